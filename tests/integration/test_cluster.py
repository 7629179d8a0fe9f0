"""Two broker groups in one cluster, a topic spread over both, one route (docs/cluster.md): real
``chronoq serve`` processes, a real etcd on loopback, the official RocketMQ 5 Python and Node
clients; the load test through a primary's kill is docs/cluster.md's "What the cluster test shows"."""

from __future__ import annotations

import concurrent.futures
import json
import time
from collections import Counter
from contextlib import contextmanager

import pytest

from chronoq.replication.cluster import read_once

from .conftest import ChronoqProcess, wait_until
from .etcd_fixture import etcd  # noqa: F401 - the fixture
from .test_official_python_client import make_message, producer, unique
from .test_replication import cli


def group_node(tmp_path, etcd, cluster: str, group: str) -> ChronoqProcess:  # noqa: F811 - the fixture's value
    return ChronoqProcess(str(tmp_path / group), etcd.config(cluster) + f'group_name = "{group}"\n')


@contextmanager
def two_groups(tmp_path, etcd):  # noqa: F811 - the fixture's value
    """A new cluster of two groups, g1 and g2, each a primary: (cluster, g1's node, g2's node)."""
    cluster = unique("c")
    nodes = [group_node(tmp_path, etcd, cluster, "g1")]
    try:
        nodes.append(group_node(tmp_path, etcd, cluster, "g2"))
        yield cluster, nodes[0], nodes[1]
    finally:
        for node in reversed(nodes):
            node.stop()


def topic_messages(node: ChronoqProcess, topic: str) -> int:
    shown = cli("topic", "describe", topic, "--endpoint", node.endpoint, "--json")
    assert shown.returncode == 0, shown.stderr
    return json.loads(shown.stdout)["messages"]


def route_of(endpoint: str, topic: str) -> list[tuple[str, str, int, int]]:
    """QueryRoute's answer through chronoq's own client: (group, endpoint, queue id, permission)."""
    import asyncio
    import concurrent.futures

    from chronoq.client.client import Client

    async def ask():
        async with Client(endpoint) as client:
            queues = await client.route(topic)
        return [(q.broker.name, f"{q.broker.endpoints.addresses[0].host}:{q.broker.endpoints.addresses[0].port}",
                 q.id, q.permission) for q in queues]

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, ask()).result(30)


def local_queues(node: ChronoqProcess, topic: str) -> int | None:
    shown = cli("topic", "list", "--endpoint", node.endpoint, "--json")
    assert shown.returncode == 0, shown.stderr
    return {t["name"]: t["queues"] for t in json.loads(shown.stdout)}.get(topic)


# 10,000 messages: 8,000 from the official Python producer (15 message groups of 100, 1,500
# delayed 1-4 s, 5,000 plain), 2,000 from the official Node producer (tests/node/cluster_load.mjs:
# 4 message groups of 125, 400 delayed, 1,100 plain).
PY_PLAIN, PY_DELAYED, PY_FIFO_GROUPS, PY_FIFO_EACH, NODE_COUNT, NODE_FIFO_GROUPS = 5000, 1500, 15, 100, 2000, 4
KILL_AFTER_S = 3.0  # into the load: the Python clients' first route refresh (10 s after their start) finds the replica
LOAD_DEADLINE_S = 90.0


