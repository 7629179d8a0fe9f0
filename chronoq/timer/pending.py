"""What is pending: a page of the delayed messages still waiting, ordered by due time
(``PendingList``, a part of ``TimerService``; docs/timers.md, "Seeing what is pending").

*Pending* means what a recall would still cancel: a timer message whose MESSAGE entry has no
DISPATCHED/CANCELLED/MOVED entry, is not claimed for delivery (a copy written ahead is as good as
delivered, as ``recall`` answers) and has no recall or reschedule in flight; a delay-level message
at or after its lane's scan position, not recalled. Order is ``(due_ms, ident)``: ``ident`` is the
commit-log offset of the record that made the message pending (the delayed record, the rescheduled
record, or the level record), unique in the one log, so it is a stable tie-break.

Paging: a query returns at most ``limit`` messages after its cursor and the cursor to continue
from, which names the last ``(due_ms, ident)`` it examined. Resuming strictly after that key is
stable while timers fire and recalls happen: a message pending throughout is listed exactly once
across the pages; one delivered or recalled meanwhile just drops out; a rescheduled one is a new
entry (new ident) and shows up where its new due time falls. The cursor does not carry the filters:
give the same ones with it.

Cost of a page: the live bucket starts are filtered and sorted (no file read, O(buckets)); then
buckets are read in due order, one at a time (a loaded bucket from memory, an unloaded one from its
file plus its write buffer; a bucket still loading is finished first, as ``recall`` does), until
``limit`` matches are found or ``SCAN_MAX`` pending messages were examined, so at most one
bucket's pending entries (plus the page) are held at once, never every pending timer. Delay-level
queues are in due order: a binary search finds the window's first entry, then entries are read in
order. A page with few matches (a rare topic or key) stops at ``SCAN_MAX`` and answers a cursor to
continue from, with fewer than ``limit`` messages.

Why the buckets at or before the current one are read as one group: a record that was already due
when it was stored (a reschedule into the past) is filed in the bucket of its store time
(``schedlog.bucket_of_record``), so there its due time can be earlier than the bucket's start; a
store time is never after the timer's ``now``, so every later bucket holds only due times inside
its own span, and reading those one by one in start order keeps the order exact.
"""

from __future__ import annotations

import base64
import heapq
import struct
from dataclasses import dataclass, field
from typing import Iterator

from chronoq.core import errors
from chronoq.core.delay_levels import DELAY_TOPIC
from chronoq.store import record
from chronoq.timer import copies, schedlog
from chronoq.timer import handle as handles
from chronoq.timer.buckets import LOADED, LOADING
from chronoq.timer.schedlog import ENTRY_HEAD_SIZE, MESSAGE

LIMIT_DEFAULT = 100
LIMIT_MAX = 1000
SCAN_MAX = 20_000            # pending messages examined per page at most (filters that match little)
LEVEL_READ_ENTRIES = 256     # consume-queue entries read per step of a level lane

CURSOR_PREFIX = "p1."
_CURSOR = struct.Struct(">qq")  # due_ms, ident


@dataclass(frozen=True)
class PendingQuery:
    """``topic``/``key`` "" match any; the due window is ``[from_ms, to_ms)``, None: unbounded;
    ``cursor`` "" starts at the beginning."""
    topic: str = ""
    key: str = ""
    from_ms: int | None = None
    to_ms: int | None = None
    limit: int = LIMIT_DEFAULT
    cursor: str = ""


@dataclass(frozen=True)
class PendingMessage:
    due_ms: int
    ident: int       # commit offset of the record that made it pending (the tie-break)
    level: int       # 0: a timer message (deliver_at); k: delay level k
    topic: str       # where it will be delivered
    queue_id: int
    position: int    # a timer message: its ident; a level message: its offset in the delay queue
    raw: bytes       # the stored record (``chronoq.store.record``)

    @property
    def parts(self) -> copies.Parts:
        return copies.split(self.raw)

    def recall_handle(self, group: str = "") -> str:
        """The handle that recalls (or reschedules) this message, as its send answered (``group``:
        the broker's ``TimerService.handle_group``)."""
        parts = self.parts
        kind = handles.LEVEL if self.level else handles.TIMER
        return handles.encode(kind, self.level, self.position, parts.deliver_at_ms, self.topic,
                              parts.message_id.decode(), group)


@dataclass
class PendingPage:
    """``next_cursor`` "": nothing more matches; otherwise more may (``scanned`` messages were
    examined for this page, at most ``SCAN_MAX``)."""
    messages: list[PendingMessage] = field(default_factory=list)
    next_cursor: str = ""
    scanned: int = 0


def encode_cursor(due_ms: int, ident: int) -> str:
    return CURSOR_PREFIX + base64.urlsafe_b64encode(_CURSOR.pack(due_ms, ident)).decode().rstrip("=")


