"""``chronoq cluster remove-group`` (docs/cluster.md): a broker group drained in every placement,
its lag and pending delayed messages waited for at its primary, then taken out of the route.
Real ``chronoq serve`` processes (two groups' primaries), a real etcd on loopback, the official
RocketMQ 5 Python producer."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import time

from chronoq.replication.cluster import read_once

from .conftest import wait_until
from .etcd_fixture import etcd  # noqa: F401 - the fixture
from .test_cluster import local_queues, route_of, topic_messages, two_groups
from .test_official_python_client import make_message, producer, unique
from .test_replication import cli

STORED = 6  # plain messages stored on g2 directly


def on_g2(endpoint: str, topic: str, consumers: str, take: int):
    """Through chronoq's own client at g2's primary only (not routed): send ``STORED`` plain
    messages and one delayed an hour ahead, then receive and ack up to ``take`` of them."""
    from chronoq.client.client import Client, OutgoingMessage

    async def work():
        async with Client(endpoint) as client:
            await client.send_batch([OutgoingMessage(topic, b"m%d" % i) for i in range(STORED)])
            late, = await client.send_batch([OutgoingMessage(topic, b"late",
                                                             deliver_at_ms=int(time.time() * 1000) + 3_600_000)])
            got = await client.receive(consumers, topic, max_messages=take, wait_s=5)
            await client.ack(consumers, topic, got)
            return len(got), late

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, work()).result(60)


def drain_g2(endpoint: str, topic: str, consumers: str, late, want: int) -> int:
    """Receive and ack the rest at g2's primary; recall the delayed message."""
    from chronoq.client.client import Client

    async def work():
        async with Client(endpoint) as client:
            taken, deadline = 0, time.monotonic() + 20
            while taken < want and time.monotonic() < deadline:
                got = await client.receive(consumers, topic, max_messages=16, wait_s=1)
                await client.ack(consumers, topic, got)
                taken += len(got)
            assert await client.recall(topic, late.recall_handle) == late.message_id
            return taken

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, work()).result(60)


def read(etcd, cluster: str):  # noqa: F811 - the fixture's value
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(read_once, [etcd.endpoint], cluster).result(30)


def placements(etcd, cluster: str) -> dict:  # noqa: F811 - the fixture's value
    return read(etcd, cluster).placements


def test_remove_group_waits_for_its_lag_then_takes_it_out_of_the_route(tmp_path, etcd):  # noqa: F811
    topic, other, consumers = unique("t"), unique("t"), unique("g")
    with two_groups(tmp_path, etcd) as (cluster, a, b):
        for name in (topic, other):
            made = cli("topic", "create", name, "--queues", "2", "--endpoint", a.endpoint)
            assert made.returncode == 0, made.stderr
            wait_until(lambda: local_queues(b, name) == 2, 20, what="g2's part")
        unknown = cli("cluster", "remove-group", "g9", "--endpoint", a.endpoint)
        assert unknown.returncode == 1 and "unknown broker group 'g9'" in unknown.stderr, unknown.stderr

        taken, late = on_g2(b.endpoint, topic, consumers, 2)
        assert 1 <= taken <= 2
        stored_on_b = topic_messages(b, topic)
        assert stored_on_b == STORED

        # Not drained: g2 stays draining, what is left is named, exit status 1.
        first = cli("cluster", "remove-group", "g2", "--endpoint", a.endpoint, "--json")
        assert first.returncode == 1, (first.stdout, first.stderr)
        assert "is draining but not drained" in first.stderr and "remove-group g2` again" in first.stderr
        shown = json.loads(first.stdout)
        assert (shown["removed"], shown["topics"]) == (False, sorted([topic, other]))
        assert shown["left"] == [{"topic": topic, "consumer_group": consumers, "lag": STORED - taken, "inflight": 0}]
        assert shown["pending"] == {topic: "1"}  # the delayed message would fire on g2
        assert shown["settling"]  # (drained by this call: not removed before routes held elsewhere are refreshed)
        text = cli("cluster", "remove-group", "g2", "--endpoint", a.endpoint)
        assert text.returncode == 1 and consumers in text.stdout and "1 delayed message(s) pending" in text.stdout
        assert [(t, p.draining) for t, p in sorted(placements(etcd, cluster).items())] == sorted(
            [(topic, ("g2",)), (other, ("g2",))])
        with producer(b.endpoint, topic) as p:  # routed through g2's node: every send lands on g1
            for i in range(10):
                p.send(make_message(topic, b"x%d" % i))
        assert (topic_messages(a, topic), topic_messages(b, topic)) == (10, stored_on_b)

        # Consumed (and the delayed one recalled): the group leaves both placements.
        assert drain_g2(b.endpoint, topic, consumers, late, STORED - taken) == STORED - taken
        done = cli("cluster", "remove-group", "g2", "--wait", "20", "--endpoint", a.endpoint, "--json")
        assert done.returncode == 0, (done.stdout, done.stderr)
        done = json.loads(done.stdout)
        assert done["removed"] and [(p["topic"], p["groups"], p["draining"]) for p in done["placements"]] == sorted(
            [(topic, {"g1": 2}, []), (other, {"g1": 2}, [])])
        assert [g for g, *_ in route_of(b.endpoint, topic)] == ["g1", "g1"]  # (asked of g2's node too)
        described = cli("topic", "describe", topic, "--endpoint", a.endpoint)
        assert "2 queues over 1 broker group" in described.stdout, described.stdout
        snap = read(etcd, cluster)
        assert "g2" in snap.identities and snap.live() == ["g1", "g2"]  # its identity stays (it may come back)
        again = cli("cluster", "remove-group", "g2", "--endpoint", a.endpoint)
        assert again.returncode == 0 and "holds no queue of any topic" in again.stdout, again.stderr

        # The last group taking sends is refused; so is a dead group, unless forced.
        last = cli("cluster", "remove-group", "g1", "--endpoint", a.endpoint)
        assert last.returncode == 1, last.stdout
        assert f"g1 is the last group taking sends of {', '.join(sorted([topic, other]))}" in last.stderr, last.stderr
        third = unique("t")
        made = cli("topic", "create", third, "--queues", "1", "--endpoint", a.endpoint)
        assert made.returncode == 0, made.stderr
        settling = cli("cluster", "remove-group", "g2", "--endpoint", a.endpoint)  # no lag, but drained just now
        assert settling.returncode == 1 and "was drained just now" in settling.stderr, settling.stderr
        assert placements(etcd, cluster)[third].draining == ("g2",)
        b.stop()
        dead = cli("cluster", "remove-group", "g2", "--endpoint", a.endpoint)
        assert dead.returncode == 1 and "broker group g2 has no primary now" in dead.stderr, dead.stderr
        assert placements(etcd, cluster)[third].groups == {"g1": 1, "g2": 1}  # (refused: nothing written)
        forced = cli("cluster", "remove-group", "g2", "--force", "--endpoint", a.endpoint)
        assert forced.returncode == 0 and "forced: g2 had no primary" in forced.stdout, (forced.stdout, forced.stderr)
        assert placements(etcd, cluster)[third].groups == {"g1": 1}
