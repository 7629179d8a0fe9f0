"""The wire contract of ``MessagingService``, checked with raw gRPC stubs against ``chronoq serve``.

These pin the exact status codes and fields the official clients depend on
(``shared/protocol/rocketmq-v2-contract.md``); the official clients themselves are driven in
``test_official_python_client.py``.
"""

from __future__ import annotations

import hashlib
import threading
import time
import uuid

import grpc
import pytest
from rocketmq.grpc_protocol import definition_pb2 as pb
from rocketmq.grpc_protocol import service_pb2 as sv
from rocketmq.grpc_protocol import service_pb2_grpc

Code = pb.Code


@pytest.fixture(scope="module")
def stub(chronoq_endpoint):
    channel = grpc.insecure_channel(chronoq_endpoint, options=[("grpc.max_send_message_length", -1)])
    try:
        yield service_pb2_grpc.MessagingServiceStub(channel)
    finally:
        channel.close()


def meta(client_id: str = "raw-test@1@1@x"):
    return (("x-mq-client-id", client_id), ("x-mq-language", "PYTHON"))


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:10]}"


def message_id() -> str:
    return "01" + uuid.uuid4().hex[:32].upper()


def send_request(topic: str, body: bytes = b"hello", **system) -> sv.SendMessageRequest:
    sp = pb.SystemProperties(message_id=system.pop("message_id", message_id()),
                             message_type=system.pop("message_type", pb.NORMAL),
                             body_encoding=pb.IDENTITY, **system)
    sp.born_timestamp.seconds = int(time.time())
    return sv.SendMessageRequest(messages=[pb.Message(topic=pb.Resource(name=topic), body=body,
                                                      system_properties=sp)])


def test_query_route_advertises_this_broker(stub, chronoq_endpoint):
    topic = unique("route")
    res = stub.QueryRoute(sv.QueryRouteRequest(topic=pb.Resource(name=topic, resource_namespace="ns")),
                          metadata=meta(), timeout=5)
    assert res.status.code == Code.OK
    host, port = chronoq_endpoint.rsplit(":", 1)
    queues = res.message_queues
    assert [q.id for q in queues] == list(range(len(queues))) and queues
    for q in queues:
        assert q.topic.name == topic and q.topic.resource_namespace == "ns"
        assert q.permission == pb.READ_WRITE
        assert q.broker.id == 0 and q.broker.name
        assert q.broker.endpoints.scheme == pb.IPv4
        assert [(a.host, a.port) for a in q.broker.endpoints.addresses] == [(host, int(port))]
        assert set(q.accept_message_types) == {pb.NORMAL, pb.FIFO, pb.DELAY, pb.TRANSACTION}


@pytest.mark.parametrize("name, code", [
    ("bad topic!", Code.ILLEGAL_TOPIC),
    ("x" * 200, Code.ILLEGAL_TOPIC),
    ("%DLQ%never-created", Code.TOPIC_NOT_FOUND),
    ("CHRONOQ_TXN_HALF", Code.ILLEGAL_TOPIC),   # the broker's internal topics exist, and are refused
    ("CHRONOQ_DELAY", Code.ILLEGAL_TOPIC),
    ("rmq_sys_wheel", Code.ILLEGAL_TOPIC),
])
def test_query_route_rejects_bad_topics(stub, name, code):
    res = stub.QueryRoute(sv.QueryRouteRequest(topic=pb.Resource(name=name)), metadata=meta(), timeout=5)
    assert res.status.code == code, res.status
    assert res.status.message and not res.message_queues


def test_query_route_topic_not_found_when_auto_create_is_off(chronoq_process):
    server = chronoq_process("auto_create_topics = false\n", name="no-auto")
    with grpc.insecure_channel(server.endpoint) as channel:
        res = service_pb2_grpc.MessagingServiceStub(channel).QueryRoute(
            sv.QueryRouteRequest(topic=pb.Resource(name="nope")), metadata=meta(), timeout=5)
    assert res.status.code == Code.TOPIC_NOT_FOUND
    assert "auto-create" in res.status.message


