"""Staged publish: rows staged invisibly under (sink id, batch id), then published exactly once.

The Spark sink (``chronoq.spark``) writes a micro-batch in two steps, as the PySpark notes say it
must: every task *stages* its rows (``Stage``), and the driver-side commit *publishes* the
batch (``Publish``). Spark may replay a batch with the same batch id and commit it again; the
broker publishes a (sink id, batch id) at most once, so the pair is exactly-once. Any client
can use the same three calls (``Stage``, ``Publish``, ``Abort`` in ``chronoq.v1.Admin``;
docs/spark.md).

Records, all in the system topic ``STAGE_TOPIC`` (one queue, ``FLAG_SYSTEM``: no consumer ever
sees them). The kind is the ``__OP`` property; ``__SINK`` and ``__BATCH`` name the batch:

=========  ==========================================================================================
stage      one chunk of a stage: ``__STAGE`` (stage id, one per Spark task attempt), ``__SEQ``
           (chunk number from 0), ``__ROWS``, ``__TOPIC``. The body is the chunk's messages,
           validated when staged (message id, queue and delivery time chosen then), in the
           ROW format below.
begin      publishing started: ``__STAGES`` lists the stage ids being published (comma-separated).
chunk      the messages of chunk (``__STAGE``, ``__SEQ``) are published.
published  the whole batch is published (``__ROWS``: how many messages).
aborted    the batch's staged rows were discarded.
=========  ==========================================================================================

Publishing a batch writes, per chunk and in one ``store.write`` call (one append): [begin, for
the first chunk], the chunk's messages, its ``chunk`` marker, [``published``, after the last
chunk]. Markers come after the messages they vouch for, so a crash never leaves a marker without
its messages. The answer waits for one fsync at the end. A restart replays the topic from the
state file's floor; a batch whose ``begin`` is durable but whose ``published`` is not is finished
by the broker itself at start-up, chunk by chunk, skipping chunks with a marker, with the stage
ids ``begin`` named. So a publish interrupted by a crash (``kill -9`` included) is completed, not
repeated: exactly once. A chunk's append is on disk whole or not at all (``record.FLAG_CONTINUES``,
recovery R11: a ``pwrite`` torn by ``kill -9`` leaves no record of it); the narrow exception, a
power loss that keeps later pages of the last write but not earlier ones, is in docs/spark.md.

ROW (little-endian), one per message, back to back in a stage record's body::

    off  size  field
      0     2  flags          commit-log record flags (DELAYED when the timer must schedule it)
      2     2  queue_id
      4     8  born_ms
     12     8  deliver_at_ms  0: immediate
     20     1  msgid_len
     21     2  tag_len
     23     2  keys_len
     25     4  props_len
     29     4  body_len
     33        message id, tag, keys, properties (commit-log encodings), body

Validation mirrors ``Broker.prepare`` for a columnar block (one topic lookup per chunk, no
per-row objects); ``tests/unit/test_staging.py`` checks the two agree. Rows without a message
group go to one queue per chunk, chosen round-robin per topic (sticky, like Kafka's default
partitioner): a queue then holds long runs of a batch's messages, so reads by offset are a few
large reads; a message group keeps its queue (``crc32(group) % queues``).

Why stage ids: a failed Spark task may have staged part of its rows before the retry staged them
all again. The commit names the stages of the successful attempts, and only those are published.
A replayed batch stages new stages; if the first publish had already *begun*, the stages it named
are finished instead and the new ones are dropped.

State file ``staging.json`` (``fsutil.write_json``)::

    {"version": 1, "floor": <queue offset of STAGE_TOPIC replay starts at>,
     "sinks": {<the published batch ids of every sink: chronoq.features.stagesinks>}}

Sinks and their published ids are bounded (``max_stage_sinks``, ``max_stage_published_ids``:
``chronoq.features.stagesinks``). Unpublished stages older than ``stage_ttl_ms`` are discarded. The file is rewritten at most every ``CHECKPOINT_EVERY_MS``: it
only bounds the replay (the markers after its floor are replayed), so an older file is safe.

At most ``max_staged_chunks`` chunks (a ``Chunk`` in memory each, ~190 bytes) are held: a new one
past it is refused (``TooManyRequests``) before any write; resends, publishes and aborts always
work, and chunks restored at start are all kept whatever the limit.

Caveat (as with any idempotent-writer id): a sink id names one sequence of batch ids. A streaming
query started over with a new checkpoint restarts its batch ids at 0, so it must use a new
``sinkId`` (the default sink id is derived from the checkpoint location, so it does).
"""

