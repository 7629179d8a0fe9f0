"""Atomic metadata writes (fsutil) and the store's checkpoint file."""

from __future__ import annotations

import errno
import os

import pytest
from storekit import crash, fill, open_store

from chronoq.core import errors, fsutil
from chronoq.store.store import CHECKPOINT_FILE, CHECKPOINT_VERSION

OLD = {"version": 1, "dispatched": 123, "queues": {"a/0": 5}}
NEW = {"version": 1, "dispatched": 456789, "queues": {"a/0": 9, "b/1": 3}, "pad": "x" * 3000}


class Crash(BaseException):
    """Raised by a fault hook to stand for the process dying at that point."""


def test_write_json_round_trip_and_replace(tmp_path):
    path = str(tmp_path / "doc.json")
    assert fsutil.read_json(path) is None
    fsutil.write_json(path, OLD)
    assert fsutil.read_json(path) == OLD
    fsutil.write_json(path, NEW)
    assert fsutil.read_json(path) == NEW
    assert os.listdir(tmp_path) == ["doc.json"]  # no temp file left behind


def test_a_partial_temp_file_from_a_crash_is_ignored_and_replaced(tmp_path):
    path = str(tmp_path / "doc.json")
    fsutil.write_json(path, OLD)
    # A crash while the new document was being written leaves part of it in the temp file.
    fsutil.write_json(str(tmp_path / "full.json"), NEW)
    full_new = (tmp_path / "full.json").read_bytes()
    for cut in (0, 1, 30, len(full_new) // 2, len(full_new) - 1, len(full_new)):
        (tmp_path / "doc.json.tmp").write_bytes(full_new[:cut])
        assert fsutil.read_json(path) == OLD
    fsutil.write_json(path, NEW)
    assert fsutil.read_json(path) == NEW
    assert not os.path.exists(path + ".tmp")


def test_every_truncation_of_the_target_is_detected(tmp_path):
    path = str(tmp_path / "doc.json")
    fsutil.write_json(path, NEW)
    raw = open(path, "rb").read()
    for cut in range(len(raw)):
        with open(path, "wb") as fh:
            fh.write(raw[:cut])
        with pytest.raises(ValueError):
            fsutil.read_json(path)


def test_edits_and_garbage_are_detected(tmp_path):
    path = str(tmp_path / "doc.json")
    fsutil.write_json(path, OLD)
    raw = bytearray(open(path, "rb").read())
    for i in range(len(raw)):
        damaged = bytearray(raw)
        damaged[i] ^= 0x04
        with open(path, "wb") as fh:
            fh.write(damaged)
        try:
            doc = fsutil.read_json(path)
        except ValueError:
            continue
        # The only undetectable change is one that leaves the document meaning the same
        # (e.g. the case of a hex digit in the checksum header).
        assert doc == OLD, i
    for junk in (b"\n", b"{}", b"chronoq-json v1 crc32c=zz\n{}", bytes(100)):
        with open(path, "wb") as fh:
            fh.write(junk)
        with pytest.raises(ValueError):
            fsutil.read_json(path)


def test_a_valid_checksum_over_invalid_json_is_a_value_error(tmp_path):
    import google_crc32c

    body = b"{not json"
    path = tmp_path / "doc.json"
    path.write_bytes(b"chronoq-json v1 crc32c=%08x\n" % google_crc32c.value(body) + body)
    with pytest.raises(ValueError):
        fsutil.read_json(str(path))


def test_crash_before_the_rename_keeps_the_old_document(tmp_path, monkeypatch):
    path = str(tmp_path / "doc.json")
    fsutil.write_json(path, OLD)

    def die(src, dst):
        raise Crash()

    monkeypatch.setattr(fsutil.os, "replace", die)
    with pytest.raises(Crash):
        fsutil.write_json(path, NEW)
    monkeypatch.undo()
    assert fsutil.read_json(path) == OLD


@pytest.mark.parametrize("err, kind", [(errno.ENOSPC, errors.DiskFull), (errno.EIO, errors.StorageError)])
def test_a_failing_write_keeps_the_old_document_and_names_the_error(tmp_path, monkeypatch, err, kind):
    path = str(tmp_path / "doc.json")
    fsutil.write_json(path, OLD)
    real_write = os.write
    calls = []

    def short_then_fail(fd, data):
        calls.append(len(data))
        if len(calls) == 1:
            return real_write(fd, bytes(data[: len(data) // 2]))
        raise OSError(err, os.strerror(err))

    monkeypatch.setattr(fsutil.os, "write", short_then_fail)
    with pytest.raises(kind) as info:
        fsutil.write_json(path, NEW)
    monkeypatch.undo()
    assert len(calls) == 2
    assert path in info.value.message
    assert fsutil.read_json(path) == OLD
    assert sorted(os.listdir(tmp_path)) == ["doc.json"]


def test_order_is_fsync_file_then_rename_then_fsync_dir(tmp_path, monkeypatch):
    """Spies wrap the real os calls (nothing is faked) and record which file each one touched."""
    path = str(tmp_path / "doc.json")
    events = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        return real_fsync(fd)

    def replace(src, dst):
        events.append(("replace", src, dst))
        return real_replace(src, dst)

    monkeypatch.setattr(fsutil.os, "fsync", fsync)
    monkeypatch.setattr(fsutil.os, "replace", replace)
    fsutil.write_json(path, NEW)
    monkeypatch.undo()
    # The data is durable before the rename, and the rename is durable (directory fsync) after.
    assert events == [
        ("fsync", os.path.realpath(path + ".tmp")),
        ("replace", path + ".tmp", path),
        ("fsync", os.path.realpath(str(tmp_path))),
    ], events
    assert fsutil.read_json(path) == NEW


def _checkpoint(path) -> dict:
    cp = fsutil.read_json(os.path.join(str(path), CHECKPOINT_FILE))
    assert isinstance(cp, dict)
    return cp


def test_store_checkpoint_after_clean_close(tmp_path):
    store = open_store(tmp_path, segment_bytes=64 * 1024)
    sent = fill(store, 120, seed=1)
    end = store.log.written
    counts = {}
    for s in sent:
        key = f"{s['topic']}/{s['queue_id']}"
        counts[key] = max(counts.get(key, 0), s["queue_offset"] + 1)
    store.close()
    cp = _checkpoint(tmp_path)
    assert cp["version"] == CHECKPOINT_VERSION
    assert cp["clean"] is True
    assert cp["dispatched"] == cp["log_end"] == end
    assert cp["queues"] == counts
    again = open_store(tmp_path, segment_bytes=64 * 1024)
    assert again.report.clean and again.report.records_replayed == 0
    # Opening marks the store as running: a crash from now on is not mistaken for a clean stop.
    assert _checkpoint(tmp_path)["clean"] is False
    again.close()


def test_store_checkpoint_after_a_crash_is_not_clean(tmp_path):
    store = open_store(tmp_path)
    fill(store, 20, seed=2)
    store.checkpoint()
    cp = _checkpoint(tmp_path)
    assert cp["clean"] is False
    assert cp["dispatched"] == store.log.written
    assert sum(cp["queues"].values()) == 20
    fill(store, 5, seed=2, start=20)
    crash(store)  # dropped without close()
    cp2 = _checkpoint(tmp_path)
    assert cp2 == cp  # nothing wrote a checkpoint since
    again = open_store(tmp_path)
    assert not again.report.clean
    assert again.report.replayed_from == cp["dispatched"]
    assert again.report.records_replayed == 5
    assert sum(again.bounds(t, q)[1] for (t, q) in again.queues) == 25
    again.close()