def test_send_echoes_the_client_message_id(stub):
    topic = unique("send")
    req = send_request(topic, tag="TagA", keys=["k1", "k2"])
    req.messages[0].user_properties["color"] = "red"
    res = stub.SendMessage(req, metadata=meta(), timeout=5)
    assert res.status.code == Code.OK, res.status
    assert len(res.entries) == 1
    entry = res.entries[0]
    assert entry.status.code == Code.OK
    assert entry.message_id == req.messages[0].system_properties.message_id
    assert entry.offset == 0
    again = stub.SendMessage(send_request(topic), metadata=meta(), timeout=5)
    assert again.entries[0].offset == 0 or again.entries[0].offset == 1  # queue chosen round robin


@pytest.mark.parametrize("case, code", [
    ("too_large", Code.MESSAGE_BODY_TOO_LARGE),
    ("empty", Code.MESSAGE_BODY_EMPTY),
    ("bad_topic", Code.ILLEGAL_TOPIC),
    ("system_topic", Code.ILLEGAL_TOPIC),
    ("bad_tag", Code.ILLEGAL_MESSAGE_TAG),
    ("bad_key", Code.ILLEGAL_MESSAGE_KEY),
    ("reserved_property", Code.ILLEGAL_MESSAGE_PROPERTY_KEY),
    ("blank_id", Code.ILLEGAL_MESSAGE_ID),
    ("long_group", Code.ILLEGAL_MESSAGE_GROUP),
    ("fifo_without_group", Code.MESSAGE_PROPERTY_CONFLICT_WITH_TYPE),
    ("normal_with_group", Code.MESSAGE_PROPERTY_CONFLICT_WITH_TYPE),
    ("too_many_properties", Code.MESSAGE_PROPERTIES_TOO_LARGE),
    ("delay_too_far", Code.ILLEGAL_DELIVERY_TIME),
    ("transaction_with_group", Code.MESSAGE_PROPERTY_CONFLICT_WITH_TYPE),
    ("priority", Code.UNSUPPORTED),
])
def test_send_rejects_bad_messages_with_the_right_code(stub, case, code):
    topic = unique("bad")
    if case == "too_large":
        req = send_request(topic, b"x" * (4 * 1024 * 1024 + 1))
    elif case == "empty":
        req = send_request(topic, b"")
    elif case == "bad_topic":
        req = send_request("no spaces allowed")
    elif case == "system_topic":
        req = send_request("%RETRY%sneaky")
    elif case == "bad_tag":
        req = send_request(topic, tag="a|b")
    elif case == "bad_key":
        req = send_request(topic, keys=["   "])  # blank (a space inside a key is allowed, as by the proxy)
    elif case == "reserved_property":
        req = send_request(topic)
        req.messages[0].user_properties["__GROUP"] = "x"
    elif case == "blank_id":
        req = send_request(topic, message_id=" ")
    elif case == "long_group":
        req = send_request(topic, message_type=pb.FIFO, message_group="g" * 64)
    elif case == "fifo_without_group":
        req = send_request(topic, message_type=pb.FIFO)
    elif case == "normal_with_group":
        req = send_request(topic, message_group="g1")
    elif case == "too_many_properties":
        req = send_request(topic)
        req.messages[0].user_properties.update({f"k{i}": "v" for i in range(129)})
    elif case == "delay_too_far":
        req = send_request(topic, message_type=pb.DELAY)
        req.messages[0].system_properties.delivery_timestamp.seconds = int(time.time()) + 3 * 365 * 86400
    elif case == "transaction_with_group":
        req = send_request(topic, message_type=pb.TRANSACTION, message_group="g1")
    elif case == "priority":
        req = send_request(topic, message_type=pb.PRIORITY, priority=3)
    res = stub.SendMessage(req, metadata=meta(), timeout=10)
    assert res.status.code == code, res.status
    assert res.status.message
    assert len(res.entries) == 1 and res.entries[0].status.code == code
    assert res.entries[0].message_id == req.messages[0].system_properties.message_id


