"""A message's life from the trace (``chronoq.broker.trace``) and the records of the log. Pure: bytes in,
plain data out.

``TraceSearch`` is fed the bodies of CHRONOQ_TRACE records oldest first and keeps the events of
the wanted message ids: stored, visible, each delivery attempt, recall and reschedule carry the
message id; an ack carries only the (topic, queue, offset) of the record that was delivered, so
it is matched to a delivery seen earlier (a delivery's ref is learnt from its DELIVERED event).

Cost: a trace record holds up to 8192 events. Rather than unpack them all, the search looks for
the 4-byte string index of a wanted id (or the 8-byte ref offset of a wanted ack) with
``bytes.find`` and keeps only hits at that field's position in a 48-byte event, so a record that
does not mention the message costs one substring search of its string table.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field

from chronoq.broker import trace
from chronoq.pop import names
from chronoq.store import record
from chronoq.timer import copies
from chronoq.core.delay_levels import DELAY_TOPIC

_U32 = struct.Struct("<I")
_I64 = struct.Struct("<q")
_MID_AT = 8          # EVENT field offsets (chronoq.broker.trace documents the layout)
_REF_OFFSET_AT = 40
assert trace.EVENT_SIZE == 48 and trace.EVENT.size == 48
IDS_MAX = 16  # message ids one lookup follows (a key shared by many messages: the first ones)

# Order of events with the same timestamp (stored before visible before delivered ...).
_KIND_ORDER = {trace.STORED: 0, trace.RESCHEDULED: 1, trace.RECALLED: 2, trace.VISIBLE: 3, trace.DELIVERED: 4,
               trace.ACKED: 5, trace.DEAD_LETTERED: 6}


def _aligned(raw: bytes, needle: bytes, field_at: int):
    """Indexes of the events whose field at ``field_at`` starts with ``needle``."""
    size = trace.EVENT_SIZE
    pos = raw.find(needle)
    while pos >= 0:
        if pos % size == field_at:
            yield pos // size
        pos = raw.find(needle, pos + 1)


@dataclass
class TraceSearch:
    ids: set[str]
    events: list[dict] = field(default_factory=list)
    records: int = 0          # trace records looked at
    # (group, ref topic, queue, offset) -> message id of each delivery seen, to match its ack
    _refs: dict[tuple[str, str, int, int], str] = field(default_factory=dict)

    def feed(self, body: bytes) -> None:
        """One trace record body (records must come oldest first)."""
        self.records += 1
        table, raw, n = trace.decode(body)
        # Every entry of a wanted id: a writer may repeat a string (chronoq.broker.trace's format).
        wanted = [i for i, s in enumerate(table) if s in self.ids]
        hits: set[int] = set()
        for i in wanted:
            hits.update(_aligned(raw, _U32.pack(i), _MID_AT))
        for k in sorted(hits):  # first the id's own events: its deliveries name the refs acks use
            ev = self._event(table, raw, k)
            if ev["code"] == trace.ACKED or ev["message_id"] not in self.ids:
                continue
            if ev["code"] == trace.DELIVERED:
                self._refs[(ev["group"], ev["ref_topic"], ev["ref_queue"], ev["ref_offset"])] = ev["message_id"]
            self.events.append(ev)
        if not self._refs:
            return
        ref_topics = {t for (_g, t, _q, _o) in self._refs}
        if not any(s in ref_topics for s in table):
            return
        acks: set[int] = set()
        for roff in {o for (_g, _t, _q, o) in self._refs}:
            acks.update(_aligned(raw, _I64.pack(roff), _REF_OFFSET_AT))
        for k in sorted(acks):
            ev = self._event(table, raw, k)
            if ev["code"] != trace.ACKED:
                continue
            seen = self._refs.get((ev["group"], ev["ref_topic"], ev["ref_queue"], ev["ref_offset"]))
            if seen is None:
                continue  # an ack of another message (another queue or group at the same offset)
            ev["message_id"] = seen
            self.events.append(ev)

    @staticmethod
    def _event(table: list[str], raw: bytes, k: int) -> dict:
        (kind, flags, attempt, topic, mid, group, rtopic, rqueue, ts, due,
         roff) = trace.EVENT.unpack_from(raw, k * trace.EVENT_SIZE)

        def text(j: int):
            return None if j == trace.NONE else table[j]

        return {"kind": trace.KIND_NAMES.get(kind, str(kind)), "code": kind, "flags": flags, "attempt": attempt,
                "topic": text(topic), "message_id": text(mid), "group": text(group), "ref_topic": text(rtopic),
                "ref_queue": rqueue, "ts_ms": ts, "due_ms": due, "ref_offset": roff}

    def timeline(self) -> list[dict]:
        """The events found, in time order."""
        return sorted(self.events, key=lambda e: (e["ts_ms"], _KIND_ORDER.get(e["code"], 9)))


def summary(events: list[dict], now_ms: int) -> dict:
    """Where the message stands, from its events (a timeline of one message id)."""
    state = {"stored_ms": None, "due_ms": None, "visible_ms": None, "attempts": {}, "acked": [], "dead_lettered": [],
             "recalled_ms": None}
    for e in events:
        k = e["code"]
        if k == trace.STORED and state["stored_ms"] is None:
            state["stored_ms"] = e["ts_ms"]
            state["due_ms"] = e["due_ms"] or e["ts_ms"]
            if not e["flags"] & trace.FLAG_DELAYED:
                state["visible_ms"] = e["ts_ms"]
        elif k == trace.RESCHEDULED:
            state["due_ms"] = e["due_ms"]
        elif k == trace.VISIBLE and state["visible_ms"] is None:
            state["visible_ms"] = e["ts_ms"]
        elif k == trace.DELIVERED:
            g = state["attempts"]
            g[e["group"]] = max(g.get(e["group"], 0), e["attempt"])
        elif k == trace.ACKED:
            state["acked"].append(e["group"])
        elif k == trace.DEAD_LETTERED:
            state["dead_lettered"].append(e["group"])
        elif k == trace.RECALLED:
            state["recalled_ms"] = e["ts_ms"]
    groups = {}
    for g in state["attempts"]:
        groups[g] = ("dead-lettered" if g in state["dead_lettered"] else "acked" if g in state["acked"]
                     else "in flight or awaiting retry")
    state["groups"] = groups
    if state["recalled_ms"] is not None:
        status = "recalled"
    elif groups:
        status = "; ".join(f"{st} ({g})" for g, st in sorted(groups.items()))
    elif state["stored_ms"] is None:
        status = "unknown"  # its stored event is older than the trace window read
    elif state["visible_ms"] is None:
        status = "pending" if (state["due_ms"] or 0) > now_ms else "due"
    else:
        status = "visible, not yet received"
    state["status"] = status
    return state


# ------------------------------------------------------------------------ records of the log
# A timer copy written ahead of its due time (``timer_prewrite_ms``) that readers cannot see yet.
KIND_HELD_COPY = "written ahead (hidden until due)"


def record_kind(topic: str, flags: int, props: dict) -> str:
    """What a stored record is in the message's life (for the lookup's table of records)."""
    if topic.startswith(names.DLQ_PREFIX):
        return "dead letter"
    if topic.startswith(names.RETRY_PREFIX):
        return "retry copy"
    if flags & record.FLAG_DELAYED or topic == DELAY_TOPIC:
        return "scheduled"
    if copies.PROP_TIMER_REF in props or copies.PROP_DELAY_REF in props:
        return "made visible (timer copy)"
    return "stored"


def origin_id(message_id: str, props: dict) -> str:
    """The id the message's producer knows (retry and DLQ copies carry it as a property)."""
    return props.get(names.PROP_ORIGIN_MESSAGE_ID) or props.get(names.PROP_DLQ_ORIGIN_MESSAGE_ID) or message_id


def origin_topic(topic: str, props: dict) -> str:
    return (props.get(names.PROP_ORIGIN_TOPIC) or props.get(names.PROP_DLQ_ORIGIN_TOPIC)
            or props.get(copies.PROP_DELAY_TOPIC) or topic)


def matches(query: str, message_id: str, keys: tuple[str, ...], props: dict) -> bool:
    """Whether a record answers a lookup: by its id, its origin id, or one of its keys."""
    return query == message_id or query in keys or query == origin_id(message_id, props)
