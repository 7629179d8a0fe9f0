"""Delayed delivery through the embedded broker, on a fake clock (no test sleeps).

Covers: exact due times, levels and lane independence, recall/reschedule outcomes including the
race at the due instant, retries/back-off/blocking, flow control, sync vs async delivery, stats.
Restarts, crashes and the timer's files: test_timer_restart.py.
"""

from __future__ import annotations

import pytest

from chronoq.core import errors
from chronoq.broker.broker import OutgoingMessage
from chronoq.core.clock import FakeClock
from chronoq.store import record
from chronoq.timer import handle as handles
from chronoq.core.delay_levels import DELAY_TOPIC
from chronoq.timer.service import RecallOutcome, RescheduleOutcome
from tests.unit.timerkit import (DAY, LEVELS, T0, TOPIC, bodies, crash, drain,
                                 open_broker, opened_broker, sched_files, visible)


@pytest.fixture
def clock():
    return FakeClock(T0)


@pytest.fixture
def broker(tmp_path, clock):
    yield from opened_broker(tmp_path, clock)


# ----------------------------------------------------------------- delivery
def test_a_timer_message_is_visible_exactly_at_its_due_time(broker, clock):
    due = T0 + 1_500
    r = broker.send(TOPIC, b"hello", deliver_at_ms=due, tag="tg", keys=["k1", "k2"], properties={"a": "b"},
                    born_ms=T0 - 7, queue_id=1)
    assert (r.topic, r.queue_id, r.queue_offset) == (TOPIC, 1, -1) and r.recall_handle
    assert visible(broker) == []
    clock.advance(1_499)
    drain(broker)
    assert visible(broker) == []  # never early
    clock.advance(1)
    assert drain(broker) == 1
    [m] = visible(broker)
    assert (m.message_id, m.body, m.tag, m.keys, m.born_ms, m.deliver_at_ms) == (
        r.message_id, b"hello", "tg", ("k1", "k2"), T0 - 7, due)
    assert m.properties["a"] == "b" and m.properties["__TYPE"] == "DELAY"
    assert m.properties["__TIMER_REF"].endswith(f".{r.commit_offset}")
    assert m.queue_id == 1 and not m.flags & record.FLAG_DELAYED
    assert broker.timer_stats()["lateness"]["count"] == 1 and broker.timer_stats()["lateness"]["max_ms"] == 0


def test_past_or_present_delivery_times_are_visible_at_once(broker, clock):
    r1 = broker.send(TOPIC, b"now", deliver_at_ms=T0)
    r2 = broker.send(TOPIC, b"past", deliver_at_ms=T0 - 60_000)
    assert bodies(broker) == [b"now", b"past"]
    assert r1.queue_offset >= 0 and r1.recall_handle
    assert broker.recall(r2.recall_handle).outcome is RecallOutcome.ALREADY_DELIVERED
    assert [m.deliver_at_ms for m in visible(broker)] in ([T0, T0 - 60_000], [T0 - 60_000, T0])


def test_delay_levels_park_in_the_delay_topic_and_fire_on_time(broker, clock):
    rs = [broker.send(TOPIC, f"L{lv}-{i}".encode(), delay_level=lv) for i in range(3) for lv in (3, 1, 2)]
    assert {r.topic for r in rs} == {TOPIC} and all(r.recall_handle for r in rs)
    assert [broker.store.bounds(DELAY_TOPIC, q) for q in range(3)] == [(0, 3)] * 3
    assert DELAY_TOPIC in {t.name for t in broker.list_topics(include_system=True)}
    for step, expect in [(999, []), (1, [b"L1-0", b"L1-1", b"L1-2"]), (3_999, None), (1, None), (55_000, None)]:
        clock.advance(step)
        drain(broker)
        got = bodies(broker)
        if expect is not None:
            assert got == expect
    assert len(bodies(broker)) == 9
    by_body = {m.body: m for m in visible(broker)}
    assert by_body[b"L2-0"].properties["__DELAY_REF"] == "2.0" and by_body[b"L2-0"].deliver_at_ms == T0 + 5_000
    assert "__DELAY_TOPIC" not in by_body[b"L2-0"].properties
    with pytest.raises(errors.InvalidDeliveryTime, match="levels are 1..3"):
        broker.send(TOPIC, b"x", delay_level=4)
    with pytest.raises(errors.InvalidDeliveryTime, match="not both"):
        broker.send(TOPIC, b"x", delay_level=1, deliver_at_ms=T0 + 5)