def test_ten_thousand_messages_over_two_groups_through_a_primarys_kill(tmp_path, etcd):  # noqa: F811
    """Two groups, each a primary and a replica (``replication = "sync"``), a topic of one queue
    on each (the Node client 1.0.8 uses queue 0 of each group only). The official Python and Node
    producers send 10,000 messages (plain, delayed, FIFO) while a Python and a Node simple
    consumer (two FIFO consumer groups) receive; 3 s into the load g1's primary is killed (-9);
    its replica wins g1's leader key and the route names it; the killed node comes back as its
    replica. Per consumer group: every acknowledged message delivered, none early, each message
    group in order, duplicates only as the kill explains them (``cluster_load.judge`` says which),
    the rest exactly once. The figures are printed (docs/cluster.md, "What the cluster test shows")."""
    from . import test_node_client as node_client
    from .cluster_load import Ledger, NodeLoad, PythonSender, SimpleReceivers, describe_missing, judge
    from .conftest import groups_toml
    from .test_replication import kill_9

    if node_client.NODE is None:
        pytest.skip("node (Node.js) is not installed on this machine")
    node_client._installed_client_version()
    cluster, topic, simple_group, node_group = unique("c"), unique("t"), unique("simple"), unique("node")
    settings = ('replication = "sync"\nreplication_sync_timeout_ms = 1000\n'
                + groups_toml({simple_group: {"fifo": True}, node_group: {"fifo": True}}))
    nodes: dict[str, ChronoqProcess] = {}
    clients = []
    try:
        def start(name: str) -> None:
            nodes[name] = ChronoqProcess(str(tmp_path / name), etcd.config(cluster) + 'group_name = "g%s"\n'
                                         % ("1" if name[0] == "a" else "2") + settings)

        with concurrent.futures.ThreadPoolExecutor(2) as pool:  # the primaries, then their replicas
            list(pool.map(start, ("a1", "b1")))
            list(pool.map(start, ("a2", "b2")))
        a1, a2, b1, b2 = (nodes[n] for n in ("a1", "a2", "b1", "b2"))
        for group, replica in (("g1", a2), ("g2", b2)):
            wait_until(lambda: (etcd.view(cluster, group).insync is not None
                                and replica.endpoint in etcd.view(cluster, group).insync.members), 30,
                       what=f"{replica.endpoint} in {group}'s in-sync set")
        made = cli("topic", "create", topic, "--queues", "1", "--endpoint", b2.endpoint)  # (a replica refuses
        assert made.returncode == 1 and b1.endpoint in made.stderr, made.stderr  # admin calls, naming its primary)
        made = cli("topic", "create", topic, "--queues", "1", "--endpoint", b1.endpoint, "--json")
        assert made.returncode == 0 and json.loads(made.stdout)["queues"] == 2, made.stderr  # 1 on each group
        with concurrent.futures.ThreadPoolExecutor(1) as pool:  # the record in etcd itself
            snap = pool.submit(read_once, [etcd.endpoint], cluster).result(30)
        assert (snap.placements[topic].groups, snap.placements[topic].message_type) == ({"g1": 1, "g2": 1}, "mixed")
        assert snap.live() == ["g1", "g2"] and set(snap.identities) == {"g1", "g2"}
        wait_until(lambda: local_queues(a1, topic) == 1, 20, what="g1's primary to create its part (the watch)")
        shown = cli("cluster", "groups", "--endpoint", a1.endpoint, "--json")
        assert shown.returncode == 0, shown.stderr
        shown = json.loads(shown.stdout)
        assert {g["name"]: (g["live"], g["leader"]) for g in shown["groups"]} == {
            "g1": (True, a1.endpoint), "g2": (True, b1.endpoint)}

        ledger = Ledger()
        deadline = time.monotonic() + LOAD_DEADLINE_S
        simple = SimpleReceivers(b1.endpoint, simple_group, topic, ledger, "simple", threads=8)
        simple.start()
        clients.append(simple.close)
        node = NodeLoad(node_client.NODE, b2.endpoint, topic, NODE_COUNT, NODE_FIFO_GROUPS, LOAD_DEADLINE_S,
                        node_group, ledger, "node")
        clients.append(node.stop)
        sender = PythonSender(b2.endpoint, topic, ledger, plain=PY_PLAIN, delayed=PY_DELAYED,  # (a replica's
                              fifo_groups=PY_FIFO_GROUPS, fifo_each=PY_FIFO_EACH, window=128,  # address: routed
                              deadline=deadline - 20)  # by its primary)
        sender.start()
        time.sleep(KILL_AFTER_S)
        acked_before = ledger.acked()
        kill_at = time.time()
        kill_9(a1)
        wait_until(lambda: getattr(etcd.view(cluster, "g1").leader, "endpoint", None) == a2.endpoint, 30,
                   interval_s=0.05, what="g1's replica to win g1's leader key")
        leader_s = time.time() - kill_at
        wait_until(lambda: ("g1", a2.endpoint) in {(g, e) for g, e, *_ in route_of(b1.endpoint, topic)}, 30,
                   what="the route to name g1's replica")
        route_s = time.time() - kill_at
        node.failover()
        # The promoted replica is alone in g1: under "sync" it refuses sends until a replica is in
        # sync again. The killed node comes back on its directory and follows it (rejoining).
        nodes["a1r"] = a1r = ChronoqProcess(a1.data_dir, etcd.config(cluster) + 'group_name = "g1"\n' + settings)
        wait_until(lambda: (etcd.view(cluster, "g1").insync is not None
                            and a1r.endpoint in etcd.view(cluster, "g1").insync.members), 30, interval_s=0.1,
                   what="the killed node back in g1's in-sync set")
        outage_end = time.time()
        sender.join()
        assert node.sent.wait(max(1.0, deadline - time.monotonic())), f"the Node producer did not finish:\n{node.log()}"
        sent_s = time.time() - kill_at

        while (ledger.missing("simple") or ledger.missing("node")) and time.monotonic() < deadline:
            time.sleep(0.2)
        if ledger.missing("simple") or ledger.missing("node"):
            shown = cli("group", "list", "--endpoint", a2.endpoint, "--json")
            raise AssertionError("\n".join(describe_missing(ledger, label, kill_at) for label in ("simple", "node"))
                                 + f"\nports: a1 {a1.port}, a2 {a2.port}, a1 rejoined {a1r.port}, b1 {b1.port}; "
                                 f"failed Python receives/acks {simple.failed_receives}/{simple.failed_acks}; "
                                 f"g1's consumer groups on a2: {shown.stdout} {shown.stderr}")
        # Redeliveries come at once (a delivery the replica never saw) or when the invisible time
        # of one it saw ends (5 s): wait past both, so a duplicate that comes late is counted too.
        time.sleep(max(1.0, kill_at + route_s + 6 - time.time()))
        simple.close()
        node_done = node.stop()
        clients.clear()

        group_of_port = {a1.port: "g1", a2.port: "g1", a1r.port: "g1", b1.port: "g2", b2.port: "g2"}
        figures = {label: judge(ledger, label, kill_at, outage_end, a1.port, group_of_port)
                   for label in ("simple", "node")}
        sends = list(ledger.sends.values())
        acked = sum(s.acked for s in sends)
        assert len(sends) == 10_000 and acked == 10_000, (len(sends), acked)  # every send acknowledged in the end
        by_group = Counter(group_of_port[d.port] for d in ledger.deliveries)
        assert by_group["g1"] > 1000 and by_group["g2"] > 1000, by_group  # the topic is spread over both
        assert any(d.port == a2.port for d in ledger.deliveries)  # and the replica took g1's part over
        kinds = Counter(s.kind for s in sends)
        print(f"\n{len(sends)} sent ({dict(kinds)}), {acked_before} acknowledged before the kill; resends after a "
              f"failed send: {sum(s.failures for s in sends)}; Node run {node_done['elapsed_ms']} ms; "
              f"g1's leader key on its replica {leader_s:.1f} s after the kill, routed {route_s:.1f} s, "
              f"g1 taking sends again (the killed node rejoined, in sync) {outage_end - kill_at:.1f} s; "
              f"all sent {sent_s:.1f} s after the kill; failed receives/acks: Python {simple.failed_receives}/{simple.failed_acks}, Node "
              f"{node_done['failedReceives']}/{node_done['failedAcks']}")
        for label, f in figures.items():
            print(f"{label}: {f}")
    finally:
        for close in reversed(clients):
            try:
                close()
            except Exception:  # noqa: BLE001 - cleanup after a failure
                pass
        for n in reversed(list(nodes.values())):
            n.stop(check=False)

