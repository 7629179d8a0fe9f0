"""Start-up recovery of the commit log, as a decision table.

The scan walks records with ``record.check`` and classifies the first bad position it meets.
"Valid after" means: some later position in the same segment holds a record that passes every
check (found by searching for the magic/version bytes and validating each candidate).

| #  | case                                   | detected by                                            | action                                                 |
|----|----------------------------------------|--------------------------------------------------------|--------------------------------------------------------|
| R0 | preallocated free space           | from a record boundary to the end, all bytes are zero  | cut silently (space reserved by fallocate, not data)   |
| R1 | clean stop                             | checkpoint says clean and its log end = log length     | nothing to verify; replay nothing                      |
| R2 | crash, log intact                      | unclean; every record from the verify start checks out | re-dispatch from the checkpoint                        |
| R3 | torn tail of the active segment        | short/zero record at the end, nothing valid after      | truncate there, fsync, report the lost bytes           |
| R4 | bit flip in the active tail            | bad CRC in the last record, nothing valid after        | same as R3 (the tail write did not complete whole)     |
| R5 | damage in the middle of active segment | bad record with a valid record after it                | fatal CorruptionError(file, offset); --quarantine: copy aside, mark lost, go on |
| R6 | damage in a sealed segment             | any bad record in a sealed segment                     | fatal CorruptionError(file, offset); --quarantine as R5 |
| R7 | checkpoint missing or unreadable       | fsutil.read_json fails / no file                       | warn; re-dispatch the whole log (rebuild all queues)  |
| R8 | consume queue missing or short         | fewer entries than the checkpoint recorded             | re-dispatch the whole log (positional, idempotent)    |
|    |                                        | (next below, or start above, it), or a missing/short   |                                                        |
|    |                                        | file before a queue's last one                         |                                                        |
| R9 | consume-queue entries past the log     | entries beyond what the replayed log produces          | truncate those consume-queue files                    |
| R10| checkpoint past the log end            | dispatched offset > recovered log end (async loss)     | warn; re-dispatch the whole log                        |
| R11| unfinished append at the active tail   | the last whole record carries ``FLAG_CONTINUES`` (its  | truncate back to the append's first record (with R0/R3/ |
|    |                                        | append's last record is missing: a torn ``pwrite``)    | R4 too: they cut there, not at the torn record), fsync, |
|    |                                        |                                                        | report the lost bytes                                  |

An append (one ``Store.write``: a batch, a staged chunk with its marker, a group of timer copies)
is one ``pwrite`` and is acknowledged only after it; ``kill -9`` during a large ``pwrite`` leaves a
prefix of it, and R11 makes sure no whole record of that prefix survives (a sealed segment always
ends with a whole append: the roll fsyncs it). Records without the flag (older files) are appends
of one record each.

Which records are verified: on an unclean start, every record from the dispatch checkpoint's
offset to the end (the checkpoint only names fsynced records, so nothing below it can be torn by a
crash), or from further back with ``verify_extra_segments`` (``verify_start``). Older records
are verified when read (``CommitLog.read_record``) and fail with the same named error.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from typing import Callable, Iterator

from chronoq.core import errors
from chronoq.store import record
from chronoq.store.commitlog import CommitLog, LostRange, Segment, find_in

_MAGIC_BYTES = bytes([record.MAGIC, record.VERSION])
_LENGTH = struct.Struct("<I")  # a record's first field: its length


@dataclass
class RecoveryReport:
    clean: bool = False
    verified_from: int = 0
    replayed_from: int = 0
    records_replayed: int = 0
    log_end: int = 0
    truncated: list[LostRange] = field(default_factory=list)
    quarantined: list[LostRange] = field(default_factory=list)
    rebuilt_queues: bool = False
    notes: list[str] = field(default_factory=list)

    def summary(self) -> str:
        parts = [
            "clean stop" if self.clean else "recovered after an unclean stop",
            f"log end {self.log_end}",
            f"replayed {self.records_replayed} records from {self.replayed_from}",
        ]
        for lost in self.truncated:
            parts.append(f"truncated torn tail {lost.start}..{lost.end} of {lost.path} ({lost.reason})")
        for lost in self.quarantined:
            parts.append(f"quarantined {lost.start}..{lost.end} of {lost.path} ({lost.reason})")
        parts.extend(self.notes)
        return "; ".join(parts)


def find_next_valid(buf, start: int, end: int) -> int | None:
    """Position of the first valid record at or after ``start``, or None."""
    pos = start
    while True:
        hit = find_in(buf, _MAGIC_BYTES, pos + 4, end)  # (not buf.find: see find_in)
        if hit < 0:
            return None
        candidate = hit - 4
        try:
            record.check(buf, candidate, end)
            return candidate
        except record.RecordError:
            pos = candidate + 1


def verify_segment(
    log: CommitLog, seg: Segment, start_pos: int, is_active: bool, quarantine: bool, report: RecoveryReport
) -> None:
    """Check every record of ``seg`` from ``start_pos``; repair or fail per the table above."""
    buf = log.map_segment(seg)
    end = seg.size
    pos = start_pos
    # Where the last append seen so far ends (``start_pos`` is a record boundary below which
    # everything was fsynced, so an append's end); an append whose last record is missing (R11)
    # is cut back to here.
    group_start = pos
    try:
        while pos < end:
            lost = _lost_at(log, seg.base + pos)
            if lost is not None:
                pos = group_start = lost.end - seg.base
                continue
            try:
                length = record.check(buf, pos, end)
            except record.RecordError as exc:
                reason = exc.reason
            else:
                pos += length
                if not record.continues(buf, pos - length):
                    group_start = pos
                continue
            nxt = find_next_valid(buf, pos + 1, end)
            if nxt is None and is_active and group_start == pos and _all_zero(buf, pos, end):  # R0
                _close(buf)
                buf = b""
                log.truncate_active(pos)
                return
            if nxt is None and is_active:  # R3 / R4 (and R11: the whole records of its append too)
                if group_start < pos:
                    reason += f"; cut back to the start of its unfinished append, {pos - group_start} bytes before"
                report.truncated.append(LostRange(seg.base + group_start, seg.base + end, seg.path, reason))
                _close(buf)
                buf = b""
                log.truncate_active(group_start)
                return
            if not quarantine:  # R5 / R6
                raise errors.CorruptionError(seg.path, pos, reason)
            stop = end if nxt is None else nxt
            report.quarantined.append(log.quarantine(seg, pos, stop, reason))
            pos = group_start = stop
        if is_active and group_start < end:  # R11: the append's last record never reached the file
            report.truncated.append(LostRange(seg.base + group_start, seg.base + end, seg.path,
                                              "unfinished append: its last record is missing (torn write)"))
            _close(buf)
            buf = b""
            log.truncate_active(group_start)
    finally:
        _close(buf)


def _all_zero(buf, start: int, end: int) -> bool:
    chunk = 1 << 20
    zeros = bytes(chunk)
    for pos in range(start, end, chunk):
        piece = buf[pos:min(end, pos + chunk)]
        if piece != zeros[:len(piece)]:
            return False
    return True


def _close(buf) -> None:
    if hasattr(buf, "close"):
        buf.close()


def _lost_at(log: CommitLog, offset: int) -> LostRange | None:
    for lost in log.lost:
        if lost.start <= offset < lost.end:
            return lost
    return None


READ_CHUNK = 1 << 20  # bytes a replay reads at a time (a record larger than this is read whole)


def iter_records(log: CommitLog, start: int, checked_end: int = 0) -> Iterator[tuple[int, bytes]]:
    """Yield ``(commit_offset, record bytes)`` for each record from ``start`` to the end of the
    log, lost ranges skipped (``iter_chunks``'s records one by one)."""
    unpack = _LENGTH.unpack_from
    for at, chunk, p, stop in iter_chunks(log, start, checked_end):
        while p < stop:
            length = unpack(chunk, p)[0]
            yield at + p, chunk[p:p + length]
            p += length


def iter_chunks(log: CommitLog, start: int, checked_end: int = 0) -> Iterator[tuple[int, bytes, int, int]]:
    """Yield ``(offset of chunk[0], chunk, p, stop)`` from ``start`` to the end of the log: whole
    records ``chunk[p:stop]``, each checked, lost ranges skipped. The log must already have been
    verified over this range (damage is a fatal ``errors.CorruptionError``, as on a read); records
    below ``checked_end``, a record boundary up to which this process checked every record as it
    wrote it (``Store.append_shipped``), are stepped over by their length field (``record.span``)
    and the others checked a run at a time (``record.check_all``): no Python step per record. A
    dispatch walks the chunk once more (``chronoq.store.routing``).

    Read with ``pread`` in chunks of ``READ_CHUNK``, not mapped: a replica dispatches every few
    kilobytes it is shipped (``Store.dispatch_shipped``), and mapping then unmapping the whole
    segment cost it more than reading those bytes (~0.1 ms a dispatch). A chunk ends at a record
    boundary: the record it cuts is read again at the head of the next (a record larger than a
    chunk whole).
    """
    for seg in list(log.segments):
        if seg.end <= start:
            continue
        pos = max(0, start - seg.base)
        want = READ_CHUNK
        while pos < seg.size:
            limit = seg.size
            if log.lost:
                lost = _lost_at(log, seg.base + pos)
                if lost is not None:
                    pos = lost.end - seg.base
                    continue
                limit = min([limit] + [r.start - seg.base for r in log.lost if seg.base + pos < r.start < seg.end])
            chunk = log.read(seg.base + pos, min(want, limit - pos))
            size, whole = len(chunk), pos + len(chunk) >= limit  # (whole: no bytes of this range lie past it)
            p = record.span(chunk, 0, max(0, min(size, checked_end - seg.base - pos)))
            try:
                p = record.check_all(chunk, p, size)
            except record.RecordError as exc:
                if not exc.torn or whole:
                    # A rebuild (R7, R8, R10) also replays segments the start-up scan did not
                    # verify: damage there is the same named, fatal error as on a read.
                    raise errors.CorruptionError(seg.path, pos + exc.at, exc.reason) from None
                p = exc.at  # (the chunk cut this record: read on from it)
            if p:
                yield seg.base + pos, chunk, 0, p
                pos += p
                want = READ_CHUNK
            else:  # a record larger than the chunk: read it whole
                length = _LENGTH.unpack_from(chunk, 0)[0] if size >= 4 else 0
                if not (want < length <= record.RECORD_SIZE_MAX):
                    raise errors.CorruptionError(seg.path, pos, f"record length {length} at a chunk's head")
                want = length


def verify_log(
    log: CommitLog, verify_from: int, quarantine: bool, report: RecoveryReport,
    progress: Callable[[int], None] | None = None,
) -> None:
    """Verify every record from ``verify_from`` (a record boundary) to the end of the log."""
    if not log.segments:
        return
    report.verified_from = verify_from
    last = len(log.segments) - 1
    for i, seg in enumerate(list(log.segments)):
        if seg.end <= verify_from and i != last:
            continue
        start = min(verify_from - seg.base, seg.size) if verify_from > seg.base else 0
        verify_segment(log, seg, start, i == last, quarantine, report)
        if progress is not None:
            progress(seg.end)


def verify_start(log: CommitLog, dispatched: int, extra: int) -> int:
    """Where the start-up CRC scan begins after an unclean stop.

    The checkpoint's ``dispatched`` is a record boundary below which everything was fsynced
    before the checkpoint was written, so a crash cannot have torn it: by default the scan
    starts there (what lies below is checked when read). ``verify_extra_segments`` (``extra``) = N > 0
    starts it at the beginning of the segment holding that offset (N = 1) or N - 1 segments
    earlier. A checkpoint past the log end (R10) scans the whole log: it is rebuilt anyway.
    """
    segs = log.segments
    if not segs or dispatched > segs[-1].end:
        return 0
    if extra <= 0:
        return dispatched
    idx = len(segs) - 1
    for i, seg in enumerate(segs):
        if seg.base <= dispatched < seg.end:
            idx = i
            break
    return segs[max(0, idx - (extra - 1))].base


def queues_short(queues: dict, expected: dict, expected_mins: dict) -> bool:
    """Row R8: a queue lost entries the checkpoint counted (a missing, cut or lost file)."""
    for key, count in expected.items():
        topic, _, qid = key.rpartition("/")
        cq = queues.get((topic, int(qid)))
        if cq is None:
            if int(count) > 0:
                return True
            continue  # a queue that never got an entry has no files (nothing was lost)
        if cq.next_offset < int(count):
            return True
        # Only retention moves a queue's start up, and it writes a checkpoint when it does.
        if cq.min_offset > int(expected_mins.get(key, cq.min_offset)):
            return True
    return not all(cq.is_whole() for cq in queues.values())
