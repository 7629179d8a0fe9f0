"""The embedded broker: topics, sends, reads and consumer-group offsets over the store.

This is the Python API every front end uses (tests, the CLI, the gRPC shell). It is synchronous
and single-threaded by design: the asyncio shell calls it from the event loop and only moves the
fsync to a worker thread (see ``chronoq.broker.committer``).

Files it owns in the data directory (``fsutil.write_json`` documents)::

    topics.json   {"topics": [{"name", "queues", "message_type"}, ...]}
    offsets.json  {"<group>": {"<topic>": {"<queue id>": <next offset to consume>}}}
"""

from __future__ import annotations

import itertools
import logging
import os
import zlib
from dataclasses import dataclass, field
from typing import Iterable, Sequence

from chronoq.core import errors, fsutil, model, validate
from chronoq.core.clock import SYSTEM_CLOCK, Clock
from chronoq.core.config import BrokerConfig
from chronoq.broker.dedupe import DedupeWindow
from chronoq.core.jobs import Job, run_all_here
from chronoq.core.model import Message, MessageType, SendResult, TopicConfig
from chronoq.core.msgid import new_message_id
from chronoq.core.validate import PROP_MESSAGE_GROUP, PROP_MESSAGE_TYPE  # (pop and staging import them from here)
from chronoq.core.refusals import Refusals
from chronoq.store import record
from chronoq.store.dirlock import DirLock
from chronoq.store.diskspace import DiskSpace
from chronoq.store.store import Prepared, Store, StoreOptions
from chronoq.core.delay_levels import DELAY_TOPIC
from chronoq.timer.service import (RecallOutcome, RecallResult, RescheduleOutcome, RescheduleResult, TimerOptions,
                                   TimerService)
from chronoq.broker.trace import TRACE_TOPIC, TraceRecorder
from chronoq.broker.trace import bodies as trace_bodies

# Enum members as module globals: ``MessageType.NORMAL`` is a metaclass attribute lookup that costs
# about a microsecond on Python 3.11, and prepare() compares types several times per message.
_MIXED, _NORMAL, _FIFO, _DELAY = MessageType.MIXED, MessageType.NORMAL, MessageType.FIFO, MessageType.DELAY
_FLAG_DELAYED = record.FLAG_DELAYED
assert Prepared._fields[0] == "topic" and Prepared._fields[4] == "deliver_at_ms"  # write() reads p[0], p[4]

log = logging.getLogger("chronoq.broker.broker")

TOPICS_FILE = "topics.json"
OFFSETS_FILE = "offsets.json"
# The properties of a message with none of its own but its type (``PROP_MESSAGE_TYPE``), as bytes.
_TYPE_PROPS = {t: record.encode_properties({PROP_MESSAGE_TYPE: t.name}) if t is not _NORMAL else b""
               for t in MessageType}
# Dedupe entries expired per maintenance call at most (maintenance runs every 200 ms, so 10,000 a
# second; above that rate ``dedupe_max_entries`` bounds the window). Expiry only moves the
# window's tail now (chronoq.broker.dedupe), well under a ms for a step; the bound stays a bound.
DEDUPE_EXPIRE_STEP = 2_000
# Per maintenance pass (every <= 200 ms), time spent counting schedule files for the metrics
# cache: a first scrape then finds them counted, and deliveries wait at most this long.
HORIZON_WARM_BUDGET_NS = 2_000_000


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


@dataclass(slots=True)
class ReadResult:
    messages: list[Message]
    next_offset: int
    min_offset: int
    max_offset: int


def _is_int(value: object) -> bool:
    """An int that is not a bool (``True`` must not pass for queue 1)."""
    return isinstance(value, int) and not isinstance(value, bool)


def _which(index: int, msg: object) -> str:
    """Which message of a batch an error concerns: its place, and its id when the client chose one."""
    mid = getattr(msg, "message_id", None)
    return f"message {index} of the batch" + (f" (id {str(mid)[:80]!r})" if mid else "")


