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
- ``Stage``/``Publish``/``Abort`` are ``chronoq.features.staging``. ``Stage`` and ``Publish`` answer once
  what they wrote is durable: they await the committer's ticket for the log's end (its fsync thread fsyncs, then
  the records are dispatched in log order). ``Publish`` writes one
  chunk per event-loop pass, so a publish of a million rows does not stall other clients, and
  publishes of one (sink, batch) are serialized.
- ``FlushTrace`` writes the trace buffer and makes it durable and readable.

Errors become the response's status at one boundary per RPC, as in admin.py.
"""

from __future__ import annotations

import asyncio

from chronoq.core import errors, model, validate
from chronoq.proto import chronoq_admin_pb2 as apb
from chronoq.protocol.rocketmq import status
from chronoq.features.staging import CHUNK_ROWS_MAX, Rows, Staging
from chronoq.store import record
from chronoq.timer import copies
from chronoq.core.delay_levels import DELAY_TOPIC

READ_MAX_MESSAGES = 10_000
READ_DEFAULT_MESSAGES = 1000
READ_DEFAULT_BYTES = 4 * 1024 * 1024
# What one answer may hold (a first record larger than ``max_bytes`` still comes whole): without a
# cap, 10,000 messages of up to ``max_body_bytes`` each could be asked for in one call. The read and
# the answer are built on the event loop, in steps of READ_STEP_BYTES (in one go a 64 MiB page held
# it ~0.6 s, every other call waiting; 16 MiB ~0.15 s). The Spark source asks 8 MiB a page.
READ_MAX_BYTES = 16 * 1024 * 1024
READ_STEP_BYTES = 1 << 20  # a page is read and cut in steps of about this much (the loop let go between)
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


def rows_from_columns(rows: apb.RowColumns) -> Rows:
    """The rows a ``RowColumns`` block carries (its shape checked here; ``Staging`` validates values)."""
    n = rows.count
    if not 1 <= n <= CHUNK_ROWS_MAX:
        raise errors.ClientError(f"a chunk holds 1..{CHUNK_ROWS_MAX} rows, not {n}")
    bodies = _split(rows.bodies, rows.body_lengths, n, "bodies")
    if bodies is None:
        raise errors.ClientError("rows need a body")
    key_items = _texts(_split(rows.keys, rows.key_lengths, len(rows.key_lengths), "keys"), "keys")
    pkeys = _texts(_split(rows.property_keys, rows.property_key_lengths, len(rows.property_key_lengths),
                          "property keys"), "property keys")
    pvalues = _texts(_split(rows.property_values, rows.property_value_lengths,
                            len(rows.property_value_lengths), "property values"), "property values")
    if len(pkeys or ()) != len(pvalues or ()):
        raise errors.ClientError("properties: as many keys as values are needed")
    props = None
    pk = _lists(rows.property_counts, pkeys, n, "properties")
    if pk is not None:
        pv = _lists(rows.property_counts, pvalues, n, "properties")
        props = [dict(zip(k, v)) for k, v in zip(pk, pv)]  # type: ignore[arg-type]
        for i, (k, d) in enumerate(zip(pk, props)):
            if len(d) != len(k):
                raise errors.InvalidProperty(f"row {i}: a property key is repeated")
    return Rows(bodies,
                tags=_texts(_split(rows.tags, rows.tag_lengths, n, "tags"), "tags"),
                keys=_lists(rows.key_counts, key_items, n, "keys"),
                properties=props,
                groups=_texts(_split(rows.message_groups, rows.message_group_lengths, n, "message groups"),
                              "message groups"),
                deliver_at_ms=_ints(rows.deliver_at_ms, n, "deliver_at_ms"),
                delay_ms=_ints(rows.delay_ms, n, "delay_ms"))


_PAIR, _SEP, _KEY_SEP = record.PROP_PAIR_SEP, record.PROP_SEP, record.KEY_SEP
_GROUP_KEY = validate.PROP_MESSAGE_GROUP.encode()
_REF_KEYS = (copies.PROP_TIMER_REF.encode(), copies.PROP_DELAY_REF.encode())
_SYSTEM_PREFIX_BYTES = _SYSTEM_PREFIX.encode()


class _ColumnBuilder:
    """``MessageColumns`` straight from stored record bytes (user properties only; the message
    group apart). Field bytes are sliced out of the records, never decoded and re-encoded."""

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
        self.any_group = False

    def read(self, entries: list, first_offset: int) -> int:
        """Add the records behind consume-queue ``entries`` (the first at ``first_offset``);
        returns the offset after the last entry. Holes (records removed by retention or
        quarantined) are skipped, as ``Store.read`` does."""
        add = self._add
        for k, blob, pos in self.broker.read_record_runs(entries):
            add(first_offset + k, blob, pos)
        return first_offset + len(entries)

    def _add(self, offset: int, blob: bytes, pos: int) -> None:
        (_t, _m, _v, _c, _flags, _qid, _qoff, born, stored, deliver,
         tlen, mlen, taglen, klen, plen, blen) = _HEADER.unpack_from(blob, pos)
        p = pos + record.HEADER_SIZE + tlen
        self.offsets.append(offset)
        self.ids.append(blob[p:p + mlen])
        p += mlen
        self.tags.append(blob[p:p + taglen])
        p += taglen
        if klen:
            items = blob[p:p + klen].split(_KEY_SEP)
            self.keys.extend(items)
            self.key_counts.append(len(items))
        else:
            self.key_counts.append(0)
        p += klen
        visible = stored
        group = b""
        count = 0
        if plen:
            for pair in blob[p:p + plen].split(_SEP):
                key, _, value = pair.partition(_PAIR)
                if key.startswith(_SYSTEM_PREFIX_BYTES):
                    if key == _GROUP_KEY:
                        group = value
                    elif key in _REF_KEYS:
                        stored = self._original_stored(key, value)
                    continue
                self.prop_keys.append(key)
                self.prop_values.append(value)
                count += 1
        p += plen
        self.prop_counts.append(count)
        self.groups.append(group)
        self.bodies.append(blob[p:p + blen])
        self.born.append(born)
        self.stored.append(stored)
        self.deliver.append(deliver)
        self.visible.append(visible)

    def _original_stored(self, key: bytes, ref: bytes) -> int:
        """When the broker accepted a delayed message: the stored time of the record its visible
        copy was delivered from (a timer entry names its commit offset, a level its queue offset)."""
        broker = self.broker
        try:
            if key == _REF_KEYS[0]:
                _start, phys = copies.parse_ref(ref.decode())
                return broker.record_stored_ms(phys)
            level, qoff = copies.parse_ref(ref.decode())
            entries = broker.queue_entries(DELAY_TOPIC, level - 1, qoff, 1)
            return entries[0][3] if entries else 0
        except (ValueError, errors.ChronoqError):
            return 0

    def build(self) -> apb.MessageColumns:
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
            bodies=b"".join(self.bodies), body_lengths=[len(b) for b in self.bodies],
            born_ms=self.born, stored_ms=self.stored, deliver_at_ms=self.deliver, visible_ms=self.visible)


class PipelineRpcs:
    """Mixin for ``AdminService`` (needs ``self.broker`` and ``self._check_open``)."""

    broker: object
    committer: object = None
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
        """What was written is durable and visible (under either flush policy): the committer's
        ticket for the log's end, or, embedded without one, ``Broker.flush`` in place."""
        broker = self.broker
        committer = self.committer
        if committer is None:
            broker.flush()  # type: ignore[attr-defined]
            return
        await committer.durable(broker.log_end)  # type: ignore[attr-defined]

    # ------------------------------------------------------------------ reading
    def _topic(self, name: str) -> model.TopicConfig:
        self._check_open()  # type: ignore[attr-defined]
        cfg = self.broker.topics.get(validate.topic_name(name))  # type: ignore[attr-defined]
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
            return await self._read_messages(request)
        except Exception as exc:  # noqa: BLE001 - the boundary
            return _failed(apb.ReadMessagesResponse, "ReadMessages", exc)

    async def _read_messages(self, request) -> apb.ReadMessagesResponse:
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
        if not 0 <= request.max_bytes <= READ_MAX_BYTES:
            raise errors.ClientError(f"max_bytes must be between 0 (the default, {READ_DEFAULT_BYTES >> 20} MiB) "
                                     f"and {READ_MAX_BYTES} ({READ_MAX_BYTES >> 20} MiB), not {request.max_bytes}")
        max_bytes = request.max_bytes or READ_DEFAULT_BYTES
        lo, hi = broker.queue_bounds(cfg.name, queue)  # type: ignore[attr-defined]
        offset = max(request.offset, lo)
        # Bound the read by the entries' record sizes first (a record is a little more than its body).
        entries = broker.queue_entries(cfg.name, queue, offset,  # type: ignore[attr-defined]
                                       min(max_messages, max(hi - offset, 0)))
        want, size = 0, 0
        for entry in entries:
            if want and size + entry[1] > max_bytes:
                break
            size += entry[1]
            want += 1
        builder = _ColumnBuilder(broker)
        # In steps of READ_STEP_BYTES with the event loop let go between (a 16 MiB page read and
        # cut in one go held every other call ~0.15 s). Retention deleting records meanwhile
        # leaves holes, skipped as in one go.
        next_offset, first, step = offset, 0, 0
        for k in range(want):
            step += entries[k][1]
            if step >= READ_STEP_BYTES or k == want - 1:
                next_offset = builder.read(entries[first:k + 1], offset + first)
                first, step = k + 1, 0
                if k < want - 1:
                    await asyncio.sleep(0)
        return apb.ReadMessagesResponse(status=_ok(), messages=builder.build(), next_offset=next_offset,
                                        min_offset=lo, max_offset=hi)

    # ------------------------------------------------------------------ staged publish
    async def Stage(self, request, context):
        try:
            staging = self._pipeline()
            rows = staging.stage(request.sink_id, request.batch_id, request.stage_id, request.seq, request.topic,
                                 rows_from_columns(request.rows))
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
            # A batch being published is left alone (Staging.abort skips batches that began).
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
