"""Delayed delivery through the embedded broker, on a fake clock (no test sleeps).

Covers: exact due times, levels and lane independence, recall/reschedule outcomes including the
race at the due instant, restarts without double dispatch, torn bucket tails, deletion of
finished buckets, commit-log retention with far-future messages pending, memory of far-future
messages, retries/back-off/blocking, flow control, sync vs async delivery, stats.
"""

from __future__ import annotations

import os

import pytest

from chronoq.core import errors
from chronoq.broker.broker import OutgoingMessage
from chronoq.core.clock import FakeClock
from chronoq.store import record
from chronoq.timer import handle as handles
from chronoq.timer import schedlog
from chronoq.timer.buckets import UNLOADED
from chronoq.core.delay_levels import DELAY_TOPIC
from chronoq.timer.service import RecallOutcome, RescheduleOutcome
from tests.unit.timerkit import T0, TOPIC, bodies, crash, crash_torn, drain, open_broker, visible

LEVELS = "1s 5s 1m"
DAY = 86_400_000


@pytest.fixture
def clock():
    return FakeClock(T0)


@pytest.fixture
def broker(tmp_path, clock):
    b = open_broker(tmp_path, clock, timer_delay_levels=LEVELS)
    b.create_topic(TOPIC, 2)
    yield b
    if not b.closed:
        b.close()


def sched_files(b) -> list[str]:
    return sorted(os.listdir(b.timer.sched_dir))


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


# ----------------------------------------------------------------- restart, crash, files
def test_a_crash_after_delivery_does_not_deliver_twice(tmp_path, clock):
    b = open_broker(tmp_path, clock, timer_delay_levels=LEVELS)
    for i in range(20):
        b.send(TOPIC, f"t{i}".encode(), deliver_at_ms=T0 + 1_000 + i * 100)
        b.send(TOPIC, f"l{i}".encode(), delay_level=1 + i % 2)
    clock.advance(2_000)
    drain(b)
    half = bodies(b)
    assert 0 < len(half) < 40
    crash(b)  # DISPATCHED entries and level offsets were only in memory
    b = open_broker(tmp_path, clock, timer_delay_levels=LEVELS)
    drain(b)
    assert bodies(b) == half  # nothing delivered twice, nothing early
    clock.advance(10_000)
    drain(b)
    got = bodies(b)
    assert len(got) == 40 and len(set(got)) == 40
    crash(b)
    b = open_broker(tmp_path, clock, timer_delay_levels=LEVELS)
    clock.advance(10_000)
    drain(b)
    assert bodies(b) == got
    b.close()


def test_a_clean_restart_keeps_everything(tmp_path, clock):
    b = open_broker(tmp_path, clock)
    b.send(TOPIC, b"a", deliver_at_ms=T0 + 90_000)
    b.send(TOPIC, b"b", deliver_at_ms=T0 + 5 * DAY)
    b.close()
    b = open_broker(tmp_path, clock)
    assert b.timer.caught_up == 0  # the clean checkpoint covered everything
    clock.advance(5 * DAY)
    drain(b)
    assert bodies(b) == [b"a", b"b"]
    b.close()


def test_a_torn_bucket_tail_is_rolled_back_and_replayed_from_the_commit_log(tmp_path, clock):
    b = open_broker(tmp_path, clock)
    b.send(TOPIC, b"m0", deliver_at_ms=T0 + 2 * DAY)
    b.timer.checkpoint()  # m0's entry is durable and covered by the cursor
    for i in range(1, 5):
        b.send(TOPIC, f"m{i}".encode(), deliver_at_ms=T0 + 2 * DAY + i)
    b.timer._flush_buffers()  # entries reach the file, but no checkpoint covers them
    [name] = [n for n in sched_files(b) if n.endswith(".sch")]
    path = os.path.join(b.timer.sched_dir, name)
    covered = os.path.getsize(path)
    b.send(TOPIC, b"m5", deliver_at_ms=T0 + 2 * DAY + 5)
    b.timer._flush_buffers()
    b = crash_torn(b, path)
    assert any("rolled back" in note for note in b.timer.notes)
    clock.advance(2 * DAY + 10)
    drain(b)
    assert bodies(b) == [f"m{i}".encode() for i in range(6)]
    assert b.timer_stats()["damage"] == []
    assert covered > schedlog.FILE_HEAD_SIZE
    b.close()


