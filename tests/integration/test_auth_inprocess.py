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
USERS = {"alice": "alice-secret", "bob": "bob-secret", "carol": "carol-secret"}
AUTH = {"enabled": True, "users": [
    {"access_key": "alice", "secret_key": USERS["alice"], "publish": ["orders"], "subscribe": ["orders"],
     "groups": ["billing"]},
    {"access_key": "bob", "secret_key": USERS["bob"], "publish": ["payments"]},
    {"access_key": "carol", "secret_key": USERS["carol"], "subscribe": ["orders"]},  # publishes nowhere
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
                # (with access control on, a client id is its user's: "<access key>/<id>")
                assert not await service.push("bob/bob-1", check)  # bob may not publish to orders
                assert not await service.push("alice-1", check)  # no session of that id unscoped
                assert await service.push("alice/alice-1", check)
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


def test_a_users_staged_batches_are_its_own(tmp_path):
    """Stage/Publish/Abort name a sink id. Another user could publish alice's staged batch as
    empty (her rows then answered already_published and dropped) or abort it; now a non-admin
    user's sink ids are its own (kept as ``user:<access key>/<sink id>``)."""
    from chronoq.proto import chronoq_admin_pb2 as apb
    from chronoq.proto import chronoq_admin_pb2_grpc as apb_grpc

    async def scenario():
        front = await _front_end(tmp_path)
        try:
            front.runtime.broker.create_topic("orders", 1)
            async with grpc.aio.insecure_channel(front.config.endpoint) as channel:
                admin = apb_grpc.AdminStub(channel)
                rows = apb.RowColumns(count=3, bodies=b"abc", body_lengths=[1, 1, 1])
                staged = await admin.Stage(apb.StageRequest(sink_id="job:nightly", batch_id=0, stage_id="s0", seq=0,
                                                            topic="orders", rows=rows), metadata=_md("alice", "a-1"))
                assert staged.status.code == pb.OK and staged.rows == 3
                await admin.Stage(apb.StageRequest(sink_id="job:nightly", batch_id=1, stage_id="s1", seq=0,
                                                   topic="orders", rows=rows), metadata=_md("alice", "a-1"))
                # bob names the same sink: his own, empty; alice's batches are untouched.
                empty = await admin.Publish(apb.PublishRequest(sink_id="job:nightly", batch_id=0),
                                            metadata=_md("bob", "b-1"))
                assert empty.status.code == pb.OK and empty.messages == 0
                aborted = await admin.Abort(apb.AbortRequest(sink_id="job:nightly", batch_id=1), metadata=_md("bob", "b-1"))
                assert aborted.status.code == pb.OK and aborted.discarded_rows == 0
                for batch, stage in ((0, "s0"), (1, "s1")):
                    done = await admin.Publish(apb.PublishRequest(sink_id="job:nightly", batch_id=batch, stages=[
                        apb.StageRef(stage_id=stage, chunks=1, rows=3)]), metadata=_md("alice", "a-1"))
                    assert done.status.code == pb.OK and not done.already_published and done.messages == 3
                # A user that may publish nowhere has no sinks: it filled max_stage_sinks with empty
                # publishes of new sink ids, and every Spark sink of the broker was refused.
                for call in (admin.Publish(apb.PublishRequest(sink_id="junk", batch_id=0), metadata=_md("carol", "c-1")),
                             admin.Abort(apb.AbortRequest(sink_id="junk", batch_id=0), metadata=_md("carol", "c-1"))):
                    refused = await call
                    assert refused.status.code == pb.FORBIDDEN and "may publish to no topic" in refused.status.message
            assert front.runtime.broker.queue_bounds("orders", 0) == (0, 6)
        finally:
            await _close(front)

    asyncio.run(scenario())
