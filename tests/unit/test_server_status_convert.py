"""The gRPC shell's pure parts: error -> status mapping, protobuf <-> model conversion, and the hand
encoder of received messages held to the generated classes."""

from __future__ import annotations

import hashlib
import inspect
import zlib
from dataclasses import dataclass

import pytest
from rocketmq.grpc_protocol import definition_pb2 as pb

from chronoq.core import errors
from chronoq.core.model import Message, MessageType
from chronoq.core.validate import PROP_MESSAGE_GROUP, PROP_MESSAGE_TYPE, SYSTEM_PROPERTY_PREFIX
from chronoq.protocol.rocketmq import receive, status
from chronoq.server import convert

Code = pb.Code


def test_every_error_kind_has_a_status_code():
    kinds = {cls.kind for _, cls in inspect.getmembers(errors, inspect.isclass)
             if issubclass(cls, errors.ChronoqError)}
    assert kinds - set(status.KIND_TO_CODE) == set()
    for code in status.KIND_TO_CODE.values():
        assert code in Code.values() and code not in (Code.OK, Code.CODE_UNSPECIFIED)


@pytest.mark.parametrize("exc, code", [
    (errors.InvalidTopic("t"), Code.ILLEGAL_TOPIC),
    (errors.ReservedName("t"), Code.ILLEGAL_TOPIC),
    (errors.InvalidGroup("g"), Code.ILLEGAL_CONSUMER_GROUP),
    (errors.BodyTooLarge("b"), Code.MESSAGE_BODY_TOO_LARGE),
    (errors.BodyEmpty("b"), Code.MESSAGE_BODY_EMPTY),
    (errors.InvalidReceiptHandle("h"), Code.INVALID_RECEIPT_HANDLE),
    (errors.TopicNotFound("t"), Code.TOPIC_NOT_FOUND),
    (errors.PropertiesTooLarge("p"), Code.MESSAGE_PROPERTIES_TOO_LARGE),
    (errors.TooManyRequests("slow down"), Code.TOO_MANY_REQUESTS),
    (errors.DiskFull("full"), Code.INTERNAL_SERVER_ERROR),
    (errors.NotYetImplemented("later"), Code.NOT_IMPLEMENTED),
    (errors.Unsupported("never"), Code.UNSUPPORTED),
])
def test_chronoq_errors_keep_their_message(exc, code):
    got_code, message = status.code_and_message(exc)
    assert got_code == code and message == exc.message


def test_unexpected_exceptions_are_internal_errors_without_details(caplog):
    code, message = status.code_and_message(KeyError("secret-internal-detail"), "SendMessage")
    assert code == Code.INTERNAL_ERROR
    assert "SendMessage" in message and "secret-internal-detail" not in message
    assert "chronoq bug" in caplog.text


def _send_pb(**kw) -> pb.Message:
    sp = pb.SystemProperties(message_id=kw.pop("message_id", "01ABC"), body_encoding=pb.IDENTITY,
                             message_type=kw.pop("message_type", pb.NORMAL), **kw.pop("sp", {}))
    return pb.Message(topic=pb.Resource(name=kw.pop("topic", "orders")), body=kw.pop("body", b"hi"),
                      system_properties=sp, user_properties=kw.pop("props", None))


def test_outgoing_from_pb_normal_and_fifo():
    m = _send_pb(sp={"tag": "T", "keys": ["k1"]}, props={"a": "b"})
    m.system_properties.born_timestamp.seconds = 1_700_000_000
    out = convert.outgoing_from_pb(m, 1024)
    assert (out.topic, out.body, out.tag, tuple(out.keys), out.properties) == ("orders", b"hi", "T", ("k1",),
                                                                              {"a": "b"})
    assert out.message_id == "01ABC" and out.born_ms == 1_700_000_000_000
    assert out.message_type is MessageType.NORMAL and out.message_group is None
    fifo = convert.outgoing_from_pb(_send_pb(message_type=pb.FIFO, sp={"message_group": "g1"}), 1024)
    assert fifo.message_type is MessageType.FIFO and fifo.message_group == "g1"
    inferred = convert.outgoing_from_pb(_send_pb(message_type=pb.MESSAGE_TYPE_UNSPECIFIED,
                                                 sp={"message_group": "g2"}), 1024)
    assert inferred.message_type is MessageType.FIFO


def test_outgoing_from_pb_gzip_body():
    import gzip

    m = _send_pb(body=gzip.compress(b"x" * 100))
    m.system_properties.body_encoding = pb.GZIP
    out = convert.outgoing_from_pb(m, 1024)
    assert out.body == b"x" * 100
    m = _send_pb(body=gzip.compress(b"x" * 2000))
    m.system_properties.body_encoding = pb.GZIP
    with pytest.raises(errors.BodyTooLarge):
        convert.outgoing_from_pb(m, 1024)


