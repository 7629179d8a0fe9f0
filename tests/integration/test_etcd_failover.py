"""Automatic failover through a real etcd on loopback (docs/replication.md, "Automatic failover
with etcd"): real ``chronoq serve`` processes given ``etcd_endpoints`` and no ``--replica-of``,
the official RocketMQ 5 Python client, ``kill -9`` and SIGSTOP of the primary."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request

import pytest

from .conftest import HTTP_ANNOUNCED, ROOT, ChronoqProcess, free_port, wait_until
from .etcd_fixture import etcd  # noqa: F401 - the fixture
from .test_official_python_client import make_message, producer, receive_all, simple_consumer, unique
from .test_replication import cli, cluster_status, kill_9

SYNC_BOUND = "replication_sync_timeout_ms = 1000\n"  # a replica leaves the in-sync set after 1 s silent


def start(tmp_path, name: str, config: str, port: int | None = None) -> ChronoqProcess:
    args = ("--port", str(port)) if port else ()
    node = ChronoqProcess(str(tmp_path / name), config, extra_args=args)
    if port:  # (the last --port wins)
        node.port, node.endpoint = port, f"127.0.0.1:{port}"
    return node


def in_sync(etcd, cluster: str, node: ChronoqProcess) -> bool:  # noqa: F811 - the fixture's value
    view = etcd.view(cluster)
    return view.insync is not None and node.endpoint in view.insync.members


def role_of(node: ChronoqProcess) -> str | None:
    """The node's role (None while it restarts its front end: a promotion)."""
    try:
        return cluster_status(node.endpoint).role
    except Exception:  # noqa: BLE001 - not listening at this moment
        return None


def stderr_has(node: ChronoqProcess, text: str) -> bool:
    with open(node.stderr_path, errors="replace") as fh:
        return text in fh.read()


def commit_log_bytes(data_dir: str) -> bytes:
    directory = os.path.join(data_dir, "commitlog")
    out = b""
    for name in sorted(os.listdir(directory)):
        if name.endswith(".log"):
            with open(os.path.join(directory, name), "rb") as fh:
                out += fh.read()
    return out


def first_acknowledged_send(endpoint: str, topic: str, since: float, limit_s: float = 60.0) -> float:
    """Seconds from ``since`` to the first send a new official producer got acknowledged at
    ``endpoint`` (tried every 0.2 s: before the promotion the route or the send fails)."""
    while time.monotonic() - since < limit_s:
        try:
            with producer(endpoint, topic) as p:
                p.send(make_message(topic, b"after the failover"))
                return time.monotonic() - since
        except Exception:  # noqa: BLE001 - not promoted yet
            time.sleep(0.2)
    raise AssertionError(f"no send acknowledged at {endpoint} within {limit_s} s of the kill")


def test_two_nodes_elect_a_primary_and_the_replica_takes_over_after_kill_9(tmp_path, etcd):  # noqa: F811
    cluster, topic, group = unique("c"), unique("t"), unique("g")
    config = etcd.config(cluster)
    a = start(tmp_path, "a", config)
    b = None
    try:
        assert any(f"leads {cluster}/default at epoch 1" in line for line in a.lines), a.output()
        b = start(tmp_path, "b", config)
        assert any(f"a replica of {a.endpoint}" in line for line in b.lines), b.output()
        view = etcd.view(cluster)
        assert (view.leader.endpoint, view.epoch) == (a.endpoint, 1)
        assert {"127.0.0.1:%d" % n.port for n in (a, b)} <= set(view.members)
        wait_until(lambda: in_sync(etcd, cluster, b), 20, what="the replica in the in-sync set")
        with producer(a.endpoint, topic) as p:
            acked = {p.send(make_message(topic, b"m%d" % i)).message_id for i in range(20)}
        end = cluster_status(a.endpoint).commit_end
        wait_until(lambda: cluster_status(b.endpoint).commit_end >= end, 20, what="the replica to catch up")
        killed = time.monotonic()
        kill_9(a)
        took = first_acknowledged_send(b.endpoint, topic, killed)
        print(f"\nkill -9 of the primary -> first send acknowledged by the promoted replica: {took:.2f} s "
              f"(lease_ttl_ms 2000)")
        view = etcd.view(cluster)
        assert (view.leader.endpoint, view.epoch) == (b.endpoint, 2)
        status = cluster_status(b.endpoint)
        assert (status.role, status.epoch) == ("primary", 2)
        shown = cli("cluster", "status", "--etcd", etcd.endpoint, "--cluster-name", cluster, "--json")
        assert shown.returncode == 0, shown.stderr
        shown = json.loads(shown.stdout)
        assert (shown["leader"]["endpoint"], shown["epoch"]) == (b.endpoint, 2)
        url = [HTTP_ANNOUNCED.search(line) for line in b.lines if HTTP_ANNOUNCED.search(line)][-1].group(1)
        metrics = urllib.request.urlopen(f"{url}metrics", timeout=10).read().decode()  # (the promoted node's listener)
        assert "chronoq_cluster_leader 1.0" in metrics and "chronoq_cluster_epoch 2.0" in metrics
        with simple_consumer(b.endpoint, group, topic) as c:
            got = {m.message_id for m in receive_all(c, len(acked) + 1, timeout_s=10)}
        assert acked <= got, len(acked - got)
    finally:
        if b is not None:
            b.stop()
        a.stop(check=False)


