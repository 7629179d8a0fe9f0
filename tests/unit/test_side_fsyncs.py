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


# ------------------------------------------------------------------------------ POP log compaction
POP_COMPACT_BYTES = 2048  # journal.COMPACT_MIN_BYTES for these tests: a few dozen CKs and acks


def _pop_log_grows(node, rounds: int, handles: list | None = None) -> None:
    """Log ``rounds`` CKs (aged out of the merge buffer) and their ACKs; keep one handle unacked
    in ``handles`` when given."""
    from popkit import BUFFER_MS

    got = []
    for i in range(rounds):
        node.broker.send("orders", f"c{i}".encode())
        got += node.pop.receive("grp", "orders", max_messages=1, invisible_ms=600_000)
    node.advance(BUFFER_MS + 100)  # aged into the log and flushed
    keep = got.pop() if handles is not None else None
    for p in got:
        node.pop.ack("grp", "orders", p.receipt_handle)
    if keep is not None:
        handles.append(keep)
    node.advance(200)


def test_a_compaction_whose_file_cannot_be_made_keeps_the_old_generation_and_its_ids(tmp_path, monkeypatch):
    """Crash window: the snapshot is encoded (on the loop) but its file is not in place. The old
    generation stays the newest on disk, holding every record synced; new CK ids keep the old
    generation, so the restart's generation (one past it) never meets an id this process handed
    out; nothing unacked is lost."""
    from popkit import Node

    from chronoq.pop import handle as handles
    from chronoq.pop import journal, poplog

    monkeypatch.setattr(journal, "COMPACT_MIN_BYTES", POP_COMPACT_BYTES)
    node = Node(str(tmp_path)).open()
    pop_dir = node.pop.pop_dir
    first = poplog._generations(pop_dir)[-1]
    fsyncs = Fsyncs(monkeypatch)
    fsyncs.fail(lambda p: p.endswith(poplog.SUFFIX + poplog.TMP_SUFFIX))  # the snapshot's file cannot be made
    kept: list = []
    _pop_log_grows(node, 40, kept)
    assert fsyncs.on(lambda p: p.endswith(poplog.SUFFIX + poplog.TMP_SUFFIX))  # a compaction was attempted ...
    assert poplog._generations(pop_dir) == [first]  # ... and the old file is still current
    assert node.pop._inflight.generation == first  # ids still of the old generation
    node.broker.send("orders", b"after")
    [late] = node.pop.receive("grp", "orders", max_messages=1, invisible_ms=600_000)
    node.advance(3_000)
    node.crash()
    fsyncs.fail(lambda p: False)
    node.open()
    assert poplog._generations(node.pop.pop_dir) == [first + 1]
    with pytest.raises(errors.InvalidReceiptHandle):  # its CK never reached a durable file
        node.pop.ack("grp", "orders", late.receipt_handle)
    node.pop.ack("grp", "orders", kept[0].receipt_handle)  # recovered from the old generation
    [again] = node.pop.receive("grp", "orders", max_messages=32, invisible_ms=60_000)
    assert again.message.body == b"after"
    # Ids of the generation the restart opened are new: none was handed out before the crash.
    assert {handles.decode(h.receipt_handle)[0] >> 32 for h in (late, kept[0])} == {first}
    assert handles.decode(again.receipt_handle)[0] >> 32 == first + 1
    node.pop.check()
    node.close()


def test_a_compaction_makes_its_file_once_it_can_and_then_mints_ids_of_the_new_generation(tmp_path, monkeypatch):
    from popkit import Node

    from chronoq.pop import journal, poplog

    monkeypatch.setattr(journal, "COMPACT_MIN_BYTES", POP_COMPACT_BYTES)
    node = Node(str(tmp_path)).open()
    first = poplog._generations(node.pop.pop_dir)[-1]
    fsyncs = Fsyncs(monkeypatch)
    fsyncs.fail(lambda p: p.endswith(poplog.SUFFIX + poplog.TMP_SUFFIX))
    kept: list = []
    _pop_log_grows(node, 40, kept)
    assert node.pop._inflight.generation == first
    fsyncs.fail(lambda p: False)
    node.advance(1_000)  # the retry makes the file
    assert poplog._generations(node.pop.pop_dir) == [first + 1]
    assert node.pop._inflight.generation == first + 1
    node.pop.ack("grp", "orders", kept[0].receipt_handle)  # a CK of the old generation, in the snapshot
    node.advance(200)
    node.crash()
    node.open()
    node.advance(700_000)
    assert node.pop.receive("grp", "orders", max_messages=32, invisible_ms=60_000) == []
    node.close()


FSYNC_THREAD = "chronoq-fsync"  # chronoq/broker/committer.py
WAIT_STEPS = 3_000  # loop turns a test waits at most (each sleeps 1 ms or more)


def test_a_compaction_under_the_committer_fsyncs_only_on_its_thread(tmp_path, monkeypatch):
    """The server's arrangement (``ConsumerLoops``: the POP log synced by the committer's thread):
    the snapshot's file, its directory and the old file's last records are all fsynced there."""
    import asyncio

    from chronoq.broker.committer import GroupCommitter
    from chronoq.broker.outgoing import OutgoingMessage
    from chronoq.pop import journal, poplog
    from chronoq.pop.service import PopService
    from chronoq.server.consumers import ConsumerLoops
    from chronoq.features.transactions import Transactions

    monkeypatch.setattr(journal, "COMPACT_MIN_BYTES", POP_COMPACT_BYTES)
    b = Broker(BrokerConfig(data_dir=str(tmp_path)))
    pop = PopService(b, b.clock, buffer_ms=5, flush_interval_ms=5)
    first = pop._inflight.generation
    pop_dir = pop.pop_dir

    def pop_file(p: str) -> bool:
        return p == pop_dir or p.endswith(poplog.SUFFIX) or p.endswith(poplog.SUFFIX + poplog.TMP_SUFFIX)

    async def main():
        committer = GroupCommitter(b)
        committer.start()
        loops = ConsumerLoops(pop, Transactions(b), committer, b.clock)
        loops.start()
        fsyncs = Fsyncs(monkeypatch)
        try:
            for _ in range(WAIT_STEPS):
                if pop._inflight.generation > first:
                    break
                await committer.send([OutgoingMessage("orders", b"x", queue_id=0)])
                got = pop.receive("grp", "orders", max_messages=1, invisible_ms=600_000)
                await asyncio.sleep(0.02)  # aged out of the merge buffer and flushed by the ticker
                for p in got:
                    pop.ack("grp", "orders", p.receipt_handle)
            else:
                raise AssertionError("no compaction")
        finally:
            loops.close()
            await committer.close()
        return fsyncs

    fsyncs = asyncio.run(main())
    try:
        assert poplog._generations(pop_dir)[-1] > first
        made = [t for t, p in fsyncs.seen if p.endswith(poplog.SUFFIX + poplog.TMP_SUFFIX)]
        assert made and set(fsyncs.on(pop_file)) == {FSYNC_THREAD}, fsyncs.seen
    finally:
        pop.close()
        b.close()
