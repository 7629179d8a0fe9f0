"""Replication with real processes on loopback (docs/replication.md): a primary, a replica that
follows it (``chronoq serve --replica-of``), failover by ``chronoq promote`` after ``kill -9`` of
the primary, and the refusals (a replica pointed at itself, at another replica, at a primary
whose log its own does not prefix, without credentials), each changing nothing on either side.
Sends go through the official RocketMQ 5 Python client."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import urllib.request

import grpc
import pytest

from chronoq.replication.client import ReplicationClient

from .conftest import ROOT, ChronoqProcess, wait_until
from .test_official_python_client import make_message, producer, receive_all, simple_consumer, unique

CONFIG = "segment_bytes = 262144\n"  # small segments: the replica must roll where the primary did


def cluster_status(endpoint: str, **credentials):
    """``ClusterStatus`` of ``endpoint`` (on a thread of its own: the official client wants this
    thread's event loop left alone)."""
    async def ask():
        async with ReplicationClient(endpoint, request_timeout_s=5, **credentials) as client:
            return await client.status()

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, ask()).result(30)


def cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "chronoq", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=180, env=dict(os.environ, PYTHONPATH=ROOT, **(env or {})))


def log_bytes(data_dir: str) -> dict[str, bytes]:
    directory = os.path.join(data_dir, "commitlog")
    out = {}
    for name in sorted(os.listdir(directory)) if os.path.isdir(directory) else ():
        if name.endswith(".log"):
            with open(os.path.join(directory, name), "rb") as fh:
                out[name] = fh.read()
    return out


def assert_log_is_prefix(replica_dir: str, primary_dir: str, replica_end: int | None = None) -> int:
    """The replica's commit log is the primary's, byte for byte, up to the replica's end
    (``replica_end``, its durable end while it runs; stopped: its files' lengths), in the same
    segment files, each sealed one whole; returns that end. A running node's active segment has a
    preallocated zero tail past its data: only its data is compared."""
    replica, primary = log_bytes(replica_dir), log_bytes(primary_dir)
    names = sorted(replica)
    assert names and names == sorted(primary)[:len(names)], (names, sorted(primary))
    for name in names[:-1]:
        assert replica[name] == primary[name], name
    last = names[-1]
    data = replica[last]
    if replica_end is not None:  # (it may have copied more since: what lies past is not compared)
        data = data[:replica_end - int(last[:-4])]
    assert data and primary[last][:len(data)] == data, last
    return int(last[:-4]) + len(data)


def kill_9(proc: ChronoqProcess) -> None:
    proc.proc.send_signal(signal.SIGKILL)
    proc.proc.wait(10)
    proc.stop(check=False)
    assert proc.proc.returncode == -signal.SIGKILL


def wait_caught_up(replica: ChronoqProcess, primary_end: int, timeout_s: float = 30.0) -> None:
    wait_until(lambda: cluster_status(replica.endpoint).commit_end >= primary_end, timeout_s,
               interval_s=0.1, what=f"the replica to reach {primary_end}")


def wait_in_sync(primary: ChronoqProcess, since_ms: float = 0, timeout_s: float = 20.0) -> None:
    """Until the primary counts its replica in sync (``PrimaryNode.in_sync``): a pull (after
    ``since_ms``) reporting everything the primary holds durably."""
    def in_sync():
        st = cluster_status(primary.endpoint)
        return bool(st.replicas) and st.replicas[0].last_pull_ms > since_ms and st.replicas[0].in_sync

    wait_until(in_sync, timeout_s, interval_s=0.05, what="the replica in sync (pulled, holding all the primary has)")


