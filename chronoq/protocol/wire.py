"""Protobuf wire encoding by hand for the per-message hot paths of ``apache.rocketmq.v2``.

Why: building a protobuf object per message from Python costs microseconds (one object per nested
message, one call per field); the bytes of these few shapes are cheap to join directly. The other
side parses them with the generated classes as usual, so only *encoding* is hand-written here, and
``tests/unit/test_wire.py`` checks every encoder against the generated classes.

Wire format, as much as is used here: a field is a key, ``number << 3 | wire type`` as a varint,
then the value: wire type 0 is a varint (negative int32/int64: two's complement, 10 bytes), wire
type 2 is a varint length and that many bytes (strings as UTF-8, bytes, nested messages, map
entries). Fields with presence are written only when present, proto3 scalars only when not at their
default, and fields in number order, so the bytes equal ``SerializeToString``'s (maps aside,
whose entry order is the dict's).

Field numbers are constants below and checked against the generated descriptors at import, so a
changed ``.proto`` fails at import, not on the wire.
"""

from __future__ import annotations

from google.protobuf import timestamp_pb2
from rocketmq.grpc_protocol import definition_pb2 as pb
from rocketmq.grpc_protocol import service_pb2 as sv

VARINT, LEN = 0, 2

# (message, field name, number, wire type) for every field encoded here.
_FIELDS = [
    (pb.Message, "topic", 1, LEN), (pb.Message, "user_properties", 2, LEN),
    (pb.Message, "system_properties", 3, LEN), (pb.Message, "body", 4, LEN),
    (pb.Resource, "resource_namespace", 1, LEN), (pb.Resource, "name", 2, LEN),
    (pb.SystemProperties, "tag", 1, LEN), (pb.SystemProperties, "keys", 2, LEN),
    (pb.SystemProperties, "message_id", 3, LEN), (pb.SystemProperties, "body_encoding", 5, VARINT),
    (pb.SystemProperties, "message_type", 6, VARINT), (pb.SystemProperties, "born_timestamp", 7, LEN),
    (pb.SystemProperties, "born_host", 8, LEN), (pb.SystemProperties, "delivery_timestamp", 11, LEN),
    (pb.SystemProperties, "message_group", 17, LEN),
    (timestamp_pb2.Timestamp, "seconds", 1, VARINT), (timestamp_pb2.Timestamp, "nanos", 2, VARINT),
    (sv.SendMessageRequest, "messages", 1, LEN),
    (sv.AckMessageRequest, "group", 1, LEN), (sv.AckMessageRequest, "topic", 2, LEN),
    (sv.AckMessageRequest, "entries", 3, LEN),
    (sv.AckMessageEntry, "message_id", 1, LEN), (sv.AckMessageEntry, "receipt_handle", 2, LEN),
    (pb.Status, "code", 1, VARINT), (pb.Status, "message", 2, LEN),
    (sv.SendMessageResponse, "status", 1, LEN), (sv.SendMessageResponse, "entries", 2, LEN),
    (sv.SendResultEntry, "status", 1, LEN), (sv.SendResultEntry, "message_id", 2, LEN),
    (sv.SendResultEntry, "transaction_id", 3, LEN), (sv.SendResultEntry, "offset", 4, VARINT),
    (sv.SendResultEntry, "recall_handle", 5, LEN),
    (sv.AckMessageResponse, "status", 1, LEN), (sv.AckMessageResponse, "entries", 2, LEN),
    (sv.AckMessageResultEntry, "message_id", 1, LEN), (sv.AckMessageResultEntry, "receipt_handle", 2, LEN),
    (sv.AckMessageResultEntry, "status", 3, LEN),
]
for _cls, _name, _number, _wire in _FIELDS:
    assert _cls.DESCRIPTOR.fields_by_name[_name].number == _number, (_cls.DESCRIPTOR.full_name, _name)
assert pb.IDENTITY == 1 and pb.NORMAL == 1 and pb.FIFO == 2 and pb.DELAY == 3

_SMALL = [bytes((i,)) for i in range(128)]
# Two-byte varints (128 .. 16383: most lengths on the receive path), made once (~0.5 MB).
_TWO = [b""] * 128 + [bytes((n & 0x7F | 0x80, n >> 7)) for n in range(128, 0x4000)]


def varint(n: int) -> bytes:
    """Base-128 varint of ``n``; a negative ``n`` as its 64-bit two's complement (10 bytes)."""
    if 0 <= n < 128:
        return _SMALL[n]
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


def field(k: bytes, payload: bytes) -> bytes:
    """A length-delimited field: key, length, payload."""
    return k + varint(len(payload)) + payload


def string_field(k: bytes, text: str) -> bytes:
    return field(k, text.encode())


# Keys used per message.
K_MESSAGE_TOPIC, K_MESSAGE_PROPS, K_MESSAGE_SP, K_MESSAGE_BODY = (key(1, LEN), key(2, LEN), key(3, LEN),
                                                                  key(4, LEN))
