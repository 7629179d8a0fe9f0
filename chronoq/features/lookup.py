"""Message lookup by id or key: the records of the log that hold it, and its life from the trace.

Shared by the console's lookup page (``chronoq.console.views``) and the Admin RPC
``LookupMessage`` (``chronoq.server.admin``, used by ``chronoq message show``), so both always
show the same life. ``lookup_message`` is the entry point; ``chronoq.features.lifeline`` is the pure part.

Data sources and their bounds (docs/console.md, "Message lookup"):

1. **The commit log, newest ``scan_bytes``** (``[console] lookup_scan_mib``, 32 MiB). The broker keeps no index from a
   key (or an id) to its records, so the lookup scans the tail of the log: every record whose
   message id, origin id (retry and dead-letter copies) or keys equal the query. This finds
   pending delayed messages too (their record waits in the log until it is due), which a
   consume-queue scan would miss. The scan starts at ``end - scan_bytes``: the first position
   there where a complete record with a valid CRC begins is taken as a record boundary (the log
   has no back links; a false boundary would need a 32-bit CRC collision on top of valid
   lengths, and would only end the scan early, reported). Records are walked by their length
   field and only those containing the query's bytes are decoded.
2. **The trace topic, newest ``trace_bytes``** (``trace_scan_mib``, 64 MiB of CHRONOQ_TRACE), after
   writing the trace buffer and waiting for it to be durable (as ``FlushTrace`` does): stored,
   visible, each delivery attempt, ack, dead-letter, recall and reschedule events of the ids
   the first step found (or of the query itself, taken as an id). See ``lifeline.TraceSearch``.

Both run on the event loop (the store is single-threaded), in steps with other work served
between: the log scan every ``SCAN_STEP_RECORDS`` records walked (a query whose bytes are in
every record walks and decodes them all: ~0.8 s for 32 MiB of small records, 25 s at the
1 GiB allowed, all of it once a stall of every call), the trace every ``TRACE_BATCH`` records.
"""

from __future__ import annotations

import asyncio
import struct
from dataclasses import dataclass, field
from typing import Awaitable, Callable

from chronoq.core import errors, model
from chronoq.features import lifeline
from chronoq.store import record
from chronoq.store.commitlog import find_in
from chronoq.timer import copies
from chronoq.timer import handle as handles
from chronoq.core.delay_levels import DELAY_TOPIC
from chronoq.broker.trace import TRACE_TOPIC

RECORDS_MAX = 200          # matching records listed (a key shared by many messages)
TRACE_BATCH = 16           # trace records read per step (each up to ~400 KiB)
SCAN_STEP_RECORDS = 2048   # log records walked per step (decoded ones ~5 us each: a step stays ~10 ms)
QUERY_CHARS_MAX = 256
BODY_HEAD_BYTES = 4096     # of each matching record's body kept for display (the console's lookup)
_U32 = struct.Struct("<I")
_MAGIC_VERSION = bytes([record.MAGIC, record.VERSION])


@dataclass
class Found:
    commit_offset: int
    topic: str
    queue_id: int
    queue_offset: int
    message_id: str
    origin_id: str
    origin_topic: str
    kind: str
    tag: str
    keys: tuple[str, ...]
    born_ms: int
    stored_ms: int
    deliver_at_ms: int
    body_bytes: int
    recall_handle: str | None = None  # a pending timer message: the handle that recalls it
    body_head: bytes = b""            # the body's first BODY_HEAD_BYTES (body_bytes is its size)
    properties: dict = field(default_factory=dict)


@dataclass
class ScanReport:
    records: list[Found] = field(default_factory=list)
    scanned_from: int = 0
    scanned_to: int = 0
    truncated: bool = False   # more matches than RECORDS_MAX
    damage: str = ""          # the scan stopped early at a record it could not read


def _resync(buf, pos: int, end: int) -> int | None:
    """The first position >= pos where a valid record starts before ``end`` (None: none does).

    Candidates are the places where the magic and version bytes sit (``find_in``, C speed);
    each is checked in full (lengths, CRC), so a body that happens to hold those two bytes costs
    one failed check. The scan window is bounded, so this is too.
    """
    at = find_in(buf, _MAGIC_VERSION, pos + 4, end)  # (not buf.find: see find_in)
    while at >= 0:
        cand = at - 4
        try:
            record.check(buf, cand, end)
            return cand
        except record.RecordError:
            at = find_in(buf, _MAGIC_VERSION, at + 1, end)
    return None