def test_send_batch_answers_one_entry_per_message(stub):
    topic = unique("batch")
    good = send_request(topic).messages[0]
    bad = send_request(topic, b"").messages[0]
    res = stub.SendMessage(sv.SendMessageRequest(messages=[good, bad, good]), metadata=meta(), timeout=5)
    assert [e.status.code for e in res.entries] == [Code.OK, Code.MESSAGE_BODY_EMPTY, Code.OK]
    assert res.status.code == Code.MESSAGE_BODY_EMPTY  # clients read only the top-level status
    # The same id twice in one request is stored once and answered twice.
    assert res.entries[0].offset == res.entries[2].offset


def test_empty_send_request_is_a_bad_request(stub):
    res = stub.SendMessage(sv.SendMessageRequest(), metadata=meta(), timeout=5)
    assert res.status.code == Code.BAD_REQUEST


def test_an_ack_of_more_entries_than_the_limit_is_refused_whole(stub):
    from chronoq.pop.names import ACK_ENTRIES_MAX
    topic, group = unique("bigack"), unique("grp")
    assert stub.SendMessage(send_request(topic), metadata=meta(), timeout=5).status.code == Code.OK
    [m] = [r.message for r in receive(stub, group, topic) if r.WhichOneof("content") == "message"]
    sp = m.system_properties
    entry = sv.AckMessageEntry(message_id=sp.message_id, receipt_handle=sp.receipt_handle)

    def ack(n):
        return stub.AckMessage(sv.AckMessageRequest(group=pb.Resource(name=group), topic=pb.Resource(name=topic),
                                                    entries=[entry] * n), metadata=meta(), timeout=10)
    refused = ack(ACK_ENTRIES_MAX + 1)
    assert refused.status.code == Code.BAD_REQUEST and str(ACK_ENTRIES_MAX) in refused.status.message
    # Nothing was acked by the refused one: the message is still in flight, its handle live.
    req = sv.ChangeInvisibleDurationRequest(group=pb.Resource(name=group), topic=pb.Resource(name=topic),
                                            receipt_handle=sp.receipt_handle, message_id=sp.message_id)
    req.invisible_duration.seconds = 30
    changed = stub.ChangeInvisibleDuration(req, metadata=meta(), timeout=5)
    assert changed.status.code == Code.OK
    entry.receipt_handle = changed.receipt_handle
    at_limit = ack(ACK_ENTRIES_MAX)  # taken: the first entry acks, the others repeat it (done too)
    assert {e.status.code for e in at_limit.entries} == {Code.OK} and len(at_limit.entries) == ACK_ENTRIES_MAX


def test_every_settings_command_gets_a_reply(stub):
    producer = pb.Settings(client_type=pb.PRODUCER, publishing=pb.Publishing(topics=[pb.Resource(name="t1")],
                                                                              max_body_size=128 << 20))
    consumer = pb.Settings(client_type=pb.PUSH_CONSUMER, subscription=pb.Subscription(
        group=pb.Resource(name="fifo-order"),
        subscriptions=[pb.SubscriptionEntry(topic=pb.Resource(name="t1"),
                                            expression=pb.FilterExpression(type=pb.TAG, expression="*"))]))
    simple = pb.Settings(client_type=pb.SIMPLE_CONSUMER, subscription=pb.Subscription(
        group=pb.Resource(name="plain-group")))
    simple.subscription.long_polling_timeout.seconds = 5
    commands = [sv.TelemetryCommand(settings=s) for s in (producer, producer, consumer, simple)]
    replies = list(stub.Telemetry(iter(commands), metadata=meta(), timeout=10))
    assert len(replies) == 4
    for reply in replies:
        assert reply.status.code == Code.OK
        assert reply.HasField("settings") and reply.settings.HasField("metric")
    p = replies[0].settings
    assert p.publishing.max_body_size == 4 * 1024 * 1024
    assert p.publishing.validate_message_type
    assert p.backoff_policy.WhichOneof("strategy") == "exponential_backoff"
    assert p.backoff_policy.max_attempts == 3
    assert p.backoff_policy.exponential_backoff.multiplier == 2
    c = replies[2].settings
    assert c.subscription.fifo is True  # configured in the shared server's config file
    assert c.subscription.long_polling_timeout.seconds == 20
    assert c.subscription.receive_batch_size == 32
    assert c.backoff_policy.WhichOneof("strategy") == "customized_backoff"
    assert c.backoff_policy.max_attempts >= 1 and c.backoff_policy.customized_backoff.next
    s = replies[3].settings
    assert s.subscription.fifo is False
    assert s.subscription.long_polling_timeout.seconds == 5  # the client's own value is kept


