"""Automatic failover through a real etcd on loopback (docs/replication.md, "Automatic failover
with etcd"): real ``chronoq serve`` processes given ``etcd_endpoints`` and no ``--replica-of``,
the official RocketMQ 5 Python client, ``kill -9`` and SIGSTOP of the primary."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request

import grpc
from rocketmq import Producer
from rocketmq.grpc_protocol import definition_pb2 as pb
from rocketmq.grpc_protocol import service_pb2 as sv
from rocketmq.grpc_protocol import service_pb2_grpc

from .conftest import HTTP_ANNOUNCED, ROOT, ChronoqProcess, free_port, wait_until
from .etcd_fixture import etcd  # noqa: F401 - the fixture
from .test_official_python_client import config as client_config
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
    return stderr_count(node, text) > 0


def stderr_count(node: ChronoqProcess, text: str) -> int:
    with open(node.stderr_path, errors="replace") as fh:
        return fh.read().count(text)


def commit_log_bytes(data_dir: str) -> bytes:
    directory = os.path.join(data_dir, "commitlog")
    out = b""
    for name in sorted(os.listdir(directory)):
        if name.endswith(".log"):
            with open(os.path.join(directory, name), "rb") as fh:
                out += fh.read()
    return out


def same_log(leader, replica, stop, timeout_s: float = 30.0) -> bytes:
    """Waits for ``replica`` to hold ``leader``'s durable log, calls ``stop()`` (the replica first),
    checks the replica's log is the leader's byte for byte up to where it caught up; returns the
    leader's log. ``leader``, ``replica``: anything with ``endpoint`` and ``data_dir``."""
    end = cluster_status(leader.endpoint).commit_end
    wait_until(lambda: cluster_status(replica.endpoint).commit_end >= end, timeout_s, interval_s=0.1,
               what=f"{replica.endpoint} to catch up with {leader.endpoint}")
    stop()
    mine, theirs = commit_log_bytes(replica.data_dir), commit_log_bytes(leader.data_dir)
    assert len(mine) >= end and theirs[:len(mine)] == mine, (len(mine), end, len(theirs))
    return theirs


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
        # (a replica registers its member key beside its follow loop, after it says it is ready)
        wait_until(lambda: {"127.0.0.1:%d" % n.port for n in (a, b)} <= set(etcd.view(cluster).members), 20,
                   what="both nodes' member keys")
        wait_until(lambda: in_sync(etcd, cluster, b), 20, what="the replica in the in-sync set")
        # (status shows the set; the leader records it once etcd answered the publish, a moment
        # after the key above can be read)
        wait_until(lambda: [r.in_sync for r in cluster_status(a.endpoint).replicas] == [True], 10,
                   what="the leader's status to show the replica in sync")
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
        # A group etcd has nothing of (the default name, here) is said so, naming the groups it has.
        unknown = cli("cluster", "status", "--etcd", etcd.endpoint, "--cluster-name", cluster, "--group-name", "nope")
        assert unknown.returncode == 4 and "its groups there are default" in unknown.stderr, unknown.stderr
        unknown = cli("cluster", "status", "--etcd", etcd.endpoint, "--cluster-name", "no-such-cluster")
        assert unknown.returncode == 4 and "no group of that cluster either" in unknown.stderr, unknown.stderr
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


class SendLoad:
    """A little load: one official producer given ``endpoint`` sending numbered messages on a
    thread (bounded in count and time), recording for each send when it began and which broker
    acknowledged it (the receipt's queue names it), or that it failed."""

    def __init__(self, endpoint: str, topic: str, limit: int = 2000, limit_s: float = 90.0) -> None:
        self.results: list[tuple[float, str | None, bytes]] = []  # (monotonic start, acknowledging endpoint, body)
        self._stop = threading.Event()
        self._producer = Producer(client_config(endpoint), (topic,))
        self._producer.startup()
        self._thread = threading.Thread(target=self._run, args=(topic, limit, time.monotonic() + limit_s), daemon=True)
        self._thread.start()

    def _run(self, topic: str, limit: int, until: float) -> None:
        for n in range(limit):
            if self._stop.is_set() or time.monotonic() > until:
                return
            body, began = b"load-%d" % n, time.monotonic()
            try:
                by = str(self._producer.send(make_message(topic, body)).message_queue.endpoints)
            except Exception:  # noqa: BLE001 - refused, or the broker away: not acknowledged
                by = None
                time.sleep(0.05)
            self.results.append((began, by, body))

    def acked(self) -> int:
        return sum(1 for _t, by, _b in self.results if by)

    def close(self) -> None:
        if self._stop.is_set():
            return
        self._stop.set()
        self._thread.join(30)
        assert not self._thread.is_alive(), "the load thread did not stop"
        self._producer.shutdown()