@pytest.mark.parametrize("kw, exc", [
    ({"message_id": ""}, errors.InvalidMessageId),
    ({"message_type": pb.FIFO}, errors.MessageTypeMismatch),
    ({"message_type": pb.FIFO, "sp": {"message_group": ""}}, errors.InvalidMessageGroup),
    ({"sp": {"message_group": "g"}}, errors.MessageTypeMismatch),
    ({"message_type": pb.DELAY}, errors.MessageTypeMismatch),  # no delivery_timestamp
    ({"message_type": pb.TRANSACTION, "sp": {"message_group": "g"}}, errors.MessageTypeMismatch),
    ({"message_type": pb.LITE}, errors.Unsupported),
    ({"sp": {"priority": 1}}, errors.Unsupported),
])
def test_outgoing_from_pb_rejects(kw, exc):
    # Topic, body, tag, key and property rules are the broker's (test_grpc_protocol.py covers the
    # codes end to end); these are the protocol's own.
    with pytest.raises(exc):
        convert.outgoing_from_pb(_send_pb(**kw), 1024)


def test_names_are_validated_once_and_cached():
    assert convert.topic_name(pb.Resource(name="orders")) == "orders"
    assert convert.group_name(pb.Resource(name="billing")) == "billing"
    with pytest.raises(errors.InvalidTopic):
        convert.topic_name(pb.Resource(name="no spaces"))
    with pytest.raises(errors.InvalidGroup):
        convert.group_name(pb.Resource(name="CHRONOQ_internal"))
    with pytest.raises(errors.InvalidTopic):  # a bad name is never cached
        convert.topic_name(pb.Resource(name="no spaces"))


@pytest.mark.parametrize("name", ["CHRONOQ_TXN_HALF", "CHRONOQ_TXN_OP", "CHRONOQ_DELAY", "CHRONOQ_TRACE",
                                  "CHRONOQ_TIMER_CTL", "CHRONOQ_STAGE", "SCHEDULE_TOPIC_XXXX", "rmq_sys_x", "%SYS%x"])
def test_client_calls_may_not_name_internal_topics(name):
    with pytest.raises(errors.ReservedName, match="internal"):
        convert.topic_name(pb.Resource(name=name))
    with pytest.raises(errors.ReservedName):  # refused again: never cached
        convert.topic_name(pb.Resource(name=name))


def test_dead_letter_and_retry_topics_stay_open_to_clients():
    assert convert.topic_name(pb.Resource(name="%DLQ%billing")) == "%DLQ%billing"
    assert convert.topic_name(pb.Resource(name="%RETRY%billing_orders")) == "%RETRY%billing_orders"


@dataclass
class FakePopped:
    message: Message
    receipt_handle: str
    delivery_attempt: int
    invisible_until_ms: int
    message_group: str | None


def _stored(**kw) -> Message:
    base = dict(topic="orders", queue_id=2, queue_offset=7, commit_offset=100, message_id="01ID", body=b"body",
                tag="T", keys=("k",), properties={"color": "red", "__ORIGIN": "x"}, born_ms=1_700_000_000_123,
                stored_ms=1_700_000_000_456)
    base.update(kw)
    return Message(**base)


# ----------------------------------------------------------------------------- the reference encoding
def message_fields(popped, *, requested_topic: str, namespace: str, store_host: str) -> dict:
    """One popped message as the keyword form of ``apache.rocketmq.v2.Message`` (contract §2.3):
    the reference ``receive.messages_bytes`` is held to, built by the generated classes.

    Retried messages carry their original topic and id; a message read from a DLQ topic also says
    where it came from (``dead_letter_queue``).
    """
    m = popped.message
    props = m.properties
    ptype = pb.NORMAL
    sp = {
        "message_id": m.message_id,
        "body_digest": {"type": pb.MD5, "checksum": hashlib.md5(m.body).hexdigest().upper()},
        "body_encoding": pb.IDENTITY,
        "born_timestamp": _ts(m.born_ms or m.stored_ms),
        "store_timestamp": _ts(m.stored_ms),
        "store_host": store_host,
        "receipt_handle": popped.receipt_handle,
        "queue_id": m.queue_id,
        "queue_offset": m.queue_offset,
        "delivery_attempt": max(1, popped.delivery_attempt),
    }
    fields = {"topic": {"name": m.topic, "resource_namespace": namespace}, "system_properties": sp,
              "body": m.body}
    if props:
        fields["user_properties"] = {k: v for k, v in props.items() if not k.startswith(SYSTEM_PROPERTY_PREFIX)}
        tname = props.get(PROP_MESSAGE_TYPE)
        if tname is not None:
            ptype = {"NORMAL": pb.NORMAL, "FIFO": pb.FIFO, "DELAY": pb.DELAY,
                     "TRANSACTION": pb.TRANSACTION}.get(tname, pb.NORMAL)
    group = popped.message_group
    if group is None and props:
        group = props.get(PROP_MESSAGE_GROUP)
    if group:
        sp["message_group"] = group
        if ptype == pb.NORMAL:
            ptype = pb.FIFO
    sp["message_type"] = ptype
    if m.tag:
        sp["tag"] = m.tag
    if m.keys:
        sp["keys"] = m.keys
    if m.deliver_at_ms:
        sp["delivery_timestamp"] = _ts(m.deliver_at_ms)
        if ptype == pb.NORMAL:  # a delivered timer copy: clients expect DELAY (contract §5.3)
            sp["message_type"] = pb.DELAY
    if requested_topic.startswith("%DLQ%"):
        # Consumers of a DLQ topic ack against it; the origin goes in dead_letter_queue.
        sp["dead_letter_queue"] = {"topic": m.topic, "message_id": m.message_id}
        fields["topic"]["name"] = requested_topic
    return fields