def test_settings_with_a_bad_group_get_a_status(stub):
    bad = pb.Settings(client_type=pb.SIMPLE_CONSUMER, subscription=pb.Subscription(group=pb.Resource(name="a b")))
    replies = list(stub.Telemetry(iter([sv.TelemetryCommand(settings=bad)]), metadata=meta(), timeout=10))
    assert [r.status.code for r in replies] == [Code.ILLEGAL_CONSUMER_GROUP]


def test_state_a_client_makes_the_broker_keep_is_bounded_in_size(stub):
    # Each of these was kept as sent: a 1 MB namespace echoed into every queue of a cached route
    # (5 MB a call), 60 KB client ids remembered per heartbeat, 7 MB settings per Telemetry stream.
    topic = unique("bounds")
    res = stub.QueryRoute(sv.QueryRouteRequest(topic=pb.Resource(name=topic, resource_namespace="n" * 129)),
                          metadata=meta(), timeout=5)
    assert res.status.code == Code.BAD_REQUEST and "resource_namespace is 129 characters" in res.status.message
    assert not res.message_queues
    ok = stub.QueryRoute(sv.QueryRouteRequest(topic=pb.Resource(name=topic, resource_namespace="n" * 128)),
                         metadata=meta(), timeout=5)
    assert ok.status.code == Code.OK
    res = stub.QueryAssignment(sv.QueryAssignmentRequest(topic=pb.Resource(name=topic, resource_namespace="\n"),
                                                         group=pb.Resource(name="g")), metadata=meta(), timeout=5)
    assert res.status.code == Code.BAD_REQUEST

    long_id = "c" * 257
    for call, request in ((stub.Heartbeat, sv.HeartbeatRequest(client_type=pb.PRODUCER)),
                          (stub.NotifyClientTermination, sv.NotifyClientTerminationRequest())):
        res = call(request, metadata=meta(long_id), timeout=5)
        assert res.status.code == Code.BAD_REQUEST and "x-mq-client-id is 257 characters" in res.status.message
    assert stub.Heartbeat(sv.HeartbeatRequest(client_type=pb.PRODUCER), metadata=meta("c" * 256),
                          timeout=5).status.code == Code.OK
    producer = pb.Settings(client_type=pb.PRODUCER, publishing=pb.Publishing())
    replies = list(stub.Telemetry(iter([sv.TelemetryCommand(settings=producer)]), metadata=meta(long_id), timeout=10))
    assert [r.status.code for r in replies] == [Code.BAD_REQUEST]

    many = pb.Settings(client_type=pb.PRODUCER, publishing=pb.Publishing(
        topics=[pb.Resource(name=f"t{i}") for i in range(1025)]))
    huge = pb.Settings(client_type=pb.PRODUCER, publishing=pb.Publishing(
        topics=[pb.Resource(name="t" * 127, resource_namespace="n" * 400) for _ in range(200)]))
    bad_name = pb.Settings(client_type=pb.PRODUCER, publishing=pb.Publishing(topics=[pb.Resource(name="a b")]))
    replies = list(stub.Telemetry(iter([sv.TelemetryCommand(settings=s) for s in (many, huge, bad_name, producer)]),
                                  metadata=meta(), timeout=10))
    assert [r.status.code for r in replies[:4]] == [Code.BAD_REQUEST, Code.BAD_REQUEST, Code.ILLEGAL_TOPIC, Code.OK]
    assert "at most 1024" in replies[0].status.message and "at most 65536 allowed" in replies[1].status.message


def test_heartbeat_and_termination(stub):
    assert stub.Heartbeat(sv.HeartbeatRequest(client_type=pb.PRODUCER), metadata=meta(),
                          timeout=5).status.code == Code.OK
    assert stub.NotifyClientTermination(sv.NotifyClientTerminationRequest(), metadata=meta(),
                                        timeout=5).status.code == Code.OK