from __future__ import annotations

import itertools
import logging
import os
import re
import struct
import zlib
from dataclasses import dataclass, field
from typing import Iterator

from chronoq.core import errors, fsutil, model, validate
from chronoq.broker.broker import PROP_MESSAGE_GROUP, PROP_MESSAGE_TYPE, Broker
from chronoq.core.model import MessageType
from chronoq.core.msgid import new_message_id, new_message_ids
from chronoq.features.stagesinks import Sinks
from chronoq.store import record
from chronoq.store.store import Prepared
from chronoq.timer import deliverytime

log = logging.getLogger("chronoq.features.staging")

STAGE_TOPIC = "CHRONOQ_STAGE"
STATE_FILE = "staging.json"
STATE_VERSION = 1
OP_STAGE, OP_BEGIN, OP_CHUNK, OP_PUBLISHED, OP_ABORTED = "stage", "begin", "chunk", "published", "aborted"
PROP_OP, PROP_SINK, PROP_BATCH = "__OP", "__SINK", "__BATCH"
PROP_STAGE, PROP_SEQ, PROP_ROWS, PROP_STAGES, PROP_TOPIC = "__STAGE", "__SEQ", "__ROWS", "__STAGES", "__TOPIC"
SINK_ID_CHARS_MAX = 200
STAGE_ID_RE = re.compile(r"[A-Za-z0-9_-]{1,64}")
CHUNK_ROWS_MAX = 65_536            # messages in one staged chunk
CHUNK_BYTES_MAX = 48 * 1024 * 1024  # encoded size of one chunk (a commit-log record holds 64 MiB)
STAGES_PER_BATCH_MAX = 100_000
CHECKPOINT_EVERY_MS = 5_000   # the state file is rewritten at most this often


@dataclass(slots=True)
class Chunk:
    queue_offset: int
    commit_offset: int
    size: int
    rows: int
    topic: str
    published: bool = False


@dataclass(slots=True)
class Batch:
    """A (sink, batch) with staged rows, not yet published."""

    first_ms: int
    stages: dict[str, dict[int, Chunk]] = field(default_factory=dict)
    begun: list[str] | None = None  # stage ids being published (a durable "begin" exists)


@dataclass(slots=True)
class PublishJob:
    """A publish under way: iterate ``steps()`` (one chunk written per step) to do it."""

    already_published: bool
    messages: int
    _todo: list[tuple[str, int]]
    _sink: str
    _batch: int
    _begin: list[str] | None

    def steps(self, staging: "Staging") -> Iterator[int]:
        yield from staging._run(self)


def check_sink_id(sink_id: object) -> str:
    if not isinstance(sink_id, str) or not sink_id.strip():
        raise errors.ClientError("sink id is missing")
    if len(sink_id) > SINK_ID_CHARS_MAX or not sink_id.isprintable():
        raise errors.ClientError(f"sink id must be printable and at most {SINK_ID_CHARS_MAX} characters")
    return sink_id


def check_batch_id(batch_id: object) -> int:
    if not isinstance(batch_id, int) or isinstance(batch_id, bool) or batch_id < 0:
        raise errors.ClientError(f"batch id must be a non-negative integer, not {batch_id!r}")
    return batch_id


def check_stage_id(stage_id: object) -> str:
    if not isinstance(stage_id, str) or not STAGE_ID_RE.fullmatch(stage_id):
        raise errors.ClientError(f"stage id {stage_id!r} must be 1-64 characters of [A-Za-z0-9_-]")
    return stage_id


ROW = struct.Struct("<HHqqBHHII")
ROW_SIZE = 33
assert ROW.size == ROW_SIZE
_TYPE_DELAY = record.encode_properties({PROP_MESSAGE_TYPE: MessageType.DELAY.name})


@dataclass(slots=True)
class Rows:
    """Columns of the rows of one chunk; ``None``: the column is absent (every row lacks it)."""

    bodies: list[bytes]
    tags: list[str] | None = None
    keys: list[list[str]] | None = None
    properties: list[dict[str, str]] | None = None
    groups: list[str] | None = None          # "": no message group
    deliver_at_ms: list[int] | None = None   # 0: none
    delay_ms: list[int] | None = None        # 0: none (from the moment the row is staged)


