"""ReceiveMessage by hand: the ``ReceiveMessageResponse`` of every receive answer (a status, a
message, the delivery timestamp) and chronoq's ``ReceiveBatch`` that carries them in one answer.

A received message is what the POP service hands out (``chronoq.pop.service.Popped``: ``message``,
a ``chronoq.core.model.Message``, with ``receipt_handle``, ``delivery_attempt`` and
``message_group``); read by attribute, so this module needs no type from above it. Retried
messages carry their original topic and id; a message read from a DLQ topic also says where it
came from (``dead_letter_queue``). ``tests/unit/test_server_status_convert.py`` holds
``messages_bytes`` to the generated classes (the contract §2.3 reference built there).
"""

from __future__ import annotations

import binascii
import dataclasses
import hashlib
import zlib
from typing import NamedTuple

from rocketmq.grpc_protocol import definition_pb2 as pb

from chronoq.core.validate import PROP_MESSAGE_GROUP, PROP_MESSAGE_TYPE, SYSTEM_PROPERTY_PREFIX
from chronoq.protocol.rocketmq import fields as f
from chronoq.protocol.rocketmq.fields import varint

DLQ_PREFIX = "%DLQ%"
_NAMES_CACHE_MAX = 10_000
# Plain ints for the per-message paths: ``pb.MessageType.NORMAL`` is a Python-level __getattr__ call.
_UNSPECIFIED, _NORMAL, _FIFO, _DELAY, _TRANSACTION, _LITE, _PRIORITY = (
    pb.MESSAGE_TYPE_UNSPECIFIED, pb.NORMAL, pb.FIFO, pb.DELAY, pb.TRANSACTION, pb.LITE, pb.PRIORITY)
# The type a message was sent as (``PROP_MESSAGE_TYPE`` holds chronoq's MessageType name).
TYPE_BY_NAME = {"NORMAL": _NORMAL, "FIFO": _FIFO, "DELAY": _DELAY, "TRANSACTION": _TRANSACTION}
_TYPE_FIELDS = {t: (f.K_SP_MESSAGE_TYPE + varint(t) if t else b"") for t in (
    _UNSPECIFIED, _NORMAL, _FIFO, _DELAY, _TRANSACTION, _LITE, _PRIORITY)}
_SP_ENCODING_IDENTITY = f.K_SP_BODY_ENCODING + varint(pb.IDENTITY)
# chronoq's own receive calls carry a CRC32 body digest (8 uppercase hex digits, as the Python
# client checks it) where ReceiveMessage sends MD5: a quarter of the cost per message, and only
# chronoq.client.client reads these answers.
_DIGEST_CRC32_HEAD = f.K_DIGEST_TYPE + varint(pb.CRC32) + f.K_DIGEST_CHECKSUM + varint(8)
_DIGEST_CRC32 = f.K_SP_DIGEST + varint(len(_DIGEST_CRC32_HEAD) + 8) + _DIGEST_CRC32_HEAD
# ReceiveMessage's MD5 digest: 32 uppercase hex digits (what the official clients check).
_DIGEST_MD5_HEAD = f.K_DIGEST_TYPE + varint(pb.MD5) + f.K_DIGEST_CHECKSUM + varint(32)
_DIGEST_MD5 = f.K_SP_DIGEST + varint(len(_DIGEST_MD5_HEAD) + 32) + _DIGEST_MD5_HEAD


def receive_status(code: int, message: str) -> bytes:
    """A ``ReceiveMessageResponse`` carrying a status (the first of a stream, or its only one)."""
    return f.field(f.K_RECEIVE_STATUS, f.status(code, message))


def receive_delivery(now_ms: int) -> bytes:
    """A ``ReceiveMessageResponse`` carrying the delivery timestamp (the last of a stream)."""
    return f.field(f.K_RECEIVE_DELIVERY_TIMESTAMP, f.timestamp(now_ms))


def store_host_field(store_host: str) -> bytes:
    """The ``store_host`` field bytes for ``messages_bytes`` (empty for an empty host)."""
    return f.string_field(f.K_SP_STORE_HOST, store_host) if store_host else b""


def message_bytes(popped, requested_topic: str, namespace: str, store_host_field: bytes, *,
                  md5: bool = False) -> bytes:
    """``messages_bytes`` for one message."""
    return messages_bytes((popped,), requested_topic, namespace, store_host_field, md5=md5)[0]