# ------------------------------------------------------------------------------------ failover
def test_failover_keeps_every_copied_message_and_fires_timers_never_early(tmp_path):
    primary = ChronoqProcess(str(tmp_path / "p"), CONFIG)
    replica = None
    try:
        replica = ChronoqProcess(str(tmp_path / "r"), CONFIG, extra_args=("--replica-of", primary.endpoint))
        plain, delayed, fifo, group = unique("plain"), unique("delayed"), unique("fifo"), unique("g")
        sent_at = time.time()
        due = {}  # delayed body -> due time (s): some during the outage, some after the promotion
        with producer(primary.endpoint, plain, delayed, fifo) as p:
            plain_ids = {p.send(make_message(plain, b"p%d" % i + b"x" * 2000)).message_id for i in range(120)}
            fifo_bodies = [b"f%d-%d" % (g, i) for i in range(10) for g in range(3)]
            for body in fifo_bodies:
                p.send(make_message(fifo, body, group=f"mg-{body[1:2].decode()}"))
            for i in range(16):
                m = make_message(delayed, b"d%d" % i)
                m.delivery_timestamp = due[m.body] = int(sent_at) + (4 if i % 2 else 14)
                assert p.send(m).recall_handle
        with simple_consumer(primary.endpoint, group, plain) as c:  # consumed (and acked) before the failover
            consumed = receive_all(c, 40, timeout_s=20)
            for m in consumed:
                c.ack(m)
        consumed_ids = {m.message_id for m in consumed}
        assert len(consumed_ids) >= 40
        time.sleep(2.5)  # the consume offsets reach offsets.json (checkpoint_interval_ms), then the replica
        end = cluster_status(primary.endpoint).commit_end
        wait_caught_up(replica, end)
        st = cluster_status(primary.endpoint)
        assert [r.endpoint for r in st.replicas] == [replica.endpoint]
        copied = cluster_status(replica.endpoint).commit_end
        assert assert_log_is_prefix(replica.data_dir, primary.data_dir, copied) == copied >= end
        metrics = urllib.request.urlopen(primary.http_url + "metrics", timeout=10).read().decode()
        for family in ("chronoq_replication_lag_bytes", "chronoq_replication_lag_seconds"):
            assert f'{family}{{replica="{replica.endpoint}"}}' in metrics

        kill_9(primary)  # every send above was acknowledged, and the replica had it
        time.sleep(max(0.0, sent_at + 5 - time.time()))  # half the timers fall due during the outage
        promoted = cli("promote", "--endpoint", replica.endpoint)
        assert promoted.returncode == 0, promoted.stderr
        assert "epoch 1" in promoted.stdout and "serving as the primary" in promoted.stdout
        st = cluster_status(replica.endpoint)
        assert (st.role, st.epoch) == ("primary", 1)

        with simple_consumer(replica.endpoint, group, plain) as c:
            got = receive_all(c, len(plain_ids - consumed_ids), timeout_s=20)
            got += receive_all(c, 1, timeout_s=3)  # (nothing more: what was acked is not read again)
            assert sorted(m.message_id for m in got) == sorted(plain_ids - consumed_ids)
        with simple_consumer(replica.endpoint, group, fifo) as c:
            bodies = []
            deadline = time.monotonic() + 20
            while len(bodies) < len(fifo_bodies) and time.monotonic() < deadline:
                for m in c.receive(32, 30):
                    bodies.append(m.body)
                    c.ack(m)
            assert sorted(bodies) == sorted(fifo_bodies)
            for g in range(3):  # each message group in its order
                mine = [b for b in bodies if b.startswith(b"f%d-" % g)]
                assert mine == [b"f%d-%d" % (g, i) for i in range(10)]
        with simple_consumer(replica.endpoint, group, delayed) as c:
            seen = {}
            deadline = time.monotonic() + 30
            while len(seen) < len(due) and time.monotonic() < deadline:
                for m in c.receive(32, 30):
                    seen[m.body] = time.time()
                    c.ack(m)
        assert set(seen) == set(due)
        early = {b: due[b] - t for b, t in seen.items() if t < due[b]}
        assert not early, f"delivered early (s): {early}"
    finally:
        if replica is not None:
            replica.stop()
        primary.stop(check=False)


# ------------------------------------------------------------------------------------ refusals
def _sources(data_dir: str) -> dict[str, bytes]:
    """What a refused replica (or the primary that refused it) must still hold, unchanged."""
    out = {f"commitlog/{n}": b for n, b in log_bytes(data_dir).items() if b}  # (a new log's empty segment)
    pop = os.path.join(data_dir, "pop")
    for name in sorted(os.listdir(pop)) if os.path.isdir(pop) else ():
        with open(os.path.join(pop, name), "rb") as fh:
            out[f"pop/{name}"] = fh.read()
    return out


