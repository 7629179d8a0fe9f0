"""SendMessage by hand: the columns of a plain batch read straight from the request's bytes (the
broker), and the one ``SendMessageResponse`` encoder. (The request's encoder, the client's, is
chronoq.protocol.rocketmq.outgoing.)

Why the columns are read from the bytes: reading them from the parsed request costs an object
per attribute read of a upb message; for a batch of 100 one-KiB messages that was a quarter of the
broker's time per message sent (about 6 us per message). Here the bytes are walked once. A batch's
messages usually differ only in their id and body (chronoq.client.client writes them so; so do
most batching producers), so after one message is read field by field the next ones are checked
against its bytes around those two (the shape) and cost a few comparisons each; a message that
differs is read field by field and becomes the new shape.

``plain_columns(raw)`` answers exactly what ``chronoq.server.convert.plain_batch(
SendMessageRequest.FromString(raw).messages)`` answers, or None in more cases (then the caller asks
``plain_batch``): it gives up on anything unusual (a nested field given twice, which protobuf
merges; groups; a truncated field), never guesses. ``tests/unit/test_plainsend.py`` holds it to
``plain_batch`` on generated batches. The bytes must have parsed as a ``SendMessageRequest`` first
(valid UTF-8 strings, well formed). Fields it does not name (chronoq.protocol.rocketmq.fields) are
skipped, as ``plain_batch`` ignores them.
"""

from __future__ import annotations

from itertools import repeat

from rocketmq.grpc_protocol import definition_pb2 as pb

from chronoq.protocol.rocketmq import fields as f
from chronoq.protocol.rocketmq.fields import read_varint as _varint  # (ValueError when truncated or overlong)
from chronoq.protocol.rocketmq.fields import varint

_SMALL = f.SMALL


# ------------------------------------------------------------------------------ response
_OK_ENTRY_STATUS = f.field(f.K_ENTRY_STATUS, f.OK_STATUS)
_OK_TOP = f.field(f.K_SEND_STATUS, f.OK_STATUS)


def send_response(message_ids, offsets, recall_handles=None, transaction_ids=None, failures=None, *,
                  status: tuple[int, str] | None = None) -> bytes:
    """The ``SendMessageResponse`` of every SendMessage answer: one ``SendResultEntry`` per message
    id, in order, with its queue offset (0: none) and, when those columns are given, its recall
    handle, transaction id and failure (``(code, message)``, None when accepted). An accepted entry's
    status is OK with message "OK". The top status is ``status`` when given (the request failed as
    a whole: give no entries), else the first failure's (clients read only that), else OK.

    Columns, not a tuple per message: the plain batch path answers 100 entries a call.
    """
    assert status is None or not message_ids, "a failed request carries no entries"
    # (all accepted, the usual answer: no call to work the top status out)
    top = _OK_TOP if failures is None and status is None else f.top_status(f.K_SEND_STATUS, _OK_TOP, failures, status)
    pieces = [top]
    add = pieces.append
    small, head, k_id, k_offset, ok = _SMALL, f.K_SEND_ENTRIES, f.K_ENTRY_MESSAGE_ID, f.K_ENTRY_OFFSET, _OK_ENTRY_STATUS
    for message_id, offset, recall, txid, failure in zip(
            message_ids, offsets, recall_handles or repeat(""), transaction_ids or repeat(""),
            failures or repeat(None)):
        mid = message_id.encode()
        entry = ok if failure is None else f.field(f.K_ENTRY_STATUS, f.status(*failure))
        if mid:
            entry += k_id + (small[len(mid)] if len(mid) < 128 else varint(len(mid))) + mid
        if txid:
            entry += f.string_field(f.K_ENTRY_TRANSACTION_ID, txid)
        if offset:
            entry += k_offset + (small[offset] if 0 < offset < 128 else varint(offset))
        if recall:
            entry += f.string_field(f.K_ENTRY_RECALL_HANDLE, recall)
        add(head)
        add(small[len(entry)] if len(entry) < 128 else varint(len(entry)))
        add(entry)
    return b"".join(pieces)