def message_to_pb(popped, *, requested_topic: str, namespace: str, store_host: str):
    """``message_fields`` as an ``apache.rocketmq.v2.Message``."""
    return pb.Message(**message_fields(popped, requested_topic=requested_topic, namespace=namespace,
                                       store_host=store_host))


def _ts(ms: int) -> dict:
    return {"seconds": ms // 1000, "nanos": (ms % 1000) * 1_000_000}


def test_message_to_pb_sets_every_field_the_clients_need():
    p = FakePopped(_stored(), "handle-1", 3, 0, None)
    m = message_to_pb(p, requested_topic="orders", namespace="ns", store_host="127.0.0.1:8081")
    sp = m.system_properties
    assert m.topic.name == "orders" and m.topic.resource_namespace == "ns"
    assert dict(m.user_properties) == {"color": "red"}  # '__' properties stay inside the broker
    assert sp.message_id == "01ID" and sp.receipt_handle == "handle-1" and sp.delivery_attempt == 3
    assert sp.body_encoding == pb.IDENTITY
    assert (sp.body_digest.type, sp.body_digest.checksum) == (pb.MD5, hashlib.md5(b"body").hexdigest().upper())
    assert convert.timestamp_ms(sp.born_timestamp) == 1_700_000_000_123
    assert convert.timestamp_ms(sp.store_timestamp) == 1_700_000_000_456
    assert (sp.queue_id, sp.queue_offset, sp.tag, list(sp.keys)) == (2, 7, "T", ["k"])
    assert sp.message_type == pb.NORMAL and not sp.HasField("message_group")
    assert not sp.HasField("dead_letter_queue") and not sp.HasField("delivery_timestamp")


def test_message_to_pb_fifo_and_dlq():
    p = FakePopped(_stored(properties={"__GROUP": "g1", "__TYPE": "FIFO"}), "h", 1, 0, "g1")
    m = message_to_pb(p, requested_topic="orders", namespace="", store_host="h:1")
    assert m.system_properties.message_type == pb.FIFO and m.system_properties.message_group == "g1"
    assert not m.user_properties
    dlq = message_to_pb(FakePopped(_stored(), "h", 1, 0, None), requested_topic="%DLQ%grp",
                        namespace="", store_host="h:1")
    assert dlq.topic.name == "%DLQ%grp"
    assert (dlq.system_properties.dead_letter_queue.topic, dlq.system_properties.dead_letter_queue.message_id) == (
        "orders", "01ID")


@pytest.mark.parametrize("endpoint, scheme, host, port", [
    ("127.0.0.1:8081", pb.IPv4, "127.0.0.1", 8081),
    ("[::1]:9000", pb.IPv6, "::1", 9000),
    ("broker.example:80", pb.DOMAIN_NAME, "broker.example", 80),
])
def test_endpoints_pb(endpoint, scheme, host, port):
    e = convert.endpoints_pb(endpoint)
    assert e.scheme == scheme and [(a.host, a.port) for a in e.addresses] == [(host, port)]


def test_route_queues_accept_types():
    from chronoq.core.model import TopicConfig

    broker = pb.Broker(name="b", id=0, endpoints=convert.endpoints_pb("127.0.0.1:1"))
    mixed = convert.route_queues(TopicConfig("t", 3), "", broker)
    assert [q.id for q in mixed] == [0, 1, 2]
    assert all(q.permission == pb.READ_WRITE for q in mixed)
    assert set(mixed[0].accept_message_types) == {pb.NORMAL, pb.FIFO, pb.DELAY, pb.TRANSACTION}
    fifo = convert.route_queues(TopicConfig("t", 2, MessageType.FIFO), "", broker, (-1,))
    assert [q.id for q in fifo] == [-1] and list(fifo[0].accept_message_types) == [pb.FIFO]


# ----------------------------------------------------------------------------- hand-encoded receive
_SHAPES = [
    dict(),
    dict(tag="", keys=(), properties={}),
    dict(keys=("a", "b", "ü"), properties={"color": "red", "__ORIGIN": "x", "k2": ""}),
    dict(properties={"__GROUP": "g1", "__TYPE": "FIFO"}),
    dict(properties={"__TYPE": "TRANSACTION"}, queue_id=0, queue_offset=0),
    dict(deliver_at_ms=1_700_000_009_000, born_ms=0),
    dict(body=b"", message_id="", stored_ms=1_700_000_000_000),
    dict(body=bytes(range(256)) * 40, queue_offset=1 << 40),
]


@pytest.mark.parametrize("shape", range(len(_SHAPES)))
@pytest.mark.parametrize("requested", ["orders", "%DLQ%grp"])
@pytest.mark.parametrize("namespace,host", [("", ""), ("ns", "127.0.0.1:8081")])
def test_message_bytes_equal_the_generated_encoding(shape, requested, namespace, host):
    from rocketmq.grpc_protocol import service_pb2 as sv

    for group, attempt in ((None, 1), ("given", 3), (None, 0)):
        p = FakePopped(_stored(**_SHAPES[shape]), "0123abcd" * 6, attempt, 0, group)
        mine = receive.message_bytes(p, requested, namespace, receive.store_host_field(host))
        reference = sv.ReceiveMessageResponse(message=message_fields(
            p, requested_topic=requested, namespace=namespace, store_host=host))
        # chronoq's own receive calls carry a CRC32 digest (8 uppercase hex digits, what the Python
        # client checks), ReceiveMessage an MD5 one; everything else is the same.
        assert reference.message.system_properties.body_digest.type == pb.MD5
        # ReceiveMessage's form: the MD5 digest, as message_fields has it.
        with_md5 = receive.message_bytes(p, requested, namespace, receive.store_host_field(host), md5=True)
        assert sv.ReceiveMessageResponse.FromString(with_md5) == reference
        if len(reference.message.user_properties) <= 1:  # map order aside, the very same bytes
            assert with_md5 == reference.SerializeToString()
        reference.message.system_properties.body_digest.CopyFrom(
            pb.Digest(type=pb.CRC32, checksum=f"{zlib.crc32(p.message.body):08X}"))
        assert sv.ReceiveMessageResponse.FromString(mine) == reference
        if len(reference.message.user_properties) <= 1:
            assert mine == reference.SerializeToString()


@pytest.mark.parametrize("requested", ["orders", "%DLQ%grp"])
def test_messages_bytes_of_a_mixed_batch_equal_each_alone(requested):
    """The batch encoder carries topic and times from one message to the next: a batch that
    changes them (and every other shape) encodes as each message would alone."""
    batch = []
    for i, shape in enumerate(_SHAPES * 2):
        extra = dict(shape)
        extra.setdefault("born_ms", 1_700_000_000_000 + (i // 3) * 1000)
        extra.setdefault("stored_ms", 1_700_000_000_500 + (i // 2) * 7)
        extra.setdefault("topic", "orders" if i % 4 else "other")
        batch.append(FakePopped(_stored(**extra), f"{i:02d}" * 24, 1 + i % 3, 0, "g" if i % 5 == 0 else None))
    host = receive.store_host_field("127.0.0.1:8081")
    assert receive.messages_bytes(batch, requested, "ns", host) == [
        receive.message_bytes(p, requested, "ns", host) for p in batch]
    assert receive.messages_bytes(batch, requested, "ns", host, md5=True) == [
        receive.message_bytes(p, requested, "ns", host, md5=True) for p in batch]


def test_a_transaction_check_carries_the_half_as_a_receive_would():
    # Guards a move: the telemetry check's message was built with the generated classes in
    # chronoq.server.convert; it is receive.messages_bytes now. This is what was built there.
    half = _stored(topic="CHRONOQ_TXN_HALF", properties={"color": "red", "__TXN_TOPIC": "orders"})
    sp = pb.SystemProperties(
        message_id="01ID", body_encoding=pb.IDENTITY,
        body_digest=pb.Digest(type=pb.MD5, checksum=hashlib.md5(b"body").hexdigest().upper()),
        message_type=pb.TRANSACTION, born_timestamp=_ts(half.born_ms), store_timestamp=_ts(half.stored_ms),
        keys=["k"], delivery_attempt=1, queue_id=2, queue_offset=7, tag="T")
    want = pb.Message(topic=pb.Resource(name="orders"), user_properties={"color": "red"}, system_properties=sp,
                      body=b"body")
    got = receive.transaction_check_message(half, "orders")
    assert got == want
    assert got.SerializeToString(deterministic=True) == want.SerializeToString(deterministic=True)