def _refused(data_dir: str, config: str, target: str, expect: str) -> None:
    before = _sources(data_dir)
    proc = ChronoqProcess(data_dir, config, extra_args=("--replica-of", target))
    try:
        proc.proc.wait(30)
    finally:
        proc.stop(check=False)  # (SIGTERM, then SIGKILL: never left running when the refusal is missing)
    assert proc.proc.returncode == 1, proc.output()
    assert expect in proc.output(), proc.output()
    assert _sources(data_dir) == before


QUIET = CONFIG + "trace_enabled = false\n"  # a primary that writes nothing of its own accord


def test_refusals_change_nothing_on_either_side(tmp_path):
    a = ChronoqProcess(str(tmp_path / "a"), QUIET)
    b = ChronoqProcess(str(tmp_path / "b"), QUIET)
    follower = None
    try:
        for proc, n in ((a, 30), (b, 50)):  # two clusters, with different histories
            with producer(proc.endpoint, "orders") as p:
                for i in range(n):
                    p.send(make_message("orders", f"{proc.endpoint}-{i}".encode()))
        follower = ChronoqProcess(str(tmp_path / "r"), QUIET, extra_args=("--replica-of", a.endpoint))
        wait_caught_up(follower, cluster_status(a.endpoint).commit_end)
        a_before, b_before = _sources(a.data_dir), _sources(b.data_dir)

        # At another replica: refused by it (and it is left as it was).
        _refused(str(tmp_path / "r2"), QUIET, follower.endpoint, "is a replica (of")
        # At a primary whose log this one's does not prefix (b has other bytes where a's end).
        follower.stop()
        follower = None
        _refused(str(tmp_path / "r"), QUIET, b.endpoint, "not a prefix")
        # At itself, by a name the configuration check cannot see through ("localhost").
        me = str(tmp_path / "self")
        port_probe = ChronoqProcess(me, QUIET)  # a data directory with a log, and a known-free port
        port = port_probe.port
        port_probe.stop()
        before = _sources(me)
        proc = subprocess.run([sys.executable, "-m", "chronoq", "serve", "--data-dir", me, "--port", str(port),
                               "--host", "127.0.0.1", "--http-port", "off", "--replica-of", f"localhost:{port}"],
                              cwd=ROOT, capture_output=True, text=True, timeout=60,
                              env=dict(os.environ, PYTHONPATH=ROOT))
        assert proc.returncode == 1, proc.stdout + proc.stderr
        assert "pointed at itself" in proc.stderr, proc.stderr
        assert _sources(me) == before
        # The primaries answered nothing that changed them.
        assert _sources(a.data_dir) == a_before and _sources(b.data_dir) == b_before
        assert cluster_status(a.endpoint).role == "primary" and cluster_status(b.endpoint).role == "primary"
        # A primary is not promoted again; the CLI says so and exits 1.
        refused = cli("promote", "--endpoint", a.endpoint)
        assert refused.returncode == 1 and "already the primary" in refused.stderr, refused.stderr
        shown = json.loads(cli("cluster", "status", "--endpoint", a.endpoint, "--json").stdout)
        assert (shown["role"], shown["epoch"]) == ("primary", 0) and shown["replicas"], shown
    finally:
        if follower is not None:
            follower.stop()
        a.stop()
        b.stop()


def test_the_own_address_is_refused_before_anything_opens(tmp_path):
    proc = cli("serve", "--data-dir", str(tmp_path / "x"), "--port", "18999", "--replica-of", "127.0.0.1:18999")
    assert proc.returncode == 2, proc.stderr
    assert "this broker's own address" in proc.stderr
    assert not os.path.exists(tmp_path / "x")


AUTH = textwrap.dedent("""
    [auth]
    enabled = true
    [[auth.users]]
    access_key = "root"
    secret_key = "root-secret-5d03"
    admin = true
    [[auth.users]]
    access_key = "app"
    secret_key = "app-secret-0b7e"
    publish = ["*"]
""")


ROOT_USER = {"access_key": "root", "secret_key": "root-secret-5d03"}


def _anonymous_refused(endpoint: str) -> None:
    try:
        cluster_status(endpoint)
    except Exception as exc:  # noqa: BLE001 - the refusal expected
        assert "UNAUTHORIZED" in str(exc) or "40100" in str(exc) or "credentials" in str(exc).lower(), exc
    else:
        raise AssertionError(f"{endpoint} answered an anonymous ClusterStatus")


