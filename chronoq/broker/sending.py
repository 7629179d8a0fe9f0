"""The send pipeline: validate a batch, choose queues, answer resends, append to the store.

One path for every shape of message (plain, delayed, delay level, FIFO, keys, properties; user
or system): ``Sender.write_batch`` takes an ``OutgoingBatch`` (columns, chronoq.broker.outgoing),
``prepare`` checks it column by column into the store's ``Columns``, ``write_batch`` deduplicates
client ids against the window of recent ones (chronoq.broker.dedupe; a batch that may hold a
resend is answered by chronoq.broker.resends), appends with the store's one record encoder
(``Store.write_columns``) and answers with ``Sent`` columns. ``write`` and ``prepare_batch`` are the
same for ``OutgoingMessage`` objects. Durability and visibility are the broker's (``Broker.flush``)
or the committer's.
"""

from __future__ import annotations

import itertools
import zlib
from itertools import repeat
from typing import Iterable, NamedTuple

from chronoq.broker import resends
from chronoq.broker.dedupe import DedupeWindow
from chronoq.broker.outgoing import OutgoingBatch, OutgoingMessage, Sent
from chronoq.broker.topics import TopicRegistry
from chronoq.broker.trace import TraceRecorder
from chronoq.core import errors, validate
from chronoq.core.clock import Clock
from chronoq.core.config import BrokerConfig
from chronoq.core.model import MessageType, SendResult, TopicConfig
from chronoq.core.msgid import new_message_ids
from chronoq.core.validate import PROP_MESSAGE_GROUP, PROP_MESSAGE_TYPE
from chronoq.store import record
from chronoq.store.store import Columns, Prepared, Store
from chronoq.timer import handle as handles
from chronoq.timer.deliverytime import YEAR_2000_MS
from chronoq.timer.keyed import has_replace_keys
from chronoq.timer.service import TimerService

__all__ = ["Sender", "OutgoingBatch", "OutgoingMessage", "Sent"]

# Enum members as module globals: ``MessageType.NORMAL`` is a metaclass attribute lookup that costs
# about a microsecond on Python 3.11.
_MIXED, _NORMAL, _FIFO, _DELAY = MessageType.MIXED, MessageType.NORMAL, MessageType.FIFO, MessageType.DELAY
_FLAG_DELAYED = record.FLAG_DELAYED
_BYTES, _STR, _INT = {bytes}, {str}, {int}
# Queue count -> [0, 1, .., count - 1] repeated (``Sender._queues``: a round-robin run of queues is
# a slice of it). Bounded: one per queue count (at most ``max_queues`` of them), each kept only up
# to ``_CYCLE_KEEP`` entries; a longer run builds its own and drops it.
_CYCLES: dict[int, list[int]] = {}
_CYCLE_KEEP = 1024  # (entries: at most ~2 x 1024 x 8 bytes for each queue count in use)

# The properties of a message with none of its own but its type (``PROP_MESSAGE_TYPE``), as bytes.
_TYPE_PROPS = {t: record.encode_properties({PROP_MESSAGE_TYPE: t.name}) if t is not _NORMAL else b""
               for t in MessageType}


class _Refused(Exception):
    """A rule of ``Sender.prepare`` broken: the first message of its column to break it."""

    def __init__(self, index: int, exc: errors.ClientError):
        super().__init__(index, exc)
        self.index, self.exc = index, exc


def _is_int(value: object) -> bool:
    """An int that is not a bool (``True`` must not pass for queue 1)."""
    return isinstance(value, int) and not isinstance(value, bool)


def _which(index: int, batch: OutgoingBatch) -> str:
    """Which message of a batch an error concerns: its place, and its id when the client chose one."""
    mid = batch.message_ids[index] if batch.message_ids is not None and index < len(batch.message_ids) else None
    return f"message {index} of the batch" + (f" (id {str(mid)[:80]!r})" if mid else "")


class WaitingFiles(NamedTuple):
    """A prepared batch waiting for its new queues' first files (``Sender.write_batch``)."""

    made: object  # awaitable: done once the files are made
    batch: OutgoingBatch
    system: bool
    now: int
    cols: Columns
    ids: list
    chosen: list
    topics: dict  # each topic of the batch -> its TopicConfig when it was prepared


