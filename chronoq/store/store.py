"""The store: commit log + consume queues + checkpoint, opened through recovery.

Write path (one thread): ``write`` encodes a batch, assigns each message its queue offset and
appends it to the page cache (``write_plain``: the same for plain records of one topic, given as
columns); ``sync`` fsyncs (any thread); ``dispatch`` publishes consume-queue
entries for records up to an offset. The flush policy decides when ``dispatch`` follows ``sync``:
under ``sync`` nothing is visible or acknowledged before it is on disk.

Checkpoint file ``checkpoint.json`` (``fsutil.write_json``)::

    {"version": 1, "dispatched": <log offset>, "log_end": <log offset>, "clean": <bool>,
     "queues": {"<topic>/<queue id>": <next logical offset>, ...},
     "queue_mins": {"<topic>/<queue id>": <first logical offset>, ...}}

``queue_mins`` may be absent (older checkpoints); then a queue's start is not checked.

Held records (``record.FLAG_HELD``, timer copies written ahead of their due time) are stamped
with their due time and held in their consume queue until ``release_held`` passes it; holds
live in memory and are rebuilt on open from the queue tails (``_restore_holds``).

Every consume-queue file is fsynced before a checkpoint naming its entries is written, so after
a crash the queues hold at least what the checkpoint says, and replay from ``dispatched`` is
positional and idempotent.
"""

from __future__ import annotations

import bisect
import itertools
import logging
import os
import struct
import time
import zlib
from collections import deque
import dataclasses
from dataclasses import dataclass
from typing import Callable, Iterable, NamedTuple

from chronoq.core import errors, fsutil
from chronoq.core.jobs import Job
from chronoq.core.model import Message
from chronoq.store import record
from chronoq.store.commitlog import CommitLog
from chronoq.store.consumequeue import ENTRY, ENTRY_SIZE, ConsumeQueue
from chronoq.store.dirlock import DirLock
from chronoq.store.recovery import RecoveryReport, iter_records, verify_log

log = logging.getLogger("chronoq.store")

CHECKPOINT_FILE = "checkpoint.json"
CHECKPOINT_VERSION = 1
# Reads: records at most READ_GAP_MAX bytes apart share one pread, of at most READ_SPAN_MAX bytes.
READ_GAP_MAX = 32 * 1024
READ_SPAN_MAX = 256 * 1024
# A replay gap longer than this (entries) is left unfilled; real gaps are a few quarantined records.
_HOLE_FILL_MAX = 1 << 16
_pack_entry = ENTRY.pack
_encode = record.encode


class Prepared(NamedTuple):
    """A message validated and encoded by the broker, waiting for its queue offset."""

    topic: str
    queue_id: int
    flags: int
    born_ms: int
    deliver_at_ms: int
    message_id: bytes
    tag: bytes
    keys: bytes
    properties: bytes
    body: bytes


# Store.read builds Messages positionally, in this order.
assert tuple(f.name for f in dataclasses.fields(Message)) == (
    "topic", "queue_id", "queue_offset", "commit_offset", "message_id", "body", "tag", "keys", "properties",
    "born_ms", "stored_ms", "deliver_at_ms", "flags")
# Store.write unpacks a Prepared positionally (faster than one named lookup per field).
assert Prepared._fields == ("topic", "queue_id", "flags", "born_ms", "deliver_at_ms", "message_id", "tag", "keys",
                            "properties", "body")


class Written(NamedTuple):
    commit_offset: int
    queue_offset: int
    size: int


@dataclass
class StoreOptions:
    segment_bytes: int = 1 << 30
    cq_entries_per_file: int = 300_000
    verify_extra_segments: int = 0
    quarantine: bool = False
    # How far back (by entry time) ``_restore_holds`` looks for held entries on open: a held
    # record is written at most the timer's prewrite lead (config.TIMER_PREWRITE_MAX_MS) before
    # its due time; the rest is slack for the wall clock.
    hold_window_ms: int = 15_000


_NEVER = 1 << 63  # an offset no record reaches


