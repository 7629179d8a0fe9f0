"""SendMessageRequest by hand: the one encoder of what a producer sends (``chronoq.client.client``,
for a lone send and for a batch alike), and the reader of the SendMessageResponse it gets back
(``send_results``, at the end).

A message is written as the generated classes write it (field order topic, user properties,
system properties, body; in the system properties tag, keys, message id, encoding, type, born
time, born host, then the message group or the delivery time), so the bytes equal
``SendMessageRequest(messages=[...]).SerializeToString()`` wherever the map of user properties
keeps its order: ``tests/unit/test_wire.py`` holds it to them.

Why by hand, and why this way: the generated classes cost an object per field per message. A
message here is six pieces joined once for the whole request::

    [message key, size, topic (+ properties), system-properties key, its size, tag (+ keys), id key, id length]
    [id] [encoding, type, born time, born host] [group or delivery time] [body key, body length] [body]

Producers repeat themselves: a batch is nearly always of one topic, one tag and one type, with
only the id, the body and (FIFO, delayed) the group or the delivery time differing. So the bytes
before the id depend only on that shape and on three lengths (id, group or delivery field, body)
and are made once for each such combination and the length of what follows the id (kept across
calls, a bounded number of them: a lone send's bytes before the id are a lookup); a message with
keys or user properties has a shape of its own.
"""

from __future__ import annotations

from operator import attrgetter

from rocketmq.grpc_protocol import definition_pb2 as pb

from chronoq.core.delay_levels import DELAY_LEVEL_PROPERTY
from chronoq.protocol.rocketmq import fields as f
# (by name: the compiled build calls these as C functions, outgoing.pxd)
from chronoq.protocol.rocketmq.fields import field, string_field, timestamp

_NORMAL, _FIFO, _DELAY = pb.NORMAL, pb.FIFO, pb.DELAY
_ENCODING = f.K_SP_BODY_ENCODING + f.varint(pb.IDENTITY)
_TYPES = {t: f.K_SP_MESSAGE_TYPE + f.varint(t) for t in (_NORMAL, _FIFO, _DELAY)}
_K_GROUP, _K_DELIVERY, _K_TAG, _K_KEYS = f.K_SP_MESSAGE_GROUP, f.K_SP_DELIVERY_TIMESTAMP, f.K_SP_TAG, f.K_SP_KEYS
_K_BORN = f.K_SP_BORN_TIMESTAMP
_KB_STATUS, _KB_ENTRIES = f.K_SEND_STATUS[0], f.K_SEND_ENTRIES[0]
_KB_CODE, _KB_MESSAGE = f.K_STATUS_CODE[0], f.K_STATUS_MESSAGE[0]
_KB_ENTRY_STATUS, _KB_ID, _KB_TXID, _KB_OFFSET, _KB_RECALL = (
    f.K_ENTRY_STATUS[0], f.K_ENTRY_MESSAGE_ID[0], f.K_ENTRY_TRANSACTION_ID[0], f.K_ENTRY_OFFSET[0],
    f.K_ENTRY_RECALL_HANDLE[0])
assert all(len(k) == 1 for k in (f.K_SEND_STATUS, f.K_SEND_ENTRIES, f.K_STATUS_CODE, f.K_STATUS_MESSAGE,
                                 f.K_ENTRY_STATUS, f.K_ENTRY_RECALL_HANDLE)), "send_results reads one-byte keys"
_NAMES_CACHE_MAX = 1024
_SHAPES_MAX = 1024  # bytes before the id kept per (topic, tag, type, lengths): cleared when full
# What a message's shape is read from, in one C-level call per message.
_ATTRS = attrgetter("topic", "tag", "keys", "properties", "message_group", "deliver_at_ms", "delay_level",
                    "message_id", "body")