def test_a_replica_without_access_control_passes_route_calls_on_as_their_caller(tmp_path):
    """A replica given the primary's admin credentials but no [auth] of its own passed the route
    calls it forwards on signed with those credentials: anyone reaching it acted as that admin (a
    route lookup by nobody created a topic on the primary). It passes on the caller's own
    signature now, so the primary decides; and it warns at start that it answers anyone."""
    from rocketmq.grpc_protocol import definition_pb2 as pb
    from rocketmq.grpc_protocol import service_pb2 as sv
    from rocketmq.grpc_protocol import service_pb2_grpc

    from chronoq.core import acl

    primary = ChronoqProcess(str(tmp_path / "p"), CONFIG + AUTH)
    replica = None
    try:
        replica = ChronoqProcess(str(tmp_path / "r"), CONFIG + 'replication_access_key = "root"\n'
                                 'replication_secret_key = "root-secret-5d03"\n',
                                 extra_args=("--replica-of", primary.endpoint))
        assert "this node's [auth] is off" in replica.output()
        date = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
        signed = (("x-mq-client-id", "app@1"), ("x-mq-date-time", date),
                  ("authorization", acl.authorization_header("app", "app-secret-0b7e", date)))
        with grpc.insecure_channel(replica.endpoint) as channel:
            stub = service_pb2_grpc.MessagingServiceStub(channel)
            anonymous = stub.QueryRoute(sv.QueryRouteRequest(topic=pb.Resource(name="made-by-nobody")),
                                        metadata=(("x-mq-client-id", "nobody@1"),), timeout=10)
            assert anonymous.status.code == pb.Code.UNAUTHORIZED and not anonymous.message_queues, anonymous.status
            routed = stub.QueryRoute(sv.QueryRouteRequest(topic=pb.Resource(name="orders-via-replica")),
                                     metadata=signed, timeout=10)  # app may publish to orders*
            assert routed.status.code == pb.Code.OK and routed.message_queues
        listed = cli("topic", "list", "--endpoint", primary.endpoint, "--json",
                     env={"CHRONOQ_ACCESS_KEY": "root", "CHRONOQ_SECRET_KEY": ROOT_USER["secret_key"]})
        names = {t["name"] for t in json.loads(listed.stdout)}
        assert "orders-via-replica" in names and "made-by-nobody" not in names, names
    finally:
        if replica is not None:
            replica.stop()
        primary.stop()


def test_pulls_are_authenticated_when_access_control_is_on(tmp_path):
    primary = ChronoqProcess(str(tmp_path / "p"), CONFIG + AUTH)
    replica = None
    try:
        _refused(str(tmp_path / "anon"), CONFIG, primary.endpoint, "UNAUTHORIZED")
        _refused(str(tmp_path / "app"), CONFIG + 'replication_access_key = "app"\n'
                 'replication_secret_key = "app-secret-0b7e"\n' + AUTH, primary.endpoint, "FORBIDDEN")
        replica = ChronoqProcess(str(tmp_path / "r"), CONFIG + 'replication_access_key = "root"\n'
                                 'replication_secret_key = "root-secret-5d03"\n' + AUTH,
                                 extra_args=("--replica-of", primary.endpoint))
        root = {"access_key": "root", "secret_key": "root-secret-5d03"}
        sent = cli("send", "--endpoint", primary.endpoint, "orders", "signed",
                   env={"CHRONOQ_ACCESS_KEY": "app", "CHRONOQ_SECRET_KEY": "app-secret-0b7e"})
        assert sent.returncode == 0, sent.stderr
        end = cluster_status(primary.endpoint, **root).commit_end
        assert end > 0
        wait_until(lambda: (lambda st: st.state == "caught up" and st.commit_end >= end)(
            cluster_status(replica.endpoint, **root)), 20, what="the replica to follow")
        # The replica has the primary's [auth] (a node holding replication credentials must):
        # an anonymous caller reaches nothing there either.
        _anonymous_refused(replica.endpoint)
    finally:
        if replica is not None:
            replica.stop()
        primary.stop()


