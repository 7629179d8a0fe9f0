"""The data-pipeline RPCs of ``chronoq.v1.Admin``: read by offset, offset bounds, staged publish, trace.

``AdminService`` inherits them from ``PipelineRpcs`` (this keeps admin.py about topics and
groups). What they serve is in docs/spark.md; the message formats in chronoq_admin.proto.

- ``QueueOffsets``/``ReadMessages`` read any existing topic (system topics included: the audit
  reads ``CHRONOQ_TRACE``) by queue and offset, without consumer groups or acks. A read answers
  columns (``MessageColumns``): one concatenated ``bytes`` field per string column, so the Spark
  source builds Arrow arrays from a response without a Python loop per message. How many
  messages a read returns is decided from the consume-queue entry sizes before any record is
  read, so ``max_bytes`` bounds the work, not just the answer. For a delayed message's visible
  copy, ``stored_ms`` is looked up from the record the timer delivered it from (one 60-byte read).
- ``Stage``/``Publish``/``Abort`` are ``chronoq.staging``. ``Stage`` and ``Publish`` answer once
  what they wrote is durable: the fsync runs in a worker thread (the event loop keeps serving),
  then the records are dispatched, exactly as the group committer does. ``Publish`` writes one
  chunk per event-loop pass, so a publish of a million rows does not stall other clients, and
  publishes of one (sink, batch) are serialized.
- ``FlushTrace`` writes the trace buffer and makes it durable and readable.

Errors become the response's status at one boundary per RPC, as in admin.py.
"""

from __future__ import annotations

import asyncio

from chronoq import errors, model
from chronoq.broker import OutgoingMessage
from chronoq.proto import chronoq_admin_pb2 as apb
from chronoq.server import status
from chronoq.staging import CHUNK_ROWS_MAX, Staging
from chronoq.store import record
from chronoq.timer import copies
from chronoq.timer.levels import DELAY_TOPIC

READ_MAX_MESSAGES = 10_000
READ_DEFAULT_MESSAGES = 1000
READ_DEFAULT_BYTES = 4 * 1024 * 1024
PROP_GROUP = "__GROUP"
_SYSTEM_PREFIX = model.SYSTEM_PROPERTY_PREFIX
_HEADER = record.HEADER


def _ok() -> apb.Status:
    return apb.Status(code=status.OK, message="OK")


def _failed(response_type, what: str, exc: Exception):
    code, message = status.code_and_message(exc, what)
    return response_type(status=apb.Status(code=code, message=message))


# ---------------------------------------------------------------------------- columns
def _split(blob: bytes, lengths, n: int, what: str) -> list[bytes] | None:
    """Cut a concatenated column into its values; None when the column is absent."""
    if not lengths:
        if blob:
            raise errors.ClientError(f"{what}: bytes given without lengths")
        return None
    if len(lengths) != n:
        raise errors.ClientError(f"{what}: {len(lengths)} lengths for {n} rows")
    out = []
    pos = 0
    for length in lengths:
        if length < 0:
            raise errors.ClientError(f"{what}: negative length")
        out.append(blob[pos:pos + length])
        pos += length
    if pos != len(blob):
        raise errors.ClientError(f"{what}: lengths add up to {pos} bytes, the column has {len(blob)}")
    return out


def _texts(values: list[bytes] | None, what: str) -> list[str] | None:
    if values is None:
        return None
    try:
        return [v.decode() for v in values]
    except UnicodeDecodeError:
        raise errors.ClientError(f"{what} must be UTF-8") from None


def _lists(counts, items: list[str] | None, n: int, what: str) -> list[list[str]] | None:
    if not counts:
        if items:
            raise errors.ClientError(f"{what}: items given without counts")
        return None
    if len(counts) != n or any(c < 0 for c in counts) or sum(counts) != len(items or ()):
        raise errors.ClientError(f"{what}: counts do not match the items")
    out, pos = [], 0
    for c in counts:
        out.append(items[pos:pos + c])  # type: ignore[index]
        pos += c
    return out


def _ints(values, n: int, what: str) -> list[int] | None:
    if not values:
        return None
    if len(values) != n:
        raise errors.ClientError(f"{what}: {len(values)} values for {n} rows")
    return list(values)


