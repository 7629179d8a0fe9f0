"""The send pipeline: validate a batch, choose queues, answer resends, append to the store.

``Sender.prepare_batch`` turns what producers hand the broker (``OutgoingMessage``) into store
records (``Prepared``); ``write`` appends a batch after deduplicating client ids against the
window of recent ones (chronoq.broker.dedupe); ``write_plain`` is ``write`` for the common
plain batch, from columns. Durability and visibility are the broker's (``Broker.flush``).
"""

from __future__ import annotations

import itertools
import logging
import zlib
from dataclasses import dataclass, field
from typing import Iterable, Sequence

from chronoq.broker.dedupe import DedupeWindow
from chronoq.broker.topics import TopicRegistry
from chronoq.broker.trace import TraceRecorder
from chronoq.core import errors, validate
from chronoq.core.clock import Clock
from chronoq.core.config import BrokerConfig
from chronoq.core.model import Message, MessageType, SendResult, TopicConfig
from chronoq.core.msgid import new_message_id
from chronoq.core.validate import PROP_MESSAGE_GROUP, PROP_MESSAGE_TYPE
from chronoq.store import record
from chronoq.store.store import Prepared, Store
from chronoq.timer.service import TimerService

# Enum members as module globals: ``MessageType.NORMAL`` is a metaclass attribute lookup that costs
# about a microsecond on Python 3.11, and prepare() compares types several times per message.
_MIXED, _NORMAL, _FIFO, _DELAY = MessageType.MIXED, MessageType.NORMAL, MessageType.FIFO, MessageType.DELAY
_FLAG_DELAYED = record.FLAG_DELAYED
assert Prepared._fields[0] == "topic" and Prepared._fields[4] == "deliver_at_ms"  # write() reads p[0], p[4]

log = logging.getLogger("chronoq.broker.broker")

# The properties of a message with none of its own but its type (``PROP_MESSAGE_TYPE``), as bytes.
_TYPE_PROPS = {t: record.encode_properties({PROP_MESSAGE_TYPE: t.name}) if t is not _NORMAL else b""
               for t in MessageType}


@dataclass(slots=True)
class OutgoingMessage:
    """What a producer hands the broker. Only ``topic`` and ``body`` are required."""

    topic: str
    body: bytes
    tag: str = ""
    keys: Sequence[str] = ()
    properties: dict[str, str] = field(default_factory=dict)
    message_id: str | None = None
    queue_id: int | None = None
    message_group: str | None = None
    born_ms: int | None = None
    message_type: MessageType | None = None
    # Delayed delivery (chronoq.timer): at most one of these. deliver_at_ms is epoch ms (at or
    # before now: delivered at once); delay_level is 1..len(timer_delay_levels), 0/None: no delay.
    deliver_at_ms: int | None = None
    delay_level: int | None = None


def _is_int(value: object) -> bool:
    """An int that is not a bool (``True`` must not pass for queue 1)."""
    return isinstance(value, int) and not isinstance(value, bool)


