"""Recall and reschedule: find where a handle's message stands, then cancel or move it with one
durable record (``Recall``, a part of ``TimerService``; the results and outcomes it answers).

Linearization against delivery is in ``chronoq.timer.service``'s docstring: one ``now`` per call
on the one thread; a message due by then is ALREADY_DELIVERED (and so is one whose held copy is
already written), a pending one gets its control or moved record written (page cache) and the call
returns an ``Answer``: the result and the commit-log position (*ticket*) that must be durable before
the result is given. The caller waits on the committer for it (``GroupCommitter.recall``, fsync on
its thread; embedded, ``Broker.durable``), whose dispatch applies the record here (``absorb``).

Between the write and that dispatch the target is *in flight* (``_in_flight``): no tick claims it
(a timer message leaves the wheel when it falls due and stays pending in its bucket; a level lane
stops at it), and a second recall or reschedule of it answers what the first will, after the same
ticket. The mark is dropped when the record is absorbed, so a record whose fsync failed keeps its
target from delivery until a later fsync makes it durable and it is applied: the caller was
answered with the error, never with a result a crash could take back.

A mixin, like ``chronoq.timer.absorb``: finding a message reads the wheel's index, the buckets
(finishing a load if one is half done), the level lanes and the store's holds.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import NamedTuple

from chronoq.core.delay_levels import DELAY_TOPIC
from chronoq.timer import copies, deliverytime, schedlog
from chronoq.timer import handle as handles
from chronoq.timer.buckets import LOADED, LOADING, lookup
from chronoq.timer.schedlog import CANCELLED, DISPATCHED, MESSAGE, MOVED


class RecallOutcome(str, enum.Enum):
    CANCELLED = "cancelled"
    ALREADY_DELIVERED = "already_delivered"
    NOT_FOUND = "not_found"


class RescheduleOutcome(str, enum.Enum):
    RESCHEDULED = "rescheduled"
    ALREADY_DELIVERED = "already_delivered"
    CANCELLED = "cancelled"
    NOT_FOUND = "not_found"


# The detail of a recall that cancelled the message itself (a handle cancelled earlier answers
# CANCELLED too, with why): only this one is a new event in the message's life (the trace).
RECALLED_NOW = "recalled"


@dataclass(slots=True)
class RecallResult:
    outcome: RecallOutcome
    topic: str
    message_id: str
    deliver_at_ms: int
    detail: str = ""


@dataclass(slots=True)
class RescheduleResult:
    outcome: RescheduleOutcome
    recall_handle: str
    topic: str
    message_id: str
    deliver_at_ms: int
    detail: str = ""


class Answer(NamedTuple):
    """A recall's or reschedule's result and the commit-log position that must be durable (and
    dispatched) before it is given; 0 when nothing was written for it."""
    result: RecallResult | RescheduleResult
    ticket: int


class InFlight:
    """Recall and reschedule records written and not yet absorbed, by target: (0, entry ident)
    for a timer message, (level, queue offset) for a level message (levels start at 1), each
    -> (CANCELLED or MOVED, the record's ticket). Pure: the recall marks, delivery asks, the
    absorbing of the record drops the mark."""

    __slots__ = ("_marks",)

    def __init__(self) -> None:
        self._marks: dict[tuple[int, int], tuple[int, int]] = {}

    def __bool__(self) -> bool:
        return bool(self._marks)

    @staticmethod
    def _key(h: handles.RecallHandle) -> tuple[int, int]:
        return (0, h.position) if h.kind == handles.TIMER else (h.level, h.position)

    def mark(self, h: handles.RecallHandle, kind: int, ticket: int) -> None:
        assert kind in (CANCELLED, MOVED) and ticket > 0
        self._marks[self._key(h)] = (kind, ticket)

    def of(self, h: handles.RecallHandle) -> tuple[int, int] | None:
        """(CANCELLED or MOVED, ticket) of the record in flight for ``h``'s target, or None."""
        return self._marks.get(self._key(h)) if self._marks else None

    def holds_timer(self, ident: int) -> bool:
        return (0, ident) in self._marks

    def holds_level(self, level: int, queue_offset: int) -> bool:
        return (level, queue_offset) in self._marks

    def timer_mark(self, ident: int) -> tuple[int, int] | None:
        """(CANCELLED or MOVED, ticket) of the record in flight for timer entry ``ident``, or None."""
        return self._marks.get((0, ident)) if self._marks else None

    def applied_timer(self, ident: int) -> bool:
        """The record for timer entry ``ident`` is absorbed: drop its mark (whether there was one)."""
        return self._marks.pop((0, ident), None) is not None

    def applied_level(self, level: int, queue_offset: int) -> bool:
        return self._marks.pop((level, queue_offset), None) is not None


class Recall:
    """Mixed into ``TimerService``: uses its ``store``, ``opts``, ``width``, ``buckets``, ``_index``,
    ``_done``, ``_in_heap``, ``level_lanes``, ``_now``, ``_path``, ``_finish_loading`` and
    ``_level_record``;
    marks its ``_in_flight`` (``InFlight``)."""

    def _locate_timer(self, h: handles.RecallHandle) -> tuple[int | None, int, bytes | None]:
        """(state, bucket start, record bytes if pending) of a timer message's entry."""
        ident = h.position
        b = self._index.get(ident)
        if b is not None:
            return MESSAGE, b.start, b.record_of(ident)
        start = schedlog.bucket_start(h.due_ms, self.width)
        b = self.buckets.get(start)
        if b is not None and b.state == LOADING:
            self._finish_loading(b)
        if b is not None and b.state == LOADED:
            return b.state_of(ident), start, b.record_of(ident)
        # A finished bucket's file may outlive it until its .done is durable, without the entries
        # only buffered at the finish (``chronoq.timer.keyed._bucket_bytes``): the .done says.
        live = b is not None or start in self._in_heap
        file_data = schedlog.read_file(self._path(start)) if live else b""
        extra = bytes(b.buffer) if b is not None else b""
        if file_data or extra:
            state, raw = lookup(self._path(start), start, file_data, extra, ident)
            if state is not None:
                return state, start, raw
        done_path = self._path(start, schedlog.DONE_SUFFIX)
        if start in self._done:
            state, _raw = lookup(done_path, start, schedlog.read_file(done_path), b"", ident)
            return state, start, None
        return None, start, None

    def _locate_level(self, h: handles.RecallHandle) -> tuple[int | None, bytes | None]:
        if not 1 <= h.level <= len(self.level_lanes):
            return None, None
        lane = self.level_lanes[h.level - 1]
        hit = lane.cancelled.get(h.position)
        if hit is not None:
            return hit[0], None
        if h.position < lane.offset:
            return DISPATCHED, None
        entry = self.store.entries(DELAY_TOPIC, lane.queue_id, h.position, 1)
        if not entry:
            return None, None
        raw = self._level_record(entry[0][0], entry[0][1])
        return (MESSAGE, raw) if raw is not None else (None, None)

    def _matches(self, raw: bytes | None, h: handles.RecallHandle) -> bool:
        if raw is None:
            return False
        parts = copies.split(raw)
        topic, _qid = copies.real_destination(parts)
        return parts.message_id.decode() == h.message_id and topic == h.topic and parts.deliver_at_ms == h.due_ms

    def _state(self, h: handles.RecallHandle, now: int) -> tuple[str, int, bytes | None, str]:
        """Classify a handle: ('pending' | 'delivered' | 'cancelled' | 'missing', bucket, raw, why)."""
        if h.group and self.handle_group and h.group != self.handle_group:  # (a cluster passes it on first)
            return "missing", 0, None, f"the handle belongs to broker group {h.group}, not {self.handle_group}"
        if h.kind == handles.IMMEDIATE:
            return "delivered", 0, None, "it was due when sent"
        if h.due_ms + self.opts.recall_memory_ms < now:
            return "missing", 0, None, "the handle is older than timer_recall_memory_ms"
        flying = self._in_flight.of(h)
        if flying is not None:  # answered once the record in flight is durable (its ticket)
            if flying[0] == CANCELLED:
                return "cancelled", 0, None, "it was cancelled earlier (recalled, replaced by key or cancelled by key)"
            return "missing", 0, None, "it was rescheduled; use the handle the reschedule returned"
        if h.kind == handles.TIMER:
            state, start, raw = self._locate_timer(h)
        else:
            state, raw = self._locate_level(h)
            start = 0
        if state == CANCELLED:
            return "cancelled", start, None, "it was cancelled earlier (recalled, replaced by key or cancelled by key)"
        if state == MOVED:
            return "missing", start, None, "it was rescheduled; use the handle the reschedule returned"
        if now >= h.due_ms:
            # Due: delivered, or durable and made visible by the next tick (linearization point).
            return "delivered", start, None, "its delivery time has passed"
        if h.kind == handles.TIMER and (self._claimed(start, h.position) if state == MESSAGE else self._held(h)):
            # Written ahead as a held copy (``prewrite_ms``): it will be visible at its due time,
            # across a crash too, so this answer never has to be taken back.
            return "delivered", start, None, "its copy is already written and becomes visible at its delivery time"
        if state == MESSAGE and self._matches(raw, h):
            return "pending", start, raw, ""
        return "missing", start, None, "no pending message matches the handle"

    def _claimed(self, start: int, ident: int) -> bool:
        b = self.buckets.get(start)
        return b is not None and ident in b.claimed

    def _held(self, h: handles.RecallHandle) -> bool:
        """A held copy of the handle's message is in its queue (completed ahead of its due time;
        loaded buckets forget DISPATCHED entries, and a restart knows holds from the store only)."""
        for raw in self.store.held_records(h.topic, h.due_ms):
            parts = copies.split(raw)
            if parts.message_id.decode() == h.message_id and parts.deliver_at_ms == h.due_ms:
                return True
        return False

    def _ticket_for(self, h: handles.RecallHandle) -> int:
        """The ticket of the record in flight for ``h``'s target (0: none in flight)."""
        flying = self._in_flight.of(h)
        return 0 if flying is None else flying[1]

    def _write_in_flight(self, p, h: handles.RecallHandle, kind: int) -> tuple[int, int]:
        """Write a recall's record (page cache) and mark its target in flight until the record is
        absorbed. Returns (its commit offset, its ticket: the log position just past it)."""
        [w] = self.store.write([p])
        ticket = w.commit_offset + w.size
        self._in_flight.mark(h, kind, ticket)
        return w.commit_offset, ticket

    def recall(self, text: str) -> Answer:
        """Cancel a pending delayed message: the answer, CANCELLED only once its ticket is durable."""
        h = handles.decode(text)
        now = self._now()
        state, start, raw, why = self._state(h, now)
        if state == "pending":
            if h.kind == handles.TIMER:
                p = copies.control(copies.PROP_TIMER_CANCEL, f"{start}.{h.position}", h.message_id.encode(),
                                   h.due_ms, now)
            else:
                p = copies.control(copies.PROP_DELAY_CANCEL, f"{h.level}.{h.position}.{h.due_ms}",
                                   h.message_id.encode(), h.due_ms, now)
            _offset, ticket = self._write_in_flight(p, h, CANCELLED)
            if h.kind == handles.TIMER and raw is not None:
                self._unindex_raw(h.position, raw)  # (chronoq.timer.keyed)
            return Answer(RecallResult(RecallOutcome.CANCELLED, h.topic, h.message_id, h.due_ms, RECALLED_NOW), ticket)
        outcome = {"delivered": RecallOutcome.ALREADY_DELIVERED, "cancelled": RecallOutcome.CANCELLED,
                   "missing": RecallOutcome.NOT_FOUND}[state]
        return Answer(RecallResult(outcome, h.topic, h.message_id, h.due_ms, why), self._ticket_for(h))

    def reschedule(self, text: str, deliver_at_ms: int) -> Answer:
        """Move a pending delayed message to ``deliver_at_ms``: the answer carries a new recall
        handle, valid once its ticket is durable."""
        h = handles.decode(text)
        now = self._now()
        new_due = deliverytime.check_deliver_at(deliver_at_ms, now, self.opts.max_delay_ms)
        state, start, raw, why = self._state(h, now)
        if state != "pending":
            outcome = {"delivered": RescheduleOutcome.ALREADY_DELIVERED, "cancelled": RescheduleOutcome.CANCELLED,
                       "missing": RescheduleOutcome.NOT_FOUND}[state]
            return Answer(RescheduleResult(outcome, "", h.topic, h.message_id, h.due_ms, why), self._ticket_for(h))
        assert raw is not None
        if h.kind == handles.TIMER:
            moved = (copies.PROP_TIMER_MOVED_FROM, f"{start}.{h.position}.{h.due_ms}")
        else:
            moved = (copies.PROP_DELAY_MOVED_FROM, f"{h.level}.{h.position}.{h.due_ms}")
        moved_record = copies.rescheduled(raw, new_due, *moved)
        offset, ticket = self._write_in_flight(moved_record, h, MOVED)
        if h.kind == handles.TIMER:
            self._unindex_raw(h.position, raw)  # the key index follows the message (chronoq.timer.keyed)
        self.index_written([moved_record], [offset])
        new = handles.RecallHandle(handles.TIMER, 0, offset, new_due, h.topic, h.message_id, self.handle_group).encode()
        return Answer(RescheduleResult(RescheduleOutcome.RESCHEDULED, new, h.topic, h.message_id, new_due, "moved"),
                      ticket)