# ------------------------------------------------------------------------------------ sync acks
def test_sync_replication_acknowledges_only_what_a_replica_holds(tmp_path):
    config = CONFIG + 'replication = "sync"\nreplication_sync_timeout_ms = 3000\n'
    primary = ChronoqProcess(str(tmp_path / "p"), config)
    replica = None
    topic, group = unique("sync"), unique("g")
    try:
        with producer(primary.endpoint, topic) as p:
            with pytest.raises(Exception) as info:  # no replica: refused at once, and clearly
                p.send(make_message(topic, b"alone"))
            assert "no replica is in sync" in str(info.value), info.value
            replica = ChronoqProcess(str(tmp_path / "r"), config, extra_args=("--replica-of", primary.endpoint))
            wait_until(lambda: cluster_status(primary.endpoint).replicas, 20, what="the replica's first pull")
            acked = {p.send(make_message(topic, b"s%d" % i)).message_id for i in range(20)}
            os.kill(replica.proc.pid, signal.SIGSTOP)  # a replica that holds nothing more
            try:
                with pytest.raises(Exception) as info:
                    p.send(make_message(topic, b"unreplicated"))
                assert "SLAVE_PERSISTENCE_TIMEOUT" in str(info.value) or "in sync" in str(info.value), info.value
                wait_until(lambda: not cluster_status(primary.endpoint).replicas[0].in_sync, 20,
                           what="the stopped replica shown out of sync")
            finally:
                os.kill(replica.proc.pid, signal.SIGCONT)
            wait_in_sync(primary, since_ms=time.time() * 1000)  # (resumed: pulled again, caught up)
            acked |= {p.send(make_message(topic, b"t%d" % i)).message_id for i in range(20)}
        kill_9(primary)  # at once: under sync every acknowledged send is on the replica already
        promoted = cli("promote", "--endpoint", replica.endpoint)
        assert promoted.returncode == 0, promoted.stderr
        with simple_consumer(replica.endpoint, group, topic) as c:
            got = {m.message_id for m in receive_all(c, len(acked) + 2, timeout_s=10)}  # (+ "alone", "unreplicated": stored here)
        assert acked <= got, len(acked - got)
    finally:
        if replica is not None:
            replica.stop()
        primary.stop(check=False)


def _metric(proc: ChronoqProcess, name: str) -> float:
    with urllib.request.urlopen(proc.http_url + "metrics", timeout=5) as reply:
        for line in reply.read().decode().splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
    raise AssertionError(f"no {name} in /metrics")


def test_sync_fallback_async_answers_without_a_replica_and_says_so(tmp_path):
    """``replication_sync_fallback = "async"``: with no replica in sync a send is acknowledged (the
    default refuses it: the test above), counted, and the state shown; once a replica reports
    again, sends wait for it as before."""
    config = (QUIET + 'replication = "sync"\nreplication_sync_timeout_ms = 1000\n'
              'replication_sync_fallback = "async"\n')  # (QUIET: the primary writes only the sends)
    primary = ChronoqProcess(str(tmp_path / "p"), config)
    replica = None
    topic = unique("fallback")
    try:
        with producer(primary.endpoint, topic) as p:
            alone = [p.send(make_message(topic, b"alone%d" % i)).message_id for i in range(3)]
            assert len(set(alone)) == 3
            assert _metric(primary, "chronoq_replication_sync_fallbacks_total") == 3
            assert _metric(primary, "chronoq_replication_sync_degraded") == 1
            replica = ChronoqProcess(str(tmp_path / "r"), config, extra_args=("--replica-of", primary.endpoint))
            wait_in_sync(primary)
            end = 0
            for i in range(5):
                p.send(make_message(topic, b"held%d" % i))
                end = cluster_status(primary.endpoint).commit_end
                # acknowledged under sync again: the replica had it before the answer came
                assert cluster_status(replica.endpoint).commit_end >= end
            assert _metric(primary, "chronoq_replication_sync_fallbacks_total") == 3
            assert _metric(primary, "chronoq_replication_sync_degraded") == 0
        assert any("falls back to async" in line for line in open(primary.stderr_path, errors="replace"))
    finally:
        if replica is not None:
            replica.stop()
        primary.stop()