def test_a_busy_level_does_not_delay_another(tmp_path, clock):
    b = open_broker(tmp_path, clock, timer_delay_levels="1s 2s", timer_pending_max=5)
    b.send_batch([OutgoingMessage(TOPIC, f"busy{i}".encode(), delay_level=2) for i in range(40)])
    clock.advance(1_000)
    b.send(TOPIC, b"quick", delay_level=1)
    clock.advance(1_000)
    b.timer_tick()
    got = bodies(b)
    assert b"quick" in got and len(got) == 6  # level 2 lane took its 5; level 1 was not held back
    drain(b)
    assert len(bodies(b)) == 41
    b.close()


def test_max_delay_is_enforced_and_stores_nothing(broker, clock):
    written = broker.store.log.written
    with pytest.raises(errors.InvalidDeliveryTime, match="maximum delay"):
        broker.send(TOPIC, b"x", deliver_at_ms=T0 + 731 * DAY)
    with pytest.raises(errors.InvalidDeliveryTime, match="integer"):
        broker.send(TOPIC, b"x", deliver_at_ms="soon")
    assert broker.store.log.written == written
    broker.send(TOPIC, b"x", deliver_at_ms=T0 + 730 * DAY)  # exactly the limit is fine


# ----------------------------------------------------------------- recall
def test_recall_outcomes(broker, clock):
    a = broker.send(TOPIC, b"a", deliver_at_ms=T0 + 10_000)
    c = broker.send(TOPIC, b"c", deliver_at_ms=T0 + 10_000)
    first = broker.recall(a.recall_handle)
    assert first.outcome is RecallOutcome.CANCELLED and first.message_id == a.message_id
    assert broker.recall(a.recall_handle).outcome is RecallOutcome.CANCELLED  # idempotent
    h = handles.decode(c.recall_handle)
    forged = handles.RecallHandle(h.kind, 0, h.position + 1, h.due_ms, h.topic, h.message_id).encode()
    assert broker.recall(forged).outcome is RecallOutcome.NOT_FOUND
    other = handles.RecallHandle(h.kind, 0, h.position, h.due_ms, h.topic, "someone-else").encode()
    assert broker.recall(other).outcome is RecallOutcome.NOT_FOUND
    with pytest.raises(errors.ClientError):
        broker.recall("not a handle")
    clock.advance(10_000)
    drain(broker)
    assert bodies(broker) == [b"c"]
    assert broker.recall(c.recall_handle).outcome is RecallOutcome.ALREADY_DELIVERED
    assert broker.recall(a.recall_handle).outcome is RecallOutcome.CANCELLED