def rows_to_messages(topic: str, rows: apb.RowColumns, now_ms: int) -> list[OutgoingMessage]:
    """The messages a ``RowColumns`` block describes (checked for shape; the broker validates)."""
    n = rows.count
    if not 1 <= n <= CHUNK_ROWS_MAX:
        raise errors.ClientError(f"a chunk holds 1..{CHUNK_ROWS_MAX} rows, not {n}")
    bodies = _split(rows.bodies, rows.body_lengths, n, "bodies")
    if bodies is None:
        raise errors.ClientError("rows need a body")
    tags = _texts(_split(rows.tags, rows.tag_lengths, n, "tags"), "tags")
    groups = _texts(_split(rows.message_groups, rows.message_group_lengths, n, "message groups"),
                    "message groups")
    key_items = _texts(_split(rows.keys, rows.key_lengths, len(rows.key_lengths), "keys"), "keys")
    keys = _lists(rows.key_counts, key_items, n, "keys")
    pkeys = _texts(_split(rows.property_keys, rows.property_key_lengths, len(rows.property_key_lengths),
                          "property keys"), "property keys")
    pvalues = _texts(_split(rows.property_values, rows.property_value_lengths,
                            len(rows.property_value_lengths), "property values"), "property values")
    if len(pkeys or ()) != len(pvalues or ()):
        raise errors.ClientError("properties: as many keys as values are needed")
    pk = _lists(rows.property_counts, pkeys, n, "properties")
    pv = _lists(rows.property_counts, pvalues, n, "properties")
    deliver = _ints(rows.deliver_at_ms, n, "deliver_at_ms")
    delay = _ints(rows.delay_ms, n, "delay_ms")
    out = []
    for i in range(n):
        at = deliver[i] if deliver is not None else 0
        wait = delay[i] if delay is not None else 0
        if at < 0 or wait < 0:
            raise errors.InvalidDeliveryTime(f"row {i}: deliver_at_ms and delay_ms may not be negative")
        if at and wait:
            raise errors.InvalidDeliveryTime(f"row {i}: give deliver_at_ms or delay_ms, not both")
        props = dict(zip(pk[i], pv[i])) if pk is not None and pk[i] else {}  # type: ignore[index]
        if pk is not None and len(props) != len(pk[i]):
            raise errors.InvalidProperty(f"row {i}: a property key is repeated")
        out.append(OutgoingMessage(
            topic, bodies[i], tag=tags[i] if tags else "", keys=keys[i] if keys else (), properties=props,
            message_group=(groups[i] or None) if groups else None,
            deliver_at_ms=at if at else (now_ms + wait if wait else None)))
    return out


