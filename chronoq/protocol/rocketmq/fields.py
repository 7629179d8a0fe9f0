"""The one table of ``apache.rocketmq.v2`` field numbers chronoq encodes or reads by hand, and the
protobuf wire primitives the encoders of this package share.

Why by hand: building a protobuf object per message from Python costs microseconds (one object per
nested message, one call per field); the bytes of the few shapes on the per-message paths are
cheap to join directly. The other side parses them with the generated classes as usual, and every
encoder here is held byte for byte to the generated classes by the tests
(``tests/unit/test_wire.py``, ``test_plainsend.py``, ``test_send_fast_path.py``,
``test_server_status_convert.py``).

Wire format, as much as is used here: a field is a key, ``number << 3 | wire type`` as a varint,
then the value: wire type 0 is a varint (negative int32/int64: two's complement, 10 bytes), wire
type 2 is a varint length and that many bytes (strings as UTF-8, bytes, nested messages, map
entries). Fields with presence are written only when present, proto3 scalars only when not at their
default, and fields in number order, so the bytes equal ``SerializeToString``'s (maps aside,
whose entry order is the dict's).

``FIELDS`` is checked against the generated descriptors at import, so a changed ``.proto`` fails at
import, not on the wire. Every key and field number the package uses is taken from it (``_number``).
"""

from __future__ import annotations

from google.protobuf import timestamp_pb2
from rocketmq.grpc_protocol import definition_pb2 as pb
from rocketmq.grpc_protocol import service_pb2 as sv

VARINT, LEN = 0, 2
Ts = timestamp_pb2.Timestamp

# (message, field, number, wire type) of every field encoded or read by hand.
FIELDS = [
    (pb.Message, "topic", 1, LEN), (pb.Message, "user_properties", 2, LEN),
    (pb.Message, "system_properties", 3, LEN), (pb.Message, "body", 4, LEN),
    (pb.Resource, "resource_namespace", 1, LEN), (pb.Resource, "name", 2, LEN),
    (pb.SystemProperties, "tag", 1, LEN), (pb.SystemProperties, "keys", 2, LEN),
    (pb.SystemProperties, "message_id", 3, LEN), (pb.SystemProperties, "body_digest", 4, LEN),
    (pb.SystemProperties, "body_encoding", 5, VARINT), (pb.SystemProperties, "message_type", 6, VARINT),
    (pb.SystemProperties, "born_timestamp", 7, LEN), (pb.SystemProperties, "born_host", 8, LEN),
    (pb.SystemProperties, "store_timestamp", 9, LEN), (pb.SystemProperties, "store_host", 10, LEN),
    (pb.SystemProperties, "delivery_timestamp", 11, LEN), (pb.SystemProperties, "receipt_handle", 12, LEN),
    (pb.SystemProperties, "queue_id", 13, VARINT), (pb.SystemProperties, "queue_offset", 14, VARINT),
    (pb.SystemProperties, "delivery_attempt", 16, VARINT), (pb.SystemProperties, "message_group", 17, LEN),
    (pb.SystemProperties, "dead_letter_queue", 20, LEN), (pb.SystemProperties, "lite_topic", 21, LEN),
    (pb.SystemProperties, "priority", 22, VARINT),
    (pb.Digest, "type", 1, VARINT), (pb.Digest, "checksum", 2, LEN),
    (pb.DeadLetterQueue, "topic", 1, LEN), (pb.DeadLetterQueue, "message_id", 2, LEN),
    (Ts, "seconds", 1, VARINT), (Ts, "nanos", 2, VARINT),
    (pb.Status, "code", 1, VARINT), (pb.Status, "message", 2, LEN),
    (sv.SendMessageRequest, "messages", 1, LEN),
    (sv.SendMessageResponse, "status", 1, LEN), (sv.SendMessageResponse, "entries", 2, LEN),
    (sv.SendResultEntry, "status", 1, LEN), (sv.SendResultEntry, "message_id", 2, LEN),
    (sv.SendResultEntry, "transaction_id", 3, LEN), (sv.SendResultEntry, "offset", 4, VARINT),
    (sv.SendResultEntry, "recall_handle", 5, LEN),
    (sv.ReceiveMessageResponse, "status", 1, LEN), (sv.ReceiveMessageResponse, "message", 2, LEN),
    (sv.ReceiveMessageResponse, "delivery_timestamp", 3, LEN),
    (sv.AckMessageRequest, "group", 1, LEN), (sv.AckMessageRequest, "topic", 2, LEN),
    (sv.AckMessageRequest, "entries", 3, LEN),
    (sv.AckMessageEntry, "message_id", 1, LEN), (sv.AckMessageEntry, "receipt_handle", 2, LEN),
    (sv.AckMessageResponse, "status", 1, LEN), (sv.AckMessageResponse, "entries", 2, LEN),
    (sv.AckMessageResultEntry, "message_id", 1, LEN), (sv.AckMessageResultEntry, "receipt_handle", 2, LEN),
    (sv.AckMessageResultEntry, "status", 3, LEN),
]
_BY_NAME = {(cls, name): (number, wire) for cls, name, number, wire in FIELDS}
for _cls, _name, _number, _wire in FIELDS:
    assert _cls.DESCRIPTOR.fields_by_name[_name].number == _number, (_cls.DESCRIPTOR.full_name, _name)