def parse_rows(topic: str, blob: bytes) -> list[Prepared]:
    """The messages of a staged chunk body (ROW format). On the publish hot path: one unpack and
    plain slices per row, tuples built directly."""
    out: list[Prepared] = []
    add, new, unpack = out.append, tuple.__new__, ROW.unpack_from
    pos, end = 0, len(blob)
    while pos < end:
        flags, qid, born, deliver, mlen, taglen, klen, plen, blen = unpack(blob, pos)
        a = pos + ROW_SIZE
        b = a + mlen
        c = b + taglen
        d = c + klen
        e = d + plen
        pos = e + blen
        if pos > end:
            raise errors.CorruptionError(STAGE_TOPIC, a - ROW_SIZE, "staged chunk: a row runs past the end")
        add(new(Prepared, (topic, qid, flags, born, deliver, blob[a:b], blob[b:c] if taglen else b"",
                           blob[c:d] if klen else b"", blob[d:e], blob[e:pos])))
    return out


class Staging:
    """Stage / publish / abort over the embedded broker; every method runs on the broker's thread."""

    def __init__(self, broker: Broker):
        self.broker = broker
        self.ttl_ms = broker.config.stage_ttl_ms
        self.max_chunks = broker.config.max_staged_chunks
        self.chunks_held = 0  # chunks of every batch in ``batches``
        broker.create_topic(STAGE_TOPIC, 1, system=True)
        self.batches: dict[tuple[str, int], Batch] = {}
        self.sinks = Sinks(broker.config.max_stage_sinks, broker.config.max_stage_published_ids)
        self._begun = 0  # batches in ``batches`` whose publish began (each adds a published id when done)
        self._turns: dict[str, itertools.count] = {}  # sticky queue choice, per topic
        self._checkpoint_ms = 0
        self._path = os.path.join(broker.data_dir, STATE_FILE)
        self._load()
        if self.chunks_held >= self.max_chunks:
            log.warning("%d staged chunks restored, max_staged_chunks is %d: all kept, new ones refused for now",
                        self.chunks_held, self.max_chunks)
        self.sinks.warn_if_over()
        broker.add_retention_guard(self._retention_floor)
        self._resume()

    # ----------------------------------------------------------------- records
    def _op(self, op: str, sink: str, batch: int, now: int, body: bytes = b"", **extra: str) -> Prepared:
        props = {PROP_OP: op, PROP_SINK: sink, PROP_BATCH: str(batch), **extra}
        return Prepared(STAGE_TOPIC, 0, record.FLAG_SYSTEM, now, 0, f"{op}-{batch}".encode(), b"", b"",
                        record.encode_properties(props), body)

    def _props_at(self, commit_offset: int, size: int) -> dict[str, str]:
        """A stage-topic record's properties, without reading its (possibly large) body."""
        return self.broker.record_properties(commit_offset)

    # ----------------------------------------------------------------- state
    def _load(self) -> None:
        state = fsutil.read_state(self._path, log, "staging state", "replaying the whole stage topic")
        self.sinks.load(state.get("sinks", {}))
        broker = self.broker
        lo, hi = broker.queue_bounds(STAGE_TOPIC, 0)
        offset = max(int(state.get("floor", 0)), lo)
        while offset < hi:
            entries = broker.queue_entries(STAGE_TOPIC, 0, offset, min(4096, hi - offset))
            if not entries:
                break
            for i, (phys, size, _tag_hash, stored_ms) in enumerate(entries):
                if size == 0 or phys < broker.log_min_offset:
                    continue
                try:
                    props = self._props_at(phys, size)
                except errors.ChronoqError as exc:
                    log.error("stage record at %d unreadable, skipped: %s", phys, exc)
                    continue
                self._apply(props, Chunk(offset + i, phys, size, int(props.get(PROP_ROWS, 0) or 0),
                                         props.get(PROP_TOPIC, "")), stored_ms)
            offset += len(entries)

    def _apply(self, props: dict[str, str], chunk: Chunk, stored_ms: int) -> None:
        """Replay one stage-topic record into the in-memory state."""
        op, sink = props.get(PROP_OP), props.get(PROP_SINK, "")
        try:
            batch = int(props.get(PROP_BATCH, "-1"))
        except ValueError:
            return
        key = (sink, batch)
        state = self.sinks.get(sink)
        if op == OP_PUBLISHED:
            self._mark_published(sink, batch, stored_ms)
            return
        if state is not None and state.has(batch):
            return
        b = self.batches.get(key)
        if op == OP_STAGE:
            if b is None:
                b = self.batches[key] = Batch(stored_ms)
            chunks, seq = b.stages.setdefault(props.get(PROP_STAGE, ""), {}), int(props.get(PROP_SEQ, 0))
            if seq not in chunks:
                chunks[seq] = chunk
                self.chunks_held += 1
        elif op == OP_BEGIN and b is not None:
            self._begin(b, [s for s in props.get(PROP_STAGES, "").split(",") if s])
        elif op == OP_CHUNK and b is not None:
            c = b.stages.get(props.get(PROP_STAGE, ""), {}).get(int(props.get(PROP_SEQ, -1)))
            if c is not None:
                c.published = True
        elif op == OP_ABORTED and b is not None and b.begun is None:
            self._forget(key)

    def _mark_published(self, sink: str, batch: int, now: int) -> None:
        # Other unpublished batches of the sink stay: a batch write publishes its partitions in any
        # order. Leftovers of failed attempts go with Abort or stage_ttl_ms.
        self.sinks.add(sink, batch, now)
        self._forget((sink, batch))

    def _begin(self, b: Batch, stage_ids: list[str]) -> None:
        if b.begun is None:
            self._begun += 1
        b.begun = stage_ids

    def _forget(self, key: tuple[str, int]) -> Batch | None:  # (published, aborted, expired)
        b = self.batches.pop(key, None)
        if b is not None:
            self.chunks_held -= sum(map(len, b.stages.values()))
            self._begun -= b.begun is not None
            assert self.chunks_held >= 0 and self._begun >= 0, (self.chunks_held, self._begun)
        return b

    def checkpoint(self, force: bool = False) -> None:
        """Persist the replay floor and the published batch ids (after a publish is durable), at
        most every CHECKPOINT_EVERY_MS unless ``force``."""
        now = self.broker.clock.wall_ms()
        if not force and now - self._checkpoint_ms < CHECKPOINT_EVERY_MS:
            return
        self._checkpoint_ms = now
        self.sinks.forget_idle(now)
        floor = min((c.queue_offset for b in self.batches.values() for st in b.stages.values() for c in st.values()),
                    default=self.broker.queue_bounds(STAGE_TOPIC, 0)[1])
        fsutil.write_json(self._path, {
            "version": STATE_VERSION, "floor": floor,
            "sinks": self.sinks.to_state()})

    def _retention_floor(self) -> int | None:
        return min((c.commit_offset for b in self.batches.values() for st in b.stages.values()
                    for c in st.values() if not c.published), default=None)

    def sweep(self, now_ms: int | None = None) -> int:
        """Discard staged batches older than ``stage_ttl_ms`` that never began publishing."""
        now = self.broker.clock.wall_ms() if now_ms is None else now_ms
        old = [k for k, b in self.batches.items() if b.begun is None and now - b.first_ms > self.ttl_ms]
        for key in old:
            log.info("discarding staged batch %s/%d: not published within stage_ttl_ms", *key)
            self._forget(key)
        return len(old)

    def _resume(self) -> None:
        """Finish publishes a crash interrupted (a durable "begin" without "published")."""
        for (sink, batch), b in list(self.batches.items()):
            if b.begun is not None:
                job = self.publish(sink, batch, [])
                log.warning("finishing the interrupted publish of %s/%d (%d messages)", sink, batch, job.messages)
                for _ in job.steps(self):
                    pass

    # ----------------------------------------------------------------- API
    def is_published(self, sink_id: str, batch_id: int) -> bool:
        return self.sinks.has(sink_id, batch_id)

    def stage(self, sink_id: str, batch_id: int, stage_id: str, seq: int, topic: str, rows: Rows) -> int:
        """Validate ``rows`` for ``topic`` and stage them as chunk ``seq`` of ``stage_id`` (page
        cache; the caller makes it durable). A bad row fails the chunk and stages nothing.
        Idempotent per (stage id, seq). Returns the row count."""
        sink_id, batch_id, stage_id = check_sink_id(sink_id), check_batch_id(batch_id), check_stage_id(stage_id)
        if not isinstance(seq, int) or not 0 <= seq < 1_000_000:
            raise errors.ClientError(f"chunk number must be in 0..999999, not {seq!r}")
        n = len(rows.bodies)
        if not 1 <= n <= CHUNK_ROWS_MAX:
            raise errors.ClientError(f"a chunk holds 1..{CHUNK_ROWS_MAX} rows, not {n}")
        key = (sink_id, batch_id)
        b = self.batches.get(key)
        if self.is_published(sink_id, batch_id) or (b is not None and b.begun is not None):
            return n  # a straggler of a batch already published (or being published): dropped
        if b is not None and seq in b.stages.get(stage_id, {}):
            return b.stages[stage_id][seq].rows  # a resent chunk
        if b is not None and stage_id not in b.stages and len(b.stages) >= STAGES_PER_BATCH_MAX:
            raise errors.ClientError(f"batch {batch_id} of sink {sink_id} has {STAGES_PER_BATCH_MAX} stages already")
        if self.chunks_held >= self.max_chunks:
            raise errors.TooManyRequests(
                f"{self.chunks_held} staged chunks are held (neither published nor aborted), the limit is "
                f"max_staged_chunks ({self.max_chunks}); publish or abort staged batches and stage again "
                "later, or raise max_staged_chunks")
        check_space = getattr(self.broker, "check_space", None)
        if check_space is not None:  # new data is refused while the disk is below its reserve;
            check_space()            # publishing staged rows later may use the reserve
        now = self.broker.clock.wall_ms()
        new_topics: dict = {}
        cfg = self.broker._send_topic(topic, False, new_topics)  # validates; plans an auto-create
        body = self._encode_rows(cfg, rows, now)
        for name in new_topics:  # every row is valid: create the topic
            self.broker.topic(name, create=True)
        rec = self._op(OP_STAGE, sink_id, batch_id, now, body, **{
            PROP_STAGE: stage_id, PROP_SEQ: str(seq), PROP_ROWS: str(n), PROP_TOPIC: cfg.name})
        w = self.broker.write_records([rec])[0]
        if b is None:
            b = self.batches[key] = Batch(now)
        b.stages.setdefault(stage_id, {})[seq] = Chunk(w.queue_offset, w.commit_offset, w.size, n, cfg.name)
        self.chunks_held += 1
        return n

    def _encode_rows(self, cfg: model.TopicConfig, rows: Rows, now: int) -> bytes:
        """ROW-encoded rows, validated as ``Broker.prepare`` validates a message (same errors)."""
        turn = self._turns.get(cfg.name)
        if turn is None:
            turn = self._turns[cfg.name] = itertools.count()
        sticky_queue = next(turn) % cfg.queues
        if rows.tags is None and rows.keys is None and rows.properties is None and rows.groups is None:
            plain = self._encode_plain(cfg, rows, now, sticky_queue)
            if plain is not None:
                return plain
        parts: list[bytes] = []
        size = 0
        for i, body in enumerate(rows.bodies):
            try:
                row = self._encode_row(i, body, rows, cfg, now, sticky_queue)
            except errors.ClientError as exc:  # say which row is refused
                raise validate.naming(exc, f"row {i}") from None
            parts.extend(row)
            size += ROW_SIZE + sum(map(len, row[1:]))
            if size > CHUNK_BYTES_MAX:
                raise errors.ClientError(f"a staged chunk may hold at most {CHUNK_BYTES_MAX} bytes; send fewer rows")
        return b"".join(parts)

    def _encode_row(self, i: int, body: bytes, rows: Rows, cfg: model.TopicConfig, now: int,
                    sticky_queue: int) -> tuple[bytes, ...]:
        """Row ``i`` as its ROW header and fields, checked by ``chronoq.core.validate`` as
        ``Broker.prepare`` checks a message (same rules, same errors)."""
        broker = self.broker
        body = validate.body(body, broker.config.max_body_bytes)
        deliver, delay = rows.deliver_at_ms, rows.delay_ms
        at = deliver[i] if deliver is not None else 0
        wait = delay[i] if delay is not None else 0
        if at or wait:
            if at < 0 or wait < 0:
                raise errors.InvalidDeliveryTime("deliver_at_ms and delay_ms may not be negative")
            if at and wait:
                raise errors.InvalidDeliveryTime("give deliver_at_ms or delay_ms, not both")
            at = deliverytime.check_deliver_at(at or now + wait, now, broker.max_delay_ms)
        group = rows.groups[i] if rows.groups is not None else ""
        if group:
            group = validate.message_group(group)
        mtype = MessageType.FIFO if group else MessageType.DELAY if at else MessageType.NORMAL
        if cfg.message_type is not MessageType.MIXED and cfg.message_type is not mtype:
            raise errors.MessageTypeMismatch(
                f"topic {cfg.name} accepts {cfg.message_type.name} messages, not {mtype.name}")
        tags, keys = rows.tags, rows.keys
        tag = broker._tag_bytes(tags[i]) if tags is not None and tags[i] else b""
        key_raw = record.encode_keys(validate.keys(keys[i])) if keys is not None and keys[i] else b""
        user = rows.properties[i] if rows.properties is not None else None
        if user or group:
            props = validate.properties(user) if user else {}
            if group:
                props[PROP_MESSAGE_GROUP] = group
            if mtype is not MessageType.NORMAL:
                props[PROP_MESSAGE_TYPE] = mtype.name
            prop_raw = record.encode_properties(props)
        else:
            prop_raw = _TYPE_DELAY if at else b""
        queue = zlib.crc32(group.encode()) % cfg.queues if group else sticky_queue
        mid = new_message_id(now).encode()
        flags = record.FLAG_DELAYED if at > now else 0
        return (ROW.pack(flags, queue, now, at, len(mid), len(tag), len(key_raw), len(prop_raw), len(body)),
                mid, tag, key_raw, prop_raw, body)

    def _encode_plain(self, cfg: model.TopicConfig, rows: Rows, now: int, queue: int) -> bytes | None:
        """``_encode_rows`` for the bulk case: bodies and delivery times only (no tag, keys,
        properties or group column). The checks run once per chunk over whole columns; None when
        any row fails one (the caller's row-by-row loop then names the row and the error), so
        both paths accept and encode exactly the same rows (``tests/unit/test_staging.py``)."""
        bodies, n = rows.bodies, len(rows.bodies)
        if not all(bodies) or max(map(len, bodies)) > self.broker.config.max_body_bytes \
                or not set(map(type, bodies)) <= {bytes}:
            return None  # (validate.body's rules, in bulk)
        deliver, delay = rows.deliver_at_ms, rows.delay_ms
        if deliver is not None and delay is not None:
            return None  # both columns: the row loop decides row by row
        times = deliver if deliver is not None else delay
        if times is not None:
            if not set(map(type, times)) <= {int} or min(times) < 0:
                return None
            ahead_max = max(times) - (now if times is deliver else 0)
            if ahead_max > self.broker.max_delay_ms:
                return None
            floor = deliverytime.past_floor(now, self.broker.max_delay_ms)
            if times is deliver and any(0 < t < floor for t in times):
                return None  # not a plausible time (0 is none): the row loop names it
            if times is delay:  # deliver this long after staging
                times = [now + t if t else 0 for t in times]
        else:
            times = [0] * n
        if cfg.message_type is not MessageType.MIXED:
            kinds = {MessageType.DELAY if t else MessageType.NORMAL for t in times}
            if kinds != {cfg.message_type}:
                return None
        ids = new_message_ids(now, n)
        delayed_rows = n - times.count(0)
        size = (n * ROW_SIZE + sum(map(len, bodies)) + sum(map(len, ids))
                + len(_TYPE_DELAY) * delayed_rows)
        if size > CHUNK_BYTES_MAX:
            return None
        pack, delayed, type_delay = ROW.pack, record.FLAG_DELAYED, _TYPE_DELAY
        parts: list[bytes] = []
        add = parts.extend
        for mid, body, at in zip(ids, bodies, times):
            props = type_delay if at else b""
            add((pack(delayed if at > now else 0, queue, now, at, len(mid), 0, 0, len(props), len(body)),
                 mid, props, body))
        out = b"".join(parts)
        assert len(out) == size
        return out

    def publish(self, sink_id: str, batch_id: int, refs: list[tuple[str, int, int]]) -> PublishJob:
        """Plan the publish of a batch from the stages ``refs`` names: ``(stage id, chunks, rows)``.

        Already published: a job with ``already_published`` and nothing to do. A publish that
        began before (then crashed) continues with the stages it began with, whatever ``refs``
        says. Raises ``ClientError`` if a named stage is missing chunks (the rows were lost, e.g.
        discarded by ``stage_ttl_ms``): the batch must be written again.
        """
        sink_id, batch_id = check_sink_id(sink_id), check_batch_id(batch_id)
        if self.is_published(sink_id, batch_id):
            return PublishJob(True, 0, [], sink_id, batch_id, None)
        b = self.batches.get((sink_id, batch_id))
        begin = None
        if b is not None and b.begun is not None:
            stage_ids = b.begun
        else:
            seen = set()
            for stage_id, chunks, rows in refs:
                check_stage_id(stage_id)
                if stage_id in seen:
                    raise errors.ClientError(f"stage {stage_id} is named twice")
                seen.add(stage_id)
                have = b.stages.get(stage_id, {}) if b is not None else {}
                # len() first: a hostile chunk count (2**31) must not build a list that large.
                if len(have) != chunks or sorted(have) != list(range(chunks)) \
                        or sum(c.rows for c in have.values()) != rows:
                    raise errors.ClientError(
                        f"stage {stage_id} of batch {batch_id} (sink {sink_id}) is incomplete on the broker: "
                        f"{len(have)} of {chunks} chunks, {sum(c.rows for c in have.values())} of {rows} rows "
                        "(discarded or lost); write the batch again")
            stage_ids = begin = [r[0] for r in refs]
            # A new publish may add a sink and a published id: refused past their limits, before
            # any write (one that began before is finished whatever the limits).
            self.sinks.admit(sink_id, batch_id, self.broker.clock.wall_ms(), self._begun)
        todo = [(sid, seq) for sid in stage_ids for seq in sorted(b.stages.get(sid, {}) if b is not None else {})
                if not b.stages[sid][seq].published]  # type: ignore[union-attr]
        messages = sum(b.stages[sid][seq].rows for sid, seq in todo) if b is not None else 0
        return PublishJob(False, messages, todo, sink_id, batch_id, begin)

    def _run(self, job: PublishJob) -> Iterator[int]:
        """Write the job's chunks, one ``store.write`` (append) per chunk, yielding after each."""
        if job.already_published:
            return
        broker = self.broker
        sink, batch = job._sink, job._batch
        key = (sink, batch)
        total = job.messages
        if not job._todo:
            now = broker.clock.wall_ms()
            broker.write_records([self._op(OP_PUBLISHED, sink, batch, now, **{PROP_ROWS: str(total)})])
            self._mark_published(sink, batch, now)
            return
        begin = job._begin
        for i, (stage_id, seq) in enumerate(job._todo):
            b = self.batches[key]
            c = b.stages[stage_id][seq]
            now = broker.clock.wall_ms()
            recs: list[Prepared] = []
            if begin is not None:
                recs.append(self._op(OP_BEGIN, sink, batch, now, **{PROP_STAGES: ",".join(begin)}))
            stored = broker.read_record(c.commit_offset, c.size)
            messages = parse_rows(c.topic, stored.body)
            recs.extend(messages)
            recs.append(self._op(OP_CHUNK, sink, batch, now, **{PROP_STAGE: stage_id, PROP_SEQ: str(seq)}))
            last = i == len(job._todo) - 1
            if last:
                recs.append(self._op(OP_PUBLISHED, sink, batch, now, **{PROP_ROWS: str(total)}))
            broker.write_records(recs)
            if begin is not None:
                self._begin(b, begin)
                begin = None
            c.published = True
            sent = broker.sent_by_topic  # chronoq.server.metrics: published rows are sends
            sent[c.topic] = sent.get(c.topic, 0) + len(messages)
            if broker.trace is not None:
                broker.trace.stored(messages, now)
            if last:
                self._mark_published(sink, batch, now)
            yield len(messages)

    def abort(self, sink_id: str, batch_id: int) -> int:
        """Discard a batch's staged rows (``batch_id`` -1: every unpublished batch of the sink);
        nothing once a batch is published or being published. Returns how many rows were discarded."""
        sink_id = check_sink_id(sink_id)
        if batch_id != -1:
            check_batch_id(batch_id)
        keys = [k for k, b in self.batches.items()
                if k[0] == sink_id and (batch_id == -1 or k[1] == batch_id) and b.begun is None]
        rows = 0
        now = self.broker.clock.wall_ms()
        for key in keys:
            b = self._forget(key)
            assert b is not None
            rows += sum(c.rows for st in b.stages.values() for c in st.values())
            self.broker.write_records([self._op(OP_ABORTED, sink_id, key[1], now)])
        return rows