class _ColumnBuilder:
    """``MessageColumns`` for stored messages (user properties only; message group apart)."""

    def __init__(self, broker) -> None:
        self.broker = broker
        self.offsets: list[int] = []
        self.ids: list[bytes] = []
        self.tags: list[bytes] = []
        self.groups: list[bytes] = []
        self.bodies: list[bytes] = []
        self.key_counts: list[int] = []
        self.keys: list[bytes] = []
        self.prop_counts: list[int] = []
        self.prop_keys: list[bytes] = []
        self.prop_values: list[bytes] = []
        self.born: list[int] = []
        self.stored: list[int] = []
        self.deliver: list[int] = []
        self.visible: list[int] = []

    def add(self, m) -> None:
        self.offsets.append(m.queue_offset)
        self.ids.append(m.message_id.encode())
        self.tags.append(m.tag.encode())
        self.bodies.append(m.body)
        self.key_counts.append(len(m.keys))
        self.keys.extend(k.encode() for k in m.keys)
        stored = m.stored_ms
        group = b""
        count = 0
        for k, v in m.properties.items():
            if k.startswith(_SYSTEM_PREFIX):
                if k == PROP_GROUP:
                    group = v.encode()
                elif k == copies.PROP_TIMER_REF or k == copies.PROP_DELAY_REF:
                    stored = self._original_stored(k, v)
                continue
            self.prop_keys.append(k.encode())
            self.prop_values.append(v.encode())
            count += 1
        self.prop_counts.append(count)
        self.groups.append(group)
        self.born.append(m.born_ms)
        self.stored.append(stored)
        self.deliver.append(m.deliver_at_ms)
        self.visible.append(m.stored_ms)

    def _original_stored(self, key: str, ref: str) -> int:
        """When the broker accepted a delayed message, from the record its copy was delivered from."""
        store = self.broker.store
        try:
            if key == copies.PROP_TIMER_REF:
                _start, phys = copies.parse_ref(ref)
                if phys < store.log.min_offset:
                    return 0
                return _HEADER.unpack(store.log.read(phys, record.HEADER_SIZE))[8]
            level, qoff = copies.parse_ref(ref)
            entries = store.entries(DELAY_TOPIC, level - 1, qoff, 1)
            return entries[0][3] if entries else 0
        except (ValueError, errors.ChronoqError):
            return 0

    def build(self) -> apb.MessageColumns:
        lens = [len(b) for b in self.bodies]
        return apb.MessageColumns(
            count=len(self.offsets), offsets=self.offsets,
            message_ids=b"".join(self.ids), message_id_lengths=[len(x) for x in self.ids],
            tags=b"".join(self.tags), tag_lengths=[len(x) for x in self.tags] if any(self.tags) else [],
            key_counts=self.key_counts if self.keys else [], keys=b"".join(self.keys),
            key_lengths=[len(x) for x in self.keys],
            property_counts=self.prop_counts if self.prop_keys else [],
            property_keys=b"".join(self.prop_keys), property_key_lengths=[len(x) for x in self.prop_keys],
            property_values=b"".join(self.prop_values), property_value_lengths=[len(x) for x in self.prop_values],
            message_groups=b"".join(self.groups),
            message_group_lengths=[len(x) for x in self.groups] if any(self.groups) else [],
            bodies=b"".join(self.bodies), body_lengths=lens,
            born_ms=self.born, stored_ms=self.stored, deliver_at_ms=self.deliver, visible_ms=self.visible)


