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
                    none may contain a newline: names and ids forbid control characters);
                    a writer may repeat a string (chronoq writes names once, message ids
                    once per event): readers go by index only
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

import itertools
import struct
import sys
from array import array
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

# The field order of an event as a tuple (``Events.from_tuples``, ``Events.tuples``).
_Event = tuple  # (kind, flags, attempt, topic, message_id, group, ref_topic, ref_queue, ts, due, ref_offset)

_LITTLE = sys.byteorder == "little"


class Events:
    """Buffered events, a column per EVENT field: the hooks extend columns (whole batches at C
    speed where they can) and ``encode`` interleaves the columns with strided copies, so no
    tuple is made, unpacked or packed per event. String columns hold str, UTF-8 bytes (message
    ids from the write path) or None."""

    __slots__ = ("head", "topic", "message_id", "group", "ref_topic", "ref_queue", "ts", "due", "ref_offset")

    def __init__(self) -> None:
        self.head = array("I")  # EVENT's first 4 bytes: kind | flags << 8 | attempt << 16
        self.topic: list = []
        self.message_id: list = []
        self.group: list = []
        self.ref_topic: list = []
        self.ref_queue = array("I")
        self.ts = array("q")
        self.due = array("q")
        self.ref_offset = array("q")

    def __len__(self) -> int:
        return len(self.head)

    def __getitem__(self, part: slice) -> "Events":
        if not isinstance(part, slice):  # (and so not iterable by accident: see ``tuples``)
            raise TypeError("Events are sliced, not indexed")
        out = Events.__new__(Events)
        for name in Events.__slots__:
            setattr(out, name, getattr(self, name)[part])
        return out

    def add(self, kind: int, flags: int, attempt: int, topic, message_id, group, ref_topic, ref_queue: int,
            ts: int, due: int, ref_offset: int) -> None:
        self.head.append(kind | flags << 8 | attempt << 16)
        self.topic.append(topic)
        self.message_id.append(message_id)
        self.group.append(group)
        self.ref_topic.append(ref_topic)
        self.ref_queue.append(ref_queue)
        self.ts.append(ts)
        self.due.append(due)
        self.ref_offset.append(ref_offset)

    def truncate(self, n: int) -> None:
        for name in Events.__slots__:
            del getattr(self, name)[n:]

    def consistent(self) -> bool:
        n = len(self.head)
        return all(len(getattr(self, name)) == n for name in Events.__slots__)

    @classmethod
    def from_tuples(cls, events) -> "Events":
        out = cls()
        for e in events:
            out.add(*e)
        return out

    def tuples(self) -> list[_Event]:
        return [(h & 0xFF, h >> 8 & 0xFF, h >> 16, *rest) for h, *rest in zip(
            self.head, self.topic, self.message_id, self.group, self.ref_topic, self.ref_queue, self.ts, self.due,
            self.ref_offset)]


def _extend_stored(ev: Events, heads, topics, message_ids, ts, dues) -> None:
    """STORED events from their columns (the rest: no group, no reference)."""
    n = len(heads)
    ev.head.extend(heads)
    ev.topic += topics
    ev.message_id += message_ids
    nones = [None] * n
    ev.group += nones
    ev.ref_topic += nones
    ev.ref_queue += array("I", (0,)) * n
    ev.ts.extend(ts)
    ev.due.extend(dues)
    ev.ref_offset += array("q", (0,)) * n




# The compiled build appends a receive's and an ack's events, and the kept batches of sends, in C
# (trace.pxd's ``_add_refs_in_c``, ``_add_runs_in_c``).
_COMPILED = not __file__.endswith(".py")


