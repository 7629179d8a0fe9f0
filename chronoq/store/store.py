"""The store: commit log + consume queues + checkpoint, opened through recovery.

Write path (one thread): ``write`` encodes a batch, assigns each message its queue offset and
appends it to the page cache (``write_columns``: the same for a batch given as columns; both in
``chronoq.store.writing``); ``sync`` fsyncs (any thread); ``dispatch`` publishes
consume-queue entries for records up to an offset. The flush policy decides when ``dispatch``
follows ``sync``: under ``sync`` nothing is visible or acknowledged before it is on disk.

``Store`` is the facade over its parts: ``chronoq.store.writing`` (encode and append),
``chronoq.store.reading`` (messages and records back), ``chronoq.store.checkpoint`` (the file
``checkpoint.json``, its format at the top of that module), ``chronoq.store.recovery`` (the
decision table run on open), ``chronoq.store.holds`` (held timer copies),
``chronoq.store.shipping`` (replication's reads and appends). Here: opening, the consume queues,
dispatch, retention.

Held records (``record.FLAG_HELD``, timer copies written ahead of their due time):
``chronoq.store.holds``.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable, Iterable

from chronoq.core import errors, fsutil
from chronoq.core.jobs import Job
from chronoq.core.model import Message
from chronoq.store import checkpoint as checkpoint_file
from chronoq.store import reading, record, routing, truncate
from chronoq.store.checkpoint import CHECKPOINT_FILE, CHECKPOINT_VERSION
from chronoq.store.commitlog import CommitLog
from chronoq.store.consumequeue import ENTRY, ENTRY_SIZE, ConsumeQueue
from chronoq.store.dirlock import DirLock
from chronoq.store.fdbudget import FdBudget
from chronoq.store.holds import Holds
from chronoq.store.newqueues import QueueFileMaker
from chronoq.store.recovery import RecoveryReport, iter_chunks, iter_records, queues_short, verify_log, verify_start
from chronoq.store.retention import Keeper, RetentionPlan, RetentionRoll
from chronoq.store.shipping import Shipping, Tap
from chronoq.store.writing import Columns, Prepared, StoreWriter, Written

# Names other modules import from here.
__all__ = ["Store", "StoreOptions", "Prepared", "Written", "Columns", "CHECKPOINT_FILE", "CHECKPOINT_VERSION",
           "RetentionPlan", "Tap"]

log = logging.getLogger("chronoq.store")

# A replay gap longer than this (entries) is left unfilled; real gaps are a few quarantined records.
_HOLE_FILL_MAX = 1 << 16

@dataclass
class StoreOptions:
    segment_bytes: int = 1 << 30
    cq_entries_per_file: int = 300_000
    verify_extra_segments: int = 0
    quarantine: bool = False
    # How far back (by entry time) ``_restore_holds`` looks for held entries on open: a held
    # record is written at most the timer's longest lead (a burst's, config.TIMER_BURST_LEAD_LIMIT_MS,
    # 10 s) before its due time; the rest is slack for the wall clock. The timer refuses a longer
    # lead than this allows (``chronoq.timer.burstlead.check_hold_window``).
    hold_window_ms: int = 15_000
    # Consume-queue files open at once, all queues together (``fdbudget``); None: a quarter of
    # the process's soft RLIMIT_NOFILE, 64 to 8,192.
    cq_open_files_max: int | None = None


_NEVER = 1 << 63  # an offset no record reaches
_REPLAY_FLUSH = 65536  # entries a replay holds before it writes them to their queues


class Store(Holds, StoreWriter, Shipping):
    """Ensures after ``__init__``: recovery ran (``report``), every record up to the log end is
    dispatched. ``progress(phase, done, total)``, if given, hears of the long parts of recovery:
    phase "verify" (bytes of segments checked) and "replay" (bytes of log re-dispatched into the
    consume queues), once per segment and at the end of each phase; ``done`` and ``total`` count
    bytes of that phase (chronoq.server.progress shows them).
    """

    def __init__(self, data_dir: str, options: StoreOptions | None = None, clock=None,
                 progress: Callable[[str, int, int], None] | None = None, dir_lock: DirLock | None = None):
        from chronoq.core.clock import SYSTEM_CLOCK

        self.options = options or StoreOptions()
        self.clock = clock or SYSTEM_CLOCK
        self.cq_files = FdBudget(self.options.cq_open_files_max)
        self.data_dir = data_dir
        os.makedirs(data_dir, exist_ok=True)
        # One process per data directory (chronoq.store.dirlock), locked before anything in it is
        # read: ours, released by ``close``, unless the opener (the broker) holds it for us.
        if dir_lock is not None and not (dir_lock.held and os.path.samefile(dir_lock.data_dir, data_dir)):
            raise ValueError(f"{dir_lock!r} is not a held lock on {data_dir}")
        self._owns_lock = dir_lock is None
        self.dir_lock = DirLock.acquire(data_dir) if dir_lock is None else dir_lock
        try:
            self._open(progress)
        except BaseException:
            if self._owns_lock:
                self.dir_lock.release()
            raise

    def _open(self, progress) -> None:
        data_dir = self.data_dir
        # A rejoining node's truncation a crash interrupted is finished before the log is read.
        cut = truncate.finish(data_dir)
        self.log = CommitLog(os.path.join(data_dir, "commitlog"), self.options.segment_bytes,
                             self.clock.monotonic_ns)
        self.cq_dir = os.path.join(data_dir, "consumequeue")
        self.queues: dict[tuple[str, int], ConsumeQueue] = {}
        self._next_qoff: dict[tuple[str, int], int] = {}
        self._topic_bytes: dict[str, bytes] = {}
        self._tag_hashes: dict[bytes, int] = {}
        # Written but not yet dispatched: (end offset, {queue key: (first offset, entries)}).
        self._pending: deque[tuple[int, dict]] = deque()
        self.dispatched = 0
        # [start, end) of the records ``append_shipped`` checked before writing them, appended
        # one after another: a dispatch from within it steps over them by length (``iter_records``).
        self._shipped_checked = (0, 0)
        self._guards: list[Callable[[], int | None]] = []
        self._keepers: list[Keeper] = []
        # The FLAG_DELAYED records of each append once it is dispatched, in log order (such records
        # get no consume-queue entry): ``(first offset, span, records, data, heads)``, ``records``
        # their ``(commit offset, size, deliver_at_ms)``, ``data`` their bytes back to back (as the
        # append wrote them), ``heads`` their heads (each record's bytes after the CRC up to its
        # body: flags, fields, topic, id, tag, keys, properties) back to back, ``span`` from the
        # first one's offset to the last one's end (so
        # ``q[0][0]`` is the oldest record queued and ``q[-1][0] + q[-1][1]`` the end of the
        # newest). The timer drains this queue (chronoq.timer.absorb) without reading the log
        # back; the store never calls up into it.
        self.delayed_dispatched: deque[tuple[int, int, list[tuple[int, int, int]], bytes, bytes]] = deque()
        # New queues' first files made off the writer's thread (``make_files_ahead``); None: the
        # dispatch creates them (embedded, replicas, recovery).
        self.new_files: QueueFileMaker | None = None
        # Queues with held entries; ``released`` counts releases (readers' wake-ups key on it).
        self._held: dict[tuple[str, int], ConsumeQueue] = {}
        self.released = 0
        self.report = self._recover(progress)
        if cut is not None:
            self.report.notes.append(f"finished an interrupted truncation of the log at {cut.offset} ({cut.note})")
        self.log.start_writing()
        self.dispatched = self.log.written
        # Where this process found the log's end: bytes past it that a replica holds were shipped
        # by an earlier process before their fsync and lost with its machine (chronoq.replication.shipper).
        self.opened_end = self.log.written
        self._restore_holds()
        self._write_checkpoint(clean=False)

    # ----------------------------------------------------------------- recovery
    def _recover(self, progress) -> RecoveryReport:
        report = RecoveryReport()
        cp = checkpoint_file.read(self.data_dir, bool(self.log.segments), report)
        self._open_queues()
        log_len = self.log.segments[-1].end if self.log.segments else 0
        clean = bool(cp and cp.get("clean") and cp.get("log_end") == log_len) or (cp is None and log_len == 0)
        report.clean = clean
        dispatched = int(cp["dispatched"]) if cp else 0
        expected = dict(cp.get("queues", {})) if cp else {}
        expected_mins = dict(cp.get("queue_mins", {})) if cp else {}
        if not clean:
            verify_from = verify_start(self.log, dispatched, self.options.verify_extra_segments)
            verify_log(self.log, verify_from, self.options.quarantine, report,
                       None if progress is None else
                       (lambda off: progress("verify", off - verify_from, log_len - verify_from)))
        log_end = self.log.segments[-1].end if self.log.segments else 0
        report.log_end = log_end
        replay_from = dispatched
        if cp is None:
            replay_from = self.log.min_offset
        elif dispatched > log_end:  # R10
            report.notes.append(f"checkpoint offset {dispatched} is past the log end {log_end}; rebuilding queues")
            replay_from = self.log.min_offset
        elif queues_short(self.queues, expected, expected_mins):  # R8
            report.notes.append("a consume queue is missing or short; rebuilding queues from the log")
            replay_from = self.log.min_offset
        report.rebuilt_queues = replay_from != dispatched or cp is None
        replay_from = max(replay_from, self.log.min_offset)
        report.replayed_from = replay_from
        report.records_replayed = self._replay(replay_from, progress, log_end)
        for key, cq in self.queues.items():  # R9
            cq.truncate_past(log_end)
            self._next_qoff[key] = cq.next_offset
        self._sync_queues()
        return report

    def _open_queues(self) -> None:
        if not os.path.isdir(self.cq_dir):
            return
        for topic in os.listdir(self.cq_dir):
            tdir = os.path.join(self.cq_dir, topic)
            for qid in os.listdir(tdir):
                if qid.isdigit():
                    self._queue(topic, int(qid))

    def _replay(self, start: int, progress, log_end: int, tap: Tap | None = None, checked_end: int = 0) -> int:
        """Re-dispatch records from ``start`` (recovery's row R9, entries the log no longer backs,
        is ``recover``'s: a replica's dispatch of what it was shipped cannot leave such entries).

        ``progress("replay", done, total)`` (bytes of this replay) is called once per segment
        passed and once at the end: one integer compare per chunk, nothing more. ``tap`` is
        handed, in log order, each record walked that is delayed or carries a delivery time (what
        a timer follows: ``Tap``); the records below ``checked_end`` were checked by this process
        already (``dispatch_shipped``).
        """
        batch: dict[tuple[str, int], tuple[int, bytearray]] = {}
        count, flush_at = 0, _REPLAY_FLUSH
        taps: list[int] | None = [] if tap is not None else None
        ends = [seg.end for seg in self.log.segments if seg.end > start]
        next_end = ends.pop(0) if ends and progress is not None else _NEVER
        for at, chunk, p, stop in iter_chunks(self.log, start, checked_end):
            if at + p >= next_end:  # a segment boundary passed (only when someone listens)
                while next_end <= at + p:
                    next_end = ends.pop(0) if ends else _NEVER
                progress("replay", at + p - start, log_end - start)
            count += routing.route(chunk, p, stop, at, batch, taps, self._add_entry)
            if taps:  # (in log order, after the chunk's entries: the timer and the queues are apart)
                for q in taps:
                    h = record.RecordHeader(chunk, q)
                    tap(at + q, h, chunk[q:q + h.length])
                taps.clear()
            if count >= flush_at:  # bounded memory for a long rebuild
                self._put_entries(batch)
                batch, flush_at = {}, count + _REPLAY_FLUSH
        self._put_entries(batch)
        if progress is not None and log_end > start:
            progress("replay", log_end - start, log_end - start)
        for key, cq in self.queues.items():
            self._next_qoff[key] = cq.next_offset
        return count

    def _add_entry(self, batch: dict, key: tuple[str, int], qoff: int, entry: bytes) -> None:
        run = batch.get(key)
        if run is not None and run[0] + len(run[1]) // ENTRY_SIZE == qoff:
            run[1].extend(entry)
            return
        run_end = None if run is None else run[0] + len(run[1]) // ENTRY_SIZE
        if run_end is not None and run_end < qoff <= run_end + _HOLE_FILL_MAX:
            # A gap (quarantined records): fill it with all-zero entries (holes, skipped on read)
            # so every consume-queue file but the last stays full (see ConsumeQueue.is_whole).
            run[1].extend(bytes((qoff - run_end) * ENTRY_SIZE))
            run[1].extend(entry)
            return
        if run is not None:  # not contiguous: write the run so far, start anew
            self._queue(*key).put(run[0], bytes(run[1]))
        batch[key] = (qoff, bytearray(entry))

    # ----------------------------------------------------------------- queues
    def _queue(self, topic: str, queue_id: int) -> ConsumeQueue:
        key = (topic, queue_id)
        cq = self.queues.get(key)
        if cq is None:
            cq = ConsumeQueue(os.path.join(self.cq_dir, topic, str(queue_id)), topic, queue_id,
                              self.options.cq_entries_per_file, self.cq_files)
            self.queues[key] = cq
            self._next_qoff.setdefault(key, cq.next_offset)
            if self.new_files is not None and not cq.has_files:
                self.new_files.add_queue(key, cq)
        return cq

    def make_files_ahead(self, made: Callable[[], None]) -> None:
        """From now on, the first file of a new queue is made on a worker thread while its batch
        is fsynced (``chronoq.store.newqueues``); ``made()`` (thread-safe) hears of each batch of
        files made, and the writer then calls ``files_made``. A dispatch that waits for them
        (``dispatch(..., wait_files=True)``) stops before the first batch whose files are not
        made; ``files_waited(ticket)`` says whether one below ``ticket`` waits."""
        assert self.new_files is None
        self.new_files = QueueFileMaker(made)
        for key, cq in self.queues.items():
            if not cq.has_files:
                self.new_files.add_queue(key, cq)

    def files_ahead(self, cols: Columns) -> int:
        """Ask for the first files of the queues a prepared batch writes (its records that are
        not delayed) that have none (``QueueFileMaker.ask_ahead``); returns the ``taken`` number
        to wait for before writing it (0: none). The send path's, for batches that create topics."""
        if self.new_files is None:
            return 0
        delayed = record.FLAG_DELAYED
        keys = {(t, q) for t, q, f in zip(cols.topics, cols.queue_ids, cols.flags) if not f & delayed}
        return self.new_files.ask_ahead([(key, self._queue(*key)) for key in keys])

    def files_made(self) -> int:
        """On the writer's thread after ``made()``: take the files made (``QueueFileMaker.take``)."""
        return self.new_files.take() if self.new_files is not None else 0

    def files_waited(self, ticket: int) -> bool:
        """A batch ending at or below ``ticket`` waits for new queues' files (not dispatched yet)."""
        return self.new_files is not None and self.new_files.waits_below(ticket)

    def _put_entries(self, batch: dict) -> None:
        for key, (first, entries) in batch.items():
            self._queue(*key).put(first, bytes(entries))

    def _sync_queues(self) -> None:
        for cq in self.queues.values():
            cq.sync()

    def drop_queues(self, topic: str) -> int:
        """Remove ``topic``'s consume queues (files included) and forget their offsets; returns
        how many entries they held. The records stay in the commit log (retention removes them).
        Refused while a record is written but not dispatched (one of the topic's could follow)
        or a queue of the topic holds timer copies not yet due: the caller retries.
        Ensures: the next checkpoint no longer lists them, so recovery does not rebuild them
        (unless it replays the log from before their records: the topic then comes back)."""
        if self.dispatched < self.log.written or self._pending or (self.new_files is not None and self.new_files.busy()):
            raise errors.TooManyRequests("writes are being made durable; try again")
        keys = [key for key in self.queues if key[0] == topic]
        if any(key in self._held for key in keys):
            raise errors.TooManyRequests(f"timer copies due in a few seconds are held in {topic}; try again")
        entries = 0
        for key in keys:
            cq = self.queues.pop(key)
            self._next_qoff.pop(key, None)
            entries += cq.next_offset - cq.min_offset
            cq.close()
        tdir = os.path.join(self.cq_dir, topic)
        if os.path.isdir(tdir):
            shutil.rmtree(tdir)
            fsutil.fsync_dir(self.cq_dir)
        return entries

    # ----------------------------------------------------------------- durability and visibility
    def sync(self) -> int:
        """fsync the log; return the durable offset. May run in a worker thread."""
        return self.log.sync()

    def dispatch(self, upto: int | None = None, wait_files: bool = False) -> int:
        """Make records below ``upto`` (default: all written) visible in their consume queues.
        ``wait_files``: stop before a batch whose new queues' first files are still being made
        (``make_files_ahead``; the committer's, on the event loop); else such files are made here."""
        limit = self.log.written if upto is None else upto
        new_files = self.new_files
        if new_files is not None:
            cap = new_files.limit() if wait_files else None
            if cap is not None:
                limit = min(limit, cap)
        pending = self._pending
        ready = 0
        for end, _batch, _delayed in pending:
            if end > limit:
                break
            ready += 1
        if not ready:
            return self.dispatched
        # Every batch below the limit at once: a queue's entries from consecutive batches (one
        # group commit of lone sends to a queue, or to a topic of fewer queues than sends) joined
        # into one run, one write per queue, not per batch. The batches leave the pending list
        # only once all their entries are written: if a consume-queue write fails (a full disk),
        # the next call writes them again. Entries are positional, so that is harmless; the
        # delayed records are queued only once.
        runs: dict = {}  # queue -> [first offset, offset after the run, entry bytes]
        for k in range(ready):
            for key, (first, entries) in pending[k][1].items():
                run = runs.get(key)
                if run is not None and run[1] == first:
                    run[1] += len(entries) // ENTRY_SIZE
                    run[2].append(entries)
                    continue
                if run is not None:  # (not contiguous: never from the write path; written as it is)
                    self._queue(*key).put(run[0], b"".join(run[2]))
                runs[key] = [first, first + len(entries) // ENTRY_SIZE, [entries]]
        for key, (first, _end, parts) in runs.items():
            self._queue(*key).put(first, parts[0] if len(parts) == 1 else b"".join(parts))
        for _ in range(ready):
            end, _batch, delayed_records = pending.popleft()
            if delayed_records:
                records, data, heads = delayed_records
                first, last = records[0][0], records[-1]
                self.delayed_dispatched.append((first, last[0] + last[1] - first, records, data, heads))
            self.dispatched = end
        if new_files is not None:
            new_files.dispatched(self.dispatched)
        return self.dispatched

    def scan(self, start: int):
        """Yield ``(commit_offset, RecordHeader, record bytes)`` from ``start`` to the log end.

        For derived data kept outside the store (the timer's schedule log) to catch up after a
        restart from its own cursor.
        """
        for offset, buf in iter_records(self.log, max(start, self.log.min_offset)):
            yield offset, record.RecordHeader(buf, 0), buf

    def scan_flagged(self, lo: int, hi: int, mask: int, pause_every: int = 0):
        """Yield ``(commit offset, record bytes)`` of the records in ``[lo, hi)`` with a flag of
        ``mask`` (``chronoq.store.reading.flagged``: the others are stepped over, not read);
        ``pause_every`` > 0: also ``(offset, None)`` after that many records stepped over in a row."""
        return reading.flagged(self.log, max(lo, self.log.min_offset), hi, mask, pause_every)

    def append(self, messages: Iterable[Prepared], durable: bool = True) -> list[Written]:
        """Write, fsync (when ``durable``) and dispatch: the embedded one-call path."""
        out = self.write(messages)
        if durable:
            self.dispatch(self.sync())
        else:
            self.dispatch()
        return out

    # ----------------------------------------------------------------- reading
    def queue_ids(self, topic: str) -> list[int]:
        return sorted(q for (t, q) in self.queues if t == topic)

    def bounds(self, topic: str, queue_id: int) -> tuple[int, int]:
        cq = self.queues.get((topic, queue_id))
        if cq is None:
            return (0, 0)
        return (cq.min_offset, cq.visible_next)

    def entries(self, topic: str, queue_id: int, offset: int, max_entries: int) -> list[tuple[int, int, int, int]]:
        cq = self.queues.get((topic, queue_id))
        if cq is None:
            return []
        raw = cq.get(offset, max_entries)
        return list(ENTRY.iter_unpack(raw))

    def read(self, topic: str, queue_id: int, offset: int, max_messages: int) -> tuple[list[Message], int]:
        """Messages from logical ``offset``; returns them and the offset to read next
        (``chronoq.store.reading.read``: entries whose record is gone are skipped)."""
        return reading.read(self.log, self.queues.get((topic, queue_id)), topic, queue_id, offset, max_messages)

    def read_runs(self, entries, min_phys: int):
        """Yield (index, bytes, position of the record in them), each record checked, none copied."""
        return reading.read_runs(self.log, entries, min_phys)

    def read_at(self, commit_offset: int, size: int) -> Message:
        return reading.read_at(self.log, commit_offset, size)

    def read_properties(self, commit_offset: int) -> dict[str, str]:
        """The properties of the record at ``commit_offset``, its body not read."""
        return reading.read_properties(self.log, commit_offset)

    def read_record_at(self, commit_offset: int) -> Message:
        """The record that starts at ``commit_offset``, its length taken from its header
        (``chronoq.store.reading.read_record_at``)."""
        return reading.read_record_at(self.log, commit_offset)

    # ----------------------------------------------------------------- checkpoints & retention
    def checkpoint(self, clean: bool = False) -> None:
        """Make consume queues durable, then record how far they are complete."""
        self._sync_queues()
        self._write_checkpoint(clean)

    def checkpoint_job(self, clean: bool = False) -> Job:
        """``checkpoint`` without blocking the writer's thread: the consume-queue fsyncs and the
        file in the job's ``run`` (``chronoq.store.checkpoint.job``)."""
        return checkpoint_file.job(self.data_dir, self.queues, lambda: self._checkpoint_doc(clean))

    def _write_checkpoint(self, clean: bool) -> None:
        checkpoint_file.write(self.data_dir, self._checkpoint_doc(clean))

    def _checkpoint_doc(self, clean: bool) -> dict:
        return checkpoint_file.document(self.dispatched, self.log.synced, self.log.written, self.queues, clean,
                                   self.clock.wall_ms())

    def add_retention_guard(self, guard: Callable[[], int | None]) -> None:
        """Register ``guard() -> lowest commit offset still needed`` (None: needs nothing)."""
        self._guards.append(guard)

    def add_retention_keeper(self, keeper: Keeper) -> None:
        """Register ``keeper(lo, hi) -> iterator of [(offset, record)] batches``: records to append
        before retention deletes ``[lo, hi)`` of the log, each with the offset of the record it
        keeps (the timer rolls its pending messages forward: ``chronoq.timer.roll``), a batch per
        step (``chronoq.store.retention``)."""
        self._keepers.append(keeper)

    def retention(self, max_age_ms: int | None, max_bytes: int | None, now_s: float | None = None) -> list[str]:
        """Delete sealed segments older than ``max_age_ms`` or beyond ``max_bytes`` in total.

        Never deletes the active segment, anything not yet dispatched, or anything at or above
        the lowest offset a retention guard still needs. What a retention keeper still needs
        from the deleted range is appended at the head first, and fsynced, before any segment
        goes (``chronoq.store.retention``). The one-call path: ``retention_plan``, the fsync here, then
        ``retention_apply`` (the server fsyncs on the committer's thread between the two).
        """
        plan = self.retention_plan(max_age_ms, max_bytes, now_s)
        durable = True
        if plan.ticket:
            try:
                self.dispatch(self.sync())
            except errors.StorageError as exc:
                durable = False
                log.warning("retention keeps the log from %d: syncing %d records it still needs failed (%s)",
                            plan.fallback, plan.kept, exc)
        deleted, job = self.retention_apply(plan, durable)
        if job is not None:
            job.run_here()
        return deleted

    def retention_plan(self, max_age_ms: int | None, max_bytes: int | None,
                       now_s: float | None = None) -> RetentionPlan:
        """``retention``'s first step at once: ``retention_begin(...).step()``."""
        return self.retention_begin(max_age_ms, max_bytes, now_s).step()

    def retention_begin(self, max_age_ms: int | None, max_bytes: int | None,
                        now_s: float | None = None) -> RetentionRoll:
        """``retention``'s first step, to run a slice at a time (``RetentionRoll.step``): how far
        the log may go, with what the keepers still need from below there written at the head
        (page cache), a batch per step: the plan's ticket, to make durable before
        ``retention_apply`` deletes anything."""
        floor = self.dispatched
        for guard in self._guards:
            needed = guard()
            if needed is not None:
                floor = min(floor, needed)
        now_s = time.time() if now_s is None else now_s
        total = sum(s.size for s in self.log.segments)
        cut = self.log.min_offset
        for seg in self.log.segments[:-1]:
            too_old = max_age_ms is not None and (now_s - os.path.getmtime(seg.path)) * 1000 > max_age_ms
            too_big = max_bytes is not None and total > max_bytes
            if not (too_old or too_big) or seg.end > floor:
                break
            cut = seg.end
            total -= seg.size
        return RetentionRoll(self, self.log.min_offset, cut, self._keepers)

    def retention_apply(self, plan: "RetentionPlan", durable: bool = True) -> tuple[list[str], Job | None]:
        """``retention``'s second step, once the plan's records are durable (``durable``; else
        only what lies below the first of them goes). Returns the deleted paths and, when any
        went, the checkpoint recording the queues' new starts (else the next recovery takes them
        for lost files, R8) as a job (``checkpoint_job``: its fsyncs on any thread)."""
        cut = plan.cut if durable else plan.fallback
        assert not (durable and plan.ticket) or self.log.synced >= plan.ticket, "roll records not durable"
        deleted = self.log.delete_before(cut)
        if not deleted:
            return [], None
        for cq in self.queues.values():
            cq.delete_below(self.log.min_offset)
        return [s.path for s in deleted], self.checkpoint_job()

    def close(self) -> None:
        if self.new_files is not None:
            self.new_files.close()  # (what it did not make, the dispatch below creates)
        self.dispatch(self.sync())
        self.checkpoint(clean=True)
        self.log.close()
        for cq in self.queues.values():
            cq.close()
        if self._owns_lock:
            self.dir_lock.release()

