"""Two broker groups in one cluster, a topic spread over both, one route (docs/cluster.md): real
``chronoq serve`` processes, a real etcd on loopback, the official RocketMQ 5 Python client."""

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
from .test_official_python_client import Recorder, make_message, producer, push_consumer, simple_consumer, unique
from .test_replication import cli

PLAIN, FIFO_GROUPS, FIFO_EACH, DELAYED = 1200, 8, 40, 200


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


def test_a_topic_spread_over_two_groups_is_sent_and_received_through_one_route(tmp_path, etcd):  # noqa: F811
    topic, consumers = unique("t"), unique("g")
    with two_groups(tmp_path, etcd) as (cluster, a, b):
        made = cli("topic", "create", topic, "--queues", "4", "--endpoint", a.endpoint, "--json")
        assert made.returncode == 0, made.stderr
        assert json.loads(made.stdout)["queues"] == 8  # 4 on each live group
        with concurrent.futures.ThreadPoolExecutor(1) as pool:  # the record in etcd itself
            snap = pool.submit(read_once, [etcd.endpoint], cluster).result(30)
        assert (snap.placements[topic].groups, snap.placements[topic].message_type) == ({"g1": 4, "g2": 4}, "mixed")
        assert snap.live() == ["g1", "g2"] and set(snap.identities) == {"g1", "g2"}
        wait_until(lambda: local_queues(b, topic) == 4, 20, what="g2's primary to create its part (the watch)")
        assert local_queues(a, topic) == 4
        shown = cli("cluster", "groups", "--endpoint", b.endpoint, "--json")
        assert shown.returncode == 0, shown.stderr
        shown = json.loads(shown.stdout)
        assert {g["name"]: (g["live"], g["leader"]) for g in shown["groups"]} == {
            "g1": (True, a.endpoint), "g2": (True, b.endpoint)}
        assert [(p["topic"], p["groups"]) for p in shown["placements"]] == [(topic, {"g1": 4, "g2": 4})]
        described = cli("topic", "describe", topic, "--endpoint", a.endpoint)
        assert "8 queues over 2 broker groups" in described.stdout, described.stdout

        # The official producer, given g1's address only: its route names both groups' primaries.
        sent_at = time.time()
        due = {}
        fifo = [b"f%d-%d" % (g, i) for i in range(FIFO_EACH) for g in range(FIFO_GROUPS)]
        with producer(a.endpoint, topic) as p:
            plain = {p.send(make_message(topic, b"p%d" % i)).message_id for i in range(PLAIN)}
            for body in fifo:
                p.send(make_message(topic, body, group="mg-" + body[1:body.index(b"-")].decode()))
            for i in range(DELAYED):
                m = make_message(topic, b"d%d" % i)
                m.delivery_timestamp = due[m.body] = int(sent_at) + 3 + i % 4
                p.send(m)
        total = PLAIN + len(fifo) + DELAYED
        on_a, on_b = topic_messages(a, topic), topic_messages(b, topic)
        assert on_a > total // 4 and on_b > total // 4, (on_a, on_b)  # round robin over both groups

        # One simple consumer given g2's address receives from both groups, each message once.
        bodies, seen_at, ids = [], {}, Counter()
        deadline = time.monotonic() + 90
        with simple_consumer(b.endpoint, consumers, topic) as c:
            while len(ids) < total and time.monotonic() < deadline:
                for m in c.receive(32, 60):
                    ids[m.message_id] += 1
                    bodies.append(m.body)
                    seen_at.setdefault(m.body, time.time())
                    c.ack(m)
            time.sleep(1)
            for m in c.receive(32, 60):  # nothing more
                ids[m.message_id] += 1
        assert len(ids) == total and max(ids.values()) == 1, (len(ids), total, ids.most_common(3))
        assert plain <= set(ids)
        for g in range(FIFO_GROUPS):  # each message group in its order (one queue of one group)
            mine = [x for x in bodies if x.startswith(b"f%d-" % g)]
            assert mine == [b"f%d-%d" % (g, i) for i in range(FIFO_EACH)], mine[:10]
        early = {x: due[x] - seen_at[x] for x in due if seen_at[x] < due[x]}
        assert not early, f"delivered early (s): {early}"

        # A push consumer of another consumer group (QueryAssignment: one assignment per group)
        # gets the whole topic too, each message once.
        recorder = Recorder()
        with push_consumer(a.endpoint, unique("push"), topic, recorder):
            wait_until(lambda: len({d[1] for d in list(recorder.deliveries)}) >= total, 90,
                       what="the push consumer to get every message from both groups")
            time.sleep(1)
        pushed = Counter(d[1] for d in recorder.deliveries)
        assert set(pushed) == set(ids) and max(pushed.values()) == 1, pushed.most_common(3)


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


