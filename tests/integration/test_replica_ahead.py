"""A replica copies what its primary has *written*, before the primary's fsync of it (so the two
fsyncs of a ``sync`` acknowledgement overlap: chronoq.replication.shipper), and what follows
from that: a replica may hold bytes its primary loses when the primary's machine stops. Real
processes on loopback, sends through the official RocketMQ 5 Python client.

The machine crash is simulated: the primary is killed (-9) and its commit log cut back to an
earlier end, as a machine that stopped before those bytes' fsync leaves it (recovery then finds
its checkpoint past the log's end: R10, queues rebuilt)."""

from __future__ import annotations

import os

from .conftest import ChronoqProcess, wait_until
from .test_official_python_client import make_message, producer, unique
from .test_rejoin import _caught_up, _digest_and_rebuilt
from .test_replication import _sources, cli, cluster_status, kill_9, log_bytes, wait_caught_up

QUIET = "trace_enabled = false\n"  # (one segment: the cut below is within it)


def _send(endpoint: str, topic: str, tag: str, n: int) -> None:
    with producer(endpoint, topic) as p:
        for i in range(n):
            p.send(make_message(topic, b"%s-%d-" % (tag.encode(), i) + b"x" * 700))


def _cut_log(data_dir: str, end: int) -> None:
    """What a machine that stopped before ``end``'s later bytes reached the disk leaves."""
    (name,) = log_bytes(data_dir)
    assert int(name[:-4]) == 0, name
    os.truncate(os.path.join(data_dir, "commitlog", name), end)


def test_a_replica_holds_what_the_primary_wrote_before_the_primary_fsyncs_it(tmp_path):
    # flush_policy = async with a long interval: the primary acknowledges without an fsync for a
    # minute; the replica has the bytes (and has fsynced them) long before.
    primary = ChronoqProcess(str(tmp_path / "p"), QUIET + "flush_policy = \"async\"\nflush_interval_ms = 60000\n")
    replica = None
    try:
        replica = ChronoqProcess(str(tmp_path / "r"), QUIET, extra_args=("--replica-of", primary.endpoint))
        wait_until(lambda: cluster_status(primary.endpoint).replicas, 30, what="the replica's first pull")
        synced = cluster_status(primary.endpoint).commit_end
        _send(primary.endpoint, unique("t"), "w", 30)
        wait_until(lambda: cluster_status(replica.endpoint).commit_end > synced + 30 * 700, 30,
                   interval_s=0.1, what="the replica to copy the unsynced sends")
        assert cluster_status(primary.endpoint).commit_end == synced  # (still not fsynced there)
    finally:
        if replica is not None:
            replica.stop()
        primary.stop()


def _ahead(tmp_path, policy: str) -> tuple[ChronoqProcess, str, int, int, str]:
    """A primary (``flush_policy``) and its replica both at B's end; the replica stopped, the
    primary killed and cut back to A's end, then restarted. Returns the restarted primary, the
    replica's directory, A's end, B's end, the topic."""
    config = QUIET + f"flush_policy = \"{policy}\"\n"
    primary = ChronoqProcess(str(tmp_path / "p"), config)
    topic = unique("orders")
    replica = None
    try:
        replica = ChronoqProcess(str(tmp_path / "r"), QUIET, extra_args=("--replica-of", primary.endpoint))
        _send(primary.endpoint, topic, "a", 40)
        wait_until(lambda: cluster_status(primary.endpoint).commit_end >= cluster_status(replica.endpoint).commit_end
                   > 0, 30, interval_s=0.1, what="A durable on the primary")  # (async: its periodic fsync)
        a_end = cluster_status(primary.endpoint).commit_end
        _send(primary.endpoint, topic, "b", 40)
        wait_until(lambda: cluster_status(primary.endpoint).commit_end > a_end, 30, interval_s=0.1, what="B durable")
        b_end = cluster_status(primary.endpoint).commit_end
        wait_caught_up(replica, b_end)
    finally:
        if replica is not None:
            replica.stop()
    kill_9(primary)
    _cut_log(primary.data_dir, a_end)
    return ChronoqProcess(primary.data_dir, config), replica.data_dir, a_end, b_end, topic


def test_a_primary_back_without_its_unsynced_tail_cuts_the_replica_back_to_it(tmp_path):
    primary, replica_dir, a_end, b_end, topic = _ahead(tmp_path, "sync")
    replica = None
    try:
        assert cluster_status(primary.endpoint).commit_end == a_end < b_end
        _send(primary.endpoint, topic, "c", 10)  # (the primary writes on over what it lost)
        replica = ChronoqProcess(replica_dir, QUIET, extra_args=("--replica-of", primary.endpoint))
        end = cluster_status(primary.endpoint).commit_end
        wait_until(lambda: _caught_up(replica, end), 30, interval_s=0.1, what="the replica cut back and caught up")
        said = replica.output()
        assert f"its log restarted at {a_end} without bytes it had shipped here before their fsync" in said, said
        assert f"cutting {b_end - a_end} bytes, 40 records" in said, said
        replica.stop()
        replica = None
        assert log_bytes(replica_dir) == {n: b[:end] for n, b in log_bytes(primary.data_dir).items()}
        live, rebuilt = _digest_and_rebuilt(replica_dir, str(tmp_path / "scratch"))
        assert live == rebuilt
    finally:
        if replica is not None:
            replica.stop()
        primary.stop()


def test_under_async_flush_a_replica_ahead_is_refused_and_nothing_is_cut(tmp_path):
    primary, replica_dir, a_end, b_end, _topic = _ahead(tmp_path, "async")
    try:
        before = _sources(replica_dir)
        replica = ChronoqProcess(replica_dir, QUIET, extra_args=("--replica-of", primary.endpoint))
        try:
            replica.proc.wait(30)
        finally:
            replica.stop(check=False)
        assert replica.proc.returncode == 1, replica.output()
        assert "under flush_policy = async they may have been acknowledged" in replica.output(), replica.output()
        assert _sources(replica_dir) == before
        promoted = cli("promote", "--endpoint", primary.endpoint)  # (the primary is unharmed, still primary)
        assert "already the primary" in promoted.stderr, promoted.stderr
    finally:
        primary.stop()
