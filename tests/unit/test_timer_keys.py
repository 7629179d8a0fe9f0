"""Replace by key and cancel by key (chronoq.timer.keyed) and their index (chronoq.timer.keys), on
the embedded broker and a fake clock: outcomes, the in-flight window, crashes, retention, resends."""

from __future__ import annotations

import shutil

import pytest

from chronoq.broker.digest import derived_digest
from chronoq.broker.outgoing import OutgoingMessage
from chronoq.core import errors
from chronoq.core.clock import FakeClock
from chronoq.core.jobs import run_all_here
from chronoq.timer import keys as keyindex
from chronoq.timer.keyed import REPLACE_PROP
from chronoq.timer.keys import KeyIndex, key_hash
from chronoq.timer.recall import RecallOutcome
from tests.unit.timerkit import T0, TOPIC, crash, drain, open_broker, visible

MIN = 60_000


@pytest.fixture
def clock():
    return FakeClock(T0)


def _open(path, clock, **cfg):
    b = open_broker(path, clock, **cfg)
    if b.topics.get(TOPIC) is None:
        b.create_topic(TOPIC, 2)
    return b


def _send(b, body: bytes, due: int, replace: str | None = None, keys=None, message_id=None):
    props = {REPLACE_PROP: replace} if replace else None
    return b.send(TOPIC, body, deliver_at_ms=due, properties=props, keys=keys, message_id=message_id)


def _fire_all(b, clock, until_ms: int) -> list[bytes]:
    while clock.wall_ms() < until_ms:
        clock.advance(min(10_000, until_ms - clock.wall_ms()))
        drain(b, max_ticks=2_000)
    return sorted(m.body for m in visible(b))


# ------------------------------------------------------------------ the index (pure)
def test_the_index_finds_removes_and_grows_within_32_bytes_a_key():
    index = KeyIndex(MIN, T0)
    n = 50_000
    for i in range(n):
        assert index.add(key_hash("k", "t", f"key-{i % 20_000}"), 1000 + i, T0 + i * 7)
    assert not index.add(key_hash("k", "t", "key-5"), 1005, T0)  # already there
    index.check()
    found = {ident for ident, _start in index.candidates(key_hash("k", "t", "key-5"))}
    assert {1005, 21005, 41005} <= found  # a key held by three messages; a collision may add more
    starts = dict(index.candidates(key_hash("k", "t", "key-5")))
    assert starts[21005] == (T0 + 20_000 * 7) // MIN * MIN  # the bucket start comes back
    assert index.memory_bytes() <= 32 * n
    for i in range(0, n, 2):
        assert index.remove(key_hash("k", "t", f"key-{i % 20_000}"), 1000 + i)
    assert not index.remove(key_hash("k", "t", "key-0"), 1000)
    index.check()
    assert len(index) == n // 2
    for i in range(1, n, 2):
        assert any(ident == 1000 + i for ident, _ in index.candidates(key_hash("k", "t", f"key-{i % 20_000}")))


def test_colliding_hashes_are_told_apart_by_the_ident():
    index = KeyIndex(MIN, T0)
    h = 0xABCD_0000_1234_5678
    assert index.add(h, 7, T0) and index.add(h, 9, T0)
    assert sorted(i for i, _ in index.candidates(h)) == [7, 9]
    assert index.remove(h, 7) and not index.remove(h, 7)
    assert [i for i, _ in index.candidates(h)] == [9]
    with pytest.raises(AssertionError):
        index.add(h, 1 << keyindex.IDENT_BITS, T0)


# ------------------------------------------------------------------ replace by key
def test_a_key_held_by_thousands_moves_to_its_own_dict_and_every_call_stays_short():
    """20,000 timers of one message key made one probe run that every add walked whole: 78 s of
    event loop at 20,000. Past HOT_RUN cells the key moves to a dict (``hot``): no cell of it is
    left in the table, so the table's runs stay short for it and every other key."""
    index = KeyIndex(MIN, T0)
    hot, n = key_hash("k", "t", "tenant-1"), 20_000
    others = [key_hash("k", "t", f"o-{i}") for i in range(500)]
    for i in range(n):
        assert index.add(hot, 10 + i, T0 + i * 1_000)
        if i < len(others):
            assert index.add(others[i], 1_000_000 + i, T0)
    assert not index.add(hot, 10, T0)  # already there, in the dict
    index.check()
    assert len(index) == n + len(others) and index.hot_entries == n and index.live == len(others)
    found = dict(index.candidates(hot))
    assert len(found) == n and found[10 + 12_345] == (T0 + 12_345_000) // MIN * MIN
    assert [i for i, _ in index.candidates(others[7])] == [1_000_007]
    for i in range(n):
        assert index.remove(hot, 10 + i)
    assert not index.remove(hot, 10) and index.hot == {} and index.candidates(hot) == []
    index.check()
    assert len(index) == len(others)