def test_recall_races_the_due_instant(tmp_path, clock):
    """Linearization point: the due instant on the timer's clock. 1 ms before: cancelled for good;
    at the instant (even before the tick ran, even across a crash): already delivered."""
    b = open_broker(tmp_path, clock, timer_delay_levels=LEVELS)
    early = b.send(TOPIC, b"early", deliver_at_ms=T0 + 5_000)
    ontime = b.send(TOPIC, b"ontime", deliver_at_ms=T0 + 5_000)
    lv = b.send(TOPIC, b"level", delay_level=2)  # due T0 + 5000 too
    lv2 = b.send(TOPIC, b"level2", delay_level=2)
    drain(b)
    clock.advance(4_999)
    assert b.recall(early.recall_handle).outcome is RecallOutcome.CANCELLED
    assert b.recall(lv.recall_handle).outcome is RecallOutcome.CANCELLED
    clock.advance(1)
    assert b.recall(ontime.recall_handle).outcome is RecallOutcome.ALREADY_DELIVERED  # tick not yet run
    assert b.recall(lv2.recall_handle).outcome is RecallOutcome.ALREADY_DELIVERED
    crash(b)
    b = open_broker(tmp_path, clock, timer_delay_levels=LEVELS)
    assert b.recall(ontime.recall_handle).outcome is RecallOutcome.ALREADY_DELIVERED
    assert b.recall(early.recall_handle).outcome is RecallOutcome.CANCELLED
    drain(b)
    assert bodies(b) == [b"level2", b"ontime"]
    clock.advance(60_000)
    drain(b)
    assert bodies(b) == [b"level2", b"ontime"]
    assert b.recall(lv.recall_handle).outcome is RecallOutcome.CANCELLED
    b.close()


def test_recall_of_a_far_future_message_survives_a_crash_and_the_bucket_deletion(tmp_path, clock):
    b = open_broker(tmp_path, clock)
    far = b.send(TOPIC, b"far", deliver_at_ms=T0 + 3 * DAY)
    keep = b.send(TOPIC, b"keep", deliver_at_ms=T0 + 3 * DAY + 1)
    drain(b)
    assert b.recall(far.recall_handle).outcome is RecallOutcome.CANCELLED  # bucket not loaded
    crash(b)
    b = open_broker(tmp_path, clock)
    clock.advance(3 * DAY + 60_000)
    drain(b)
    clock.advance(120_000)
    drain(b)
    assert bodies(b) == [b"keep"]
    assert not [n for n in sched_files(b) if n.endswith(".sch")]  # finished buckets are deleted
    assert [n for n in sched_files(b) if n.endswith(".done")]  # ... but the cancellation is remembered
    assert b.recall(far.recall_handle).outcome is RecallOutcome.CANCELLED
    assert b.recall(keep.recall_handle).outcome is RecallOutcome.ALREADY_DELIVERED
    clock.advance(8 * DAY)
    b.maintenance()
    assert b.recall(far.recall_handle).outcome is RecallOutcome.NOT_FOUND  # beyond the recall memory
    assert not sched_files(b)
    b.close()


# ----------------------------------------------------------------- reschedule
def test_reschedule_moves_a_pending_message(broker, clock):
    r = broker.send(TOPIC, b"m", deliver_at_ms=T0 + 10_000, properties={"u": "1"})
    moved = broker.reschedule(r.recall_handle, T0 + 20_000)
    assert moved.outcome is RescheduleOutcome.RESCHEDULED and moved.recall_handle != r.recall_handle
    assert broker.recall(r.recall_handle).outcome is RecallOutcome.NOT_FOUND  # the old handle
    clock.advance(10_000)
    drain(broker)
    assert visible(broker) == []
    clock.advance(10_000)
    drain(broker)
    [m] = visible(broker)
    assert m.deliver_at_ms == T0 + 20_000 and m.message_id == r.message_id and m.properties["u"] == "1"
    assert "__TIMER_MOVED_FROM" not in m.properties
    again = broker.reschedule(moved.recall_handle, T0 + 99_000)
    assert again.outcome is RescheduleOutcome.ALREADY_DELIVERED and again.recall_handle == ""


