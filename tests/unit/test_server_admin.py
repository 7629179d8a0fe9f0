"""``chronoq.v1.Admin`` servicer (``chronoq.server.admin``) over a real Broker + PopService, no
network: every bad request is answered with a status code, never an exception; lag and
in-flight follow receives and acks."""

from __future__ import annotations

import asyncio
import logging

import pytest
from popkit import loop_turns_during, opened_node

from chronoq.proto import chronoq_admin_pb2 as apb
from chronoq.server import admin
from chronoq.protocol.rocketmq.status import Code


@pytest.fixture
def node(tmp_path):
    yield from opened_node(tmp_path)


@pytest.fixture
def svc(node):
    return admin.AdminService(node.broker, node.pop)


def call(svc, method: str, request):
    return asyncio.run(getattr(svc, method)(request, None))


def create_topic(svc, name: str, queues: int = 0, message_type: str = ""):
    return call(svc, "CreateTopic", apb.CreateTopicRequest(
        topic=apb.Topic(name=name, queues=queues, message_type=message_type)))


def list_groups(svc, group: str = "", topic: str = ""):
    return call(svc, "ListGroups", apb.ListGroupsRequest(group=group, topic=topic))


def test_create_topic_defaults_to_mixed_and_is_idempotent(svc, node):
    r = create_topic(svc, "orders")
    assert r.status.code == Code.OK
    assert (r.topic.name, r.topic.queues, r.topic.message_type) == ("orders", node.broker.config.default_queues,
                                                                    "mixed")
    r = create_topic(svc, "orders", queues=8, message_type="NORMAL")
    assert (r.status.code, r.topic.queues, r.topic.message_type) == (Code.OK, 8, "normal")
    r = create_topic(svc, "orders")  # 0 / "": keep what the topic has
    assert (r.status.code, r.topic.queues, r.topic.message_type) == (Code.OK, 8, "normal")
    listed = call(svc, "ListTopics", apb.ListTopicsRequest())
    assert listed.status.code == Code.OK
    assert [(t.name, t.queues, t.message_type) for t in listed.topics] == [("orders", 8, "normal")]


@pytest.mark.parametrize("request_, code", [
    (apb.CreateTopicRequest(), Code.BAD_REQUEST),
    (apb.CreateTopicRequest(topic=apb.Topic(name="")), Code.ILLEGAL_TOPIC),
    (apb.CreateTopicRequest(topic=apb.Topic(name="bad name")), Code.ILLEGAL_TOPIC),
    (apb.CreateTopicRequest(topic=apb.Topic(name="orders\n")), Code.ILLEGAL_TOPIC),
    (apb.CreateTopicRequest(topic=apb.Topic(name="x" * 128)), Code.ILLEGAL_TOPIC),
    (apb.CreateTopicRequest(topic=apb.Topic(name="%DLQ%g")), Code.ILLEGAL_TOPIC),
    (apb.CreateTopicRequest(topic=apb.Topic(name="CHRONOQ_TXN_HALF")), Code.ILLEGAL_TOPIC),
    (apb.CreateTopicRequest(topic=apb.Topic(name="t", queues=-1)), Code.BAD_REQUEST),
    (apb.CreateTopicRequest(topic=apb.Topic(name="t", queues=1_000_000)), Code.BAD_REQUEST),
    (apb.CreateTopicRequest(topic=apb.Topic(name="t", message_type="lite")), Code.BAD_REQUEST),
])
def test_create_topic_refuses_bad_input(svc, node, request_, code):
    r = call(svc, "CreateTopic", request_)
    assert r.status.code == code, r.status.message
    assert r.status.message
    assert node.broker.list_topics() == []  # nothing was created


def test_topic_queues_only_grow(svc):
    create_topic(svc, "orders", queues=4)
    r = create_topic(svc, "orders", queues=2)
    assert r.status.code == Code.BAD_REQUEST
    assert "only grow" in r.status.message