def test_hot_keys_against_a_model():
    """Adds and removes over a few keys, some going hot (a low HOT_RUN), colliding hash bits
    included: the index answers what a dict would, and its invariants hold throughout."""
    import random

    rnd = random.Random(5)
    saved, keyindex.HOT_RUN = keyindex.HOT_RUN, 4
    try:
        index, model = KeyIndex(MIN, T0), {}
        # Two hashes that differ only in bits 32..47 share fingerprint and low bits: one key's
        # candidates hold the other's (the caller tells them apart by reading the record).
        hashes = [key_hash("k", "t", f"m{i}") for i in range(4)] + [0x1234_0000_0000_5678, 0x1234_FFFF_0000_5678]
        for step in range(4_000):
            which = rnd.randrange(len(hashes))
            h = hashes[which]
            ident = which * 100 + rnd.randrange(1, 60)  # an ident is one message's, under its own keys
            if rnd.random() < 0.6:
                assert index.add(h, ident, T0 + ident * MIN) == ((h, ident) not in model)
                model[(h, ident)] = (T0 + ident * MIN) // MIN * MIN  # (bucket starts come back)
            else:
                assert index.remove(h, ident) == ((h, ident) in model)
                model.pop((h, ident), None)
            if step % 97 == 0:
                index.check()
            for other in hashes:
                got = set(index.candidates(other))
                assert {(i, start) for (hh, i), start in model.items() if hh == other} <= got
        index.check()
        assert index.hot, "some key went hot"
        assert len(index) == len(model)
    finally:
        keyindex.HOT_RUN = saved


def test_a_replacing_send_answers_what_it_replaced_and_only_the_last_fires(tmp_path, clock):
    b = _open(tmp_path, clock)
    r1 = _send(b, b"a", T0 + MIN, "order-1")
    r2 = _send(b, b"b", T0 + 2 * MIN, "order-1")
    other = _send(b, b"x", T0 + MIN, "order-2")
    r3 = _send(b, b"c", T0 + 3 * MIN, "order-1")
    assert (r1.replaced, r2.replaced, other.replaced) == ("none", f"replaced:{r1.message_id}", "none")
    assert r3.replaced == f"replaced:{r2.message_id}"
    plain = b.send(TOPIC, b"p", deliver_at_ms=T0 + MIN)
    assert plain.replaced == ""  # no key, no answer
    assert _fire_all(b, clock, T0 + 4 * MIN) == [b"c", b"p", b"x"]
    b.close()


def test_the_old_one_already_due_is_answered_delivered_and_both_fire(tmp_path, clock):
    b = _open(tmp_path, clock, timer_prewrite_ms=0)
    r1 = _send(b, b"a", T0 + MIN, "k")
    clock.advance(MIN)  # due, not ticked yet: delivered all the same (the next tick makes it visible)
    r2 = _send(b, b"b", T0 + 2 * MIN, "k")
    assert r2.replaced == f"already_delivered:{r1.message_id}"
    assert _fire_all(b, clock, T0 + 3 * MIN) == [b"a", b"b"]
    # Once delivered, the key holds nothing: the next send replaces the pending one only.
    r3 = _send(b, b"c", T0 + 4 * MIN, "k")
    assert r3.replaced == "none"
    b.close()


def test_a_held_copy_already_written_counts_as_delivered(tmp_path, clock):
    b = _open(tmp_path, clock, timer_prewrite_ms=1_000)
    r1 = _send(b, b"a", T0 + MIN, "k")
    clock.advance(MIN - 500)
    drain(b)  # inside the prewrite window: its held copy is written
    r2 = _send(b, b"b", T0 + 2 * MIN, "k")
    assert r2.replaced == f"already_delivered:{r1.message_id}"
    assert _fire_all(b, clock, T0 + 3 * MIN) == [b"a", b"b"]
    b.close()


