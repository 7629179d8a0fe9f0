"""``chronoq.v1.Consume/ReceiveBatch``: ReceiveMessage answered in one unary response, as
``chronoq.client.client`` receives from chronoq; and the client's fallback to the ReceiveMessage stream
for a server that does not offer it (a small real gRPC server that implements only the stream)."""

from __future__ import annotations

import asyncio
import dataclasses
import uuid

import grpc
import pytest
from rocketmq.grpc_protocol import definition_pb2 as pb
from rocketmq.grpc_protocol import service_pb2 as sv
from rocketmq.grpc_protocol import service_pb2_grpc

from chronoq.protocol.rocketmq import ack, fields
from chronoq.protocol.rocketmq.receive import split_receive_batch
from chronoq.client.client import RECEIVE_BATCH_PATH, Client, ClientError, OutgoingMessage

from .conftest import ChronoqProcess, free_port
from .test_security import AUTH_TOML, USERS


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def _fields(m) -> tuple:
    return (m.topic, m.message_id, m.body, m.tag, m.keys, m.properties, m.delivery_attempt, m.queue_id,
            m.born_ms, m.store_ms, m.deliver_at_ms, m.message_group)


def test_batch_and_stream_receives_hand_out_the_same_messages(chronoq_endpoint):
    topic, group = unique("rb"), unique("rbg")

    async def scenario():
        async with Client(chronoq_endpoint) as client:
            await client.send_batch([OutgoingMessage(topic, b"m%d" % i, tag="t", keys=("k1", "k2"),
                                                     properties={"p": str(i)}) for i in range(6)])
            await client.send_batch([OutgoingMessage(topic, b"fifo", message_group="g1")])
            batch = []
            while len(batch) < 7:
                got = await client.receive(group, topic, max_messages=3, wait_s=1)
                assert got and client._batch_offered, "the broker must offer ReceiveBatch"
                batch += got
            # Give them back (0 s) and receive them again over the stream.
            for m in batch:
                await client.change_invisible(group, topic, m, 0)
            client._batch_offered = False
            stream = []
            while len(stream) < 7:
                stream += await client.receive(group, topic, max_messages=32, wait_s=1)
            await client.ack(group, topic, stream)
            return batch, stream

    batch, stream = asyncio.run(scenario())
    by_id = {m.message_id: m for m in stream}
    assert len(by_id) == 7
    for m in batch:
        again = by_id[m.message_id]
        # (the second delivery is a retry copy: its queue and stored time are its own)
        same = lambda f: f[:6] + (f[8],) + f[10:]  # noqa: E731
        assert same(_fields(again)) == same(_fields(m))
        assert (m.delivery_attempt, again.delivery_attempt) == (1, 2)
        assert m.receipt_handle != again.receipt_handle
    fifo = next(m for m in batch if m.body == b"fifo")
    assert fifo.message_group == "g1" and fifo.properties == {}


def test_batch_receive_answers_statuses(chronoq_endpoint):
    topic = unique("rbs")

    async def scenario():
        async with Client(chronoq_endpoint) as client:
            await client.send(topic, b"x")
            assert await client.receive(unique("g"), unique("empty"), wait_s=0) == []  # MESSAGE_NOT_FOUND
            with pytest.raises(ClientError) as bad_group:
                await client.receive("bad group!", topic, wait_s=0)
            with pytest.raises(ClientError) as bad_batch:
                await client.receive(unique("g"), topic, max_messages=0, wait_s=0)
            assert client._batch_offered
            # The raw call: one response, status first, then the message, then the timestamp.
            req = sv.ReceiveMessageRequest(group=pb.Resource(name=unique("g")),
                                           message_queue=pb.MessageQueue(topic=pb.Resource(name=topic), id=-1),
                                           batch_size=4)
            raw = client._channel.unary_unary(RECEIVE_BATCH_PATH,
                                              request_serializer=sv.ReceiveMessageRequest.SerializeToString)
            items = [sv.ReceiveMessageResponse.FromString(b) for b in split_receive_batch(await raw(req))]
            return bad_group.value, bad_batch.value, items

    bad_group, bad_batch, items = asyncio.run(scenario())
    assert bad_group.code == pb.Code.ILLEGAL_CONSUMER_GROUP
    assert bad_batch.code == pb.Code.BAD_REQUEST
    assert [i.WhichOneof("content") for i in items] == ["status", "message", "delivery_timestamp"]
    assert items[0].status.code == pb.Code.OK and items[1].message.body == b"x"