class PipelineRpcs:
    """Mixin for ``AdminService`` (needs ``self.broker`` and ``self._check_open``)."""

    broker: object
    _staging: Staging | None = None
    _publishing: dict | None = None

    def start_pipeline(self) -> None:
        """Open the staging state at server start (replays it, finishes interrupted publishes)."""
        self._staging = Staging(self.broker)  # type: ignore[arg-type]
        self._publishing = {}

    def _pipeline(self) -> Staging:
        self._check_open()  # type: ignore[attr-defined]
        if self._staging is None:
            self.start_pipeline()
        return self._staging  # type: ignore[return-value]

    async def _durable(self) -> None:
        """fsync in a worker thread, then dispatch: what was written is durable and visible."""
        broker = self.broker
        store = broker.store  # type: ignore[attr-defined]
        synced = await asyncio.get_running_loop().run_in_executor(None, store.sync)
        store.dispatch(synced)
        broker.notify_arrivals()  # type: ignore[attr-defined]

    # ------------------------------------------------------------------ reading
    def _topic(self, name: str) -> model.TopicConfig:
        self._check_open()  # type: ignore[attr-defined]
        cfg = self.broker.topics.get(model.validate_topic_name(name))  # type: ignore[attr-defined]
        if cfg is None:
            raise errors.TopicNotFound(f"topic {name!r} does not exist")
        return cfg

    async def QueueOffsets(self, request, context):
        try:
            cfg = self._topic(request.topic)
            bounds = self.broker.queue_bounds  # type: ignore[attr-defined]
            return apb.QueueOffsetsResponse(status=_ok(), queues=[
                apb.QueueRange(queue=q, min_offset=lo, next_offset=hi)
                for q in range(cfg.queues) for lo, hi in (bounds(cfg.name, q),)])
        except Exception as exc:  # noqa: BLE001 - the boundary
            return _failed(apb.QueueOffsetsResponse, "QueueOffsets", exc)

    async def ReadMessages(self, request, context):
        try:
            return self._read_messages(request)
        except Exception as exc:  # noqa: BLE001 - the boundary
            return _failed(apb.ReadMessagesResponse, "ReadMessages", exc)

    def _read_messages(self, request) -> apb.ReadMessagesResponse:
        cfg = self._topic(request.topic)
        broker = self.broker
        queue = request.queue
        if not 0 <= queue < cfg.queues:
            raise errors.InvalidQueue(f"queue {queue} does not exist in topic {cfg.name} (queues 0..{cfg.queues - 1})")
        if request.offset < 0:
            raise errors.InvalidOffset(f"offset must be a non-negative integer, not {request.offset}")
        max_messages = request.max_messages or READ_DEFAULT_MESSAGES
        if not 1 <= max_messages <= READ_MAX_MESSAGES:
            raise errors.ClientError(f"max_messages must be between 1 and {READ_MAX_MESSAGES}")
        if request.max_bytes < 0:
            raise errors.ClientError("max_bytes may not be negative")
        max_bytes = request.max_bytes or READ_DEFAULT_BYTES
        lo, hi = broker.queue_bounds(cfg.name, queue)  # type: ignore[attr-defined]
        offset = max(request.offset, lo)
        # Bound the read by the entries' record sizes first (a record is a little more than its body).
        want, size = 0, 0
        for _phys, length, _tag, _time in broker.store.entries(  # type: ignore[attr-defined]
                cfg.name, queue, offset, min(max_messages, max(hi - offset, 0))):
            if want and size + length > max_bytes:
                break
            size += length
            want += 1
        builder = _ColumnBuilder(broker)
        next_offset = offset
        if want:
            res = broker.read(cfg.name, queue, offset, want)  # type: ignore[attr-defined]
            for m in res.messages:
                builder.add(m)
            next_offset = res.next_offset
        return apb.ReadMessagesResponse(status=_ok(), messages=builder.build(), next_offset=next_offset,
                                        min_offset=lo, max_offset=hi)

    # ------------------------------------------------------------------ staged publish
    async def Stage(self, request, context):
        try:
            staging = self._pipeline()
            messages = rows_to_messages(request.topic, request.rows, self.broker.clock.wall_ms())  # type: ignore
            rows = staging.stage(request.sink_id, request.batch_id, request.stage_id, request.seq, messages)
            if staging.sweep():
                staging.checkpoint()
            await self._durable()
            return apb.StageResponse(status=_ok(), rows=rows)
        except Exception as exc:  # noqa: BLE001 - the boundary
            return _failed(apb.StageResponse, "Stage", exc)

    async def Publish(self, request, context):
        try:
            staging = self._pipeline()
            key = (request.sink_id, request.batch_id)
            publishing = self._publishing
            assert publishing is not None
            while key in publishing:  # one publish of a batch at a time; the next one sees its result
                await asyncio.shield(publishing[key])
            done = asyncio.get_running_loop().create_future()
            publishing[key] = done
            try:
                job = staging.publish(request.sink_id, request.batch_id,
                                      [(s.stage_id, s.chunks, s.rows) for s in request.stages])
                for _ in job.steps(staging):  # the first chunk is written before any await
                    await asyncio.sleep(0)
                await self._durable()
                if not job.already_published:
                    staging.checkpoint()
            finally:
                del publishing[key]
                done.set_result(None)
            return apb.PublishResponse(status=_ok(), already_published=job.already_published, messages=job.messages)
        except Exception as exc:  # noqa: BLE001 - the boundary
            return _failed(apb.PublishResponse, "Publish", exc)

    async def Abort(self, request, context):
        try:
            staging = self._pipeline()
            if (request.sink_id, request.batch_id) in (self._publishing or {}):
                return apb.AbortResponse(status=_ok(), discarded_rows=0)
            return apb.AbortResponse(status=_ok(), discarded_rows=staging.abort(request.sink_id, request.batch_id))
        except Exception as exc:  # noqa: BLE001 - the boundary
            return _failed(apb.AbortResponse, "Abort", exc)

    # ------------------------------------------------------------------ trace
    async def FlushTrace(self, request, context):
        try:
            self._check_open()  # type: ignore[attr-defined]
            broker = self.broker
            trace = broker.trace  # type: ignore[attr-defined]
            if trace is None:
                return apb.FlushTraceResponse(status=_ok(), enabled=False)
            events = broker.write_trace()  # type: ignore[attr-defined]
            await self._durable()
            return apb.FlushTraceResponse(status=_ok(), enabled=True, events=events, dropped=trace.dropped)
        except Exception as exc:  # noqa: BLE001 - the boundary
            return _failed(apb.FlushTraceResponse, "FlushTrace", exc)
