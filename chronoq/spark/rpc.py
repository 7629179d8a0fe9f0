"""A synchronous ``chronoq.v1.Admin`` client for Spark's Python workers, and the Arrow conversions.

Spark runs the data source in many short-lived Python processes (docs/spark.md), so each call
site opens a plain (synchronous) gRPC channel, uses it, and closes it; nothing here is kept in a
pickled reader or writer. Messages arrive as ``MessageColumns`` and leave as ``RowColumns``
(chronoq_admin.proto): both map onto Arrow buffers without a Python loop per message.
"""

from __future__ import annotations

import hashlib
import hmac
import time
from typing import Callable

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

import grpc

from chronoq.proto import chronoq_admin_pb2 as apb
from chronoq.proto import chronoq_admin_pb2_grpc as apb_grpc

OK = 20000
CHANNEL_OPTIONS = [("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)]
UTC = "UTC"
TIMESTAMP = pa.timestamp("us", tz=UTC)

# The source's columns, in order (docs/spark.md). Spark's DDL and the Arrow schema must agree.
READ_COLUMNS = [
    ("topic", "string", pa.string()),
    ("queue", "int", pa.int32()),
    ("offset", "bigint", pa.int64()),
    ("message_id", "string", pa.string()),
    ("keys", "array<string>", pa.list_(pa.string())),
    ("tag", "string", pa.string()),
    ("properties", "map<string,string>", pa.map_(pa.string(), pa.string())),
    ("message_group", "string", pa.string()),
    ("body", "binary", pa.binary()),
    ("born", "timestamp", TIMESTAMP),
    ("stored", "timestamp", TIMESTAMP),
    ("deliver_at", "timestamp", TIMESTAMP),
    ("visible", "timestamp", TIMESTAMP),
    # The broker group holding the queue, for a topic spread over a cluster's groups (each
    # group's queue ids start at 0: (broker_group, queue, offset) is unique); null on one node.
    ("broker_group", "string", pa.string()),
]
READ_DDL = ", ".join(f"{name} {ddl}" for name, ddl, _ in READ_COLUMNS)
READ_ARROW_SCHEMA = pa.schema([pa.field(name, t) for name, _, t in READ_COLUMNS])


class BrokerError(RuntimeError):
    """The broker answered a non-OK status (the message names the code), or could not be reached."""

    def __init__(self, code: int, message: str):
        super().__init__(f"chronoq: {message} (code {code})")
        self.code = code


def parse_endpoints(text: str) -> list[str]:
    """``host:port`` entries separated by ``;`` or ``,``."""
    out = [e.strip() for e in text.replace(",", ";").split(";") if e.strip()]
    for e in out:
        host, sep, port = e.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ValueError(f"endpoint {e!r} is not host:port")
    if not out:
        raise ValueError("the endpoints option is empty")
    return out


class AdminRpc:
    """One channel to the first reachable endpoint. Use as a context manager.

    With ``access_key`` every call is signed as the broker's access control expects (MQv2-HMAC-SHA1
    over ``x-mq-date-time``; docs/security.md; the Admin calls need a user with ``admin = true``).
    ``tls`` (or a ``tls_ca_file`` of PEM roots to trust) connects over TLS.
    """

    def __init__(self, endpoints: list[str] | str, timeout_s: float = 60.0, *, access_key: str = "",
                 secret_key: str = "", tls: bool = False, tls_ca_file: str = ""):
        self.endpoints = parse_endpoints(endpoints) if isinstance(endpoints, str) else list(endpoints)
        self.timeout_s = timeout_s
        self.access_key, self.secret_key = access_key or "", secret_key or ""
        self.tls, self.tls_ca_file = bool(tls or tls_ca_file), tls_ca_file or ""
        self._channel = None
        self._stub = None
        self._index = 0

    def _metadata(self) -> tuple:
        if not self.access_key:
            return ()
        date = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
        sig = hmac.new(self.secret_key.encode(), date.encode(), hashlib.sha1).hexdigest()
        return (("x-mq-date-time", date), ("authorization", f"MQv2-HMAC-SHA1 Credential={self.access_key}, "
                                                           f"SignedHeaders=x-mq-date-time, Signature={sig}"))

    def _open(self, endpoint: str):
        if not self.tls:
            return grpc.insecure_channel(endpoint, options=CHANNEL_OPTIONS)
        roots = None
        if self.tls_ca_file:
            with open(self.tls_ca_file, "rb") as fh:
                roots = fh.read()
        return grpc.secure_channel(endpoint, grpc.ssl_channel_credentials(roots), options=CHANNEL_OPTIONS)

    def __enter__(self) -> "AdminRpc":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if self._channel is not None:
            self._channel.close()
            self._channel = self._stub = None

    def _call(self, method: str, request):
        last: Exception | None = None
        for _ in range(len(self.endpoints)):
            if self._stub is None:
                self._channel = self._open(self.endpoints[self._index])
                self._stub = apb_grpc.AdminStub(self._channel)
            try:
                resp = getattr(self._stub, method)(request, timeout=self.timeout_s, metadata=self._metadata())
            except grpc.RpcError as exc:
                last = exc
                if exc.code() != grpc.StatusCode.UNAVAILABLE:
                    break
                self.close()
                self._index = (self._index + 1) % len(self.endpoints)
                continue
            if resp.status.code != OK:
                raise BrokerError(resp.status.code, f"{method}: {resp.status.message}")
            return resp
        detail = last.details() if isinstance(last, grpc.RpcError) else str(last)
        raise BrokerError(-1, f"{method}: no answer from {';'.join(self.endpoints)} ({detail})")

    # ------------------------------------------------------------------ calls
    def queue_offsets(self, topic: str) -> dict[int, tuple[int, int]]:
        """``{queue: (min offset, next offset)}`` for every queue of ``topic``."""
        resp = self._call("QueueOffsets", apb.QueueOffsetsRequest(topic=topic))
        return {q.queue: (q.min_offset, q.next_offset) for q in resp.queues}

    def cluster_groups(self):
        """``ClusterGroupsResponse``: the cluster's broker groups and every topic's placement
        (chronoq.spark.cluster); PRECONDITION_FAILED from a node without etcd."""
        return self._call("ClusterGroups", apb.ClusterGroupsRequest())

    def list_topics(self) -> list[str]:
        """The names of the broker's user topics (system topics left out)."""
        return [t.name for t in self._call("ListTopics", apb.ListTopicsRequest()).topics]

    def read(self, topic: str, queue: int, offset: int, max_messages: int, max_bytes: int = 0):
        return self._call("ReadMessages", apb.ReadMessagesRequest(
            topic=topic, queue=queue, offset=offset, max_messages=max_messages, max_bytes=max_bytes))

    def stage(self, sink_id: str, batch_id: int, stage_id: str, seq: int, topic: str, rows: apb.RowColumns) -> int:
        return self._call("Stage", apb.StageRequest(sink_id=sink_id, batch_id=batch_id, stage_id=stage_id, seq=seq,
                                                    topic=topic, rows=rows)).rows

    def stage_async(self, sink_id: str, batch_id: int, stage_id: str, seq: int, topic: str,
                    rows: apb.RowColumns) -> Callable[[], int]:
        """Send a ``Stage`` call without waiting for it; the returned function waits for its answer
        (the row count). A writer converts its next chunk while the broker stages this one. Any
        failure of the call sends it again through ``_call`` (failover, errors): ``Stage`` is
        idempotent per (stage id, seq), so a chunk staged twice is kept once."""
        request = apb.StageRequest(sink_id=sink_id, batch_id=batch_id, stage_id=stage_id, seq=seq, topic=topic,
                                   rows=rows)
        future = None
        try:
            if self._stub is None:
                self._channel = self._open(self.endpoints[self._index])
                self._stub = apb_grpc.AdminStub(self._channel)
            future = self._stub.Stage.future(request, timeout=self.timeout_s, metadata=self._metadata())
        except grpc.RpcError:
            pass

        def result() -> int:
            if future is not None:
                try:
                    resp = future.result()
                except grpc.RpcError:
                    pass
                else:
                    if resp.status.code != OK:
                        raise BrokerError(resp.status.code, f"Stage: {resp.status.message}")
                    return resp.rows
            return self._call("Stage", request).rows

        return result

    def publish(self, sink_id: str, batch_id: int, stages: list[tuple[str, int, int]]):
        return self._call("Publish", apb.PublishRequest(sink_id=sink_id, batch_id=batch_id, stages=[
            apb.StageRef(stage_id=s, chunks=c, rows=r) for s, c, r in stages]))

    def abort(self, sink_id: str, batch_id: int) -> int:
        return self._call("Abort", apb.AbortRequest(sink_id=sink_id, batch_id=batch_id)).discarded_rows

    def list_pending(self, topic: str = "", key: str = "", from_ms: int | None = None, to_ms: int | None = None,
                     limit: int = 0, cursor: str = "", bodies: bool = False, span: bool = False):
        """A page of pending delayed messages (``ListPendingResponse``; chronoq.spark.pending)."""
        return self._call("ListPending", apb.ListPendingRequest(
            topic=topic, key=key, from_ms=from_ms, to_ms=to_ms, limit=limit, cursor=cursor, bodies=bodies, span=span))

    def flush_trace(self):
        return self._call("FlushTrace", apb.FlushTraceRequest())


# ---------------------------------------------------------------------------- MessageColumns -> Arrow
def _offsets32(lengths: np.ndarray) -> np.ndarray:
    out = np.zeros(len(lengths) + 1, dtype=np.int32)
    np.cumsum(lengths, out=out[1:])
    return out


def _validity(mask: np.ndarray) -> tuple[pa.Buffer | None, int]:
    nulls = int(len(mask) - np.count_nonzero(mask))
    if not nulls:
        return None, 0
    return pa.py_buffer(np.packbits(mask, bitorder="little")), nulls


def _strings(blob: bytes, lengths, n: int, kind=pa.string(), empty_is_null: bool = False) -> pa.Array:
    if not len(lengths):
        return pa.nulls(n, kind) if empty_is_null else pa.array([b""] * n if kind == pa.binary() else [""] * n, kind)
    lens = np.asarray(lengths, dtype=np.int32)
    validity, nulls = _validity(lens > 0) if empty_is_null else (None, 0)
    return pa.Array.from_buffers(kind, n, [validity, pa.py_buffer(_offsets32(lens)), pa.py_buffer(blob)],
                                 null_count=nulls)


def _times(values, null_when_zero: bool) -> pa.Array:
    ms = np.asarray(values, dtype=np.int64)
    mask = (ms == 0) if null_when_zero else None
    return pa.array(ms * 1000, type=TIMESTAMP, mask=mask)


def columns_to_arrow(topic: str, queue: int, cols: apb.MessageColumns, group: str = "") -> pa.RecordBatch:
    """A record batch with the source's schema for one ``ReadMessages`` answer (``group``: the
    broker group it came from, "" for a topic on one node)."""
    n = cols.count
    key_counts = np.asarray(cols.key_counts, dtype=np.int32) if len(cols.key_counts) else np.zeros(n, np.int32)
    keys = pa.ListArray.from_arrays(pa.array(_offsets32(key_counts)),
                                    _strings(cols.keys, cols.key_lengths, len(cols.key_lengths)))
    prop_counts = (np.asarray(cols.property_counts, dtype=np.int32) if len(cols.property_counts)
                   else np.zeros(n, np.int32))
    np_props = len(cols.property_key_lengths)
    props = pa.MapArray.from_arrays(pa.array(_offsets32(prop_counts)),
                                    _strings(cols.property_keys, cols.property_key_lengths, np_props),
                                    _strings(cols.property_values, cols.property_value_lengths, np_props))
    arrays = [
        pa.array([topic] * n, pa.string()) if n else pa.array([], pa.string()),
        pa.array(np.full(n, queue, dtype=np.int32)),
        pa.array(np.asarray(cols.offsets, dtype=np.int64)),
        _strings(cols.message_ids, cols.message_id_lengths, n),
        keys,
        _strings(cols.tags, cols.tag_lengths, n, empty_is_null=True),
        props,
        _strings(cols.message_groups, cols.message_group_lengths, n, empty_is_null=True),
        _strings(cols.bodies, cols.body_lengths, n, pa.binary()),
        _times(cols.born_ms, False),
        _times(cols.stored_ms, True),
        _times(cols.deliver_at_ms, True),
        _times(cols.visible_ms, False),
        pa.array([group] * n, pa.string()) if group else pa.nulls(n, pa.string()),
    ]
    return pa.RecordBatch.from_arrays(arrays, schema=READ_ARROW_SCHEMA)


# ---------------------------------------------------------------------------- Arrow -> RowColumns
# What a written row may carry (docs/spark.md); anything else is refused when the write is planned.
WRITE_COLUMNS = {
    "body": "binary or string, required",
    "key": "string",
    "keys": "array<string>",
    "tag": "string",
    "properties": "map<string,string>",
    "message_group": "string",
    "deliver_at": "timestamp",
    "deliver_at_ms": "bigint (epoch ms)",
    "delay_ms": "bigint",
}


def _flat_bytes(arr: pa.Array, what: str, required: bool = False) -> tuple[bytes, np.ndarray]:
    """(concatenated values, per-row byte lengths; null -> 0) of a string/binary array."""
    if pa.types.is_large_string(arr.type) or pa.types.is_large_binary(arr.type):
        arr = arr.cast(pa.large_binary())
    elif not pa.types.is_binary(arr.type):
        arr = arr.cast(pa.binary())
    if required and arr.null_count:
        raise ValueError(f"column {what} has nulls: every row needs one")
    if arr.null_count:
        arr = pc.fill_null(arr, b"")
    buffers = arr.buffers()
    wide = pa.types.is_large_binary(arr.type)
    offsets = np.frombuffer(buffers[1], dtype=np.int64 if wide else np.int32)[arr.offset:arr.offset + len(arr) + 1]
    data = buffers[2]
    blob = data[int(offsets[0]):int(offsets[-1])].to_pybytes() if data is not None else b""
    return blob, np.diff(offsets).astype(np.int32)


_PER_MS = {"s": None, "ms": 1, "us": 1000, "ns": 1_000_000}


def _ms(arr: pa.Array, what: str) -> np.ndarray:
    """Epoch milliseconds (null -> 0). A timestamp finer than a millisecond is rounded *up*, so a
    message is never due before the instant the row asked for."""
    if pa.types.is_timestamp(arr.type):
        unit = arr.type.unit
        values = np.asarray(pc.fill_null(arr.cast(pa.int64()), 0).to_numpy(zero_copy_only=False), dtype=np.int64)
        per_ms = _PER_MS[unit]
        if per_ms is None:
            return values * 1000
        return -((-values) // per_ms) if per_ms > 1 else values
    if not pa.types.is_integer(arr.type):
        raise ValueError(f"column {what} must be a timestamp or a bigint, not {arr.type}")
    return np.asarray(pc.fill_null(arr.cast(pa.int64()), 0).to_numpy(zero_copy_only=False), dtype=np.int64)


def _list_parts(arr: pa.Array) -> tuple[np.ndarray, pa.Array]:
    """(per-row item counts, flattened items) of a list or map array; a null row has no items.

    Arrow compute has no list kernels for maps, so a map is viewed as a list of key/value structs
    (its offsets index its whole, unsliced key and item arrays).
    """
    if isinstance(arr, pa.MapArray):
        entries = pa.StructArray.from_arrays([arr.keys, arr.items], names=["key", "value"])
        offsets = pa.array(np.asarray(arr.offsets, dtype=np.int32))  # a fresh buffer (sliced + mask fails)
        arr = pa.ListArray.from_arrays(offsets, entries, mask=arr.is_null())
    counts = pc.fill_null(pc.list_value_length(arr), 0).to_numpy(zero_copy_only=False).astype(np.int32)
    return counts, pc.list_flatten(arr)


def batch_to_rows(batch: pa.RecordBatch) -> apb.RowColumns:
    """``RowColumns`` for the rows of a record batch (columns named as in ``WRITE_COLUMNS``)."""
    n = batch.num_rows
    names = batch.schema.names
    rows = apb.RowColumns(count=n)
    col = dict(zip(names, batch.columns))
    body, lens = _flat_bytes(col["body"], "body", required=True)
    rows.bodies, rows.body_lengths[:] = body, lens.tolist()
    for name, blob_field, len_field in (("tag", "tags", "tag_lengths"),
                                        ("message_group", "message_groups", "message_group_lengths")):
        if name in col and col[name].null_count < n:
            blob, lens = _flat_bytes(col[name], name)
            setattr(rows, blob_field, blob)
            getattr(rows, len_field)[:] = lens.tolist()
    if "keys" in col or "key" in col:
        if "keys" in col:
            counts, items = _list_parts(col["keys"])
            if "key" in col:
                raise ValueError("give a key column or a keys column, not both")
        else:
            arr = col["key"]
            counts = (~np.asarray(arr.is_null().to_numpy(zero_copy_only=False))).astype(np.int32)
            items = arr.drop_null()
        if len(items):
            blob, lens = _flat_bytes(items, "keys", required=True)
            rows.key_counts[:] = counts.tolist()
            rows.keys, rows.key_lengths[:] = blob, lens.tolist()
    if "properties" in col and col["properties"].null_count < n:
        counts, entries = _list_parts(col["properties"])
        if len(entries):
            kblob, klens = _flat_bytes(entries.field("key"), "property keys", required=True)
            vblob, vlens = _flat_bytes(entries.field("value"), "property values")
            rows.property_counts[:] = counts.tolist()
            rows.property_keys, rows.property_key_lengths[:] = kblob, klens.tolist()
            rows.property_values, rows.property_value_lengths[:] = vblob, vlens.tolist()
    times = [name for name in ("deliver_at", "deliver_at_ms") if name in col]
    if len(times) > 1:
        raise ValueError("give deliver_at or deliver_at_ms, not both")
    if times:
        rows.deliver_at_ms[:] = _ms(col[times[0]], times[0]).tolist()
    if "delay_ms" in col:
        rows.delay_ms[:] = _ms(col["delay_ms"], "delay_ms").tolist()
    return rows


def split_batch(batch: pa.RecordBatch, rows_max: int, bytes_max: int) -> list[pa.RecordBatch]:
    """Cut a batch into pieces of at most ``rows_max`` rows and about ``bytes_max`` body bytes."""
    n = batch.num_rows
    if n == 0:
        return []
    body = batch.column(batch.schema.get_field_index("body"))
    lens = pc.fill_null(pc.binary_length(body.cast(pa.binary()) if pa.types.is_string(body.type) else body), 0)
    cum = np.cumsum(lens.to_numpy(zero_copy_only=False))
    out, start = [], 0
    while start < n:
        base = cum[start - 1] if start else 0
        end = int(np.searchsorted(cum, base + bytes_max, side="right"))
        end = max(start + 1, min(end, start + rows_max, n))
        out.append(batch.slice(start, end - start))
        start = end
    return out
