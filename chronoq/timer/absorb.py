"""The timer's send side: what a delayed send writes and answers, and how the records it wrote
reach the schedule log (``SendSide``, a part of ``TimerService``; every method runs on the
broker's thread).

Sending: the broker validates a message and asks here for its due time (``due_ms``) or, for a
delay level, its level record (``prepare_delayed``); after the batch is written it asks for the
answers, recall handles encoded for the whole batch at once (``send_results``).

Absorbing: the store never calls the timer. ``Store.dispatch`` puts the dispatched
``FLAG_DELAYED`` records of each append, their ``(commit offset, size, due)`` and their bytes, on
``store.delayed_dispatched``, a queue the store fills and the timer drains (it is the timer's
``_unabsorbed``): the timer never reads back a record just written. The timer absorbs
from it whenever it runs: after every dispatch (the broker's arrival hook, ``on_arrivals``),
and before it ticks, answers a recall or checkpoints. A record is absorbed only once it is also
fsynced (under the async flush policy dispatch runs ahead of fsync), and leaves the queue only
once absorbed, so the cursor (``_covered``) never passes a record that is not in a bucket.
"""

from __future__ import annotations

import logging

from chronoq.core import errors
from chronoq.core.model import SendResult
from chronoq.store import record
from chronoq.store.store import Prepared, Written
from chronoq.timer import copies, deliverytime, schedlog
from chronoq.timer import handle as handles
from chronoq.core.delay_levels import DELAY_TOPIC
from chronoq.timer.keyed import replaced_answer
from chronoq.timer.schedlog import CANCELLED, MESSAGE, MOVED

log = logging.getLogger("chronoq.timer")

_CONTROL_TOPIC = copies.CONTROL_TOPIC.encode()
_MOVED_MARKERS = (copies.PROP_TIMER_MOVED_FROM.encode(), copies.PROP_DELAY_MOVED_FROM.encode())
_REPLACED_MARKER = copies.PROP_TIMER_REPLACED.encode()
# What the control topic and the timer's markers share: a run without it (or the level move
# marker) holds none of the four, told in two scans of its heads instead of four.
_TIMER_MARK = b"_TIMER_"
assert all(_TIMER_MARK in m for m in (_CONTROL_TOPIC, _MOVED_MARKERS[0], _REPLACED_MARKER))
_FLAG_DELAYED = record.FLAG_DELAYED