def test_reschedule_into_the_past_delivers_at_the_next_tick_and_levels_can_move(broker, clock):
    r = broker.send(TOPIC, b"soon", deliver_at_ms=T0 + 50_000)
    lv = broker.send(TOPIC, b"lv", delay_level=3)
    c = broker.send(TOPIC, b"cancelled", deliver_at_ms=T0 + 50_000)
    broker.recall(c.recall_handle)
    assert broker.reschedule(c.recall_handle, T0 + 5).outcome is RescheduleOutcome.CANCELLED
    assert broker.reschedule(r.recall_handle, T0 - 1).outcome is RescheduleOutcome.RESCHEDULED
    moved = broker.reschedule(lv.recall_handle, T0 + 2_000)
    assert moved.outcome is RescheduleOutcome.RESCHEDULED
    drain(broker)
    assert bodies(broker) == [b"soon"]
    clock.advance(2_000)
    drain(broker)
    assert bodies(broker) == [b"lv", b"soon"]
    clock.advance(60_000)
    drain(broker)
    assert bodies(broker) == [b"lv", b"soon"]  # the level queue skips the moved entry
    with pytest.raises(errors.InvalidDeliveryTime):
        broker.reschedule(moved.recall_handle, T0 + 800 * DAY)


# ----------------------------------------------------------------- lanes: failures, flow control, modes
def test_failed_deliveries_back_off_then_block_and_never_skip(tmp_path, clock, monkeypatch):
    b = open_broker(tmp_path, clock, timer_retry_backoff_ms=100, timer_block_after_failures=3)
    for i in range(4):
        b.send(TOPIC, f"m{i}".encode(), deliver_at_ms=T0 + 1_000 + i)
    real_write = b.store.write
    failing = {"on": True, "calls": 0}

    def write(messages):
        if failing["on"]:
            failing["calls"] += 1
            raise errors.DiskFull("disk full (injected)")
        return real_write(messages)

    monkeypatch.setattr(b.store, "write", write)
    clock.advance(1_003)
    b.timer_tick()
    lane = b.timer.timer_lane
    assert failing["calls"] == 1 and lane.failures == 1 and lane.retry_at_ms == clock.wall_ms() + 100
    assert b.timer_next_deadline_ms() == clock.wall_ms() + 100
    b.timer_tick()  # inside the back-off: no write attempted
    assert failing["calls"] == 1
    clock.advance(100)
    b.timer_tick()
    assert lane.failures == 2 and lane.retry_at_ms == clock.wall_ms() + 200
    clock.advance(200)
    b.timer_tick()
    assert lane.failures == 3 and lane.blocked and lane.retry_at_ms == clock.wall_ms() + 400
    failing["on"] = False
    b.send(TOPIC, b"late", deliver_at_ms=clock.wall_ms() + 1)
    clock.advance(1)
    assert b.timer_tick() == 0 and lane.room(clock.wall_ms()) == 0  # blocked: claims nothing new
    clock.advance(399)
    b.timer_tick()
    assert not lane.blocked and lane.failures == 0
    drain(b)
    got = sorted(visible(b), key=lambda m: m.commit_offset)
    assert [m.body for m in got] == [b"m0", b"m1", b"m2", b"m3", b"late"]  # in due order, none skipped
    assert b.timer_stats()["timer_lane"]["times_blocked"] == 1
    b.close()


def test_a_failed_fsync_is_retried_without_writing_the_copy_twice(tmp_path, clock, monkeypatch):
    b = open_broker(tmp_path, clock)
    b.send(TOPIC, b"once", deliver_at_ms=T0 + 1_000)
    real_sync = b.store.sync
    fail = {"n": 1}

    def sync():
        if fail["n"]:
            fail["n"] -= 1
            raise errors.StorageError("I/O error (injected)")
        return real_sync()

    monkeypatch.setattr(b.store, "sync", sync)
    clock.advance(1_000)
    b.timer_tick()
    assert visible(b) == [] and b.timer.timer_lane.failures == 1
    clock.advance(100)
    drain(b)
    assert bodies(b) == [b"once"]
    b.close()


def test_flow_control_bounds_each_tick(tmp_path, clock):
    b = open_broker(tmp_path, clock, timer_pending_max=3)
    b.send_batch([OutgoingMessage(TOPIC, f"m{i:02d}".encode(), deliver_at_ms=T0 + 500 + i) for i in range(10)])
    clock.advance(1_000)
    assert b.timer_tick() == 3
    assert len(visible(b)) == 3 and len(b.timer.wheel) == 7
    assert b.timer_next_deadline_ms() <= clock.wall_ms()
    drain(b)
    assert len(visible(b)) == 10
    b.close()