class SendRequestEncoder:
    """Encodes ``SendMessageRequest``s for one producer (its namespace and host): keeps the bytes
    its sends repeat (topic fields) between calls."""

    def __init__(self, namespace: str, born_host: str) -> None:
        self.namespace = namespace
        self._host = f.string_field(f.K_SP_BORN_HOST, born_host)
        self._topic_fields: dict[str, bytes] = {}
        self._born_ms: int | None = None
        self._born = b""
        self._by_type: dict[int, bytes] = {}
        # (topic, tag, type, id, tail, common and body lengths) -> (bytes before the id, the body's
        # key and length): what ``_parts`` makes of a shape, whatever the born time.
        self._shapes: dict[tuple, tuple[bytes, bytes]] = {}

    def _topic_field(self, topic: str) -> bytes:
        head = self._topic_fields.get(topic)
        if head is None:  # producers send to a few topics over and over
            if len(self._topic_fields) >= _NAMES_CACHE_MAX:
                self._topic_fields.clear()
            head = self._topic_fields[topic] = field(f.K_MESSAGE_TOPIC, f.resource(topic, self.namespace))
        return head

    def _common(self, born_ms: int, mtype: int) -> bytes:
        """Encoding, type, born time and host: the system properties after the id (sends within a
        millisecond share them; each type's made when first asked for)."""
        if born_ms != self._born_ms:
            self._born_ms, self._by_type = born_ms, {}
            self._born = field(_K_BORN, timestamp(born_ms)) + self._host
        common = self._by_type.get(mtype)
        if common is None:
            common = self._by_type[mtype] = _ENCODING + _TYPES[mtype] + self._born
        return common

    def encode(self, messages, born_ms: int, fresh_ids) -> bytes:
        """The request for ``messages`` (objects with ``topic``, ``body``, ``tag``, ``keys``,
        ``properties``, ``message_group``, ``deliver_at_ms``, ``delay_level`` and ``message_id``
        as ``chronoq.client.client.OutgoingMessage``), born at ``born_ms``. A message without an
        id takes the next of ``fresh_ids`` (an iterator of ASCII ids).

        The type is FIFO with a message group, else DELAY with a delivery time or a delay level
        (sent as the user property ``DELAY_LEVEL_PROPERTY``), else NORMAL.
        """
        pieces: list[bytes] = []
        extend = pieces.extend
        topic_fields, shapes = self._topic_fields, self._shapes
        for topic, tag, keys, props, group, deliver_at_ms, level, message_id, body in map(_ATTRS, messages):
            mid = message_id.encode() if message_id else next(fresh_ids)
            if group:
                mtype, tail = _FIFO, string_field(_K_GROUP, group)
            elif deliver_at_ms is not None:
                mtype, tail = _DELAY, field(_K_DELIVERY, timestamp(int(deliver_at_ms)))
            else:
                mtype, tail = _NORMAL, b""
            if keys or props or level:  # a shape of its own
                if level:
                    mtype = _DELAY
                    props = dict(props, **{DELAY_LEVEL_PROPERTY: str(int(level))})
                head = topic_fields.get(topic) or self._topic_field(topic)
                if props:
                    head += f.properties(props)
                sp_head = string_field(_K_TAG, tag) if tag else b""
                if keys:
                    sp_head += b"".join([string_field(_K_KEYS, k) for k in keys])
                common = self._common(born_ms, mtype)
                prefix, body_head = _parts(head, sp_head, len(common), len(mid), len(tail), len(body))
            else:
                common = self._common(born_ms, mtype)
                at = (topic, tag, mtype, len(mid), len(tail), len(common), len(body))
                shape = shapes.get(at)
                if shape is None:
                    if len(shapes) >= _SHAPES_MAX:
                        shapes.clear()
                    shape = shapes[at] = _parts(self._topic_field(topic), string_field(_K_TAG, tag) if tag else b"",
                                                len(common), len(mid), len(tail), len(body))
                prefix, body_head = shape
            if tail:
                extend((prefix, mid, common, tail, body_head, body))
            else:
                extend((prefix, mid, common, body_head, body))
        return b"".join(pieces)


def _parts(head: bytes, sp_head: bytes, common_len: int, id_len: int, tail_len: int,
           body_len: int) -> tuple[bytes, bytes]:
    """(the bytes before the id, the body's key and length) of a message: ``head`` its topic and
    user properties, ``sp_head`` its tag and keys, ``common_len`` the length of what follows the
    id (``_common``)."""
    varint = f.varint
    sp_head += f.K_SP_MESSAGE_ID + varint(id_len)
    sp_len = len(sp_head) + id_len + common_len + tail_len
    size = len(head) + 1 + len(varint(sp_len)) + sp_len
    body_head = b""
    if body_len:  # (proto3 leaves an empty body out)
        body_head = f.K_MESSAGE_BODY + varint(body_len)
        size += len(body_head) + body_len
    prefix = f.K_SEND_MESSAGES + varint(size) + head + f.K_MESSAGE_SP + varint(sp_len) + sp_head
    return prefix, body_head



