"""A full disk refuses the batch with DiskFull and leaves the store as it was (no half records)."""

from __future__ import annotations

import errno
import os

import pytest
from storekit import body_for, crash, fill, open_store, prep, read_all

from chronoq.core import errors
from chronoq.store import commitlog, record


def _enospc(*_args):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


@pytest.mark.parametrize("fault", ["fallocate", "pwrite"])
def test_disk_full_refuses_the_batch_and_keeps_the_store_whole(tmp_path, monkeypatch, fault):
    store = open_store(tmp_path, segment_bytes=64 * 1024)
    sent = fill(store, 30, seed=31)
    before = (store.log.written, {k: store.bounds(*k) for k in store.queues}, read_all(store))
    batch = [prep("a", 0, body_for("F0", 3000), "F0"),
             prep("a", 1, b"later", "F-delayed", flags=record.FLAG_DELAYED, deliver_at_ms=1_800_000_000_000)]
    if fault == "fallocate":
        monkeypatch.setattr(commitlog.os, "posix_fallocate", _enospc)
        store.log._allocated = store.log.active.size  # force a reservation on the next append
    else:
        monkeypatch.setattr(commitlog.os, "pwrite", _enospc)
    with pytest.raises(errors.DiskFull):
        store.append(batch)
    monkeypatch.undo()
    after = (store.log.written, {k: store.bounds(*k) for k in store.queues}, read_all(store))
    assert after == before
    # The same offsets are handed out again once there is space: no gap in the queue.
    lo, hi = store.bounds("a", 0)
    (w,) = store.append(batch[:1])
    assert w.queue_offset == hi
    crash(store)
    store = open_store(tmp_path, segment_bytes=64 * 1024)
    assert store.report.truncated == []
    got = read_all(store)
    assert got[("a", 0, hi)][0] == "F0"
    assert len(got) == len(sent) + 1
    store.close()


@pytest.mark.parametrize("fault", ["create", "fsync_dir", "seal"])
def test_a_failed_segment_roll_keeps_the_log_whole_and_rolls_later(tmp_path, monkeypatch, fault):
    """A roll that fails part way (the new file cannot be made, its directory entry cannot be made
    durable, the old segment cannot be sealed) refuses that batch and leaves every written byte as
    it was; the next batch rolls, and a restart finds everything."""
    store = open_store(tmp_path, segment_bytes=64 * 1024)
    sent = fill(store, 15, seed=7)
    while store.log.left() > 4000:  # up to the roll
        sent += fill(store, 1, seed=len(sent))
    before = (store.log.written, len(store.log.segments), read_all(store))
    if fault == "create":
        real_open = commitlog.os.open
        monkeypatch.setattr(commitlog.os, "open", lambda path, flags, *a: _enospc() if flags & os.O_CREAT
                            else real_open(path, flags, *a))
    elif fault == "fsync_dir":
        monkeypatch.setattr(commitlog.fsutil, "fsync_dir", lambda _path: _enospc())
    else:
        real_fsync = commitlog.os.fsync
        monkeypatch.setattr(commitlog.os, "fsync", lambda fd: _enospc() if fd == store.log._active_fd
                            else real_fsync(fd))
    with pytest.raises(errors.StorageError):
        store.append([prep("a", 0, body_for("R0", 8000), "R0")])
    monkeypatch.undo()
    assert (store.log.written, len(store.log.segments), read_all(store)) == before
    lo, hi = store.bounds("a", 0)
    (w,) = store.append([prep("a", 0, body_for("R1", 8000), "R1")])
    assert w.queue_offset == hi and len(store.log.segments) == before[1] + 1
    store.sync()
    crash(store)
    store = open_store(tmp_path, segment_bytes=64 * 1024)
    assert store.report.truncated == []
    got = read_all(store)
    assert got == {**before[2], ("a", 0, hi): got[("a", 0, hi)]} and got[("a", 0, hi)][0] == "R1"
    store.close()


def test_a_consume_queue_file_whose_directory_fsync_failed_is_synced_again(tmp_path, monkeypatch):
    """A new file's directory entry is fsynced with the files by the checkpoint (off the loop:
    ``take_dirty`` hands the directory after the files); a failed fsync gives it back."""
    from chronoq.store import consumequeue

    cq = consumequeue.ConsumeQueue(str(tmp_path / "q"), "a", 0, 4)
    directory = (consumequeue.DIR_INDEX, str(tmp_path / "q"))
    entry = bytes(range(consumequeue.ENTRY_SIZE))
    monkeypatch.setattr(consumequeue.fsutil, "fsync_dir", lambda _path: _enospc())
    cq.put(0, entry)  # a new file: no fsync here
    assert cq.take_dirty()[-1] == directory
    cq.put(1, entry)
    assert directory not in cq.take_dirty()  # the same file: nothing more for the directory
    cq.put(4, entry)  # a new file
    taken = cq.take_dirty()
    assert taken[-1] == directory
    cq.mark_dirty(index for index, _path in taken)  # the checkpoint's fsync failed: given back
    with pytest.raises(OSError):
        cq.sync()
    synced = []
    monkeypatch.setattr(consumequeue.fsutil, "fsync_dir", synced.append)
    cq.sync()  # retried
    assert synced == [str(tmp_path / "q")]
    cq.sync()
    assert synced == [str(tmp_path / "q")]  # once
    cq.close()