def test_sync_replication_answers_a_recall_only_once_a_replica_holds_it(tmp_path):
    """A recall (like a send) is answered OK under ``sync`` only once a replica has its record: one
    answered by the primary alone is lost with it, and the promoted replica delivers the message
    its producer was told was cancelled."""
    config = CONFIG + 'replication = "sync"\nreplication_sync_timeout_ms = 2000\n'
    primary = ChronoqProcess(str(tmp_path / "p"), config)
    replica = None
    topic, group = unique("recall-sync"), unique("g")
    try:
        replica = ChronoqProcess(str(tmp_path / "r"), config, extra_args=("--replica-of", primary.endpoint))
        wait_in_sync(primary)
        due = int(time.time()) + 6
        with producer(primary.endpoint, topic) as p:
            receipts = []
            for body in (b"kept", b"recalled"):
                m = make_message(topic, body)
                m.delivery_timestamp = due
                receipts.append(p.send(m))
            os.kill(replica.proc.pid, signal.SIGSTOP)  # the replica copies nothing more
            try:
                with pytest.raises(Exception) as info:
                    p.recall_message(topic, receipts[1].recall_handle)
                assert "replication = sync" in str(info.value), info.value  # (SLAVE_PERSISTENCE_TIMEOUT)
            finally:
                os.kill(replica.proc.pid, signal.SIGCONT)
            wait_in_sync(primary, since_ms=time.time() * 1000)  # (resumed: pulled again, caught up)
            # Recalled again: the record is stored already, the answer waited for the replica.
            assert p.recall_message(topic, receipts[1].recall_handle) == receipts[1].message_id
        kill_9(primary)
        promoted = cli("promote", "--endpoint", replica.endpoint)
        assert promoted.returncode == 0, promoted.stderr
        with simple_consumer(replica.endpoint, group, topic) as c:
            got = receive_all(c, 2, timeout_s=max(0.0, due - time.time()) + 8)
        assert [m.body for m in got] == [b"kept"]
    finally:
        if replica is not None:
            replica.stop()
        primary.stop(check=False)


# ------------------------------------------------------------------------------------ TLS
def test_a_replica_follows_a_tls_primary_with_replication_tls_ca_file(tmp_path):
    """Pulls signed and over TLS (the credentials never cross the wire in the clear); a replica
    that speaks plaintext to the TLS port follows nothing and says it cannot reach the primary."""
    from .test_security import _make_certificates

    ca, cert, key = _make_certificates(tmp_path)
    tls = f'tls_cert_file = "{cert}"\ntls_key_file = "{key}"\n'
    signed = 'replication_access_key = "root"\nreplication_secret_key = "root-secret-5d03"\n'
    primary = ChronoqProcess(str(tmp_path / "p"), CONFIG + tls + AUTH)  # (top-level keys before [auth])
    replica = plain = None
    try:
        replica = ChronoqProcess(str(tmp_path / "r"), CONFIG + signed + f'replication_tls_ca_file = "{ca}"\n' + AUTH,
                                 extra_args=("--replica-of", primary.endpoint))
        plain = ChronoqProcess(str(tmp_path / "plain"), CONFIG + signed + AUTH,
                               extra_args=("--replica-of", primary.endpoint))
        sent = cli("send", "--endpoint", primary.endpoint, "--tls-ca-file", ca, "orders", "over tls",
                   env={"CHRONOQ_ACCESS_KEY": "app", "CHRONOQ_SECRET_KEY": "app-secret-0b7e"})
        assert sent.returncode == 0, sent.stderr
        end = cluster_status(primary.endpoint, access_key="root", secret_key="root-secret-5d03", tls_ca_file=ca).commit_end
        wait_until(lambda: (lambda st: st.state == "caught up" and st.commit_end >= end)(
            cluster_status(replica.endpoint, **ROOT_USER)), 20, what="the TLS replica to follow")
        assert_log_is_prefix(str(tmp_path / "r"), str(tmp_path / "p"), cluster_status(replica.endpoint, **ROOT_USER).commit_end)
        wait_until(lambda: cluster_status(plain.endpoint, **ROOT_USER).state.startswith("unreachable"), 20,
                   what="the plaintext replica to say it cannot reach the primary")
        assert cluster_status(plain.endpoint, **ROOT_USER).commit_end == 0
    finally:
        for proc in (plain, replica):
            if proc is not None:
                proc.stop()
        primary.stop()
