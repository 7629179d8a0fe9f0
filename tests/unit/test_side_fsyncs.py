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

    @staticmethod
    def through(committer) -> None:
        """Route the committer's fsync thread's rounds through Python, where ``os.fsync`` is the
        recording one (compiled, its plain fsyncs are C calls this cannot see)."""
        committer.fsyncer.before_fsync = lambda _fd: None

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


FSYNC_THREAD = "chronoq-fsync"  # chronoq/store/fsyncer.py
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
        Fsyncs.through(committer)
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


# ------------------------------------------------------------------------------ schedule files
class FileEvents(Fsyncs):
    """``Fsyncs`` plus every ``os.write`` to a bucket file and every ``os.unlink``, in one list of
    (what, thread name, path)."""

    def __init__(self, monkeypatch):
        super().__init__(monkeypatch)
        self.events: list[tuple[str, str, str]] = []
        fsync, write, writev, unlink = os.fsync, os.write, os.writev, os.unlink

        def recording_fsync(fd):
            self.events.append(("fsync", threading.current_thread().name, os.readlink(f"/proc/self/fd/{fd}")))
            return fsync(fd)

        def recording_write(fd, data):
            path = os.readlink(f"/proc/self/fd/{fd}")
            if path.endswith(".sch"):
                self.events.append(("write", threading.current_thread().name, path))
            return write(fd, data)

        def recording_writev(fd, buffers):  # (bucket files are appended to by writev)
            path = os.readlink(f"/proc/self/fd/{fd}")
            if path.endswith(".sch"):
                self.events.append(("write", threading.current_thread().name, path))
            return writev(fd, buffers)

        def recording_unlink(path, *args, **kwargs):
            self.events.append(("unlink", threading.current_thread().name, os.fspath(path)))
            return unlink(path, *args, **kwargs)

        monkeypatch.setattr(os, "fsync", recording_fsync)
        monkeypatch.setattr(os, "write", recording_write)
        monkeypatch.setattr(os, "writev", recording_writev)
        monkeypatch.setattr(os, "unlink", recording_unlink)

    def first(self, what: str, predicate) -> int:
        return next(i for i, (w, _t, p) in enumerate(self.events) if w == what and predicate(p))

    def threads(self, what: str, predicate) -> set[str]:
        return {t for w, t, p in self.events if w == what and predicate(p)}


def _journal(path: str) -> bool:
    return path.endswith(os.path.join("timer", "appends.journal"))


def _serve_timer(b, body, *, fail_side=None):
    """Run ``body(committer)`` on a loop with a started committer wired to the timer as the
    server wires it (``Runtime.serve``); ``fail_side(path)``: fsyncs of those paths raise EIO
    on the committer's thread."""
    import asyncio

    from chronoq.broker.committer import GroupCommitter

    timer = b.timer
    if fail_side is not None:
        real_sync_side = timer.files.sync_side
        fsync = os.fsync

        def failing_sync_side():
            def failing(fd):
                if fail_side(os.readlink(f"/proc/self/fd/{fd}")):
                    raise OSError(5, "injected EIO")
                return fsync(fd)
            os.fsync = failing
            try:
                real_sync_side()
            finally:
                os.fsync = fsync
        sync_side = failing_sync_side
    else:
        sync_side = timer.files.sync_side

    async def main():
        committer = GroupCommitter(b)
        committer.start()
        remove = committer.add_log(sync_side)
        timer.attach_files_syncer(lambda: committer.after_durable(lambda _s, _e: timer.files_synced()))
        try:
            return await body(committer)
        finally:
            timer.attach_files_syncer(None)
            remove()
            await committer.close()

    return asyncio.run(main())


async def _maintain(b, committer, rounds: int, until=lambda: False) -> None:
    """``rounds`` passes of the server's periodic work (jobs on a worker thread) and timer ticks
    (their tickets handed to the committer, as ``Runtime._timer_loop`` does)."""
    import asyncio

    def synced(upto: int, exc: BaseException | None) -> None:
        if exc is None:
            b.timer_synced(upto)
        else:
            b.timer_sync_failed(exc)

    for _ in range(rounds):
        for job in b.maintenance_jobs():
            try:
                await asyncio.get_running_loop().run_in_executor(None, job.run)
            except BaseException as exc:  # noqa: BLE001 - the job keeps its state for a retry
                job.finish(exc)
            else:
                job.finish(None)
        if b.timer_step().ticket:
            committer.after_durable(synced)
        await asyncio.sleep(0.005)
        if until():
            return