def test_a_dead_group_leaves_the_route_and_refusals_name_the_group(tmp_path, etcd):  # noqa: F811
    topic, other = unique("t"), unique("t")
    with two_groups(tmp_path, etcd) as (cluster, a, b):
        unknown = cli("topic", "create", topic, "--groups", "g1,g9", "--endpoint", a.endpoint)
        assert unknown.returncode == 1 and "unknown broker group 'g9'" in unknown.stderr, unknown.stderr
        made = cli("topic", "create", topic, "--groups", "g2", "--queues", "2", "--endpoint", a.endpoint, "--json")
        assert made.returncode == 0, made.stderr
        assert json.loads(made.stdout)["groups"] == {"g2": 2}
        wait_until(lambda: local_queues(b, topic) == 2, 20, what="g2's part")
        assert local_queues(a, topic) is None  # g1 holds none of it
        last = cli("cluster", "drain", topic, "--group", "g2", "--endpoint", a.endpoint)
        assert last.returncode == 1 and "last group taking sends" in last.stderr, last.stderr
        added = cli("topic", "add-queues", topic, "--group", "g1", "--endpoint", b.endpoint, "--json")
        assert added.returncode == 0, added.stderr
        assert json.loads(added.stdout)["groups"] == {"g1": 2, "g2": 2}
        wait_until(lambda: local_queues(a, topic) == 2, 20, what="g1's part")
        rw, read_only = 4, 2  # pb.READ_WRITE, pb.READ
        assert route_of(b.endpoint, topic) == [("g1", a.endpoint, 0, rw), ("g1", a.endpoint, 1, rw),
                                               ("g2", b.endpoint, 0, rw), ("g2", b.endpoint, 1, rw)]
        with producer(a.endpoint, topic) as p:
            for i in range(20):
                p.send(make_message(topic, b"w%d" % i))
        assert (topic_messages(a, topic), topic_messages(b, topic)) == (10, 10)  # round robin over 4 queues
        sent = cli("send", topic, "c", "--count", "20", "--batch-size", "5", "--endpoint", b.endpoint)
        assert sent.returncode == 0, sent.stderr  # chronoq send: batches round robin over the groups
        assert (topic_messages(a, topic), topic_messages(b, topic)) == (20, 20)
        drained = cli("cluster", "drain", topic, "--group", "g2", "--endpoint", a.endpoint, "--json")
        assert drained.returncode == 0 and json.loads(drained.stdout)["draining"] == ["g2"], drained.stderr
        with producer(a.endpoint, topic) as p:  # a draining group takes no sends
            for i in range(20):
                p.send(make_message(topic, b"x%d" % i))
        assert (topic_messages(a, topic), topic_messages(b, topic)) == (40, 20)
        assert [(g, q, perm) for g, _e, q, perm in route_of(a.endpoint, topic)] == [
            ("g1", 0, rw), ("g1", 1, rw), ("g2", 0, read_only), ("g2", 1, read_only)]

        b.stop()  # a clean stop revokes g2's lease: its leader key goes at once
        assert etcd.view(cluster, "g2").leader is None
        wait_until(lambda: [g for g, *_ in route_of(a.endpoint, topic)] == ["g1", "g1"], 10,
                   what="g2 out of the route (the leader key's deletion, watched)")
        shown = cli("cluster", "groups", "--etcd", etcd.endpoint, "--cluster-name", cluster, "--json")
        assert shown.returncode == 0, shown.stderr  # (etcd read directly: no node asked)
        shown = json.loads(shown.stdout)
        assert [(g["name"], g["live"]) for g in shown["groups"]] == [("g1", True), ("g2", False)]
        assert shown["placements"][0]["groups"] == {"g1": 2, "g2": 2}
        dead = cli("topic", "create", other, "--groups", "g2", "--endpoint", a.endpoint)
        assert dead.returncode == 1 and "broker group 'g2' has no primary now" in dead.stderr, dead.stderr
        default = cli("topic", "create", other, "--queues", "3", "--endpoint", a.endpoint, "--json")
        assert default.returncode == 0 and json.loads(default.stdout)["queues"] == 3, default.stderr  # g1 only
        with producer(a.endpoint, topic) as p:  # the route names g1 alone now: every send lands there
            for i in range(10):
                p.send(make_message(topic, b"y%d" % i))
        assert topic_messages(a, topic) == 50