def test_create_group_sets_only_what_is_flagged(svc, node):
    r = call(svc, "CreateGroup", apb.CreateGroupRequest(group=apb.Group(name="billing")))
    assert (r.status.code, r.group.fifo, r.group.max_attempts) == (Code.OK, False, 17)
    r = call(svc, "CreateGroup", apb.CreateGroupRequest(group=apb.Group(name="billing", fifo=True, max_attempts=3),
                                                        set_fifo=True, set_max_attempts=True))
    assert (r.status.code, r.group.fifo, r.group.max_attempts) == (Code.OK, True, 3)
    r = call(svc, "CreateGroup", apb.CreateGroupRequest(group=apb.Group(name="billing"), set_fifo=True))
    assert (r.status.code, r.group.fifo, r.group.max_attempts) == (Code.OK, False, 3)
    assert node.pop.group("billing").max_attempts == 3


@pytest.mark.parametrize("request_, code", [
    (apb.CreateGroupRequest(), Code.BAD_REQUEST),
    (apb.CreateGroupRequest(group=apb.Group(name="")), Code.ILLEGAL_CONSUMER_GROUP),
    (apb.CreateGroupRequest(group=apb.Group(name="a b")), Code.ILLEGAL_CONSUMER_GROUP),
    (apb.CreateGroupRequest(group=apb.Group(name="CHRONOQ_x")), Code.ILLEGAL_CONSUMER_GROUP),
    (apb.CreateGroupRequest(group=apb.Group(name="g", fifo=True)), Code.BAD_REQUEST),
    (apb.CreateGroupRequest(group=apb.Group(name="g", max_attempts=3)), Code.BAD_REQUEST),
    (apb.CreateGroupRequest(group=apb.Group(name="g", max_attempts=0), set_max_attempts=True), Code.BAD_REQUEST),
    (apb.CreateGroupRequest(group=apb.Group(name="g", max_attempts=1001), set_max_attempts=True),
     Code.BAD_REQUEST),
])
def test_create_group_refuses_bad_input(svc, node, request_, code):
    r = call(svc, "CreateGroup", request_)
    assert r.status.code == code, r.status.message
    assert node.pop.list_groups() == []


def test_list_groups_reports_lag_and_inflight(svc, node):
    create_topic(svc, "orders", queues=2)
    call(svc, "CreateGroup", apb.CreateGroupRequest(group=apb.Group(name="billing")))
    for i in range(10):
        node.broker.send("orders", f"m{i}".encode())
    r = list_groups(svc)
    assert r.status.code == Code.OK
    assert [(g.group.name, g.topic, g.lag, g.inflight) for g in r.groups] == [("billing", "", 0, 0)]
    r = list_groups(svc, topic="orders")  # named topic: reported before the first receive
    assert [(g.group.name, g.topic, g.lag, g.inflight) for g in r.groups] == [("billing", "orders", 10, 0)]

    got = node.pop.receive("billing", "orders", max_messages=4, invisible_ms=30_000)
    assert len(got) == 4
    r = list_groups(svc)
    assert [(g.topic, g.lag, g.inflight) for g in r.groups] == [("orders", 6, 4)]
    for p in got[:3]:
        node.pop.ack("billing", "orders", p.receipt_handle)
    r = list_groups(svc, group="billing")
    assert [(g.topic, g.lag, g.inflight) for g in r.groups] == [("orders", 6, 1)]


def test_list_groups_includes_offset_only_groups(svc, node):
    node.broker.send("orders", b"x")
    node.broker.commit_offset("puller", "orders", 0, 0)
    r = list_groups(svc)
    rows = {g.group.name: (g.group.max_attempts, g.topic, g.lag) for g in r.groups}
    assert rows == {"puller": (17, "orders", node.pop.lag("puller", "orders"))}