def _add_refs(ev: Events, kind: int, group: str, popped: list | None, refs: list, now_ms: int) -> None:
    """Events of ``kind`` (DELIVERED, ACKED) about ``refs[i] = (checkpoint, index)`` appended
    to ``ev``: a receive's (``popped[i]``, a ``chronoq.pop.handout.Popped``, was read from
    ``refs[i]``: its topic, id and attempt go in) or an ack's (``popped`` None: no topic, no id).

    The pure build's, column by column, and the reference trace.pxd's ``_add_refs_in_c`` (the
    compiled build's: one C loop, a few hundred instructions an event, where these column
    extends cost ~20k for a receive of one message and ~18k for an ack of one; callgrind,
    ``bench/official_replay.py --lone``) is held to (tests/unit/test_trace.py)."""
    if _COMPILED:
        _add_refs_in_c(ev, kind, group, popped, refs, now_ms)  # noqa: F821 - trace.pxd's
        return
    n = len(refs)
    if popped is None:
        ev.head += array("I", (kind,)) * n
        nones = [None] * n
        ev.topic += nones
        ev.message_id += nones
    else:
        assert len(popped) == n, (len(popped), n)
        ev.head.extend([kind | min(p.delivery_attempt, 0xFFFF) << 16 for p in popped])
        messages = [p.message for p in popped]
        ev.topic += [m.topic for m in messages]
        ev.message_id += [m.message_id for m in messages]
    ev.group += [group] * n
    queues = [ck.queue for ck, _ in refs]
    ev.ref_topic += [q.topic for q in queues]
    ev.ref_queue.extend([q.queue_id for q in queues])
    ev.ts += array("q", (now_ms,)) * n
    ev.due += array("q", (0,)) * n
    ev.ref_offset.extend([ck.offsets[i] for ck, i in refs])