def test_a_paused_primary_is_fenced_then_steps_down_and_follows_the_new_leader(tmp_path, etcd):  # noqa: F811
    """SIGSTOP of the primary under a little load until the replica took over, then SIGCONT: the
    old primary acknowledges nothing more, steps down by itself (no restart), follows the new
    leader (cutting its unacknowledged tail at the epoch boundary), ends with its log byte for
    byte, and its routes name the new leader; a timer due meanwhile is fired by the new one only."""
    cluster, topic, delayed, group = unique("c"), unique("t"), unique("d"), unique("g")
    due_body = f"due while fenced {unique('m')}".encode()
    config = etcd.config(cluster)
    a = start(tmp_path, "a", config)
    b = load = None
    try:
        b = start(tmp_path, "b", config)
        wait_until(lambda: in_sync(etcd, cluster, b), 20, what="the replica in the in-sync set")
        with producer(a.endpoint, delayed) as p:
            m = make_message(delayed, due_body)
            m.delivery_timestamp = int(time.time()) + 8  # falls due after the takeover
            p.send(m)
        load = SendLoad(a.endpoint, topic)
        wait_until(lambda: load.acked() >= 20, 20, what="the load under way")
        os.kill(a.proc.pid, signal.SIGSTOP)  # a partition: the primary alive but silent past its lease
        try:
            wait_until(lambda: role_of(b) == "primary", 40, interval_s=0.2, what="the replica to take over")
        finally:
            resumed = time.monotonic()
            os.kill(a.proc.pid, signal.SIGCONT)
        # It steps down by itself and follows the new leader.
        wait_until(lambda: (lambda st: st is not None and st.role == "replica" and st.following == b.endpoint)(
            status_or_none(a)), 30, interval_s=0.1, what="the old primary to step down and follow the new leader")
        print(f"\nSIGCONT of the fenced primary -> a replica of the new leader: {time.monotonic() - resumed:.2f} s")
        load.close()
        after = [(by, body) for began, by, body in load.results if began >= resumed]
        assert after, "no send was tried after the resume"
        late = [body for by, body in after if by == a.endpoint]
        assert not late, f"the fenced primary acknowledged {len(late)} sends after resuming: {late[:5]}"
        assert stderr_has(a, "acknowledges nothing more") and stderr_has(a, "it steps down")
        assert any("stepped down from epoch 1" in line for line in a.lines), a.output()
        view = etcd.view(cluster)
        assert (view.leader.endpoint, view.epoch) == (b.endpoint, 2)
        assert view.members[a.endpoint]["role"] == "replica", view.members
        # Its routes name the new leader: an official producer given only the old primary's address.
        with producer(a.endpoint, topic) as p:
            receipt = p.send(make_message(topic, b"routed by the old primary"))
        assert str(receipt.message_queue.endpoints) == b.endpoint
        with simple_consumer(b.endpoint, group, delayed) as c:  # the new primary fires the timer
            assert [m.body for m in receive_all(c, 1, timeout_s=30)] == [due_body]
        theirs = same_log(b, a, lambda: (a.stop(), b.stop()))
        for by, body in after:  # what was acknowledged after the resume is in the one history (a's old tail was cut)
            assert by is None or body in theirs, (by, body)
    finally:
        if load is not None:
            load.close()
        if b is not None:
            b.stop(check=False)
        a.stop(check=False)


def status_or_none(node: ChronoqProcess):
    try:
        return cluster_status(node.endpoint)
    except Exception:  # noqa: BLE001 - between its two front ends
        return None


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


def test_a_primary_that_loses_etcd_fences_itself_and_leads_again_once_etcd_answers(tmp_path, etcd):  # noqa: F811
    """It cannot tell a partition from a slow etcd: past its lease deadline it refuses, and its
    route names nobody (a retryable status, never itself) while etcd cannot say who leads. Once
    etcd answers it steps down and, the only member of the in-sync set, campaigns: it leads the
    next epoch (the group is not left leaderless)."""
    cluster, topic = unique("c"), unique("t")
    a = start(tmp_path, "a", etcd.config(cluster))
    try:
        with producer(a.endpoint, topic) as p:
            p.send(make_message(topic, b"while etcd answers"))
            os.kill(etcd.proc.pid, signal.SIGSTOP)  # etcd away (its lease clock stopped with it)
            try:
                def refused() -> str | None:
                    try:
                        p.send(make_message(topic, b"after etcd went away"))
                    except Exception as exc:  # noqa: BLE001 - the refusal we wait for
                        return str(exc)
                    return None
                why = wait_until(refused, 30, interval_s=0.2, what="the primary to refuse without etcd")
                assert "lost leadership" in why, why
                with grpc.insecure_channel(a.endpoint) as channel:
                    route = service_pb2_grpc.MessagingServiceStub(channel).QueryRoute(
                        sv.QueryRouteRequest(topic=pb.Resource(name=topic)), timeout=10,
                        metadata=(("x-mq-client-id", "route@1@1@x"), ("x-mq-language", "PYTHON")))
            finally:
                os.kill(etcd.proc.pid, signal.SIGCONT)
        assert route.status.code == pb.Code.INTERNAL_SERVER_ERROR and not route.message_queues, route
        assert "no new leader is known yet" in route.status.message, route.status.message
        wait_until(lambda: any("leads %s/default at epoch 2" % cluster in line for line in a.lines), 30,
                   interval_s=0.2, what="the stepped-down primary to lead again")
        first_acknowledged_send(a.endpoint, topic, time.monotonic(), 30)  # (once its broker is open again)
        assert (etcd.view(cluster).leader.endpoint, etcd.view(cluster).epoch) == (a.endpoint, 2)
        a.stop()
    finally:
        a.stop(check=False)


