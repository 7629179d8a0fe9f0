"""The timer's kept pending counts (the ``chronoq_timer_pending`` figures a scrape reads without
a recount) against a fresh count: after sends, recalls, tombstones, absorb passes that fail,
crashes, and the horizon cache warmed a bucket at a time."""

from __future__ import annotations

import random

from metricskit import INVISIBLE_MS, T0, TICKS_MAX, open_broker, scrape, served, value

from chronoq.broker.broker import OutgoingMessage
from chronoq.core.clock import FakeClock
from chronoq.timer import copies
from chronoq.timer.buckets import LOADED


def _watch_recounts(timer, recounted: list) -> None:
    """Note each bucket ``timer`` counts from its file and buffer (``_pending_in``) in ``recounted``."""
    fresh = timer._pending_in

    def counting(start):
        recounted.append(start)
        return fresh(start)
    timer._pending_in = counting


def _assert_kept_counts_exact(timer, where: str) -> None:
    """Every kept count of a bucket not loaded equals a count of that bucket from nothing."""
    for start, hit in list(timer._horizon_cache.items()):
        b = timer.buckets.get(start)
        if (b is None or b.state != LOADED) and (b is not None or start in timer._in_heap):
            assert hit == type(timer)._pending_in(timer, start), f"{where}: bucket {start}"


def _control_records(broker, lo: int) -> list[tuple[int, bytes]]:
    """(offset, bytes) of the recall records (recalls, cancels by key) written from ``lo`` on."""
    return [(offset, raw) for offset, _h, raw in broker.store.scan(lo) if copies.PROP_TIMER_CANCEL.encode() in raw]


def test_cached_pending_counts_equal_a_fresh_count(tmp_path):
    """pending_by_horizon keeps per-bucket counts as entries arrive; after every kind of change
    (new entries buffered, buffers written, recalls, reschedules, replacing sends, cancels by
    key, a recall record absorbed again, deliveries, finished buckets, a restart) every kept
    count equals one computed from nothing, and so does the answer; counts kept through plain
    sends and through tombstones (recall, reschedule, replace, cancel by key) are served without
    a recount from the files."""
    seed = 20261121
    rng = random.Random(seed)
    clock = FakeClock(T0)
    broker = open_broker(tmp_path / "data", clock, timer_bucket_ms=10_000, timer_preload_ms=20_000)
    horizons = (0, 15_000, 60_000, 600_000, 1 << 62)
    handles, controls, kept, recounted = [], [], 0, []
    # Per kind of tombstone: kept counts it lowered that the next scrape served without a recount.
    lowered = {"recall": 0, "reschedule": 0, "replace": 0, "cancel": 0, "again": 0}
    _watch_recounts(broker.timer, recounted)
    try:
        for step in range(200):
            action = rng.random()
            now = clock.wall_ms()
            before, written, kind = dict(broker.timer._horizon_cache), broker.store.log.written, None
            if action < 0.3:
                results = broker.send_batch([OutgoingMessage("t", b"x", deliver_at_ms=now + rng.randrange(1, 900_000))
                                             for _ in range(rng.randrange(1, 20))])
                handles += [r.recall_handle for r in results]
                kept += sum(1 for start, hit in broker.timer._horizon_cache.items() if before.get(start, hit) != hit)
            elif action < 0.4:
                key = f"k{rng.randrange(4)}"
                props = {"CHRONOQ_REPLACE_KEY": key} if rng.random() < 0.7 else {}
                results = broker.send_batch([OutgoingMessage("t", b"r", keys=[key], properties=props,
                                                             deliver_at_ms=now + rng.randrange(1, 900_000))])
                handles += [r.recall_handle for r in results]
                kind = "replace"
            elif action < 0.45:
                broker.cancel_by_key("t", f"k{rng.randrange(4)}")
                kind = "cancel"
            elif action < 0.5 and handles:
                broker.reschedule(handles.pop(rng.randrange(len(handles))), now + rng.randrange(1, 900_000))
                kind = "reschedule"
            elif action < 0.6 and handles:
                broker.recall(handles.pop(rng.randrange(len(handles))))
                kind = "recall"
            elif action < 0.65 and controls:
                # Absorbed again (as after a failed absorb pass): its target is cancelled already.
                broker.timer._absorb_record(*controls[rng.randrange(len(controls))])
                kind = "again"
            elif action < 0.8:
                clock.advance(rng.randrange(1, 60_000))
                for _ in range(TICKS_MAX):
                    if not broker.timer_tick():
                        break
            elif action < 0.95:
                broker.maintenance()
            else:
                broker.close()
                broker = open_broker(tmp_path / "data", clock, timer_bucket_ms=10_000, timer_preload_ms=20_000)
                _watch_recounts(broker.timer, recounted)
            if kind in ("recall", "cancel"):
                controls += _control_records(broker, written)
            where = f"seed {seed}, step {step}"
            _assert_kept_counts_exact(broker.timer, where)
            after = dict(broker.timer._horizon_cache)
            del recounted[:]
            cached = broker.timer.pending_by_horizon(horizons)
            if kind is not None:  # a MESSAGE only raises a count: a lower one followed a tombstone
                lowered[kind] += sum(1 for start, hit in after.items()
                                     if start in before and hit[0] < before[start][0] and start not in recounted)
            kept_now = dict(broker.timer._horizon_cache)
            broker.timer._horizon_cache.clear()
            assert cached == broker.timer.pending_by_horizon(horizons), where
            broker.timer._horizon_cache.update(kept_now)  # go on from the kept counts
        assert cached[-1] > 0  # the walk left something pending (the test looked at real counts)
        assert kept > 0  # some counts followed new sends without a recount
        assert lowered["again"] == 0  # a tombstone absorbed twice proves nothing
        del lowered["again"]
        assert all(lowered.values()), lowered  # and some followed each kind of tombstone
    finally:
        broker.close()


