"""Delayed delivery across restarts and crashes, and the timer's files, on a fake clock (no test
sleeps): restarts without double dispatch, torn bucket tails, quarantined damage, deletion of
finished buckets, commit-log retention with far-future messages pending, memory of far-future
messages, checkpoints interrupted by a crash, the append journal, buckets loaded over several
ticks. The rest of the timer service: test_timer_service.py.
"""

from __future__ import annotations

import os

import pytest

from chronoq.core import errors
from chronoq.broker.broker import OutgoingMessage
from chronoq.core.clock import FakeClock
from chronoq.timer import schedlog
from chronoq.timer.buckets import UNLOADED
from chronoq.timer.service import RecallOutcome
from tests.unit.timerkit import (DAY, LEVELS, T0, TOPIC, bodies, crash, crash_torn,
                                 drain, open_broker, sched_files, visible)


@pytest.fixture
def clock():
    return FakeClock(T0)


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



# ----------------------------------------------------------------- checkpoints, the journal, bucket loading
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
