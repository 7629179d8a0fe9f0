"""Message life trace: what happened to each message, recorded for the delivery audit.

The broker records, per message of a user topic: stored (accepted, with its due time), visible
(a delayed message made visible by the timer), each delivery attempt to a consumer group (POP
receive), ack, dead-letter, recall and reschedule. Hooks in the send, timer, POP, recall and
reschedule paths only append a tuple to an in-memory buffer; ``flush`` (called from
``Broker.maintenance``, at most every ``trace_flush_ms``, and by the ``FlushTrace`` RPC) writes
the buffer as a few system messages of ``TRACE_TOPIC``. There is no fsync and no RPC per event:
trace records become durable with the broker's next fsync, like any write. ``chronoq audit``
(``chronoq.spark.audit``) reads the topic through the Spark data source and decodes the bodies
in bulk with NumPy.

Crash window: events still in the buffer (at most ``trace_flush_ms`` old) are lost with the
process, and trace records not yet fsynced with the machine. The audit then under-counts: a lost
*visible* event would make a delivered message look lost, so the audit reports loss only for
messages whose due time is older than a grace period and says how many trace events were dropped.

Trace record body (one system message, little-endian)::

    off   size      field
      0      4      magic b"CQT1"
      4      4      n, u32: number of events
      8      4      s, u32: byte length of the string table
     12      s      string table: UTF-8 strings joined by b"\\n" (topics, groups, message ids;
                    none may contain a newline: names and ids forbid control characters)
     12+s  48 * n   events, EVENT below; string fields are indexes into the table
                    (NONE = 0xFFFFFFFF: absent)

EVENT (48 bytes)::

      0  1  kind       STORED .. RESCHEDULED
      1  1  flags      STORED: bit 0 = delayed (the timer makes it visible later)
      2  2  attempt    DELIVERED: delivery attempt (1 = first)
      4  4  topic      the message's topic (a retried message: its original topic)
      8  4  message_id the message's id (a retried message: its original id)
     12  4  group      consumer group (DELIVERED, ACKED, DEAD_LETTERED)
     16  4  ref_topic  DELIVERED/ACKED: topic of the queue the message was read from ...
     20  4  ref_queue  ... its queue id ...
     24  8  ts_ms      when it happened (broker clock, epoch ms)
     32  8  due_ms     STORED/VISIBLE/RECALLED: due time (0: immediate); RESCHEDULED: new due
     40  8  ref_offset ... and its offset. (ref_topic, ref_queue, ref_offset) names one stored
                       record, so an ACKED event is matched to its DELIVERED events by it.
"""

from __future__ import annotations

import struct
from typing import Iterable

from chronoq.store import record

TRACE_TOPIC = "CHRONOQ_TRACE"
MAGIC = b"CQT1"
HEAD = struct.Struct("<4sII")
EVENT = struct.Struct("<BBHIIIIIqqq")
EVENT_SIZE = 48
assert HEAD.size == 12 and EVENT.size == EVENT_SIZE
NONE = 0xFFFFFFFF

STORED = 1
VISIBLE = 2
DELIVERED = 3
ACKED = 4
DEAD_LETTERED = 5
RECALLED = 6
RESCHEDULED = 7
KIND_NAMES = {STORED: "stored", VISIBLE: "visible", DELIVERED: "delivered", ACKED: "acked",
              DEAD_LETTERED: "dead_lettered", RECALLED: "recalled", RESCHEDULED: "rescheduled"}
FLAG_DELAYED = 0x01

EVENTS_PER_RECORD = 8192      # one trace message holds at most this many events (~700 KiB)
BUFFER_MAX = 2_000_000        # events held between flushes; past this new events are dropped (counted)

# The field order of a buffered event tuple (EVENT without the string indexes resolved).
_Event = tuple  # (kind, flags, attempt, topic, message_id, group, ref_topic, ref_queue, ts, due, ref_offset)


