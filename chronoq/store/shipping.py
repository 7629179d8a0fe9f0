"""A replica's copy of the commit log: what a primary ships and how a replica appends and
dispatches it, the ``Shipping`` half of ``chronoq.store.store.Store``.

The primary reads whole records of one segment below its written end (``read_shipped``), never
cutting an append in two where it can help it; the replica checks every record before writing
it (``append_shipped``: nothing invalid reaches its log) and, once its own fsync covers them,
makes them visible by the same walk recovery replays (``dispatch_shipped``), handing the records
a timer follows to its ``Tap`` (the replica's ``TimerService.follow``). The protocol around
these calls is ``chronoq.replication``'s.
"""

from __future__ import annotations

from typing import Callable

from chronoq.core import errors
from chronoq.store import record

# Handed the records a dispatch walks that a timer follows, the delayed ones and those with a
# delivery time (a timer's delivered copy keeps its message's): (commit offset, RecordHeader, bytes).
Tap = Callable[[int, record.RecordHeader, bytes], None]


class Shipping:
    """Mixed into ``Store``: uses its ``log``, ``dispatched``, ``_replay`` and owns
    ``_shipped_checked`` (set by ``Store._open``)."""

    def read_shipped(self, offset: int, max_bytes: int) -> tuple[int, bytes]:
        """``(segment base, bytes)`` a replica at ``offset`` copies next: whole records of one
        segment below the written end (``log.written``: whole appends, fsynced or not yet: a
        replica's fsync overlaps this log's, chronoq.replication.shipper), ending at an append's
        end when one lies within ``max_bytes`` (else at a record's; a first record larger than
        ``max_bytes`` comes whole). Empty at the written end. ``offset`` must be a record boundary
        (a replica's log end). Called on the thread that appends (a complete ``append`` only)."""
        log_, end = self.log, self.log.written
        if offset >= end or not log_.segments:
            return (log_.active.base if log_.segments else 0), b""
        if log_.lost:
            raise errors.Unsupported("this log has quarantined ranges (commitlog/lost.json); replicas cannot copy it")
        seg = log_.segment_for(offset)  # NotFound below the oldest segment
        avail = min(seg.end, end) - offset
        data = log_.read(offset, min(avail, max(max_bytes, record.HEADER_SIZE)))
        if len(data) == avail:  # up to the written end or the segment's: an append's end either way
            return seg.base, data
        pos = cut = 0
        while pos + 4 <= len(data):
            length = int.from_bytes(data[pos:pos + 4], "little")
            if not record.HEADER_SIZE <= length <= record.RECORD_SIZE_MAX:
                raise errors.CorruptionError(seg.path, offset - seg.base + pos, f"record length {length}")
            if pos + length > len(data):
                if pos == 0:  # a record larger than max_bytes: it alone
                    return seg.base, log_.read(offset, length)
                break
            pos += length
            if not record.continues(data, pos - length):
                cut = pos
        return seg.base, data[:cut or pos]

    def append_shipped(self, offset: int, segment_base: int, blob: bytes) -> int:
        """Append records a replica copied from its primary, unchanged, at ``offset`` (this log's
        end) in the segment ``segment_base`` (``CommitLog.append``); every record is checked
        first, so nothing invalid is written. Page cache only: ``sync`` then ``dispatch_shipped``.
        Returns the new end."""
        empty = self.log.written == self.log.min_offset  # (an empty log starts where the primary's does)
        if offset != self.log.written and not (empty and offset == segment_base):
            raise errors.ClientError(f"shipped bytes start at {offset}, this log ends at {self.log.written}")
        try:
            record.check_all(blob, 0, len(blob))
        except record.RecordError as exc:
            raise errors.CorruptionError(f"bytes shipped for offset {offset}", exc.at, exc.reason) from None
        lo, hi = self._shipped_checked
        self.log.append(blob, segment_base=segment_base)
        self._shipped_checked = (lo if hi == offset else offset, self.log.written)
        return self.log.written

    def dispatch_shipped(self, tap: Tap | None = None) -> int:
        """Make the fsynced shipped records visible in their consume queues, as recovery's replay
        does (``_replay``: positional writes, the same entries the primary wrote). ``tap``
        (``Tap``) is handed the records a timer follows from the same walk (the replica's timer
        follows by it: ``TimerService.follow``), so a shipped record is parsed once; records
        ``append_shipped`` checked are not checked again. Returns the dispatched offset."""
        end = self.log.synced
        if end > self.dispatched:
            start = max(self.dispatched, self.log.min_offset)
            lo, hi = self._shipped_checked
            self._replay(start, None, end, tap, hi if lo <= start else 0)
            self.dispatched = end
        return self.dispatched