def test_rpcs_not_offered_answer_a_status(stub):
    q = pb.MessageQueue(topic=pb.Resource(name="t1"))
    g = pb.Resource(name="g1")
    assert stub.EndTransaction(sv.EndTransactionRequest(topic=pb.Resource(name="t1"), resolution=pb.COMMIT + 7),
                               metadata=meta(), timeout=5).status.code == Code.BAD_REQUEST  # no such resolution
    # "Not known yet" (no resolution) of a transaction that is not pending
    assert stub.EndTransaction(sv.EndTransactionRequest(topic=pb.Resource(name="t1")), metadata=meta(),
                               timeout=5).status.code == Code.INVALID_TRANSACTION_ID
    assert stub.RecallMessage(sv.RecallMessageRequest(topic=pb.Resource(name="t1"), recall_handle="x"),
                              metadata=meta(), timeout=5).status.code == Code.BAD_REQUEST  # malformed handle
    assert stub.UpdateOffset(sv.UpdateOffsetRequest(group=g, message_queue=q), metadata=meta(),
                             timeout=5).status.code == Code.NOT_IMPLEMENTED
    assert stub.GetOffset(sv.GetOffsetRequest(group=g, message_queue=q), metadata=meta(),
                          timeout=5).status.code == Code.NOT_IMPLEMENTED
    assert stub.QueryOffset(sv.QueryOffsetRequest(message_queue=q), metadata=meta(),
                            timeout=5).status.code == Code.NOT_IMPLEMENTED
    pulled = list(stub.PullMessage(sv.PullMessageRequest(group=g, message_queue=q), metadata=meta(), timeout=5))
    assert [r.status.code for r in pulled] == [Code.NOT_IMPLEMENTED]
    assert stub.SyncLiteSubscription(sv.SyncLiteSubscriptionRequest(topic=pb.Resource(name="t1"), group=g),
                                     metadata=meta(), timeout=5).status.code == Code.UNSUPPORTED


def test_query_assignment(stub):
    topic = unique("assign")
    plain = stub.QueryAssignment(sv.QueryAssignmentRequest(topic=pb.Resource(name=topic),
                                                           group=pb.Resource(name="plain-group")),
                                 metadata=meta(), timeout=5)
    assert plain.status.code == Code.OK
    assert [a.message_queue.id for a in plain.assignments] == [-1]
    assert plain.assignments[0].message_queue.broker.endpoints.addresses
    fifo = stub.QueryAssignment(sv.QueryAssignmentRequest(topic=pb.Resource(name=topic),
                                                          group=pb.Resource(name="fifo-order")),
                                metadata=meta(), timeout=5)
    assert fifo.status.code == Code.OK
    assert [a.message_queue.id for a in fifo.assignments] == list(range(len(fifo.assignments)))
    assert len(fifo.assignments) > 1


def receive(stub, group: str, topic: str, *, batch: int = 16, invisible_s: int = 30, poll_s: float = 0,
            timeout: float = 10, tag: str = "*"):
    req = sv.ReceiveMessageRequest(group=pb.Resource(name=group),
                                   message_queue=pb.MessageQueue(topic=pb.Resource(name=topic), id=0),
                                   filter_expression=pb.FilterExpression(type=pb.TAG, expression=tag),
                                   batch_size=batch, auto_renew=False)
    req.invisible_duration.seconds = invisible_s
    req.long_polling_timeout.FromMilliseconds(int(poll_s * 1000))
    return list(stub.ReceiveMessage(req, metadata=meta(), timeout=timeout))