assert pb.IDENTITY == 1 and pb.NORMAL == 1 and pb.FIFO == 2 and pb.DELAY == 3


def _number(cls, name: str) -> int:
    return _BY_NAME[(cls, name)][0]


# Varints below 128 are one byte, the value; two-byte varints (128 .. 16383: most lengths on the
# receive path) are made once (~0.5 MB).
SMALL = [bytes((i,)) for i in range(128)]
_TWO = [b""] * 128 + [bytes((n & 0x7F | 0x80, n >> 7)) for n in range(128, 0x4000)]


def varint(n: int) -> bytes:
    """Base-128 varint of ``n``; a negative ``n`` as its 64-bit two's complement (10 bytes)."""
    if 0 <= n < 128:
        return SMALL[n]
    if 0 < n < 0x4000:  # lengths of bodies and messages up to 16 KiB: a table, no loop
        return _TWO[n]
    if n < 0:
        n += 1 << 64
    out = bytearray()
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def key(number: int, wire_type: int) -> bytes:
    return varint(number << 3 | wire_type)


def _key(cls, name: str) -> bytes:
    """The key of a field of ``FIELDS``."""
    return key(*_BY_NAME[(cls, name)])


def field(k: bytes, payload: bytes) -> bytes:
    """A length-delimited field: key, length, payload."""
    return k + varint(len(payload)) + payload


def string_field(k: bytes, text: str) -> bytes:
    return field(k, text.encode())


# Keys, per message.
K_MESSAGE_TOPIC, K_MESSAGE_PROPS, K_MESSAGE_SP, K_MESSAGE_BODY = (
    _key(pb.Message, n) for n in ("topic", "user_properties", "system_properties", "body"))
K_RESOURCE_NAMESPACE, K_RESOURCE_NAME = _key(pb.Resource, "resource_namespace"), _key(pb.Resource, "name")
K_SP_TAG, K_SP_KEYS, K_SP_MESSAGE_ID, K_SP_DIGEST, K_SP_BODY_ENCODING, K_SP_MESSAGE_TYPE = (
    _key(pb.SystemProperties, n) for n in ("tag", "keys", "message_id", "body_digest", "body_encoding",
                                           "message_type"))
K_SP_BORN_TIMESTAMP, K_SP_BORN_HOST, K_SP_STORE_TIMESTAMP, K_SP_STORE_HOST = (
    _key(pb.SystemProperties, n) for n in ("born_timestamp", "born_host", "store_timestamp", "store_host"))
K_SP_DELIVERY_TIMESTAMP, K_SP_RECEIPT_HANDLE, K_SP_QUEUE_ID, K_SP_QUEUE_OFFSET = (
    _key(pb.SystemProperties, n) for n in ("delivery_timestamp", "receipt_handle", "queue_id", "queue_offset"))
K_SP_DELIVERY_ATTEMPT, K_SP_MESSAGE_GROUP, K_SP_DEAD_LETTER_QUEUE = (
    _key(pb.SystemProperties, n) for n in ("delivery_attempt", "message_group", "dead_letter_queue"))
K_DIGEST_TYPE, K_DIGEST_CHECKSUM = _key(pb.Digest, "type"), _key(pb.Digest, "checksum")
K_DLQ_TOPIC, K_DLQ_MESSAGE_ID = _key(pb.DeadLetterQueue, "topic"), _key(pb.DeadLetterQueue, "message_id")
K_TS_SECONDS, K_TS_NANOS = _key(Ts, "seconds"), _key(Ts, "nanos")
K_MAP_KEY, K_MAP_VALUE = key(1, LEN), key(2, LEN)  # (every map entry: key = 1, value = 2)
K_STATUS_CODE, K_STATUS_MESSAGE = _key(pb.Status, "code"), _key(pb.Status, "message")
K_SEND_MESSAGES = _key(sv.SendMessageRequest, "messages")
K_SEND_STATUS, K_SEND_ENTRIES = _key(sv.SendMessageResponse, "status"), _key(sv.SendMessageResponse, "entries")
K_ENTRY_STATUS, K_ENTRY_MESSAGE_ID, K_ENTRY_TRANSACTION_ID, K_ENTRY_OFFSET, K_ENTRY_RECALL_HANDLE = (
    _key(sv.SendResultEntry, n) for n in ("status", "message_id", "transaction_id", "offset", "recall_handle"))
K_RECEIVE_STATUS, K_RECEIVE_MESSAGE, K_RECEIVE_DELIVERY_TIMESTAMP = (
    _key(sv.ReceiveMessageResponse, n) for n in ("status", "message", "delivery_timestamp"))
