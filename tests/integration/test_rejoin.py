"""Rejoining after a failover, with real processes (docs/replication.md, "Rejoining after a
failover"): a primary A that acknowledged sends (async) its stopped replica B never copied is
killed; B is promoted and written to; A restarted with ``--replica-of B`` truncates at the epoch
boundary, keeps the cut bytes aside, and then holds exactly B's log, with consume queues equal to
a rebuild. Then the refusals that change nothing (a foreign cluster's log, a newer epoch pointed
at an older primary) and the stored role (a promoted directory restarted with its old
``--replica-of`` serves as the primary). Sends through the official RocketMQ 5 Python client."""

from __future__ import annotations

import os
import shutil
import signal

from chronoq.store.digest import queue_digest
from chronoq.store.store import Store, StoreOptions

from .conftest import ChronoqProcess, wait_until
from .test_official_python_client import make_message, producer, unique
from .test_replication import (_refused, _sources, assert_log_is_prefix, cli, cluster_status, kill_9, log_bytes,
                               wait_caught_up)

CONFIG = "segment_bytes = 262144\ntrace_enabled = false\n"  # small segments; nothing written of its own accord


def _send(endpoint: str, topic: str, bodies: list[bytes]) -> None:
    with producer(endpoint, topic) as p:
        for body in bodies:
            p.send(make_message(topic, body))


def _caught_up(replica: ChronoqProcess, end: int) -> bool:
    st = cluster_status(replica.endpoint)
    return st.state == "caught up" and st.commit_end == st.primary_synced == end


def _digest_and_rebuilt(data_dir: str, scratch: str) -> tuple[dict, dict]:
    """The consume queues of ``data_dir`` as its own recovery opens them, and as a rebuild from
    a copy of its commit log alone gives them."""
    options = StoreOptions(segment_bytes=262144)
    store = Store(data_dir, options)
    try:
        live = queue_digest(store)
    finally:
        store.close()
    os.makedirs(scratch)
    shutil.copytree(os.path.join(data_dir, "commitlog"), os.path.join(scratch, "commitlog"))
    rebuilt = Store(scratch, options)
    try:
        return live, queue_digest(rebuilt)
    finally:
        rebuilt.close()


def test_a_killed_primary_rejoins_truncated_at_the_epoch_boundary_and_follows(tmp_path):
    a = ChronoqProcess(str(tmp_path / "a"), CONFIG)
    b = rejoined = w = None
    topic = unique("orders")
    try:
        b = ChronoqProcess(str(tmp_path / "b"), CONFIG, extra_args=("--replica-of", a.endpoint))
        copied = [b"copied-%d-" % i + b"x" * 900 for i in range(60)]
        _send(a.endpoint, topic, copied)
        wait_caught_up(b, cluster_status(a.endpoint).commit_end)
        b.proc.send_signal(signal.SIGSTOP)  # B stops copying; A acknowledges on (async)
        try:
            lost = [b"only-on-a-%d-" % i + b"y" * 900 for i in range(40)]
            _send(a.endpoint, topic, lost)
            kill_9(a)
        finally:
            b.proc.send_signal(signal.SIGCONT)
        promoted = cli("promote", "--endpoint", b.endpoint)
        assert promoted.returncode == 0, promoted.stderr
        st = cluster_status(b.endpoint)
        assert (st.role, st.epoch) == ("primary", 1)
        after = [b"on-b-%d-" % i + b"z" * 900 for i in range(80)]  # B ends past where A did
        _send(b.endpoint, topic, after)
        b_end = cluster_status(b.endpoint).commit_end

        # A comes back as B's replica: cut at the boundary, then a copy of B.
        rejoined = ChronoqProcess(a.data_dir, CONFIG, extra_args=("--replica-of", b.endpoint))
        wait_until(lambda: _caught_up(rejoined, b_end), 60, interval_s=0.1, what="the rejoined node to copy B")
        said = rejoined.output()
        assert said.count("rejoining") == 1 and "its epoch 1 began" in said, said
        rejoined.stop()
        rejoined = None
        assert assert_log_is_prefix(a.data_dir, b.data_dir) == b_end  # exactly B's log, byte for byte
        aside_dir = os.path.join(a.data_dir, "truncated")
        (aside,) = os.listdir(aside_dir)
        with open(os.path.join(aside_dir, aside), "rb") as fh:
            kept = fh.read()
        b_log = b"".join(log_bytes(b.data_dir).values())
        assert not any(body in kept for body in copied + after)
        cut = [body for body in lost if body in kept]
        assert len(cut) >= 20 and all(body in b_log for body in lost if body not in kept)  # (B copied a few)
        assert f"{len(cut)} records ({topic} {len(cut)})" in said, said
        assert not os.path.exists(os.path.join(a.data_dir, "truncate.json"))
        live, rebuilt = _digest_and_rebuilt(a.data_dir, str(tmp_path / "scratch"))
        assert live == rebuilt and any(name.startswith(topic + "/") for name in live)

        # A foreign cluster's node (its own log, past B's boundary) pointed at B: refused, both unchanged.
        w = ChronoqProcess(str(tmp_path / "w"), CONFIG)
        _send(w.endpoint, unique("other"), [b"w-%d-" % i + b"w" * 900 for i in range(200)])
        w.stop()
        b_before = _sources(b.data_dir)
        _refused(w.data_dir, CONFIG, b.endpoint, "differ from the primary's")
        assert _sources(b.data_dir) == b_before
        # B (epoch 1) told to follow W (epoch 0): refused by W, nothing changed.
        w = ChronoqProcess(w.data_dir, CONFIG)
        b.stop()
        _refused(b.data_dir, CONFIG + "rejoin = true\n", w.endpoint, "newer than this primary's 0")
        # B restarted with its old --replica-of (the stale configuration): it stays the primary.
        b = ChronoqProcess(b.data_dir, CONFIG, extra_args=("--replica-of", w.endpoint))
        assert "was promoted to primary (epoch 1" in b.output(), b.output()
        st = cluster_status(b.endpoint)
        assert (st.role, st.epoch, st.commit_end >= b_end) == ("primary", 1, True)
    finally:
        for proc in (rejoined, b, w, a):
            if proc is not None:
                proc.stop(check=False)