K_RESOURCE_NAMESPACE, K_RESOURCE_NAME = key(1, LEN), key(2, LEN)
K_SP_TAG, K_SP_KEYS, K_SP_MESSAGE_ID = key(1, LEN), key(2, LEN), key(3, LEN)
K_SP_BODY_ENCODING, K_SP_MESSAGE_TYPE = key(5, VARINT), key(6, VARINT)
K_SP_BORN_TIMESTAMP, K_SP_BORN_HOST = key(7, LEN), key(8, LEN)
K_SP_DELIVERY_TIMESTAMP, K_SP_MESSAGE_GROUP = key(11, LEN), key(17, LEN)
K_TS_SECONDS, K_TS_NANOS = key(1, VARINT), key(2, VARINT)
K_MAP_KEY, K_MAP_VALUE = key(1, LEN), key(2, LEN)
K_SEND_MESSAGES = key(1, LEN)
K_ACK_GROUP, K_ACK_TOPIC, K_ACK_ENTRIES = key(1, LEN), key(2, LEN), key(3, LEN)
K_ACK_ENTRY_MESSAGE_ID, K_ACK_ENTRY_HANDLE = key(1, LEN), key(2, LEN)
K_STATUS_CODE, K_STATUS_MESSAGE = key(1, VARINT), key(2, LEN)
K_SEND_STATUS, K_SEND_ENTRIES = key(1, LEN), key(2, LEN)
K_ENTRY_STATUS, K_ENTRY_MESSAGE_ID, K_ENTRY_OFFSET, K_ENTRY_RECALL_HANDLE = key(1, LEN), key(2, LEN), key(4, VARINT), \
    key(5, LEN)


def status(code: int, message: str) -> bytes:
    """The bytes of a ``Status``."""
    out = K_STATUS_CODE + varint(code) if code else b""
    return out + string_field(K_STATUS_MESSAGE, message) if message else out


K_ACK_RESULT_STATUS, K_ACK_RESULTS = key(1, LEN), key(2, LEN)
K_RESULT_MESSAGE_ID, K_RESULT_HANDLE, K_RESULT_STATUS = key(1, LEN), key(2, LEN), key(3, LEN)

_OK_STATUS = status(pb.OK, "OK")
_OK_SEND_STATUS = field(K_SEND_STATUS, _OK_STATUS)
_OK_ENTRY_STATUS = field(K_ENTRY_STATUS, _OK_STATUS)


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


def properties(props: dict[str, str]) -> bytes:
    """``user_properties`` map entries as fields of ``Message`` (empty for no properties)."""
    if not props:
        return b""
    return b"".join(field(K_MESSAGE_PROPS, string_field(K_MAP_KEY, k) + string_field(K_MAP_VALUE, v))
                    for k, v in props.items())


def send_request(messages) -> bytes:
    """A ``SendMessageRequest`` from ``(message field bytes, system properties bytes, body)``.

    ``message field bytes`` are the topic and user-property fields, ready made; the bodies are
    copied once, into the answer.
    """
    pieces: list[bytes] = []
    add = pieces.append
    for head, sp, body in messages:
        sp_len = varint(len(sp))
        size = len(head) + 1 + len(sp_len) + len(sp)
        if body:  # (proto3 leaves an empty body out)
            body_len = varint(len(body))
            size += 1 + len(body_len) + len(body)
        add(K_SEND_MESSAGES)
        add(varint(size))
        add(head)
        add(K_MESSAGE_SP)
        add(sp_len)
        add(sp)
        if body:
            add(K_MESSAGE_BODY)
            add(body_len)
            add(body)
    return b"".join(pieces)


def ack_request(group: bytes, topic: bytes, entries) -> bytes:
    """An ``AckMessageRequest``: ``group``/``topic`` are ``resource()`` bytes; ``entries`` are
    (message id, receipt handle) strings."""
    pieces = [field(K_ACK_GROUP, group), field(K_ACK_TOPIC, topic)]
    add = pieces.append
    for message_id, handle in entries:
        entry = (string_field(K_ACK_ENTRY_MESSAGE_ID, message_id) if message_id else b"") + \
            (string_field(K_ACK_ENTRY_HANDLE, handle) if handle else b"")
        add(K_ACK_ENTRIES)
        add(varint(len(entry)))
        add(entry)
    return b"".join(pieces)


def send_response_ok(results) -> bytes:
    """A ``SendMessageResponse`` with status OK (message "OK") and one OK ``SendResultEntry`` per
    ``(message id, offset, recall handle)`` of ``results``, in order."""
    pieces = [_OK_SEND_STATUS]
    add = pieces.append
    for message_id, offset, recall_handle in results:
        mid = message_id.encode()
        entry = _OK_ENTRY_STATUS + K_ENTRY_MESSAGE_ID + varint(len(mid)) + mid if mid else _OK_ENTRY_STATUS
        if offset:
            entry += K_ENTRY_OFFSET + varint(offset)
        if recall_handle:
            entry += string_field(K_ENTRY_RECALL_HANDLE, recall_handle)
        add(K_SEND_ENTRIES)
        add(varint(len(entry)))
        add(entry)
    return b"".join(pieces)