def messages_bytes(popped_list, requested_topic: str, namespace: str, store_host_field: bytes, *,
                   md5: bool = False) -> list[bytes]:
    """A ``ReceiveMessageResponse`` carrying the message, serialized, for each popped message: the
    receive hot path of every receive call. ``store_host_field`` is ``store_host_field(host)``.

    Equal to the generated encoding up to the order of map entries. The body digest is MD5 with
    ``md5`` (ReceiveMessage: what the official clients get), else CRC32 (``zlib.crc32`` as 8
    uppercase hex digits; chronoq's own ReceiveBatch and AckAndReceive, a quarter of the cost).
    This loop works out each message's variable parts; ``_message`` writes them (the compiled
    build: receive.pxd's ``_message_in_c``, into one buffer).
    """
    text, crc32 = f.string_field, zlib.crc32
    type_fields, type_by_name, prefix = _TYPE_FIELDS, TYPE_BY_NAME, SYSTEM_PROPERTY_PREFIX
    properties, k_tag, k_keys, k_group = f.properties, f.K_SP_TAG, f.K_SP_KEYS, f.K_SP_MESSAGE_GROUP
    dlq = requested_topic.startswith(DLQ_PREFIX)
    digest_field, md5_of, hexlify = (_DIGEST_MD5 if md5 else _DIGEST_CRC32), hashlib.md5, binascii.b2a_hex
    out = []
    last_topic, head = None, b""
    for popped in popped_list:
        m = popped.message
        props = m.properties
        ptype = _NORMAL
        user = b""
        group = popped.message_group
        if props:
            user = properties([(k, v) for k, v in props.items() if not k.startswith(prefix)])
            tname = props.get(PROP_MESSAGE_TYPE)
            if tname is not None:
                ptype = type_by_name.get(tname, _NORMAL)
            if group is None:
                group = props.get(PROP_MESSAGE_GROUP)
        deliver_at_ms = m.deliver_at_ms
        if ptype == _NORMAL:
            if group:
                ptype = _FIFO
            elif deliver_at_ms:  # a delivered timer copy: clients expect DELAY (contract §5.3)
                ptype = _DELAY
        tag = m.tag
        tag_keys = text(k_tag, tag) if tag else b""
        if m.keys:
            tag_keys += b"".join(text(k_keys, k) for k in m.keys)
        body = m.body
        if dlq:
            # Consumers of a DLQ topic ack against it; the origin goes in dead_letter_queue.
            dlq_field = f.field(f.K_SP_DEAD_LETTER_QUEUE, (text(f.K_DLQ_TOPIC, m.topic) if m.topic else b"") +
                                (text(f.K_DLQ_MESSAGE_ID, m.message_id) if m.message_id else b""))
            topic = requested_topic
        else:
            dlq_field = b""
            topic = m.topic
        if topic is not last_topic:  # a batch is nearly always of one topic
            head = _topic_field(topic, namespace)
            last_topic = topic
        stored_ms = m.stored_ms
        out.append(_message(head, user, tag_keys, m.message_id.encode(), digest_field,
                            hexlify(md5_of(body).digest()).upper() if md5 else b"%08X" % crc32(body),
                            type_fields[ptype], m.born_ms or stored_ms, stored_ms, store_host_field, deliver_at_ms,
                            popped.receipt_handle.encode(), m.queue_id, m.queue_offset, popped.delivery_attempt,
                            text(k_group, group) if group else b"", dlq_field, body))
    return out


# A received message's keys and constant fields, in the order ``_message`` writes them (the C writer
# takes them as one tuple).
_KEYS = (f.K_RECEIVE_MESSAGE, f.K_MESSAGE_SP, f.K_MESSAGE_BODY, f.K_SP_MESSAGE_ID, _SP_ENCODING_IDENTITY,
         f.K_SP_BORN_TIMESTAMP, f.K_SP_STORE_TIMESTAMP, f.K_SP_DELIVERY_TIMESTAMP, f.K_SP_RECEIPT_HANDLE,
         f.K_SP_QUEUE_ID, f.K_SP_QUEUE_OFFSET, f.K_SP_DELIVERY_ATTEMPT)
# receive.pxd writes a Timestamp's two keys as these bytes (protobuf's Timestamp: seconds = 1, nanos = 2).
assert f.K_TS_SECONDS == b"\x08" and f.K_TS_NANOS == b"\x10"
_COMPILED = not __file__.endswith(".py")


