"""Delayed delivery in the gRPC shell's pure parts and the Admin servicer, no network.

* ``CHRONOQ_DELAY_LEVEL``: the user property that asks for a delay level over RocketMQ 5's
  protocol (which has no field for it), decoded by ``convert.outgoing_from_pb``;
* ``chronoq.v1.Admin`` ``TimerStats``, ``Recall`` and ``Reschedule`` over a real broker: definite
  outcomes answered with status OK, malformed handles and bad times with a client-error code.
"""

from __future__ import annotations

import asyncio

import pytest
from popkit import Node
from rocketmq.grpc_protocol import definition_pb2 as pb

from chronoq.core import errors
from chronoq.core.model import MessageType
from chronoq.proto import chronoq_admin_pb2 as apb
from chronoq.server import admin, convert
from chronoq.protocol.rocketmq.status import Code
from chronoq.timer.stats import LATENESS_BOUNDS_MS

LEVEL = convert.DELAY_LEVEL_PROPERTY


def _send_pb(message_type=pb.NORMAL, props=None, sp=None) -> pb.Message:
    system = pb.SystemProperties(message_id="01ABC", body_encoding=pb.IDENTITY, message_type=message_type,
                                 **(sp or {}))
    return pb.Message(topic=pb.Resource(name="orders"), body=b"hi", system_properties=system,
                      user_properties=props)


# ----------------------------------------------------------------------------- the level property
@pytest.mark.parametrize("message_type", [pb.NORMAL, pb.DELAY, pb.MESSAGE_TYPE_UNSPECIFIED])
def test_the_level_property_makes_a_delay_message_and_is_not_kept(message_type):
    out = convert.outgoing_from_pb(_send_pb(message_type, {LEVEL: "3", "a": "b"}), 1024)
    assert out.delay_level == 3 and out.deliver_at_ms is None
    assert out.message_type is MessageType.DELAY
    assert out.properties == {"a": "b"}  # a request to the broker, not data of the message


def test_level_zero_means_no_delay():
    out = convert.outgoing_from_pb(_send_pb(pb.NORMAL, {LEVEL: "0"}), 1024)
    assert out.delay_level is None and out.message_type is MessageType.NORMAL and out.properties == {}


@pytest.mark.parametrize("kw, exc", [
    ({"props": {LEVEL: "x"}}, errors.InvalidDeliveryTime),
    ({"props": {LEVEL: "-1"}}, errors.InvalidDeliveryTime),
    ({"props": {LEVEL: "²"}}, errors.InvalidDeliveryTime),
    ({"props": {LEVEL: "99999"}}, errors.InvalidDeliveryTime),
    ({"props": {LEVEL: "2"}, "message_type": pb.FIFO, "sp": {"message_group": "g"}}, errors.MessageTypeMismatch),
    ({"props": {LEVEL: "2"}, "message_type": pb.TRANSACTION}, errors.MessageTypeMismatch),
    ({"props": {LEVEL: "2"}, "message_type": pb.DELAY, "sp": {"delivery_timestamp": {"seconds": 2_000_000_000}}},
     errors.InvalidDeliveryTime),
])
def test_bad_level_requests_are_client_errors(kw, exc):
    with pytest.raises(exc):
        convert.outgoing_from_pb(_send_pb(**kw), 1024)


# ----------------------------------------------------------------------------- Admin RPCs
@pytest.fixture
def node(tmp_path):
    n = Node(str(tmp_path), flush_policy="sync").open()
    yield n
    if n.pop is not None and not n.pop.closed:
        n.close()


@pytest.fixture
def svc(node):
    return admin.AdminService(node.broker, node.pop)


def call(svc, method: str, request):
    return asyncio.run(getattr(svc, method)(request, None))


