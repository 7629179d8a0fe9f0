"""Reading the store: messages of a consume queue, records by commit offset.

Entries (chronoq.store.consumequeue) name records in the commit log; records near each other are
read with one pread (``spans``) and checked (CRC, and that each names the queue and offset its
entry claims) before anything is decoded. Entries whose record is gone (retention, quarantine, a
hole left by a rebuild) are skipped.
"""

from __future__ import annotations

import dataclasses
import struct

from chronoq.core import errors
from chronoq.core.model import Message
from chronoq.store import record
from chronoq.store.commitlog import CommitLog
from chronoq.store.consumequeue import ENTRY, ENTRY_SIZE, ConsumeQueue

# Reads: records at most READ_GAP_MAX bytes apart share one pread, of at most READ_SPAN_MAX bytes.
READ_GAP_MAX = 32 * 1024
READ_SPAN_MAX = 256 * 1024

# Total length, magic and flags of a record: all ``flagged`` reads of a record it skips.
_LEN_MAGIC_FLAGS = struct.Struct("<IB5xH")
assert _LEN_MAGIC_FLAGS.size == record.CRC_START + 2

# read() builds Messages positionally, in this order.
assert tuple(f.name for f in dataclasses.fields(Message)) == (
    "topic", "queue_id", "queue_offset", "commit_offset", "message_id", "body", "tag", "keys", "properties",
    "born_ms", "stored_ms", "deliver_at_ms", "flags")


def read(log: CommitLog, cq: ConsumeQueue | None, topic: str, queue_id: int, offset: int,
         max_messages: int) -> tuple[list[Message], int]:
    """Messages of ``cq`` (the consume queue of ``topic``/``queue_id``, None: it has none) from
    logical ``offset``; returns them and the offset to read next.

    Entries whose record was deleted by retention or quarantined are skipped.
    """
    if cq is None or max_messages <= 0:
        return [], offset
    offset = max(offset, cq.min_offset)
    raw = cq.get(offset, max_messages)
    entries = list(ENTRY.iter_unpack(raw))
    out: list[Message] = []
    add = out.append
    min_phys = log.min_offset
    check_decode = record.check_decode
    for i, j, blob, phys, seg in spans(log, entries, min_phys):
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

def read_runs(log: CommitLog, entries, min_phys: int):
    """Yield (index, bytes, position of the record in them), each record checked, none copied."""
    check = record.check
    for i, j, blob, phys, seg in spans(log, entries, min_phys):
        for k in range(i, j):
            pos = entries[k][0] - phys
            try:
                check(blob, pos, pos + entries[k][1])
            except record.RecordError as exc:
                raise errors.CorruptionError(seg.path, entries[k][0] - seg.base, exc.reason) from None
            yield k, blob, pos

def spans(log: CommitLog, entries, min_phys: int):
    """Yield (i, j, bytes, their log offset, segment): entries[i:j] read with one pread.

    Records near each other in the log are read together, gaps included: a queue's
    messages are interleaved with other queues' (round robin), so they are rarely adjacent,
    and one pread of the span costs less than a pread per record while gaps are small.
    Entries that are holes, retained away or lost are left out. Nothing is checked here.
    """
    i = 0
    n = len(entries)
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

def read_at(log: CommitLog, commit_offset: int, size: int) -> Message:
    data = log.read_record(commit_offset, size)
    f = record.decode(data)
    return Message(topic=f["topic"], queue_id=f["queue_id"], queue_offset=f["queue_offset"],
                   commit_offset=commit_offset, message_id=f["message_id"], body=f["body"], tag=f["tag"],
                   keys=f["keys"], properties=f["properties"], born_ms=f["born_ms"],
                   stored_ms=f["stored_ms"], deliver_at_ms=f["deliver_at_ms"], flags=f["flags"])

def read_record_at(log: CommitLog, commit_offset: int) -> Message:
    """The record that starts at ``commit_offset``, its length taken from its header (for
    callers that kept only the offset: the broker's dedupe window). ``errors.NotFound``
    when that part of the log is gone (retention) or was never written."""
    head = log.read(commit_offset, record.HEADER_SIZE)
    return read_at(log, commit_offset, record.HEADER.unpack_from(head)[0])


def read_properties(log: CommitLog, commit_offset: int) -> dict[str, str]:
    """The properties of the record at ``commit_offset``, without reading its (possibly large) body."""
    head = log.read(commit_offset, record.HEADER_SIZE)
    (_t, _m, _v, _c, _f, _q, _o, _b, _s, _d, tlen, mlen, taglen, klen, plen, _bl) = record.HEADER.unpack(head)
    start = commit_offset + record.HEADER_SIZE + tlen + mlen + taglen + klen
    return record.decode_properties(log.read(start, plen)) if plen else {}


def flagged(log: CommitLog, lo: int, hi: int, mask: int, pause_every: int = 0):
    """Yield ``(commit offset, record bytes)`` of the records in ``[lo, hi)`` (``lo`` a record
    boundary) with a flag of ``mask`` set, each checked. The others are stepped over by their
    length, not checked: retention looks for the timer's few records in segments it is about to
    delete (``chronoq.timer.roll``), about 20x faster than checking every record. A length that
    does not fit is the same named error as a bad record on a read. ``pause_every`` > 0: after
    that many records stepped over since the last yield, ``(offset, None)`` (a caller that works
    in bounded slices can stop there: a gigabyte of other records takes seconds to step over)."""
    skipped = 0
    for seg in list(log.segments):
        if seg.end <= lo or seg.base >= hi:
            continue
        buf = log.map_segment(seg)
        unpack, size, head, magic_ok, lost_ranges = _LEN_MAGIC_FLAGS.unpack_from, seg.size, record.HEADER_SIZE, \
            record.MAGIC, log.lost
        try:
            pos, stop = max(0, lo - seg.base), min(size, hi - seg.base)
            while pos < stop:
                lost = next((r for r in lost_ranges if r.start <= seg.base + pos < r.end), None) if lost_ranges else None
                if lost is not None:
                    pos = lost.end - seg.base
                    continue
                total, magic, flags = unpack(buf, pos)
                if flags & mask or magic != magic_ok or not head <= total <= size - pos:
                    try:
                        total = record.check(buf, pos, size)
                    except record.RecordError as exc:
                        raise errors.CorruptionError(seg.path, pos, exc.reason) from None
                    if flags & mask:
                        yield seg.base + pos, bytes(buf[pos:pos + total])
                        skipped = 0
                elif pause_every:
                    skipped += 1
                    if skipped >= pause_every:
                        skipped = 0
                        yield seg.base + pos, None
                pos += total
        finally:
            if hasattr(buf, "close"):
                buf.close()