def test_the_replaced_message_is_never_claimed_while_the_replacing_record_is_in_flight(tmp_path, clock):
    b = _open(tmp_path, clock, timer_prewrite_ms=0)
    _send(b, b"a", T0 + 1_000, "k")
    # Written (page cache), not yet durable nor absorbed; the old one falls due meanwhile.
    [res] = b.write([OutgoingMessage(TOPIC, b"b", deliver_at_ms=T0 + MIN, properties={REPLACE_PROP: "k"})])
    assert res.replaced.startswith("replaced:")
    clock.advance(2_000)
    b.timer_tick()  # claims what is due: not "a" (in flight)
    b.flush()  # "b" durable and absorbed: "a" is CANCELLED
    assert _fire_all(b, clock, T0 + 2 * MIN) == [b"b"]
    b.close()


@pytest.mark.parametrize("flush_first", [False, True])
def test_a_replacing_record_survives_kill_9_before_or_after_it_is_absorbed(tmp_path, clock, flush_first):
    b = _open(tmp_path, clock, timer_prewrite_ms=0)
    _send(b, b"a", T0 + 1_000, "k")
    b.timer.checkpoint()  # "a" in its bucket file, below the cursor
    b.write([OutgoingMessage(TOPIC, b"b", deliver_at_ms=T0 + MIN, properties={REPLACE_PROP: "k"})])
    if flush_first:
        b.flush()  # absorbed (CANCELLED in a buffer, lost by the crash; the replay files it again)
    else:
        b.store.log.sync()  # durable, not dispatched nor absorbed
    crash(b)
    clock.advance(2_000)  # the old one is overdue at the restart
    b = _open(tmp_path, clock, timer_prewrite_ms=0)
    drain(b)
    assert _fire_all(b, clock, T0 + 2 * MIN) == [b"b"]
    r = _send(b, b"c", T0 + 3 * MIN, "k")  # the index rebuilt from the buckets knows "b" was delivered
    assert r.replaced == "none"
    b.close()


def test_the_index_is_rebuilt_after_a_restart(tmp_path, clock):
    b = _open(tmp_path, clock)
    r1 = _send(b, b"a", T0 + 10 * MIN, "k", keys=["order"])
    b.timer.checkpoint()
    b.close()
    b = _open(tmp_path, clock)
    r2 = _send(b, b"b", T0 + 11 * MIN, "k")
    assert r2.replaced == f"replaced:{r1.message_id}"
    crash(b)
    b = _open(tmp_path, clock)
    r3 = _send(b, b"c", T0 + 12 * MIN, "k")
    assert r3.replaced == f"replaced:{r2.message_id}"
    assert _fire_all(b, clock, T0 + 13 * MIN) == [b"c"]
    b.close()