def decode_cursor(text: str) -> tuple[int, int] | None:
    """(due_ms, ident) of a cursor, None for "". Raises ClientError for anything malformed."""
    if not text:
        return None
    try:
        if not text.startswith(CURSOR_PREFIX):
            raise ValueError("prefix")
        blob = base64.urlsafe_b64decode(text[len(CURSOR_PREFIX):] + "=" * (-len(text) % 4))
        due_ms, ident = _CURSOR.unpack(blob)
    except (ValueError, struct.error):
        raise errors.ClientError(f"not a pending-list cursor: {text[:40]!r} (give back the one a page "
                                 "answered)") from None
    return due_ms, ident


def check_query(q: PendingQuery) -> tuple[int, int] | None:
    """Validate a query (ClientError); returns its decoded cursor."""
    if not isinstance(q.limit, int) or not 1 <= q.limit <= LIMIT_MAX:
        raise errors.ClientError(f"limit must be between 1 and {LIMIT_MAX}, not {q.limit!r}")
    if q.from_ms is not None and q.to_ms is not None and q.to_ms <= q.from_ms:
        raise errors.ClientError(f"the due window [{q.from_ms}, {q.to_ms}) is empty: to must be after from")
    return decode_cursor(q.cursor)


def has_key(keys_field: bytes, key: bytes) -> bool:
    """Whether a record's keys field (``KEY_SEP``-joined) holds ``key`` exactly."""
    return bool(keys_field) and key in keys_field.split(record.KEY_SEP)


def unloaded_pending(path: str, start: int, file_data: bytes, extra: bytes,
                     lo_due: int | None, hi_due: int | None) -> list[tuple[int, int, bytes, int, int]]:
    """Pending messages of an unloaded bucket (its file plus its unwritten buffer) due inside
    ``[lo_due, hi_due)``: ``(due_ms, ident, data, pos, total)`` with the entry at ``data[pos:pos +
    total]``. Entries are set facts (``schedlog``): pending iff a MESSAGE and no other kind."""
    found: dict[int, tuple[int, bytes, int, int]] = {}
    resolved: set[int] = set()

    def note(data, pos, total, kind, ident, due):
        if kind != MESSAGE:
            resolved.add(ident)
        elif ident not in found and (lo_due is None or due >= lo_due) and (hi_due is None or due < hi_due):
            found[ident] = (due, data, pos, total)

    if file_data:
        try:
            for pos, total, kind, ident, due, _aux in schedlog.scan(path, start, file_data):
                note(file_data, pos, total, kind, ident, due)
        except schedlog.SchedLogError:  # a bad file header: the replay reported it; nothing to trust
            pass
    pos = 0
    while pos < len(extra):  # the buffer: entries this process encoded, not yet written
        total, kind, ident, due, _aux = schedlog.entry_fields(extra, pos)
        note(extra, pos, total, kind, ident, due)
        pos += total
    return [(due, ident, data, p, t) for ident, (due, data, p, t) in found.items() if ident not in resolved]


