"""The embedded broker: topics, sends, reads and consumer-group offsets over the store.

This is the Python API every front end uses (tests, the CLI, the gRPC shell). It is synchronous
and single-threaded by design: the asyncio shell calls it from the event loop and only moves the
fsync to a worker thread (see ``chronoq.broker.committer``).

``Broker`` is the facade; its jobs live beside it: the send pipeline (``chronoq.broker.sending``),
topics and ``topics.json`` (``chronoq.broker.topics``), consumer offsets and ``offsets.json``
(``chronoq.broker.offsets``), the dedupe window (``chronoq.broker.dedupe``), the message life trace
(``chronoq.broker.trace``). Features (transactions, staging) use the named operations below, not
the store or the timer behind them.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Iterable

from chronoq.broker.offsets import OFFSETS_FILE, ConsumerOffsets
from chronoq.broker.sending import OutgoingBatch, OutgoingMessage, Sender, Sent, _is_int
from chronoq.broker.timing import TimerOperations
from chronoq.broker import topics
from chronoq.broker.topics import TOPICS_FILE, TopicRegistry
from chronoq.broker.trace import TRACE_TOPIC, TraceRecorder
from chronoq.broker.trace import bodies as trace_bodies
from chronoq.core import errors, fsutil, model, validate
from chronoq.core.clock import SYSTEM_CLOCK, Clock
from chronoq.core.config import BrokerConfig
from chronoq.core.delay_levels import DELAY_TOPIC
from chronoq.core.jobs import Job, run_all_here
from chronoq.core.model import Message, MessageType, SendResult, TopicConfig
from chronoq.core.msgid import new_message_id
from chronoq.core.validate import PROP_MESSAGE_GROUP, PROP_MESSAGE_TYPE  # (pop and staging import them from here)
from chronoq.core.refusals import Refusals
from chronoq.store import record
from chronoq.store.dirlock import DirLock
from chronoq.store.diskspace import DiskSpace
from chronoq.store.store import Prepared, Store, StoreOptions, Written
from chronoq.timer import roll
from chronoq.timer.service import TimerOptions, TimerService

# Names other modules import from here (the facade's public API).
__all__ = ["Broker", "OutgoingMessage", "OutgoingBatch", "Sent", "ReadResult", "PROP_MESSAGE_GROUP", "PROP_MESSAGE_TYPE", "TOPICS_FILE",
           "OFFSETS_FILE", "DEDUPE_EXPIRE_STEP", "HORIZON_WARM_BUDGET_NS"]

log = logging.getLogger("chronoq.broker.broker")

# Dedupe entries expired per maintenance call at most (maintenance runs every 200 ms, so 10,000 a
# second; above that rate ``dedupe_max_entries`` bounds the window). Expiry only moves the
# window's tail now (chronoq.broker.dedupe), well under a ms for a step; the bound stays a bound.
DEDUPE_EXPIRE_STEP = 2_000
# Per maintenance pass (every <= 200 ms), time spent counting schedule files for the metrics
# cache: a first scrape then finds them counted, and deliveries wait at most this long.
HORIZON_WARM_BUDGET_NS = 2_000_000


@dataclass(slots=True)
class ReadResult:
    messages: list[Message]
    next_offset: int
    min_offset: int
    max_offset: int


class Broker(TimerOperations):
    def __init__(self, config: BrokerConfig | None = None, clock: Clock | None = None, progress=None):
        self.config = (config or BrokerConfig()).validate()
        self.clock = clock or SYSTEM_CLOCK
        opened_ns = self.clock.monotonic_ns()
        self.data_dir = self.config.data_dir
        try:
            os.makedirs(self.data_dir, exist_ok=True)
        except OSError as exc:  # a file in the way, no permission, a read-only file system
            raise errors.ClientError(f"cannot use data directory {self.data_dir}: {exc.strerror or exc} "
                                     "(--data-dir, CHRONOQ_DATA_DIR or data_dir in the config file)") from None
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
            cq_open_files_max=self.config.cq_open_files or None,
            verify_extra_segments=self.config.verify_extra_segments,
            quarantine=self.config.quarantine,
        ), clock=self.clock, progress=progress, dir_lock=self.dir_lock)
        self.recovery = self.store.report
        # Requests the front ends turn away, by reason (chronoq_requests_refused_total).
        self.refusals = Refusals(self.clock.monotonic_ns)
        # New messages are refused while free space is below the reserve (receives and acks go on).
        self.disk = DiskSpace(self.data_dir, self.config.disk_reserve_bytes, self.config.disk_check_interval_ms,
                              self.clock)
        self.topic_registry = TopicRegistry(self.data_dir, self.config)
        self.topics: dict[str, TopicConfig] = self.topic_registry.topics
        self.topic_registry.load(self.store.queues, self.recovery.notes)
        self.consumer_offsets = ConsumerOffsets(self.data_dir)
        self.consumer_offsets.load()
        self._last_checkpoint_ms = self.clock.wall_ms()
        self._arrival_listeners: list = []
        self._notified_upto = (self.store.dispatched, self.store.released)
        # Delayed delivery: the timer absorbs FLAG_DELAYED records (it drains store.delayed_dispatched
        # after each dispatch: ``on_arrivals``), catches up from its cursor here, and delivers what
        # falls due when ``timer_tick`` runs.
        self.timer = TimerService(self.store, TimerOptions.from_config(self.config), self.clock, self.data_dir,
                                  ensure_delay_topic=self._ensure_delay_topic)
        if self.config.etcd_endpoints:  # in a cluster: recall handles name this broker group
            self.timer.handle_group = self.config.group_name
        self.add_arrival_listener(self.timer.on_arrivals)
        # Retention rolls pending timer messages forward before it deletes their records.
        self.store.add_retention_keeper(lambda lo, hi: roll.keep_batches(self.timer, lo, hi, self.clock.wall_ms()))
        # Message life trace for the delivery audit (chronoq.broker.trace): the hooks only append to a
        # buffer; ``maintenance`` writes it to TRACE_TOPIC every ``trace_flush_ms``.
        self.trace: TraceRecorder | None = None
        if self.config.trace_enabled:
            self.trace = TraceRecorder(self.config.trace_flush_ms, DELAY_TOPIC)
            self.create_topic(TRACE_TOPIC, 1, system=True)
            self.timer.on_visible = self.trace.visible
        self.sender = Sender(self.config, self.clock, self.topic_registry, self.store, self.timer, self.trace)
        # For chronoq.server.metrics: messages accepted from producers per topic (duplicates and system
        # writes not counted), and how long opening took (recovery of the store and the timer).
        self.sent_by_topic: dict[str, int] = self.sender.sent_by_topic
        # What deleted topics had counted (their series leave /metrics: a topic a day, deleted
        # when done, would grow the scrape), so the total sent never shrinks (the console's history).
        self.sent_gone = 0
        # ("recall" | "reschedule", outcome) -> requests answered so (chronoq.server.service_metrics).
        self.recall_outcomes: dict[tuple[str, str], int] = {}
        self.open_duration_ns = self.clock.monotonic_ns() - opened_ns
        self.closed = False

    # ----------------------------------------------------------------- topics (chronoq.broker.topics)
    def create_topic(self, name: str, queues: int | None = None,
                     message_type: MessageType | str = MessageType.MIXED, *, system: bool = False,
                     force: bool = False) -> TopicConfig:
        """Create a topic, or update its queue count (only upwards) and type. Idempotent.

        Changing the type of a user topic that holds messages is refused unless ``force``: its
        producers and consumers were written for the old type, and its messages keep theirs."""
        return self.topic_registry.create(name, queues, message_type, system=system,
                                          held=None if force or system else self.topic_messages)

    def topic_messages(self, name: str) -> int:
        """Messages in the topic's queues (their entries from the oldest retained on)."""
        cfg = self.topics.get(name)
        return topics.messages_in(self.store, cfg) if cfg is not None else 0

    def queue_figures(self, name: str) -> list[tuple[int, int, int, int, int]]:
        """Per queue of topic ``name``: (queue id, min offset, next offset, stored ms of its
        oldest message, of its newest; 0 when none)."""
        return topics.queue_figures(self.store, self.topic(name, create=False))

    def offset_for_time(self, name: str, queue_id: int, at_ms: int) -> int:
        """The first offset of the queue stored at or after ``at_ms`` (``topics.offset_for_time``)."""
        return topics.offset_for_time(self.store, name, queue_id, at_ms)

    def delete_topic(self, name: str) -> int:
        """Remove user topic ``name`` (its queues and files, configuration, every group's offsets
        for it), then checkpoint; returns how many messages its queues held. Everything written
        must be dispatched first (``Store.drop_queues``); the rules and what stays on disk are
        ``chronoq.features.operations``."""
        name = validate.user_topic(name)
        if name not in self.topics:
            raise errors.TopicNotFound(f"topic {name!r} does not exist")
        return self._drop_topic(name)

    def _drop_topic(self, name: str) -> int:
        messages = self.store.drop_queues(name)
        self.sent_gone += self.sent_by_topic.pop(name, 0)
        self.topic_registry.remove(name)
        self.consumer_offsets.drop_topic(name)
        self.consumer_offsets.save_now()
        self.store.checkpoint()
        return messages

    def drop_system_topic(self, name: str) -> int:
        """``delete_topic`` for a system topic a feature owns (a deleted topic's retry topics)."""
        assert model.is_system_topic(name), name
        return self._drop_topic(name) if name in self.topics else 0

    def list_topics(self, include_system: bool = False) -> list[TopicConfig]:
        return self.topic_registry.list(include_system)

    def topic(self, name: str, *, create: bool | None = None) -> TopicConfig:
        return self.topic_registry.get(name, create=create)

    def _send_topic(self, name: object, system: bool,
                    new_topics: dict[str, TopicConfig] | None = None) -> TopicConfig:
        """The topic a message goes to; an auto-create only planned in ``new_topics`` (see
        ``TopicRegistry.send_topic``)."""
        return self.topic_registry.send_topic(name, system, new_topics)

    # ----------------------------------------------------------------- sending (chronoq.broker.sending)
    @property
    def _dedupe(self):
        return self.sender._dedupe

    @_dedupe.setter
    def _dedupe(self, window) -> None:  # tests and benches swap the window
        self.sender._dedupe = window

    def _tag_bytes(self, tag: object) -> bytes:
        return self.sender.tag_bytes(tag)

    def prepare(self, msg: OutgoingMessage, *, system: bool = False, now: int | None = None,
                new_topics: dict[str, TopicConfig] | None = None) -> tuple[Prepared, str]:
        """``prepare_batch`` for one message: its store record and its id."""
        (prepared,), (message_id,), _chosen = self.prepare_batch([msg], system=system, now=now, new_topics=new_topics)
        return prepared, message_id

    def prepare_batch(self, messages: Iterable[OutgoingMessage], *, system: bool = False, now: int | None = None,
                      new_topics: dict[str, TopicConfig] | None = None
                      ) -> tuple[list[Prepared], list[str], list[bool]]:
        """Validate a batch and choose each message's queue (``Sender.prepare_batch``)."""
        return self.sender.prepare_batch(messages, system=system, now=now, new_topics=new_topics)

    def check_duplicate(self, topic: str, message_id: str, body: bytes) -> SendResult | None:
        """The original result if (topic, id) was sent within the window with the same body."""
        return self.sender.check_duplicate(topic, message_id, body)

    def write(self, messages: Iterable[OutgoingMessage], *, system: bool = False) -> list[SendResult]:
        """Validate and append (page cache only); durability and visibility come from ``flush``.
        A whole batch or nothing; exact resends answer the original (``Sender.write``)."""
        return self.sender.write(messages, system=system)

    def write_batch(self, batch: OutgoingBatch, *, system: bool = False, files_ahead=None):
        """``write`` for a batch given as columns, answered as columns (``Sender.write_batch``):
        the one send path, which ``write`` adapts objects to. ``files_ahead``: the committer's
        (a ``WaitingFiles`` may come back, for ``write_waited``)."""
        return self.sender.write_batch(batch, system=system, files_ahead=files_ahead)

    def write_waited(self, waiting) -> Sent:
        """A batch ``write_batch`` handed back to wait for new queues' files, written now."""
        return self.sender.write_waited(waiting)

    def flush(self) -> int:
        """Make everything written durable (per policy) and visible; return the durable offset."""
        synced = self.store.dispatch(self.store.sync())
        self.notify_arrivals()
        return synced

    def durable(self, ticket: int) -> None:
        """The embedded committer's wait: return once the commit log is fsynced to at least
        ``ticket`` and dispatched below it (``GroupCommitter.durable`` without a loop: the fsync
        runs here, on the caller's thread, then dispatch in log order; ``flush``)."""
        if self.store.log.synced < ticket or self.store.dispatched < ticket:
            self.flush()

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

    # recall, reschedule, cancel by key, the tick and the views: chronoq.broker.timing.TimerOperations

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

    # ----------------------------------------------------------------- records (for chronoq.features)
    # The named operations features build on, so they need not reach into the store or the timer.
    def write_records(self, records: list[Prepared]) -> list[Written]:
        """Append records prepared by a feature as they are (system records: no validation, no
        dedupe, no metrics); page cache only, durable and visible with the next ``flush``. Keyed
        timer records enter the key index (cancel by key; a replace key there replaces nothing)."""
        written = self.store.write(records)
        self.timer.index_written(records, [w.commit_offset for w in written])
        return written

    def read_record(self, commit_offset: int, size: int) -> Message:
        """The record of ``size`` bytes at ``commit_offset`` (``errors.NotFound`` when retention
        deleted it, ``errors.CorruptionError`` when it fails its checks)."""
        return self.store.read_at(commit_offset, size)

    def record_properties(self, commit_offset: int) -> dict[str, str]:
        """The properties of the record at ``commit_offset``, its body not read."""
        return self.store.read_properties(commit_offset)

    def queue_entries(self, topic: str, queue_id: int, offset: int,
                      max_entries: int) -> list[tuple[int, int, int, int]]:
        """Raw consume-queue entries (commit offset, size, tag hash, time ms) from ``offset``, those
        whose record is gone included (see ``log_min_offset``); no checks on the arguments."""
        return self.store.entries(topic, queue_id, offset, max_entries)

    def entry_commit_offset(self, topic: str, queue_id: int, offset: int) -> int | None:
        """The commit offset the consume-queue entry ``offset`` names (None: no such entry)."""
        entries = self.store.entries(topic, queue_id, offset, 1)
        return entries[0][0] if entries else None

    def entry_record(self, topic: str, queue_id: int, offset: int) -> Message | None:
        """The record the consume-queue entry ``offset`` names (None: no such entry; errors as
        ``read_record``)."""
        entries = self.store.entries(topic, queue_id, offset, 1)
        return self.store.read_at(entries[0][0], entries[0][1]) if entries else None

    @property
    def log_written(self) -> int:
        """The commit log's end: everything written so far lies below it (a committer ticket)."""
        return self.store.log.written

    def scan_log(self, start: int):
        """``(commit offset, record bytes)`` from ``start`` to the log's end (``Store.scan``): for a
        feature that must find what it wrote after a position it recorded (chronoq.features.schedules)."""
        for offset, _header, raw in self.store.scan(start):
            yield offset, raw

    @property
    def log_min_offset(self) -> int:
        """The first commit offset still in the log (below it, retention deleted the records)."""
        return self.store.log.min_offset

    @property
    def log_end(self) -> int:
        """The commit offset after the last record written (durable once a flush covers it)."""
        return self.store.log.written

    def read_record_runs(self, entries):
        """(index, bytes, position of the record in them) for each record consume-queue
        ``entries`` name, each checked, none copied; those retention deleted are left out."""
        return self.store.read_runs(entries, self.store.log.min_offset)

    def record_stored_ms(self, commit_offset: int) -> int:
        """The stored time of the record at ``commit_offset`` (its header only is read); 0 when
        retention deleted it."""
        if commit_offset < self.store.log.min_offset:
            return 0
        return record.HEADER.unpack(self.store.log.read(commit_offset, record.HEADER_SIZE))[8]

    def log_figures(self) -> tuple[int, int, object]:
        """(bytes in the commit log from the oldest retained segment to the end, segment files,
        its fsync latencies: ``chronoq.store.commitlog.SyncTimes``)."""
        log = self.store.log
        return log.written - log.min_offset, len(log.segments), log.sync_times

    @property
    def commit_log(self):
        """The commit log, read only, for a reader that walks its raw segments
        (``chronoq.features.lookup``'s scan for an id or a key)."""
        return self.store.log

    def add_retention_guard(self, guard) -> None:
        """Register ``guard() -> lowest commit offset still needed`` (None: needs nothing)."""
        self.store.add_retention_guard(guard)

    @property
    def max_delay_ms(self) -> int:
        """How far ahead a delivery time may be (``timer_max_delay_ms``, as the timer applies it)."""
        return self.timer.opts.max_delay_ms

    # ----------------------------------------------------------------- consumer offsets (chronoq.broker.offsets)
    @property
    def offsets(self) -> dict[str, dict[str, dict[int, int]]]:
        return self.consumer_offsets.offsets

    def get_offset(self, group: str, topic: str, queue_id: int) -> int | None:
        return self.consumer_offsets.get(group, topic, queue_id)

    def commit_offset(self, group: str, topic: str, queue_id: int, offset: int) -> None:
        """Record that ``group`` consumed ``topic``/``queue_id`` below ``offset``.

        Durable at the next checkpoint (``checkpoint_interval_ms``) or clean stop.
        """
        self.consumer_offsets.commit(group, topic, queue_id, offset, self.topics.get(topic), self.store.bounds)

    def list_groups(self) -> list[str]:
        return self.consumer_offsets.groups()

    def set_offsets(self, group: str, topic: str, offsets: dict[int, int]) -> None:
        """Set ``group``'s offsets of ``topic`` (queue id -> offset), up or down (an operator's
        reset; ``group`` may be the broker's own, unchecked): all checked, then all set, durable
        before this returns."""
        cfg = self.topics.get(topic)
        if cfg is None:
            raise errors.TopicNotFound(f"topic {topic!r} does not exist")
        for queue_id, offset in offsets.items():
            if not _is_int(queue_id) or not 0 <= queue_id < cfg.queues:
                raise errors.InvalidQueue(f"queue {queue_id!r} does not exist in topic {topic}")
            lo, hi = self.store.bounds(topic, queue_id)
            if not _is_int(offset) or not lo <= offset <= hi:
                raise errors.InvalidOffset(f"offset {offset!r} is outside {lo}..{hi} for {topic}/{queue_id}")
        for queue_id, offset in offsets.items():
            self.consumer_offsets.put(group, topic, queue_id, offset)
        self.consumer_offsets.save_now()

    def drop_group_offsets(self, group: str) -> list[str]:
        """Forget ``group``'s consume offsets (durable before this returns); the topics it had."""
        dropped = self.consumer_offsets.drop_group(group)
        self.consumer_offsets.save_now()
        return dropped

    # ----------------------------------------------------------------- lifecycle
    def checkpoint(self) -> None:
        self.checkpoint_job().run_here()

    def checkpoint_job(self) -> Job:
        """The store checkpoint and consumer offsets, with their fsyncs in ``run`` (any thread;
        ``chronoq.core.jobs``). The offsets written are those of now."""
        store_job = self.store.checkpoint_job()
        consumer_offsets = self.consumer_offsets
        offsets = consumer_offsets.take()
        self._last_checkpoint_ms = self.clock.wall_ms()
        path = consumer_offsets.path

        def run() -> None:
            store_job.run()
            if offsets is not None:
                fsutil.write_json(path, offsets)

        def finish(exc: BaseException | None) -> None:
            store_job.finish(exc)
            if exc is not None and offsets is not None:
                consumer_offsets.write_failed()  # written again at the next checkpoint

        return Job("broker checkpoint", run, finish)

    def maintenance(self) -> None:
        """Periodic work for the shell to call: checkpoint when due and expire dedupe entries."""
        run_all_here(self.maintenance_jobs())

    def maintenance_jobs(self, build_keys: bool = True) -> list[Job]:
        """``maintenance`` for the asyncio shell: the cheap work is done here, the blocking parts
        (checkpoint fsyncs and files) are returned as jobs to run on a worker thread and finish
        back on this one, in order (``chronoq.core.jobs``). Call again only once they all finished.
        ``build_keys=False``: no step of the timer's key index build (the server's runtime runs it
        in short slices, ``TimerService.keys_step``)."""
        now = self.clock.wall_ms()
        jobs = []
        try:
            if now - self._last_checkpoint_ms >= self.config.checkpoint_interval_ms:
                jobs.append(self.checkpoint_job())
            timer_job = self.timer.maintenance_job(now, build_keys)
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
        return self.store.retention(*self._retention_limits())

    def retention_begin(self):
        """``retention``'s first step, a slice at a time (``Store.retention_begin``,
        ``RetentionRoll.step``); the server makes the plan's ticket durable on the committer's
        thread, then ``retention_apply`` (``GroupCommitter.retention``)."""
        return self.store.retention_begin(*self._retention_limits())

    def retention_apply(self, plan, durable: bool = True) -> tuple[list[str], Job | None]:
        return self.store.retention_apply(plan, durable)

    def _retention_limits(self) -> tuple[int | None, int | None]:
        max_age = self.config.retention_max_age_hours * 3600 * 1000 if self.config.retention_max_age_hours else None
        return max_age, self.config.retention_max_bytes or None

    def close(self) -> None:
        if self.closed:
            return
        self.timer.count_released()  # (a burst's copies released, not yet counted: their trace events)
        self.write_trace()
        self.store.dispatch(self.store.sync())
        try:
            self.timer.close()  # its clean checkpoint; without it the next start replays more
        finally:
            self.store.close()
        self.consumer_offsets.save()
        self.closed = True
        self.dir_lock.release()  # only after a clean close: a failed one keeps others out until we exit

    def __enter__(self) -> "Broker":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
