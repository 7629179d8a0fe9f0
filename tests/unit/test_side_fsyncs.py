"""The fsyncs beside the commit log's run off the broker's thread (issue 21 §2): a new consume-queue
file's directory entry, the timer's append journal and ``.done`` files, POP log compaction and the
retention roll-forward. Each test records which thread fsyncs which path (``os.fsync`` wrapped; the
fsync itself still runs) and checks the order the crash reasoning relies on.
"""

from __future__ import annotations

import os
import threading

import pytest

from chronoq.broker.broker import Broker
from chronoq.core import errors
from chronoq.core.config import BrokerConfig
from chronoq.store import checkpoint as store_checkpoint


class Fsyncs:
    """Every ``os.fsync`` from now on as (thread name, path); ``fail(predicate)`` makes the fsyncs
    of matching paths raise EIO."""

    def __init__(self, monkeypatch):
        self.seen: list[tuple[str, str]] = []
        self._failing = None
        real = os.fsync

        def recording(fd):
            path = os.readlink(f"/proc/self/fd/{fd}")
            self.seen.append((threading.current_thread().name, path))
            if self._failing is not None and self._failing(path):
                raise OSError(5, "injected EIO")
            return real(fd)

        monkeypatch.setattr(os, "fsync", recording)

    def fail(self, predicate) -> None:
        self._failing = predicate

    def on(self, predicate) -> list[str]:
        return [thread for thread, path in self.seen if predicate(path)]

    def paths(self) -> list[str]:
        return [path for _thread, path in self.seen]


def _in_thread(fn) -> None:
    """Run ``fn`` on a thread named like a worker (as ``chronoq.core.jobs`` runs a job's ``run``)."""
    box: list[BaseException] = []

    def run():
        try:
            fn()
        except BaseException as exc:  # noqa: BLE001 - handed back
            box.append(exc)

    t = threading.Thread(target=run, name="worker")
    t.start()
    t.join(30)
    assert not t.is_alive()
    if box:
        raise box[0]


def _cq_dir(b: Broker, topic: str, queue_id: int) -> str:
    return b.store.queues[(topic, queue_id)].directory


# ------------------------------------------------------------------------------ consume queues
def test_a_new_consume_queue_files_directory_is_fsynced_by_the_checkpoint_job_before_its_document(
        tmp_path, monkeypatch):
    b = Broker(BrokerConfig(data_dir=str(tmp_path)))
    try:
        b.create_topic("t", 1)
        fsyncs = Fsyncs(monkeypatch)
        b.send("t", b"one")  # makes the queue's first file (embedded: write, fsync, dispatch here)
        cq_dir = _cq_dir(b, "t", 0)
        assert fsyncs.on(lambda p: p == cq_dir) == []  # not on the broker's thread
        job = b.store.checkpoint_job()
        _in_thread(job.run)
        job.finish(None)
        assert fsyncs.on(lambda p: p == cq_dir) == ["worker"]
        paths = fsyncs.paths()
        doc = paths.index(os.path.join(str(tmp_path), store_checkpoint.CHECKPOINT_FILE + ".tmp"))
        assert paths.index(cq_dir) < doc  # the entry is durable before a checkpoint names its entries
        b.send("t", b"two")  # same file: the directory needs nothing more
        job = b.store.checkpoint_job()
        _in_thread(job.run)
        job.finish(None)
        assert fsyncs.on(lambda p: p == cq_dir) == ["worker"]
    finally:
        b.close()


def test_a_failed_directory_fsync_keeps_the_checkpoint_back_and_is_retried(tmp_path, monkeypatch):
    b = Broker(BrokerConfig(data_dir=str(tmp_path)))
    try:
        b.create_topic("t", 1)
        fsyncs = Fsyncs(monkeypatch)
        b.send("t", b"one")
        cq_dir = _cq_dir(b, "t", 0)
        before = b.store.log.synced
        fsyncs.fail(lambda p: p == cq_dir)
        job = b.store.checkpoint_job()
        with pytest.raises(errors.StorageError):
            _in_thread(job.run)
        job.finish(errors.StorageError("injected"))
        doc = os.path.join(str(tmp_path), store_checkpoint.CHECKPOINT_FILE + ".tmp")
        assert doc not in fsyncs.paths()  # no document claims the file's entries
        fsyncs.fail(lambda p: False)
        job = b.store.checkpoint_job()
        _in_thread(job.run)
        job.finish(None)
        assert fsyncs.on(lambda p: p == cq_dir) == ["worker", "worker"]
        assert b.store.log.synced >= before
    finally:
        b.close()