def scan_log(log, query: str, scan_bytes: int, now_ms: int, group: str = "") -> ScanReport:
    """Records of the newest ``scan_bytes`` of ``log`` (a ``CommitLog``) that match ``query``
    (``group``: the broker group its recall handles name, ``TimerService.handle_group``), in one go."""
    report = ScanReport()
    for _step in _scan_steps(log, query, scan_bytes, now_ms, group, report):
        pass
    return report


async def scan_log_stepped(log, query: str, scan_bytes: int, now_ms: int, group: str = "") -> ScanReport:
    """``scan_log`` with the event loop let go every ``SCAN_STEP_RECORDS`` records walked. What
    is appended meanwhile is past the end the scan took at its start; a segment deleted meanwhile
    stays readable through its mapping."""
    report = ScanReport()
    for _step in _scan_steps(log, query, scan_bytes, now_ms, group, report):
        await asyncio.sleep(0)
    return report


def _scan_steps(log, query: str, scan_bytes: int, now_ms: int, group: str, report: ScanReport):
    """The scan of ``scan_log`` into ``report``, a generator: it yields between steps."""
    assert scan_bytes > 0
    needle = query.encode()
    segments = list(log.segments)
    if not segments:
        return
    end = segments[-1].end
    start = max(log.min_offset, end - scan_bytes)
    report.scanned_from, report.scanned_to = start, end
    first = True
    for seg in segments:
        if seg.end <= start or seg.size == 0:
            continue
        buf = log.map_segment(seg)
        try:
            pos = max(0, start - seg.base)
            if first and pos > 0:
                found = _resync(buf, pos, seg.size)
                if found is None:  # no record starts in the rest of it: scan from the next one
                    report.scanned_from = seg.end
                    continue
                report.scanned_from = seg.base + found
                pos = found
            first = False
            if not (yield from _scan_segment(log, seg, buf, pos, needle, query, report, now_ms, group)):
                break
        finally:
            if hasattr(buf, "close"):
                buf.close()


def _scan_segment(log, seg, buf, pos: int, needle: bytes, query: str, report: ScanReport, now_ms: int,
                  group: str):
    """Walk records from ``pos`` (a generator, yielding every ``SCAN_STEP_RECORDS``); returns
    False when the scan must stop (damage or enough matches)."""
    size = seg.size
    hit = find_in(buf, needle, pos)
    walked = 0
    while hit >= 0 and pos < size:
        walked += 1
        if walked % SCAN_STEP_RECORDS == 0:
            yield
        if log.lost and log.is_lost(seg.base + pos):
            return True  # quarantined bytes: the rest of this segment is not walked
        if size - pos < record.HEADER_SIZE or buf[pos + 4] != record.MAGIC:
            report.damage = f"no record at commit-log offset {seg.base + pos}; the scan stopped there"
            return False
        total = _U32.unpack_from(buf, pos)[0]
        if total < record.HEADER_SIZE:
            report.damage = f"bad record length at commit-log offset {seg.base + pos}; the scan stopped there"
            return False
        if hit < pos + total:  # the query's bytes are in this record: decode it
            try:
                record.check(buf, pos, size)
            except record.RecordError as exc:
                report.damage = f"damaged record at commit-log offset {seg.base + pos} ({exc.reason})"
                return False
            (flags, qid, qoff, born, stored, deliver, topic, mid, tag, keys, props,
             body) = record.decode_tuple(buf, pos)
            if lifeline.matches(query, mid, keys, props):
                if len(report.records) >= RECORDS_MAX:
                    report.truncated = True
                    return False
                report.records.append(_found(seg.base + pos, flags, qid, qoff, born, stored, deliver, topic, mid,
                                             tag, keys, props, body, now_ms, group))
            hit = find_in(buf, needle, pos + total)
        pos += total
    return True


def _found(offset, flags, qid, qoff, born, stored, deliver, topic, mid, tag, keys, props, body,
           now_ms, group) -> Found:
    kind = lifeline.record_kind(topic, flags, props)
    if flags & record.FLAG_HELD and stored > now_ms:  # stamped with its due time, hidden until then
        kind = lifeline.KIND_HELD_COPY
    handle = None
    if deliver > now_ms:
        # A message still waiting: the recall handle its send returned (chronoq.timer.handle),
        # rebuilt from where its record is: a timer message is named by its commit offset, a
        # delay-level message by its level and its offset in that level's queue.
        if topic == DELAY_TOPIC and copies.PROP_DELAY_TOPIC in props:
            handle = handles.encode(handles.LEVEL, qid + 1, qoff, deliver, props[copies.PROP_DELAY_TOPIC], mid, group)
        elif flags & record.FLAG_DELAYED and not model.is_system_topic(topic):
            handle = handles.encode(handles.TIMER, 0, offset, deliver, topic, mid, group)
    return Found(offset, topic, qid, qoff, mid, lifeline.origin_id(mid, props), lifeline.origin_topic(topic, props),
                 kind, tag, tuple(keys), born, stored, deliver, len(body), handle, bytes(body[:BODY_HEAD_BYTES]),
                 dict(props))