def test_receive_stream_shape_and_message_fields(stub):
    topic, group = unique("recv"), unique("grp")
    sent = send_request(topic, b"payload-1", tag="TagA", keys=["key-1"])
    sent.messages[0].user_properties["color"] = "red"
    assert stub.SendMessage(sent, metadata=meta(), timeout=5).status.code == Code.OK
    stream = receive(stub, group, topic)
    assert stream[0].WhichOneof("content") == "status" and stream[0].status.code == Code.OK
    assert stream[-1].WhichOneof("content") == "delivery_timestamp"
    messages = [r.message for r in stream if r.WhichOneof("content") == "message"]
    assert len(messages) == 1
    m = messages[0]
    sp = m.system_properties
    assert m.topic.name == topic and m.body == b"payload-1"
    assert dict(m.user_properties) == {"color": "red"}
    assert sp.message_id == sent.messages[0].system_properties.message_id
    assert sp.body_encoding == pb.IDENTITY
    assert sp.body_digest.type == pb.MD5
    assert sp.body_digest.checksum == hashlib.md5(b"payload-1").hexdigest().upper()
    assert sp.delivery_attempt == 1
    assert sp.receipt_handle
    assert sp.tag == "TagA" and list(sp.keys) == ["key-1"]
    assert sp.message_type == pb.NORMAL
    assert sp.HasField("born_timestamp") and sp.HasField("store_timestamp") and sp.HasField("queue_offset")
    ack = stub.AckMessage(sv.AckMessageRequest(group=pb.Resource(name=group), topic=pb.Resource(name=topic),
                                               entries=[sv.AckMessageEntry(message_id=sp.message_id,
                                                                           receipt_handle=sp.receipt_handle)]),
                          metadata=meta(), timeout=5)
    assert ack.status.code == Code.OK
    again = stub.AckMessage(sv.AckMessageRequest(group=pb.Resource(name=group), topic=pb.Resource(name=topic),
                                                 entries=[sv.AckMessageEntry(message_id=sp.message_id,
                                                                             receipt_handle="garbage")]),
                            metadata=meta(), timeout=5)
    assert again.status.code == Code.INVALID_RECEIPT_HANDLE  # a failed single entry shows on top


def test_receive_serves_every_queue_and_long_polls(stub):
    topic, group = unique("poll"), unique("grp")
    for i in range(8):  # round robin spreads these over all queues
        assert stub.SendMessage(send_request(topic, b"m%d" % i), metadata=meta(), timeout=5).status.code == Code.OK
    got = []
    deadline = time.monotonic() + 10
    while len(got) < 8 and time.monotonic() < deadline:
        got += [r.message for r in receive(stub, group, topic, batch=3) if r.WhichOneof("content") == "message"]
    assert sorted(m.body for m in got) == sorted(b"m%d" % i for i in range(8))
    # Nothing left: a long poll waits about as long as asked, then answers MESSAGE_NOT_FOUND.
    start = time.monotonic()
    stream = receive(stub, group, topic, poll_s=1.0)
    took = time.monotonic() - start
    assert [r.status.code for r in stream] == [Code.MESSAGE_NOT_FOUND]
    assert 0.8 <= took < 3.0
    # A deadline shorter than the poll is honoured with a margin: no DEADLINE_EXCEEDED.
    start = time.monotonic()
    stream = receive(stub, group, topic, poll_s=20, timeout=2.5)
    assert [r.status.code for r in stream] == [Code.MESSAGE_NOT_FOUND]
    assert time.monotonic() - start < 2.5


def test_long_poll_wakes_when_a_message_arrives(stub):
    topic, group = unique("wake"), unique("grp")
    stub.QueryRoute(sv.QueryRouteRequest(topic=pb.Resource(name=topic)), metadata=meta(), timeout=5)
    result = {}

    def poll():
        start = time.monotonic()
        result["stream"] = receive(stub, group, topic, poll_s=8, timeout=12)
        result["took"] = time.monotonic() - start

    t = threading.Thread(target=poll)
    t.start()
    time.sleep(0.5)
    assert stub.SendMessage(send_request(topic, b"late"), metadata=meta(), timeout=5).status.code == Code.OK
    t.join(15)
    assert result["stream"][0].status.code == Code.OK
    assert result["took"] < 4


def test_receive_rejects_bad_requests(stub):
    topic = unique("rbad")
    assert receive(stub, "bad group!", topic)[0].status.code == Code.ILLEGAL_CONSUMER_GROUP
    assert receive(stub, "g1", "bad topic!")[0].status.code == Code.ILLEGAL_TOPIC
    assert receive(stub, "g1", topic, batch=0)[0].status.code == Code.BAD_REQUEST
    assert receive(stub, "g1", topic, invisible_s=13 * 3600)[0].status.code == Code.ILLEGAL_INVISIBLE_TIME
    req = sv.ReceiveMessageRequest(group=pb.Resource(name="g1"),
                                   message_queue=pb.MessageQueue(topic=pb.Resource(name=topic)),
                                   filter_expression=pb.FilterExpression(type=pb.SQL, expression="a > 1"),
                                   batch_size=1)
    stream = list(stub.ReceiveMessage(req, metadata=meta(), timeout=5))
    assert [r.status.code for r in stream] == [Code.UNSUPPORTED]


