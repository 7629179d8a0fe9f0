"""Replace by key and cancel by key (``Keyed``, a part of ``TimerService``; docs/timers.md).

**Replace by key (debounce).** A timer message sent with the user property ``REPLACE_PROP``
(``CHRONOQ_REPLACE_KEY``) replaces the pending message of the same topic that holds the same
replace key. The decision is taken when the new record is written (broker thread, one ``now``,
as a recall is: ``chronoq.timer.recall``) and written *into the new record*, so the log alone
says what happened and a replay needs no index::

    __TIMER_REPLACED = "replaced:<bucket start>.<ident>.<due>:<message id>"   old one cancelled
                     | "delivered:<message id>"                               old one due/being delivered
                     (absent: no pending message held the key)

Absorbing a record with ``replaced:`` files a CANCELLED entry for the old ident (``absorb``), as
a recall record would; from the write until then the old message is *in flight* (``InFlight``)
with the new record's ticket, so no tick claims it. So at most one message per (topic, key) is
pending, the last write wins, and one durable record does it. Crash windows:

* the old message's copy written before the new record: it was claimed (or due) when the new
  record was written, so the answer was ``delivered`` and no reference was written;
* after: impossible, the old message is in flight from the new record's write on;
* the new record lost (crash before its fsync): the send was never answered; the old one fires;
* the new record durable, not absorbed: the replay absorbs it (CANCELLED) before any tick;
* retention: a rolled record (``roll``) carries the new record's bytes, reference included; the
  old one is not rolled while it is in flight (``roll``: a roll record after the new record would
  outlive it in a later pass and bring the old message back in a rebuild from the log);
* a schedule-log rebuild replays the log in order: the same entries.

**Cancel by key.** Every pending timer message of a topic carrying a RocketMQ message key gets
a recall record (``copies.control``), all in one write, each target in flight until absorbed.

**The index** (``chronoq.timer.keys``) maps (topic, key) hashes to idents. It is exact: a
message is in it from the write of its record until it is delivered (``_complete``), recalled,
replaced, cancelled or moved (the new record is indexed instead). Its build begins on first use
(``_keys_ready``: an empty index and the list of buckets, ``_keys_todo``); before that no keyed
delayed record was written in this process (writing one begins it first). ``keys_step`` then
reads buckets a bounded share at a time (``_keyed_pending``; the server's runtime in slices of
time, an embedded ``maintenance`` a few MB a call), skipping the messages in
flight, and until the last one is read a keyed call also searches the unread buckets for its key
(``_unread_candidates``). Exact at each bucket read, whatever happened since the build began: a
bucket's file and buffer plus the in-flight marks are that bucket's whole truth at any moment (a
delivery appends its DISPATCHED entry in the step that unindexes it; a recall, cancel or replace
target is in flight until its CANCELLED entry is appended), and a message written since is
already indexed (an add is idempotent). Delay-level messages are not indexed (recall them by
handle).
"""

from __future__ import annotations

import logging
import os
import struct
from dataclasses import dataclass, field
from typing import NamedTuple

from chronoq.core import errors
from chronoq.store import record
from chronoq.store.store import Prepared
from chronoq.timer import copies, schedlog
from chronoq.timer import handle as handles
from chronoq.timer.buckets import LOADED, LOADING
from chronoq.timer.keys import MESSAGE_KEY, REPLACE, KeyIndex, key_hash
from chronoq.timer.schedlog import CANCELLED, MESSAGE

log = logging.getLogger("chronoq.timer")
REPLACE_PROP = "CHRONOQ_REPLACE_KEY"
PROP_REPLACED = copies.PROP_TIMER_REPLACED
REPLACED_MARKER = PROP_REPLACED.encode()
_REPLACE_MARK = REPLACE_PROP.encode()
REPLACE_KEY_CHARS_MAX = 1024
CANCEL_BY_KEY_MAX = 10_000  # messages one cancel-by-key call cancels at most (``truncated`` beyond)
_FLAG_DELAYED = record.FLAG_DELAYED
# Schedule-file bytes the index build reads per embedded ``maintenance`` call, a bucket at least:
# ~25-80 ms of CPU for 4 MB (~17,000 keyed timers; bench/timers.py --parts g). The server reads
# in slices of time instead (``keys_slice``: the runtime's task, and keyed calls waiting on it).
KEY_BUILD_BYTES_PER_STEP = 4 << 20
KEY_BUILD_SLICE_MS = 5  # at most this long a slice (a bucket at least)