# ------------------------------------------------------------------------------ plain batch columns
_PLAIN_TYPES = frozenset((pb.NORMAL, pb.MESSAGE_TYPE_UNSPECIFIED))
_PLAIN_ENCODINGS = frozenset((pb.IDENTITY, pb.ENCODING_UNSPECIFIED))
# SystemProperties fields whose presence makes a message not plain: keys, delivery_timestamp,
# message_group, lite_topic, priority (proto3 ``optional``: present even at the default).
_NOT_PLAIN_SP = frozenset((f.N_SP_KEYS, f.N_SP_DELIVERY_TIMESTAMP, f.N_SP_MESSAGE_GROUP, f.N_SP_LITE_TOPIC,
                           f.N_SP_PRIORITY))
_MESSAGE_KEY = f.K_SEND_MESSAGES[0]
assert len(f.K_SEND_MESSAGES) == 1
_TOPIC, _PROPS, _SP, _BODY, _NAME = f.N_MESSAGE_TOPIC, f.N_MESSAGE_PROPS, f.N_MESSAGE_SP, f.N_MESSAGE_BODY, \
    f.N_RESOURCE_NAME
_TAG, _ID, _ENCODING, _TYPE, _BORN = f.N_SP_TAG, f.N_SP_MESSAGE_ID, f.N_SP_BODY_ENCODING, f.N_SP_MESSAGE_TYPE, \
    f.N_SP_BORN_TIMESTAMP
_SECONDS, _NANOS = f.N_TS_SECONDS, f.N_TS_NANOS


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
        if number == _TOPIC:
            if wire_type != 2 or topic_name is not None:
                raise _GiveUp  # a second Resource would be merged into the first
            topic_name = ""
            for n, w, x, y in _fields(raw, a, b):
                if n == _NAME and w == 2:
                    topic_name = raw[x:y].decode()
        elif number == _PROPS:
            raise _GiveUp  # user properties
        elif number == _SP:
            if wire_type != 2 or sp is not None:
                raise _GiveUp
            sp = (a, b)
        elif number == _BODY:
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
            if number == _TAG and wire_type == 2:
                tag = raw[a:b].decode()
            elif number == _ID and wire_type == 2:
                message_id, id_at, id_end = raw[a:b], a, b
            elif number == _ENCODING and wire_type == 0:
                if _int32(a) not in _PLAIN_ENCODINGS:
                    raise _GiveUp
            elif number == _TYPE and wire_type == 0:
                if _int32(a) not in _PLAIN_TYPES:
                    raise _GiveUp
            elif number == _BORN and wire_type == 2:
                if born_seen:
                    raise _GiveUp
                born_seen = True
                seconds = nanos = 0
                for n, w, x, _ in _fields(raw, a, b):
                    if n == _SECONDS and w == 0:
                        seconds = _int64(x)
                    elif n == _NANOS and w == 0:
                        nanos = _int32(x)
                ms = seconds * 1000 + nanos // 1_000_000
                born = ms if ms > 0 else None
            elif wire_type not in (0, 2) and number in (_TAG, _ID, _ENCODING, _TYPE, _BORN):
                raise _GiveUp  # a known field with a foreign wire type: let upb's reading decide
    if body is None:
        body = b""
    # The shape: the id lies in the system properties, the body is the message's last field and
    # comes after the id, and its length is written in the fewest bytes right before it.
    shape = None
    length = varint(len(body))
    if 0 <= id_at and id_end <= body_at - len(length) and body_at + len(body) == end \
            and raw.startswith(length, body_at - len(length)):
        shape = (raw[start:id_at], id_end - id_at, raw[id_end:body_at - len(length)])
    return topic_name, message_id, tag, body, born, shape


def plain_columns(raw: bytes):
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