def test_a_lone_node_restarted_after_kill_9_reports_the_crash_recovery(tmp_path, etcd):  # noqa: F811
    """With no leader in etcd, a starting node opens its store to learn its log position before it
    campaigns; that open recovers the crash and closes cleanly. The start-up report and
    chronoq_recovery_clean must still say the last stop was a crash, not a clean stop."""
    cluster, topic = unique("c"), unique("t")
    config = etcd.config(cluster)
    a = start(tmp_path, "a", config)
    with producer(a.endpoint, topic) as p:
        for i in range(5):
            p.send(make_message(topic, b"m%d" % i))
    kill_9(a)
    again = start(tmp_path, "a", config, port=a.port)  # the same node: it waits out its old lease
    try:
        assert any(f"leads {cluster}/default" in line for line in again.lines), again.output()
        recovery = [line for line in again.lines if "recovery:" in line]
        assert recovery and "recovered after an unclean stop" in recovery[-1], again.output()
        assert "topics.json" not in recovery[-1]  # (the store's own system topics need no advice)
        url = [HTTP_ANNOUNCED.search(line) for line in again.lines if HTTP_ANNOUNCED.search(line)][-1].group(1)
        metrics = urllib.request.urlopen(f"{url}metrics", timeout=10).read().decode()
        assert "chronoq_recovery_clean 0.0" in metrics
    finally:
        again.stop()



def test_three_nodes_after_an_etcd_outage_all_follow_whoever_leads_next(tmp_path, etcd):  # noqa: F811
    """etcd away past the lease: the primary fences itself, and once etcd answers it steps down
    and a new term is elected. A replica still following the old primary may then be refused by
    it ("a replica, not a primary") before its own etcd watch sees the change: that refusal must
    send it back to etcd to follow the new leader, not end its process (it did, in about a third
    of such outages: the group was left with two nodes, and the next failure under sync took
    writes away). Two outages, so the race is likely met."""
    cluster, topic = unique("c"), unique("t")
    config = etcd.config(cluster) + SYNC_BOUND
    nodes = [start(tmp_path, "a", config)]
    try:
        nodes += [start(tmp_path, "b", config), start(tmp_path, "c", config)]
        wait_until(lambda: all(in_sync(etcd, cluster, n) for n in nodes[1:]), 30, what="both replicas in sync")
        by_endpoint = {n.endpoint: n for n in nodes}

        def settled(epoch: int) -> bool:
            view = etcd.view(cluster)
            if view.leader is None or view.epoch < epoch:
                return False
            roles = [role_of(n) for n in nodes]
            return (roles.count("primary") == 1 and roles.count("replica") == 2
                    and all(in_sync(etcd, cluster, n) for n in nodes if n.endpoint != view.leader.endpoint))

        for outage in (1, 2):
            leader = by_endpoint[etcd.view(cluster).leader.endpoint]
            with producer(leader.endpoint, topic) as p:
                p.send(make_message(topic, f"before outage {outage}".encode()))
            fenced = stderr_count(leader, "acknowledges nothing more")
            os.kill(etcd.proc.pid, signal.SIGSTOP)
            try:
                wait_until(lambda: stderr_count(leader, "acknowledges nothing more") > fenced, 30,
                           interval_s=0.2, what="the primary to fence itself")
                time.sleep(2)  # the replicas keep pulling from it meanwhile
            finally:
                os.kill(etcd.proc.pid, signal.SIGCONT)
            wait_until(lambda: settled(outage + 1), 60, interval_s=0.5,
                       what="one leader of a new term, the two others its in-sync replicas")
            for n in nodes:
                assert n.proc.poll() is None, f"{n.endpoint} exited:\n{n.output()[-2000:]}"
        first_acknowledged_send(etcd.view(cluster).leader.endpoint, topic, time.monotonic(), 30)
    finally:
        for n in reversed(nodes):
            n.stop(check=False)