class PendingList:
    """Mixed into ``TimerService``: reads ``buckets``, ``_in_heap``, ``width``, ``level_lanes``,
    ``_in_flight``, ``store`` and ``_now``; may finish a bucket's load (``_finish_loading``)."""

    def pending(self, query: PendingQuery, now_ms: int | None = None) -> PendingPage:
        """One page of pending messages (see the module docstring). Raises ClientError for a bad
        query. Ensures: the messages are in ``(due_ms, ident)`` order, all after the cursor."""
        after = check_query(query)
        now = self._now(now_ms)
        lo = query.from_ms
        if after is not None and (lo is None or after[0] > lo):
            lo = after[0]  # entries at the cursor's due time are filtered by ident below
        hi = query.to_ms
        sources = [self._timer_pending(lo, hi, now)]
        sources += [self._level_pending(lane, lo, hi) for lane in self.level_lanes]
        topic, key = query.topic, query.key.encode()
        page = PendingPage()
        last = None
        for due, ident, level, position, raw in heapq.merge(*sources):
            if after is not None and (due, ident) <= after:
                continue
            if page.scanned >= SCAN_MAX:
                page.next_cursor = encode_cursor(*last)
                return page
            page.scanned += 1
            last = (due, ident)
            parts = copies.split(raw)
            if key and not has_key(parts.keys, key):
                continue
            dest, dest_queue = copies.real_destination(parts) if level else (parts.topic.decode(), parts.queue_id)
            if topic and dest != topic:
                continue
            if len(page.messages) == query.limit:  # one more matches: the page is full, more follow
                tail = page.messages[-1]
                page.next_cursor = encode_cursor(tail.due_ms, tail.ident)
                return page
            page.messages.append(PendingMessage(due, ident, level, dest, dest_queue, position, raw))
        keys = [(m.due_ms, m.ident) for m in page.messages]
        assert keys == sorted(keys) and (after is None or not keys or keys[0] > after)
        return page

    def pending_span(self) -> tuple[int, int] | None:
        """``(first, end)``: every pending message is due before ``end``, and at or after
        ``first`` except overdue ones (for planning, e.g. the Spark source's partitions). From the
        bucket starts and each level queue's ends: no file is read. None: nothing pending."""
        starts = self._in_heap | self.buckets.keys()
        lows, highs = [], []
        if starts:
            lows.append(min(starts))
            highs.append(max(starts) + self.width)
        for lane in self.level_lanes:
            q_lo, q_hi = self.store.bounds(DELAY_TOPIC, lane.queue_id)
            first = max(lane.offset, lane.scan_offset, q_lo)
            if first < q_hi:
                head = self.store.entries(DELAY_TOPIC, lane.queue_id, first, 1)
                tail = self.store.entries(DELAY_TOPIC, lane.queue_id, q_hi - 1, 1)
                if head and tail:
                    lows.append(head[0][3] + lane.delay_ms)
                    highs.append(tail[0][3] + lane.delay_ms + 1)
        return (min(lows), max(highs)) if lows else None

    # ------------------------------------------------------------------ timer messages
    def _timer_pending(self, lo: int | None, hi: int | None, now: int) -> Iterator[tuple]:
        """``(due, ident, 0, ident, raw)`` of pending timer messages due in ``[lo, hi)``, in order."""
        width = self.width
        current = schedlog.bucket_start(now, width)
        # A bucket's entries are due before its end; only buckets up to the current one can hold
        # entries due before their start (see the module docstring).
        starts = sorted(s for s in self._in_heap | self.buckets.keys()
                        if (lo is None or s + width > lo) and (hi is None or s < hi or s <= current))
        first_group = [s for s in starts if s <= current]
        groups = ([first_group] if first_group else []) + [[s] for s in starts if s > current]
        for group in groups:
            found = []
            for start in group:
                found.extend(self._bucket_pending(start, lo, hi))
            found.sort()
            yield from found

    def _bucket_pending(self, start: int, lo: int | None, hi: int | None) -> list[tuple]:
        b = self.buckets.get(start)
        if b is not None and b.state == LOADING:
            self._finish_loading(b)  # as recall does: a half-parsed bucket does not know its state yet
        holds = self._in_flight.holds_timer
        out = []
        if b is not None and b.state == LOADED:
            data = b.data
            for ident, (due, pos, total) in b.pending.items():
                if (lo is None or due >= lo) and (hi is None or due < hi) and not holds(ident):
                    raw = bytes(data[pos + ENTRY_HEAD_SIZE:pos + total])
                    out.append((due, ident, 0, ident, raw))
            return out
        if b is None and start not in self._in_heap:
            return out
        path = self._path(start)
        file_data = schedlog.read_file(path)
        extra = bytes(b.buffer) if b is not None else b""
        for due, ident, data, pos, total in unloaded_pending(path, start, file_data, extra, lo, hi):
            if not holds(ident):
                out.append((due, ident, 0, ident, bytes(data[pos + ENTRY_HEAD_SIZE:pos + total])))
        return out

    # ------------------------------------------------------------------ delay-level messages
    def _level_pending(self, lane, lo: int | None, hi: int | None) -> Iterator[tuple]:
        """``(due, ident, level, queue offset, raw)`` of a level's pending messages due in ``[lo, hi)``, in
        order: its queue is in arrival order, so in due order (stored time + the level's delay)."""
        store = self.store
        q_lo, q_hi = store.bounds(DELAY_TOPIC, lane.queue_id)
        offset = max(lane.offset, lane.scan_offset, q_lo)
        if lo is not None:
            offset = self._level_due_before(lane, offset, q_hi, lo - 1)
        holds, cancelled = self._in_flight.holds_level, lane.cancelled
        while offset < q_hi:
            entries = store.entries(DELAY_TOPIC, lane.queue_id, offset, min(LEVEL_READ_ENTRIES, q_hi - offset))
            if not entries:
                return
            for phys, size, _tag, stored in entries:
                due = stored + lane.delay_ms
                if hi is not None and due >= hi:
                    return
                if offset not in cancelled and not holds(lane.level, offset):
                    raw = self._level_raw(phys, size)
                    if raw is not None:
                        yield due, phys, lane.level, offset, raw
                offset += 1

    def _level_raw(self, phys: int, size: int) -> bytes | None:
        """The record behind a level entry, None when it is gone (the lane reports that when it
        reaches it; a read must not count it again)."""
        if size == 0 or phys < self.store.log.min_offset:
            return None
        try:
            return self.store.log.read_record(phys, size)
        except errors.CorruptionError:
            return None