K_ACK_GROUP, K_ACK_TOPIC, K_ACK_ENTRIES = (_key(sv.AckMessageRequest, n) for n in ("group", "topic", "entries"))
K_ACK_ENTRY_MESSAGE_ID, K_ACK_ENTRY_HANDLE = (_key(sv.AckMessageEntry, n) for n in ("message_id", "receipt_handle"))
K_ACK_RESULT_STATUS, K_ACK_RESULTS = _key(sv.AckMessageResponse, "status"), _key(sv.AckMessageResponse, "entries")
K_RESULT_MESSAGE_ID, K_RESULT_HANDLE, K_RESULT_STATUS = (
    _key(sv.AckMessageResultEntry, n) for n in ("message_id", "receipt_handle", "status"))

# Field numbers the readers compare against (chronoq.protocol.rocketmq.send.send_columns).
N_MESSAGE_TOPIC, N_MESSAGE_PROPS, N_MESSAGE_SP, N_MESSAGE_BODY = (
    _number(pb.Message, n) for n in ("topic", "user_properties", "system_properties", "body"))
N_RESOURCE_NAME = _number(pb.Resource, "name")
N_SP_TAG, N_SP_KEYS, N_SP_MESSAGE_ID, N_SP_BODY_ENCODING, N_SP_MESSAGE_TYPE, N_SP_BORN_TIMESTAMP = (
    _number(pb.SystemProperties, n) for n in ("tag", "keys", "message_id", "body_encoding", "message_type",
                                              "born_timestamp"))
N_SP_DELIVERY_TIMESTAMP, N_SP_MESSAGE_GROUP, N_SP_LITE_TOPIC, N_SP_PRIORITY = (
    _number(pb.SystemProperties, n) for n in ("delivery_timestamp", "message_group", "lite_topic", "priority"))
N_TS_SECONDS, N_TS_NANOS = _number(Ts, "seconds"), _number(Ts, "nanos")


# ------------------------------------------------------------------------------ small shapes
def status(code: int, message: str) -> bytes:
    """The bytes of a ``Status``."""
    out = K_STATUS_CODE + varint(code) if code else b""
    return out + string_field(K_STATUS_MESSAGE, message) if message else out


OK_STATUS = status(pb.OK, "OK")


def top_status(k: bytes, ok: bytes, failures, refused: tuple[int, str] | None) -> bytes:
    """A response's top ``status`` field (key ``k``): ``refused`` when the request failed as a whole,
    else the first failure of ``failures`` (``(code, message)`` or None per entry; clients read only
    the top status), else ``ok``, the OK field ready made."""
    first = refused if refused is not None else next(filter(None, failures), None) if failures else None
    return ok if first is None else field(k, status(*first))


def resource(name: str, namespace: str = "") -> bytes:
    """The bytes of a ``Resource`` (not wrapped in a field)."""
    out = string_field(K_RESOURCE_NAMESPACE, namespace) if namespace else b""
    return out + string_field(K_RESOURCE_NAME, name) if name else out


_NANOS = [b""] + [K_TS_NANOS + varint(rest * 1_000_000) for rest in range(1, 1000)]
_seconds_cache: dict[int, bytes] = {}


def timestamp(ms: int) -> bytes:
    """The bytes of a ``google.protobuf.Timestamp`` for epoch milliseconds ``ms``."""
    seconds, rest = divmod(ms, 1000)
    if not seconds:
        return _NANOS[rest]
    head = _seconds_cache.get(seconds)
    if head is None:  # messages received together were mostly stored within a few seconds
        if len(_seconds_cache) >= 4096:
            _seconds_cache.clear()
        head = _seconds_cache[seconds] = K_TS_SECONDS + varint(seconds)
    return head + _NANOS[rest]


def properties(props) -> bytes:
    """``user_properties`` map entries as fields of ``Message`` (empty for no properties), from a
    dict or an iterable of (key, value)."""
    if not props:
        return b""
    items = props.items() if isinstance(props, dict) else props
    return b"".join(field(K_MESSAGE_PROPS, string_field(K_MAP_KEY, k) + string_field(K_MAP_VALUE, v))
                    for k, v in items)


# ------------------------------------------------------------------------------ reading
def read_varint(blob: bytes, pos: int, end: int) -> tuple[int, int]:
    """(value, next position) of the varint at ``pos``; ValueError when truncated or overlong."""
    value = shift = 0
    while True:
        if pos >= end or shift > 63:
            raise ValueError("truncated or overlong varint")
        b = blob[pos]
        pos += 1
        value |= (b & 0x7F) << shift
        if b < 0x80:
            return value, pos
        shift += 7


def length_fields(blob: bytes) -> list[tuple[int, memoryview]]:
    """(field number, value) of a message made only of length-delimited fields, in order;
    ValueError for anything else or a truncated message."""
    out = []
    pos, end = 0, len(blob)
    view = memoryview(blob)
    while pos < end:
        k, pos = read_varint(blob, pos, end)
        if k & 7 != LEN:
            raise ValueError(f"field {k >> 3} has wire type {k & 7}, not length-delimited")
        size, pos = read_varint(blob, pos, end)
        if pos + size > end:
            raise ValueError("truncated field")
        out.append((k >> 3, view[pos:pos + size]))
        pos += size
    return out