def test_a_paused_primary_is_fenced_and_acknowledges_nothing_more(tmp_path, etcd):  # noqa: F811
    cluster, topic, delayed, group = unique("c"), unique("t"), unique("d"), unique("g")
    due_body = f"due while fenced {unique('m')}".encode()
    config = etcd.config(cluster)
    a = start(tmp_path, "a", config)
    b = None
    try:
        b = start(tmp_path, "b", config)
        wait_until(lambda: in_sync(etcd, cluster, b), 20, what="the replica in the in-sync set")
        with producer(a.endpoint, topic, delayed) as p:
            p.send(make_message(topic, b"before the pause"))
            m = make_message(delayed, due_body)
            m.delivery_timestamp = int(time.time()) + 10  # falls due after the takeover
            p.send(m)
        end = cluster_status(a.endpoint).commit_end
        wait_until(lambda: cluster_status(b.endpoint).commit_end >= end, 20, what="the replica to catch up")
        os.kill(a.proc.pid, signal.SIGSTOP)  # a partition: the primary alive but silent past its lease
        try:
            wait_until(lambda: role_of(b) == "primary", 40, interval_s=0.2,
                       what="the replica to take over")
        finally:
            os.kill(a.proc.pid, signal.SIGCONT)
        assert etcd.view(cluster).leader.endpoint == b.endpoint
        with producer(a.endpoint, topic) as p:  # straight to the old primary (its route names itself)
            with pytest.raises(Exception) as info:
                p.send(make_message(topic, b"sent to the fenced primary"))
        assert "lost leadership" in str(info.value), info.value
        wait_until(lambda: stderr_has(a, "acknowledges nothing more"), 20, what="the fenced primary's log line")
        assert etcd.view(cluster).leader.endpoint == b.endpoint  # (it did not take the lead back)
        with producer(b.endpoint, topic) as p:
            p.send(make_message(topic, b"sent to the new primary"))
        with simple_consumer(b.endpoint, group, delayed) as c:  # the new primary fires the timer ...
            assert [m.body for m in receive_all(c, 1, timeout_s=30)] == [due_body]
        a.stop(check=False)
        old = commit_log_bytes(a.data_dir)
        assert b"before the pause" in old and b"sent to the fenced primary" not in old
        assert old.count(due_body) == 1  # ... the fenced one wrote no copy of it (the original only)
    finally:
        if b is not None:
            b.stop()
        a.stop(check=False)


def test_a_replica_out_of_the_in_sync_set_does_not_take_over(tmp_path, etcd):  # noqa: F811
    cluster = unique("c")
    config = etcd.config(cluster) + SYNC_BOUND
    a = start(tmp_path, "a", config)
    b = again = None
    try:
        b = start(tmp_path, "b", config)
        wait_until(lambda: in_sync(etcd, cluster, b), 20, what="the replica in the in-sync set")
        os.kill(b.proc.pid, signal.SIGSTOP)  # silent past the bound: the primary publishes the set without it
        try:
            wait_until(lambda: not in_sync(etcd, cluster, b), 20, what="the in-sync set to shrink")
            kill_9(a)
        finally:
            os.kill(b.proc.pid, signal.SIGCONT)
        wait_until(lambda: stderr_has(b, "this replica does not campaign"), 30, what="the replica to decline")
        assert etcd.view(cluster).leader is None
        assert cluster_status(b.endpoint).role == "replica"
        refused = cli("promote", "--endpoint", b.endpoint)  # an operator's promote asks for the force
        assert refused.returncode != 0 and "not in the in-sync set" in refused.stderr, refused.stderr
        assert "--force-leader" in refused.stderr and etcd.view(cluster).leader is None
        # The old primary restarted (same address: the same node) is in the set: it leads again, b follows it.
        again = start(tmp_path, "a", config, port=a.port)
        assert any(f"leads {cluster}/default at epoch 2" in line for line in again.lines), again.output()
        wait_until(lambda: cluster_status(b.endpoint).following == again.endpoint, 30, interval_s=0.2,
                   what="the replica to follow the new leader")
    finally:
        for node in (b, again):
            if node is not None:
                node.stop()
        a.stop(check=False)