def encode(events: list[_Event]) -> bytes:
    """One trace record body for ``events`` (buffered tuples)."""
    assert 0 < len(events) <= 0xFFFFFFFF
    # Strings are str or (message ids from the write path) UTF-8 bytes; the table holds each
    # once. The lookups are inlined: this runs for every event the broker records.
    strings: list[bytes] = []
    index: dict = {None: NONE}
    get = index.get

    def intern(text) -> int:
        raw = text if type(text) is bytes else text.encode()
        i = get(raw)
        if i is None:
            i = index[raw] = len(strings)
            strings.append(raw)
        index[text] = i
        return i

    pack = EVENT.pack
    body = []
    add = body.append
    for kind, flags, attempt, topic, mid, group, rtopic, rqueue, ts, due, roff in events:
        t = get(topic)
        if t is None:
            t = intern(topic)
        m = get(mid)
        if m is None:
            m = intern(mid)
        g = get(group)
        if g is None:
            g = intern(group)
        r = get(rtopic)
        if r is None:
            r = intern(rtopic)
        add(pack(kind, flags, attempt, t, m, g, r, rqueue, ts, due, roff))
    table = b"\n".join(strings)
    return HEAD.pack(MAGIC, len(events), len(table)) + table + b"".join(body)


def decode(body: bytes) -> tuple[list[str], bytes, int]:
    """(string table, raw event bytes, event count) of a trace body; ValueError if malformed."""
    if len(body) < HEAD.size:
        raise ValueError("trace record shorter than its header")
    magic, n, s = HEAD.unpack_from(body, 0)
    if magic != MAGIC:
        raise ValueError(f"not a trace record (magic {magic!r})")
    if HEAD.size + s + n * EVENT_SIZE != len(body):
        raise ValueError("trace record lengths do not add up")
    table = body[HEAD.size:HEAD.size + s].decode().split("\n") if s else []
    return table, body[HEAD.size + s:], n


def decode_events(body: bytes) -> list[dict]:
    """Every event of a trace body as a dict (for tests and small tools; Spark decodes with NumPy)."""
    table, raw, n = decode(body)

    def text(i: int):
        return None if i == NONE else table[i]

    out = []
    for kind, flags, attempt, topic, mid, group, rtopic, rqueue, ts, due, roff in EVENT.iter_unpack(raw):
        out.append({"kind": KIND_NAMES.get(kind, str(kind)), "flags": flags, "attempt": attempt,
                    "topic": text(topic), "message_id": text(mid), "group": text(group),
                    "ref_topic": text(rtopic), "ref_queue": rqueue, "ts_ms": ts, "due_ms": due,
                    "ref_offset": roff})
    return out


def bodies(events: list[_Event]) -> list[bytes]:
    """Trace record bodies for ``events``, at most EVENTS_PER_RECORD each."""
    return [encode(events[i:i + EVENTS_PER_RECORD]) for i in range(0, len(events), EVENTS_PER_RECORD)]


