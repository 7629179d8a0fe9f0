"""A full disk refuses the batch with DiskFull and leaves the store as it was (no half records)."""

from __future__ import annotations

import errno
import os

import pytest
from storekit import body_for, crash, fill, open_store, prep, read_all

from chronoq import errors
from chronoq.store import commitlog, record


def _enospc(*_args):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


@pytest.mark.parametrize("fault", ["fallocate", "pwrite"])
def test_disk_full_refuses_the_batch_and_keeps_the_store_whole(tmp_path, monkeypatch, fault):
    store = open_store(tmp_path, segment_bytes=64 * 1024)
    store.delayed_sink = lambda records: None
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