def test_batch_receive_is_guarded_like_receive_message(tmp_path):
    import os

    os.environ["CHRONOQ_TEST_READER_SECRET"] = USERS["reader"]
    try:
        server = ChronoqProcess(str(tmp_path / "data"), AUTH_TOML)
    finally:
        os.environ.pop("CHRONOQ_TEST_READER_SECRET", None)
    topic = unique("orders")

    async def scenario():
        async with Client(server.endpoint, access_key="app", secret_key=USERS["app"]) as client:
            await client.send(topic, b"x")
            group = unique("billing")
            got = await client.receive(group, topic, wait_s=1)
            with pytest.raises(ClientError) as no_group:
                await client.receive(unique("fraud"), topic, wait_s=0)
            # The ack's group is allowed, the receive's is not: the whole call is refused.
            receive = await client._receive_request(unique("fraud"), topic, 16, 30, 0, "*")
            both = ack.ack_and_receive_request(client._ack_request(group, topic, got), receive.SerializeToString())
            with pytest.raises(ClientError) as no_group_either:
                await client._chronoq_call(client._ack_and_receive, both, 5)
            acked_next = await client.ack_and_receive(group, topic, got, wait_s=0)
            return got, no_group.value, no_group_either.value, acked_next

    try:
        got, refused, refused_too, acked_next = asyncio.run(scenario())
    finally:
        server.stop()
    assert [m.body for m in got] == [b"x"] and acked_next == []
    assert refused.code == pb.Code.FORBIDDEN and "may not use consumer group" in refused.status_message
    assert refused_too.code == pb.Code.FORBIDDEN and "AckAndReceive" in refused_too.status_message


def test_ack_and_receive_acks_then_receives_in_one_call(chronoq_endpoint):
    topic, group = unique("ar"), unique("arg")

    async def scenario():
        async with Client(chronoq_endpoint) as client:
            await client.send_batch([OutgoingMessage(topic, b"m%d" % i) for i in range(5)])
            first = await client.ack_and_receive(group, topic, [], max_messages=3, wait_s=1)
            second = await client.ack_and_receive(group, topic, first, max_messages=3, wait_s=1)
            # Acked already (the answer was lost, say): done again, and nothing left to receive.
            assert await client.ack_and_receive(group, topic, first, max_messages=3, wait_s=0) == []
            # A stale handle (replaced by change-invisible-time): the ack fails, nothing is received.
            replaced = dataclasses.replace(second[0])
            await client.change_invisible(group, topic, second[0], 30)  # (second[0] holds the new handle)
            with pytest.raises(ClientError) as stale:
                await client.ack_and_receive(group, topic, [replaced], max_messages=3, wait_s=0)
            last = await client.ack_and_receive(group, topic, second, max_messages=3, wait_s=0)
            assert client._batch_offered
            with pytest.raises(ClientError) as bad:
                await client.ack_and_receive("bad group!", topic, last, wait_s=0)
            return first, second, stale.value, last, bad.value

    first, second, stale, last, bad = asyncio.run(scenario())
    assert len(first) == 3 and len(second) == 2 and last == []
    assert {m.body for m in first + second} == {b"m%d" % i for i in range(5)}
    assert stale.code == pb.Code.INVALID_RECEIPT_HANDLE
    assert bad.code == pb.Code.ILLEGAL_CONSUMER_GROUP


def test_ack_and_receive_answers_a_status_alone_when_every_entry_was_acked(chronoq_endpoint):
    # (AckMessage answers one entry per receipt; the combined call needs only the verdict.)
    topic, group = unique("ars"), unique("arsg")

    async def scenario():
        async with Client(chronoq_endpoint) as client:
            await client.send_batch([OutgoingMessage(topic, b"m%d" % i) for i in range(4)])
            got = await client.receive(group, topic, max_messages=4, wait_s=1)
            receive = await client._receive_request(group, topic, 4, 30, 0, "*")
            both = ack.ack_and_receive_request(client._ack_request(group, topic, got), receive.SerializeToString())
            return got, await client._chronoq_call(client._ack_and_receive, both, 5)

    got, blob = asyncio.run(scenario())
    assert len(got) == 4
    acks = [value for number, value in fields.length_fields(blob) if number == 2]
    answer = sv.AckMessageResponse.FromString(acks[0])
    assert answer.status.code == pb.Code.OK and not answer.entries


