"""The gate in-process: what goes over a Telemetry stream when access control is on.

- A settings command naming a group or topic the user may not use is answered FORBIDDEN.
- A transaction check (server-initiated ``recover_orphaned_transaction_command``) only reaches a
  client whose user may publish to the message's topic: a producer of another application must
  not see the body of a half message.
"""

from __future__ import annotations

import asyncio

import grpc
from rocketmq.grpc_protocol import definition_pb2 as pb
from rocketmq.grpc_protocol import service_pb2 as sv
from rocketmq.grpc_protocol import service_pb2_grpc

from chronoq.core import acl

from .conftest import start_front_end, stop_front_end

DATE = "20250101T000000Z"
USERS = {"alice": "alice-secret", "bob": "bob-secret"}
AUTH = {"enabled": True, "users": [
    {"access_key": "alice", "secret_key": USERS["alice"], "publish": ["orders"], "subscribe": ["orders"],
     "groups": ["billing"]},
    {"access_key": "bob", "secret_key": USERS["bob"], "publish": ["payments"]},
]}


def _md(ak: str, client_id: str) -> tuple:
    return (("x-mq-client-id", client_id), ("x-mq-date-time", DATE),
            ("authorization", acl.authorization_header(ak, USERS[ak], DATE)))


async def _front_end(tmp_path):
    return await start_front_end(str(tmp_path / "data"), extra={"auth": AUTH})


async def _close(front) -> None:
    await stop_front_end(front)


def test_telemetry_settings_and_transaction_checks_respect_permissions(tmp_path):
    async def scenario():
        front = await _front_end(tmp_path)
        try:
            service = front.service
            async with grpc.aio.insecure_channel(front.config.endpoint) as channel:
                stub = service_pb2_grpc.MessagingServiceStub(channel)
                producer = pb.Settings(client_type=pb.PRODUCER, publishing=pb.Publishing(
                    topics=[pb.Resource(name="orders")]))
                alice = stub.Telemetry(metadata=_md("alice", "alice-1"))
                await alice.write(sv.TelemetryCommand(settings=producer))
                assert (await alice.read()).status.code == pb.OK
                bob = stub.Telemetry(metadata=_md("bob", "bob-1"))
                await bob.write(sv.TelemetryCommand(settings=producer))  # declaring is not publishing
                assert (await bob.read()).status.code == pb.OK

                # A consumer's settings name its group and topics: checked.
                await bob.write(sv.TelemetryCommand(settings=pb.Settings(
                    client_type=pb.SIMPLE_CONSUMER, subscription=pb.Subscription(
                        group=pb.Resource(name="billing"),
                        subscriptions=[pb.SubscriptionEntry(topic=pb.Resource(name="orders"))]))))
                reply = await asyncio.wait_for(bob.read(), 5)
                assert reply.status.code == pb.FORBIDDEN and "consumer group 'billing'" in reply.status.message

                check = sv.TelemetryCommand(recover_orphaned_transaction_command=sv.RecoverOrphanedTransactionCommand(
                    message=pb.Message(topic=pb.Resource(name="orders"), body=b"secret order"), transaction_id="1"))
                assert not await service.push("bob-1", check)  # bob may not publish to orders
                assert await service.push("alice-1", check)
                pushed = await asyncio.wait_for(alice.read(), 5)
                assert pushed.recover_orphaned_transaction_command.message.body == b"secret order"
                for call in (alice, bob):
                    await call.done_writing()
        finally:
            await _close(front)

    asyncio.run(scenario())


def test_refused_calls_are_counted_by_reason_and_logged(tmp_path, caplog):
    """chronoq_requests_refused_total{reason}: a call without credentials, a call the user may
    not make and a malformed request each count under their reason; the log names the peer."""
    from prometheus_client import generate_latest

    from chronoq.server.metrics import BrokerMetrics

    async def scenario():
        front = await _front_end(tmp_path)
        try:
            async with grpc.aio.insecure_channel(front.config.endpoint) as channel:
                stub = service_pb2_grpc.MessagingServiceStub(channel)
                route = sv.QueryRouteRequest(topic=pb.Resource(name="orders"))
                anonymous = await stub.QueryRoute(route)
                assert anonymous.status.code == pb.UNAUTHORIZED
                forbidden = await stub.QueryRoute(sv.QueryRouteRequest(topic=pb.Resource(name="orders")),
                                                  metadata=_md("bob", "bob-2"))
                assert forbidden.status.code == pb.FORBIDDEN
                malformed = channel.unary_unary("/apache.rocketmq.v2.MessagingService/QueryRoute")
                garbled = sv.QueryRouteResponse.FromString(
                    await malformed(b"\xff\xff\xff", metadata=_md("alice", "alice-2")))
                assert garbled.status.code == pb.BAD_REQUEST
            broker = front.runtime.broker
            return broker, generate_latest(BrokerMetrics(broker).registry).decode()
        finally:
            await _close(front)

    with caplog.at_level("WARNING", logger="chronoq.refused"):
        broker, scrape = asyncio.run(scenario())
    counts = broker.refusals.counts
    assert (counts["unauthenticated"], counts["permission"], counts["invalid_request"]) == (1, 1, 1)
    assert 'chronoq_requests_refused_total{reason="unauthenticated"} 1.0' in scrape
    assert 'chronoq_requests_refused_total{reason="permission"} 1.0' in scrape
    lines = [r.getMessage() for r in caplog.records if r.name == "chronoq.refused"]
    assert any(line.startswith("refused permission from ipv") and "bob" in line for line in lines), lines
