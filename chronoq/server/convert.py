"""Protobuf (``apache.rocketmq.v2``) <-> chronoq model conversions, with request validation.

Pure functions, no I/O: the gRPC shell turns a SendMessage request's columns
(``chronoq.protocol.rocketmq.send.send_columns``, or ``send_columns`` here from the parsed request)
into the broker's with ``outgoing_batch``, and builds routes, assignments and transaction checks
with ``route_queues`` and friends; the per-message answers are encoded by hand in
``chronoq.protocol.rocketmq`` (received messages: ``receive.messages_bytes``). Everything the
official clients may send is checked here or in the broker, and every rejection is a
``chronoq.core.errors`` exception so that ``chronoq.protocol.rocketmq.status`` can turn it into the
right code.

Decoding runs per batch, column by column: each field is read once, enum values are module ints.
"""

from __future__ import annotations

import operator
from operator import is_not
import zlib
from itertools import repeat

from google.protobuf.duration_pb2 import Duration
from rocketmq.grpc_protocol import definition_pb2

from chronoq.core import errors, validate
from chronoq.broker.broker import OutgoingBatch, OutgoingMessage
from chronoq.core.delay_levels import DELAY_LEVEL_PROPERTY  # (docs/timers.md: delay levels)
from chronoq.core.model import MessageType
from chronoq.protocol.rocketmq.send import SendColumns
from chronoq.timer.deliverytime import from_client_timestamp

pb = definition_pb2
PbType = pb.MessageType
# Plain ints for the per-message paths: ``PbType.NORMAL`` is a Python-level __getattr__ call.
_UNSPECIFIED, _NORMAL, _FIFO, _DELAY, _LITE, _PRIORITY = (
    pb.MESSAGE_TYPE_UNSPECIFIED, pb.NORMAL, pb.FIFO, pb.DELAY, pb.LITE, pb.PRIORITY)
_GZIP, _IDENTITY, _ENCODING_UNSPECIFIED = pb.GZIP, pb.IDENTITY, pb.ENCODING_UNSPECIFIED
# (and chronoq's enum members: ``MessageType.DELAY`` is a slow metaclass lookup on Python 3.11)
_MT_DELAY, _MT_FIFO = MessageType.DELAY, MessageType.FIFO

MILLIS_12H = 12 * 3600 * 1000

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