@pytest.mark.parametrize("mode,fsyncs", [("async", 1), ("sync", 6)])
def test_async_delivery_groups_one_fsync_sync_mode_one_each(tmp_path, clock, monkeypatch, mode, fsyncs):
    b = open_broker(tmp_path, clock, timer_deliver_mode=mode)
    b.send_batch([OutgoingMessage(TOPIC, f"m{i}".encode(), deliver_at_ms=T0 + 500 + i) for i in range(6)])
    b.timer_tick()  # loads the bucket; nothing is due yet
    clock.advance(1_000)
    calls = []
    real_sync = b.store.sync
    monkeypatch.setattr(b.store, "sync", lambda: calls.append(1) or real_sync())
    # async: one tick writes all six, one fsync; sync: a tick writes one copy per fsync (its
    # ticket), the next once that one is durable, so draining takes six of each.
    drain(b)
    assert len(visible(b)) == 6 and len(calls) == fsyncs
    b.close()


def test_incremental_loading_never_delivers_a_half_loaded_bucket(tmp_path, clock):
    b = open_broker(tmp_path, clock, timer_load_batch=7)
    rs = [b.send(TOPIC, f"m{i}".encode(), deliver_at_ms=T0 + 3 * DAY + i) for i in range(40)]
    b.recall(rs[-1].recall_handle)  # the tombstone is the last entry of the file
    b.close()
    b = open_broker(tmp_path, clock, timer_load_batch=7)
    clock.advance(3 * DAY + 100)
    b.timer_tick()
    assert visible(b) == [] and b.timer._loading and b.timer_next_deadline_ms() <= clock.wall_ms()
    drain(b)
    assert len(bodies(b)) == 39 and b"m39" not in bodies(b)
    b.close()


def test_async_flush_policy_still_absorbs_only_durable_records(tmp_path, clock):
    b = open_broker(tmp_path, clock, flush_policy="async")
    b.send(TOPIC, b"a", deliver_at_ms=T0 + 1_000)
    assert b.timer._unabsorbed  # dispatched, not yet fsynced: the timer waits for it
    clock.advance(1_000)
    drain(b)
    assert bodies(b) == [b"a"]
    b.close()


def test_duplicate_client_ids_return_the_same_handle(broker, clock):
    r1 = broker.send(TOPIC, b"x", deliver_at_ms=T0 + 5_000, message_id="my-id-1")
    r2 = broker.send(TOPIC, b"x", deliver_at_ms=T0 + 5_000, message_id="my-id-1")
    assert r2.duplicate and r2.recall_handle == r1.recall_handle
    clock.advance(5_000)
    drain(broker)
    assert bodies(broker) == [b"x"]


def test_stats_report_lateness_due_buckets_and_level_backlog(tmp_path, clock):
    b = open_broker(tmp_path, clock, timer_delay_levels=LEVELS)
    b.send(TOPIC, b"a", deliver_at_ms=T0 + 1_000)
    b.send(TOPIC, b"b", deliver_at_ms=T0 + 90_000)
    b.send(TOPIC, b"c", delay_level=3)
    drain(b)
    stats = b.timer_stats(horizon_ms=180_000)
    assert sum(r["pending"] for r in stats["due_by_bucket"]) == 2
    assert [lv["backlog"] for lv in stats["levels"]] == [0, 0, 1]
    assert stats["levels"][2]["delay_ms"] == 60_000
    clock.advance(1_007)
    drain(b)  # 7 ms late on purpose
    stats = b.timer_stats()
    assert stats["lateness"]["count"] == 1 and stats["lateness"]["max_ms"] == 7 and stats["lateness"]["early"] == 0
    assert stats["lateness"]["p99_ms"] == 7
    b.close()