def test_a_fifo_forward_to_the_dlq_is_a_dead_letter_not_a_revive(tmp_path):
    clock, broker, pop, metrics = served(tmp_path)
    try:
        pop.set_group("f", fifo=True)
        broker.send("orders", b"poison", message_group="order-7")
        got = pop.receive("f", "orders", max_messages=1, invisible_ms=INVISIBLE_MS)
        pop.forward_to_dlq("f", "orders", got[0].receipt_handle)
        samples = scrape(metrics)
        assert value(samples, "chronoq_messages_dead_lettered_total", group="f") == 1
        assert value(samples, "chronoq_dlq_messages", group="f") == 1
        assert ("chronoq_messages_revived_total", frozenset({("group", "f")})) not in samples
        assert value(samples, "chronoq_inflight_messages", topic="orders", group="f") == 0
    finally:
        pop.close()
        broker.close()


def test_a_kept_count_follows_only_entries_it_can_prove_new(tmp_path):
    """count_appended adds MESSAGE entries naming an ident above every ident seen; a tombstone or
    an ident not above (a replayed duplicate, a message its cancel reached first) drops the
    count, so the next ask reads the bucket again."""
    from chronoq.timer import schedlog
    clock = FakeClock(T0)
    broker = open_broker(tmp_path / "data", clock)
    try:
        timer, start = broker.timer, 123_000
        payload = (40).to_bytes(4, "little") + b"r" * 36

        def message(ident):
            return schedlog.encode_entry(schedlog.MESSAGE, ident, start + 5, 0, payload)

        timer._horizon_cache[start] = (5, 100)
        timer.count_appended(start, message(101) + message(150))
        assert timer._horizon_cache[start] == (7, 150)
        timer.count_appended(start, message(150))  # the same ident again
        assert start not in timer._horizon_cache
        timer._horizon_cache[start] = (5, 100)
        timer.count_appended(start, message(120) + message(90))  # the second may have been cancelled
        assert start not in timer._horizon_cache
        timer._horizon_cache[start] = (5, 100)
        timer.count_appended(start, schedlog.encode_entry(schedlog.CANCELLED, 101, start + 5, 200))
        assert start not in timer._horizon_cache
        timer.count_appended(start, message(300))  # nothing kept: nothing to follow
        assert start not in timer._horizon_cache
    finally:
        broker.close()