def test_a_groups_primary_killed_mid_run_its_replica_takes_over_and_no_acknowledged_message_is_lost(
        tmp_path, etcd):  # noqa: F811
    """Two groups, each a primary and a replica (replication = "sync"); the official producer
    sends while g1's primary is killed (-9): its attempts on g1 fail over to g2's queues (2 per
    group: any 3 consecutive queues of the route include g2's), g1's replica wins g1's leader key
    and is routed to from then on, and every acknowledged message is received."""
    import threading

    from .test_replication import kill_9

    cluster, topic, consumers = unique("c"), unique("t"), unique("g")
    nodes = {}
    try:
        for name in ("a1", "a2", "b1", "b2"):  # the first node of each group leads, the second follows
            group = "g1" if name[0] == "a" else "g2"
            config = etcd.config(cluster) + f'group_name = "{group}"\nreplication = "sync"\n' \
                "replication_sync_timeout_ms = 1000\n"
            nodes[name] = ChronoqProcess(str(tmp_path / name), config)
        for group, replica in (("g1", "a2"), ("g2", "b2")):
            wait_until(lambda: (etcd.view(cluster, group).insync is not None
                                and nodes[replica].endpoint in etcd.view(cluster, group).insync.members), 30,
                       what=f"{replica} in {group}'s in-sync set")
        made = cli("topic", "create", topic, "--queues", "2", "--endpoint", nodes["b2"].endpoint)  # (a replica
        assert made.returncode == 1, made.stdout  # refuses admin calls; a primary places the topic)
        made = cli("topic", "create", topic, "--queues", "2", "--endpoint", nodes["b1"].endpoint)
        assert made.returncode == 0, made.stderr
        wait_until(lambda: local_queues(nodes["a1"], topic) == 2, 20, what="g1's part")

        acked, failed, due = set(), [], {}
        half = threading.Event()

        def load() -> None:
            with producer(nodes["b2"].endpoint, topic) as p:  # (a replica's address: routed by its primary)
                for i in range(600):
                    m = make_message(topic, b"m%d" % i)
                    if i % 5 == 0:
                        m.delivery_timestamp = due[m.body] = int(time.time()) + 2
                    try:
                        acked.add(p.send(m).message_id)
                    except Exception as exc:  # noqa: BLE001 - three attempts failed: not acknowledged
                        failed.append(repr(exc))
                    if i == 200:
                        half.set()

        sender = threading.Thread(target=load)
        sender.start()
        assert half.wait(120)
        kill_9(nodes["a1"])
        sender.join(300)
        assert not sender.is_alive()
        wait_until(lambda: ("g1", nodes["a2"].endpoint) in {(g, e) for g, e, *_ in route_of(nodes["b1"].endpoint,
                                                                                              topic)}, 60,
                   what="g1's replica promoted and in the route")
        # (the leader key, and so the route, names a2 from its campaign on; it serves a moment later,
        # once its broker is open: a client's attempt on it meanwhile fails over to g2)
        wait_until(lambda: cli("topic", "describe", topic, "--endpoint", nodes["a2"].endpoint).returncode == 0,
                   60, what="g1's promoted replica serving")
        with producer(nodes["b1"].endpoint, topic) as p:  # a producer started now is routed to both at once
            after = {p.send(make_message(topic, b"n%d" % i)).message_id for i in range(40)}
        assert topic_messages(nodes["a2"], topic) > 0 and topic_messages(nodes["b1"], topic) > 0

        ids, seen_at = Counter(), {}
        deadline = time.monotonic() + 90
        with simple_consumer(nodes["a2"].endpoint, consumers, topic) as c:
            while not (acked | after) <= set(ids) and time.monotonic() < deadline:
                for m in c.receive(32, 60):
                    ids[m.message_id] += 1
                    seen_at.setdefault(m.body, time.time())
                    c.ack(m)
        lost = (acked | after) - set(ids)
        assert not lost, f"{len(lost)} acknowledged messages lost ({len(acked)} acked, {len(failed)} sends failed)"
        early = {x: due[x] - seen_at[x] for x in due if x in seen_at and seen_at[x] < due[x]}
        assert not early, f"delivered early (s): {early}"
        print(f"\n{len(acked)} acknowledged of 600 across the kill ({len(failed)} failed after 3 attempts), "
              f"{sum(n - 1 for n in ids.values())} received twice")
    finally:
        for node in reversed(list(nodes.values())):
            node.stop(check=False)


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
