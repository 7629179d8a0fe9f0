"""The columns of a plain SendMessage batch, read straight from the request's wire bytes.

Why: ``convert.plain_batch`` reads the same columns from the parsed request, but every attribute
read of a upb message builds a Python object; for a batch of 100 one-KiB messages that was a
quarter of the broker's time per message sent (about 6 us per message). Here the bytes are walked
once. A batch's messages usually differ only in their id and body (chronoq.client.client writes them
so; so do most batching producers), so after one message is read field by field the next ones are
checked against its bytes around those two (``_Shape``) and cost a few comparisons each; a
message that differs is read field by field and becomes the new shape.

``columns(raw)`` answers exactly what ``convert.plain_batch(SendMessageRequest.FromString(raw)
.messages)`` answers, or None in more cases (then the caller asks ``plain_batch``): it gives up
on anything unusual (a nested field given twice, which protobuf merges; groups; a truncated field),
never guesses. ``tests/unit/test_plainsend.py`` holds it to ``plain_batch`` on generated batches.
The bytes must have parsed as a ``SendMessageRequest`` first (valid UTF-8 strings, well formed).

Wire format read here (``apache.rocketmq.v2``): SendMessageRequest ``messages`` = 1; Message
``topic`` = 1 (Resource: ``resource_namespace`` = 1, ``name`` = 2), ``user_properties`` = 2,
``system_properties`` = 3, ``body`` = 4; SystemProperties ``tag`` = 1, ``keys`` = 2,
``message_id`` = 3, ``body_encoding`` = 5, ``message_type`` = 6, ``born_timestamp`` = 7
(Timestamp: ``seconds`` = 1, ``nanos`` = 2), ``delivery_timestamp`` = 11, ``message_group`` = 17,
``lite_topic`` = 21, ``priority`` = 22; other fields are skipped, as ``plain_batch`` ignores them.
"""

from __future__ import annotations

from google.protobuf import timestamp_pb2

from chronoq.protocol.wire import _read_varint as _varint  # (ValueError when truncated or overlong)
from chronoq.protocol.wire import varint as _VARINT_BYTES
from rocketmq.grpc_protocol import definition_pb2 as pb
from rocketmq.grpc_protocol import service_pb2 as sv

# Field numbers, checked against the generated descriptors: a changed .proto fails at import.
for _cls, _name, _number in [
        (sv.SendMessageRequest, "messages", 1), (pb.Message, "topic", 1), (pb.Message, "user_properties", 2),
        (pb.Message, "system_properties", 3), (pb.Message, "body", 4), (pb.Resource, "name", 2),
        (pb.SystemProperties, "tag", 1), (pb.SystemProperties, "keys", 2), (pb.SystemProperties, "message_id", 3),
        (pb.SystemProperties, "body_encoding", 5), (pb.SystemProperties, "message_type", 6),
        (pb.SystemProperties, "born_timestamp", 7), (pb.SystemProperties, "delivery_timestamp", 11),
        (pb.SystemProperties, "message_group", 17), (pb.SystemProperties, "lite_topic", 21),
        (pb.SystemProperties, "priority", 22), (timestamp_pb2.Timestamp, "seconds", 1),
        (timestamp_pb2.Timestamp, "nanos", 2)]:
    assert _cls.DESCRIPTOR.fields_by_name[_name].number == _number, (_cls.DESCRIPTOR.full_name, _name)

_PLAIN_TYPES = frozenset((pb.NORMAL, pb.MESSAGE_TYPE_UNSPECIFIED))
_PLAIN_ENCODINGS = frozenset((pb.IDENTITY, pb.ENCODING_UNSPECIFIED))
# SystemProperties fields whose presence makes a message not plain: keys, delivery_timestamp,
# message_group, lite_topic, priority (proto3 ``optional``: present even at the default).
_NOT_PLAIN_SP = frozenset((2, 11, 17, 21, 22))
_MESSAGE_KEY = 0x0A  # field 1, length-delimited


class _GiveUp(Exception):
    """The bytes are not a plain batch (or not one this reader is sure of)."""


def _int64(value: int) -> int:
    """A varint read as int64 (its low 64 bits, two's complement), as protobuf reads it."""
    value &= (1 << 64) - 1
    return value - (1 << 64) if value >= 1 << 63 else value


def _int32(value: int) -> int:
    """A varint read as int32 or an enum (its low 32 bits, two's complement)."""
    value &= 0xFFFFFFFF
    return value - (1 << 32) if value >= 1 << 31 else value


def _fields(raw: bytes, pos: int, end: int):
    """(number, wire type, value start, value end or varint value) of each field in raw[pos:end]."""
    while pos < end:
        key, pos = _varint(raw, pos, end)
        number, wire_type = key >> 3, key & 7
        if wire_type == 2:
            size, start = _varint(raw, pos, end)
            pos = start + size
            if pos > end:
                raise _GiveUp
            yield number, 2, start, pos
        elif wire_type == 0:
            value, pos = _varint(raw, pos, end)
            yield number, 0, value, pos
        elif wire_type == 1 or wire_type == 5:  # fixed 64 or 32 bits
            pos += 8 if wire_type == 1 else 4
            if pos > end:
                raise _GiveUp
            yield number, wire_type, 0, pos
        else:  # groups (3, 4) or invalid
            raise _GiveUp