@dataclass
class TraceReport:
    enabled: bool = True
    events: list[dict] = field(default_factory=list)
    records_read: int = 0
    bytes_read: int = 0
    window_from: int = 0     # trace queue offsets covered
    window_to: int = 0
    dropped: int = 0         # events the trace buffer had to drop (it was full)


async def trace_events(broker, durable: Callable[[], Awaitable[None]], ids: set[str],
                       trace_bytes: int) -> TraceReport:
    """Events of ``ids`` in the newest ``trace_bytes`` of the trace topic, oldest first.

    ``durable`` makes what the broker wrote durable and dispatched (the group committer's
    barrier in the console, an fsync + dispatch in the Admin service): the trace buffer written
    here must be readable before the read starts.
    """
    if broker.trace is None:
        return TraceReport(enabled=False)
    broker.write_trace()
    await durable()  # durable and dispatched: readable now
    report = TraceReport(dropped=broker.trace.dropped)
    lo, hi = broker.queue_bounds(TRACE_TOPIC, 0)
    wanted = [i.encode() for i in ids]
    # Pass 1, newest first: how far back the byte budget reaches, and the oldest record that
    # mentions a wanted id (acks name no id: they follow their delivery, so reading on from
    # the oldest mention finds them).
    pos, first_hit = hi, None
    while pos > lo and report.bytes_read < trace_bytes:
        n = min(TRACE_BATCH, pos - lo)
        batch = broker.read(TRACE_TOPIC, 0, pos - n, n).messages
        for m in reversed(batch):
            report.bytes_read += len(m.body)
            if any(w in m.body for w in wanted):
                first_hit = m.queue_offset
        pos -= n
        await asyncio.sleep(0)  # let sends and receives run between steps
    report.window_from, report.window_to = pos, hi
    if first_hit is None or not ids:
        return report
    search = lifeline.TraceSearch(set(ids))
    pos = first_hit
    while pos < hi:
        batch = broker.read(TRACE_TOPIC, 0, pos, min(TRACE_BATCH, hi - pos))
        for m in batch.messages:
            search.feed(m.body)
        report.bytes_read += sum(len(m.body) for m in batch.messages)
        if batch.next_offset <= pos:
            break
        pos = batch.next_offset
        await asyncio.sleep(0)
    report.records_read = search.records
    report.events = search.timeline()
    return report


# ------------------------------------------------------------------------ the whole lookup
@dataclass
class LookupResult:
    query: str
    scan: ScanReport
    trace: TraceReport
    # One per message id found: {"id", "topic", "events", "records", "state"} (``lifeline.summary``).
    messages: list[dict]


def check_query(query: str) -> str:
    """The query stripped; ``errors.ClientError`` when it cannot be a message id or key."""
    text = query.strip()
    if not text or len(text) > QUERY_CHARS_MAX or not text.isprintable():
        raise errors.ClientError(f"a message id or key is 1 to {QUERY_CHARS_MAX} printable characters")
    return text


async def lookup_message(broker, durable: Callable[[], Awaitable[None]], query: str, scan_bytes: int,
                         trace_bytes: int) -> LookupResult:
    """Every message ``query`` names (by id, origin id or key), with its records and its life.

    Ensures: each listed message has at least one record or one trace event; at most
    ``lifeline.IDS_MAX`` messages. An empty list means nothing in the windows read.
    """
    query = check_query(query)
    now = broker.clock.wall_ms()
    scan = await scan_log_stepped(broker.commit_log, query, scan_bytes, now, broker.timer.handle_group)
    ids: list[str] = []
    for r in scan.records:
        if r.origin_id not in ids:
            ids.append(r.origin_id)
    if not ids:
        ids = [query]  # not in the scanned log: it may still be an id the trace knows
    ids = ids[:lifeline.IDS_MAX]
    trace = await trace_events(broker, durable, set(ids), trace_bytes)
    now = broker.clock.wall_ms()  # the trace read yielded: time moved on
    messages = []
    for mid in ids:
        events = [e for e in trace.events if e["message_id"] == mid]
        records = [r for r in scan.records if r.origin_id == mid]
        if not events and not records:
            continue
        messages.append({"id": mid, "events": events, "records": records, "state": lifeline.summary(events, now),
                         "topic": records[0].origin_topic if records else (events[0]["topic"] or "")})
    assert len(messages) <= lifeline.IDS_MAX
    return LookupResult(query, scan, trace, messages)
