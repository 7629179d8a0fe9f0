"""A crowd of timers claimed ahead by a lead that grows with it (``chronoq.timer.burstlead``), on a
fake clock, the runtime's way (a tick, then the committer's fsync for its ticket).

The claim schedule is exact: claims start ``n / rate + margin`` before the crowd's due time and
are paced at ``rate`` (each claim's start ``claimed / rate`` after the last), down to the least
burst lead; every copy is on disk before its due time and none is readable before it, in any
queue; a recall or cancel by key of a message whose copy is written answers "already delivered",
up to the lead before its due time, and keeps that promise across a crash.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
from timerkit import T0, TOPIC, crash, open_broker, visible

from chronoq.broker.outgoing import OutgoingMessage
from chronoq.core.clock import FakeClock
from chronoq.store import record
from chronoq.timer.burstlead import MARGIN_MS
from chronoq.timer.service import RecallOutcome

PREWRITE, MIN, MAX = 50, 1_000, 5_000
RATE = 200  # copies a second, scaled down with the crowd (the real one is 40,000)
ROOM = 100  # timer_pending_max: a claim takes at most this many, the next waits for their fsync
CONFIG = dict(timer_prewrite_ms=PREWRITE, timer_burst_lead_ms=MIN, timer_burst_lead_max_ms=MAX,
              timer_pending_max=ROOM)


@pytest.fixture
def clock():
    return FakeClock(T0)


def _open(path, clock, **cfg):
    b = open_broker(path, clock, **{**CONFIG, **cfg})
    b.timer.lead_policy = dataclasses.replace(b.timer.lead_policy, rate_per_s=RATE)
    return b


def _tick_and_sync(b) -> int:
    tick = b.timer_step()
    done = tick.visible
    if tick.ticket:
        done += b.timer_synced(b.flush())
    return done


def _settle(b, ticks: int = 50) -> None:
    """Tick until nothing is to do now (loading the crowd's bucket into the wheel: bounded)."""
    for _ in range(ticks):
        if b.timer_next_deadline_ms() > b.clock.wall_ms():
            return
        _tick_and_sync(b)
    raise AssertionError("the timer is still busy")


def _held(b) -> int:
    """Copies written and held (hidden until due), all queues."""
    return sum(len(cq.held) for cq in b.store.queues.values())


def _readable(b) -> int:
    return sum(b.store.bounds(TOPIC, q)[1] for q in range(4))


def _claims(b, clock, due: int, bound: int) -> list[tuple[int, int]]:
    """Tick at every timer deadline before ``due`` (at most ``bound`` ticks): (lead before due,
    copies newly held) per tick, each tick's copies durable and nothing readable yet."""
    out = []
    for _ in range(bound):
        deadline = b.timer_next_deadline_ms()
        if deadline >= due:
            break
        clock.advance(deadline - clock.wall_ms())
        before = _held(b)
        _tick_and_sync(b)
        out.append((due - clock.wall_ms(), _held(b) - before))
        assert _readable(b) == 0 and b.store.log.synced == b.store.log.written  # on disk, hidden
    return out


def _send_crowd(b, n: int, due: int) -> list:
    b.create_topic(TOPIC, 4)
    return b.send_batch([OutgoingMessage(TOPIC, b"c%d" % i, keys=[f"k{i}"], deliver_at_ms=due, queue_id=i % 4)
                         for i in range(n)])


def test_a_crowd_is_claimed_from_its_copies_time_ahead_paced_at_the_rate(tmp_path, clock):
    """600 due at one instant at 200 copies/s: 3 s of copies, so claims start 3 s + the margin
    ahead; each claim of 100 moves the next 0.5 s later; the last 100 (0.5 s of copies, less than
    the least burst lead) go at the least burst lead. Each copy is held until the due instant."""
    b = _open(tmp_path, clock)
    due = T0 + 10_000
    _send_crowd(b, 600, due)
    _settle(b)  # (loads the bucket into the wheel)
    schedule = _claims(b, clock, due, 20)  # 6 claims expected
    lead = 600 * 1000 // RATE + MARGIN_MS
    assert schedule == [(lead, 100), (lead - 500, 100), (lead - 1_000, 100), (lead - 1_500, 100),
                        (lead - 2_000, 100), (MIN, 100)]
    assert b.timer.burst_claims == 6 and b.timer.burst_lead_top_ms == lead and b.timer.burst_lead_last_ms == MIN
    assert b.timer_next_deadline_ms() == due  # the release
    clock.advance(due - 1 - clock.wall_ms())
    _tick_and_sync(b)
    assert _readable(b) == 0  # never early
    clock.advance(1)
    _tick_and_sync(b)
    seen = visible(b)
    assert len(seen) == 600 and all(m.flags & record.FLAG_HELD and m.stored_ms == due for m in seen)
    while b.timer.histogram.count < 600:  # (counted RELEASE_COUNT_MAX a tick)
        _tick_and_sync(b)
    assert b.timer.histogram.max_ms == 0 and b.timer.histogram.early == 0
    b.close()


def test_the_longest_lead_bounds_how_early_a_copy_is_written(tmp_path, clock):
    """A crowd needing 6 s of copies at MAX = 5 s: claims start 5 s ahead (and then run behind
    schedule, back to back), never earlier."""
    b = _open(tmp_path, clock, timer_pending_max=2_000)
    due = T0 + 20_000
    _send_crowd(b, 1_200, due)
    _settle(b)
    assert b.timer_next_deadline_ms() == due - MAX
    clock.advance(due - MAX - 1 - T0)
    _tick_and_sync(b)
    assert _held(b) == 0
    clock.advance(1)
    _tick_and_sync(b)
    assert _held(b) == 1_200 and _readable(b) == 0 and b.timer.burst_lead_top_ms == MAX
    b.close()


def test_messages_sent_behind_a_held_copy_wait_for_the_crowd(tmp_path, clock):
    """The price: queue offsets are dense, so a message sent to a queue behind one of the crowd's
    held copies is readable at the crowd's due time, up to the lead later."""
    b = _open(tmp_path, clock)
    due = T0 + 10_000
    _send_crowd(b, 600, due)
    _settle(b)
    clock.advance(b.timer_next_deadline_ms() - T0)
    _tick_and_sync(b)  # the first 100 held, 25 a queue
    b.send(TOPIC, b"now", queue_id=0)
    assert _readable(b) == 0
    for _ in range(50):  # bounded
        deadline = b.timer_next_deadline_ms()
        if deadline > due:
            break
        clock.advance(max(0, deadline - clock.wall_ms()))
        _tick_and_sync(b)
        assert b"now" not in [m.body for m in visible(b)] or clock.wall_ms() >= due
    assert b"now" in [m.body for m in visible(b)]
    b.close()


def test_recall_and_cancel_by_key_inside_a_long_lead_answer_already_delivered_and_keep_it(tmp_path, clock):
    """3.25 s before the crowd's due time its first 100 copies are written: recalling one of them
    answers ALREADY_DELIVERED, as does cancelling its key (listed as delivered); one not yet
    claimed is cancelled. Across a kill -9 the written copies stay held and are delivered once,
    the cancelled one never."""
    b = _open(tmp_path, clock)
    due = T0 + 10_000
    sent = _send_crowd(b, 600, due)
    _settle(b)
    clock.advance(b.timer_next_deadline_ms() - T0)
    _tick_and_sync(b)
    assert due - clock.wall_ms() == 600 * 1000 // RATE + MARGIN_MS and _held(b) == 100
    got = b.recall(sent[0].recall_handle)
    assert got.outcome is RecallOutcome.ALREADY_DELIVERED and "already written" in got.detail
    res = b.cancel_by_key(TOPIC, "k1")
    assert res.delivered == [(sent[1].message_id, due)] and res.cancelled == []
    last = sent[-1]
    assert b.recall(last.recall_handle).outcome is RecallOutcome.CANCELLED
    res = b.cancel_by_key(TOPIC, "k598")
    assert res.cancelled == [(sent[598].message_id, due)]
    crash(b)
    b = _open(tmp_path, clock)
    assert _readable(b) == 0 and _held(b) == 100  # restored holds, 3.25 s ahead of their time
    assert b.recall(sent[0].recall_handle).outcome is RecallOutcome.ALREADY_DELIVERED
    for _ in range(100):  # bounded
        deadline = b.timer_next_deadline_ms()
        if deadline is None or deadline > due + 100:
            break
        clock.advance(max(0, deadline - clock.wall_ms()))
        _tick_and_sync(b)
        if clock.wall_ms() < due:
            assert _readable(b) == 0
    bodies = [m.body for m in visible(b)]
    assert sorted(bodies) == sorted(b"c%d" % i for i in range(598))
    assert len(set(bodies)) == len(bodies)  # once each
    b.close()


def test_a_big_crowd_with_the_default_settings_is_on_disk_before_and_readable_exactly_at_its_due_time(
        tmp_path, clock):
    """100,000 due at one instant, the default leads and rate (40,000 copies/s): claims start
    2.75 s ahead, 2,000 a claim (the lane's room), paced 50 ms apart; at every step nothing is
    readable and every copy written is on disk; at the due instant all are readable at once."""
    n = 100_000
    b = open_broker(tmp_path, clock, segment_bytes=64 << 20)
    b.create_topic(TOPIC, 4)
    due = T0 + 30_000
    for first in range(0, n, 10_000):
        b.send_batch([OutgoingMessage(TOPIC, b"b", deliver_at_ms=due, queue_id=i % 4)
                      for i in range(first, first + 10_000)])
    _settle(b, ticks=500)  # (loaded 1,000 entries a tick)
    starts = [lead for lead, held in _claims(b, clock, due, 200) if held]  # 50 claims expected
    assert _held(b) == n and len(starts) == n // 2_000
    assert starts[0] == n * 1000 // 40_000 + MARGIN_MS and starts[1] == starts[0] - 50 and starts[-1] == 1_000
    clock.advance(due - 1 - clock.wall_ms())
    _tick_and_sync(b)
    assert _readable(b) == 0
    clock.advance(1)
    _tick_and_sync(b)
    assert _readable(b) == n
    b.close()


def test_a_crowd_arriving_near_its_due_time_wakes_the_timer_once_its_lead_grows(tmp_path, clock):
    """A crowd sent into the near window (its bucket loaded) grows the lead while the runtime
    sleeps until the deadline reported before it: the timer wakes it (every LEAD_RECHECK_ADDS
    entries), so the claim starts at the new, earlier time."""
    from chronoq.timer.deadline import LEAD_RECHECK_ADDS

    b = _open(tmp_path, clock)
    b.create_topic(TOPIC, 4)
    due = T0 + 20_000
    b.send(TOPIC, b"first", deliver_at_ms=due)
    _settle(b)
    assert b.timer_next_deadline_ms() == due - PREWRITE // 2  # one copy: the short lead
    woken = []
    b.timer.add_wakeup_listener(lambda: woken.append(b.timer.wheel.changes))
    b.send_batch([OutgoingMessage(TOPIC, b"c", deliver_at_ms=due, queue_id=i % 4)
                  for i in range(LEAD_RECHECK_ADDS - 1)])
    assert woken == []  # (not looked at yet)
    b.send_batch([OutgoingMessage(TOPIC, b"c", deliver_at_ms=due, queue_id=0)])
    assert len(woken) == 1  # LEAD_RECHECK_ADDS entries: 257 due at once need 1.285 s of copies
    assert b.timer_next_deadline_ms() == due - (math.ceil((LEAD_RECHECK_ADDS + 1) * 1000 / RATE) + MARGIN_MS)
    b.close()
