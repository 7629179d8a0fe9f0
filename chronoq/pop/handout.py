"""A receive's pass over a topic's queues (``HandOut``, a part of ``PopService``): for each queue,
from the group's pop offset, read what may be handed out (``reading.py``), merge FIFO entries
due for redelivery in place, and open one CK per queue with what was chosen; each message goes
out as a ``Popped`` with its receipt handle.

A mixin, like ``chronoq.timer.absorb``: the in-flight books, the blocked retry queues and the
broker are the service's state, shared with settling and ticking.
"""

from __future__ import annotations

from dataclasses import dataclass

from chronoq.broker.broker import PROP_MESSAGE_GROUP
from chronoq.core import model
from chronoq.core.model import Message
from chronoq.pop import copies, reading
from chronoq.pop import handle as handles
from chronoq.pop.groups import GroupConfig
from chronoq.pop.inflight import QueueState
from chronoq.pop.names import PROP_DLQ_ORIGIN_TOPIC, PROP_ORIGIN_TOPIC


@dataclass(slots=True)
class Popped:
    message: Message          # retried/dead-lettered: origin topic and id; queue_id/offset: where read
    receipt_handle: str       # opaque printable ASCII
    delivery_attempt: int     # >= 1 (previous deliveries + 1)
    invisible_until_ms: int
    message_group: str | None  # FIFO group, if any


class HandOut:
    """Mixed into ``PopService``: uses its ``broker``, ``_inflight`` and ``_blocked``."""

    def _pop_topic(self, gcfg: GroupConfig, topic: str, tcfg: model.TopicConfig, out: list[Popped],
                   refs: list, limit: int, now: int, invisible_ms: int, tags: frozenset[str] | None,
                   start: int, retry: bool) -> None:
        queues = tcfg.queues
        for i in range(queues):
            if len(out) >= limit:
                return
            self._pop_queue(gcfg, topic, tcfg.name, (start + i) % queues, out, refs, limit, now,
                            invisible_ms, tags, retry)

    def _pop_queue(self, gcfg: GroupConfig, topic: str, popped: str, qid: int, out: list[Popped],
                   refs: list, limit: int, now: int, invisible_ms: int, tags: frozenset[str] | None,
                   retry: bool) -> None:
        qs = self._queue_state(gcfg.name, popped, qid)
        if gcfg.fifo and qs.fifo_inflight:
            return  # an earlier message of this queue is in flight (I5)
        if qs.blocked_until:
            if qs.blocked_until > now:
                return
            qs.blocked_until = 0
            self._blocked.discard(qs)
        lo, hi = self.broker.queue_bounds(popped, qid)
        if qs.pop_offset < lo:  # retention removed what this group had not read
            qs.pop_offset = lo
            self._inflight.dirty.add(qs)
        if qs.pop_offset >= hi and not qs.pending:
            return
        need = limit - len(out)
        fresh, next_offset = reading.read_fresh(self.broker, self._blocked, qs, topic, popped, qid, hi, need, now,
                                                 tags, retry)
        if qs.pending:
            chosen, next_offset = reading.merge_pending(qs, fresh, next_offset, need)
        else:
            chosen = fresh
        if qs.skip:
            qs.skip = {o for o in qs.skip if o >= next_offset}
        if next_offset != qs.pop_offset:
            qs.pop_offset = next_offset
            self._inflight.dirty.add(qs)
        if chosen:
            self._hand_out(gcfg, topic, qs, chosen, out, refs, now, invisible_ms)

    def _hand_out(self, gcfg: GroupConfig, topic: str, qs: QueueState, chosen: list, out: list[Popped],
                  refs: list, now: int, invisible_ms: int) -> None:
        inflight = self._inflight
        offsets, attempts, messages, sources = [], [], [], []
        aging_ms = None
        log_now = False
        for m, attempt, src, index in chosen:
            if src is not None:  # an expired FIFO entry: read it again, settle it once handed on
                m = copies.read_one(self.broker, qs.topic, qs.queue_id, src.offsets[index])
                if m is None:
                    inflight.settle(src, index)
                    continue
                sources.append((src, index))
                aging_ms = src.aging_ms if aging_ms is None else min(aging_ms, src.aging_ms)
                log_now = log_now or src.logged
            offsets.append(m.queue_offset)
            attempts.append(attempt)
            messages.append(m)
        if not messages:
            return
        ck = inflight.open(qs, topic, offsets, attempts, now, invisible_ms, fifo=gcfg.fifo,
                           aging_ms=aging_ms, log_now=log_now)
        for src, index in sources:
            inflight.settle(src, index, ck)
        encode = handles.encode
        ck_id, qid, deadline = ck.ck_id, qs.queue_id, ck.deadline_ms
        for i, m in enumerate(messages):
            props = m.properties
            view = copies.view(m) if props and (PROP_ORIGIN_TOPIC in props or PROP_DLQ_ORIGIN_TOPIC in props) else m
            out.append(Popped(view, encode(ck_id, i, qid, m.queue_offset), attempts[i], deadline,
                              view.properties.get(PROP_MESSAGE_GROUP) if props else None))
            refs.append((ck, i))

    def _queue_state(self, group: str, topic: str, qid: int, *, recovered: bool = False) -> QueueState:
        """The state of ``group`` reading queue ``qid`` of ``topic``, made on first use (a new
        group/topic pair past ``max_subscriptions`` is refused, unless the POP log names it)."""
        qs = self._inflight.queues.get((group, topic, qid))
        if qs is None:
            if not recovered:
                self._check_subscription(group, topic)
            committed = self.broker.get_offset(group, topic, qid)
            lo, hi = self.broker.queue_bounds(topic, qid)
            if committed is None:  # a new group starts at the oldest retained message
                qs = QueueState(group, topic, qid, lo, -1)
            else:
                qs = QueueState(group, topic, qid, min(max(committed, lo), hi), min(committed, hi))
            self._inflight.add_queue(qs)
        return qs
