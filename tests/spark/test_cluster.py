"""The data source and the audit across a cluster (docs/spark.md, "Across a cluster"): two broker
groups (real ``chronoq serve`` primaries) and a real etcd on loopback, a topic spread over both.

One test, so the cluster starts once: a batch read and a stream (stopped and restarted mid-way)
cover every (group, queue) exactly once, through either group's endpoint; a write spreads its
rows over both groups (a message group on one group only); the audit reads both groups' traces.
"""

from __future__ import annotations

import asyncio
import glob
import json
import os

from tests.integration.conftest import ChronoqProcess
from tests.integration.etcd_fixture import etcd  # noqa: F401 - the fixture
from tests.integration.test_official_python_client import unique
from tests.integration.test_replication import cli
from tests.spark.conftest import QUERY_TIMEOUT_S, queue_totals, read_topic, wait_until, write_rows
from tests.spark.test_streaming import _source

FIRST, SECOND = 400, 200


def _has_part(endpoint: str, topic: str, queues: int) -> bool:
    from chronoq.spark.rpc import AdminRpc, BrokerError

    with AdminRpc(endpoint) as client:
        try:
            return len(client.queue_offsets(topic)) == queues
        except BrokerError:
            return False


async def _send(endpoint: str, topic: str, prefix: str, n: int) -> None:
    """``n`` messages through the route (``RoutedSender``: batches round robin over the groups)."""
    from chronoq.client.client import OutgoingMessage
    from chronoq.client.routed import RoutedSender

    async with RoutedSender(endpoint) as sender:
        for first in range(0, n, 25):
            await sender.send_batch([OutgoingMessage(topic, f"{prefix}-{i:05d}".encode())
                                     for i in range(first, min(n, first + 25))])


async def _consume(endpoint: str, group: str, topic: str, want: int, ack: bool) -> int:
    """Receive the ``want`` messages of the node's part (each once); ack them or not."""
    import time

    from chronoq.client.client import Client

    got = []
    async with Client(endpoint) as client:
        end = time.monotonic() + 60
        while len(got) < want and time.monotonic() < end:
            got += await client.receive(group, topic, max_messages=32, invisible_s=300, wait_s=1)
        if ack:
            await client.ack(group, topic, got)
    return len(got)


