"""Protobuf (``apache.rocketmq.v2``) <-> chronoq model conversions, with request validation.

Pure functions, no I/O: the gRPC shell decodes a sent message with ``outgoing_from_pb`` (or a
plain batch's columns with ``plain_batch``) and builds routes, assignments and transaction checks
with ``route_queues`` and friends; the per-message answers are encoded by hand in
``chronoq.protocol.rocketmq`` (received messages: ``receive.messages_bytes``). Everything the
official clients may send is checked here or in the broker, and every rejection is a
``chronoq.core.errors`` exception so that ``chronoq.protocol.rocketmq.status`` can turn it into the
right code.

Decoding runs once per message sent: each field is read once, enum values are module ints.
"""

from __future__ import annotations

import dataclasses
import operator
import zlib

from google.protobuf.duration_pb2 import Duration
from google.protobuf.timestamp_pb2 import Timestamp
from rocketmq.grpc_protocol import definition_pb2

from chronoq.core import errors, validate
from chronoq.broker.broker import OutgoingMessage
from chronoq.core.model import MessageType
from chronoq.timer.deliverytime import from_client_timestamp

pb = definition_pb2
PbType = pb.MessageType
# Plain ints for the per-message paths: ``PbType.NORMAL`` is a Python-level __getattr__ call.
_UNSPECIFIED, _NORMAL, _FIFO, _DELAY, _LITE, _PRIORITY = (
    pb.MESSAGE_TYPE_UNSPECIFIED, pb.NORMAL, pb.FIFO, pb.DELAY, pb.LITE, pb.PRIORITY)
_GZIP, _IDENTITY, _ENCODING_UNSPECIFIED = pb.GZIP, pb.IDENTITY, pb.ENCODING_UNSPECIFIED
# (and chronoq's enum members: ``MessageType.DELAY`` is a slow metaclass lookup on Python 3.11)
_MT_DELAY, _MT_FIFO = MessageType.DELAY, MessageType.FIFO
_OUTGOING_FIELDS = ("topic", "body", "tag", "keys", "properties", "message_id", "queue_id", "message_group",
                    "born_ms", "message_type", "deliver_at_ms", "delay_level")
assert tuple(f.name for f in dataclasses.fields(OutgoingMessage)) == _OUTGOING_FIELDS  # outgoing_from_pb's order

MILLIS_12H = 12 * 3600 * 1000
# User property asking for a delay level (1..N of timer_delay_levels; "0": none). RocketMQ 5's
# protocol has no delay-level field; RocketMQ 4 clients used the property "DELAY". chronoq takes a
# name of its own so no existing user property changes meaning (docs/timers.md).
DELAY_LEVEL_PROPERTY = "CHRONOQ_DELAY_LEVEL"

# Message types a producer may send today. DELAY and TRANSACTION come with the timer and
# transaction issues; LITE and PRIORITY are not planned.
_SENDABLE = {
    PbType.NORMAL: MessageType.NORMAL,
    PbType.FIFO: MessageType.FIFO,
    PbType.TRANSACTION: MessageType.TRANSACTION,
    PbType.DELAY: MessageType.DELAY,
}
_LATER: dict = {}
_NEVER = {
    PbType.LITE: "lite topics are not supported by chronoq",
    PbType.PRIORITY: "priority messages are not supported by chronoq",
}


# ------------------------------------------------------------------------------------ time
def timestamp_ms(ts) -> int:
    """Epoch milliseconds of a ``google.protobuf.Timestamp``."""
    return ts.seconds * 1000 + ts.nanos // 1_000_000


def duration_ms(d) -> int:
    return d.seconds * 1000 + d.nanos // 1_000_000