def _read_message(raw: bytes, start: int, end: int):
    """One message field by field: (topic name, id bytes, tag, body, born ms or None, shape).

    The shape is (bytes before the id, the id's length, bytes between the id and the body's
    length), or None when the message is not laid out so. A message whose bytes match a shape
    around its id and body has the same topic, tag and born time as the one it came from: those
    lie in the matched bytes, and every length that frames them is there too."""
    topic_name = None
    sp = body = None
    body_at = -1
    for number, wire_type, a, b in _fields(raw, start, end):
        if number == 1:
            if wire_type != 2 or topic_name is not None:
                raise _GiveUp  # a second Resource would be merged into the first
            topic_name = ""
            for n, w, x, y in _fields(raw, a, b):
                if n == 2 and w == 2:
                    topic_name = raw[x:y].decode()
        elif number == 2:
            raise _GiveUp  # user properties
        elif number == 3:
            if wire_type != 2 or sp is not None:
                raise _GiveUp
            sp = (a, b)
        elif number == 4:
            if wire_type != 2:
                raise _GiveUp
            body, body_at = raw[a:b], a
    if topic_name is None:
        topic_name = ""
    tag, message_id, born = "", b"", None
    id_at = id_end = -1
    if sp is not None:
        born_seen = False
        for number, wire_type, a, b in _fields(raw, sp[0], sp[1]):
            if number in _NOT_PLAIN_SP:
                raise _GiveUp
            if number == 1 and wire_type == 2:
                tag = raw[a:b].decode()
            elif number == 3 and wire_type == 2:
                message_id, id_at, id_end = raw[a:b], a, b
            elif number == 5 and wire_type == 0:
                if _int32(a) not in _PLAIN_ENCODINGS:
                    raise _GiveUp
            elif number == 6 and wire_type == 0:
                if _int32(a) not in _PLAIN_TYPES:
                    raise _GiveUp
            elif number == 7 and wire_type == 2:
                if born_seen:
                    raise _GiveUp
                born_seen = True
                seconds = nanos = 0
                for n, w, x, _ in _fields(raw, a, b):
                    if n == 1 and w == 0:
                        seconds = _int64(x)
                    elif n == 2 and w == 0:
                        nanos = _int32(x)
                ms = seconds * 1000 + nanos // 1_000_000
                born = ms if ms > 0 else None
            elif wire_type not in (0, 2) and number in (1, 3, 5, 6, 7):
                raise _GiveUp  # a known field with a foreign wire type: let upb's reading decide
    if body is None:
        body = b""
    # The shape: the id lies in the system properties, the body is the message's last field and
    # comes after the id, and its length is written in the fewest bytes right before it.
    shape = None
    length = _VARINT_BYTES(len(body))
    if 0 <= id_at and id_end <= body_at - len(length) and body_at + len(body) == end \
            and raw.startswith(length, body_at - len(length)):
        shape = (raw[start:id_at], id_end - id_at, raw[id_end:body_at - len(length)])
    return topic_name, message_id, tag, body, born, shape


def columns(raw: bytes):
    """(topic, ids, tags, bodies, born ms or None) of a SendMessageRequest whose messages are all
    plain and of one topic; None otherwise, or when unsure (ask ``convert.plain_batch``)."""
    try:
        return _columns(raw)
    except _GiveUp:
        return None
    except (ValueError, IndexError):  # (UnicodeDecodeError is a ValueError)
        return None


def _columns(raw: bytes):
    end = len(raw)
    pos = 0
    topic = None
    ids: list[bytes] = []
    bodies: list[bytes] = []
    tags: list[str] = []
    borns: list[int | None] = []
    # The current shape, unpacked into locals (the loop below is the hot path).
    before = between = b""
    id_len = -1
    tag, born = "", None
    startswith = raw.startswith
    while pos < end:
        if raw[pos] != _MESSAGE_KEY:
            raise _GiveUp  # another field of the request, or a key written oddly: the careful way
        b = raw[pos + 1]
        if b < 0x80:
            start = pos + 2
            pos = start + b
        elif raw[pos + 2] < 0x80:  # (two-byte lengths inline: a call costs more than the rest)
            start = pos + 3
            pos = start + (b & 0x7F | raw[pos + 2] << 7)
        else:
            size, start = _varint(raw, pos + 1, end)
            pos = start + size
        if pos > end:
            raise _GiveUp
        if id_len >= 0 and startswith(before, start):
            at = start + len(before)
            id_end = at + id_len
            if startswith(between, id_end):
                body_at = id_end + len(between)
                if body_at < pos:
                    b = raw[body_at]
                    if b < 0x80:
                        body_at += 1
                    elif body_at + 1 < pos and raw[body_at + 1] < 0x80:
                        b = b & 0x7F | raw[body_at + 1] << 7
                        body_at += 2
                    else:
                        b, body_at = _varint(raw, body_at, pos)
                    if body_at + b == pos:
                        ids.append(raw[at:id_end])
                        bodies.append(raw[body_at:pos])
                        tags.append(tag)
                        borns.append(born)
                        continue
        name, message_id, tag, body, born, shape = _read_message(raw, start, pos)
        if topic is None:
            topic = name
        elif name != topic:
            raise _GiveUp
        ids.append(message_id)
        bodies.append(body)
        tags.append(tag)
        borns.append(born)
        if shape is None:
            id_len = -1
        else:
            before, id_len, between = shape
    if topic is None:
        raise _GiveUp
    return topic, list(map(bytes.decode, ids)), tags, bodies, borns