def test_a_kept_count_follows_a_tombstone_only_with_proof(tmp_path):
    """A CANCELLED/MOVED entry lowers a kept count by one when its appender proved its target
    pending in that bucket (``pending_target``), once; without proof, for another ident, for an
    ident the count has not seen, twice, or for a DISPATCHED entry, the count is dropped."""
    from chronoq.timer import schedlog
    clock = FakeClock(T0)
    broker = open_broker(tmp_path / "data", clock)
    try:
        timer, start = broker.timer, 123_000
        payload = (40).to_bytes(4, "little") + b"r" * 36

        def entry(kind, ident):
            return schedlog.encode_entry(kind, ident, start + 5, 0 if kind == schedlog.MESSAGE else 500,
                                         payload if kind == schedlog.MESSAGE else b"")

        cancel, moved = (lambda ident: entry(schedlog.CANCELLED, ident)), (lambda ident: entry(schedlog.MOVED, ident))
        timer._horizon_cache[start] = (5, 100)
        timer.count_appended(start, cancel(90), pending_target=90)
        assert timer._horizon_cache[start] == (4, 100)
        timer.count_appended(start, moved(100), pending_target=100)
        assert timer._horizon_cache[start] == (3, 100)
        timer.count_appended(start, cancel(80) + entry(schedlog.MESSAGE, 130), pending_target=80)
        assert timer._horizon_cache[start] == (3, 130)
        for entries, target, why in ((cancel(90), None, "no proof: its state is unknown"),
                                     (cancel(90), 80, "the proof is for another message"),
                                     (cancel(90) + cancel(90), 90, "a second tombstone for it"),
                                     (cancel(90) + moved(90), 90, "a second tombstone for it"),
                                     (cancel(140), 140, "above the top: never counted here"),
                                     (entry(schedlog.DISPATCHED, 90), 90, "not a tombstone")):
            timer._horizon_cache[start] = (5, 130)
            timer.count_appended(start, entries, pending_target=target)
            assert start not in timer._horizon_cache, why
        timer._horizon_cache[start] = (0, 130)
        timer.count_appended(start, cancel(90), pending_target=90)  # nothing counted to take it from
        assert start not in timer._horizon_cache
    finally:
        broker.close()


def test_recall_like_records_lower_kept_counts_without_a_recount(tmp_path):
    """Through the broker: a recall, a cancel by key, a replacing send and a reschedule (to
    another bucket) keep the counts of the buckets they touch, read from no file; the same recall
    record absorbed again (a failed pass retried, a replay) drops the count, and a second recall
    of the same handle writes nothing and changes nothing."""
    clock = FakeClock(T0)
    broker = open_broker(tmp_path / "data", clock, timer_bucket_ms=10_000, timer_preload_ms=20_000)
    try:
        timer, recounted = broker.timer, []
        far, other = T0 + 600_000, T0 + 700_000
        a, b = far - far % 10_000, other - other % 10_000
        sent = broker.send_batch([OutgoingMessage("t", b"x%d" % i, keys=["k"] if i == 0 else [],
                                                  properties={"CHRONOQ_REPLACE_KEY": "r"} if i == 1 else {},
                                                  deliver_at_ms=far + i) for i in range(6)])
        broker.send("t", b"y", deliver_at_ms=other)
        broker.maintenance()  # the buffers written: the counts below are of files
        timer._horizon_cache.clear()
        assert timer.pending_by_horizon((1 << 62,)) == [7]
        _watch_recounts(timer, recounted)

        def counts():
            del recounted[:]
            total = timer.pending_by_horizon((1 << 62,))[0]
            assert not recounted, recounted
            _assert_kept_counts_exact(timer, "now")
            return total, timer._horizon_cache[a][0], timer._horizon_cache[b][0]

        written = broker.store.log.written
        assert broker.recall(sent[2].recall_handle).outcome.value == "cancelled"
        assert counts() == (6, 5, 1)
        [control] = _control_records(broker, written)
        log_end = broker.store.log.written
        assert broker.recall(sent[2].recall_handle).outcome.value == "cancelled"  # again: nothing written
        assert broker.store.log.written == log_end
        assert counts() == (6, 5, 1)
        assert len(broker.cancel_by_key("t", "k").cancelled) == 1
        assert counts() == (5, 4, 1)
        replacing = broker.send("t", b"z", properties={"CHRONOQ_REPLACE_KEY": "r"}, deliver_at_ms=other + 1)
        assert replacing.replaced.startswith("replaced:")
        assert counts() == (5, 3, 2)
        assert broker.reschedule(sent[3].recall_handle, other + 2).outcome.value == "rescheduled"
        assert counts() == (5, 2, 3)

        timer._absorb_record(*control)  # again: its mark is gone, so nothing proves its target pending
        assert a not in timer._horizon_cache
        del recounted[:]
        assert timer.pending_by_horizon((1 << 62,)) == [5]
        assert recounted == [a] and timer._horizon_cache[a][0] == 2

        # A recall record this process did not write (a foreign tool's), naming a pending message
        # of bucket a in bucket b, absorbed while the message is in flight for a real recall:
        # that mark is the real record's, it proves nothing about bucket b.
        target = sent[4]
        broker.store.write([copies.control(copies.PROP_TIMER_CANCEL, f"{b}.{target.commit_offset}",
                                           target.message_id.encode(), far + 4, clock.wall_ms())])
        answer = broker.timer_recall(target.recall_handle)
        broker.durable(answer.ticket)
        assert broker.timer_answered(answer).outcome.value == "cancelled"
        del recounted[:]
        assert timer.pending_by_horizon((1 << 62,)) == [4]
        _assert_kept_counts_exact(timer, "after a foreign record")
        assert b in recounted  # dropped, not lowered
    finally:
        broker.close()