class Sender:
    """The broker's send path and what it remembers between batches: the round-robin counters,
    the validated tags, the dedupe window (``_dedupe``) and the messages accepted per topic
    (``sent_by_topic``, the dict ``Broker.sent_by_topic`` is, for chronoq.server.metrics)."""

    def __init__(self, config: BrokerConfig, clock: Clock, registry: TopicRegistry, store: Store,
                 timer: TimerService, trace: TraceRecorder | None):
        self.config = config
        self.clock = clock
        self.registry = registry
        self.store = store
        self.timer = timer
        self.trace = trace
        self._round_robin: dict[str, int] = {}  # topic -> the next round-robin count
        self._tags: dict[str, bytes] = {}
        # Client message ids stored lately: a hash of (topic, id) and the record's commit offset
        # (chronoq.broker.dedupe, ~40 B an entry, no Python object per entry); an exact resend answers
        # the original, rebuilt from its record (``resends.original``).
        self._dedupe = DedupeWindow(config.dedupe_max_entries, config.dedupe_window_ms)
        # Messages accepted from producers per topic (duplicates and system writes not counted).
        self.sent_by_topic: dict[str, int] = {}

    def tag_bytes(self, tag: object) -> bytes:
        raw = self._tags.get(tag) if type(tag) is str else None  # type: ignore[arg-type]
        if raw is None:
            raw = validate.tag(tag).encode()
            if len(self._tags) > 4096:
                self._tags.clear()
            self._tags[tag] = raw  # type: ignore[index]
        return raw

    def prepare_batch(self, messages: Iterable[OutgoingMessage], *, system: bool = False, now: int | None = None,
                      new_topics: dict[str, TopicConfig] | None = None
                      ) -> tuple[list[Prepared], list[str], list[bool]]:
        """``prepare`` for ``OutgoingMessage`` objects, as one ``Prepared`` record per message
        (the embedded callers: staging, ``Broker.prepare``)."""
        cols, ids, chosen = self.prepare(OutgoingBatch.of(messages), system=system, now=now, new_topics=new_topics)
        return list(map(Prepared._make, zip(*cols))), ids, chosen

    def prepare(self, batch: OutgoingBatch, *, system: bool = False, now: int | None = None,
                new_topics: dict[str, TopicConfig] | None = None) -> tuple[Columns, list[str], list[bool]]:
        """Validate a batch and choose each message's queue: the store records as ``Columns``,
        the message ids, and whether the client chose each id. The first message that breaks a
        rule raises its error, naming its place in the batch (``_which``), whatever the rule.

        With ``new_topics`` an unknown topic is planned there instead of auto-created (``write``
        creates them once the whole batch is valid).

        Column by column: each rule runs over a whole column at once (a set of the distinct
        topics and tags, bodies' lengths, client ids in bulk, one round-robin step per batch, due
        times by their maximum), and per message only where a message sets something rare (keys,
        properties, a group, a queue, a delay level). The rules are ``chronoq.core.validate``'s,
        which every entry point shares, and the timer's for delivery times (``due_ms``).
        """
        if now is None:
            now = self.clock.wall_ms()
        try:
            return self._prepare(batch, system, now, new_topics, commit=True)
        except _Refused as refused:
            index, exc = refused.index, refused.exc
        # A column's rule found message ``index``: an earlier message may break a rule of a
        # later column. Its prefix answers that (the same rules; nothing is kept).
        while index > 0:
            try:
                self._prepare(batch.take(range(index)), system, now, {} if new_topics is not None else None,
                              commit=False)
            except _Refused as earlier:
                index, exc = earlier.index, earlier.exc
                continue
            break
        raise validate.naming(exc, _which(index, batch)) from None

    def _prepare(self, batch: OutgoingBatch, system: bool, now: int, new_topics: dict[str, TopicConfig] | None,
                 commit: bool) -> tuple[Columns, list[str], list[bool]]:
        """``prepare``'s rules, column by column; a broken one raises ``_Refused`` naming the
        first message of that column to break it. ``commit``: advance the round-robin counters."""
        n = len(batch.bodies)
        registry = self.registry
        # --- topics: each distinct name once
        names = batch.topics
        if len(names) != n:
            raise _Refused(0, errors.ClientError("the batch's columns differ in length"))
        topic_of = None  # None: every message goes to ``one``
        one = None
        if n and names.count(names[0]) == n:  # (one topic, the usual batch: told at C level, no hashing)
            try:
                one = registry.send_topic(names[0], system, new_topics)
            except errors.ClientError as exc:
                raise _Refused(0, exc) from None
        else:
            configs: dict = {}
            try:
                distinct = set(names)
            except TypeError:  # an unhashable name: its message is refused below
                distinct = None
            for i, name in enumerate(names):
                if distinct is None or name not in configs:
                    try:
                        configs[name if type(name) is str else i] = registry.send_topic(name, system, new_topics)
                    except errors.ClientError as exc:
                        raise _Refused(names.index(name) if distinct is not None else i, exc) from None
            if n and len(configs) == 1:
                one = next(iter(configs.values()))
            else:
                topic_of = [configs[name] for name in names]
        # --- bodies: bytes, not empty, within the limit
        bodies = batch.bodies
        body_max = self.config.max_body_bytes
        if n == 1:
            body = bodies[0]
            bulk_ok = type(body) is bytes and 0 < len(body) <= body_max
        else:
            bulk_ok = not n or (set(map(type, bodies)) == _BYTES and min(map(len, bodies))
                                and max(map(len, bodies)) <= body_max)
        if not bulk_ok:
            bodies = list(bodies)
            for i, body in enumerate(bodies):
                if type(body) is not bytes or not body or len(body) > body_max:
                    try:
                        bodies[i] = validate.body(body, body_max)
                    except errors.ClientError as exc:
                        raise _Refused(i, exc) from None
        # --- tags, each distinct one once
        tags = batch.tags
        if tags is None:
            raw_tags = [b""] * n
        else:
            known: dict = {}
            if (type(tags[0]) is not str) if n == 1 else set(map(type, tags)) != _STR:
                # (not a str: refused unless falsy, which means none)
                for i, tag in enumerate(tags):
                    if tag:
                        try:
                            self.tag_bytes(tag)
                        except errors.ClientError as exc:
                            raise _Refused(i, exc) from None
                tags = [t if t else "" for t in tags]
            for tag in tags if n == 1 else set(tags):
                try:
                    known[tag] = self.tag_bytes(tag) if tag else b""
                except errors.ClientError as exc:
                    raise _Refused(tags.index(tag), exc) from None
            raw_tags = list(map(known.__getitem__, tags))
        # --- keys, properties, groups (rare: message by message where set)
        keys_in = batch.keys
        if keys_in is None:
            raw_keys = [b""] * n
        else:
            raw_keys = []
            for i, k in enumerate(keys_in):
                try:
                    raw_keys.append(record.encode_keys(validate.keys(k)) if k else b"")
                except errors.ClientError as exc:
                    raise _Refused(i, exc) from None
        props_in, groups_in = batch.properties, batch.message_groups
        props: list = [None] * n
        if props_in is not None:
            for i, pr in enumerate(props_in):
                if pr:
                    try:
                        props[i] = validate.properties(pr, allow_system=system)
                    except errors.ClientError as exc:
                        raise _Refused(i, exc) from None
        groups: list | None = None
        if groups_in is not None and any(groups_in):
            groups = [None] * n
            for i, group in enumerate(groups_in):
                if group:  # (None or "": no group)
                    try:
                        groups[i] = validate.message_group(group)
                    except errors.ClientError as exc:
                        raise _Refused(i, exc) from None
        # --- message types, against each topic's
        deliver_in, levels_in = batch.deliver_at_ms, batch.delay_levels
        if levels_in is not None and not any(levels_in):
            levels_in = None
        delayed: list | None = None  # per message: a delivery time or a level; None: none is
        # (the delayed batch, a delivery time each, told at C level: no comprehension per message)
        each_timed = levels_in is None and deliver_in is not None and None not in deliver_in
        if each_timed:
            delayed = [True] * n
        elif deliver_in is not None or levels_in is not None:
            delayed = [d is not None or bool(lv) for d, lv in zip(deliver_in or repeat(None, n),
                                                                     levels_in or repeat(None, n))]
        types_in = batch.message_types
        if types_in is None and groups is None:
            mtypes = [_DELAY] * n if each_timed else [_DELAY if d else _NORMAL for d in delayed] \
                if delayed is not None else [_NORMAL] * n
        elif types_in is not None and None not in types_in:  # (as the wire's columns come: every type set)
            mtypes = types_in
        else:
            mtypes = [t or (_FIFO if g else _DELAY if d else _NORMAL) for t, g, d in zip(
                types_in or repeat(None, n), groups or repeat(None, n), delayed or repeat(False, n))]
        # (``count``, not a set: hashing an enum member is a Python-level call)
        alike = n and mtypes.count(mtypes[0]) == n
        if topic_of is None and (one is None or one.message_type is _MIXED):
            pairs = ()  # (a topic of any type: nothing to check)
        elif topic_of or not alike:
            by_id = {id(c): c for c in (topic_of or (one,))}  # (a topic's config is not hashable)
            pairs = [(by_id[cid], t) for cid, t in {(id(c), t) for c, t in zip(topic_of or repeat(one, n), mtypes)}]
        else:
            pairs = ((one, mtypes[0]),)
        for cfg, mtype in pairs:
            if cfg.message_type is not _MIXED and cfg.message_type is not mtype:
                i = next(i for i, (c, t) in enumerate(zip(topic_of or repeat(one, n), mtypes))
                         if c is cfg and t is mtype)
                raise _Refused(i, errors.MessageTypeMismatch(
                    f"topic {cfg.name} accepts {cfg.message_type.name} messages, not {mtype.name}"))
        # --- the properties' bytes (with the group and the type, the broker's)
        if props_in is None and groups is None:
            if alike:
                raw_props = [_TYPE_PROPS[mtypes[0]]] * n if n else []
            else:
                raw_props = [_TYPE_PROPS[t] for t in mtypes]
        else:
            raw_props = []
            for pr, group, mtype in zip(props, groups or repeat(None, n), mtypes):
                if pr is None and not group:
                    raw_props.append(_TYPE_PROPS[mtype])
                    continue
                pr = pr or {}
                if group:
                    pr[PROP_MESSAGE_GROUP] = group
                if mtype is not _NORMAL:
                    pr[PROP_MESSAGE_TYPE] = mtype.name
                raw_props.append(record.encode_properties(pr) if pr else b"")
        # --- message ids: the client's, checked in bulk, or new ones
        ids_in = batch.message_ids
        if ids_in is not None and all(ids_in):
            chosen = [True] * n
            ids = ids_in if validate.plain_message_ids(ids_in) else self._checked_ids(ids_in)
        elif ids_in is None:  # (the embedded callers' usual batch: every id new, at C level)
            chosen = [False] * n
            ids = list(map(bytes.decode, new_message_ids(now, n)))
        else:
            chosen = [bool(m) for m in ids_in] if ids_in is not None else [False] * n
            fresh = iter(new_message_ids(now, n - sum(chosen)))
            client = [m for m in ids_in if m] if ids_in is not None else []
            if client and not validate.plain_message_ids(client):
                self._checked_ids(ids_in)
            ids = [m if c else next(fresh).decode() for m, c in zip(ids_in or repeat(None, n), chosen)]
        # --- queues
        queue_ids = self._queues(batch, n, names, one, topic_of, groups, commit)
        # --- born, due times and flags
        born_in = batch.born_ms
        if born_in is None:
            borns = [now] * n
        elif None not in born_in and (type(born_in[0]) is int if n == 1 else set(map(type, born_in)) == _INT):
            borns = born_in
        else:
            borns = [now if b is None else int(b) for b in born_in]
        base_flags = record.FLAG_SYSTEM if system else 0
        topic_names = [one.name] * n if topic_of is None else [c.name for c in topic_of]
        # (one join, encode and split at C level: an id is ASCII without control characters)
        raw_ids = "\0".join(ids).encode().split(b"\0") if n else []
        assert len(raw_ids) == n, "a message id held a NUL"
        flags = [base_flags] * n
        dues = [0] * n
        # (tuple.__new__: a NamedTuple's own __new__ is a Python-level call, which a lone send pays in full)
        cols = tuple.__new__(Columns, (topic_names, queue_ids, flags, borns, dues, raw_ids, raw_tags, raw_keys,
                                       raw_props, bodies))
        if delayed is not None:
            self._due_times(cols, deliver_in, levels_in, now)
        return cols, ids, chosen

    def _checked_ids(self, ids: list) -> list[str]:
        """Client ids one by one (``validate.message_id`` words the error); None/"": generated."""
        out = []
        for i, mid in enumerate(ids):
            if mid:
                try:
                    mid = validate.message_id(mid)
                except errors.ClientError as exc:
                    raise _Refused(i, exc) from None
            out.append(mid)
        return out

    def _queues(self, batch: OutgoingBatch, n: int, names: list, one, topic_of, groups, commit: bool) -> list[int]:
        """Each message's queue: the one it names (checked), its group's (crc32, so a group's
        order holds), else round robin per topic (one counter step per batch)."""
        asked = batch.queue_ids
        if asked is None and groups is None and topic_of is None:
            start = self._round_robin.get(one.name, 0)
            if commit:
                self._round_robin[one.name] = start + n
            # A slice of the queues in turn, 0..queues-1 repeated (``_CYCLES``): one C-level copy,
            # where a map of ``%`` over a range paid 4k instructions for one message.
            queues, at = one.queues, start % one.queues
            cycle = _CYCLES.get(queues)
            if cycle is None or len(cycle) < at + n:
                cycle = list(range(queues)) * (max(at + n, _CYCLE_KEEP // 2) // queues + 1)
                if len(cycle) <= _CYCLE_KEEP + queues:
                    _CYCLES[queues] = cycle
            return cycle[at:at + n]
        counters: dict[str, int] = {}
        out = []
        for i, cfg, q, group in zip(range(n), topic_of or repeat(one, n), asked or repeat(None, n),
                                    groups or repeat(None, n)):
            if q is not None:
                if not _is_int(q) or not 0 <= q < cfg.queues:
                    raise _Refused(i, errors.InvalidQueue(f"queue {q!r} does not exist in topic {cfg.name} "
                                                          f"(queues 0..{cfg.queues - 1})"))
                out.append(q)
            elif group:
                out.append(zlib.crc32(group.encode()) % cfg.queues)
            else:
                at = counters.get(cfg.name)
                if at is None:
                    at = self._round_robin.get(cfg.name, 0)
                counters[cfg.name] = at + 1
                out.append(at % cfg.queues)
        if commit:
            self._round_robin.update(counters)
        return out

    def _due_times(self, cols: Columns, deliver_in: list | None, levels_in: list | None, now: int) -> None:
        """Fill in the due times and FLAG_DELAYED (a time ahead), and turn delay-level messages
        into the timer's level records, in place."""
        timer = self.timer
        n = len(cols.bodies)
        if levels_in is None:
            values = deliver_in
            given = values if None not in values else [d for d in values if d is not None]
            # In bulk: all ints within the maximum delay and none before the past floor (a 0 takes
            # the loop too) (the timer's rule, ``due_ms``).
            max_delay = self.timer.opts.max_delay_ms
            if set(map(type, given)) <= _INT and (not given or (  # (deliverytime.past_floor, inline)
                    max(given) - now <= max_delay and min(given) >= min(now - max_delay, YEAR_2000_MS))):
                dues = values if given is values else [0 if d is None else d for d in values]
            else:
                dues = []
                for i, d in enumerate(values):
                    try:
                        dues.append(0 if d is None else timer.due_ms(d, now))
                    except errors.ClientError as exc:
                        raise _Refused(i, exc) from None
            cols.deliver_at_ms[:] = dues
            flags = cols.flags
            if min(dues) > now:  # the delayed batch
                flags[:] = [flags[0] | _FLAG_DELAYED] * n
                return
            delayed = _FLAG_DELAYED
            for i, d in enumerate(dues):
                if d > now:  # (due already: an ordinary record with its due time, visible at once)
                    flags[i] |= delayed
            return
        for i, d, level in zip(range(n), deliver_in or repeat(None, n), levels_in):
            if d is None and not level:
                continue
            p = Prepared._make(c[i] for c in cols)
            try:
                if level:  # a level record (rare): the timer rewrites the destination
                    p = timer.prepare_delayed(p, d, level, now)
                else:
                    due = timer.due_ms(d, now)
                    p = p._replace(deliver_at_ms=due, flags=p.flags | (_FLAG_DELAYED if due > now else 0))
            except errors.ClientError as exc:
                raise _Refused(i, exc) from None
            for column, value in zip(cols, p):
                column[i] = value

    def check_duplicate(self, topic: str, message_id: str, body: bytes) -> SendResult | None:
        """The original result if (topic, id) was sent within the window with the same body."""
        window = self._dedupe
        return resends.original(self.store, self.timer, window, topic, message_id, body,
                                window.hash_key(topic, message_id), self.clock.wall_ms())

    def write(self, messages: Iterable[OutgoingMessage], *, system: bool = False) -> list[SendResult]:
        """``write_batch`` for ``OutgoingMessage`` objects, answered with ``SendResult`` objects
        (the embedded API)."""
        return self.write_batch(OutgoingBatch.of(messages), system=system).results()

    def write_batch(self, batch: OutgoingBatch, *, system: bool = False, files_ahead=None):
        """Validate and append (page cache only). Durability and visibility come from ``flush``.

        The whole batch is validated before anything is written: one bad message fails the batch
        and stores nothing. A message id the client chose is deduplicated: an exact resend within
        ``dedupe_window_ms`` (also inside one batch) answers the original result, ``duplicate=True``.

        ``files_ahead(cols)`` (the committer's): a batch that creates topics has them created, then
        is handed over; if that returns an awaitable (the first files of their queues are being made
        off the loop: chronoq.store.newqueues), the batch is not written yet: ``WaitingFiles`` is
        returned, for ``write_waited`` once it is done. So the batch takes its place in the log only
        once its files exist, and what others write meanwhile is not dispatched behind it.
        """
        new_topics: dict[str, TopicConfig] = {}
        now = self.clock.wall_ms()
        cols, ids, chosen = self.prepare(batch, system=system, now=now, new_topics=new_topics)
        if new_topics and files_ahead is not None:
            self.registry.create_planned(new_topics)
            made = files_ahead(cols)
            if made is not None:
                topics = self.registry.topics
                return WaitingFiles(made, batch, system, now, cols, ids, chosen,
                                    {t: topics.get(t) for t in set(cols.topics)})
        return self._write_prepared(batch, system, now, cols, ids, chosen, new_topics)

    def write_waited(self, waiting: "WaitingFiles") -> Sent:
        """``write_batch``'s batch that waited for its files, written now; prepared anew (its
        files then made by the dispatch) if a topic of it changed meanwhile (deleted, re-created)."""
        topics = self.registry.topics
        if any(topics.get(t) is not cfg for t, cfg in waiting.topics.items()):
            return self.write_batch(waiting.batch, system=waiting.system)
        return self._write_prepared(waiting.batch, waiting.system, waiting.now, waiting.cols, waiting.ids,
                                    waiting.chosen, {})

    def _write_prepared(self, batch: OutgoingBatch, system: bool, now: int, cols: Columns, ids: list[str],
                        chosen: list[bool], new_topics: dict[str, TopicConfig]) -> Sent:
        window = self._dedupe
        client_ids = any(chosen)
        key_hashes: list[int] = []
        answers: list | None = None  # None: every message is new
        if client_ids:
            key_hashes = window.hash_keys(cols.topics, ids)
            chosen_hashes = key_hashes if all(chosen) else list(itertools.compress(key_hashes, chosen))
            # Duplicates (in the batch or the window) are rare: one bulk test for the batch, and
            # only a batch that may hold one is answered message by message.
            if (len(chosen_hashes) > 1 and len(set(chosen_hashes)) != len(chosen_hashes)) \
                    or window.any_present(chosen_hashes):
                answers, cols, ids, key_hashes = resends.deduplicated(self.store, self.timer, window, cols, ids,
                                                                      chosen, key_hashes, now)
        if new_topics:  # the whole batch is valid: now create the topics it needs (one save)
            self.registry.create_planned(new_topics)
        replaced = None
        if batch.properties is not None and has_replace_keys(batch.properties):
            # Replace by key (chronoq.timer.keyed): the timer decides and writes, key by key.
            written, replaced, cancelled = self.timer.write_replacing(list(map(Prepared._make, zip(*cols))))
            commits, qoffs = [w.commit_offset for w in written], [w.queue_offset for w in written]
            if self.trace is not None:  # a replaced message is cancelled: its life ends here (audit)
                for topic, message_id, due_ms in cancelled:
                    self.trace.recalled(topic, message_id, due_ms, now)
        else:
            commits, qoffs, _sizes = self.store.write_columns(cols)
            if batch.keys is not None:  # keyed timer messages enter the key index (chronoq.timer.keys)
                self.timer.index_columns(cols, commits)
        n = len(ids)
        topics = cols.topics
        if self.trace is not None and n:
            flags = cols.flags
            one_topic = not system and topics.count(topics[0]) == n
            if one_topic and not any(cols.deliver_at_ms):
                self.trace.stored_plain(topics[0], cols.message_ids, now)
            elif one_topic and flags[0] == _FLAG_DELAYED and flags.count(flags[0]) == n:  # the delayed batch
                self.trace.stored_plain(topics[0], cols.message_ids, now, cols.deliver_at_ms)
            else:
                self.trace.stored(zip(*cols), now)
        fresh = self._answers(cols, ids, commits, qoffs)
        if n and not system:
            # chronoq.server.metrics, by the answers' topics: a delay-level record is stored in the
            # system topic CHRONOQ_DELAY, its answer names the producer's topic.
            self._count_sent(fresh.topics)
        if client_ids:  # every message of a batch with client ids is remembered (generated ids too)
            window.add(key_hashes, commits, now)
        if replaced is not None:
            fresh.replaced = replaced
        if answers is None:
            return fresh
        return resends.merged(answers, fresh)

    def _answers(self, cols: Columns, ids: list[str], commits: list[int], qoffs: list[int]) -> Sent:
        """The answer to written records: a delayed record (FLAG_DELAYED) is in no queue until
        due (offset -1) and has a recall handle, made for the batch at once; another with a due
        time (due at send, or a delay-level record) takes the timer's answer (``send_result``)."""
        dues = cols.deliver_at_ms
        topics, queue_ids = cols.topics, cols.queue_ids
        if not any(dues):
            return Sent(ids, topics, queue_ids, qoffs, commits)
        flags = cols.flags
        if flags[0] & _FLAG_DELAYED and flags.count(flags[0]) == len(flags):
            # The delayed batch (its flags alike, told at C level): every message a timer message.
            recalls = handles.encode_many(handles.TIMER, commits, dues, topics, cols.message_ids,
                                          self.timer.handle_group)
            return Sent(ids, topics, queue_ids, [-1] * len(ids), commits, recalls)
        delayed = [i for i, f in enumerate(flags) if f & _FLAG_DELAYED]
        recalls = [""] * len(ids)
        qoffs = list(qoffs)
        texts = iter(handles.encode_many(handles.TIMER, [commits[i] for i in delayed], [dues[i] for i in delayed],
                                         [topics[i] for i in delayed], [cols.message_ids[i] for i in delayed],
                                         self.timer.handle_group))
        topics, queue_ids = list(topics), list(queue_ids)
        for i, (f, due) in enumerate(zip(flags, dues)):
            if f & _FLAG_DELAYED:
                recalls[i], qoffs[i] = next(texts), -1
            elif due:
                r = self.timer.send_result(Prepared._make(c[i] for c in cols), ids[i], commits[i], qoffs[i])
                topics[i], queue_ids[i], qoffs[i], recalls[i] = r.topic, r.queue_id, r.queue_offset, r.recall_handle
        return Sent(ids, topics, queue_ids, qoffs, commits, recalls)

    def _count_sent(self, topics: list[str]) -> None:
        """Count accepted messages per topic (a batch is nearly always of one topic)."""
        sent, n = self.sent_by_topic, len(topics)
        if topics.count(topics[0]) == n:
            sent[topics[0]] = sent.get(topics[0], 0) + n
        else:
            for t in topics:
                sent[t] = sent.get(t, 0) + 1