class TraceRecorder:
    """The in-memory buffer behind the hooks. Every method runs on the broker's thread."""

    def __init__(self, flush_ms: int, delay_topic: str):
        self.flush_ms = flush_ms
        self._delay_topic = delay_topic
        self.events: list[_Event] = []
        self.dropped = 0
        self.written = 0
        self._first_ms: int | None = None

    def _room(self, n: int, now_ms: int) -> bool:
        if len(self.events) + n > BUFFER_MAX:
            self.dropped += n
            return False
        if self._first_ms is None:
            self._first_ms = now_ms
        return True

    # ------------------------------------------------------------------ hooks
    def stored(self, prepared: Iterable, now_ms: int) -> None:
        """Messages just written to the log (``store.Prepared``; system records are skipped)."""
        add = self.events.append
        start = len(self.events)
        delay_topic = self._delay_topic
        system, delayed = record.FLAG_SYSTEM, record.FLAG_DELAYED
        # Positional unpacking (Prepared field order): attribute access costs more, per message.
        for topic, _qid, pflags, _born, deliver_at_ms, message_id, _tag, _keys, props, _body in prepared:
            if pflags & system:
                if topic != delay_topic:
                    continue
                topic = record.decode_properties(props).get("__DELAY_TOPIC", topic)
                flags = FLAG_DELAYED
            else:
                flags = FLAG_DELAYED if pflags & delayed else 0
            add((STORED, flags, 0, topic, message_id, None, None, 0, now_ms, deliver_at_ms, 0))
        self._trim(start, now_ms)

    def stored_plain(self, topic: str, message_ids: list[bytes], now_ms: int) -> None:
        """``stored`` for a batch of plain (not delayed, not system) messages of one topic: the
        same events, one list extend per batch (Store.write_plain's callers)."""
        start = len(self.events)
        self.events += [(STORED, 0, 0, topic, mid, None, None, 0, now_ms, 0, 0) for mid in message_ids]
        self._trim(start, now_ms)

    def visible(self, deliveries: list, visible_ms: int) -> None:
        """Timer deliveries made visible (``timer.lanes.Delivery`` with a ``prepared`` copy)."""
        start = len(self.events)
        add = self.events.append
        for d in deliveries:
            p = d.prepared
            add((VISIBLE, 0, 0, p.topic, p.message_id, None, None, 0, visible_ms, d.due_ms, 0))
        self._trim(start, visible_ms)

    def delivered(self, group: str, popped: list, refs: list, now_ms: int) -> None:
        """A POP receive: ``popped[i]`` was read from ``refs[i] = (checkpoint, index)``."""
        start = len(self.events)
        add = self.events.append
        for p, (ck, i) in zip(popped, refs):
            m = p.message
            q = ck.queue
            add((DELIVERED, 0, min(p.delivery_attempt, 0xFFFF), m.topic, m.message_id, group, q.topic,
                 q.queue_id, now_ms, 0, ck.offsets[i]))
        self._trim(start, now_ms)

    def acked(self, group: str, ref_topic: str, ref_queue: int, ref_offset: int, now_ms: int) -> None:
        if self._room(1, now_ms):
            self.events.append((ACKED, 0, 0, None, None, group, ref_topic, ref_queue, now_ms, 0, ref_offset))

    def dead_lettered(self, group: str, topic: str, message_id: str, now_ms: int) -> None:
        if self._room(1, now_ms):
            self.events.append((DEAD_LETTERED, 0, 0, topic, message_id, group, None, 0, now_ms, 0, 0))

    def recalled(self, topic: str, message_id: str, due_ms: int, now_ms: int) -> None:
        if self._room(1, now_ms):
            self.events.append((RECALLED, 0, 0, topic, message_id, None, None, 0, now_ms, due_ms, 0))

    def rescheduled(self, topic: str, message_id: str, due_ms: int, now_ms: int) -> None:
        if self._room(1, now_ms):
            self.events.append((RESCHEDULED, 0, 0, topic, message_id, None, None, 0, now_ms, due_ms, 0))

    def _trim(self, start: int, now_ms: int) -> None:
        """After a bulk append: enforce BUFFER_MAX (drop the new events past it, counted)."""
        over = len(self.events) - BUFFER_MAX
        if over > 0:
            del self.events[-over:]
            self.dropped += over
        if self._first_ms is None and len(self.events) > start:
            self._first_ms = now_ms

    # ------------------------------------------------------------------ flushing
    def due(self, now_ms: int) -> bool:
        """Whether ``flush`` has work now (buffer older than ``flush_ms`` or full enough)."""
        if not self.events:
            return False
        return len(self.events) >= EVENTS_PER_RECORD or now_ms - (self._first_ms or now_ms) >= self.flush_ms

    def take_events(self) -> list[_Event]:
        """Empty the buffer; the caller encodes (``bodies``) and writes the events. Encoding costs
        ~2 µs an event on the broker's thread, so the server does it a slice at a time."""
        events, self.events = self.events, []
        self._first_ms = None
        self.written += len(events)
        return events