# Answers of a replacing send (``SendResult.replaced``): "none", or one of these and a message id.
REPLACED = "replaced"
ALREADY_DELIVERED = "already_delivered"


@dataclass(slots=True)
class KeyCancelResult:
    """Cancel by key: what was cancelled (durable once answered) and what was already delivered
    (due or being delivered when asked: the index forgets a message once its delivery completed,
    so messages delivered before that are not listed). Each entry: (message id, due ms)."""
    topic: str
    key: str
    cancelled: list[tuple[str, int]] = field(default_factory=list)
    delivered: list[tuple[str, int]] = field(default_factory=list)
    truncated: bool = False  # more than CANCEL_BY_KEY_MAX pending: call again for the rest


class KeyAnswer(NamedTuple):
    result: KeyCancelResult
    ticket: int


class _Target(NamedTuple):
    pending: bool
    ident: int
    start: int
    due_ms: int
    message_id: str
    raw: bytes


def describe_replaced(value: str | None) -> str:
    """The send's answer from a record's ``PROP_REPLACED`` value: "none", "replaced:<id>" or
    "already_delivered:<id>"."""
    if not value:
        return "none"
    kind, _, rest = value.partition(":")
    if kind == "replaced":
        return f"{REPLACED}:{rest.partition(':')[2]}"
    return f"{ALREADY_DELIVERED}:{rest}"


def replaced_answer(props: bytes) -> str:
    """A stored record's ``SendResult.replaced`` (a resend answered from the log): "" without a
    replace key."""
    if _REPLACE_MARK not in props:
        return ""
    return describe_replaced(copies.get_prop(props, PROP_REPLACED))


# A copy parked until its release (``parked_copy``): a plain tuple of ints, strings and bytes, which
# the garbage collector stops tracking at its first pass. As a ``Delivery`` holding a ``Prepared``
# named tuple (neither is ever untracked) the 300,000 copies of a crowd's lead put 600,000 objects
# into every generation-1 and -2 collection until their release: 55-183 ms each in
# ``bench/stalls.py --due-burst 300000`` (timed by a gc callback, machine busy).
PARKED_OFFSET, PARKED_DUE, PARKED_IDENT, PARKED_TOPIC, PARKED_MESSAGE_ID, PARKED_KEYS, PARKED_PROPS = range(7)
NO_IDENT = -1  # a delay level's copy: not a timer message, never in the key index


def parked_copy(d) -> tuple:
    """A written copy (a ``Delivery``) as it waits for its release, up to a burst's lead
    (``Deliver._count_visible``): what counting it visible reads (queue offset and due time; topic
    and message id for the trace; its timer ident, keys, and the properties when they hold a
    replace key, for ``unindex_released``), without its body and other properties (written
    already: 300,000 such copies of 200-byte bodies held 175 MB)."""
    p, ref = d.prepared, d.ref
    return (d.queue_offset, d.due_ms, ref[1] if type(ref) is tuple else NO_IDENT, p[0], p[5], p[7],
            p[8] if _REPLACE_MARK in p[8] else b"")


def replaced_ref(value: str) -> tuple[int, int, int] | None:
    """(bucket start, ident, due) a ``PROP_REPLACED`` value cancels, or None."""
    kind, _, rest = value.partition(":")
    if kind != "replaced":
        return None
    start, ident, due = copies.parse_ref(rest.partition(":")[0], 3)
    return start, ident, due


_ENTRY_FIELDS = struct.Struct("<I5xBxxq")  # total_len, kind, ident (chronoq.timer.schedlog)
_RECORD_LENS = struct.Struct("<BBHHI")       # topic, id, tag, keys, props lengths at record offset 46
_LENS_AT = schedlog.ENTRY_HEAD_SIZE + 46     # (chronoq.store.record)
_FIELDS_AT = schedlog.ENTRY_HEAD_SIZE + record.HEADER_SIZE