def _which(index: int, msg: object) -> str:
    """Which message of a batch an error concerns: its place, and its id when the client chose one."""
    mid = getattr(msg, "message_id", None)
    return f"message {index} of the batch" + (f" (id {str(mid)[:80]!r})" if mid else "")


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
        self._round_robin: dict[str, itertools.count] = {}
        self._tags: dict[str, bytes] = {}
        # Client message ids stored lately: a hash of (topic, id) and the record's commit offset
        # (chronoq.broker.dedupe, ~40 B an entry, no Python object per entry); an exact resend answers
        # the original, rebuilt from its record (``_original``).
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
        """Validate a batch and choose each message's queue. Returns the store records, the
        message ids, and whether the client chose each id. The first message that breaks a rule
        raises its error, naming its place in the batch (``_which``).

        With ``new_topics`` an unknown topic is planned there instead of auto-created (``write``
        creates them once the whole batch is valid).

        One loop per batch with what every message needs looked up once: the common fields
        (a cached topic, a cached tag, a body, client ids checked in bulk, a round-robin queue)
        cost no call; the others go through ``chronoq.core.validate``, the rules every entry
        point shares, and a delivery time through the timer's (``due_ms``).
        """
        msgs = messages if type(messages) is list else list(messages)
        if now is None:
            now = self.clock.wall_ms()
        # Client ids in bulk (a few C passes): when all surely pass, none is checked one by one.
        client_ids = [m.message_id for m in msgs if m.message_id]
        ids_checked = not client_ids or validate.plain_message_ids(client_ids)
        prepared: list[Prepared] = []
        ids: list[str] = []
        chosen: list[bool] = []
        add_prepared, add_id, add_chosen = prepared.append, ids.append, chosen.append
        registry = self.registry
        cache = registry.system_cache if system else registry.user_cache
        topics, tags, round_robin, timer = registry.topics, self._tags, self._round_robin, self.timer
        body_max = self.config.max_body_bytes
        base_flags = record.FLAG_SYSTEM if system else 0
        new = tuple.__new__  # a NamedTuple's own __new__ is a Python-level call, per message
        i, msg = 0, None
        try:
            for i, msg in enumerate(msgs):
                name = msg.topic
                topic = cache.get(name) if type(name) is str else None  # (an unhashable name must not raise)
                if topic is None or topics.get(name) is not topic:
                    topic = registry.send_topic(name, system, new_topics)
                body = msg.body
                if type(body) is not bytes or not body or len(body) > body_max:
                    body = validate.body(body, body_max)
                tag = msg.tag
                if tag:
                    raw_tag = tags.get(tag) if type(tag) is str else None
                    if raw_tag is None:
                        raw_tag = self.tag_bytes(tag)
                else:
                    raw_tag = b""
                keys = record.encode_keys(validate.keys(msg.keys)) if msg.keys else b""
                props = validate.properties(msg.properties, allow_system=system) if msg.properties else None
                group = msg.message_group  # (None or "": no group)
                if group:
                    group = validate.message_group(group)
                deliver_at, level = msg.deliver_at_ms, msg.delay_level
                delayed = deliver_at is not None or bool(level)
                mtype = msg.message_type or (_FIFO if group else _DELAY if delayed else _NORMAL)
                if topic.message_type is not _MIXED and topic.message_type is not mtype:
                    raise errors.MessageTypeMismatch(
                        f"topic {topic.name} accepts {topic.message_type.name} messages, not {mtype.name}")
                if props is None and not group:
                    # The common case (no properties of its own): the type property's bytes, encoded once.
                    raw_props = _TYPE_PROPS[mtype]
                else:
                    if group or mtype is not _NORMAL:
                        props = props or {}
                        if group:
                            props[PROP_MESSAGE_GROUP] = group
                        if mtype is not _NORMAL:
                            props[PROP_MESSAGE_TYPE] = mtype.name
                    raw_props = record.encode_properties(props) if props else b""
                message_id = msg.message_id
                if message_id:
                    if not ids_checked:
                        message_id = validate.message_id(message_id)
                    add_chosen(True)
                else:
                    message_id = new_message_id(now)
                    add_chosen(False)
                if msg.queue_id is None and not msg.message_group:  # round robin
                    counter = round_robin.get(topic.name)
                    if counter is None:
                        counter = round_robin[topic.name] = itertools.count()
                    queue_id = next(counter) % topic.queues
                else:
                    queue_id = self._choose_queue(topic, msg)
                born = now if msg.born_ms is None else int(msg.born_ms)
                flags, due = base_flags, 0
                if delayed:
                    if level:  # a level record (rare): the timer rewrites the destination
                        p = new(Prepared, (topic.name, queue_id, flags, born, 0, message_id.encode(), raw_tag, keys,
                                           raw_props, body))
                        add_prepared(timer.prepare_delayed(p, deliver_at, level, now))
                        add_id(message_id)
                        continue
                    due = timer.due_ms(deliver_at, now)
                    if due > now:  # (due already: an ordinary record with its due time, visible at once)
                        flags |= _FLAG_DELAYED
                add_prepared(new(Prepared, (topic.name, queue_id, flags, born, due, message_id.encode(), raw_tag, keys,
                                            raw_props, body)))
                add_id(message_id)
        except errors.ClientError as exc:  # say which message of the batch is refused
            raise validate.naming(exc, _which(i, msg)) from None
        return prepared, ids, chosen

    def _choose_queue(self, topic: TopicConfig, msg: OutgoingMessage) -> int:
        if msg.queue_id is not None:
            if not _is_int(msg.queue_id) or not 0 <= msg.queue_id < topic.queues:
                raise errors.InvalidQueue(f"queue {msg.queue_id!r} does not exist in topic {topic.name} "
                                          f"(queues 0..{topic.queues - 1})")
            return msg.queue_id
        if msg.message_group:  # one group always lands in one queue, so its order holds
            return zlib.crc32(msg.message_group.encode()) % topic.queues
        counter = self._round_robin.get(topic.name)
        if counter is None:
            counter = self._round_robin[topic.name] = itertools.count()
        return next(counter) % topic.queues

    def check_duplicate(self, topic: str, message_id: str, body: bytes) -> SendResult | None:
        """The original result if (topic, id) was sent within the window with the same body."""
        window = self._dedupe
        return self._original(topic, message_id, body, window.hash_key(topic, message_id), self.clock.wall_ms())

    def _original(self, topic: str, message_id: str, body: bytes, key_hash: int, now: int) -> SendResult | None:
        """``check_duplicate`` with the key's hash known. The window keeps only a hash and a
        commit offset: each candidate's record is read back and must carry this topic and id (a
        hash collision is another message, not a duplicate); its body decides duplicate or
        ``DuplicateMessageId``, and its fields rebuild the original answer."""
        for commit_offset in self._dedupe.candidates(key_hash, now):
            try:
                stored = self.store.read_record_at(commit_offset)
            except (errors.NotFound, errors.CorruptionError) as exc:
                # The record is gone (retention deleted its segment inside the window) or damaged:
                # there is no original to answer with, so the entry counts as gone and the resend
                # is stored anew (at least once, as after the window).
                if isinstance(exc, errors.CorruptionError):
                    log.warning("dedupe: record at %d unreadable (%s); resend of %s stored anew",
                                commit_offset, exc, message_id)
                continue
            if stored.topic != topic or stored.message_id != message_id:
                continue
            if stored.body != body:
                raise errors.DuplicateMessageId(
                    f"message id {message_id} was already used in topic {topic} for a different body")
            return self._result_of(stored)
        return None

    def _result_of(self, m: Message) -> SendResult:
        """The answer ``write`` gave when it stored ``m`` (read back from the log), as a duplicate."""
        if not m.deliver_at_ms:
            return SendResult(m.message_id, m.topic, m.queue_id, m.queue_offset, m.commit_offset, duplicate=True)
        # A delayed send: the timer's answer (recall handle; the real topic of a delay-level copy).
        props = record.encode_properties(m.properties) if m.properties else b""
        p = Prepared(m.topic, m.queue_id, m.flags, m.born_ms, m.deliver_at_ms, m.message_id.encode(), b"", b"",
                     props, b"")
        result = self.timer.send_result(p, m.message_id, m.commit_offset, m.queue_offset)
        result.duplicate = True
        return result

    def write(self, messages: Iterable[OutgoingMessage], *, system: bool = False) -> list[SendResult]:
        """Validate and append (page cache only). Durability and visibility come from ``flush``.

        The whole batch is validated before anything is written: one bad message fails the batch
        and stores nothing. A message id the client chose is deduplicated: an exact resend within
        ``dedupe_window_ms`` (also inside one batch) answers the original result, ``duplicate=True``.
        """
        new_topics: dict[str, TopicConfig] = {}
        now = self.clock.wall_ms()
        prepared, ids, chosen = self.prepare_batch(messages, system=system, now=now, new_topics=new_topics)
        timed = any(p[4] for p in prepared)  # a message with a due time: answered with a recall handle
        window = self._dedupe
        client_ids = any(chosen)
        key_hashes: list[int] = []
        answers: list[SendResult | int | None] | None = None  # None: every message is new
        if client_ids:
            key_hashes = window.hash_keys([p[0] for p in prepared], ids)
            keys = [(p[0], mid) for p, mid, c in zip(prepared, ids, chosen) if c]
            # Duplicates (in the batch or the window) are rare: one bulk test for the batch, and
            # only a batch that may hold one is answered message by message.
            if len(set(keys)) != len(keys) or window.any_present(list(itertools.compress(key_hashes, chosen))):
                answers, prepared, ids, key_hashes = self._deduplicated(prepared, ids, chosen, key_hashes, now)
        for name in new_topics:  # the whole batch is valid: now create the topics it needs
            self.registry.get(name, create=True)
        written = self.store.write(prepared)
        if self.trace is not None and prepared:
            self.trace.stored(prepared, now)
        if timed:  # delayed sends answer with recall handles, made for the batch at once
            fresh = self.timer.send_results(prepared, ids, written)
        else:
            fresh = [SendResult(mid, p.topic, p.queue_id, w.queue_offset, w.commit_offset)
                     for p, mid, w in zip(prepared, ids, written)]
        if prepared and not system:
            self._count_sent(fresh if timed else prepared)
        if not client_ids:  # every message is new and has no id to remember
            return fresh
        # Every message of a batch with client ids is remembered (generated ids too, as before).
        window.add(key_hashes, [w.commit_offset for w in written], self.clock.wall_ms())
        if answers is None:
            return fresh
        taken = iter(fresh)
        out: list[SendResult] = []
        for answer in answers:
            if answer is None:
                result = next(taken)
            elif isinstance(answer, int):
                first = out[answer]
                result = SendResult(first.message_id, first.topic, first.queue_id, first.queue_offset,
                                    first.commit_offset, duplicate=True, recall_handle=first.recall_handle)
            else:
                result = answer
            out.append(result)
        return out

    def _count_sent(self, rows: list) -> None:
        """Count accepted messages per topic (chronoq.server.metrics). ``rows``: records or results
        whose ``.topic`` is the producer's topic: a delay-level record is stored in the system
        topic CHRONOQ_DELAY, so a timed batch is counted from its answers (the real topic)."""
        sent = self.sent_by_topic
        topic = rows[0].topic
        if len(rows) == 1 or all(r.topic == topic for r in rows):  # a batch is nearly always of one topic
            sent[topic] = sent.get(topic, 0) + len(rows)
        else:
            for r in rows:
                sent[r.topic] = sent.get(r.topic, 0) + 1

    def _deduplicated(self, prepared: list[Prepared], ids: list[str], chosen: list[bool], key_hashes: list[int],
                      now: int) -> tuple[list, list[Prepared], list[str], list[int]]:
        """``write``'s batch that may hold a duplicate, message by message: (the answer slots,
        and the prepared records, ids and key hashes of the new messages). Slot i of the answer:
        None = new (the next written record), an int = the slot whose resend it is (inside the
        batch), else the original's result (from the window)."""
        answers: list[SendResult | int | None] = []
        new_prepared: list[Prepared] = []
        new_ids: list[str] = []
        new_hashes: list[int] = []
        # (topic, id) -> (its slot, its body): a resend inside the batch answers that slot.
        first_in_batch: dict[tuple[str, str], tuple[int, bytes]] = {}
        for p, mid, c, h in zip(prepared, ids, chosen, key_hashes):
            if c:
                key = (p.topic, mid)
                first = first_in_batch.get(key)
                if first is not None:
                    if first[1] != p.body:  # same rule as check_duplicate, inside a batch
                        raise errors.DuplicateMessageId(
                            f"message id {mid} is used twice in this batch for different bodies")
                    answers.append(first[0])
                    continue
                dup = self._original(p.topic, mid, p.body, h, now)
                if dup is not None:
                    answers.append(dup)
                    continue
                first_in_batch[key] = (len(answers), p.body)
            answers.append(None)
            new_prepared.append(p)
            new_ids.append(mid)
            new_hashes.append(h)
        return answers, new_prepared, new_ids, new_hashes

    def write_plain(self, topic: str, message_ids: list[str], tags: list[str], bodies: list[bytes],
                    born_ms: list[int | None]) -> list[int] | None:
        """``write`` for the common batch, checked and stored in bulk: plain messages of one
        existing topic, each with a client-chosen id, a tag or none, and no keys, properties,
        group, delay or queue. Returns the queue offsets (the results are those of ``write``:
        these ids, round-robin queues, no duplicates), or None, having changed nothing, when the
        batch is anything else: a new topic, a rule broken, a duplicate id (in the batch or the
        window). The caller then uses ``write``, which answers such batches message by message
        with the usual errors. Same records, queues, dedupe entries, metrics and trace events.
        """
        n = len(bodies)
        if not n or not (len(message_ids) == len(tags) == len(born_ms) == n):
            return None
        cfg = self.registry.user_cache.get(topic) if type(topic) is str else None
        if cfg is None or self.registry.topics.get(topic) is not cfg or (cfg.message_type is not _MIXED
                                                                 and cfg.message_type is not _NORMAL):
            return None  # (the first send of a topic validates and caches it)
        # Bodies: bytes, not empty, within the limit.
        lengths = list(map(len, bodies))
        if min(lengths) == 0 or max(lengths) > self.config.max_body_bytes \
                or not all(type(b) is bytes for b in bodies):
            return None
        if not validate.plain_message_ids(message_ids):
            return None
        # Duplicates (in the batch or the dedupe window) are answered with the original: slow way.
        window = self._dedupe
        key_hashes = window.hash_keys(itertools.repeat(topic, n), message_ids)
        if len(set(message_ids)) != n or window.any_present(key_hashes):
            return None
        distinct_tags = set(tags)
        tag_bytes: dict[str, bytes] = {}
        for t in distinct_tags:
            if type(t) is not str:
                return None
            try:
                tag_bytes[t] = self.tag_bytes(t) if t else b""
            except errors.ClientError:
                return None
        raw_tags = [tag_bytes[tags[0]]] * n if len(distinct_tags) == 1 else [tag_bytes[t] for t in tags]
        # All valid: from here on the batch is written as write() would write it.
        counter = self._round_robin.get(topic)
        start = 0 if counter is None else next(counter)
        self._round_robin[topic] = itertools.count(start + n)  # as if next() ran once per message
        queues = cfg.queues
        queue_ids = [(start + i) % queues for i in range(n)]
        now = self.clock.wall_ms()
        born = [now if b is None else b for b in born_ms]
        raw_ids = [m.encode() for m in message_ids]
        commits, qoffs = self.store.write_plain(topic, queue_ids, born, raw_ids, raw_tags, bodies)
        sent = self.sent_by_topic
        sent[topic] = sent.get(topic, 0) + n
        if self.trace is not None:
            self.trace.stored_plain(topic, raw_ids, now)
        window.add(key_hashes, commits, self.clock.wall_ms())
        return qoffs
