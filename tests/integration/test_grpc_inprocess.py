"""The gRPC front end in-process (one event loop): what a subprocess test cannot reach.

Server-initiated Telemetry commands (``MessagingService.push``, for transaction checks) and the
per-client session registry keyed by ``x-mq-client-id``.
"""

from __future__ import annotations

import asyncio

import grpc
import pytest
from google.protobuf import duration_pb2
from rocketmq.grpc_protocol import definition_pb2 as pb
from rocketmq.grpc_protocol import service_pb2 as sv
from rocketmq.grpc_protocol import service_pb2_grpc


from .conftest import start_front_end, stop_front_end


async def _front_end(tmp_path, **settings):
    return await start_front_end(str(tmp_path / "data"), **settings)


async def _close(front) -> None:
    await stop_front_end(front)


def test_push_reaches_the_clients_telemetry_stream(tmp_path):
    async def scenario():
        front = await _front_end(tmp_path)
        try:
            service = front.service
            async with grpc.aio.insecure_channel(front.config.endpoint) as channel:
                stub = service_pb2_grpc.MessagingServiceStub(channel)
                call = stub.Telemetry(metadata=(("x-mq-client-id", "producer-1"),))
                await call.write(sv.TelemetryCommand(settings=pb.Settings(
                    client_type=pb.PRODUCER, publishing=pb.Publishing(topics=[pb.Resource(name="orders")]))))
                reply = await call.read()
                assert reply.status.code == pb.OK and reply.settings.publishing.max_body_size > 0
                session = service.sessions["producer-1"]
                assert session.client_type == pb.PRODUCER and session.topics == {"orders"}

                command = sv.TelemetryCommand(print_thread_stack_trace_command=sv.PrintThreadStackTraceCommand(
                    nonce="n-1"))
                assert await service.push("producer-1", command)
                pushed = await asyncio.wait_for(call.read(), 5)
                assert pushed.print_thread_stack_trace_command.nonce == "n-1"
                assert not await service.push("nobody", command)

                await call.done_writing()  # the client closes its side: the session ends
                for _ in range(50):
                    if "producer-1" not in service.sessions:
                        break
                    await asyncio.sleep(0.02)
                assert "producer-1" not in service.sessions
        finally:
            await _close(front)

    asyncio.run(scenario())


def test_a_client_reply_to_our_command_gets_no_answer(tmp_path):
    async def scenario():
        front = await _front_end(tmp_path)
        try:
            async with grpc.aio.insecure_channel(front.config.endpoint) as channel:
                stub = service_pb2_grpc.MessagingServiceStub(channel)
                call = stub.Telemetry(metadata=(("x-mq-client-id", "node-1"),))
                # Node answers stack-trace requests; that is not a settings command: no reply.
                await call.write(sv.TelemetryCommand(status=pb.Status(code=pb.OK),
                                                     thread_stack_trace=sv.ThreadStackTrace(nonce="x")))
                await call.write(sv.TelemetryCommand(settings=pb.Settings(
                    client_type=pb.SIMPLE_CONSUMER, subscription=pb.Subscription(group=pb.Resource(name="g1")))))
                reply = await asyncio.wait_for(call.read(), 5)
                assert reply.HasField("settings") and reply.status.code == pb.OK
                await call.done_writing()
                assert await call.read() == grpc.aio.EOF
        finally:
            await _close(front)

    asyncio.run(scenario())


def test_invalid_sends_and_parked_poll_overflow_are_counted_as_refusals(tmp_path):
    """chronoq_requests_refused_total: a message that fails validation (invalid_request) and a long
    poll past max_parked_polls (parked_poll_limit); a receive that finds nothing is no refusal."""
    async def scenario():
        front = await _front_end(tmp_path, max_parked_polls=1)
        try:
            counts = front.runtime.broker.refusals.counts
            front.runtime.broker.create_topic("orders", 1)
            async with grpc.aio.insecure_channel(front.config.endpoint) as channel:
                stub = service_pb2_grpc.MessagingServiceStub(channel)
                sp = pb.SystemProperties(message_id="01AA", message_type=pb.FIFO, message_group="g\x02evil\x01yes",
                                         body_encoding=pb.IDENTITY)
                sent = await stub.SendMessage(sv.SendMessageRequest(messages=[pb.Message(
                    topic=pb.Resource(name="orders"), body=b"x", system_properties=sp)]))
                assert sent.status.code == pb.ILLEGAL_MESSAGE_GROUP
                assert counts["invalid_request"] == 1

                def receive(wait_s: int):
                    request = sv.ReceiveMessageRequest(
                        group=pb.Resource(name="billing"),
                        message_queue=pb.MessageQueue(topic=pb.Resource(name="orders")), batch_size=1,
                        invisible_duration=duration_pb2.Duration(seconds=30),
                        long_polling_timeout=duration_pb2.Duration(seconds=wait_s))
                    return stub.ReceiveMessage(request, timeout=wait_s + 5)

                parked = receive(3)  # waits for a message that does not come
                await asyncio.sleep(0.5)
                refused = [r async for r in receive(3)]
                assert refused[0].status.code == pb.TOO_MANY_REQUESTS
                assert counts["parked_poll_limit"] == 1
                answers = [r async for r in parked]
                assert answers[0].status.code == pb.MESSAGE_NOT_FOUND
                assert counts["invalid_request"] == 1 and counts["parked_poll_limit"] == 1
        finally:
            await _close(front)

    asyncio.run(scenario())