def send_response_ok_plain(message_ids: list[str], offsets: list[int]) -> bytes:
    """``send_response_ok`` for results without recall handles, from two columns (the
    SendMessage fast path): the same bytes, without a tuple per message."""
    pieces = [_OK_SEND_STATUS]
    add = pieces.append
    small, head, k_offset = _SMALL, K_SEND_ENTRIES, K_ENTRY_OFFSET
    for message_id, offset in zip(message_ids, offsets):
        mid = message_id.encode()
        entry = _OK_ENTRY_STATUS + K_ENTRY_MESSAGE_ID + varint(len(mid)) + mid if mid else _OK_ENTRY_STATUS
        if offset:
            entry += k_offset + (small[offset] if offset < 128 else varint(offset))
        add(head)
        add(small[len(entry)] if len(entry) < 128 else varint(len(entry)))
        add(entry)
    return b"".join(pieces)


_OK_ACK_STATUS = field(K_ACK_RESULT_STATUS, _OK_STATUS)
_OK_RESULT_STATUS = field(K_RESULT_STATUS, _OK_STATUS)


def ack_response_ok(entries) -> bytes:
    """An ``AckMessageResponse`` with status OK (message "OK") and one OK
    ``AckMessageResultEntry`` per ``(message id, receipt handle)`` of ``entries``, in order."""
    pieces = [_OK_ACK_STATUS]
    add = pieces.append
    for message_id, handle in entries:
        entry = (string_field(K_RESULT_MESSAGE_ID, message_id) if message_id else b"") + \
            (string_field(K_RESULT_HANDLE, handle) if handle else b"") + _OK_RESULT_STATUS
        add(K_ACK_RESULTS)
        add(varint(len(entry)))
        add(entry)
    return b"".join(pieces)


# ------------------------------------------------------------------------------ batched receive
# ``chronoq.v1.Consume/ReceiveBatch`` (chronoq.server.grpc_server, chronoq.client.client) answers what
# ReceiveMessage streams, in one unary response: the bytes of a message
#
#     message ReceiveBatch { repeated apache.rocketmq.v2.ReceiveMessageResponse responses = 1; }
#
# in stream order (status first, then one per message, then the delivery timestamp). No .proto
# declares it: both sides use the two functions below. Why: gRPC Python costs tens of
# microseconds of server CPU per streamed message (bench/grpc_floor.py), one unary answer a few.
K_BATCH_ITEM = key(1, LEN)


def receive_batch(items) -> bytes:
    """Join serialized ``ReceiveMessageResponse``s into a ``ReceiveBatch``."""
    pieces: list[bytes] = []
    add = pieces.append
    for item in items:
        add(K_BATCH_ITEM)
        add(varint(len(item)))
        add(item)
    return b"".join(pieces)


def split_receive_batch(blob: bytes) -> list[memoryview]:
    """The serialized ``ReceiveMessageResponse``s of a ``ReceiveBatch``; ValueError if malformed."""
    items = []
    for number, value in length_fields(blob):
        if number != 1:
            raise ValueError(f"ReceiveBatch: unexpected field {number}")
        items.append(value)
    return items


# ``chronoq.v1.Consume/AckAndReceive`` acks one batch and receives the next in one call:
#
#     message AckAndReceiveRequest  { apache.rocketmq.v2.AckMessageRequest ack = 1;
#                                     apache.rocketmq.v2.ReceiveMessageRequest receive = 2; }
#     message AckAndReceiveResponse { repeated apache.rocketmq.v2.ReceiveMessageResponse responses = 1;
#                                     apache.rocketmq.v2.AckMessageResponse ack = 2; }
#
# The ack runs first; when it fails the receive does not run (``responses`` is empty). When every
# entry was acked, ``ack`` carries the OK status alone (no per-entry results).
K_ACK_AND_RECEIVE_ACK, K_ACK_AND_RECEIVE_RECEIVE = key(1, LEN), key(2, LEN)
K_ACK_AND_RECEIVE_RESPONSE_ACK = key(2, LEN)


def ack_and_receive_request(ack: bytes, receive: bytes) -> bytes:
    return field(K_ACK_AND_RECEIVE_ACK, ack) + field(K_ACK_AND_RECEIVE_RECEIVE, receive)


def ack_and_receive_response(ack: bytes, items) -> bytes:
    return receive_batch(items) + field(K_ACK_AND_RECEIVE_RESPONSE_ACK, ack)


def length_fields(blob: bytes) -> list[tuple[int, memoryview]]:
    """(field number, value) of a message made only of length-delimited fields, in order;
    ValueError for anything else or a truncated message."""
    out = []
    pos, end = 0, len(blob)
    view = memoryview(blob)
    while pos < end:
        k, pos = _read_varint(blob, pos, end)
        if k & 7 != LEN:
            raise ValueError(f"field {k >> 3} has wire type {k & 7}, not length-delimited")
        size, pos = _read_varint(blob, pos, end)
        if pos + size > end:
            raise ValueError("truncated field")
        out.append((k >> 3, view[pos:pos + size]))
        pos += size
    return out


def _read_varint(blob: bytes, pos: int, end: int) -> tuple[int, int]:
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