def test_two_groups_cannot_claim_one_name(tmp_path, etcd):  # noqa: F811
    """A data directory keeps its group's identity (cluster.json); started under a name that etcd
    gives another group, or under another cluster's name, it is refused and changes nothing."""
    import subprocess
    import sys

    from .conftest import ROOT, free_port

    ours, theirs = unique("c"), unique("c")
    a = group_node(tmp_path, etcd, ours, "g1")
    other = None
    (tmp_path / "other").mkdir()
    try:
        other = group_node(tmp_path / "other", etcd, theirs, "g1")  # a group of the same name, another cluster
        other.stop()
        other = None
        with open(tmp_path / "other" / "g1" / "cluster.json", "rb") as fh:
            before = fh.read()

        def serve(cluster: str) -> subprocess.CompletedProcess:
            config = tmp_path / f"claim-{cluster}.toml"
            config.write_text(etcd.config(cluster) + 'group_name = "g1"\n')
            directory = str(tmp_path / "other" / "g1")
            return subprocess.run([sys.executable, "-m", "chronoq", "serve", "--data-dir", directory, "--host",
                                   "127.0.0.1", "--port", str(free_port()), "--http-port", "off",
                                   "--config", str(config)], cwd=ROOT, capture_output=True, text=True, timeout=60)

        moved = serve(ours)  # the other cluster's g1 pointed at ours: its identity differs from ours
        assert moved.returncode == 1, moved.stderr[-2000:]
        assert f"this data directory belongs to broker group 'g1' of cluster '{theirs}'" in moved.stderr, moved.stderr
        with open(tmp_path / "other" / "g1" / "cluster.json", "rb") as fh:
            assert fh.read() == before
        # A directory of a g1 of ours with another identity (etcd was replaced since it last ran).
        from chronoq.core import fsutil

        fsutil.write_json(str(tmp_path / "other" / "g1" / "cluster.json"), {"cluster": ours, "group": "g1", "id": "x1"})
        taken = serve(ours)
        assert taken.returncode == 1, taken.stderr[-2000:]
        assert f"broker group name 'g1' of cluster '{ours}' is taken in etcd by another group" in taken.stderr, \
            taken.stderr
        assert etcd.view(ours, "g1").leader.endpoint == a.endpoint  # ours still led by a
    finally:
        if other is not None:
            other.stop()
        a.stop()