def encode(events) -> bytes:
    """One trace record body for ``events`` (``Events``, or a list of event tuples)."""
    if not isinstance(events, Events):
        events = Events.from_tuples(events)
    n = len(events)
    assert 0 < n <= 0xFFFFFFFF and events.consistent()
    # The string table: names (topics, groups: few) once each, str and bytes of a name sharing
    # an entry; message ids (nearly all distinct) in event order, one entry per event that has
    # one, so no Python work is done per distinct id (an id stored and delivered within one
    # flush is in the table twice; readers go by index).
    strings: list[bytes] = []
    index: dict = {None: NONE}

    def indexes(column: list) -> array:
        for text in set(column).difference(index):  # only names not seen yet: no loop per event
            raw = text if type(text) is bytes else text.encode()
            i = index.get(raw)
            if i is None:
                i = index[raw] = len(strings)
                strings.append(raw)
            index[text] = i
        return array("I", map(index.__getitem__, column))

    names = (indexes(events.topic), indexes(events.group), indexes(events.ref_topic))
    ids = events.message_id
    first = len(strings)
    present = [m if type(m) is bytes else m.encode() for m in ids if m is not None]
    strings += present
    if len(present) == len(ids):
        id_indexes = array("I", range(first, first + len(ids)))
    else:
        position = itertools.count(first)
        id_indexes = array("I", [NONE if m is None else next(position) for m in ids])
    columns32 = (events.head, names[0], id_indexes, names[1], names[2], events.ref_queue)
    columns64 = (events.ts, events.due, events.ref_offset)
    out = bytearray(n * EVENT_SIZE)
    words, quads = memoryview(out).cast("I"), memoryview(out).cast("q")
    for k, column in enumerate(columns32):  # EVENT's 4-byte fields are its words 0..5
        words[k::EVENT_SIZE // 4] = column if _LITTLE else _swapped(column)
    for k, column in enumerate(columns64, start=3):  # ... and its 8-byte fields quads 3..5
        quads[k::EVENT_SIZE // 8] = column if _LITTLE else _swapped(column)
    table = b"\n".join(strings)
    return HEAD.pack(MAGIC, n, len(table)) + table + bytes(out)


def _swapped(column: array) -> array:
    column = array(column.typecode, column)
    column.byteswap()
    return column


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


def bodies(events: Events) -> list[bytes]:
    """Trace record bodies for ``events``, at most EVENTS_PER_RECORD each."""
    return [encode(events[i:i + EVENTS_PER_RECORD]) for i in range(0, len(events), EVENTS_PER_RECORD)]


def _add_runs(ev: Events, runs: list) -> None:
    """STORED events of ``TraceRecorder.stored_plain``'s kept batches ``(topic, message ids,
    now_ms, due times or None)`` appended to ``ev``.

    The pure build's, a few column extends per batch (whole arrays: a batch of many pays no
    conversion per event), then one per constant column; the compiled build's is trace.pxd's
    ``_add_runs_in_c`` (one C loop: a lone send's spill ~11k instructions here), held to this one
    (tests/unit/test_trace.py)."""
    if _COMPILED:
        _add_runs_in_c(ev, runs, STORED, STORED | FLAG_DELAYED << 8)  # noqa: F821 - trace.pxd's
        return
    total = 0
    for topic, ids, now_ms, delayed_dues in runs:
        n = len(ids)
        total += n
        ev.topic += [topic] * n
        ev.message_id += ids
        ev.ts += array("q", (now_ms,)) * n
        if delayed_dues is None:
            ev.head += array("I", (STORED,)) * n
            ev.due += array("q", (0,)) * n
        else:
            assert len(delayed_dues) == n, (len(delayed_dues), n)
            ev.head += array("I", (STORED | FLAG_DELAYED << 8,)) * n
            ev.due += array("q", delayed_dues)
    nones = [None] * total
    ev.group += nones
    ev.ref_topic += nones
    ev.ref_queue += array("I", (0,)) * total
    ev.ref_offset += array("q", (0,)) * total


class TraceRecorder:
    """The in-memory buffer behind the hooks. Every method runs on the broker's thread.

    The send path's hook (``stored_plain``) only keeps its batch (``_runs``: topic, message ids,
    time, due times); the batches become events (``_spill``: every batch kept since, in bulk)
    before any other hook adds one and whenever ``events`` is read, so the buffer's order is
    the hooks' order. (Callgrind, a lone send: the hook extending every column cost ~22k
    instructions; kept, ~3k at the send and ~11k when spilled by the Python ``_add_runs``,
    wherever that falls; the compiled build's C loop took that ~11k off a lone send.)"""

    def __init__(self, flush_ms: int, delay_topic: str):
        self.flush_ms = flush_ms
        self._delay_topic = delay_topic
        self._events = Events()
        self._runs: list[tuple] = []  # stored_plain's batches not in ``_events`` yet
        self._run_events = 0  # the events they hold
        self.dropped = 0
        self.written = 0
        self._first_ms: int | None = None

    @property
    def events(self) -> Events:
        """Every buffered event, in the order the hooks added them."""
        if self._runs:
            self._spill()
        return self._events

    @events.setter
    def events(self, events: Events) -> None:
        self._runs, self._run_events = [], 0
        self._events = events

    def _spill(self) -> None:
        """The kept ``stored_plain`` batches as events (``_add_runs``)."""
        runs, self._runs, self._run_events = self._runs, [], 0
        _add_runs(self._events, runs)

    def _room(self, n: int, now_ms: int) -> bool:
        if len(self.events) + n > BUFFER_MAX:
            self.dropped += n
            return False
        if self._first_ms is None:
            self._first_ms = now_ms
        return True

    # ------------------------------------------------------------------ hooks
    def stored(self, prepared: Iterable, now_ms: int) -> None:
        """Messages just written to the log (``store.Prepared``; system records are skipped but
        for delay-level records, traced under their real topic). Column extends per batch: the
        batch is transposed once (``zip``) and no event tuple is made."""
        system, delay_topic = record.FLAG_SYSTEM, self._delay_topic
        rows = [p for p in prepared if not p[2] & system or p[0] == delay_topic]
        if not rows:
            return
        # Prepared field order: topic, queue id, flags, born, deliver_at_ms, message id, ...
        topics, _qids, flags, _born, dues, message_ids, _tags, _keys, props, _bodies = zip(*rows)
        marked = record.FLAG_DELAYED | system  # (a system record here is a delay-level record)
        delayed_head = STORED | FLAG_DELAYED << 8
        if any(f & system for f in flags):
            topics = [record.decode_properties(pr).get("__DELAY_TOPIC", t) if f & system else t
                      for t, f, pr in zip(topics, flags, props)]
        self._add_stored(array("I", [delayed_head if f & marked else STORED for f in flags]), topics, message_ids,
                         array("q", dues), now_ms)

    def stored_plain(self, topic: str, message_ids: list[bytes], now_ms: int, delayed_dues: list | None = None) -> None:
        """``stored`` for a batch of messages of one topic, not system, all plain or (with their
        ``delayed_dues``) all delayed: the same events, kept as the batch until ``_spill``
        (``Sender.write_batch``'s plain and delayed batches). Past BUFFER_MAX the batch's tail
        is dropped (counted)."""
        n = len(message_ids)
        room = BUFFER_MAX - len(self._events) - self._run_events
        if n > room:
            room = max(room, 0)
            self.dropped += n - room
            if not room:
                return
            n, message_ids = room, message_ids[:room]
            if delayed_dues is not None:
                delayed_dues = delayed_dues[:room]
        self._runs.append((topic, message_ids, now_ms, delayed_dues))
        self._run_events += n
        if self._first_ms is None:
            self._first_ms = now_ms

    def _add_stored(self, heads: array, topics, message_ids, dues: array, now_ms: int) -> None:
        """STORED events from their columns (the rest: no group, no reference, ``now_ms``)."""
        ev = self.events
        start = len(ev.head)
        _extend_stored(ev, heads, topics, message_ids, array("q", (now_ms,)) * len(heads), dues)
        self._trim(ev, start, now_ms)

    def visible(self, topics: list[str], message_ids: list[bytes], dues: list[int], visible_ms: int) -> None:
        """Timer copies made visible at ``visible_ms``, given as columns (``chronoq.timer.delivery``)."""
        ev = self.events
        start, n = len(ev.head), len(topics)
        assert len(message_ids) == n and len(dues) == n, (n, len(message_ids), len(dues))
        # Column by column, at C speed: a burst due at one instant releases all its copies in one
        # loop callback (bench/stalls.py --due-burst 100000), and an ``add`` per event cost 30 ms
        # of it per 100,000 against 14 ms so (``visible`` alone, timed in a scratch script).
        ev.head += array("I", (VISIBLE,)) * n
        ev.topic += topics
        ev.message_id += message_ids
        ev.group += [None] * n
        ev.ref_topic += [None] * n
        ev.ref_queue += array("I", (0,)) * n
        ev.ts += array("q", (visible_ms,)) * n
        ev.due.extend(dues)
        ev.ref_offset += array("q", (0,)) * n
        self._trim(ev, start, visible_ms)

    def delivered(self, group: str, popped: list, refs: list, now_ms: int) -> None:
        """A POP receive: ``popped[i]`` was read from ``refs[i] = (checkpoint, index)``."""
        ev = self.events
        start = len(ev.head)
        _add_refs(ev, DELIVERED, group, popped, refs, now_ms)
        self._trim(ev, start, now_ms)

    def acked(self, group: str, refs: list, now_ms: int) -> None:
        """Acks: ``refs[i] = (checkpoint, index)`` of each settled message."""
        ev = self.events
        start = len(ev.head)
        _add_refs(ev, ACKED, group, None, refs, now_ms)
        self._trim(ev, start, now_ms)

    def dead_lettered(self, group: str, topic: str, message_id: str, now_ms: int) -> None:
        if self._room(1, now_ms):
            self.events.add(DEAD_LETTERED, 0, 0, topic, message_id, group, None, 0, now_ms, 0, 0)

    def recalled(self, topic: str, message_id: str, due_ms: int, now_ms: int) -> None:
        if self._room(1, now_ms):
            self.events.add(RECALLED, 0, 0, topic, message_id, None, None, 0, now_ms, due_ms, 0)

    def rescheduled(self, topic: str, message_id: str, due_ms: int, now_ms: int) -> None:
        if self._room(1, now_ms):
            self.events.add(RESCHEDULED, 0, 0, topic, message_id, None, None, 0, now_ms, due_ms, 0)

    def _trim(self, ev: Events, start: int, now_ms: int) -> None:
        """After a bulk append to ``ev`` (``self.events``, from ``start`` events on): enforce
        BUFFER_MAX (drop the new events past it, counted). (``len(ev.head)``, not ``len(ev)``:
        Events.__len__ is a Python call, and a receive or ack of one message makes four.)"""
        held = len(ev.head)
        over = held - BUFFER_MAX
        if over > 0:
            ev.truncate(BUFFER_MAX)
            self.dropped += over
            held = BUFFER_MAX
        if self._first_ms is None and held > start:
            self._first_ms = now_ms

    # ------------------------------------------------------------------ flushing
    def due(self, now_ms: int) -> bool:
        """Whether ``flush`` has work now (buffer older than ``flush_ms`` or full enough)."""
        held = len(self._events) + self._run_events
        if not held:
            return False
        return held >= EVENTS_PER_RECORD or now_ms - (self._first_ms or now_ms) >= self.flush_ms

    def take_events(self) -> Events:
        """Empty the buffer; the caller encodes (``bodies``) and writes the events, a slice at a
        time on the server (a second of busy traffic is tens of thousands of events)."""
        events, self.events = self.events, Events()  # (``events`` spills the kept batches first)
        self._first_ms = None
        self.written += len(events)
        return events
