"""The POP log format and its recovery decision table (poplog.py)."""

from __future__ import annotations

import os

import pytest

from chronoq.core import errors
from chronoq.pop import poplog
from chronoq.pop.inflight import Inflight, QueueState


def setup_log(directory, generation=1):
    inflight = Inflight(None, generation=generation, buffer_ms=0)
    log = poplog.PopLog.create(directory, generation, [], created_ms=0)
    inflight.sink = log
    return inflight, log


def open_ck(inflight, qs, offsets, fifo=False, now=0, invisible=5_000):
    return inflight.open(qs, "topic", offsets, [1] * len(offsets), now_ms=now, invisible_ms=invisible,
                         fifo=fifo)


def test_roundtrip_ck_ack_done(tmp_path):
    d = str(tmp_path)
    inflight, log = setup_log(d)
    qs = inflight.add_queue(QueueState("grp", "%RETRY%grp_topic", 3, 0, -1))
    a = open_ck(inflight, qs, [0, 1, 2], fifo=True)
    b = open_ck(inflight, qs, [3])
    c = open_ck(inflight, qs, [4, 5])
    inflight.settle(a, 1)
    inflight.finish(b)
    inflight.settle(c, 0)
    inflight.settle(c, 1)  # fully settled
    assert len(log.flush()) == 3
    log.close()
    rec = poplog.load(d)
    assert rec.generation == 1 and rec.truncated_bytes == 0
    assert list(rec.cks) == [a.ck_id]
    got = rec.cks[a.ck_id]
    assert (got.group, got.topic, got.popped, got.queue_id, got.fifo) == ("grp", "topic", "%RETRY%grp_topic", 3, True)
    assert got.offsets == [0, 1, 2] and got.bits == 0b010 and got.deadline_ms == 5_000
    assert rec.seen[("grp", "%RETRY%grp_topic", 3)] == {0, 1, 2, 3, 4, 5}


def test_snapshot_replaces_older_generations(tmp_path):
    d = str(tmp_path)
    inflight, log = setup_log(d, generation=4)
    qs = inflight.add_queue(QueueState("g", "t", 0, 0, -1))
    a = open_ck(inflight, qs, [0, 1])
    inflight.settle(a, 0)
    log.flush()
    log.close()
    new = poplog.PopLog.create(d, 5, [a], created_ms=1)
    new.close()
    assert sorted(os.listdir(d)) == [poplog.file_name(5)]
    rec = poplog.load(d)
    assert rec.generation == 5 and rec.cks[a.ck_id].bits == 0b01


def test_leftovers_of_an_interrupted_snapshot_are_removed(tmp_path):
    d = str(tmp_path)
    _, log = setup_log(d, generation=2)
    log.close()
    open(os.path.join(d, poplog.file_name(3) + poplog.TMP_SUFFIX), "wb").write(b"partial")
    open(os.path.join(d, poplog.file_name(1)), "wb").write(b"old generation")
    rec = poplog.load(d)
    assert rec.generation == 2
    assert os.listdir(d) == [poplog.file_name(2)]


def _two_batches(d):
    inflight, log = setup_log(d)
    qs = inflight.add_queue(QueueState("g", "t", 0, 0, -1))
    a = open_ck(inflight, qs, [0])
    log.flush()
    first_end = log.size
    b = open_ck(inflight, qs, [1])
    log.flush()
    log.close()
    return log.path, first_end, a, b


def test_torn_tail_of_the_last_batch_is_truncated(tmp_path):
    d = str(tmp_path)
    path, first_end, a, b = _two_batches(d)
    size = os.path.getsize(path)
    with open(path, "r+b") as fh:
        fh.truncate(size - 3)  # the last write was cut short
    rec = poplog.load(d)
    assert list(rec.cks) == [a.ck_id]
    # Cut at the torn record; the second flush's (valid, harmless) BATCH record stays.
    assert os.path.getsize(path) == first_end + poplog.REC_HEAD_SIZE + poplog.BATCH.size
    assert rec.truncated_bytes == size - 3 - os.path.getsize(path)


def test_garbage_inside_the_last_batch_is_a_torn_tail(tmp_path):
    d = str(tmp_path)
    path, first_end, a, b = _two_batches(d)
    with open(path, "r+b") as fh:  # damage the last batch's BATCH record: nothing later is valid
        fh.seek(first_end + 10)
        fh.write(b"\xff")
    rec = poplog.load(d)
    assert list(rec.cks) == [a.ck_id] and rec.truncated_bytes > 0


def test_damage_before_a_later_batch_is_fatal(tmp_path):
    d = str(tmp_path)
    path, first_end, a, b = _two_batches(d)
    with open(path, "r+b") as fh:  # flip a byte in the first batch's CK record
        fh.seek(first_end - 5)
        byte = fh.read(1)
        fh.seek(first_end - 5)
        fh.write(bytes([byte[0] ^ 0x40]))
    with pytest.raises(errors.CorruptionError):
        poplog.load(d)


@pytest.mark.parametrize("offset", [0, 9, 12, 30])
def test_bad_header_is_fatal(tmp_path, offset):
    d = str(tmp_path)
    _, log = setup_log(d)
    log.close()
    with open(log.path, "r+b") as fh:
        fh.seek(offset)
        byte = fh.read(1)
        fh.seek(offset)
        fh.write(bytes([byte[0] ^ 0x01]))
    with pytest.raises(errors.CorruptionError):
        poplog.load(d)


def test_records_from_another_generation_do_not_validate(tmp_path):
    d1, d2 = str(tmp_path / "one"), str(tmp_path / "two")
    inflight, log = setup_log(d1, generation=1)
    qs = inflight.add_queue(QueueState("g", "t", 0, 0, -1))
    open_ck(inflight, qs, [0])
    log.flush()
    log.close()
    tail = open(log.path, "rb").read()[poplog.HEADER_SIZE:]
    _, other = setup_log(d2, generation=2)
    other.close()
    with open(other.path, "ab") as fh:
        fh.write(tail)
    rec = poplog.load(d2)
    assert rec.cks == {}  # the copied records fail the salted CRC: treated as a torn tail
    assert rec.truncated_bytes == len(tail)


def test_empty_directory(tmp_path):
    rec = poplog.load(str(tmp_path / "missing"))
    assert rec.generation == 0 and rec.cks == {}


def test_snapshot_carries_seen_offsets(tmp_path):
    d = str(tmp_path)
    offsets = set(range(0, 3 * poplog.SEEN_OFFSETS_MAX, 3))  # more than one record's worth
    log = poplog.PopLog.create(d, 7, [], created_ms=0, seen=[("g", "t", 2, offsets), ("g", "u", 0, {5})])
    log.close()
    rec = poplog.load(d)
    assert rec.seen == {("g", "t", 2): offsets, ("g", "u", 0): {5}}
    assert rec.cks == {}