class SendSide:
    """Mixed into ``TimerService``: uses its ``store``, ``opts``, ``levels``, ``width``,
    ``level_lanes``, ``_unabsorbed`` (``store.delayed_dispatched``), ``_append``, ``_wake`` and
    ``_in_flight`` (whose marks absorbing a recall's record reads and drops)."""

    # ================================================================= sending (called by the broker)
    def due_ms(self, deliver_at_ms: object, now_ms: int) -> int:
        """The due time of a send with ``deliver_at_ms`` (validated); at or before ``now_ms``: due
        already, an ordinary record (visible at once), else a ``FLAG_DELAYED`` one."""
        return deliverytime.check_deliver_at(deliver_at_ms, now_ms, self.opts.max_delay_ms)

    def prepare_delayed(self, p: Prepared, deliver_at_ms: int | None, delay_level: int | None,
                        now_ms: int) -> Prepared:
        """Turn a validated message into the record a delayed send writes."""
        if deliver_at_ms is not None and delay_level:
            raise errors.InvalidDeliveryTime("give either deliver_at_ms or delay_level, not both")
        if delay_level:
            level = self.levels.check(delay_level)
            if not self._delay_topic_ready:
                if self._ensure_delay_topic is not None:
                    self._ensure_delay_topic(len(self.levels))
                self._delay_topic_ready = True
            return copies.level_record(p, level, now_ms + self.levels.delay_ms(level))
        due = self.due_ms(deliver_at_ms, now_ms)
        if due <= now_ms:  # due already: an ordinary record, visible at once
            return p._replace(deliver_at_ms=due)
        return p._replace(flags=p.flags | _FLAG_DELAYED, deliver_at_ms=due)

    def send_result(self, p: Prepared, message_id: str, commit_offset: int, queue_offset: int) -> SendResult:
        """The answer to a delayed send (``p.deliver_at_ms`` is set), with its recall handle."""
        if p.flags & _FLAG_DELAYED:
            text = handles.encode(handles.TIMER, 0, commit_offset, p.deliver_at_ms, p.topic, message_id,
                                  self.handle_group)
            return SendResult(message_id, p.topic, p.queue_id, -1, commit_offset, recall_handle=text,
                              replaced=replaced_answer(p.properties))
        if p.topic == DELAY_TOPIC:
            props = record.decode_properties(p.properties)
            topic, qid = props[copies.PROP_DELAY_TOPIC], int(props[copies.PROP_DELAY_QID])
            text = handles.encode(handles.LEVEL, p.queue_id + 1, queue_offset, p.deliver_at_ms, topic, message_id,
                                  self.handle_group)
            return SendResult(message_id, topic, qid, -1, commit_offset, recall_handle=text)
        text = handles.encode(handles.IMMEDIATE, 0, commit_offset, p.deliver_at_ms, p.topic, message_id,
                              self.handle_group)
        return SendResult(message_id, p.topic, p.queue_id, queue_offset, commit_offset, recall_handle=text)

    def send_results(self, prepared: list[Prepared], ids: list[str], written: list[Written]) -> list[SendResult]:
        """The answers to a written batch, each as ``send_result`` gives it (a message without a
        due time: a plain answer). The timer messages' handles are encoded together."""
        timed = [i for i, p in enumerate(prepared) if p[2] & _FLAG_DELAYED]
        texts = iter(handles.encode_many(handles.TIMER, [written[i][0] for i in timed],
                                         [prepared[i][4] for i in timed], [prepared[i][0] for i in timed],
                                         [prepared[i][5] for i in timed], self.handle_group))
        out: list[SendResult] = []
        add = out.append
        for p, mid, w in zip(prepared, ids, written):
            if p[2] & _FLAG_DELAYED:
                add(SendResult(mid, p[0], p[1], -1, w[0], recall_handle=next(texts)))
            elif p[4]:
                add(self.send_result(p, mid, w[0], w[1]))
            else:
                add(SendResult(mid, p[0], p[1], w[1], w[0]))
        return out

    # ================================================================= absorbing delayed records
    def absorb_dispatched(self) -> None:
        """Absorb what the store has dispatched (and fsynced) since the last call. Never raises:
        it runs in the broker's arrival hook; a failure keeps the records queued for the next."""
        if not self._unabsorbed:
            return
        try:
            self._absorb_durable()
        except Exception:  # a bug or an unreadable log: keep the records, retry from tick
            log.exception("absorbing delayed records failed; will retry")

    def _absorb_durable(self) -> None:
        """Absorb dispatched records that are also fsynced (under the async flush policy dispatch
        runs ahead of fsync; absorbing a record that a power loss could take back would let its
        commit offset, the entry's identity, be reused). The queue holds each append's delayed
        records with their bytes (``Store.delayed_dispatched``): one ``_absorb_run`` per append,
        nothing read back from the log."""
        queue = self._unabsorbed
        upto = self.store.log.synced
        while queue and queue[0][0] + queue[0][1] <= upto:
            _first, _span, records, data, heads = queue[0]
            self._absorb_run(data, records, heads)
            # Only now: a failure above leaves the append queued (absorbing again is idempotent),
            # so the cursor never passes a record that was not absorbed.
            queue.popleft()

    def _absorb_run(self, blob: bytes, records: list[tuple[int, int, int]], heads: bytes | None = None) -> None:
        """Absorb ``records`` (``(offset, size, due)``), held back to back in ``blob``.

        Plain timer messages, the bulk of a delayed publish, are encoded together and appended
        with one call per bucket (``schedlog.encode_messages``). A run that may hold a recall, a
        move or a replacing send (their markers appear somewhere in it: in a topic or in the
        properties, so in ``heads``, the records' heads without their bodies, when the store gave
        them; a tenth of the bytes to search) goes one record at a time, in order.
        """
        scan = blob if heads is None else heads
        if _MOVED_MARKERS[1] in scan or (_TIMER_MARK in scan and (
                _CONTROL_TOPIC in scan or _MOVED_MARKERS[0] in scan or _REPLACED_MARKER in scan)):
            pos = 0
            for offset, size, _due in records:
                self._absorb_record(offset, blob[pos:pos + size])
                pos += size
            return
        for start, entries in schedlog.encode_messages(blob, records, self.width).items():
            self._append(start, entries)

    def _absorb_record(self, offset: int, raw: bytes) -> None:
        flags, _qid, deliver_at, topic, _mid = copies.header_fields(raw)
        if topic == _CONTROL_TOPIC:
            self._apply_control(offset, raw, deliver_at)
            return
        if _MOVED_MARKERS[0] in raw or _MOVED_MARKERS[1] in raw:
            self._apply_move(offset, raw)
        if _REPLACED_MARKER in raw:  # a replacing send (chronoq.timer.keyed)
            self._apply_replaced(offset, raw)
        # The bucket must be the same every time the record is absorbed (a replay after a crash
        # included), because recall records name it: the due time's bucket, or for a record that
        # was already due when stored (a reschedule into the past), the bucket of its store time.
        start = schedlog.bucket_of_record(copies.stored_ms(raw), deliver_at, self.width)
        self._append(start, schedlog.encode_entry(MESSAGE, offset, deliver_at, 0, raw))

    def _apply_control(self, offset: int, raw: bytes, due_ms: int) -> None:
        """A recall's control record: its target is CANCELLED (the due time is the record's)."""
        self._file_refs(offset, raw, CANCELLED, copies.PROP_TIMER_CANCEL, copies.PROP_DELAY_CANCEL, due_ms)

    def _apply_move(self, offset: int, raw: bytes) -> None:
        """A rescheduled record: its old entry is MOVED (the old due time rides in the reference)."""
        self._file_refs(offset, raw, MOVED, copies.PROP_TIMER_MOVED_FROM, copies.PROP_DELAY_MOVED_FROM, None)

    def _file_refs(self, offset: int, raw: bytes, kind: int, timer_prop: str, level_prop: str,
                   due_ms: int | None) -> None:
        """File ``kind`` for the timer entry (``start.ident[.due]``) and the level message
        (``level.qoff.due``) that ``raw``'s properties name."""
        props = record.decode_properties(copies.split(raw).properties)
        ref = props.get(timer_prop)
        if ref is not None:
            if due_ms is None:
                start, ident, due = copies.parse_ref(ref, 3)
            else:
                (start, ident), due = copies.parse_ref(ref), due_ms
            self._file_tombstone(start, kind, ident, due, offset, offset + len(raw))
        ref = props.get(level_prop)
        if ref is not None:
            level, qoff, due = copies.parse_ref(ref, 3)
            if 1 <= level <= len(self.level_lanes):
                self.level_lanes[level - 1].cancelled[qoff] = (kind, due)
                if self._in_flight.applied_level(level, qoff):
                    self._wake()  # its lane stopped at it (``_claim_level``) and may go on now

    def _file_tombstone(self, start: int, kind: int, ident: int, due_ms: int, offset: int, ticket: int) -> None:
        """Append ``kind`` (CANCELLED or MOVED) for timer entry ``ident`` to bucket ``start``, for
        the record at ``offset`` (ending at ``ticket``), and drop the target's in-flight mark.

        When the mark is the one this very record set, its writer found the target pending in
        ``start`` (the bucket its reference names: ``recall._state``, ``keyed._target``), and
        since then no tick claimed it and no other tombstone was written for it: the bucket's
        kept count may drop by one (``Horizon.count_appended``). Anything else (a replay at
        start-up, a record absorbed again after a failed pass, a record this process did not
        write) proves nothing, and the count is dropped."""
        proven = self._in_flight.timer_mark(ident) == (kind, ticket)
        self._append(start, schedlog.encode_entry(kind, ident, due_ms, offset), ident if proven else None)
        # Applied: the target is no longer in flight (``chronoq.timer.recall``). Only now, so no
        # tick claims it between the record's write and this.
        self._in_flight.applied_timer(ident)