def test_timer_stats_report_pending_per_bucket_levels_and_lateness(svc, node):
    b, clock = node.broker, node.clock
    now = clock.wall_ms()
    for i in range(7):
        b.send("orders", b"later", deliver_at_ms=now + 120_000 + i)
    b.send("orders", b"soon", deliver_at_ms=now + 1_000)
    b.send("orders", b"level", delay_level=2)
    r = call(svc, "TimerStats", apb.TimerStatsRequest(minutes=5))
    assert r.status.code == Code.OK
    assert r.bucket_ms == b.config.timer_bucket_ms and r.now_ms == now
    assert sum(x.pending for x in r.due_by_bucket) == 8
    assert [lv.level for lv in r.levels] == list(range(1, 19)) and r.levels[1].backlog == 1
    assert r.levels[1].delay_ms == 5_000 and r.levels[1].head_due_ms == now + 5_000
    assert r.lateness.count == 0 and len(r.lateness.buckets) == len(LATENESS_BOUNDS_MS) + 1
    clock.advance(6_000)
    for _ in range(20):
        b.timer_tick()
    r = call(svc, "TimerStats", apb.TimerStatsRequest())  # minutes 0: the default (10)
    assert r.lateness.count == 2 and r.lateness.early == 0 and r.lateness.buckets[-1].le_ms == -1
    assert r.timer_lane.delivered == 1 and r.levels[1].lane.delivered == 1 and r.levels[1].backlog == 0
    assert sum(x.pending for x in r.due_by_bucket) == 7


@pytest.mark.parametrize("minutes", [-1, 10_081])
def test_timer_stats_refuse_a_bad_horizon(svc, minutes):
    assert call(svc, "TimerStats", apb.TimerStatsRequest(minutes=minutes)).status.code == Code.BAD_REQUEST


def test_recall_and_reschedule_answer_definite_outcomes(svc, node):
    b, clock = node.broker, node.clock
    now = clock.wall_ms()
    later = b.send("orders", b"a", deliver_at_ms=now + 60_000).recall_handle
    soon = b.send("orders", b"b", deliver_at_ms=now + 1_000).recall_handle
    r = call(svc, "Recall", apb.RecallRequest(recall_handle=later))
    assert (r.status.code, r.outcome, r.topic) == (Code.OK, "cancelled", "orders")
    assert call(svc, "Recall", apb.RecallRequest(recall_handle=later)).outcome == "cancelled"  # idempotent
    moved = call(svc, "Reschedule", apb.RescheduleRequest(recall_handle=soon, deliver_at_ms=now + 30_000))
    assert (moved.status.code, moved.outcome, moved.deliver_at_ms) == (Code.OK, "rescheduled", now + 30_000)
    assert moved.recall_handle and moved.recall_handle != soon
    old = call(svc, "Recall", apb.RecallRequest(recall_handle=soon))
    assert (old.status.code, old.outcome) == (Code.OK, "not_found") and "rescheduled" in old.detail
    back = call(svc, "Reschedule", apb.RescheduleRequest(recall_handle=moved.recall_handle,
                                                         deliver_at_ms=now + 2_000))  # earlier again
    assert back.outcome == "rescheduled"
    clock.advance(2_500)
    for _ in range(20):
        b.timer_tick()
    done = call(svc, "Recall", apb.RecallRequest(recall_handle=back.recall_handle))
    assert (done.status.code, done.outcome) == (Code.OK, "already_delivered")
    again = call(svc, "Reschedule", apb.RescheduleRequest(recall_handle=back.recall_handle, deliver_at_ms=now))
    assert again.outcome == "already_delivered" and again.recall_handle == ""
    cancelled = call(svc, "Reschedule", apb.RescheduleRequest(recall_handle=later, deliver_at_ms=now + 9_000))
    assert cancelled.outcome == "cancelled"


@pytest.mark.parametrize("method, request_, code", [
    ("Recall", apb.RecallRequest(recall_handle=""), Code.BAD_REQUEST),
    ("Recall", apb.RecallRequest(recall_handle="1garbage"), Code.BAD_REQUEST),
    ("Reschedule", apb.RescheduleRequest(recall_handle=""), Code.BAD_REQUEST),
    ("Reschedule", apb.RescheduleRequest(recall_handle="not-a-handle", deliver_at_ms=1), Code.BAD_REQUEST),
])
def test_malformed_requests_are_client_errors(svc, method, request_, code):
    assert call(svc, method, request_).status.code == code


def test_reschedule_beyond_the_maximum_delay_is_an_illegal_delivery_time(svc, node):
    now = node.clock.wall_ms()
    handle = node.broker.send("orders", b"a", deliver_at_ms=now + 60_000).recall_handle
    r = call(svc, "Reschedule", apb.RescheduleRequest(recall_handle=handle,
                                                      deliver_at_ms=now + node.broker.config.timer_max_delay_ms + 1))
    assert r.status.code == Code.ILLEGAL_DELIVERY_TIME and r.outcome == ""