def timestamp_pb(ms: int):
    return Timestamp(seconds=ms // 1000, nanos=(ms % 1000) * 1_000_000)


def duration_pb(ms: int):
    return Duration(seconds=ms // 1000, nanos=(ms % 1000) * 1_000_000)


# ------------------------------------------------------------------------------------ names
# Names already validated: acks and receives name the same few topics and groups over and over.
_NAMES_CACHE_MAX = 10_000
_valid_topics: set[str] = set()
_valid_groups: set[str] = set()


def topic_name(resource) -> str:
    """The topic named by a ``Resource``; validated (ILLEGAL_TOPIC when malformed)."""
    name = resource.name
    if name not in _valid_topics:
        validate.topic_name(name)
        if len(_valid_topics) >= _NAMES_CACHE_MAX:
            _valid_topics.clear()
        _valid_topics.add(name)
    return name


def group_name(resource) -> str:
    """The consumer group named by a ``Resource``; validated (ILLEGAL_CONSUMER_GROUP)."""
    name = resource.name
    if name not in _valid_groups:
        validate.group_name(name)
        if len(_valid_groups) >= _NAMES_CACHE_MAX:
            _valid_groups.clear()
        _valid_groups.add(name)
    return name


# ------------------------------------------------------------------------------------ sending
def outgoing_from_pb(msg, max_body_bytes: int, now_ms: int = 0,
                     max_delay_ms: int = 2 * 365 * 86_400_000) -> OutgoingMessage:
    """Decode one ``apache.rocketmq.v2.Message`` of a SendMessage request.

    Checks what the protocol adds (message type against the fields, id present, encoding). The
    broker checks every field's bytes when it prepares the message (``chronoq.core.validate``: topic,
    body, tag, keys, properties, group, id), so that is done once, by the rules every entry
    point shares.
    Runs once per message sent: each field is read once, and enum values are module ints.
    """
    sp = msg.system_properties
    message_id = sp.message_id
    if not message_id:
        raise errors.InvalidMessageId("message_id is missing; the client must set it")
    body = msg.body
    encoding = sp.body_encoding
    if encoding == _GZIP:
        body = _gunzip(body, max_body_bytes)
    elif encoding != _IDENTITY and encoding != _ENCODING_UNSPECIFIED:
        raise errors.ClientError(f"message {message_id}: unknown body encoding {encoding}")
    ptype = sp.message_type
    has_group = sp.HasField("message_group")
    has_ts = sp.HasField("delivery_timestamp")
    if ptype == _UNSPECIFIED:  # infer it the way the clients do
        ptype = _FIFO if has_group else _DELAY if has_ts else _NORMAL
    if sp.HasField("lite_topic"):
        ptype = _LITE
    if ptype == _NORMAL and sp.HasField("priority"):
        ptype = _PRIORITY
    # A delay level rides in a user property (RocketMQ 5 has no field for it); docs/timers.md.
    props = msg.user_properties
    delay_level = _delay_level(props[DELAY_LEVEL_PROPERTY], message_id) \
        if props and DELAY_LEVEL_PROPERTY in props else None
    if delay_level and ptype == _NORMAL:
        ptype = _DELAY  # the clients mark a message DELAY only with a delivery_timestamp
    mtype = _SENDABLE.get(ptype)
    if mtype is None:
        if ptype in _LATER:
            raise errors.NotYetImplemented(_LATER[ptype])
        if ptype in _NEVER:
            raise errors.Unsupported(_NEVER[ptype])
        raise errors.ClientError(f"message {message_id}: unknown message type {ptype}")
    deliver_at_ms = None
    if delay_level:
        if mtype is not _MT_DELAY:
            raise errors.MessageTypeMismatch(
                f"message {message_id}: a {PbType.Name(ptype)} message may not carry {DELAY_LEVEL_PROPERTY}")
        if has_ts:
            raise errors.InvalidDeliveryTime(
                f"message {message_id}: give a delivery_timestamp or {DELAY_LEVEL_PROPERTY}, not both")
    elif mtype is _MT_DELAY:
        if not has_ts:
            raise errors.MessageTypeMismatch(f"message {message_id}: a DELAY message needs a delivery_timestamp")
        ts = sp.delivery_timestamp
        deliver_at_ms = from_client_timestamp(ts.seconds, ts.nanos, now_ms, max_delay_ms)
    elif has_ts:
        raise errors.MessageTypeMismatch(
            f"message {message_id}: a {PbType.Name(ptype)} message may not carry a delivery_timestamp")
    group = None
    if mtype is _MT_FIFO:
        if not has_group:
            raise errors.MessageTypeMismatch(f"message {message_id}: a FIFO message needs a message_group")
        group = sp.message_group
        if not group:  # (its bytes are checked by chronoq.core.validate when the broker prepares it)
            raise errors.InvalidMessageGroup(f"message {message_id}: a FIFO message needs a non-empty message_group")
    elif has_group:
        raise errors.MessageTypeMismatch(
            f"message {message_id}: a {mtype.name} message may not carry a message_group")
    born_ms = None
    if sp.HasField("born_timestamp"):
        born = sp.born_timestamp
        born_ms = born.seconds * 1000 + born.nanos // 1_000_000
        if born_ms <= 0:
            born_ms = None
    properties = dict(props) if props else {}
    if delay_level is not None:
        del properties[DELAY_LEVEL_PROPERTY]  # a request, not data: the delivered copy drops it
    keys = sp.keys
    # Positional (see _OUTGOING_FIELDS): half the cost of keywords, once per message sent.
    return OutgoingMessage(msg.topic.name, body, sp.tag if sp.HasField("tag") else "", tuple(keys) if keys else (),
                           properties, message_id, None, group, born_ms, mtype, deliver_at_ms, delay_level or None)


def plain_batch(messages) -> tuple[str, list[str], list[str], list[bytes], list[int | None]] | None:
    """The messages of a SendMessage request as columns (topic, ids, tags, bodies, born ms or
    None) when every one is plain: one topic, NORMAL (or unspecified and nothing that makes
    it another type), an uncompressed body, no keys, user properties, group, delivery time,
    lite topic or priority. Else None: ``outgoing_from_pb`` message by message decides (and
    words the errors). What ``outgoing_from_pb`` leaves to the broker (id, tag, body, topic
    rules) ``Broker.write_plain`` checks.
    """
    # Column by column through map/attrgetter: the iteration runs in C, no bytecode per message.
    sps = list(map(_get_sp, messages))
    if (len(set(map(_get_topic, messages))) != 1 or not _PLAIN_TYPES.issuperset(map(_get_type, sps))
            or not _PLAIN_ENCODINGS.issuperset(map(_get_encoding, sps))
            or any(map(_get_user_properties, messages)) or any(map(_get_keys, sps))
            or any(map(_has_group, sps)) or any(map(_has_delivery, sps)) or any(map(_has_lite, sps))
            or any(map(_has_priority, sps))):
        return None
    # born_timestamp unset reads 0, which means none (as in outgoing_from_pb)
    borns = [ms if (ms := seconds * 1000 + nanos // 1_000_000) > 0 else None
             for seconds, nanos in zip(map(_get_born_seconds, sps), map(_get_born_nanos, sps))]
    return (messages[0].topic.name, list(map(_get_id, sps)), list(map(_get_tag, sps)),  # (tag: "" when absent)
            list(map(_get_body, messages)), borns)


_get_sp, _get_topic, _get_body = (operator.attrgetter("system_properties"), operator.attrgetter("topic.name"),
                                  operator.attrgetter("body"))
_get_user_properties = operator.attrgetter("user_properties")
_get_type, _get_encoding, _get_keys, _get_id, _get_tag = map(
    operator.attrgetter, ("message_type", "body_encoding", "keys", "message_id", "tag"))
_get_born_seconds, _get_born_nanos = map(operator.attrgetter, ("born_timestamp.seconds", "born_timestamp.nanos"))
_has_group, _has_delivery, _has_lite, _has_priority = (
    operator.methodcaller("HasField", name)
    for name in ("message_group", "delivery_timestamp", "lite_topic", "priority"))
_PLAIN_TYPES = frozenset((_NORMAL, _UNSPECIFIED))
_PLAIN_ENCODINGS = frozenset((_IDENTITY, _ENCODING_UNSPECIFIED))


def _delay_level(text: str, message_id: str) -> int:
    """The value of ``DELAY_LEVEL_PROPERTY``: a whole number; 0 means no delay. The broker checks
    that the level exists (``InvalidDeliveryTime`` naming the table)."""
    value = text.strip()
    if not (value.isascii() and value.isdigit()) or len(value) > 4:
        raise errors.InvalidDeliveryTime(
            f"message {message_id}: {DELAY_LEVEL_PROPERTY} must be a delay level (a whole number, 0 for none), "
            f"not {text[:40]!r}")
    return int(value)


def _gunzip(data: bytes, limit: int) -> bytes:
    try:
        d = zlib.decompressobj(wbits=47)  # gzip or zlib header, as the clients accept both
        out = d.decompress(data, limit + 1)
    except zlib.error as exc:
        raise errors.ClientError(f"GZIP body could not be decompressed: {exc}") from None
    if len(out) > limit:
        raise errors.BodyTooLarge(f"the decompressed body exceeds {limit} bytes")
    return out


# ------------------------------------------------------------------------------------ routes
def endpoints_pb(endpoint: str):
    """``Endpoints`` for an advertised ``host:port`` (IPv4, bracketed IPv6 or a DNS name)."""
    host, sep, port_text = endpoint.rpartition(":")
    if not sep or not port_text.isdigit():
        raise errors.ClientError(f"advertised address {endpoint!r} is not host:port")
    if host.startswith("[") and host.endswith("]"):
        host, scheme = host[1:-1], pb.IPv6
    elif _is_ipv4(host):
        scheme = pb.IPv4
    elif ":" in host:
        scheme = pb.IPv6
    else:
        scheme = pb.DOMAIN_NAME
    return pb.Endpoints(scheme=scheme, addresses=[pb.Address(host=host, port=int(port_text))])


def _is_ipv4(host: str) -> bool:
    parts = host.split(".")
    return len(parts) == 4 and all(p.isdigit() and 0 <= int(p) <= 255 for p in parts)


_ACCEPT_ALL = (PbType.NORMAL, PbType.FIFO, PbType.DELAY, PbType.TRANSACTION)


def accept_types(topic_type: MessageType) -> tuple[int, ...]:
    """Message types a topic's queues accept, as listed in the route (contract §2.1)."""
    if topic_type is MessageType.MIXED:
        return _ACCEPT_ALL
    return (int(topic_type),)


def route_queues(topic_cfg, namespace: str, broker: "pb.Broker", queue_ids=None) -> list:
    """``MessageQueue``s of a topic: ids from 0, all READ_WRITE, all on this broker."""
    resource = pb.Resource(name=topic_cfg.name, resource_namespace=namespace)
    types = accept_types(topic_cfg.message_type)
    ids = range(topic_cfg.queues) if queue_ids is None else queue_ids
    return [pb.MessageQueue(topic=resource, id=i, permission=pb.READ_WRITE, broker=broker,
                            accept_message_types=types) for i in ids]