def test_the_official_node_client_sends_to_and_receives_from_both_groups(tmp_path, etcd):  # noqa: F811
    """The Node client 1.0.8 keeps only the route's queues whose *queue* id is 0 (it compares the
    queue id with the master broker id): each group's local ids start at 0, so it still sends
    round robin over every group's queue 0 and receives from each."""
    from . import test_node_client as node

    if node.NODE is None:
        pytest.skip("node (Node.js) is not installed on this machine")
    node._installed_client_version()
    topic, group = unique("node"), unique("node-grp")
    with two_groups(tmp_path, etcd) as (_cluster, a, b):
        made = cli("topic", "create", topic, "--queues", "2", "--endpoint", a.endpoint)
        assert made.returncode == 0, made.stderr
        wait_until(lambda: local_queues(b, topic) == 2, 20, what="g2's part")
        result = node.run_script(b.endpoint, topic, group)
        sent = {s["messageId"] for s in result["sent"]}
        assert len(sent) == node.COUNT and sorted(result["acked"]) == sorted(sent)
        assert topic_messages(a, topic) > 0 and topic_messages(b, topic) > 0
        assert topic_messages(a, topic) + topic_messages(b, topic) == node.COUNT


def test_an_etcd_that_lost_its_data_is_said_so(tmp_path, etcd):  # noqa: F811
    """The cluster's placements and group identities live in etcd only. etcd wiped (or replaced)
    under a running cluster: the groups elect leaders again and serve, each showing its own part
    of a spread topic only, and nothing said so. The node now logs an error naming the loss,
    and a node started afterwards warns that etcd forgot a group its data directory records."""
    import shutil

    from .etcd_fixture import Etcd

    cluster = unique("c")
    a = group_node(tmp_path, etcd, cluster, "g1")
    fresh = None
    try:
        wait_until(lambda: etcd.view(cluster, "g1").leader is not None, 20, what="g1 led")
        etcd.stop()
        shutil.rmtree(tmp_path / "etcd" / "etcd-data")
        fresh = Etcd(str(tmp_path / "etcd"), port=etcd.port)  # the same address, no data
        wait_until(lambda: "etcd no longer holds broker group g1's identity" in a.output(), 60, interval_s=0.5,
                   what="the node to say etcd lost the cluster's data")
        a.stop()
        port = a.port  # (restarted where it was: the in-sync set etcd now holds names that endpoint)
        a = ChronoqProcess(str(tmp_path / "g1"), fresh.config(cluster) + 'group_name = "g1"\n',
                           extra_args=("--port", str(port)))
        assert "etcd holds no identity for broker group g1" in a.output()  # (its directory records it)
    finally:
        a.stop(check=False)
        if fresh is not None:
            fresh.stop()