@pytest.mark.parametrize("kill", [False, True])
def test_keyed_calls_right_after_a_restart_answer_while_the_index_is_partly_built(tmp_path, clock, kill):
    # 30 keyed messages over 15 buckets; after the restart the first keyed call begins the build
    # (nothing read yet): the answers must come from the buckets the build has not read.
    b = _open(tmp_path, clock)
    ids = {}
    for i in range(30):
        due = T0 + (10 + i // 2) * MIN + i
        ids[i] = _send(b, b"m%d" % i, due, replace=f"r{i}" if i % 3 == 0 else None, keys=[f"order-{i}"]).message_id
    b.timer.checkpoint()
    crash(b) if kill else b.close()
    b = _open(tmp_path, clock)
    got = b.cancel_by_key(TOPIC, "order-7")
    assert b.timer.keys_building and len(b.timer.keys) == 0
    assert [m for m, _ in got.cancelled] == [ids[7]]
    r = _send(b, b"new-27", T0 + 40 * MIN, replace="r27")
    assert r.replaced == f"replaced:{ids[27]}"
    # The build goes on a bucket at a time; removals meanwhile (cancels of messages in unread
    # buckets, a replace) must not come back when their buckets are read.
    b.timer.keys_step(budget=1)
    assert b.timer.keys_building
    assert [m for m, _ in b.cancel_by_key(TOPIC, "order-20").cancelled] == [ids[20]]
    r2 = _send(b, b"new-24", T0 + 41 * MIN, replace="r24")
    assert r2.replaced == f"replaced:{ids[24]}"
    steps = 1
    while b.timer.keys_building:
        b.timer.keys_step(budget=1)
        steps += 1
    assert steps == 15
    b.timer.keys.check()
    for key in ("order-7", "order-20", "order-24", "order-27"):
        assert b.cancel_by_key(TOPIC, key).cancelled == []
    assert [m for m, _ in b.cancel_by_key(TOPIC, "order-5").cancelled] == [ids[5]]
    # The index holds each pending message once a key: 30 - 5 gone, the two new ones.
    assert len(b.timer.keys) == sum(1 if i % 3 else 2 for i in ids if i not in (5, 7, 20, 24, 27)) + 2
    fired = _fire_all(b, clock, T0 + 45 * MIN)
    assert fired == sorted([b"m%d" % i for i in ids if i not in (5, 7, 20, 24, 27)] + [b"new-24", b"new-27"])
    b.close()


def test_maintenance_finishes_the_key_index_build_a_restart_begins(tmp_path, clock):
    b = _open(tmp_path, clock)
    ids = [_send(b, b"m%d" % i, T0 + (10 + i) * MIN, keys=[f"k{i}"]).message_id for i in range(3)]
    b.close()
    b = _open(tmp_path, clock)
    assert b.cancel_by_key(TOPIC, "k0").cancelled == [(ids[0], T0 + 10 * MIN)]
    assert b.timer.keys_building and len(b.timer.keys) == 0
    b.maintenance()
    assert not b.timer.keys_building and len(b.timer.keys) == 2
    assert _fire_all(b, clock, T0 + 15 * MIN) == [b"m1", b"m2"]
    b.close()


def test_two_sends_of_one_key_in_a_batch_leave_the_last(tmp_path, clock):
    b = _open(tmp_path, clock)
    msgs = [OutgoingMessage(TOPIC, body, deliver_at_ms=T0 + MIN, properties={REPLACE_PROP: "k"})
            for body in (b"a", b"b")] + [OutgoingMessage(TOPIC, b"p", deliver_at_ms=T0 + MIN)]
    r = b.send_batch(msgs)
    assert [x.replaced for x in r] == ["none", f"replaced:{r[0].message_id}", ""]
    assert _fire_all(b, clock, T0 + 2 * MIN) == [b"b", b"p"]
    b.close()


def test_a_resend_answers_what_the_original_replaced(tmp_path, clock):
    b = _open(tmp_path, clock)
    r1 = _send(b, b"a", T0 + MIN, "k")
    r2 = _send(b, b"b", T0 + MIN, "k", message_id="client-id-2")
    again = _send(b, b"b", T0 + MIN, "k", message_id="client-id-2")
    assert again.duplicate and again.replaced == r2.replaced == f"replaced:{r1.message_id}"
    assert _fire_all(b, clock, T0 + 2 * MIN) == [b"b"]
    b.close()


def test_a_replace_key_without_a_future_delivery_time_is_refused_and_writes_nothing(tmp_path, clock):
    b = _open(tmp_path, clock, timer_delay_levels="1s 5s")
    written = b.store.log.written
    with pytest.raises(errors.InvalidProperty):
        b.send(TOPIC, b"now", properties={REPLACE_PROP: "k"})
    with pytest.raises(errors.InvalidProperty):
        b.send(TOPIC, b"level", delay_level=1, properties={REPLACE_PROP: "k"})
    with pytest.raises(errors.InvalidProperty):
        b.send_batch([OutgoingMessage(TOPIC, b"ok", deliver_at_ms=T0 + MIN),
                      OutgoingMessage(TOPIC, b"bad", deliver_at_ms=T0 + MIN, properties={REPLACE_PROP: "x" * 1025})])
    assert b.store.log.written == written
    b.close()


def test_a_recalled_or_rescheduled_message_follows_its_key(tmp_path, clock):
    b = _open(tmp_path, clock)
    r1 = _send(b, b"a", T0 + MIN, "k")
    moved = b.reschedule(r1.recall_handle, T0 + 5 * MIN)
    r2 = _send(b, b"b", T0 + 2 * MIN, "k")  # replaces the moved message (same id)
    assert r2.replaced == f"replaced:{r1.message_id}"
    assert b.recall(moved.recall_handle).outcome.value == "cancelled"  # it was replaced
    assert b.recall(r2.recall_handle).outcome.value == "cancelled"
    assert _send(b, b"c", T0 + 3 * MIN, "k").replaced == "none"  # a recalled one is no longer pending
    assert _fire_all(b, clock, T0 + 6 * MIN) == [b"c"]
    b.close()


def test_replaced_and_replacing_records_rolled_past_retention_rebuild_the_same(tmp_path, clock):
    settings = dict(segment_bytes=64 * 1024, retention_max_bytes=1, timer_checkpoint_interval_ms=1000)
    b = _open(tmp_path, clock, **settings)
    r1 = _send(b, b"a", T0 + 30 * MIN, "k")
    _send(b, b"b", T0 + 40 * MIN, "k")
    for _ in range(40):  # ~10 segments after them; the timer's cursor passes them
        b.send_batch([OutgoingMessage("filler", bytes(1024)) for _ in range(16)])
        clock.advance(100)
        b.timer_tick()
        b.maintenance()
    b.retention()
    assert b.store.log.min_offset > r1.commit_offset, "retention deleted nothing"
    live = derived_digest(b)
    assert len(live["timers"]) == 1
    b.close()
    shutil.rmtree(tmp_path / "timer")
    b = _open(tmp_path, clock, **settings)
    assert derived_digest(b)["timers"] == live["timers"]
    assert _send(b, b"c", T0 + 50 * MIN, "k").replaced.startswith("replaced:")
    assert _fire_all(b, clock, T0 + 51 * MIN) == [b"c"]
    b.close()


# ------------------------------------------------------------------ cancel by key
def test_cancel_by_key_cancels_every_pending_message_with_the_key_and_lists_the_delivered(tmp_path, clock):
    b = _open(tmp_path, clock, timer_prewrite_ms=0)
    due_now = _send(b, b"due", T0 + 1_000, keys=["order-7"])
    ids = [_send(b, b"m%d" % i, T0 + (i + 2) * MIN, keys=["order-7", f"x{i}"]).message_id for i in range(3)]
    _send(b, b"other", T0 + MIN, keys=["order-8"])
    clock.advance(1_000)  # "due" is due, not ticked yet
    r = b.cancel_by_key(TOPIC, "order-7")
    assert sorted(m for m, _ in r.cancelled) == sorted(ids)
    assert r.delivered == [(due_now.message_id, T0 + 1_000)]
    assert not r.truncated
    again = b.cancel_by_key(TOPIC, "order-7")
    assert again.cancelled == [] and again.delivered == [(due_now.message_id, T0 + 1_000)]
    assert _fire_all(b, clock, T0 + 10 * MIN) == [b"due", b"other"]
    assert b.cancel_by_key(TOPIC, "order-7").delivered == []  # delivered: forgotten
    b.close()


def test_cancel_by_key_after_a_kill_9_uses_the_rebuilt_index(tmp_path, clock):
    b = _open(tmp_path, clock)
    ids = [_send(b, b"m%d" % i, T0 + (i + 1) * MIN, keys=["k"]).message_id for i in range(5)]
    b.timer.checkpoint()
    recalled = b.recall(_send(b, b"r", T0 + MIN, keys=["k"]).recall_handle)
    assert recalled.outcome.value == "cancelled"
    crash(b)
    b = _open(tmp_path, clock)
    r = b.cancel_by_key(TOPIC, "k")
    assert sorted(m for m, _ in r.cancelled) == sorted(ids)  # not the recalled one
    crash(b)
    b = _open(tmp_path, clock)
    assert b.cancel_by_key(TOPIC, "k").cancelled == []  # the cancellations were durable
    assert _fire_all(b, clock, T0 + 10 * MIN) == []
    b.close()


def test_cancel_by_key_refuses_what_is_not_a_key(tmp_path, clock):
    b = _open(tmp_path, clock)
    with pytest.raises(errors.ClientError):
        b.cancel_by_key(TOPIC, "")
    with pytest.raises(errors.ClientError):
        b.cancel_by_key("", "k")
    # A topic that does not exist (misspelt?) or is not a user topic: not "nothing pending there".
    with pytest.raises(errors.TopicNotFound, match="nowhere"):
        b.cancel_by_key("nowhere", "k")
    with pytest.raises(errors.InvalidTopic):
        b.cancel_by_key("bad topic!", "k")
    with pytest.raises(errors.ReservedName):
        b.cancel_by_key("%DLQ%x", "k")
    assert b.cancel_by_key(TOPIC, "k").cancelled == []
    b.close()


def test_a_finished_bucket_whose_file_awaits_deletion_holds_no_key(tmp_path, clock):
    # The server fsyncs the .done files on the committer's thread (``attach_files_syncer``): a
    # finished bucket's file stays until its .done is durable, without the entries that were only
    # buffered when it finished (the CANCELLED of a replaced message). The key index's build (begun
    # by a restart, that bucket not read yet) must not take that file for pending messages.
    b = _open(tmp_path, clock)
    r1 = _send(b, b"a", T0 + 10 * MIN + 500, "k")
    b.timer.checkpoint()  # its MESSAGE entry in the bucket file
    b.close()
    b = _open(tmp_path, clock)
    b.timer.attach_files_syncer(lambda: None)  # the committer never gets to the fsyncs
    r2 = _send(b, b"b", T0 + 10 * MIN + 100, "k")
    assert r2.replaced == f"replaced:{r1.message_id}"
    assert _fire_all(b, clock, T0 + 12 * MIN) == [b"b"]
    assert b.timer.keys_building and b.timer.buckets_finished == 1
    r3 = _send(b, b"c", T0 + 20 * MIN, "k")
    assert r3.replaced == "none"  # b was delivered (the index forgot it), a was replaced
    assert b.recall(r1.recall_handle).outcome == RecallOutcome.CANCELLED  # (its .done says; not its file)
    b.timer.attach_files_syncer(None)
    assert _fire_all(b, clock, T0 + 21 * MIN) == [b"b", b"c"]
    b.close()


@pytest.mark.parametrize("blocking", [False, True])
def test_no_checkpoint_completes_while_a_finished_bucket_file_awaits_deletion(tmp_path, clock, blocking):
    # That file lacks the entries buffered at the finish (p's DISPATCHED, a's CANCELLED): a kill -9
    # after a checkpoint past their records would load it as a live bucket and deliver p twice, a.
    b = _open(tmp_path, clock)
    r1 = _send(b, b"a", T0 + 10 * MIN + 500, "k")
    _send(b, b"p", T0 + 10 * MIN + 700)
    b.timer.checkpoint()  # a's and p's MESSAGE entries in the bucket file
    b.close()
    b = _open(tmp_path, clock)
    b.timer.attach_files_syncer(lambda: None)  # the committer gets to the fsyncs when told below
    assert _send(b, b"b", T0 + 10 * MIN + 100, "k").replaced == f"replaced:{r1.message_id}"
    assert _fire_all(b, clock, T0 + 12 * MIN) == [b"b", b"p"]
    assert b.timer.buckets_finished == 1 and b.timer.files.finishing
    if blocking:
        b.timer.checkpoint()  # (the .done fsync in place, the file deleted, then the checkpoint)
    else:
        clock.advance(MIN)
        assert b.timer.maintenance_job() is None  # waits for the file's deletion
        b.timer.files.sync_side()  # (the committer's thread)
        b.timer.files_synced()
        b.timer_tick()  # deletes it
        job = b.timer.maintenance_job()
        assert job is not None
        job.run_here()
    assert not b.timer.files.finishing
    crash(b)
    b = _open(tmp_path, clock)
    assert _fire_all(b, clock, T0 + 15 * MIN) == [b"b", b"p"]
    b.close()


def test_a_build_step_with_a_deadline_reads_buckets_until_it_passes_and_one_at_least(tmp_path, clock):
    """The server reads the key index's build in slices of time (``keys_step(deadline_ns=)``,
    chronoq.server.runtime): a step whose deadline has passed still reads one bucket, so the build
    always ends; one with time left reads on, within its byte budget; maintenance without
    ``build_keys`` does not step."""
    b = _open(tmp_path, clock)
    for i in range(12):  # 12 buckets, one keyed message each
        _send(b, b"m%d" % i, T0 + (10 + i) * MIN, keys=[f"k{i}"])
    b.close()
    b = _open(tmp_path, clock)
    assert b.cancel_by_key(TOPIC, "k0").cancelled  # begins the build
    timer = b.timer
    assert timer.keys_to_read and len(timer.keys) == 0
    run_all_here(b.maintenance_jobs(build_keys=False))
    assert timer.keys_to_read and len(timer.keys) == 0
    now = clock.monotonic_ns()
    # Passed: one bucket a step, the earliest first (k0's: cancelled, nothing to index).
    assert timer.keys_step(deadline_ns=now) > 0 and len(timer.keys) == 0 and timer.keys_to_read
    assert timer.keys_step(deadline_ns=now - 1) > 0 and len(timer.keys) == 1
    assert timer.keys_step(deadline_ns=now) > 0 and len(timer.keys) == 2
    assert timer.keys_step(deadline_ns=now + 1) > 0  # time left (the fake clock stands still): the rest
    assert not timer.keys_to_read and not timer.keys_building and len(timer.keys) == 11
    timer.keys.check()
    b.close()