# ------------------------------------------------------------------------------ the answer
def send_results(raw: bytes) -> tuple[int, str, list[tuple[int, str, str, int, str, str]]]:
    """A ``SendMessageResponse`` read by hand: ``(status code, status message, entries)``, an entry
    ``(status code, status message, message id, offset, recall handle, transaction id)`` with the
    generated classes' defaults for what is absent (0 and ""). Why: the generated class and its
    wrappers cost a lone send more than its request's encoding. As the generated parser does,
    fields of other numbers are skipped and of a singular field sent twice the last counts (a
    status is not merged: chronoq's server and RocketMQ's send one). ValueError (UnicodeDecodeError
    among them) when ``raw`` is not a well-formed message, or has a key or length over 5 bytes."""
    code, message, entries = 0, "", []
    pos, end = 0, len(raw)
    while pos < end:
        key, pos = _small(raw, pos, end)
        if key == _KB_STATUS or key == _KB_ENTRIES:
            pos, stop = _span(raw, pos, end)
            if key == _KB_STATUS:
                code, message = _status(raw, pos, stop)
            else:
                entries.append(_entry(raw, pos, stop))
            pos = stop
        else:
            pos = _skip(raw, key, pos, end)
    return code, message, entries


def _entry(raw: bytes, pos: int, end: int) -> tuple[int, str, str, int, str, str]:
    code, message, message_id, offset, recall, txid = 0, "", "", 0, "", ""
    while pos < end:
        key, pos = _small(raw, pos, end)
        if key == _KB_OFFSET:
            offset, pos = _int64(raw, pos, end)
        elif key == _KB_ENTRY_STATUS or key == _KB_ID or key == _KB_RECALL or key == _KB_TXID:
            pos, stop = _span(raw, pos, end)
            if key == _KB_ENTRY_STATUS:
                code, message = _status(raw, pos, stop)
            elif key == _KB_ID:
                message_id = raw[pos:stop].decode()
            elif key == _KB_RECALL:
                recall = raw[pos:stop].decode()
            else:
                txid = raw[pos:stop].decode()
            pos = stop
        else:
            pos = _skip(raw, key, pos, end)
    return code, message, message_id, offset, recall, txid


def _status(raw: bytes, pos: int, end: int) -> tuple[int, str]:
    code, message = 0, ""
    while pos < end:
        key, pos = _small(raw, pos, end)
        if key == _KB_CODE:
            code, pos = _int64(raw, pos, end)
            code &= 0xFFFFFFFF  # an enum, an int32 (sent sign-extended to 64 bits)
            if code >= 1 << 31:
                code -= 1 << 32
        elif key == _KB_MESSAGE:
            pos, stop = _span(raw, pos, end)
            message = raw[pos:stop].decode()
            pos = stop
        else:
            pos = _skip(raw, key, pos, end)
    return code, message


def _span(raw: bytes, pos: int, end: int) -> tuple[int, int]:
    """(start, stop) of a length-delimited value whose length varint begins at ``pos``."""
    size, pos = _small(raw, pos, end)
    if pos + size > end:
        raise ValueError("truncated field")
    return pos, pos + size


def _small(raw: bytes, pos: int, end: int) -> tuple[int, int]:
    """(value, next position) of a key's or a length's varint, at most 5 bytes (so below 2**35:
    a C integer in the compiled build)."""
    value = shift = 0
    while True:
        if pos >= end or shift > 28:
            raise ValueError("truncated varint, or a key or length over 5 bytes")
        b = raw[pos]
        pos += 1
        value |= (b & 0x7F) << shift
        if b < 0x80:
            return value, pos
        shift += 7


def _int64(raw: bytes, pos: int, end: int) -> tuple[int, int]:
    """(value, next position) of a varint read as a signed 64-bit integer, as int64 and enum fields
    are (a negative one is ten bytes, its tenth the sign bit; the bits past 64 dropped as protobuf
    drops them). Within the range of a C integer all the way in the compiled build."""
    value = shift = 0
    while True:
        if pos >= end:
            raise ValueError("truncated varint")
        b = raw[pos]
        pos += 1
        if shift == 63:
            if b >= 0x80:
                raise ValueError("overlong varint")
            return (-(0x7FFFFFFFFFFFFFFF - value) - 1 if b & 1 else value), pos  # (value - 2**63, said in range)
        value |= (b & 0x7F) << shift
        if b < 0x80:
            return value, pos
        shift += 7


def _skip(raw: bytes, key: int, pos: int, end: int) -> int:
    """The position after the value of a field this reader does not keep (its ``key`` read)."""
    wire = key & 7
    if key >> 3 == 0:
        raise ValueError("field number 0")
    if wire == 0:
        return _int64(raw, pos, end)[1]
    if wire == 2:
        size, pos = _small(raw, pos, end)
        pos += size
    elif wire == 1:
        pos += 8
    elif wire == 5:
        pos += 4
    else:  # (groups, long deprecated, and invalid types)
        raise ValueError(f"wire type {wire}")
    if pos > end:
        raise ValueError("truncated field")
    return pos