class Broker:
    def __init__(self, config: BrokerConfig | None = None, clock: Clock | None = None, progress=None):
        self.config = (config or BrokerConfig()).validate()
        self.clock = clock or SYSTEM_CLOCK
        opened_ns = self.clock.monotonic_ns()
        self.data_dir = self.config.data_dir
        os.makedirs(self.data_dir, exist_ok=True)
        # One process per data directory (chronoq.store.dirlock), before anything in it is read;
        # held until ``close`` has written the last file, and given back if opening fails.
        self.dir_lock = DirLock.acquire(self.data_dir)
        try:
            self._open(opened_ns, progress)
        except BaseException:
            self.dir_lock.release()
            raise

    def _open(self, opened_ns: int, progress) -> None:
        self.store = Store(self.data_dir, StoreOptions(
            segment_bytes=self.config.segment_bytes,
            cq_entries_per_file=self.config.cq_entries_per_file,
            verify_extra_segments=self.config.verify_extra_segments,
            quarantine=self.config.quarantine,
        ), clock=self.clock, progress=progress, dir_lock=self.dir_lock)
        self.recovery = self.store.report
        # Requests the front ends turn away, by reason (chronoq_requests_refused_total).
        self.refusals = Refusals(self.clock.monotonic_ns)
        # New messages are refused while free space is below the reserve (receives and acks go on).
        self.disk = DiskSpace(self.data_dir, self.config.disk_reserve_bytes, self.config.disk_check_interval_ms,
                              self.clock)
        self.topics: dict[str, TopicConfig] = {}
        self._load_topics()
        self.offsets: dict[str, dict[str, dict[int, int]]] = {}
        self._offsets_dirty = False
        self._load_offsets()
        self._round_robin: dict[str, itertools.count] = {}
        self._valid_groups: set[str] = set()  # group names commit_offset has validated
        self._user_topics: dict[str, TopicConfig] = {}
        self._system_topics: dict[str, TopicConfig] = {}
        self._tags: dict[str, bytes] = {}
        # Client message ids stored lately: a hash of (topic, id) and the record's commit offset
        # (chronoq.broker.dedupe, ~40 B an entry, no Python object per entry); an exact resend answers
        # the original, rebuilt from its record (``_original``).
        self._dedupe = DedupeWindow(self.config.dedupe_max_entries, self.config.dedupe_window_ms)
        self._last_checkpoint_ms = self.clock.wall_ms()
        self._arrival_listeners: list = []
        self._notified_upto = (self.store.dispatched, self.store.released)
        # Delayed delivery: the timer absorbs FLAG_DELAYED records (it drains store.delayed_dispatched
        # after each dispatch: ``on_arrivals``), catches up from its cursor here, and delivers what
        # falls due when ``timer_tick`` runs.
        self.timer = TimerService(self.store, TimerOptions.from_config(self.config), self.clock, self.data_dir,
                                  ensure_delay_topic=self._ensure_delay_topic)
        self.add_arrival_listener(self.timer.on_arrivals)
        # Message life trace for the delivery audit (chronoq.broker.trace): the hooks only append to a
        # buffer; ``maintenance`` writes it to TRACE_TOPIC every ``trace_flush_ms``.
        self.trace: TraceRecorder | None = None
        if self.config.trace_enabled:
            self.trace = TraceRecorder(self.config.trace_flush_ms, DELAY_TOPIC)
            self.create_topic(TRACE_TOPIC, 1, system=True)
            self.timer.on_visible = self.trace.visible
        # For chronoq.server.metrics: messages accepted from producers per topic (duplicates and system
        # writes not counted), and how long opening took (recovery of the store and the timer).
        self.sent_by_topic: dict[str, int] = {}
        self.open_duration_ns = self.clock.monotonic_ns() - opened_ns
        self.closed = False

    # ----------------------------------------------------------------- topics
    def _load_topics(self) -> None:
        try:
            data = fsutil.read_json(os.path.join(self.data_dir, TOPICS_FILE))
        except ValueError as exc:
            raise errors.CorruptionError(os.path.join(self.data_dir, TOPICS_FILE), 0, str(exc)) from None
        for item in (data or {}).get("topics", []):
            cfg = TopicConfig.from_json(item)
            self.topics[cfg.name] = cfg
        # Queues found in the store but missing from topics.json (e.g. lost metadata) are adopted.
        for (topic, qid) in list(self.store.queues):
            cfg = self.topics.get(topic)
            if cfg is None:
                self.topics[topic] = TopicConfig(topic, max(self.config.default_queues, qid + 1))
            elif qid >= cfg.queues:
                cfg.queues = qid + 1

    def _save_topics(self) -> None:
        fsutil.write_json(os.path.join(self.data_dir, TOPICS_FILE),
                          {"topics": [t.to_json() for t in sorted(self.topics.values(), key=lambda t: t.name)]})

    def create_topic(self, name: str, queues: int | None = None,
                     message_type: MessageType | str = MessageType.MIXED, *, system: bool = False) -> TopicConfig:
        """Create a topic, or update its queue count (only upwards) and type. Idempotent."""
        name = validate.topic_name(name) if system else validate.user_topic(name)
        if isinstance(message_type, str):
            message_type = MessageType.parse(message_type)
        queues = self.config.default_queues if queues is None else queues
        if not isinstance(queues, int) or not 1 <= queues <= self.config.max_queues:
            raise errors.InvalidQueue(f"queue count must be between 1 and {self.config.max_queues}, not {queues!r}")
        existing = self.topics.get(name)
        if existing is not None:
            if queues < existing.queues:
                raise errors.InvalidQueue(f"topic {name} has {existing.queues} queues; the count can only grow")
            if existing.queues == queues and existing.message_type == message_type:
                return existing
        cfg = TopicConfig(name, queues, message_type)
        self.topics[name] = cfg
        self._save_topics()
        return cfg

    def list_topics(self, include_system: bool = False) -> list[TopicConfig]:
        return sorted((t for t in self.topics.values() if include_system or not model.is_system_topic(t.name)),
                      key=lambda t: t.name)

    def topic(self, name: str, *, create: bool | None = None) -> TopicConfig:
        cfg = self.topics.get(name)
        if cfg is not None:
            return cfg
        validate.topic_name(name)
        if create is None:
            create = self.config.auto_create_topics
        if not create or model.is_system_topic(name):
            raise errors.TopicNotFound(f"topic {name!r} does not exist"
                                       + ("" if create else " (auto-create is off: create it first)"))
        return self.create_topic(name)

    # ----------------------------------------------------------------- sending
    def _send_topic(self, name: object, system: bool,
                    new_topics: dict[str, TopicConfig] | None = None) -> TopicConfig:
        """The topic a message goes to. With ``new_topics``, a topic auto-create would make is only
        planned there (not saved), so a batch that fails validation creates nothing."""
        # Validated topics are cached: the name rules cost more than the rest of a send.
        cache = self._system_topics if system else self._user_topics
        cfg = cache.get(name) if type(name) is str else None  # (an unhashable name must not raise TypeError)
        if cfg is None or self.topics.get(name) is not cfg:  # type: ignore[arg-type]
            topic_name = validate.topic_name(name) if system else validate.user_topic(name)
            if new_topics is not None and topic_name not in self.topics:
                planned = new_topics.get(topic_name)
                if planned is None:
                    if not self.config.auto_create_topics or model.is_system_topic(topic_name):
                        self.topic(topic_name)  # raises TopicNotFound, worded as usual
                    planned = new_topics[topic_name] = TopicConfig(topic_name, self.config.default_queues)
                return planned
            cfg = cache[topic_name] = self.topic(topic_name)
        return cfg

    def _tag_bytes(self, tag: object) -> bytes:
        raw = self._tags.get(tag) if type(tag) is str else None  # type: ignore[arg-type]
        if raw is None:
            raw = validate.tag(tag).encode()
            if len(self._tags) > 4096:
                self._tags.clear()
            self._tags[tag] = raw  # type: ignore[index]
        return raw

    def prepare(self, msg: OutgoingMessage, *, system: bool = False, now: int | None = None,
                new_topics: dict[str, TopicConfig] | None = None) -> tuple[Prepared, str]:
        """``prepare_batch`` for one message: its store record and its id."""
        (prepared,), (message_id,), _chosen = self.prepare_batch([msg], system=system, now=now, new_topics=new_topics)
        return prepared, message_id

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
        cache = self._system_topics if system else self._user_topics
        topics, tags, round_robin, timer = self.topics, self._tags, self._round_robin, self.timer
        body_max = self.config.max_body_bytes
        base_flags = record.FLAG_SYSTEM if system else 0
        new = tuple.__new__  # a NamedTuple's own __new__ is a Python-level call, per message
        i, msg = 0, None
        try:
            for i, msg in enumerate(msgs):
                name = msg.topic
                topic = cache.get(name) if type(name) is str else None  # (an unhashable name must not raise)
                if topic is None or topics.get(name) is not topic:
                    topic = self._send_topic(name, system, new_topics)
                body = msg.body
                if type(body) is not bytes or not body or len(body) > body_max:
                    body = validate.body(body, body_max)
                tag = msg.tag
                if tag:
                    raw_tag = tags.get(tag) if type(tag) is str else None
                    if raw_tag is None:
                        raw_tag = self._tag_bytes(tag)
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
            self.topic(name, create=True)
        written = self.store.write(prepared)
        if prepared and not system:  # chronoq.server.metrics; a batch is nearly always of one topic
            sent, topic = self.sent_by_topic, prepared[0][0]
            if len(prepared) == 1 or all(p[0] == topic for p in prepared):
                sent[topic] = sent.get(topic, 0) + len(prepared)
            else:
                for p in prepared:
                    sent[p[0]] = sent.get(p[0], 0) + 1
        if self.trace is not None and prepared:
            self.trace.stored(prepared, now)
        if timed:  # delayed sends answer with recall handles, made for the batch at once
            fresh = self.timer.send_results(prepared, ids, written)
        else:
            fresh = [SendResult(mid, p.topic, p.queue_id, w.queue_offset, w.commit_offset)
                     for p, mid, w in zip(prepared, ids, written)]
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
        cfg = self._user_topics.get(topic) if type(topic) is str else None
        if cfg is None or self.topics.get(topic) is not cfg or (cfg.message_type is not _MIXED
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
                tag_bytes[t] = self._tag_bytes(t) if t else b""
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

    def flush(self) -> int:
        """Make everything written durable (per policy) and visible; return the durable offset."""
        synced = self.store.dispatch(self.store.sync())
        self.notify_arrivals()
        return synced

    def add_arrival_listener(self, listener) -> None:
        """``listener()`` is called after new messages became visible (for long polling)."""
        self._arrival_listeners.append(listener)

    def notify_arrivals(self) -> None:
        # Visibility grows by dispatch and by releasing held timer copies at their due time.
        mark = (self.store.dispatched, self.store.released)
        if mark != self._notified_upto:
            self._notified_upto = mark
            for listener in self._arrival_listeners:
                listener()

    def send(self, topic: str, body: bytes | str, **kwargs) -> SendResult:
        """Send one message; returns after it is durable (sync policy) and visible."""
        return self.send_batch([OutgoingMessage(topic, body, **kwargs)])[0]

    def check_space(self) -> None:
        """Raise ``errors.DiskFull`` while the disk is below its reserve. Callers: new sends only."""
        self.disk.check()

    def send_batch(self, messages: Iterable[OutgoingMessage], *, system: bool = False) -> list[SendResult]:
        if not system:
            self.check_space()
        results = self.write(messages, system=system)
        if self.config.flush_policy == "sync":
            self.flush()
        else:
            self.store.dispatch()
            self.notify_arrivals()
        return results

    # ----------------------------------------------------------------- delayed delivery (chronoq.timer)
    def _ensure_delay_topic(self, levels: int) -> None:
        cfg = self.topics.get(DELAY_TOPIC)
        if cfg is None or cfg.queues < levels:
            self.create_topic(DELAY_TOPIC, min(max(levels, cfg.queues if cfg else 1), self.config.max_queues),
                              system=True)

    def recall(self, handle: str) -> RecallResult:
        """Cancel a delayed message by the ``recall_handle`` its send returned.

        The outcome is definite: CANCELLED (durable before this returns; it will never be
        visible), ALREADY_DELIVERED (its time has come: it is or will be visible), NOT_FOUND.
        A malformed handle raises ``ClientError``.
        """
        result = self.timer.recall(handle)
        self.notify_arrivals()
        if self.trace is not None and result.outcome is RecallOutcome.CANCELLED:
            self.trace.recalled(result.topic, result.message_id, result.deliver_at_ms, self.clock.wall_ms())
        return result

    def reschedule(self, handle: str, deliver_at_ms: int) -> RescheduleResult:
        """Move a pending delayed message to ``deliver_at_ms``; the result carries a new handle."""
        result = self.timer.reschedule(handle, deliver_at_ms)
        self.notify_arrivals()
        if self.trace is not None and result.outcome is RescheduleOutcome.RESCHEDULED:
            self.trace.rescheduled(result.topic, result.message_id, result.deliver_at_ms, self.clock.wall_ms())
        return result

    def timer_tick(self, now_ms: int | None = None, *, durable: bool = True) -> int:
        """Deliver what is due (bounded work); the runtime calls it at ``timer_next_deadline_ms``.

        ``durable=False``: write due copies without waiting for their fsync; when
        ``timer.durability_wanted()`` the caller runs ``store.sync`` on a worker thread and
        calls ``timer_synced`` (or ``timer_sync_failed``). See ``TimerService.tick``.
        """
        done = self.timer.tick(now_ms, durable=durable)
        self.notify_arrivals()
        return done

    def release_due_timers(self, now_ms: int | None = None) -> int:
        """Make held timer copies due by now visible (an in-memory step; readers call it so a read
        at t sees every copy due by t even while the timer's tick waits behind other work).
        Returns how many completed deliveries became visible."""
        if not self.store.holding or self.timer.closed:
            return 0
        done = self.timer.release_due(now_ms)
        self.notify_arrivals()
        return done

    def timer_synced(self, synced_upto: int) -> int:
        """The commit log is fsynced below ``synced_upto``: complete the timer's deliveries."""
        done = self.timer.synced(synced_upto)
        self.notify_arrivals()
        return done

    def timer_sync_failed(self, exc: BaseException) -> None:
        self.timer.sync_failed(exc)

    def timer_next_deadline_ms(self) -> int | None:
        """Epoch ms at which ``timer_tick`` next has work (may be in the past), or None."""
        return self.timer.next_deadline_ms()

    def timer_stats(self, horizon_ms: int = 600_000) -> dict:
        """Lateness histogram, pending counts by due bucket, per-level backlog, lanes (plain dicts)."""
        return self.timer.stats(horizon_ms)

    # ----------------------------------------------------------------- message life trace
    def write_trace(self) -> int:
        """Write the buffered trace events as TRACE_TOPIC records (page cache; durable and visible
        with the next fsync, e.g. ``flush``). Returns how many events were written."""
        trace = self.trace
        if trace is None or not trace.events:
            return 0
        return self.write_trace_events(trace.take_events())

    def write_trace_events(self, events: list) -> int:
        """Write trace events taken with ``trace.take_events()`` (the server does it in slices)."""
        if not events:
            return 0
        now = self.clock.wall_ms()
        self.store.write([Prepared(TRACE_TOPIC, 0, record.FLAG_SYSTEM, now, 0, new_message_id(now).encode(),
                                   b"", b"", b"", body) for body in trace_bodies(events)])
        return len(events)

    # ----------------------------------------------------------------- reading
    def read(self, topic: str, queue_id: int, offset: int, max_messages: int = 32) -> ReadResult:
        cfg = self.topics.get(topic)
        if cfg is None:
            raise errors.TopicNotFound(f"topic {topic!r} does not exist")
        if not _is_int(queue_id) or not 0 <= queue_id < cfg.queues:
            raise errors.InvalidQueue(f"queue {queue_id!r} does not exist in topic {topic}")
        if not _is_int(offset) or offset < 0:
            raise errors.InvalidOffset(f"offset must be a non-negative integer, not {offset!r}")
        if not _is_int(max_messages) or not 1 <= max_messages <= 10_000:
            raise errors.ClientError("max_messages must be between 1 and 10000")
        messages, nxt = self.store.read(topic, queue_id, offset, max_messages)
        lo, hi = self.store.bounds(topic, queue_id)
        return ReadResult(messages, max(nxt, offset if offset >= lo else lo), lo, hi)

    def queue_bounds(self, topic: str, queue_id: int) -> tuple[int, int]:
        """(min offset, next offset) of a queue: readable offsets are min <= n < next."""
        return self.store.bounds(topic, queue_id)

    # ----------------------------------------------------------------- consumer offsets
    def _load_offsets(self) -> None:
        path = os.path.join(self.data_dir, OFFSETS_FILE)
        try:
            data = fsutil.read_json(path) or {}
        except ValueError as exc:
            log.warning("consumer offsets unreadable (%s); groups restart from their last durable state", exc)
            data = {}
        self.offsets = {g: {t: {int(q): int(o) for q, o in qs.items()} for t, qs in ts.items()}
                        for g, ts in data.items()}

    def get_offset(self, group: str, topic: str, queue_id: int) -> int | None:
        validate.group_name(group)
        return self.offsets.get(group, {}).get(topic, {}).get(queue_id)

    def commit_offset(self, group: str, topic: str, queue_id: int, offset: int) -> None:
        """Record that ``group`` consumed ``topic``/``queue_id`` below ``offset``.

        Durable at the next checkpoint (``checkpoint_interval_ms``) or clean stop.
        """
        if group not in self._valid_groups:  # POP commits after every ack: validate a name once
            validate.group_name(group)
            if len(self._valid_groups) > 10_000:
                self._valid_groups.clear()
            self._valid_groups.add(group)
        cfg = self.topics.get(topic)
        if cfg is None:
            raise errors.TopicNotFound(f"topic {topic!r} does not exist")
        if not _is_int(queue_id) or not 0 <= queue_id < cfg.queues:
            raise errors.InvalidQueue(f"queue {queue_id!r} does not exist in topic {topic}")
        lo, hi = self.store.bounds(topic, queue_id)
        if not _is_int(offset) or not 0 <= offset <= hi:
            raise errors.InvalidOffset(f"offset {offset!r} is outside 0..{hi} for {topic}/{queue_id}")
        self.offsets.setdefault(group, {}).setdefault(topic, {})[queue_id] = offset
        self._offsets_dirty = True

    def list_groups(self) -> list[str]:
        return sorted(self.offsets)

    def _save_offsets(self) -> None:
        if self._offsets_dirty:
            fsutil.write_json(os.path.join(self.data_dir, OFFSETS_FILE), self._offsets_doc())
            self._offsets_dirty = False

    def _offsets_doc(self) -> dict:
        return {g: {t: {str(q): o for q, o in qs.items()} for t, qs in ts.items()} for g, ts in self.offsets.items()}

    # ----------------------------------------------------------------- lifecycle
    def checkpoint(self) -> None:
        self.checkpoint_job().run_here()

    def checkpoint_job(self) -> Job:
        """The store checkpoint and consumer offsets, with their fsyncs in ``run`` (any thread;
        ``chronoq.core.jobs``). The offsets written are those of now."""
        store_job = self.store.checkpoint_job()
        offsets = self._offsets_doc() if self._offsets_dirty else None
        self._offsets_dirty = False
        self._last_checkpoint_ms = self.clock.wall_ms()
        path = os.path.join(self.data_dir, OFFSETS_FILE)

        def run() -> None:
            store_job.run()
            if offsets is not None:
                fsutil.write_json(path, offsets)

        def finish(exc: BaseException | None) -> None:
            store_job.finish(exc)
            if exc is not None and offsets is not None:
                self._offsets_dirty = True  # written again at the next checkpoint

        return Job("broker checkpoint", run, finish)

    def maintenance(self) -> None:
        """Periodic work for the shell to call: checkpoint when due and expire dedupe entries."""
        run_all_here(self.maintenance_jobs())

    def maintenance_jobs(self) -> list[Job]:
        """``maintenance`` for the asyncio shell: the cheap work is done here, the blocking parts
        (checkpoint fsyncs and files) are returned as jobs to run on a worker thread and finish
        back on this one, in order (``chronoq.core.jobs``). Call again only once they all finished."""
        now = self.clock.wall_ms()
        jobs = []
        try:
            if now - self._last_checkpoint_ms >= self.config.checkpoint_interval_ms:
                jobs.append(self.checkpoint_job())
            timer_job = self.timer.maintenance_job(now)
            if timer_job is not None:
                jobs.append(timer_job)
        except BaseException as exc:  # a begun job must still be finished (it undoes its snapshot)
            for job in jobs:
                job.finish(exc)
            raise
        if self.trace is not None and self.trace.due(now):
            self.write_trace()
        self.timer.warm_horizon_cache(HORIZON_WARM_BUDGET_NS)
        # At most DEDUPE_EXPIRE_STEP a call: a burst of sends expires all at once, and expiring
        # 300,000 entries in one go (as the OrderedDict window did) held the event loop, and every
        # timer release, for tens of ms.
        self._dedupe.expire(now, DEDUPE_EXPIRE_STEP)
        return jobs

    def retention(self) -> list[str]:
        max_age = self.config.retention_max_age_hours * 3600 * 1000 if self.config.retention_max_age_hours else None
        return self.store.retention(max_age, self.config.retention_max_bytes or None)

    def close(self) -> None:
        if self.closed:
            return
        self.write_trace()
        self.store.dispatch(self.store.sync())
        try:
            self.timer.close()  # its clean checkpoint; without it the next start replays more
        finally:
            self.store.close()
        self._save_offsets()
        self.closed = True
        self.dir_lock.release()  # only after a clean close: a failed one keeps others out until we exit

    def __enter__(self) -> "Broker":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