def test_bucket_files_are_appended_to_only_after_their_journal_record_is_fsynced_on_the_committers_thread(
        tmp_path, monkeypatch):
    from timerkit import T0, TOPIC, open_broker

    from chronoq.core.clock import FakeClock

    clock = FakeClock(T0)
    b = open_broker(tmp_path, clock, timer_prewrite_ms=0)
    for i in range(3):  # three far buckets, written by maintenance
        b.send(TOPIC, f"far{i}".encode(), deliver_at_ms=T0 + 3_600_000 + i * 60_000)
    events = FileEvents(monkeypatch)

    async def body(committer):
        clock.advance(10_000)  # a timer checkpoint is due: its buckets are written
        await _maintain(b, committer, 200, until=lambda: len(b.timer.files._journaled) >= 3 and not b.timer._buffered_starts)

    _serve_timer(b, body)
    assert events.threads("fsync", _journal) == {FSYNC_THREAD}
    journal_synced = events.first("fsync", _journal)
    assert events.first("write", lambda p: True) > journal_synced  # no byte before its rollback point
    assert len({p for w, _t, p in events.events if w == "write"}) == 3
    b.close()


def test_a_failed_journal_fsync_keeps_the_entries_buffered_and_a_crash_then_loses_nothing(tmp_path, monkeypatch):
    """Crash window: journal records written, their fsync failed (or not reported yet). No bucket
    file was appended to; a restart replays the messages from the commit log, each delivered once
    and none before it is due."""
    from timerkit import T0, TOPIC, crash, drain, open_broker, visible

    from chronoq.core.clock import FakeClock

    clock = FakeClock(T0)
    b = open_broker(tmp_path, clock, timer_prewrite_ms=0)
    due = [T0 + 3_600_000 + i * 60_000 for i in range(3)]
    for i, at in enumerate(due):
        b.send(TOPIC, f"far{i}".encode(), deliver_at_ms=at)
    events = FileEvents(monkeypatch)

    async def body(committer):
        clock.advance(10_000)
        await _maintain(b, committer, 30, until=lambda: bool(b.timer._files_retry_ms))

    _serve_timer(b, body, fail_side=_journal)
    assert b.timer._files_retry_ms  # the failure reached the timer ...
    assert [e for e in events.events if e[0] == "write"] == []  # ... and no bucket file was written
    assert not events.threads("fsync", _journal) - {FSYNC_THREAD}
    crash(b)
    b = open_broker(tmp_path, clock, timer_prewrite_ms=0)
    for i, at in enumerate(due):
        clock.set(at - 1)
        drain(b)
        assert len(visible(b)) == i  # nothing early
        clock.set(at)
        drain(b)
        assert sorted(m.body for m in visible(b)) == [f"far{j}".encode() for j in range(i + 1)]
    b.close()


def test_a_finished_buckets_file_goes_only_after_its_done_file_is_fsynced_on_the_committers_thread(
        tmp_path, monkeypatch):
    from timerkit import T0, TOPIC, crash, open_broker, visible

    from chronoq.core.clock import FakeClock
    from chronoq.timer.service import RecallOutcome

    clock = FakeClock(T0)
    b = open_broker(tmp_path, clock, timer_prewrite_ms=0)
    handle = b.send(TOPIC, b"gone", deliver_at_ms=T0 + 1_000).recall_handle
    b.send(TOPIC, b"kept", deliver_at_ms=T0 + 2_000)
    assert b.recall(handle).outcome is RecallOutcome.CANCELLED
    b.checkpoint()  # the bucket file holds the message and its tombstone
    events = FileEvents(monkeypatch)

    def is_done(p):
        return p.endswith(".done")

    async def body(committer):
        clock.advance(180_000)  # the bucket is due, delivered and finished
        await _maintain(b, committer, 300, until=lambda: any(w == "unlink" and p.endswith(".sch") for w, _t, p in events.events))

    _serve_timer(b, body)
    assert events.threads("fsync", is_done) == {FSYNC_THREAD}
    assert events.first("fsync", is_done) < events.first("unlink", lambda p: p.endswith(".sch"))
    assert [m.body for m in visible(b)] == [b"kept"]
    crash(b)
    b = open_broker(tmp_path, clock, timer_prewrite_ms=0)
    assert b.recall(handle).outcome is RecallOutcome.CANCELLED  # the .done file answers a late recall
    assert [m.body for m in visible(b)] == [b"kept"]
    b.close()