def test_an_unreachable_etcd_stops_the_start_and_says_so(tmp_path):
    data_dir = tmp_path / "a"
    dead = f"127.0.0.1:{free_port()}"  # nothing listens there
    done = subprocess.run([sys.executable, "-m", "chronoq", "serve", "--data-dir", str(data_dir),
                           "--port", str(free_port()), "--http-port", "off", "--etcd-endpoints", dead],
                          cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, PYTHONPATH=ROOT))
    assert done.returncode == 1, (done.returncode, done.stderr[-2000:])
    assert f"etcd cannot be reached ({dead}" in done.stderr, done.stderr[-2000:]
    assert not (data_dir / "commitlog").exists()  # nothing opened, nothing written


def test_sync_acknowledges_only_once_etcd_no_longer_names_a_replica_that_lacks_the_message(tmp_path, etcd):  # noqa: F811
    """replication = "sync" with etcd: an acknowledgement waits for every replica of the in-sync
    set; one that falls silent is dropped from the set in etcd *before* anything it lacks is
    acknowledged, so whichever member etcd names could take over without losing it."""
    cluster, topic = unique("c"), unique("t")
    config = etcd.config(cluster) + SYNC_BOUND + 'replication = "sync"\n'
    a = start(tmp_path, "a", config)
    b = c = None
    try:
        b = start(tmp_path, "b", config)
        c = start(tmp_path, "c", config)
        wait_until(lambda: in_sync(etcd, cluster, b) and in_sync(etcd, cluster, c), 20,
                   what="both replicas in the in-sync set")
        with producer(a.endpoint, topic) as p:
            p.send(make_message(topic, b"both have it"))
            os.kill(c.proc.pid, signal.SIGSTOP)
            try:
                p.send(make_message(topic, b"c lacks it"))  # waits for c to leave the set, in etcd first
                members = set(etcd.view(cluster).insync.members)
            finally:
                os.kill(c.proc.pid, signal.SIGCONT)
        assert members == {a.endpoint, b.endpoint}, members
    finally:
        for node in (b, c):
            if node is not None:
                node.stop()
        a.stop()


def test_a_node_outside_the_in_sync_set_waits_unless_forced(tmp_path, etcd):  # noqa: F811
    cluster = unique("c")
    config = etcd.config(cluster)
    a = start(tmp_path, "a", config)
    kill_9(a)  # the set was {a}: no other node may take over without losing what a acknowledged
    wait_until(lambda: etcd.view(cluster).leader is None, 20, interval_s=0.2, what="a's lease to expire")
    config_path = tmp_path / "b.toml"
    config_path.write_text(config)
    waiting = subprocess.Popen([sys.executable, "-m", "chronoq", "serve", "--data-dir", str(tmp_path / "b"),
                                "--port", str(free_port()), "--http-port", "off", "--config", str(config_path)],
                               cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                               env=dict(os.environ, PYTHONPATH=ROOT))
    try:
        line = waiting.stdout.readline()
        assert "etcd: waiting for a leader" in line and "not in the in-sync set" in line, line
    finally:
        waiting.terminate()
        assert waiting.wait(30) == 0  # (a clean stop while waiting)
    assert etcd.view(cluster).leader is None
    b = start(tmp_path, "b", config + "force_leader = true\n")
    try:
        assert any(f"leads {cluster}/default at epoch 2" in line for line in b.lines), b.output()
        assert stderr_has(b, "forced campaign") and stderr_has(b, "lacks is lost")
    finally:
        b.stop()


def test_a_primary_that_loses_etcd_fences_itself(tmp_path, etcd):  # noqa: F811
    """It cannot tell a partition from a slow etcd: past its lease deadline it refuses."""
    cluster, topic = unique("c"), unique("t")
    a = start(tmp_path, "a", etcd.config(cluster))
    try:
        with producer(a.endpoint, topic) as p:
            p.send(make_message(topic, b"while etcd answers"))
            etcd.stop()

            def refused() -> str | None:
                try:
                    p.send(make_message(topic, b"after etcd went away"))
                except Exception as exc:  # noqa: BLE001 - the refusal we wait for
                    return str(exc)
                return None
            why = wait_until(refused, 30, interval_s=0.2, what="the primary to refuse without etcd")
        assert "lost leadership" in why, why
        a.stop()  # a clean stop all the same (its lease is left to expire)
    finally:
        a.stop(check=False)