def duration_pb(ms: int):
    return Duration(seconds=ms // 1000, nanos=(ms % 1000) * 1_000_000)


# ------------------------------------------------------------------------------------ names
# Names already validated: acks and receives name the same few topics and groups over and over.
_NAMES_CACHE_MAX = 10_000
_valid_topics: set[str] = set()
_valid_groups: set[str] = set()


def _validated(name: str, valid: set[str], check) -> str:
    """``name`` once ``check`` passed it, now or before (``valid`` remembers, up to the bound)."""
    if name not in valid:
        check(name)
        if len(valid) >= _NAMES_CACHE_MAX:
            valid.clear()
        valid.add(name)
    return name


def topic_name(resource) -> str:
    """The topic named by a ``Resource``; validated (ILLEGAL_TOPIC when malformed or internal to
    the broker: ``validate.client_topic``)."""
    return _validated(resource.name, _valid_topics, validate.client_topic)


def group_name(resource) -> str:
    """The consumer group named by a ``Resource``; validated (ILLEGAL_CONSUMER_GROUP)."""
    return _validated(resource.name, _valid_groups, validate.group_name)


# ------------------------------------------------------------------------------------ sending
def send_columns(messages) -> SendColumns:
    """The columns of a SendMessage request's messages read through the generated classes: what
    ``chronoq.protocol.rocketmq.send.send_columns`` reads from the bytes (held equal to this), for
    a lone message (the request is parsed already, and upb reads one message's fields in C, where
    the byte reader walks them in Python: it pays for batches only) or a request that reader
    gives up on or has no bytes of.

    One pass, message by message (a map or comprehension per column costs a frame each, which a
    lone message pays in full)."""
    cols = tuple.__new__(SendColumns, ([], [], [], [], [], [], [], [], [], [], [], [], []))  # (no Python-level call)
    topics, ids, tags, keys, bodies, borns, deliveries, types, encodings, groups, props, lites, priorities = cols
    for m in messages:
        sp = m.system_properties
        topics.append(m.topic.name)
        ids.append(sp.message_id)
        tags.append(sp.tag)  # ("" when absent)
        k = sp.keys
        keys.append(tuple(k) if k else ())  # (a tuple of none cost 3k instructions)
        bodies.append(m.body)
        born = sp.born_timestamp  # (absent: a Timestamp of 0, i.e. None below; no HasField call)
        ms = born.seconds * 1000 + born.nanos // 1_000_000
        borns.append(ms if ms > 0 else None)
        if sp.HasField("delivery_timestamp"):
            ts = sp.delivery_timestamp
            deliveries.append((ts.seconds, ts.nanos))
        else:
            deliveries.append(None)
        types.append(sp.message_type)
        encodings.append(sp.body_encoding)
        groups.append(sp.message_group if sp.HasField("message_group") else None)
        user = m.user_properties
        props.append(dict(user) if user else None)
        lites.append(sp.HasField("lite_topic"))
        priorities.append(sp.HasField("priority"))
    return cols


def outgoing_batch(cols: SendColumns, max_body_bytes: int, now_ms: int = 0,
                   max_delay_ms: int = 2 * 365 * 86_400_000) -> OutgoingBatch:
    """The broker's columns of a SendMessage request's (``send_columns``), with what the protocol
    adds checked: the message type against the fields (inferred as the clients do when
    unspecified), an id present, the body encoding (GZIP bodies decompressed), a delay level
    asked in ``DELAY_LEVEL_PROPERTY``, delivery timestamps. The broker checks every field's bytes
    when it prepares the batch (``chronoq.core.validate``: topic, body, tag, keys, properties,
    group, id), so that is done once, by the rules every entry point shares.

    Column by column: the type rule runs once per distinct combination of what decides it
    (``_type_rule``); a refusal is the first message's, in the order a message's rules run.
    """
    n = len(cols.bodies)
    ids = cols.message_ids
    if not all(ids):
        raise errors.InvalidMessageId("message_id is missing; the client must set it")
    bodies = cols.bodies
    encodings = cols.body_encodings
    if not _PLAIN_ENCODINGS.issuperset(encodings):
        bodies = list(bodies)
        for i, encoding in enumerate(encodings):
            if encoding == _GZIP:
                bodies[i] = _gunzip(bodies[i], max_body_bytes)
            elif encoding != _IDENTITY and encoding != _ENCODING_UNSPECIFIED:
                raise errors.ClientError(f"message {ids[i]}: unknown body encoding {encoding}")
    # A delay level rides in a user property (RocketMQ 5 has no field for it); docs/timers.md.
    props_in = cols.properties
    levels = None
    properties = None
    if props_in.count(None) != n:
        properties = [dict(p) if p else {} for p in props_in]
        if any(p and DELAY_LEVEL_PROPERTY in p for p in props_in):
            levels = [None] * n
            for i, p in enumerate(properties):
                if DELAY_LEVEL_PROPERTY in p:
                    levels[i] = _delay_level(p.pop(DELAY_LEVEL_PROPERTY), ids[i]) or None  # (a request, not data)
    deliveries, groups = cols.delivery_timestamps, cols.message_groups
    types, lites, priorities = cols.message_types, cols.lite_topics, cols.priorities
    no_groups, no_deliveries = groups.count(None), deliveries.count(None)
    if levels is None and types.count(types[0]) == n and no_groups in (0, n) and no_deliveries in (0, n) \
            and lites.count(lites[0]) == n and priorities.count(priorities[0]) == n:
        # Every message decides its type alike (the usual batch): the rule once.
        kind = _type_rule(types[0], not no_groups, not no_deliveries, lites[0], priorities[0], False)
        if type(kind) is not MessageType:
            raise kind(ids[0])
        mtypes = [kind] * n
        kinds = [kind]  # (the distinct types: a list, as an enum member hashes at Python level)
    else:  # (C-level maps only: no Python call per message)
        rules = list(zip(types, map(is_not, groups, repeat(None)), map(is_not, deliveries, repeat(None)),
                         lites, priorities, map(bool, levels) if levels is not None else repeat(False, n)))
        outcome = {rule: _type_rule(*rule) for rule in set(rules)}
        mtypes = list(map(outcome.__getitem__, rules))
        kinds = []
        for t in outcome.values():
            if t not in kinds:  # (by identity first: no hash)
                kinds.append(t)
        if not all(type(t) is MessageType for t in kinds):
            i, refuse = next((i, t) for i, t in enumerate(mtypes) if type(t) is not MessageType)
            raise refuse(ids[i])
    deliver_at = None
    if kinds == [_MT_DELAY] and levels is None:  # the delayed batch: every message timed
        all_nanos = list(map(_nanos, deliveries))
        deliver_at = [seconds * 1000 + nanos // 1_000_000 for seconds, nanos in deliveries]
        if min(all_nanos) < 0 or max(all_nanos) >= 1_000_000_000 or max(deliver_at) - now_ms > max_delay_ms:
            for i, ts in enumerate(deliveries):  # the timer's rule words the refusal
                deliver_at[i] = from_client_timestamp(ts[0], ts[1], now_ms, max_delay_ms)
    elif _MT_DELAY in kinds:
        deliver_at = [None] * n
        for i, (mtype, ts, level) in enumerate(zip(mtypes, deliveries, levels or repeat(None, n))):
            if mtype is _MT_DELAY and not level:
                seconds, nanos = ts
                deliver_at[i] = seconds * 1000 + nanos // 1_000_000 if 0 <= nanos < 1_000_000_000 else None
        given = [d for d in deliver_at if d is not None]
        timed = sum(1 for t, level in zip(mtypes, levels or repeat(None, n)) if t is _MT_DELAY and not level)
        if len(given) != timed or max(given, default=now_ms) - now_ms > max_delay_ms:
            for i, (mtype, ts, level) in enumerate(zip(mtypes, deliveries, levels or repeat(None, n))):
                if mtype is _MT_DELAY and not level:  # the timer's rule words the refusal
                    deliver_at[i] = from_client_timestamp(ts[0], ts[1], now_ms, max_delay_ms)
    if len(kinds) == 1 and no_groups in (0, n):  # (the usual batch: the rule once)
        refuse = _group_rule(mtypes[0], not no_groups)
        if refuse is not True:
            raise refuse(ids[0])
    else:
        pairs = list(zip(mtypes, map(is_not, groups, repeat(None))))
        group_outcome = {pair: _group_rule(*pair) for pair in set(pairs)}
        if any(v is not True for v in group_outcome.values()):
            i = next(i for i, pair in enumerate(pairs) if group_outcome[pair] is not True)
            raise group_outcome[pairs[i]](ids[i])
    if _MT_FIFO in kinds:
        for i, (mtype, group) in enumerate(zip(mtypes, groups)):
            if mtype is _MT_FIFO and not group:  # (its bytes are checked by chronoq.core.validate)
                raise errors.InvalidMessageGroup(f"message {ids[i]}: a FIFO message needs a non-empty message_group")
    tags = cols.tags
    keys = cols.keys
    return OutgoingBatch(cols.topics, bodies, tags if any(tags) else None, keys if any(keys) else None, properties,
                         ids, None, groups if groups.count(None) != n else None, cols.born_ms, mtypes,
                         deliver_at, levels)


def _type_rule(ptype: int, has_group: bool, has_ts: bool, lite: bool, priority: bool, level: bool):
    """The chronoq type of a message from what decides it, or a function of its id raising
    why it is refused: the type is inferred as the clients do when unspecified; a delay level
    makes a NORMAL message DELAY; a DELAY message needs a delivery timestamp or a level, not
    both; no other type carries either."""
    if ptype == _UNSPECIFIED:  # infer it the way the clients do
        ptype = _FIFO if has_group else _DELAY if has_ts else _NORMAL
    if lite:
        ptype = _LITE
    if ptype == _NORMAL and priority:
        ptype = _PRIORITY
    if level and ptype == _NORMAL:
        ptype = _DELAY  # the clients mark a message DELAY only with a delivery_timestamp
    mtype = _SENDABLE.get(ptype)
    if mtype is None:
        if ptype in _LATER:
            return lambda mid: errors.NotYetImplemented(_LATER[ptype])
        if ptype in _NEVER:
            return lambda mid: errors.Unsupported(_NEVER[ptype])
        return lambda mid: errors.ClientError(f"message {mid}: unknown message type {ptype}")
    if level:
        if mtype is not _MT_DELAY:
            return lambda mid: errors.MessageTypeMismatch(
                f"message {mid}: a {PbType.Name(ptype)} message may not carry {DELAY_LEVEL_PROPERTY}")
        if has_ts:
            return lambda mid: errors.InvalidDeliveryTime(
                f"message {mid}: give a delivery_timestamp or {DELAY_LEVEL_PROPERTY}, not both")
    elif mtype is _MT_DELAY:
        if not has_ts:
            return lambda mid: errors.MessageTypeMismatch(f"message {mid}: a DELAY message needs a delivery_timestamp")
    elif has_ts:
        return lambda mid: errors.MessageTypeMismatch(
            f"message {mid}: a {PbType.Name(ptype)} message may not carry a delivery_timestamp")
    return mtype


def _group_rule(mtype: MessageType, has_group: bool):
    """True, or a function of a message's id raising why it is refused: a FIFO message needs a
    message group, no other type carries one (checked after the delivery time, as ever)."""
    if mtype is _MT_FIFO:
        if not has_group:
            return lambda mid: errors.MessageTypeMismatch(f"message {mid}: a FIFO message needs a message_group")
    elif has_group:
        return lambda mid: errors.MessageTypeMismatch(
            f"message {mid}: a {mtype.name} message may not carry a message_group")
    return True


def outgoing_from_pb(msg, max_body_bytes: int, now_ms: int = 0,
                     max_delay_ms: int = 2 * 365 * 86_400_000) -> OutgoingMessage:
    """One ``apache.rocketmq.v2.Message`` of a SendMessage request as an ``OutgoingMessage``:
    ``outgoing_batch`` of a batch of one."""
    return outgoing_batch(send_columns([msg]), max_body_bytes, now_ms, max_delay_ms).message(0)


_nanos = operator.itemgetter(1)
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
