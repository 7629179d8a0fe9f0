"""``callstats.answer_code``: the RocketMQ status code read off a serialized MessagingService answer
(generated classes and chronoq's hand encoders), and ``CallStats`` counting it per method."""

from __future__ import annotations

from rocketmq.grpc_protocol import definition_pb2 as d, service_pb2 as s

from chronoq.protocol.rocketmq.receive import receive_delivery, receive_status
from chronoq.server.callstats import NO_ANSWER, CallStats, answer_code
from chronoq.server.service_metrics import rocketmq_code_name

SEND = "/apache.rocketmq.v2.MessagingService/SendMessage"


def test_the_code_of_generated_answers():
    for code in (d.Code.OK, d.Code.BAD_REQUEST, d.Code.TOO_MANY_REQUESTS, d.Code.MESSAGE_NOT_FOUND):
        answer = s.SendMessageResponse(status=d.Status(code=code, message="m"),
                                       entries=[s.SendResultEntry(message_id="x")])
        assert answer_code(answer.SerializeToString()) == code
    assert answer_code(s.AckMessageResponse(status=d.Status(message="no code")).SerializeToString()) == 0
    assert answer_code(s.AckMessageResponse().SerializeToString()) == NO_ANSWER  # no Status at all


def test_a_receive_stream_is_counted_by_its_status_not_its_messages():
    assert answer_code(s.ReceiveMessageResponse(message=d.Message(body=b"x")).SerializeToString()) == NO_ANSWER
    assert answer_code(receive_delivery(1_700_000_000_000)) == NO_ANSWER
    assert answer_code(receive_status(d.Code.MESSAGE_NOT_FOUND, "no new message")) == d.Code.MESSAGE_NOT_FOUND
    assert answer_code(receive_status(d.Code.OK, "OK")) == d.Code.OK


def test_codes_outside_the_enum_and_other_buffers_are_decoded():
    for code in (7, 300, 70000, 3_000_000):
        data = s.SendMessageResponse(status=d.Status(code=code, message="m")).SerializeToString()
        assert answer_code(data) == code
    data = s.SendMessageResponse(status=d.Status(code=d.Code.TOO_MANY_REQUESTS)).SerializeToString()
    assert answer_code(bytearray(data)) == answer_code(memoryview(data)) == d.Code.TOO_MANY_REQUESTS


def test_truncated_bytes_are_no_answer():
    whole = s.SendMessageResponse(status=d.Status(code=d.Code.OK)).SerializeToString()
    assert answer_code(whole[:1]) == NO_ANSWER
    assert answer_code(b"\x0a\xff") == NO_ANSWER  # a length varint that never ends
    assert answer_code(b"\x0a\x03\x08\xff\xff") == NO_ANSWER


def test_counted_per_method_and_code_with_a_bounded_label():
    stats = CallStats()
    stats.call_ended(SEND, 0, 0.001, d.Code.OK)
    stats.call_ended(SEND, 0, 0.001, d.Code.OK)
    stats.call_ended(SEND, 0, 0.001, d.Code.MESSAGE_BODY_EMPTY)
    stats.call_ended("/chronoq.v1.Admin/ListTopics", 0, 0.001)
    assert stats.answers == {(SEND, d.Code.OK): 2, (SEND, d.Code.MESSAGE_BODY_EMPTY): 1}
    assert rocketmq_code_name(d.Code.OK) == "OK" and rocketmq_code_name(12345) == "OTHER"


def test_every_admin_and_replication_answer_begins_with_a_status():
    """The peek is right for chronoq's own services: each response's field 1 is a
    ``chronoq.v1.Status`` whose field 1 is the code (``STATUS_ANSWER_PREFIXES``)."""
    from chronoq.proto import chronoq_admin_pb2 as a
    from chronoq.server.callstats import STATUS_ANSWER_PREFIXES

    services = a.DESCRIPTOR.services_by_name
    assert {f"/{services[n].full_name}/" for n in ("Admin", "Replication")} <= set(STATUS_ANSWER_PREFIXES)
    for name in ("Admin", "Replication"):
        for method in services[name].methods:
            status = method.output_type.fields_by_number[1]
            assert status.message_type is a.Status.DESCRIPTOR, method.full_name
    assert a.Status.DESCRIPTOR.fields_by_number[1].name == "code"
    answer = a.DeleteGroupResponse(status=a.Status(code=d.Code.CONSUMER_GROUP_NOT_FOUND, message="m"), topics=["t"])
    assert answer_code(answer.SerializeToString()) == d.Code.CONSUMER_GROUP_NOT_FOUND