def test_ack_and_receive_request_must_hold_both_parts(chronoq_endpoint):
    async def scenario():
        async with grpc.aio.insecure_channel(chronoq_endpoint) as channel:
            call = channel.unary_unary("/chronoq.v1.Consume/AckAndReceive")
            with pytest.raises(grpc.aio.AioRpcError) as only_ack:
                await call(fields.field(ack.K_ACK_AND_RECEIVE_ACK, b""), timeout=5)
            with pytest.raises(grpc.aio.AioRpcError) as garbage:
                await call(b"\xff\xff\xff", timeout=5)
            return only_ack.value, garbage.value

    only_ack, garbage = asyncio.run(scenario())
    assert only_ack.code() == garbage.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "not a valid protobuf message" in only_ack.details()


class _StreamOnly(service_pb2_grpc.MessagingServiceServicer):
    """A server without ReceiveBatch (like a RocketMQ proxy): route and a one-message stream."""

    async def QueryRoute(self, request, context):
        return sv.QueryRouteResponse(status=pb.Status(code=pb.Code.OK), message_queues=[
            pb.MessageQueue(topic=request.topic, id=0, permission=pb.READ_WRITE)])

    acked: list = []

    async def AckMessage(self, request, context):
        self.acked += [e.receipt_handle for e in request.entries]
        return sv.AckMessageResponse(status=pb.Status(code=pb.Code.OK))

    async def ReceiveMessage(self, request, context):
        yield sv.ReceiveMessageResponse(status=pb.Status(code=pb.Code.OK))
        yield sv.ReceiveMessageResponse(message=pb.Message(
            topic=request.message_queue.topic, body=b"streamed",
            system_properties=pb.SystemProperties(message_id="01", receipt_handle="h", delivery_attempt=1)))


def test_client_falls_back_to_the_stream_when_the_server_lacks_receive_batch():
    async def scenario():
        server = grpc.aio.server()
        servicer = _StreamOnly()
        service_pb2_grpc.add_MessagingServiceServicer_to_server(servicer, server)
        port = server.add_insecure_port(f"127.0.0.1:{free_port()}")
        await server.start()
        try:
            async with Client(f"127.0.0.1:{port}") as client:
                first = await client.receive("g", "t", wait_s=0)
                offered = client._batch_offered
                second = await client.ack_and_receive("g", "t", first, wait_s=0)
            async with Client(f"127.0.0.1:{port}") as client:  # AckAndReceive is the first call
                third = await client.ack_and_receive("g", "t", second, wait_s=0)
            return first, offered, second, third, servicer.acked
        finally:
            await server.stop(None)

    first, offered, second, third, acked = asyncio.run(scenario())
    assert [m.body for m in first] == [b"streamed"] and not offered
    assert [m.body for m in second] == [b"streamed"] and [m.body for m in third] == [b"streamed"]
    assert acked == ["h", "h"]  # ack, then receive: two calls each time


def test_client_ack_of_more_than_the_broker_takes_in_one_call_goes_in_several(chronoq_endpoint):
    from chronoq.pop.names import ACK_ENTRIES_MAX
    topic, group = unique("bigack"), unique("bigackg")
    n = ACK_ENTRIES_MAX + 40

    async def scenario():
        async with Client(chronoq_endpoint) as client:
            for start in (0, n // 2):
                await client.send_batch([OutgoingMessage(topic, b"m%d" % i) for i in range(start, start + n // 2)])
            got = []
            while len(got) < n:
                batch = await client.receive(group, topic, max_messages=32, invisible_s=2, wait_s=1)
                assert batch
                got += batch
            await client.ack(group, topic, got)  # more than one AckMessage may carry
            await asyncio.sleep(2.5)  # past the invisible time: an unacked one would be back
            return len(got), await client.receive(group, topic, max_messages=32, wait_s=0)

    count, after = asyncio.run(scenario())
    assert count == n and after == []