def test_without_a_timer_checkpoint_torn_tails_are_found_by_scanning(tmp_path, clock):
    b = open_broker(tmp_path, clock)
    for i in range(5):
        b.send(TOPIC, f"m{i}".encode(), deliver_at_ms=T0 + 2 * DAY + i)
    b.timer._flush_buffers()
    [name] = [n for n in sched_files(b) if n.endswith(".sch")]
    path = os.path.join(b.timer.sched_dir, name)
    b = crash_torn(b, path, lose_checkpoint=True)
    clock.advance(2 * DAY + 10)
    drain(b)
    assert bodies(b) == [f"m{i}".encode() for i in range(5)]
    damage = b.timer_stats()["damage"]
    assert len(damage) == 1 and damage[0]["truncated"] and damage[0]["reason"] == "torn tail"
    b.close()


def test_middle_damage_is_quarantined_and_reported(tmp_path, clock):
    b = open_broker(tmp_path, clock)
    for i in range(3):
        b.send(TOPIC, f"m{i}".encode(), deliver_at_ms=T0 + 2 * DAY + i)
    b.close()  # the clean checkpoint makes the bucket file the only copy the timer will read
    [name] = [n for n in os.listdir(os.path.join(tmp_path, "timer", "schedule")) if n.endswith(".sch")]
    path = os.path.join(tmp_path, "timer", "schedule", name)
    with open(path, "r+b") as fh:
        fh.seek(schedlog.FILE_HEAD_SIZE + 50)
        byte = fh.read(1)
        fh.seek(schedlog.FILE_HEAD_SIZE + 50)
        fh.write(bytes([byte[0] ^ 0x10]))
    b = open_broker(tmp_path, clock)
    clock.advance(2 * DAY + 10)
    drain(b)
    assert bodies(b) == [b"m1", b"m2"]  # the damaged entry is lost, and that is reported
    damage = b.timer_stats()["damage"]
    assert len(damage) == 1 and not damage[0]["truncated"]
    b.close()


def test_changing_the_bucket_width_with_pending_files_is_refused(tmp_path, clock):
    b = open_broker(tmp_path, clock)
    b.send(TOPIC, b"x", deliver_at_ms=T0 + DAY)
    b.close()
    with pytest.raises(errors.ClientError, match="timer_bucket_ms"):
        open_broker(tmp_path, clock, timer_bucket_ms=30_000)


def test_retention_is_not_pinned_by_far_future_messages(tmp_path, clock):
    b = open_broker(tmp_path, clock, retention_max_bytes=1)
    far = [b.send(TOPIC, f"year{i}".encode(), deliver_at_ms=T0 + 365 * DAY + i) for i in range(3)]
    for i in range(300):  # ~5 segments of ordinary traffic after them
        b.send("other", b"x" * 1000)
    assert b.retention() == []  # the timer's cursor has not passed the delayed records yet
    b.maintenance()
    b.timer.checkpoint()
    b.checkpoint()
    deleted = b.retention()
    assert deleted and b.store.log.min_offset > max(r.commit_offset for r in far)
    b.close()
    b = open_broker(tmp_path, clock, retention_max_bytes=1)
    clock.advance(365 * DAY + 10)
    drain(b)
    assert bodies(b) == [b"year0", b"year1", b"year2"]
    b.close()