def _message(head: bytes, user: bytes, tag_keys: bytes, mid: bytes, digest_field: bytes, digest: bytes,
             type_field: bytes, born_ms: int, stored_ms: int, store_host_field: bytes, deliver_at_ms: int,
             handle: bytes, queue_id: int, queue_offset: int, attempt: int, group_field: bytes, dlq_field: bytes,
             body: bytes) -> bytes:
    """One ``ReceiveMessageResponse`` carrying a message, from the parts ``messages_bytes`` works out
    (``head``: the topic field; ``user``: user properties; ``tag_keys``, ``group_field``,
    ``dlq_field``: those system property fields or empty; ``digest``: the checksum's text). The pure
    build's writer, and the one receive.pxd's ``_message_in_c`` (the compiled build's) is held to."""
    if _COMPILED:
        return _message_in_c(head, user, tag_keys, mid, digest_field, digest, type_field, born_ms,  # noqa: F821
                             stored_ms, store_host_field, deliver_at_ms, handle, queue_id, queue_offset, attempt,
                             group_field, dlq_field, body, _KEYS)
    (k_message, k_sp, k_body, k_id, encoding, k_born, k_stored, k_delivery, k_handle, k_queue, k_offset,
     k_attempt) = _KEYS
    born, stored = f.timestamp(born_ms), f.timestamp(stored_ms)
    sp = b"".join((
        tag_keys,
        f.field(k_id, mid) if mid else b"",
        digest_field, digest, encoding, type_field,
        f.field(k_born, born), f.field(k_stored, stored), store_host_field,
        f.field(k_delivery, f.timestamp(deliver_at_ms)) if deliver_at_ms else b"",
        f.field(k_handle, handle),
        k_queue + varint(queue_id) if queue_id else b"",
        k_offset, varint(queue_offset),
        k_attempt, varint(max(1, attempt)),
        group_field, dlq_field,
    ))
    message = b"".join((head, user, k_sp, varint(len(sp)), sp, k_body + varint(len(body)) if body else b"", body))
    return k_message + varint(len(message)) + message


class _Held(NamedTuple):
    """A stored message as ``messages_bytes`` reads a popped one, handed out by nobody."""
    message: object
    receipt_handle: str = ""
    delivery_attempt: int = 1
    message_group: str | None = None


def transaction_check_message(message, topic: str, namespace: str = "") -> pb.Message:
    """A stored transaction half (a ``chronoq.core.model.Message``) as the ``Message`` of a
    ``RecoverOrphanedTransactionCommand``: what ReceiveMessage would carry (``messages_bytes``,
    MD5 digest, first delivery), under its real topic ``topic``, of type TRANSACTION, with no
    receipt handle. Off the hot path (a check per unresolved half every few seconds): the
    generated class holds it, as the telemetry command that carries it is built with them."""
    props = dict(message.properties)
    props[PROP_MESSAGE_TYPE] = "TRANSACTION"
    held = _Held(dataclasses.replace(message, topic=topic, properties=props))
    [(number, raw)] = f.length_fields(message_bytes(held, "", namespace, b"", md5=True))
    assert number == f.K_RECEIVE_MESSAGE[0] >> 3, number
    out = pb.Message.FromString(bytes(raw))
    out.system_properties.ClearField("receipt_handle")  # (written empty: nobody holds it)
    return out


_topic_fields: dict[tuple[str, str], bytes] = {}


def _topic_field(topic: str, namespace: str) -> bytes:
    key = (topic, namespace)
    head = _topic_fields.get(key)
    if head is None:  # receives name the same few topics over and over
        if len(_topic_fields) >= _NAMES_CACHE_MAX:
            _topic_fields.clear()
        head = _topic_fields[key] = f.field(f.K_MESSAGE_TOPIC, f.resource(topic, namespace))
    return head


# ------------------------------------------------------------------------------ batched receive
# ``chronoq.v1.Consume/ReceiveBatch`` (chronoq.server.messaging, chronoq.client.client) answers what
# ReceiveMessage streams, in one unary response: the bytes of a message
#
#     message ReceiveBatch { repeated apache.rocketmq.v2.ReceiveMessageResponse responses = 1; }
#
# in stream order (status first, then one per message, then the delivery timestamp). No .proto
# declares it: both sides use the two functions below. Why: gRPC Python costs tens of
# microseconds of server CPU per streamed message (bench/grpc_floor.py), one unary answer a few.
K_BATCH_ITEM = f.key(1, f.LEN)


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
    for number, value in f.length_fields(blob):
        if number != 1:
            raise ValueError(f"ReceiveBatch: unexpected field {number}")
        items.append(value)
    return items
