"""Timer copies written ahead of their due time (``timer_prewrite_ms``), held until it.

The runtime's way (a tick, then the committer's fsync for its ticket) on a fake clock: a copy is
written and made durable before it is due, stays hidden (and keeps what follows it in its queue
hidden) until the tick at its due instant releases it, and a restart in between keeps it hidden
and delivers it once. Recall inside the window answers ALREADY_DELIVERED and keeps that promise.
"""

from __future__ import annotations

import pytest
from timerkit import T0, TOPIC, crash, open_broker, visible

from chronoq.broker import trace
from chronoq.broker.outgoing import OutgoingMessage
from chronoq.core import errors
from chronoq.core.clock import FakeClock
from chronoq.store import record
from chronoq.timer.service import RecallOutcome

LEAD = 50


@pytest.fixture
def clock():
    return FakeClock(T0)


def _tick_and_sync(b) -> int:
    tick = b.timer_step()
    done = tick.visible
    if tick.ticket:
        done += b.timer_synced(b.flush())
    return done


def test_a_copy_is_durable_before_its_due_time_and_visible_exactly_at_it(tmp_path, clock):
    b = open_broker(tmp_path, clock, timer_prewrite_ms=LEAD)
    b.create_topic(TOPIC, 1)
    due = T0 + 1_000
    b.send(TOPIC, b"held", deliver_at_ms=due)
    _tick_and_sync(b)  # (loads the bucket)
    # Claiming starts half the lead ahead and takes everything due within the lead.
    assert b.timer_next_deadline_ms() == due - LEAD // 2
    clock.advance(1_000 - LEAD // 2)
    assert _tick_and_sync(b) == 0
    assert b.store.log.synced == b.store.log.written  # the copy is on disk already
    assert visible(b) == [] and b.timer.histogram.count == 0
    assert b.timer_next_deadline_ms() == due  # the release
    clock.advance(LEAD // 2 - 1)
    _tick_and_sync(b)
    assert visible(b) == []  # never early
    clock.advance(1)
    assert b.timer_step().visible == 1  # no fsync needed at the due instant
    [m] = visible(b)
    assert m.body == b"held" and m.stored_ms == due and m.flags & record.FLAG_HELD
    assert b.timer.histogram.count == 1 and b.timer.histogram.max_ms == 0 and b.timer.histogram.early == 0
    b.close()


def test_a_hold_keeps_what_follows_it_in_its_queue_hidden_until_its_due_time(tmp_path, clock):
    """Queue offsets are dense and in log order: a message sent behind a held copy waits for it
    (at most the lead), in every reader: POP, reads by offset, bounds."""
    b = open_broker(tmp_path, clock, timer_prewrite_ms=LEAD)
    b.create_topic(TOPIC, 1)
    due = T0 + 1_000
    b.send(TOPIC, b"held", deliver_at_ms=due, queue_id=0)
    clock.advance(1_000 - 20)
    _tick_and_sync(b)
    b.send(TOPIC, b"now", queue_id=0)  # an immediate message behind the hold
    assert visible(b) == [] and b.store.bounds(TOPIC, 0) == (0, 0)
    clock.advance(20)
    _tick_and_sync(b)
    assert [m.body for m in visible(b)] == [b"held", b"now"]
    assert b.store.bounds(TOPIC, 0) == (0, 2)
    b.close()


def test_a_crash_between_prewrite_and_due_time_keeps_the_copy_hidden_then_delivers_it_once(tmp_path, clock):
    b = open_broker(tmp_path, clock, timer_prewrite_ms=LEAD)
    b.create_topic(TOPIC, 1)
    due = T0 + 1_000
    b.send(TOPIC, b"held", deliver_at_ms=due)
    b.send(TOPIC, b"later", deliver_at_ms=due + 5_000)
    clock.advance(1_000 - LEAD // 2)
    _tick_and_sync(b)
    crash(b)
    b = open_broker(tmp_path, clock, timer_prewrite_ms=LEAD)
    assert visible(b) == []  # restored hold: the copy is in the log and its queue, still hidden
    assert b.store.next_held_ms() == due and b.timer_next_deadline_ms() <= due
    clock.advance(LEAD // 2)
    _tick_and_sync(b)
    assert [m.body for m in visible(b)] == [b"held"]
    clock.advance(5_000)
    _tick_and_sync(b)
    _tick_and_sync(b)
    assert [m.body for m in visible(b)] == [b"held", b"later"]  # once each
    b.close()
    b = open_broker(tmp_path, clock, timer_prewrite_ms=LEAD)  # and a clean restart changes nothing
    assert [m.body for m in visible(b)] == [b"held", b"later"]
    b.close()


def test_a_crash_before_the_copy_is_durable_writes_it_again_once(tmp_path, clock):
    b = open_broker(tmp_path, clock, timer_prewrite_ms=LEAD)
    b.create_topic(TOPIC, 1)
    b.send(TOPIC, b"held", deliver_at_ms=T0 + 1_000)
    clock.advance(1_000 - LEAD // 2)
    b.timer_step()  # written to the page cache, no fsync
    assert b.store.log.written > b.store.log.synced
    crash(b)  # (the page cache survives a kill -9, so the replay may find the copy: still once)
    b = open_broker(tmp_path, clock, timer_prewrite_ms=LEAD)
    clock.advance(LEAD // 2)
    for _ in range(3):
        _tick_and_sync(b)
    assert [m.body for m in visible(b)] == [b"held"]
    b.close()


def test_recall_inside_the_prewrite_window_answers_already_delivered_and_keeps_it(tmp_path, clock):
    b = open_broker(tmp_path, clock, timer_prewrite_ms=LEAD)
    b.create_topic(TOPIC, 1)
    early = b.send(TOPIC, b"recalled", deliver_at_ms=T0 + 1_000)
    late = b.send(TOPIC, b"kept", deliver_at_ms=T0 + 2_000)
    clock.advance(1_000 - LEAD - 1)
    _tick_and_sync(b)
    assert b.recall(early.recall_handle).outcome is RecallOutcome.CANCELLED  # before the window
    clock.advance(1_026)
    _tick_and_sync(b)  # "kept" is written, held: 25 ms to go
    got = b.recall(late.recall_handle)
    assert got.outcome is RecallOutcome.ALREADY_DELIVERED and "already written" in got.detail
    clock.advance(LEAD + 1)
    _tick_and_sync(b)
    assert [m.body for m in visible(b)] == [b"kept"]
    b.close()


def test_no_prewrite_writes_copies_at_their_due_time(tmp_path, clock):
    b = open_broker(tmp_path, clock, timer_prewrite_ms=0)
    b.create_topic(TOPIC, 1)
    b.send(TOPIC, b"m", deliver_at_ms=T0 + 1_000)
    _tick_and_sync(b)
    assert b.timer_next_deadline_ms() == T0 + 1_000
    clock.advance(1_000)
    assert _tick_and_sync(b) == 1
    [m] = visible(b)
    assert not m.flags & record.FLAG_HELD and not b.store.queues[(TOPIC, 0)].held
    b.close()


def test_record_many_matches_one_at_a_time():
    from chronoq.timer.stats import LatenessHistogram

    dues = [95, 100, 100, 100, 103, 250, 99, 120]  # 250: early (before the visible time 200)
    one, many = LatenessHistogram(), LatenessHistogram()
    for due in dues:
        one.record(200 - due)
    many.record_many(200, dues)
    assert many.snapshot() == one.snapshot() and many.early == 1


def test_holds_are_restored_across_consume_queue_files(tmp_path, clock):
    """Restoring holds walks back over a queue's newest entries, a file at a time."""
    b = open_broker(tmp_path, clock, timer_prewrite_ms=LEAD, cq_entries_per_file=4)
    b.create_topic(TOPIC, 1)
    for i in range(6):
        b.send(TOPIC, f"n{i}".encode(), queue_id=0)  # offsets 0..5: files 0 and 1
    b.send(TOPIC, b"held", deliver_at_ms=T0 + 1_000, queue_id=0)
    clock.advance(1_000 - LEAD // 2)
    _tick_and_sync(b)  # the held copy at offset 6
    for i in range(3):
        b.send(TOPIC, f"m{i}".encode(), queue_id=0)  # offsets 7..9: into file 2
    crash(b)
    b = open_broker(tmp_path, clock, timer_prewrite_ms=LEAD, cq_entries_per_file=4)
    assert [m.body for m in visible(b)] == [f"n{i}".encode() for i in range(6)]
    assert list(b.store.queues[(TOPIC, 0)].held) == [(6, T0 + 1_000)]
    clock.advance(LEAD // 2)
    _tick_and_sync(b)
    assert [m.body for m in visible(b)] == [*(f"n{i}".encode() for i in range(6)), b"held",
                                            *(f"m{i}".encode() for i in range(3))]
    b.close()


def test_a_copy_due_at_t_is_visible_to_a_receive_after_the_timer_tick_at_t_and_never_before(tmp_path, clock):
    """A receive does not release timer holds: the timer's tick does, and the runtime's timer loop
    wakes for it because ``timer_next_deadline_ms`` includes the earliest hold. Driven as that loop
    does (tick whenever the reported deadline has come), a POP receive every millisecond, once
    before that millisecond's tick and once after it, sees each copy first after the tick at its
    due time: never earlier, never later."""
    from chronoq.pop.service import PopService

    b = open_broker(tmp_path, clock, timer_prewrite_ms=LEAD)
    b.create_topic(TOPIC, 1)
    first, second = T0 + 1_000, T0 + 1_010
    b.send(TOPIC, b"first", deliver_at_ms=first, queue_id=0)
    b.send(TOPIC, b"second", deliver_at_ms=second, queue_id=0)
    pop = PopService(b, clock)
    _tick_and_sync(b)
    seen: dict[bytes, tuple[int, str]] = {}  # body -> (ms, "before"/"after" that ms's tick)
    ticks = []

    def receive(when: str) -> None:
        for p in pop.receive("g", TOPIC, max_messages=8, invisible_ms=60_000):
            assert p.message.deliver_at_ms <= clock.wall_ms(), "delivered early"
            seen.setdefault(p.message.body, (clock.wall_ms(), when))

    while clock.wall_ms() < second + 20:
        clock.advance(1)
        now = clock.wall_ms()
        receive("before")
        deadline = b.timer_next_deadline_ms()
        if deadline is not None and deadline <= now:
            _tick_and_sync(b)
            ticks.append(now)
        receive("after")
    assert b.store.log.synced == b.store.log.written
    assert seen == {b"first": (first, "after"), b"second": (second, "after")}
    assert first in ticks and second in ticks  # the deadline named each hold's due time
    assert b.timer.histogram.count == 2 and b.timer.histogram.max_ms == 0 and b.timer.histogram.early == 0
    pop.close()
    b.close()


# ----------------------------------------------------------------------------- the burst lead
BURST = 1_000  # the default timer_burst_lead_ms


def test_a_burst_is_written_ahead_by_the_burst_lead_and_each_copy_is_visible_exactly_at_its_due_time(
        tmp_path, clock):
    """Timers due faster than the burst rate are claimed from the burst lead ahead (instead of
    prewrite_ms): every copy is written and on disk before its due time, and none is readable
    before it, in any queue; the tick at each due instant releases it."""
    b = open_broker(tmp_path, clock, timer_prewrite_ms=LEAD, timer_burst_lead_ms=BURST)
    b.timer.burst_due_min = 100  # (the real threshold, 20,000 due per second, scaled down)
    b.create_topic(TOPIC, 4)
    first = T0 + 5_000
    dues = [first + i for i in range(300)]  # 300 due within 300 ms
    for i, due in enumerate(dues):
        b.send(TOPIC, f"m{i}".encode(), deliver_at_ms=due, queue_id=i % 4)
    _tick_and_sync(b)
    assert b.timer_next_deadline_ms() == first - BURST
    clock.advance(first - BURST - T0)
    _tick_and_sync(b)
    assert b.timer.burst_claims >= 1 and b.store.log.synced == b.store.log.written
    assert visible(b) == []
    while clock.wall_ms() < dues[-1]:
        clock.advance(1)
        _tick_and_sync(b)
        now = clock.wall_ms()
        seen = visible(b)
        assert all(m.deliver_at_ms <= now for m in seen)  # never early
        assert len(seen) == sum(1 for d in dues if d <= now)  # and each at its due instant
    seen = visible(b)
    assert sorted(m.body for m in seen) == sorted(f"m{i}".encode() for i in range(300))
    # Every copy was written ahead (held, stamped with its due time), none after it fell due.
    assert all(m.flags & record.FLAG_HELD and m.stored_ms == m.deliver_at_ms for m in seen)
    assert b.timer.histogram.max_ms == 0 and b.timer.histogram.early == 0
    b.close()


def test_timers_below_the_burst_rate_keep_the_short_lead(tmp_path, clock):
    b = open_broker(tmp_path, clock, timer_prewrite_ms=LEAD, timer_burst_lead_ms=BURST)
    b.timer.burst_due_min = 100
    b.create_topic(TOPIC, 1)
    first = T0 + 5_000
    for i in range(99):  # one short of a burst within the lead
        b.send(TOPIC, b"x", deliver_at_ms=first + i * 10)
    _tick_and_sync(b)
    assert b.timer_next_deadline_ms() == first - LEAD // 2
    clock.advance(first - LEAD // 2 - T0)
    _tick_and_sync(b)
    assert b.timer.burst_claims == 0
    b.close()


@pytest.mark.parametrize("prewrite, lead", [(0, BURST), (LEAD, 0), (LEAD, LEAD)])
def test_no_burst_lead_without_holds_or_when_it_is_off(tmp_path, clock, prewrite, lead):
    """prewrite 0 means no copy is ever written ahead (hence never held), and a burst lead of 0
    or not longer than prewrite_ms changes nothing."""
    b = open_broker(tmp_path, clock, timer_prewrite_ms=prewrite, timer_burst_lead_ms=lead)
    b.timer.burst_due_min = 1
    b.create_topic(TOPIC, 1)
    first = T0 + 5_000
    for i in range(10):
        b.send(TOPIC, b"x", deliver_at_ms=first + i)
    _tick_and_sync(b)
    assert b.timer_next_deadline_ms() == first - prewrite // 2
    b.close()


@pytest.mark.parametrize("bad", [-1, 1_001])
def test_the_burst_lead_is_checked(tmp_path, bad):
    with pytest.raises(errors.ClientError, match="timer_burst_lead_ms"):
        open_broker(tmp_path, FakeClock(T0), timer_burst_lead_ms=bad)


def test_a_burst_released_at_once_is_visible_at_once_and_counted_in_runs_at_its_release_time(
        tmp_path, clock, monkeypatch):
    """A burst due at one instant: every copy visible at the due instant, but counted (key index,
    lateness, trace) RELEASE_COUNT_MAX a tick, each at the time it became visible, the deadline
    staying "now" until all are counted; a close counts what is left."""
    import chronoq.timer.delivery as delivery

    monkeypatch.setattr(delivery, "RELEASE_COUNT_MAX", 3)
    b = open_broker(tmp_path, clock, timer_prewrite_ms=LEAD)
    b.create_topic(TOPIC, 2)
    due = T0 + 1_000
    b.send_batch([OutgoingMessage(TOPIC, b"m%d" % i, keys=[f"k{i}"], deliver_at_ms=due) for i in range(8)])
    _tick_and_sync(b)
    clock.advance(1_000 - LEAD // 2)
    while b.timer_next_deadline_ms() < due:  # claimed and written ahead, held
        _tick_and_sync(b)
    assert visible(b) == [] and b.timer.histogram.count == 0
    clock.advance(LEAD // 2)
    assert b.timer_step().visible == 3  # all released, three counted
    assert len(visible(b)) == 8 and b.timer.histogram.count == 3
    assert b.timer_next_deadline_ms() == due  # (now: the rest waits to be counted)
    clock.advance(7)
    assert b.timer_step().visible == 3 and b.timer.histogram.count == 6
    clock.advance(5)
    ids = sorted(m.message_id for m in visible(b))
    b.close()  # counts the last two before it writes the trace
    h = b.timer.histogram
    assert (h.count, h.sum_ms, h.max_ms, h.early) == (8, 0, 0, 0)  # at the time they became visible
    b = open_broker(tmp_path, clock, timer_prewrite_ms=LEAD)
    seen = [e for m in b.read(trace.TRACE_TOPIC, 0, 0, 1_000).messages for e in trace.decode_events(m.body)
            if e["kind"] == "visible"]
    assert sorted(e["message_id"] for e in seen) == ids and {e["ts_ms"] for e in seen} == {due}
    b.close()