def test_a_receive_creates_no_topic(stub):
    """As RocketMQ's consumers, a receive on a topic nobody sent to or looked up is refused, and
    leaves nothing behind (a misspelt name used to create a topic and poll it empty for ever)."""
    topic = unique("never-sent")
    for _ in range(2):  # the second answer would be empty (not refused) had the first created it
        answers = receive(stub, "g1", topic)
        assert [a.status.code for a in answers] == [Code.TOPIC_NOT_FOUND], answers
        assert "only a send or a route lookup creates one" in answers[0].status.message


def test_internal_topics_are_refused_to_consumers(stub):
    """A consumer may not read the broker's own topics: a message sent in a transaction not yet
    committed sits in CHRONOQ_TXN_HALF (it does here), and the receive is refused, as RocketMQ's
    proxy refuses its system topics; so is an ack naming one. Dead-letter topics stay readable
    (test_official_python_client.py's DLQ tests read them)."""
    topic = unique("txn-hidden")
    half = send_request(topic, b"uncommitted", message_type=pb.TRANSACTION)
    assert stub.SendMessage(half, metadata=meta(), timeout=5).status.code == Code.OK
    for internal in ("CHRONOQ_TXN_HALF", "CHRONOQ_DELAY", "CHRONOQ_TRACE"):
        answers = receive(stub, "spy", internal, batch=32)
        assert [a.status.code for a in answers] == [Code.ILLEGAL_TOPIC], answers
        assert "internal" in answers[0].status.message
        ack = sv.AckMessageRequest(group=pb.Resource(name="spy"), topic=pb.Resource(name=internal),
                                   entries=[sv.AckMessageEntry(message_id=message_id(), receipt_handle="x")])
        assert stub.AckMessage(ack, metadata=meta(), timeout=5).status.code == Code.ILLEGAL_TOPIC
    # Nor does the topic itself hand the message out before its commit.
    assert all(not a.HasField("message") for a in receive(stub, "reader", topic, batch=32))


def test_change_invisible_duration_returns_a_new_handle(stub):
    topic, group = unique("cid"), unique("grp")
    stub.SendMessage(send_request(topic, b"x"), metadata=meta(), timeout=5)
    m = [r.message for r in receive(stub, group, topic) if r.WhichOneof("content") == "message"][0]
    old = m.system_properties.receipt_handle

    def change(handle, seconds):
        req = sv.ChangeInvisibleDurationRequest(group=pb.Resource(name=group), topic=pb.Resource(name=topic),
                                                receipt_handle=handle,
                                                message_id=m.system_properties.message_id)
        req.invisible_duration.seconds = seconds
        return stub.ChangeInvisibleDuration(req, metadata=meta(), timeout=5)

    res = change(old, 0)  # 0 s is allowed (Node nacks that way)
    assert res.status.code == Code.OK and res.receipt_handle and res.receipt_handle != old
    stale = change(old, 5)
    assert stale.status.code == Code.INVALID_RECEIPT_HANDLE
    assert stale.receipt_handle == old  # handed back, so the Python client keeps a usable handle
    assert change(res.receipt_handle, 13 * 3600).status.code == Code.ILLEGAL_INVISIBLE_TIME
    # Visible again at once: received with the next attempt number.
    again = []
    deadline = time.monotonic() + 5
    while not again and time.monotonic() < deadline:
        again = [r.message for r in receive(stub, group, topic, poll_s=1) if r.WhichOneof("content") == "message"]
    assert again and again[0].system_properties.delivery_attempt == 2


