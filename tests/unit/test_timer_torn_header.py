"""A bucket file whose header a power loss tore (S0 met by a write, not by a scan).

A machine stop during a bucket file's creation can leave 1-23 bytes of its 24-byte header (or
24 bytes that are not a valid header: a file system that names the file before its data is
written). When the append journal's record of that file was not durable either, start-up's
roll-back does not touch it, and the entries replayed from the commit log are appended to it.
They must be read back: a file appended to behind a torn header was quarantined, with them, when
its bucket was loaded.
"""

from __future__ import annotations

import os

import pytest

from chronoq.core.clock import FakeClock
from chronoq.timer import schedlog
from chronoq.timer.bucketreader import BucketReader
from chronoq.timer.schedfiles import ScheduleFiles
from chronoq.timer.schedlog import DISPATCHED
from tests.unit.timerkit import T0, TOPIC, bodies, crash, drain, open_broker

MIN = 60_000
B = (T0 // MIN + 10) * MIN
DAY = 86_400_000

TORN = [
    pytest.param(schedlog.encode_header(B, MIN)[:10], id="10-bytes"),
    pytest.param(schedlog.encode_header(B, MIN)[:1], id="1-byte"),
    pytest.param(schedlog.encode_header(B, MIN)[:23], id="23-bytes"),
    pytest.param(bytes(schedlog.FILE_HEAD_SIZE), id="24-zero-bytes"),
    pytest.param(schedlog.encode_header(B + MIN, MIN), id="another-buckets-header"),
]


def _entry(ident: int) -> bytes:
    return schedlog.encode_entry(DISPATCHED, ident, B + 1, ident + 1)


@pytest.mark.parametrize("torn", TORN)
def test_a_torn_header_is_cut_and_written_again_before_the_first_append(tmp_path, torn):
    files = ScheduleFiles(str(tmp_path), MIN)
    path = files.path(B)
    with open(path, "wb") as fh:
        fh.write(torn)
    assert files.write([(B, [_entry(1), _entry(2)])]) == []
    assert files.write([(B, [_entry(3)])]) == []
    files.close()
    assert schedlog.read_file(path) == schedlog.encode_header(B, MIN) + _entry(1) + _entry(2) + _entry(3)
    assert files.entries(B) == _entry(1) + _entry(2) + _entry(3)
    assert bytes(BucketReader(files, B).finish()) == _entry(1) + _entry(2) + _entry(3)
    assert not os.path.exists(os.path.join(tmp_path, "quarantine"))
    [damage] = files.damage  # reported, though nothing was lost (it held no entry)
    assert damage.truncated and (damage.start, damage.end) == (0, len(torn))
    # Its journal record is at length 0: a crash from here on cuts the file to nothing.
    journal = schedlog.read_file(os.path.join(tmp_path, schedlog.JOURNAL_FILE))
    assert schedlog.decode_journal(journal, files.generation) == {B: 0}


def test_a_valid_header_only_file_is_appended_to_as_it_is(tmp_path):
    files = ScheduleFiles(str(tmp_path), MIN)
    path = files.path(B)
    with open(path, "wb") as fh:
        fh.write(schedlog.encode_header(B, MIN))
    assert files.write([(B, [_entry(1)])]) == []
    files.close()
    assert schedlog.read_file(path) == schedlog.encode_header(B, MIN) + _entry(1)
    assert files.damage == []


def test_a_torn_file_being_read_ahead_yields_what_is_written_to_it_meanwhile(tmp_path):
    """The load-ahead's reader opened the file while it was torn; the write cuts it and puts
    the header and entries in: the reader takes them (as for a 0-byte file)."""
    files = ScheduleFiles(str(tmp_path), MIN)
    with open(files.path(B), "wb") as fh:
        fh.write(schedlog.encode_header(B, MIN)[:10])
    reader = BucketReader(files, B)
    assert reader.step(1 << 20)
    assert files.write([(B, [_entry(1)])]) == []
    assert bytes(reader.finish()) == _entry(1)
    files.close()


@pytest.mark.parametrize("torn_len", [10, schedlog.FILE_HEAD_SIZE])
def test_messages_replayed_into_a_torn_bucket_file_are_delivered(tmp_path, torn_len):
    """Through the broker: the bucket file made for three delayed messages after the last timer
    checkpoint is torn by a power loss that also lost its append-journal record. Start-up replays
    the messages from the commit log into that file, a checkpoint then makes the file their only
    copy the timer reads (its cursor passes them), and they are delivered at their time, not
    before."""
    clock = FakeClock(T0)
    b = open_broker(tmp_path, clock)
    b.send(TOPIC, b"m0", deliver_at_ms=T0 + DAY)
    b.timer.checkpoint()  # m0 covered; the journal starts a new cycle (empty)
    due = T0 + 2 * DAY
    for i in range(1, 4):
        b.send(TOPIC, f"m{i}".encode(), deliver_at_ms=due + i)
    b.timer._flush_buffers()  # the new bucket file is created and written, no checkpoint covers it
    path = b.timer.files.path(schedlog.bucket_start(due, b.timer.width))
    journal = os.path.join(tmp_path, "timer", schedlog.JOURNAL_FILE)
    assert os.path.getsize(path) > schedlog.FILE_HEAD_SIZE and os.path.getsize(journal) > 0
    crash(b)
    head = schedlog.read_file(path)[:schedlog.FILE_HEAD_SIZE]
    with open(path, "wb") as fh:  # the power loss: a torn header (or zeros), the journal record gone
        fh.write(head[:torn_len] if torn_len < schedlog.FILE_HEAD_SIZE else bytes(torn_len))
    os.truncate(journal, 0)
    b = open_broker(tmp_path, clock)
    b.timer.checkpoint()  # the replayed entries are written to the torn file and covered
    assert os.path.getsize(path) > schedlog.FILE_HEAD_SIZE
    b.close()
    b = open_broker(tmp_path, clock)
    assert b.timer.caught_up == 0  # nothing re-derived from the commit log this time
    clock.advance(2 * DAY)
    drain(b)
    assert bodies(b) == [b"m0"]  # not early
    clock.advance(10)
    drain(b)
    assert bodies(b) == [b"m0", b"m1", b"m2", b"m3"]
    assert b.timer_stats()["damage"] == []  # a clean reopen: nothing left to report
    assert not os.path.exists(os.path.join(tmp_path, "timer", "quarantine"))
    b.close()


def test_a_kill_after_the_torn_file_was_cut_and_written_loses_nothing(tmp_path):
    """The repair's own crash point: the torn file cut, headed and appended to (page cache), its
    journal record (length 0) durable, then ``kill -9`` before any checkpoint. Start-up cuts the
    file back to 0 bytes by that record and replays the messages again."""
    clock = FakeClock(T0)
    b = open_broker(tmp_path, clock)
    b.send(TOPIC, b"m0", deliver_at_ms=T0 + DAY)
    b.timer.checkpoint()
    due = T0 + 2 * DAY
    for i in range(1, 4):
        b.send(TOPIC, f"m{i}".encode(), deliver_at_ms=due + i)
    b.timer._flush_buffers()
    path = b.timer.files.path(schedlog.bucket_start(due, b.timer.width))
    crash(b)
    with open(path, "r+b") as fh:
        fh.truncate(10)
    os.truncate(os.path.join(tmp_path, "timer", schedlog.JOURNAL_FILE), 0)
    b = open_broker(tmp_path, clock)
    b.timer._flush_buffers()  # the replayed entries: the torn file is cut, headed, appended to
    assert len(b.timer.damage) == 1 and os.path.getsize(path) > schedlog.FILE_HEAD_SIZE
    crash(b)
    b = open_broker(tmp_path, clock)
    assert any("rolled back" in note for note in b.timer.notes)
    clock.advance(2 * DAY + 10)
    drain(b)
    assert bodies(b) == [b"m0", b"m1", b"m2", b"m3"]
    assert b.timer_stats()["damage"] == []
    b.close()


def test_entries_written_after_a_quarantine_go_to_a_new_file_not_the_quarantined_one(tmp_path):
    """A bucket file quarantined (a bad header found by its load) while its write descriptor is
    kept open: the next append must not follow the moved inode into the quarantine."""
    files = ScheduleFiles(str(tmp_path), MIN)
    path = files.path(B)
    assert files.write([(B, [_entry(1)])]) == []  # the descriptor is now cached
    with open(path, "r+b") as fh:  # the header damaged behind the writer's back
        fh.write(b"\xff" * 8)
    assert files.entries(B) == b""  # S1: quarantined
    moved = os.path.join(tmp_path, "quarantine", os.path.basename(path))
    assert os.path.exists(moved) and not os.path.exists(path)
    quarantined = schedlog.read_file(moved)
    assert files.write([(B, [_entry(2)])]) == []
    files.sync()
    files.close()
    assert schedlog.read_file(moved) == quarantined  # nothing more went there
    assert schedlog.read_file(path) == schedlog.encode_header(B, MIN) + _entry(2)
    assert files.entries(B) == _entry(2)