@pytest.mark.parametrize("group, topic, code", [
    ("nope", "", Code.CONSUMER_GROUP_NOT_FOUND),
    ("bad group", "", Code.ILLEGAL_CONSUMER_GROUP),
    ("", "nope", Code.TOPIC_NOT_FOUND),
    ("", "bad topic", Code.ILLEGAL_TOPIC),
    ("", "%RETRY%g_t", Code.ILLEGAL_TOPIC),
])
def test_list_groups_refuses_bad_filters(svc, group, topic, code):
    r = list_groups(svc, group, topic)
    assert r.status.code == code, r.status.message
    assert not r.groups


def test_internal_errors_become_a_status_without_details(svc, node, monkeypatch, caplog):
    def boom(*a, **k):
        raise RuntimeError("secret detail")

    monkeypatch.setattr(node.broker, "list_topics", boom)
    with caplog.at_level(logging.ERROR, logger="chronoq.server"):
        r = call(svc, "ListTopics", apb.ListTopicsRequest())
    assert r.status.code == Code.INTERNAL_ERROR
    assert "secret" not in r.status.message
    assert "RuntimeError" in caplog.text


def test_stopping_broker_answers_a_status(svc, node):
    node.close()
    r = create_topic(svc, "orders")
    assert r.status.code == Code.INTERNAL_SERVER_ERROR
    assert "stopping" in r.status.message


def test_read_messages_answers_are_bounded_in_bytes(svc, node):
    """``ReadMessages`` (the Spark source's read): ``max_bytes`` is capped (``READ_MAX_BYTES``), so
    one call cannot ask for 10,000 messages of up to ``max_body_bytes`` each; under the cap, an
    answer stops at the first message past ``max_bytes`` (one larger than it still comes whole)."""
    from chronoq.broker.broker import OutgoingMessage
    from chronoq.server import pipeline

    create_topic(svc, "reads", queues=1)
    node.broker.send_batch([OutgoingMessage("reads", bytes([i]) * 10_000, queue_id=0) for i in range(10)])

    def read(max_bytes: int):
        return call(svc, "ReadMessages", apb.ReadMessagesRequest(topic="reads", queue=0, max_messages=1000,
                                                                 max_bytes=max_bytes))

    for bad in (-1, pipeline.READ_MAX_BYTES + 1, 1 << 40):
        r = read(bad)
        assert r.status.code == Code.BAD_REQUEST and "max_bytes must be between" in r.status.message, r.status
    assert len(read(pipeline.READ_MAX_BYTES).messages.offsets) == 10
    assert len(read(0).messages.offsets) == 10  # the default: 4 MiB
    assert list(read(25_000).messages.offsets) == [0, 1]  # a record is a little more than its body
    assert list(read(1).messages.offsets) == [0]  # a first record larger than max_bytes comes whole


def test_a_read_messages_page_is_read_in_steps_with_other_work_between(svc, node):
    """A page of ``READ_MAX_BYTES`` was read and cut in one go (~0.15 s for 16 MiB, every other
    call waiting); it is read in steps of ``READ_STEP_BYTES`` with the event loop let go
    between, and answers the same messages, in order, as one step would."""
    from chronoq.broker.broker import OutgoingMessage
    from chronoq.server import pipeline

    create_topic(svc, "big-reads", queues=1)
    body = 100_000
    n = 4 * pipeline.READ_STEP_BYTES // body + 3
    node.broker.send_batch([OutgoingMessage("big-reads", bytes([i % 251]) * body, queue_id=0) for i in range(n)])

    answer, turns = asyncio.run(loop_turns_during(svc.ReadMessages(apb.ReadMessagesRequest(
        topic="big-reads", queue=0, max_messages=1000, max_bytes=pipeline.READ_MAX_BYTES), None)))
    assert turns >= 3  # (in one go: 0)
    assert list(answer.messages.offsets) == list(range(n)) and answer.next_offset == n
    lengths = list(answer.messages.body_lengths)
    assert lengths == [body] * n and answer.messages.bodies[body * 7:body * 8] == bytes([7]) * body