def test_a_spread_topic_is_read_streamed_written_and_audited_over_both_groups(spark, tmp_path, etcd):  # noqa: F811
    from pyspark.sql import functions as F

    from chronoq.spark import audit

    cluster, topic, back = unique("c"), unique("t"), unique("back")
    nodes = []
    try:
        for group in ("g1", "g2"):
            nodes.append(ChronoqProcess(str(tmp_path / group), etcd.config(cluster) + f'group_name = "{group}"\n'))
        a, b = nodes
        for name in (topic, back):
            made = cli("topic", "create", name, "--queues", "2", "--endpoint", a.endpoint, "--json")
            assert made.returncode == 0, made.stderr
            wait_until(lambda name=name: _has_part(b.endpoint, name, 2), 20, what="g2's part (its watch)")
        asyncio.run(_send(b.endpoint, topic, "first", FIRST))
        on_a, on_b = queue_totals(a.endpoint, topic), queue_totals(b.endpoint, topic)
        assert on_a + on_b == FIRST and on_a > 0 and on_b > 0, (on_a, on_b)

        # A batch read through either group's endpoint covers both groups, each message once.
        for via in (a, b):
            rows = read_topic(spark, via.endpoint, topic).select("body", "broker_group", "queue", "offset").collect()
            assert sorted(bytes(r.body).decode() for r in rows) == [f"first-{i:05d}" for i in range(FIRST)]
            assert len({(r.broker_group, r.queue, r.offset) for r in rows}) == FIRST
            assert sum(r.broker_group == "g1" for r in rows) == on_a and {r.broker_group for r in rows} == {"g1", "g2"}

        # A stream stopped mid-way and restarted from its checkpoint: nothing missed, nothing twice.
        out, ckpt = str(tmp_path / "sink"), str(tmp_path / "ckpt")

        def start(**trigger):
            return (_source(spark, a.endpoint, topic, maxRecordsPerTrigger="150")
                    .select("broker_group", "queue", "offset", "body")
                    .writeStream.format("parquet").option("path", out).option("checkpointLocation", ckpt)
                    .trigger(**trigger).start())

        q = start(processingTime="500 milliseconds")
        try:
            wait_until(lambda: len(glob.glob(os.path.join(ckpt, "commits", "[0-9]*"))) >= 2, QUERY_TIMEOUT_S,
                       interval_s=0.2, what="two committed micro-batches")
        finally:
            q.stop()
        assert spark.read.parquet(out).count() < FIRST
        asyncio.run(_send(a.endpoint, topic, "second", SECOND))  # while the query is down
        q = start(availableNow=True)
        assert q.awaitTermination(QUERY_TIMEOUT_S) and q.exception() is None
        streamed = spark.read.parquet(out).collect()
        want = {f"first-{i:05d}" for i in range(FIRST)} | {f"second-{i:05d}" for i in range(SECOND)}
        assert len(streamed) == FIRST + SECOND and {bytes(r.body).decode() for r in streamed} == want
        assert len({(r.broker_group, r.queue, r.offset) for r in streamed}) == FIRST + SECOND
        last = max(glob.glob(os.path.join(ckpt, "offsets", "[0-9]*")), key=lambda p: int(os.path.basename(p)))
        with open(last) as fh:
            offsets = json.loads(fh.read().splitlines()[-1])
        assert list(offsets[topic]) == ["g1/0", "g1/1", "g2/0", "g2/1"], offsets  # each (group, queue) named

        # A write spreads its rows over both groups; a message group stays on one group.
        rows = (spark.read.parquet(out).repartition(2)
                .select(F.concat(F.lit("back:"), F.col("body").cast("string")).alias("body"),
                        F.when(F.col("offset") % 10 == 0, F.concat(F.lit("mg-"), (F.col("offset") % 3).cast("string")))
                        .alias("message_group")))
        write_rows(rows, b.endpoint, back)
        back_a, back_b = queue_totals(a.endpoint, back), queue_totals(b.endpoint, back)
        assert back_a + back_b == FIRST + SECOND and back_a > 0 and back_b > 0, (back_a, back_b)
        read_back = read_topic(spark, a.endpoint, back).collect()
        assert {bytes(r.body).decode() for r in read_back} == {"back:" + x for x in want}
        homes: dict[str, set] = {}
        for r in read_back:
            if r.message_group:
                homes.setdefault(r.message_group, set()).add(r.broker_group)
        assert homes and all(len(groups) == 1 for groups in homes.values()), homes

        # The audit reads both groups' traces. Both parts are delivered, only g1's acked: an ack is
        # joined to its delivery within its group (both groups number their records from 0).
        on_a = queue_totals(a.endpoint, topic)
        assert asyncio.run(_consume(a.endpoint, "readers", topic, on_a, ack=True)) == on_a
        on_b = FIRST + SECOND - on_a
        assert asyncio.run(_consume(b.endpoint, "readers", topic, on_b, ack=False)) == on_b
        result = audit.run(spark, b.endpoint, grace_s=30)
        assert result.groups == ["g1", "g2"]
        got = {}
        for r in result.rows:
            t = got.setdefault(r["topic"], {"sent": 0, "delivered": 0, "acked": 0})
            for k in t:
                t[k] += r[k]
        assert got[topic] == {"sent": FIRST + SECOND, "delivered": FIRST + SECOND, "acked": on_a}, got
        assert got[back]["sent"] == FIRST + SECOND
        assert result.ok
    finally:
        for node in reversed(nodes):
            node.stop()