def _keyed_pending(file_data: bytes, buffered: bytes) -> list[tuple[int, bytes, bytes, bytes]]:
    """(ident, topic, keys, properties: b"" without a replace key) of each pending timer message
    that carries a key, in a
    bucket's file and write buffer: the index's start-up build. A lean walk, not
    ``schedlog.scan`` (no CRCs: the index is a cache each hit is checked against the record, and
    the timer's own load reports damage); it stops at the first entry that does not fit."""
    messages: dict[int, tuple[int, bytes, bytes, bytes]] = {}
    resolved: set[int] = set()
    fields, lens, marker = _ENTRY_FIELDS.unpack_from, _RECORD_LENS.unpack_from, _REPLACE_MARK
    for data, pos in ((file_data, schedlog.FILE_HEAD_SIZE), (buffered, 0)):
        end = len(data)
        while pos + schedlog.ENTRY_HEAD_SIZE <= end:
            total, kind, ident = fields(data, pos)
            if total < schedlog.ENTRY_HEAD_SIZE or pos + total > end:
                break
            if kind != MESSAGE:
                resolved.add(ident)
            elif total >= _FIELDS_AT:
                tlen, mlen, taglen, klen, plen = lens(data, pos + _LENS_AT)
                at = pos + _FIELDS_AT
                kat = at + tlen + mlen + taglen
                replace = plen and data.find(marker, kat + klen, kat + klen + plen) >= 0
                if klen or replace:
                    messages[ident] = (ident, data[at:at + tlen], data[kat:kat + klen],
                                       data[kat + klen:kat + klen + plen] if replace else b"")
            pos += total
    return [m for ident, m in messages.items() if ident not in resolved]


def _hashes(topic: str, keys: bytes, props: bytes) -> list[int]:
    """The index hashes of a message: one a message key, and its replace key's."""
    hashes = [key_hash(MESSAGE_KEY, topic, k) for k in record.decode_keys(keys)] if keys else []
    if _REPLACE_MARK in props:
        value = copies.get_prop(props, REPLACE_PROP)
        if value:
            hashes.append(key_hash(REPLACE, topic, value))
    return hashes


def _file_size(path: str) -> int:
    try:
        return os.stat(path).st_size
    except FileNotFoundError:
        return 0


def has_replace_keys(properties: list) -> bool:
    """Whether any message of a batch (its user properties dicts) carries a replace key."""
    return any(pr and REPLACE_PROP in pr for pr in properties)