def test_far_future_messages_take_no_memory_until_their_window(tmp_path, clock):
    b = open_broker(tmp_path, clock, timer_preload_ms=60_000)
    b.send_batch([OutgoingMessage(TOPIC, b"near", deliver_at_ms=T0 + 10_000 + i) for i in range(30)])
    b.send_batch([OutgoingMessage(TOPIC, b"far", deliver_at_ms=T0 + DAY + i * 7_000) for i in range(3_000)])
    drain(b)
    b.timer.checkpoint()
    t = b.timer
    assert len(t.wheel) == 30  # only the near window is in the wheel
    assert all(bk.state != UNLOADED for bk in t.buckets.values())  # far buckets: no objects at all
    assert len(t.buckets) <= 3 and t._buffered == 0
    stats = b.timer_stats(horizon_ms=DAY + 6 * 3_600_000)
    counted = sum(row["pending"] for row in stats["due_by_bucket"])
    assert counted == 3_030  # counted from the files, on demand
    assert stats["buckets"]["waiting_on_disk"] == len({(T0 + DAY + i * 7_000) // 60_000 for i in range(3_000)})
    clock.advance(DAY - 30_000)
    drain(b)
    assert 0 < len(t.wheel) < 100  # the window moved; far buckets come in one or two at a time
    b.close()


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


def test_an_incremental_checkpoint_interrupted_by_a_crash_loses_nothing(tmp_path, clock, monkeypatch):
    from chronoq.timer import checkpoint

    monkeypatch.setattr(checkpoint, "FLUSH_FILES_PER_MAINTENANCE", 2)
    b = open_broker(tmp_path, clock, timer_checkpoint_interval_ms=1_000)
    dues = [T0 + DAY + i * 60_000 for i in range(9)]  # nine far buckets
    for i, due in enumerate(dues):
        b.send(TOPIC, f"m{i}".encode(), deliver_at_ms=due)
    clock.advance(1_000)
    b.maintenance()  # snapshot + the first two buckets
    t = b.timer
    assert t._ckpt_target is not None and len(t._ckpt_pending) == 7
    before = t.cursor
    b.send(TOPIC, b"late", deliver_at_ms=T0 + 2 * DAY)  # absorbed during the checkpoint
    b.maintenance()
    assert t.cursor == before and t._ckpt_target is not None  # not complete yet
    crash(b)
    b = open_broker(tmp_path, clock, timer_checkpoint_interval_ms=1_000)
    for _ in range(6):
        clock.advance(1_000)
        b.maintenance()
    assert b.timer._ckpt_target is None and b.timer.cursor > before
    crash(b)  # after a completed incremental checkpoint
    b = open_broker(tmp_path, clock)
    clock.advance(2 * DAY)
    drain(b)
    assert bodies(b) == sorted([f"m{i}".encode() for i in range(9)] + [b"late"])
    b.close()


def test_stale_journal_records_are_ignored(tmp_path, clock):
    """A crash between writing the checkpoint and clearing the journal leaves records of the old
    generation: they must not cut files the new checkpoint covers."""
    b = open_broker(tmp_path, clock)
    b.send(TOPIC, b"kept", deliver_at_ms=T0 + DAY)
    b.timer.checkpoint()
    [name] = [n for n in sched_files(b) if n.endswith(".sch")]
    start = schedlog.parse_file_name(name)[0]
    stale = schedlog.encode_intent(b.timer.files.generation - 1, start, 0)
    crash(b)
    with open(os.path.join(tmp_path, "timer", schedlog.JOURNAL_FILE), "ab") as fh:
        fh.write(stale + stale[:10])  # and a torn record after it
    size = os.path.getsize(os.path.join(tmp_path, "timer", "schedule", name))
    b = open_broker(tmp_path, clock)
    assert os.path.getsize(os.path.join(tmp_path, "timer", "schedule", name)) >= size
    assert b.timer.caught_up == 0
    clock.advance(DAY)
    drain(b)
    assert bodies(b) == [b"kept"]
    b.close()


def test_a_bucket_file_of_0_bytes_keeps_the_entries_flushed_to_it_while_it_loads(tmp_path, clock, monkeypatch):
    """A 0-byte bucket file (what a roll-back leaves of a file first written after the last
    checkpoint) is loaded ahead behind a bigger bucket read over several ticks: its reader opens a
    file too short for a header. A message for it arrives meanwhile and its buffer is flushed to
    the file (header and entry) before the reader finishes. The entry must be in the loaded
    bucket: a reader that took the short file for an empty one, with the buffer already written
    out, loaded nothing and the bucket was finished undelivered (found by
    tests/crash/test_timer_newfiles_crash.py, seed 20261127)."""
    from chronoq.timer import bucketlife

    monkeypatch.setattr(bucketlife, "LOAD_READ_BYTES", 700)
    b = open_broker(tmp_path, clock)
    start = schedlog.bucket_start(T0 + 3 * DAY, b.timer.width)
    before = [f"a{i}".encode() for i in range(30)]  # the bucket before: a file read over several ticks
    for body in before:
        b.send(TOPIC, body, deliver_at_ms=start - 1)
    b.timer.checkpoint()
    crash(b)
    open(os.path.join(b.timer.sched_dir, schedlog.file_name(start)), "wb").close()  # cut back to 0 bytes
    b = open_broker(tmp_path, clock)
    clock.advance(start - 30_000 - T0)  # both buckets enter the preload window
    b.timer_tick()
    assert start in b.timer._readers and b.timer.buckets[start].state == UNLOADED
    late = [f"late{i}".encode() for i in range(3)]
    for i, body in enumerate(late):
        b.send(TOPIC, body, deliver_at_ms=start + i)
    b.timer._flush_buffers()  # header and entries written to the file being read
    drain(b)
    clock.advance(30_000 + 1_000)
    drain(b)
    assert sorted(bodies(b)) == sorted(before + late)
    b.close()


def test_a_bucket_file_is_read_over_several_ticks_and_entries_arriving_meanwhile_are_kept(
        tmp_path, clock, monkeypatch):
    """Loading ahead reads a big bucket file a few MB per tick (here a few hundred bytes). While
    it is read, new entries for it are flushed to the same file and a recall looks it up; all of
    that is in the bucket once loaded, and nothing is delivered before the whole file is read."""
    from chronoq.timer import bucketlife

    monkeypatch.setattr(bucketlife, "LOAD_READ_BYTES", 700)
    b = open_broker(tmp_path, clock)
    first = [b.send(TOPIC, f"a{i}".encode(), deliver_at_ms=T0 + 3 * DAY + i) for i in range(30)]
    b.timer.checkpoint()  # the bucket is a file on disk, nothing of it in memory
    clock.advance(3 * DAY - 30_000)  # the bucket enters the preload window
    b.timer_tick()
    start = schedlog.bucket_start(T0 + 3 * DAY, b.timer.width)
    assert start in b.timer._readers and b.timer.buckets[start].state == UNLOADED
    b.timer_tick()
    assert start in b.timer._readers  # still reading: several ticks
    for i in range(5):
        b.send(TOPIC, f"b{i}".encode(), deliver_at_ms=T0 + 3 * DAY + 100 + i)
    b.timer._flush_buffers()  # appended to the file being read
    assert b.recall(first[3].recall_handle).outcome is RecallOutcome.CANCELLED
    b.send(TOPIC, b"c", deliver_at_ms=T0 + 3 * DAY + 200)  # stays buffered
    drain(b)
    assert not b.timer._readers and len(b.timer.wheel) == 30 - 1 + 5 + 1
    clock.advance(30_000 + 1_000)
    drain(b)
    assert sorted(bodies(b)) == sorted([f"a{i}".encode() for i in range(30) if i != 3]
                                       + [f"b{i}".encode() for i in range(5)] + [b"c"])
    b.close()


def test_a_recall_stays_answered_after_its_bucket_finishes_twice(tmp_path, clock):
    """A kill -9 replays the records after the timer's cursor into a bucket that was already
    finished; finishing it again must keep the earlier .done's cancellations (found by the
    property test: the second .done replaced the first, and a recall answered ALREADY_DELIVERED)."""
    def reopen():
        return open_broker(tmp_path, clock, timer_delay_levels=LEVELS, timer_checkpoint_interval_ms=20_000)

    b = reopen()
    b.create_topic(TOPIC, 2)
    moved = b.reschedule(b.send(TOPIC, b"l", delay_level=1).recall_handle, clock.wall_ms() + 59_999)
    assert b.recall(moved.recall_handle).outcome is RecallOutcome.CANCELLED
    b.close()  # a clean checkpoint: the cancellation is now before the cursor
    b = reopen()
    other = b.send(TOPIC, b"t", deliver_at_ms=clock.wall_ms() + 59_999, queue_id=0)
    assert b.recall(other.recall_handle).outcome is RecallOutcome.CANCELLED
    clock.advance(3_600_000)
    drain(b)  # the bucket finishes: its .done keeps both cancellations
    crash(b)
    b = reopen()
    drain(b)  # the replay re-creates the bucket (the second message only) and finishes it again
    assert b.recall(moved.recall_handle).outcome is RecallOutcome.CANCELLED
    assert b.recall(other.recall_handle).outcome is RecallOutcome.CANCELLED
    assert visible(b) == []
    b.close()