def test_messages_of_an_abandoned_receive_come_back_at_once(stub, chronoq_endpoint):
    topic, group = unique("abandon"), unique("grp")
    body = b"z" * (1 << 20)  # 1 MiB each: the stream cannot finish before the client reads it...
    for _ in range(8):
        assert stub.SendMessage(send_request(topic, body), metadata=meta(), timeout=10).status.code == Code.OK
    # ...as long as the client's window stays small: grpcio grows it with the bandwidth it sees
    # (BDP probes), and a window of 8 MiB would let the server hand over the whole batch, which
    # then counts as received (what was handed over is not taken back). The server's flow
    # control is what keeps the rest of the batch from leaving.
    channel = grpc.insecure_channel(chronoq_endpoint, options=[("grpc.http2.bdp_probe", 0)])
    stub = service_pb2_grpc.MessagingServiceStub(channel)
    req = sv.ReceiveMessageRequest(group=pb.Resource(name=group),
                                   message_queue=pb.MessageQueue(topic=pb.Resource(name=topic)),
                                   filter_expression=pb.FilterExpression(type=pb.TAG, expression="*"),
                                   batch_size=32, auto_renew=False)
    req.invisible_duration.seconds = 60
    got = 0
    deadline = time.monotonic() + 10
    while got == 0 and time.monotonic() < deadline:  # the first receive may see only some queues
        call = stub.ReceiveMessage(req, metadata=meta(), timeout=10)
        first = next(call)
        if first.status.code == Code.OK:
            next(call)  # one message, then the client goes away
            got = 1
        call.cancel()
    assert got
    # Everything comes back long before the 60 s invisible time would end.
    back = []
    deadline = time.monotonic() + 10
    while len(back) < 8 and time.monotonic() < deadline:
        back += [r.message for r in receive(stub, group, topic, poll_s=1, invisible_s=60, timeout=20)
                 if r.WhichOneof("content") == "message"]
    assert len(back) == 8
    assert all(m.system_properties.delivery_attempt >= 1 for m in back)
    channel.close()


def test_sigterm_answers_parked_polls_and_stops_cleanly(chronoq_process):
    server = chronoq_process(name="stopping")
    result = {}
    done = threading.Event()

    def commands():  # an open Telemetry stream, as every client keeps one
        yield sv.TelemetryCommand(settings=pb.Settings(client_type=pb.PRODUCER, publishing=pb.Publishing()))
        done.wait(30)

    with grpc.insecure_channel(server.endpoint) as channel:
        s = service_pb2_grpc.MessagingServiceStub(channel)
        telemetry = s.Telemetry(commands(), metadata=meta(), timeout=60)
        s.QueryRoute(sv.QueryRouteRequest(topic=pb.Resource(name="t1")), metadata=meta(), timeout=5)  # (creates it)

        def poll():
            result["stream"] = receive(s, "g1", "t1", poll_s=20, timeout=30)

        t = threading.Thread(target=poll)
        t.start()
        try:
            assert next(telemetry).status.code == Code.OK
            time.sleep(1.0)  # the poll is parked now
            start = time.monotonic()
            assert server.stop() == 0  # and the helper checks "chronoq stopped cleanly"
            t.join(10)
            assert time.monotonic() - start < 8
        finally:
            done.set()
    assert [r.status.code for r in result["stream"]] == [Code.MESSAGE_NOT_FOUND]


@pytest.mark.parametrize("groups_toml, complaint", [
    ('[groups.g1]\nretries = 3\n', "unknown setting 'retries'"),
    ('[groups.g1]\nfifo = "yes"\n', "fifo must be bool"),
    ('[groups."bad name"]\nfifo = true\n', "consumer group name"),
])
def test_bad_group_config_refuses_to_start_and_says_why(chronoq_process, groups_toml, complaint):
    with pytest.raises(RuntimeError) as info:
        chronoq_process(groups_toml, name="badcfg")
    assert complaint in str(info.value)
    assert "cannot start" in str(info.value)


def test_end_transaction_refuses_unknown_or_malformed_ids(stub):
    topic = unique("txn")
    for txid in ("", "zz", "7fffffff"):
        res = stub.EndTransaction(sv.EndTransactionRequest(
            topic=pb.Resource(name=topic), message_id="01ABC", transaction_id=txid, resolution=pb.COMMIT,
            source=pb.SOURCE_CLIENT), metadata=meta(), timeout=5)
        assert res.status.code == Code.INVALID_TRANSACTION_ID, res.status
        assert res.status.message