def test_parked_polls_are_shared_out_between_connections(tmp_path):
    """At max_parked_polls, a poll from a connection holding few takes the place of the oldest
    poll of the connection holding the most (that one is answered empty at once); a connection
    already holding its share is refused. One client could shut every other out before."""
    async def scenario():
        front = await _front_end(tmp_path, max_parked_polls=3)
        try:
            front.runtime.broker.create_topic("orders", 1)
            front.runtime.broker.create_topic("other", 1)
            loop = asyncio.get_running_loop()

            def receive(stub, topic: str, wait_s: int = 20):
                request = sv.ReceiveMessageRequest(
                    group=pb.Resource(name=f"g-{topic}"),
                    message_queue=pb.MessageQueue(topic=pb.Resource(name=topic)), batch_size=1,
                    invisible_duration=duration_pb2.Duration(seconds=30),
                    long_polling_timeout=duration_pb2.Duration(seconds=wait_s))
                return stub.ReceiveMessage(request, timeout=wait_s + 5)

            async def answers(call):
                return [r async for r in call]

            async with grpc.aio.insecure_channel(front.config.endpoint) as hog_channel, \
                    grpc.aio.insecure_channel(front.config.endpoint, options=[("grpc.use_local_subchannel_pool", 1)]) \
                    as other_channel:
                hog, other = (service_pb2_grpc.MessagingServiceStub(c) for c in (hog_channel, other_channel))
                hogs = [asyncio.ensure_future(answers(receive(hog, "orders"))) for _ in range(3)]
                await asyncio.sleep(0.5)
                assert front.service._waker.parked == 3
                started = loop.time()
                mine = asyncio.ensure_future(answers(receive(other, "other")))
                done, _ = await asyncio.wait(hogs, timeout=5, return_when=asyncio.FIRST_COMPLETED)
                assert len(done) == 1 and loop.time() - started < 5  # the hog's oldest gave its place up
                [kicked] = done
                assert kicked.result()[0].status.code == pb.MESSAGE_NOT_FOUND
                await asyncio.sleep(0.3)
                assert front.service._waker.parked == 3 and not mine.done()
                # The newcomer holds 1, the hog 2: no more room to take from it.
                refused = await answers(receive(other, "other"))
                assert refused[0].status.code == pb.TOO_MANY_REQUESTS
                front.runtime.broker.send("other", b"for the newcomer")
                got = await asyncio.wait_for(mine, 10)
                assert got[0].status.code == pb.OK and [r.message.body for r in got if r.HasField("message")] == [b"for the newcomer"]
                for task in hogs:
                    task.cancel()
        finally:
            await _close(front)

    asyncio.run(scenario())


def test_telemetry_streams_are_shared_out_between_connections(tmp_path):
    """At max_streams, a new Telemetry stream from a connection holding few ends the oldest one
    of the connection holding the most (its client opens it again); a connection already holding
    its share is refused. One client inventing client ids could take every stream before, and
    new clients got no settings and no transaction checks."""
    async def scenario():
        front = await _front_end(tmp_path, max_streams=3)
        try:
            settings = sv.TelemetryCommand(settings=pb.Settings(
                client_type=pb.PRODUCER, publishing=pb.Publishing(topics=[pb.Resource(name="t")])))

            async def open_stream(stub, client_id: str):
                call = stub.Telemetry(metadata=(("x-mq-client-id", client_id),))
                await call.write(settings)
                return call, await asyncio.wait_for(call.read(), 5)

            async with grpc.aio.insecure_channel(front.config.endpoint) as hog_channel, \
                    grpc.aio.insecure_channel(front.config.endpoint, options=[("grpc.use_local_subchannel_pool", 1)]) \
                    as new_channel:
                hog, newcomer = (service_pb2_grpc.MessagingServiceStub(c) for c in (hog_channel, new_channel))
                hogs = []
                for i in range(3):
                    call, reply = await open_stream(hog, f"hog-{i}")
                    assert reply.status.code == pb.OK
                    hogs.append(call)
                call, reply = await open_stream(newcomer, "new-1")
                assert reply.status.code == pb.OK  # settings answered: it took the hog's oldest place
                with pytest.raises(grpc.aio.AioRpcError) as ended:
                    while True:  # the hog's oldest stream ends (its settings re-sends may come first)
                        if await asyncio.wait_for(hogs[0].read(), 5) == grpc.aio.EOF:
                            break
                assert ended.value.code() == grpc.StatusCode.CANCELLED
                refused, reply = await open_stream(newcomer, "new-2")  # 1 against the hog's 2: its share
                assert reply.status.code == pb.TOO_MANY_REQUESTS and "max_streams" in reply.status.message
                for c in (*hogs[1:], call, refused):
                    c.cancel()
        finally:
            await _close(front)

    asyncio.run(scenario())