def test_a_crash_before_the_done_file_is_fsynced_keeps_the_bucket_file(tmp_path, monkeypatch):
    """Crash window: the ``.done`` file written, its fsync failed (or not reported): the bucket
    file is still there, so the restart finishes the bucket again from it; the recalled message
    stays recalled, the delivered one is not delivered again."""
    from timerkit import T0, TOPIC, crash, drain, open_broker, visible

    from chronoq.core.clock import FakeClock
    from chronoq.timer.service import RecallOutcome

    clock = FakeClock(T0)
    b = open_broker(tmp_path, clock, timer_prewrite_ms=0)
    handle = b.send(TOPIC, b"gone", deliver_at_ms=T0 + 1_000).recall_handle
    b.send(TOPIC, b"kept", deliver_at_ms=T0 + 2_000)
    assert b.recall(handle).outcome is RecallOutcome.CANCELLED
    b.checkpoint()
    events = FileEvents(monkeypatch)

    async def body(committer):
        clock.advance(180_000)
        await _maintain(b, committer, 60, until=lambda: bool(b.timer._files_retry_ms))

    _serve_timer(b, body, fail_side=lambda p: p.endswith(".done"))
    assert b.timer._files_retry_ms and b.timer.buckets_finished == 1
    sch = [name for name in os.listdir(b.timer.sched_dir) if name.endswith(".sch")]
    assert sch and not [e for e in events.events if e[0] == "unlink" and e[2].endswith(".sch")]
    crash(b)
    b = open_broker(tmp_path, clock, timer_prewrite_ms=0)
    drain(b)
    assert [m.body for m in visible(b)] == [b"kept"]  # not delivered twice, the recalled one never
    assert b.recall(handle).outcome is RecallOutcome.CANCELLED
    b.close()


# ------------------------------------------------------------------------------ retention
def test_served_retention_fsyncs_its_roll_records_on_the_committers_thread_and_checkpoints_off_the_loop(
        tmp_path, monkeypatch):
    """``GroupCommitter.retention``: the roll records fsynced on the committer's thread before any
    segment goes; the checkpoint naming the queues' new starts returned as a job (run here on a
    worker thread, as ``Runtime._periodic`` does); the pending timer survives in the log."""
    import asyncio

    from timerkit import T0

    from chronoq.broker.committer import GroupCommitter
    from chronoq.broker.digest import derived_digest
    from chronoq.broker.outgoing import OutgoingMessage
    from chronoq.core.clock import FakeClock

    clock = FakeClock(T0)
    cfg = BrokerConfig(data_dir=str(tmp_path), segment_bytes=64 * 1024, retention_max_bytes=1)
    b = Broker(cfg, clock=clock)
    b.send("later", b"far", deliver_at_ms=T0 + 3_600_000)
    for _ in range(20):  # a few segments of plain messages after it
        b.send_batch([OutgoingMessage("orders", bytes(1024)) for _ in range(16)])
    b.timer.checkpoint()
    b.checkpoint()
    pending = derived_digest(b)["timers"]
    fsyncs = Fsyncs(monkeypatch)

    async def main():
        committer = GroupCommitter(b)
        committer.start()
        Fsyncs.through(committer)
        try:
            deleted, job = await committer.retention()
            assert deleted and job is not None
            await asyncio.get_running_loop().run_in_executor(None, job.run)
            job.finish(None)
        finally:
            await committer.close()

    asyncio.run(main())
    commitlog = os.path.join(str(tmp_path), "commitlog") + os.sep
    assert set(fsyncs.on(lambda p: p.startswith(commitlog))) == {FSYNC_THREAD}  # the roll records
    checkpoint_doc = os.path.join(str(tmp_path), store_checkpoint.CHECKPOINT_FILE + ".tmp")
    assert fsyncs.on(lambda p: p == checkpoint_doc) and "MainThread" not in fsyncs.on(lambda p: p == checkpoint_doc)
    assert b.store.log.min_offset > 0 and derived_digest(b)["timers"] == pending
    b.close()