class Store:
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
        self._guards: list[Callable[[], int | None]] = []
        # (commit offset, size, deliver_at_ms) of each FLAG_DELAYED record once it is dispatched,
        # in log order: such records get no consume-queue entry. The timer drains this queue
        # (chronoq.timer.absorb); the store never calls up into it.
        self.delayed_dispatched: deque[tuple[int, int, int]] = deque()
        # Queues with held entries; ``released`` counts releases (readers' wake-ups key on it).
        self._held: dict[tuple[str, int], ConsumeQueue] = {}
        self.released = 0
        self.report = self._recover(progress)
        self.log.start_writing()
        self.dispatched = self.log.written
        self._restore_holds()
        self._write_checkpoint(clean=False)

    # ----------------------------------------------------------------- recovery
    def _recover(self, progress) -> RecoveryReport:
        report = RecoveryReport()
        cp = self._read_checkpoint(report)
        self._open_queues()
        log_len = self.log.segments[-1].end if self.log.segments else 0
        clean = bool(cp and cp.get("clean") and cp.get("log_end") == log_len) or (cp is None and log_len == 0)
        report.clean = clean
        dispatched = int(cp["dispatched"]) if cp else 0
        expected = dict(cp.get("queues", {})) if cp else {}
        expected_mins = dict(cp.get("queue_mins", {})) if cp else {}
        if not clean:
            verify_from = self._verify_start(dispatched)
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
        elif self._queues_short(expected, expected_mins):  # R8
            report.notes.append("a consume queue is missing or short; rebuilding queues from the log")
            replay_from = self.log.min_offset
        report.rebuilt_queues = replay_from != dispatched or cp is None
        replay_from = max(replay_from, self.log.min_offset)
        report.replayed_from = replay_from
        report.records_replayed = self._replay(replay_from, progress, log_end)
        self._sync_queues()
        return report

    def _read_checkpoint(self, report: RecoveryReport) -> dict | None:
        path = os.path.join(self.data_dir, CHECKPOINT_FILE)
        try:
            cp = fsutil.read_json(path)
        except ValueError as exc:  # R7
            report.notes.append(f"checkpoint unreadable ({exc}); rebuilding queues from the log")
            return None
        if cp is not None and (not isinstance(cp, dict) or cp.get("version") != CHECKPOINT_VERSION):
            report.notes.append("checkpoint has an unknown version; rebuilding queues from the log")
            return None
        if cp is None and self.log.segments:
            report.notes.append("no checkpoint; rebuilding queues from the log")
        return cp

    def _verify_start(self, dispatched: int) -> int:
        """Where the start-up CRC scan begins after an unclean stop.

        The checkpoint's ``dispatched`` is a record boundary below which everything was fsynced
        before the checkpoint was written, so a crash cannot have torn it: by default the scan
        starts there (what lies below is checked when read). ``verify_extra_segments`` = N > 0
        starts it at the beginning of the segment holding that offset (N = 1) or N - 1 segments
        earlier. A checkpoint past the log end (R10) scans the whole log: it is rebuilt anyway.
        """
        segs = self.log.segments
        if not segs or dispatched > segs[-1].end:
            return 0
        extra = self.options.verify_extra_segments
        if extra <= 0:
            return dispatched
        idx = len(segs) - 1
        for i, seg in enumerate(segs):
            if seg.base <= dispatched < seg.end:
                idx = i
                break
        return segs[max(0, idx - (extra - 1))].base

    def _open_queues(self) -> None:
        if not os.path.isdir(self.cq_dir):
            return
        for topic in os.listdir(self.cq_dir):
            tdir = os.path.join(self.cq_dir, topic)
            for qid in os.listdir(tdir):
                if qid.isdigit():
                    self._queue(topic, int(qid))

    def _queues_short(self, expected: dict, expected_mins: dict) -> bool:
        """Row R8: a queue lost entries the checkpoint counted (a missing, cut or lost file)."""
        for key, count in expected.items():
            topic, _, qid = key.rpartition("/")
            cq = self.queues.get((topic, int(qid)))
            if cq is None:
                if int(count) > 0:
                    return True
                continue  # a queue that never got an entry has no files (nothing was lost)
            if cq.next_offset < int(count):
                return True
            # Only retention moves a queue's start up, and it writes a checkpoint when it does.
            if cq.min_offset > int(expected_mins.get(key, cq.min_offset)):
                return True
        return not all(cq.is_whole() for cq in self.queues.values())

    def _replay(self, start: int, progress, log_end: int) -> int:
        """Re-dispatch records from ``start``; then cut queue entries the log no longer backs.

        ``progress("replay", done, total)`` (bytes of this replay) is called once per segment
        passed and once at the end: one integer compare per record, nothing more.
        """
        batch: dict[tuple[str, int], tuple[int, bytearray]] = {}
        count = 0
        ends = [seg.end for seg in self.log.segments if seg.end > start]
        next_end = ends.pop(0) if ends and progress is not None else _NEVER
        for offset, buf in iter_records(self.log, start):
            if offset >= next_end:  # a segment boundary passed (only when someone listens)
                while next_end <= offset:
                    next_end = ends.pop(0) if ends else _NEVER
                progress("replay", offset - start, log_end - start)
            h = record.RecordHeader(buf, 0)
            if h.flags & record.FLAG_DELAYED:  # the timer absorbs these itself (see scan)
                continue
            entry = _pack_entry(offset, h.length, zlib.crc32(h.tag), h.stored_ms)
            self._add_entry(batch, (h.topic, h.queue_id), h.queue_offset, entry)
            count += 1
            if count % 65536 == 0:  # bounded memory for a long rebuild
                self._put_entries(batch)
                batch = {}
        self._put_entries(batch)
        if progress is not None and log_end > start:
            progress("replay", log_end - start, log_end - start)
        for cq in self.queues.values():  # R9
            cq.truncate_past(log_end)
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
                              self.options.cq_entries_per_file)
            self.queues[key] = cq
            self._next_qoff.setdefault(key, cq.next_offset)
        return cq

    def _put_entries(self, batch: dict) -> None:
        for key, (first, entries) in batch.items():
            self._queue(*key).put(first, bytes(entries))

    def _sync_queues(self) -> None:
        for cq in self.queues.values():
            cq.sync()

    # ----------------------------------------------------------------- writing
    def write(self, messages: Iterable[Prepared]) -> list[Written]:
        """Append a batch to the log (page cache). Not durable or visible until sync/dispatch."""
        now = self.clock.wall_ms()
        next_qoff = self._next_qoff
        topic_bytes = self._topic_bytes
        tag_hashes = self._tag_hashes
        pack_tail, pack_prefix, crc, extend = record._pack_tail, record._pack_prefix, record._crc, record._extend
        magic, version, size_max, crc_start = record.MAGIC, record.VERSION, record.RECORD_SIZE_MAX, record.CRC_START
        delayed = record.FLAG_DELAYED
        held_flag = record.FLAG_HELD
        pieces: list[bytes] = []
        add_piece = pieces.append
        meta = []
        add_meta = meta.append
        sizes: list[int] = []
        add_size = sizes.append
        holds = False
        for m in messages:
            # One unpack instead of a named-field lookup per use: this loop runs per message.
            topic, queue_id, flags, born_ms, deliver_at_ms, message_id, tag, keys, props, body = m
            stamp = now
            if flags & held_flag:
                assert deliver_at_ms > 0 and not flags & delayed, "a held copy is a visible copy with a due time"
                stamp = deliver_at_ms
                holds = True
            if flags & delayed:
                # Not in any consume queue yet: the timer re-puts a copy when it falls due.
                key, qoff, tag_hash, time_ms = None, 0, 0, deliver_at_ms
            else:
                key = (topic, queue_id)
                qoff = next_qoff.get(key)
                if qoff is None:
                    qoff = self._queue(*key).next_offset
                next_qoff[key] = qoff + 1
                tag_hash = tag_hashes.get(tag)
                if tag_hash is None:
                    if len(tag_hashes) > 4096:
                        tag_hashes.clear()
                    tag_hash = tag_hashes[tag] = zlib.crc32(tag)
                time_ms = stamp
            tb = topic_bytes.get(topic)
            if tb is None:
                tb = topic_bytes[topic] = topic.encode()
            # record.encode_parts, inlined (a call per message costs as much as its body); the
            # record-equivalence tests hold both to the same bytes.
            head = pack_tail(flags, queue_id, qoff, born_ms, stamp, deliver_at_ms, len(tb), len(message_id),
                             len(tag), len(keys), len(props), len(body)) + tb + message_id + tag + keys + props
            size = crc_start + len(head) + len(body)
            if size > size_max:
                raise ValueError(f"record of {size} bytes exceeds {size_max}")
            add_piece(pack_prefix(size, magic, version, extend(crc(head), body)))
            add_piece(head)
            add_piece(body)
            add_meta((key, qoff, size, tag_hash, time_ms))
            add_size(size)
        if not meta:
            return []
        ends = list(itertools.accumulate(sizes))  # ends[k]: bytes of records 0..k
        out: list[Written] = []
        add_out, new_tuple = out.append, tuple.__new__
        batch: dict[tuple[str, int], tuple[int, bytearray]] = {}
        delayed_records: list[tuple[int, int, int]] = []
        i = 0
        pos = 0
        try:
            while i < len(meta):
                # Fill what fits in the active segment (at least one record); a roll happens
                # between chunks only.
                j = max(i + 1, bisect.bisect_right(ends, (ends[i - 1] if i else 0) + self.log.room(), i))
                pos = self.log.append(b"".join(pieces[3 * i:3 * j]))
                if holds:  # before dispatch can put their entries: never visible unreleased
                    self._hold_written(meta, i, j, now)
                for k in range(i, j):
                    key, qoff, length, tag_hash, time_ms = meta[k]
                    # tuple.__new__: a NamedTuple's own __new__ is a Python-level call, per message.
                    add_out(new_tuple(Written, (pos, qoff, length)))
                    if key is None:
                        delayed_records.append((pos, length, time_ms))
                        pos += length
                        continue
                    run = batch.get(key)
                    entry = _pack_entry(pos, length, tag_hash, time_ms)
                    if run is not None and run[0] + len(run[1]) // ENTRY_SIZE == qoff:
                        run[1].extend(entry)
                    else:
                        self._add_entry(batch, key, qoff, entry)
                    pos += length
                i = j
        except errors.StorageError:
            for key, qoff, *_ in meta[i:]:  # give back the offsets of what was not written
                if key is not None:  # (delayed records took no queue offset)
                    next_qoff[key] = min(next_qoff[key], qoff)
            if out:
                self._pending.append((pos, batch, delayed_records))
            raise
        self._pending.append((pos, batch, delayed_records))
        return out

    def write_plain(self, topic: str, queue_ids: list[int], born_ms: list[int], message_ids: list[bytes],
                    tags: list[bytes], bodies: list[bytes]) -> tuple[list[int], list[int]]:
        """``write`` for plain records of one topic (flags 0; no keys, properties or delay), from
        columns instead of ``Prepared`` tuples: the same records byte for byte, the same queue
        offsets and pending dispatch, without a tuple per message in or out (the SendMessage
        fast path, chronoq.server.grpc_server). Returns (commit offsets, queue offsets).
        """
        n = len(bodies)
        assert len(queue_ids) == len(born_ms) == len(message_ids) == len(tags) == n
        if not n:
            return [], []
        now = self.clock.wall_ms()
        tb = self._topic_bytes.get(topic)
        if tb is None:
            tb = self._topic_bytes[topic] = topic.encode()
        tlen = len(tb)
        next_qoff = self._next_qoff
        nxt: dict[int, int] = {}
        for qid in set(queue_ids):
            qoff = next_qoff.get((topic, qid))
            nxt[qid] = self._queue(topic, qid).next_offset if qoff is None else qoff
        first = dict(nxt)
        tag_hash = {t: zlib.crc32(t) for t in set(tags)}
        pack_tail, pack_prefix, crc, extend = record._pack_tail, record._pack_prefix, record._crc, record._extend
        magic, version, size_max = record.MAGIC, record.VERSION, record.RECORD_SIZE_MAX
        pieces: list[bytes] = []
        add = pieces.append
        sizes: list[int] = []
        add_size = sizes.append
        qoffs: list[int] = []
        add_qoff = qoffs.append
        # The loop of record.encode_parts, inlined: a call per message costs as much as its body.
        for qid, born, mid, tag, body in zip(queue_ids, born_ms, message_ids, tags, bodies):
            qoff = nxt[qid]
            nxt[qid] = qoff + 1
            head = pack_tail(0, qid, qoff, born, now, 0, tlen, len(mid), len(tag), 0, 0, len(body)) + tb + mid + tag
            total = record.CRC_START + len(head) + len(body)
            if total > size_max:
                raise ValueError(f"record of {total} bytes exceeds {size_max}")
            add(pack_prefix(total, magic, version, extend(crc(head), body)))
            add(head)
            add(body)
            add_size(total)
            add_qoff(qoff)
        commits: list[int] = []
        add_commit = commits.append
        runs: dict[int, bytearray] = {qid: bytearray() for qid in nxt}
        pack_entry = _pack_entry
        i = pos = 0
        try:
            while i < n:
                j, room, size = i, self.log.room(), 0
                # Fill what fits in the active segment; a roll happens between chunks only.
                while j < n and (size + sizes[j] <= room or j == i):
                    size += sizes[j]
                    j += 1
                pos = self.log.append(b"".join(pieces[3 * i:3 * j]))
                for k in range(i, j):
                    length = sizes[k]
                    add_commit(pos)
                    runs[queue_ids[k]] += pack_entry(pos, length, tag_hash[tags[k]], now)
                    pos += length
                i = j
        finally:
            # Queue offsets of records not written (a storage error) are given back; what was
            # written waits for dispatch like any batch.
            batch: dict[tuple[str, int], tuple[int, bytearray]] = {}
            for qid, run in runs.items():
                next_qoff[(topic, qid)] = first[qid] + len(run) // ENTRY_SIZE
                if run:
                    self._add_entry(batch, (topic, qid), first[qid], run)
            if commits:
                self._pending.append((pos, batch, []))
        return commits, qoffs

    def _hold_written(self, meta: list, i: int, j: int, now: int) -> None:
        for key, qoff, _size, _tag_hash, time_ms in meta[i:j]:
            if key is not None and time_ms > now:  # only held copies are stamped ahead of now
                cq = self._queue(*key)
                cq.hold(qoff, time_ms)
                self._held[key] = cq

    def release_held(self, now_ms: int) -> bool:
        """Release held entries due by ``now_ms``; True when something became visible."""
        if not self._held:
            return False
        released = False
        for key, cq in list(self._held.items()):
            if cq.release(now_ms):
                released = True
            if not cq.held:
                del self._held[key]
        if released:
            self.released += 1
        return released

    def held_records(self, topic: str, due_ms: int):
        """Records of ``topic`` held (dispatched, not yet released) with due time ``due_ms``."""
        for (t, _q), cq in self._held.items():
            if t != topic:
                continue
            for qoff, due in cq.held:
                if due == due_ms and qoff < cq.next_offset:
                    phys, size, _tag, _time = ENTRY.unpack(cq.read_including_held(qoff, 1))
                    yield self.log.read_record(phys, size)

    @property
    def holding(self) -> bool:
        """Whether any consume queue holds entries (``release_held`` has work ahead)."""
        return bool(self._held)

    def next_held_ms(self) -> int | None:
        """The earliest due time of a held entry (when ``release_held`` next has work)."""
        return min((cq.held[0][1] for cq in self._held.values()), default=None)

    def _restore_holds(self) -> None:
        """Hold again the HELD records of each queue's tail that are not due yet (after a restart).

        A held record is written at most ``hold_window_ms`` before its due time, and every entry
        after it in its queue was written later, so walking back from a tail while entry times
        are within the window finds every held entry still due in the future.
        """
        now = self.clock.wall_ms()
        floor = now - self.options.hold_window_ms
        for key, cq in self.queues.items():
            found: list[tuple[int, int]] = []
            off = cq.next_offset
            while off > cq.min_offset:
                # Within one consume-queue file (a read never crosses one).
                n = min(256, off - cq.min_offset, (off - 1) % cq.per_file + 1)
                raw = cq.read_including_held(off - n, n)
                assert len(raw) == n * ENTRY_SIZE
                entries = list(ENTRY.iter_unpack(raw))
                stop = False
                for k in range(len(entries) - 1, -1, -1):
                    phys, size, _tag, time_ms = entries[k]
                    if time_ms <= floor:
                        stop = True
                        break
                    if time_ms > now and size and phys >= self.log.min_offset:
                        try:
                            flags = record.RecordHeader(self.log.read_record(phys, size), 0).flags
                        except errors.CorruptionError:
                            continue
                        if flags & record.FLAG_HELD:
                            found.append((off - n + k, time_ms))
                if stop:
                    break
                off -= n
            for qoff, due in reversed(found):
                cq.hold(qoff, due)
            if cq.held:
                self._held[key] = cq

    def sync(self) -> int:
        """fsync the log; return the durable offset. May run in a worker thread."""
        return self.log.sync()

    def dispatch(self, upto: int | None = None) -> int:
        """Make records below ``upto`` (default: all written) visible in their consume queues."""
        limit = self.log.written if upto is None else upto
        pending = self._pending
        while pending and pending[0][0] <= limit:
            end, batch, delayed_records = pending[0]
            # A batch leaves the pending list only once it is fully dispatched: if a consume-queue
            # write fails (a full disk), the next call retries it. Entries are positional, so
            # writing them again is harmless; the delayed records are queued only once.
            if batch:
                self._put_entries(batch)
                pending[0] = (end, None, delayed_records)
            pending.popleft()
            if delayed_records:
                self.delayed_dispatched.extend(delayed_records)
            self.dispatched = end
        return self.dispatched

    def scan(self, start: int):
        """Yield ``(commit_offset, RecordHeader, record bytes)`` from ``start`` to the log end.

        For derived data kept outside the store (the timer's schedule log) to catch up after a
        restart from its own cursor.
        """
        for offset, buf in iter_records(self.log, max(start, self.log.min_offset)):
            yield offset, record.RecordHeader(buf, 0), buf

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
        """Messages from logical ``offset``; returns them and the offset to read next.

        Entries whose record was deleted by retention or quarantined are skipped.
        """
        cq = self.queues.get((topic, queue_id))
        if cq is None or max_messages <= 0:
            return [], offset
        offset = max(offset, cq.min_offset)
        raw = cq.get(offset, max_messages)
        entries = list(ENTRY.iter_unpack(raw))
        out: list[Message] = []
        add = out.append
        min_phys = self.log.min_offset
        check_decode = record.check_decode
        for i, j, blob, phys, seg in self._spans(entries, min_phys):
            for k in range(i, j):
                pos = entries[k][0] - phys
                try:
                    (flags, r_queue_id, r_offset, born_ms, stored_ms, deliver_at_ms, r_topic, message_id, tag, keys,
                     props, body) = check_decode(blob, pos, pos + entries[k][1])
                except record.RecordError as exc:
                    raise errors.CorruptionError(seg.path, entries[k][0] - seg.base, exc.reason) from None
                if r_offset != offset + k or r_topic != topic or r_queue_id != queue_id:
                    # A damaged consume queue must not hand out another queue's message.
                    raise errors.CorruptionError(
                        cq.directory, (offset + k) * ENTRY_SIZE,
                        f"consume-queue entry {offset + k} of {topic}/{queue_id} points at message "
                        f"{r_offset} of {r_topic}/{r_queue_id}; the consume queue is "
                        "damaged (it is derived data: delete its directory while the broker is stopped to rebuild it)")
                # Positional, in _MESSAGE_FIELDS order: this runs for every message read.
                add(Message(r_topic, r_queue_id, r_offset, entries[k][0], message_id, body, tag, keys, props,
                            born_ms, stored_ms, deliver_at_ms, flags))
        return out, offset + len(entries)

    def read_runs(self, entries, min_phys: int):
        """Yield (index, bytes, position of the record in them), each record checked, none copied."""
        check = record.check
        for i, j, blob, phys, seg in self._spans(entries, min_phys):
            for k in range(i, j):
                pos = entries[k][0] - phys
                try:
                    check(blob, pos, pos + entries[k][1])
                except record.RecordError as exc:
                    raise errors.CorruptionError(seg.path, entries[k][0] - seg.base, exc.reason) from None
                yield k, blob, pos

    def _spans(self, entries, min_phys: int):
        """Yield (i, j, bytes, their log offset, segment): entries[i:j] read with one pread.

        Records near each other in the log are read together, gaps included: a queue's
        messages are interleaved with other queues' (round robin), so they are rarely adjacent,
        and one pread of the span costs less than a pread per record while gaps are small.
        Entries that are holes, retained away or lost are left out. Nothing is checked here.
        """
        i = 0
        n = len(entries)
        log = self.log
        while i < n:
            phys, size = entries[i][0], entries[i][1]
            # size 0 is a hole (never a real entry): the record was quarantined before a rebuild.
            if size == 0 or phys < min_phys or log.lost and log.is_lost(phys):
                i += 1
                continue
            j = i + 1
            end = phys + size
            seg = log.segment_for(phys)
            limit = min(seg.end, phys + READ_SPAN_MAX)
            while j < n:
                next_phys, next_size = entries[j][0], entries[j][1]
                if not (end <= next_phys <= end + READ_GAP_MAX and next_size and next_phys + next_size <= limit) or (
                        log.lost and log.is_lost(next_phys)):
                    break
                end = next_phys + next_size
                j += 1
            yield i, j, log.read(phys, end - phys), phys, seg
            i = j

    def read_at(self, commit_offset: int, size: int) -> Message:
        data = self.log.read_record(commit_offset, size)
        f = record.decode(data)
        return Message(topic=f["topic"], queue_id=f["queue_id"], queue_offset=f["queue_offset"],
                       commit_offset=commit_offset, message_id=f["message_id"], body=f["body"], tag=f["tag"],
                       keys=f["keys"], properties=f["properties"], born_ms=f["born_ms"],
                       stored_ms=f["stored_ms"], deliver_at_ms=f["deliver_at_ms"], flags=f["flags"])

    def read_record_at(self, commit_offset: int) -> Message:
        """The record that starts at ``commit_offset``, its length taken from its header (for
        callers that kept only the offset: the broker's dedupe window). ``errors.NotFound``
        when that part of the log is gone (retention) or was never written."""
        head = self.log.read(commit_offset, record.HEADER_SIZE)
        return self.read_at(commit_offset, record.HEADER.unpack_from(head)[0])

    # ----------------------------------------------------------------- checkpoints & retention
    def checkpoint(self, clean: bool = False) -> None:
        """Make consume queues durable, then record how far they are complete."""
        self._sync_queues()
        self._write_checkpoint(clean)

    def checkpoint_job(self, clean: bool = False) -> Job:
        """``checkpoint`` without blocking the writer's thread (see ``chronoq.core.jobs``).

        Here: take the consume-queue files written since the last checkpoint and the document
        to write, as of now. ``run`` (any thread): fsync those files by path, then write the
        document. Every entry the document claims was written before ``run`` starts, so the
        fsync covers it; entries written meanwhile may be synced along, which is harmless.
        ``finish`` with an error marks the files dirty again for the next checkpoint.
        """
        taken = [(cq, cq.take_dirty()) for cq in self.queues.values()]
        paths = [path for _cq, files in taken for _index, path in files]
        doc = self._checkpoint_doc(clean)
        target = os.path.join(self.data_dir, CHECKPOINT_FILE)

        def run() -> None:
            for path in paths:
                fsutil.fsync_path(path)
            fsutil.write_json(target, doc)

        def finish(exc: BaseException | None) -> None:
            if exc is not None:
                for cq, files in taken:
                    cq.mark_dirty(index for index, _path in files)

        return Job("store checkpoint", run, finish)

    def _write_checkpoint(self, clean: bool) -> None:
        fsutil.write_json(os.path.join(self.data_dir, CHECKPOINT_FILE), self._checkpoint_doc(clean))

    def _checkpoint_doc(self, clean: bool) -> dict:
        dispatched = min(self.dispatched, self.log.synced)
        if dispatched < self.dispatched:
            # Async policy: queues may be ahead of the durable log. Only claim what is synced,
            # with the queue sizes as of ``dispatched`` unknown, so record the lower safe bound.
            queues = {}
        else:
            queues = {f"{t}/{q}": cq.next_offset for (t, q), cq in self.queues.items()}
        # Queue starts too, so a lost first consume-queue file is detected (row R8).
        queue_mins = {f"{t}/{q}": cq.min_offset for (t, q), cq in self.queues.items()} if queues else {}
        return {
            "version": CHECKPOINT_VERSION, "dispatched": dispatched, "log_end": self.log.written,
            "clean": clean, "queues": queues, "queue_mins": queue_mins, "written_at_ms": self.clock.wall_ms(),
        }

    def add_retention_guard(self, guard: Callable[[], int | None]) -> None:
        """Register ``guard() -> lowest commit offset still needed`` (None: needs nothing)."""
        self._guards.append(guard)

    def retention(self, max_age_ms: int | None, max_bytes: int | None, now_s: float | None = None) -> list[str]:
        """Delete sealed segments older than ``max_age_ms`` or beyond ``max_bytes`` in total.

        Never deletes the active segment, anything not yet dispatched, or anything at or above
        the lowest offset a retention guard still needs.
        """
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
        deleted = self.log.delete_before(cut)
        if deleted:
            for cq in self.queues.values():
                cq.delete_below(self.log.min_offset)
            # Record the queues' new starts, or the next recovery takes them for lost files (R8).
            self.checkpoint()
        return [s.path for s in deleted]

    def close(self) -> None:
        self.dispatch(self.sync())
        self.checkpoint(clean=True)
        self.log.close()
        for cq in self.queues.values():
            cq.close()
        if self._owns_lock:
            self.dir_lock.release()

