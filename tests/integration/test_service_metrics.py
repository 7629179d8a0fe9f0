"""``/metrics`` of a real ``chronoq serve``: the service series (build, process, gRPC transport, parked
polls, recalls) equal what a real client did over the gRPC port."""

from __future__ import annotations

import asyncio
import time

import grpc

import chronoq
from chronoq import __version__
from chronoq.client.client import Client, ClientError

from .conftest import wait_until
from .test_cli import make_cli
from .test_metrics import scrape, value

MS = "apache.rocketmq.v2.MessagingService"
SENDS = 3


def scrape_when(url: str, name: str, wanted: float, what: str) -> dict:
    """The first scrape in which ``name`` (no labels) equals ``wanted`` (polled, bounded)."""
    def check():
        samples = scrape(url)
        return samples if value(samples, name) == wanted else None

    return wait_until(check, 15, 0.05, what)


def test_transport_and_service_series(chronoq_process):
    server = chronoq_process()
    url = server.http_url
    samples = scrape(url)
    assert value(samples, "chronoq_build_info", version=__version__, build=chronoq.build()) == 1  # as this process
    assert value(samples, "process_resident_memory_bytes") > 0 and value(samples, "process_open_fds") > 0
    assert value(samples, "chronoq_grpc_connections") == 0 and value(samples, "chronoq_parked_polls") == 0
    assert value(samples, "chronoq_disk_free_bytes") > 0 and value(samples, "chronoq_disk_reserve_low") == 0
    assert value(samples, "chronoq_transaction_halves_pending") == 0
    assert value(samples, "chronoq_grpc_received_bytes_total") == 0

    async def traffic() -> dict:
        async with Client(server.endpoint) as client:
            for i in range(SENDS):
                await client.send("svc-orders", b"m%d" % i)
            delayed = await client.send("svc-orders", b"later", deliver_at_ms=int(time.time() * 1000) + 3_600_000)
            await client.recall("svc-orders", delayed.recall_handle)
            # A receive of an empty topic parks as a long poll: seen while it waits.
            poll = asyncio.ensure_future(client.receive("svc-group", "svc-empty", wait_s=20))
            loop = asyncio.get_running_loop()
            parked = await loop.run_in_executor(None, scrape_when, url, "chronoq_parked_polls", 1,
                                                "a parked long poll")
            await client.send("svc-empty", b"wake")
            assert len(await poll) == 1
            try:  # refused inside an OK call: the RocketMQ code tells
                await client.send("svc-orders", b"")
            except ClientError:
                pass
            else:
                raise AssertionError("an empty body was accepted")
        # A method the broker does not serve, through a plain gRPC channel.
        async with grpc.aio.insecure_channel(server.endpoint) as channel:
            try:
                await channel.unary_unary("/nope.Service/Nope")(b"", timeout=10)
            except grpc.aio.AioRpcError as exc:
                assert exc.code() == grpc.StatusCode.UNIMPLEMENTED
            else:
                raise AssertionError("an unknown method was answered")
        return parked

    parked = asyncio.run(traffic())
    assert value(parked, "chronoq_grpc_connections") >= 1
    assert value(parked, "chronoq_grpc_streams") >= 1  # the receive under way

    samples = scrape_when(url, "chronoq_grpc_connections", 0, "the clients' connections to close")
    sends = value(samples, "chronoq_grpc_calls_total", service=MS, method="SendMessage", code="OK")
    assert value(samples, "chronoq_grpc_call_seconds_count", service=MS, method="SendMessage") == sends
    assert value(samples, "chronoq_grpc_call_seconds_bucket", service=MS, method="SendMessage", le="+Inf") == sends
    assert value(samples, "chronoq_grpc_calls_total", service=MS, method="RecallMessage", code="OK") == 1
    assert value(samples, "chronoq_grpc_calls_total", service="unknown", method="unknown", code="UNIMPLEMENTED") == 1
    assert not [labels for name, labels in samples if name == "chronoq_grpc_calls_total"
                and ("service", "nope.Service") in labels]  # a client's path is never a label value
    # The RocketMQ status code of each MessagingService answer (the refused send is an OK gRPC call).
    answers = {dict(labels)["rocketmq_code"]: n for (name, labels), n in samples.items()
               if name == "chronoq_grpc_answers_total" and ("method", "SendMessage") in labels}
    assert answers == {"OK": SENDS + 2, "MESSAGE_BODY_EMPTY": 1}, answers
    assert sends == SENDS + 3  # (the refused one too: gRPC says OK)
    assert value(samples, "chronoq_grpc_answers_total", service=MS, method="RecallMessage", rocketmq_code="OK") == 1
    assert not [labels for name, labels in samples if name == "chronoq_grpc_answers_total"
                and ("service", "unknown") in labels]  # no RocketMQ answer, no count
    assert value(samples, "chronoq_timer_recalls_total", outcome="cancelled") == 1
    assert value(samples, "chronoq_messages_sent_total", topic="svc-orders") == SENDS + 1
    assert value(samples, "chronoq_grpc_received_bytes_total") > SENDS * 2
    assert value(samples, "chronoq_grpc_sent_bytes_total") > 0
    assert value(samples, "chronoq_parked_polls") == 0 and value(samples, "chronoq_grpc_streams") == 0


def test_admin_and_replication_answers_are_counted_by_their_code(chronoq_process):
    """``chronoq_grpc_answers_total`` counts chronoq's own services through the same path as
    MessagingService: the CLI's Admin calls and ``cluster status`` (Replication), refusals too."""
    server = chronoq_process()
    cli = make_cli(server.endpoint)
    cli("topic", "create", "svc-admin", "--queues", "2")
    cli("topic", "list")
    assert cli("topic", "describe", "svc-nope", expect=1).err.startswith("chronoq: error: TOPIC_NOT_FOUND")
    cli("cluster", "status")
    samples = scrape(server.http_url)
    admin = "chronoq.v1.Admin"
    assert value(samples, "chronoq_grpc_answers_total", service=admin, method="CreateTopic", rocketmq_code="OK") == 1
    assert value(samples, "chronoq_grpc_answers_total", service=admin, method="ListTopics", rocketmq_code="OK") == 1
    assert value(samples, "chronoq_grpc_answers_total", service=admin, method="DescribeTopic",
                 rocketmq_code="TOPIC_NOT_FOUND") == 1
    assert value(samples, "chronoq_grpc_answers_total", service="chronoq.v1.Replication", method="ClusterStatus",
                 rocketmq_code="OK") == 1
    # Each call is counted once here and once (gRPC status) in chronoq_grpc_calls_total.
    assert value(samples, "chronoq_grpc_calls_total", service=admin, method="DescribeTopic", code="OK") == 1