def test_an_absorb_pass_that_fails_after_a_proven_tombstone_drops_the_count(tmp_path):
    """A pass that fails after a tombstone was appended is retried whole, with its target still
    marked in flight: the tombstone comes again with the same proof, so the first drops the count."""
    clock = FakeClock(T0)
    broker = open_broker(tmp_path / "data", clock, timer_bucket_ms=10_000, timer_preload_ms=20_000)
    try:
        timer, far = broker.timer, T0 + 600_000
        sent = broker.send_batch([OutgoingMessage("t", b"x", deliver_at_ms=far + i) for i in range(3)])
        assert timer.pending_by_horizon((1 << 62,)) == [3]
        after_append, failures = timer._after_append, []

        def failing_once(b, entry):
            after_append(b, entry)
            if not failures:
                failures.append(b.start)
                raise OSError("injected")
        timer._after_append = failing_once
        answer = broker.timer_recall(sent[0].recall_handle)
        broker.durable(answer.ticket)  # its absorb fails (logged) and stays queued
        assert failures and timer._unabsorbed
        timer.absorb_dispatched()  # retried: the same CANCELLED entry again, its mark still set
        assert not timer._unabsorbed
        _assert_kept_counts_exact(timer, "after the retry")
        assert timer.pending_by_horizon((1 << 62,)) == [2]
    finally:
        broker.close()


def test_maintenance_warms_the_horizon_cache_a_bucket_at_a_time(tmp_path):
    """After a restart the schedule files are counted in small steps, not by the first scrape."""
    clock = FakeClock(T0)
    broker = open_broker(tmp_path / "data", clock, timer_bucket_ms=10_000, timer_preload_ms=20_000)
    now = clock.wall_ms()
    broker.send_batch([OutgoingMessage("t", b"x", deliver_at_ms=now + 60_000 + 10_000 * i + 7)
                       for i in range(12) for _ in range(i + 1)])
    broker.close()
    broker = open_broker(tmp_path / "data", clock, timer_bucket_ms=10_000, timer_preload_ms=20_000)
    try:
        timer = broker.timer
        timer._horizon_cache.clear()
        timer._horizon_warm, timer._warm_todo = False, None
        calls = 0
        while not timer.warm_horizon_cache(0):  # a zero budget: one bucket per call
            calls += 1
            assert calls <= 100
        assert calls + 1 >= 12 and len(timer._horizon_cache) >= 12
        horizons = (0, 60_000, 120_000, 1 << 62)
        warmed = timer.pending_by_horizon(horizons)
        timer._horizon_cache.clear()
        assert warmed == timer.pending_by_horizon(horizons)
        assert warmed[-1] == sum(range(1, 13))
    finally:
        broker.close()