class Keyed:
    """Mixed into ``TimerService``: uses its ``store``, ``opts``, ``width``, ``buckets``,
    ``sched_dir``, ``_in_heap``, ``_in_flight``, ``lead_policy``, ``_now``, ``_file_tombstone``,
    ``_finish_loading``, ``_locate_timer`` and ``_held``; owns ``keys`` (None until built)."""

    keys: KeyIndex | None = None
    _keys_todo: list[int] = ()  # type: ignore[assignment]  # bucket starts the build has not read yet
    _keys_todo_bytes = 0  # their size when the build began (until the first read sizes the index)
    _keys_began_ns = 0  # when the build began (the clock's monotonic time), for its log line
    _keys_read = 0  # schedule-file bytes the build has read so far

    # ================================================================= the index
    def _keys_ready(self) -> KeyIndex:
        """The index, its build begun: empty, with every bucket there is now still to read."""
        if self.keys is None:
            pending, _done = schedlog.list_dir(self.sched_dir)
            # Popped from the end: the earliest buckets (due soonest) are read first.
            self._keys_todo = sorted(set(pending) | set(self.buckets), reverse=True)
            self._keys_todo_bytes = sum(_file_size(self.files.path(s)) for s in pending)
            self.keys = KeyIndex(self.width, self._now())
            self._keys_began_ns = self.clock.monotonic_ns()
        return self.keys

    @property
    def keys_building(self) -> bool:
        """Whether some bucket is not read into the index yet (``keys_step``)."""
        return self.keys is None or bool(self._keys_todo)

    def begin_keys(self) -> None:
        """Begin the index's build now if it is not begun (``keys_slice`` reads it)."""
        self._keys_ready()

    def keys_slice(self) -> int:
        """``keys_step`` for at most KEY_BUILD_SLICE_MS of the clock (a bucket at least)."""
        return self.keys_step(deadline_ns=self.clock.monotonic_ns() + KEY_BUILD_SLICE_MS * 1_000_000)

    @property
    def keys_to_read(self) -> bool:
        """The build is begun and some bucket is still to read (``keys_step`` has work)."""
        return bool(self._keys_todo)

    def keys_step(self, budget: int = KEY_BUILD_BYTES_PER_STEP, deadline_ns: int | None = None) -> int:
        """Read buckets into the index until ``budget`` schedule-file bytes were read or the
        clock's monotonic time passed ``deadline_ns`` (a bucket at least): a bounded share of
        the build. Returns bytes read."""
        index = self._keys_ready()
        todo, holds = self._keys_todo, self._in_flight.holds_timer
        first, read = self._keys_todo_bytes, 0
        clock = self.clock
        while todo and read < budget and (deadline_ns is None or not read or clock.monotonic_ns() < deadline_ns):
            start = todo.pop()
            data, buffered = self._bucket_bytes(start)
            read += len(data) + len(buffered) + 1
            for ident, topic, keys, props in _keyed_pending(data, buffered):
                if holds(ident):
                    continue
                name = topic.decode()
                if props:  # (a replace key, rare: the general way)
                    self._index_change(index, True, ident, name, keys, props, start)
                    continue
                for k in record.decode_keys(keys):  # (the bulk: message keys)
                    index.add(key_hash(MESSAGE_KEY, name, k), ident, start)
            if first and index.live:  # sized once, from the keys a byte of the first bucket read: no growth after
                index.reserve(len(index) * first // read)
                first = self._keys_todo_bytes = 0
        self._keys_read += read
        if read and not todo:
            log.info("timer key index built: %d keys from %.1f MB of schedule files in %.1f s", len(index),
                     self._keys_read / 1e6, (self.clock.monotonic_ns() - self._keys_began_ns) / 1e9)
        return read

    def _bucket_bytes(self, start: int) -> tuple[bytes, bytes]:
        """A bucket's schedule file and write buffer (empty when finished meanwhile)."""
        b = self.buckets.get(start)
        if b is None and start not in self._in_heap:
            # Finished: nothing pending (as ``pending`` and ``horizon`` read it). Its file may
            # outlive it until its .done is durable (the server fsyncs that on the committer's
            # thread, ``schedfiles.remove_finished``), and it lacks the entries only buffered at
            # the finish (a replaced message's CANCELLED): read, it would index that message
            # again, and a later replace would answer it "already delivered".
            return b"", b""
        buffered = bytes(b.buffer) if b is not None else b""
        if self.files.awaits_deletion(start):  # made again meanwhile: all it has is in memory
            return b"", buffered
        return schedlog.read_file(self.files.path(start)), buffered

    def _unread_candidates(self, h: int, topic: str, key: str) -> list[tuple[int, int]]:
        """``KeyIndex.candidates`` among the buckets the build has not read yet: each one's bytes
        searched for the key (C speed), and only a bucket holding them walked."""
        needle, name = key.encode(), topic.encode()
        out = []
        for start in self._keys_todo:
            data, buffered = self._bucket_bytes(start)
            if needle not in data and needle not in buffered:
                continue
            for ident, t, keys, props in _keyed_pending(data, buffered):
                if t == name and h in _hashes(topic, keys, props):
                    out.append((ident, start))
        return out

    @staticmethod
    def _index_change(index: KeyIndex, add: bool, ident: int, topic: str, keys: bytes, props: bytes, start: int) -> None:
        """Add (or remove) ``ident`` under each of its message keys and its replace key."""
        for h in _hashes(topic, keys, props):
            if add:
                index.add(h, ident, start)
            else:
                index.remove(h, ident)

    def _unindex_raw(self, ident: int, raw: bytes) -> None:
        if self.keys is not None:
            parts = copies.split(raw)
            self._index_change(self.keys, False, ident, parts.topic.decode(), parts.keys, parts.properties, 0)

    def index_written(self, prepared: list[Prepared], commits: list[int]) -> None:
        """Index the keyed timer records just written (the send path, feature records, moves)."""
        for p, commit in zip(prepared, commits):
            if p[2] & _FLAG_DELAYED and (p[7] or _REPLACE_MARK in p[8]) and p[0] != copies.CONTROL_TOPIC:
                start = schedlog.bucket_start(p[4], self.width)
                self._index_change(self._keys_ready(), True, commit, p[0], p[7], p[8], start)

    def index_columns(self, cols, commits: list[int]) -> None:
        """``index_written`` for a batch written as columns (only its keyed timer records)."""
        rows = [i for i, (f, k) in enumerate(zip(cols.flags, cols.keys)) if f & _FLAG_DELAYED and k]
        if rows:
            self.index_written([Prepared._make(c[i] for c in cols) for i in rows], [commits[i] for i in rows])

    def unindex_delivered(self, completed, now: int) -> None:
        """Timer deliveries completed (``Deliver._complete``) or released (``_release``): no
        longer pending. A held copy not yet due stays indexed until its release, so replace and
        cancel answer it as delivered (``_target``) rather than forget it."""
        index = self.keys
        if index is None or not index.live:
            return
        for d in completed:
            p = d.prepared
            if p is not None and d.due_ms <= now and (p[7] or _REPLACE_MARK in p[8]):
                self._index_change(index, False, d.ref[1], p[0], p[7], p[8], 0)

    def unindex_released(self, parked: list[tuple], now: int) -> None:
        """``unindex_delivered`` of copies parked until their release (``parked_copy``)."""
        index = self.keys
        if index is None or not index.live:
            return
        for c in parked:
            if c[PARKED_IDENT] != NO_IDENT and c[PARKED_DUE] <= now and (c[PARKED_KEYS] or c[PARKED_PROPS]):
                self._index_change(index, False, c[PARKED_IDENT], c[PARKED_TOPIC], c[PARKED_KEYS], c[PARKED_PROPS], 0)

    def _target(self, ident: int, start: int | None, topic: str, namespace: str, key: str,
                now: int) -> _Target | None:
        """The indexed message ``ident`` if it is a timer message of ``topic`` with ``key`` that
        is not in flight: pending, or delivered (due by ``now``, or claimed). None: a hash
        collision, or a message no longer there (lost to damage)."""
        if self._in_flight.holds_timer(ident):
            return None
        raw = self._record_of(ident, start)
        if raw is None:
            return None
        parts = copies.split(raw)
        if parts.topic.decode() != topic:
            return None
        if namespace == REPLACE:
            if copies.get_prop(parts.properties, REPLACE_PROP) != key:
                return None
        elif key not in record.decode_keys(parts.keys):
            return None
        due = parts.deliver_at_ms
        start = schedlog.bucket_of_record(parts.stored_ms, due, self.width)
        b = self.buckets.get(start)
        delivered = due <= now or (b is not None and ident in b.claimed)
        if not delivered and due <= now + self.lead_policy.longest_ms:
            # Its copy may be written ahead already, held until due (``timer_prewrite_ms``, in
            # a burst up to ``timer_burst_lead_max_ms``).
            delivered = self._held(handles.RecallHandle(handles.TIMER, 0, ident, due, topic,
                                                        parts.message_id.decode()))
        return _Target(not delivered, ident, start, due, parts.message_id.decode(), raw)

    def _record_of(self, ident: int, start: int | None) -> bytes | None:
        """The record of timer message ``ident``: from the commit log while retention keeps it
        (one read), else from its bucket."""
        log = self.store.log
        if ident >= log.min_offset:
            try:
                size = copies.record_length(log.read(ident, 4))
                return log.read_record(ident, size)
            except errors.ChronoqError:
                pass
        if start is None:
            return None
        b = self.buckets.get(start)
        if b is not None and b.state in (LOADING, LOADED):
            if b.state == LOADING:
                self._finish_loading(b)
            return b.record_of(ident) if ident not in b.claimed else None
        _state, _start, raw = self._locate_timer(handles.RecallHandle(handles.TIMER, 0, ident, start, "-", "-"))
        return raw

    def _targets(self, namespace: str, topic: str, key: str, now: int) -> list[_Target]:
        index = self._keys_ready()
        h = key_hash(namespace, topic, key)
        candidates = index.candidates(h)
        if self._keys_todo:  # the build is partial: the buckets it has not read yet too
            candidates += self._unread_candidates(h, topic, key)
        found, seen = [], set()
        for ident, start in candidates:
            if ident in seen:
                continue
            seen.add(ident)
            t = self._target(ident, start, topic, namespace, key, now)
            if t is not None:
                found.append(t)
        found.sort(key=lambda t: (t.due_ms, t.ident))
        return found

    # ================================================================= replace by key
    def write_replacing(self, prepared: list[Prepared]) -> tuple[list, list[str], list[tuple[str, str, int]]]:
        """Write a batch holding replace keys (page cache), record by record where a key is, and
        return (its ``Written``, each message's answer: "" without a key, else as
        ``describe_replaced``, and the (topic, message id, due ms) of each pending message the
        batch replaced: cancelled, for the trace). Refuses the whole batch, writing nothing, when
        a replace key is on a message that is not a timer message."""
        keys: list[str | None] = []
        for p in prepared:
            value = copies.get_prop(p[8], REPLACE_PROP) if _REPLACE_MARK in p[8] else None
            if value is not None:
                if not p[2] & _FLAG_DELAYED:
                    raise errors.InvalidProperty(
                        f"{REPLACE_PROP} needs a delivery time in the future (deliver_at), not a delay level "
                        "or a message due at once")
                if not value or len(value) > REPLACE_KEY_CHARS_MAX:
                    raise errors.InvalidProperty(f"{REPLACE_PROP} must have 1 to {REPLACE_KEY_CHARS_MAX} characters")
            keys.append(value)
        self._keys_ready()
        now = self._now()
        written: list = []
        answers: list[str] = []
        cancelled: list[tuple[str, str, int]] = []
        i, n = 0, len(prepared)
        while i < n:
            if keys[i] is None:  # a run without replace keys: one write
                j = i
                while j < n and keys[j] is None:
                    j += 1
                run = self.store.write(prepared[i:j])
                self.index_written(prepared[i:j], [w.commit_offset for w in run])
                written += run
                answers += [""] * (j - i)
                i = j
                continue
            written.append(self._write_replacing_one(prepared[i], keys[i], now, answers, cancelled))
            i += 1
        return written, answers, cancelled

    def _write_replacing_one(self, p: Prepared, key: str, now: int, answers: list[str],
                             cancelled: list[tuple[str, str, int]]):
        targets = self._targets(REPLACE, p[0], key, now)
        # One pending message per key at most: the send path keeps that. Records written past it
        # (a Spark publish carrying the property) may add more; the newest is the one replaced.
        pending = [t for t in targets if t.pending][-1:]
        if pending:
            t = pending[0]
            value = f"replaced:{t.start}.{t.ident}.{t.due_ms}:{t.message_id}"
        elif targets:
            value = f"delivered:{targets[-1].message_id}"
        else:
            value = None
        if value is not None:
            p = p._replace(properties=copies.add_prop(p[8], PROP_REPLACED, value))
        [w] = self.store.write([p])
        if pending:
            t = pending[0]
            h = handles.RecallHandle(handles.TIMER, 0, t.ident, t.due_ms, p[0], t.message_id)
            self._in_flight.mark(h, CANCELLED, w.commit_offset + w.size)
            self._unindex_raw(t.ident, t.raw)
            cancelled.append((p[0], t.message_id, t.due_ms))
        self.index_written([p], [w.commit_offset])
        answers.append(describe_replaced(value))
        return w

    def _apply_replaced(self, offset: int, raw: bytes) -> None:
        """Absorbing a record that replaced a pending message: that one is CANCELLED."""
        value = copies.get_prop(copies.split(raw).properties, PROP_REPLACED)
        ref = replaced_ref(value) if value else None
        if ref is not None:
            start, ident, due = ref
            self._file_tombstone(start, CANCELLED, ident, due, offset, offset + len(raw))  # (absorb)

    # ================================================================= cancel by key
    def cancel_by_key(self, topic: object, key: object) -> KeyAnswer:
        """Cancel every pending timer message of ``topic`` carrying message key ``key``: the
        answer, valid once its ticket is durable (each target in flight until then)."""
        if not isinstance(topic, str) or not topic:
            raise errors.ClientError("topic is missing")
        if not isinstance(key, str) or not key:
            raise errors.InvalidKey("a message key is needed")
        now = self._now()
        result = KeyCancelResult(topic, key)
        chosen: list[_Target] = []
        for t in self._targets(MESSAGE_KEY, topic, key, now):
            if not t.pending:
                result.delivered.append((t.message_id, t.due_ms))
            elif len(chosen) < CANCEL_BY_KEY_MAX:
                chosen.append(t)
            else:
                result.truncated = True
        if not chosen:
            return KeyAnswer(result, 0)
        written = self.store.write([copies.control(copies.PROP_TIMER_CANCEL, f"{t.start}.{t.ident}",
                                                   t.message_id.encode(), t.due_ms, now) for t in chosen])
        ticket = 0
        for t, w in zip(chosen, written):
            ticket = w.commit_offset + w.size
            self._in_flight.mark(handles.RecallHandle(handles.TIMER, 0, t.ident, t.due_ms, topic, t.message_id),
                                 CANCELLED, ticket)
            self._unindex_raw(t.ident, t.raw)
            result.cancelled.append((t.message_id, t.due_ms))
        return KeyAnswer(result, ticket)
