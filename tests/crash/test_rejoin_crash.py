"""kill -9 of a node in the middle of its rejoin truncation (docs/replication.md, "Rejoining
after a failover"): restarted, it finishes the cut (or makes it afresh), follows its new primary
and ends as that primary's log byte for byte, its consume queues what a rebuild gives.

The cluster is real: a primary A (async) acknowledges sends its SIGSTOPped replica B never
copies, A is killed, B promoted and written to. A's data directory is then copied once per kill
point; each copy is rejoined by this module run as a child (``_child``: the follower of
``chronoq serve --replica-of``, with ``chronoq.store.truncate.fault`` set to SIGKILL the process
after a named step: the marker written, the cut bytes kept aside, one derived path removed
(seeded), all removed, the log cut). Then the real ``chronoq serve --replica-of B`` opens the
copy. Seed: ``CHRONOQ_CRASH_SEED``.
"""

from __future__ import annotations

import asyncio
import os
import random
import shutil
import signal
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

SEED = int(os.environ.get("CHRONOQ_CRASH_SEED", "20261126"))
CONFIG = "segment_bytes = 262144\ntrace_enabled = false\n"
STEPS = ("marker", "aside", "remove <seeded>", "remove", "cut")


def _child(data_dir: str, primary: str, step: str) -> None:
    from chronoq.core.clock import SYSTEM_CLOCK
    from chronoq.replication.client import ReplicationClient
    from chronoq.replication.follower import Follower
    from chronoq.replication.position import new_node_id
    from chronoq.store import truncate
    from chronoq.store.store import Store, StoreOptions

    def kill(name: str) -> None:
        if name == step:
            os.kill(os.getpid(), signal.SIGKILL)
    truncate.fault = kill

    def open_store():
        return Store(data_dir, StoreOptions(segment_bytes=262144))

    async def follow():
        client = ReplicationClient(primary)
        await Follower(open_store(), data_dir, client, new_node_id(), "", SYSTEM_CLOCK, reopen=open_store).run()

    asyncio.run(follow())


def test_a_rejoin_killed_mid_truncation_finishes_and_follows(tmp_path):
    import time

    from tests.integration.conftest import ChronoqProcess, wait_until
    from tests.integration.test_official_python_client import make_message, producer, unique
    from tests.integration.test_rejoin import _caught_up, _digest_and_rebuilt, _send
    from tests.integration.test_replication import assert_log_is_prefix, cli, cluster_status, kill_9, wait_caught_up

    from chronoq.replication.follower import rejoin_paths

    rng = random.Random(SEED)
    a = ChronoqProcess(str(tmp_path / "a"), CONFIG)
    b = None
    try:
        b = ChronoqProcess(str(tmp_path / "b"), CONFIG, extra_args=("--replica-of", a.endpoint))
        topic = unique("t")
        _send(a.endpoint, topic, [b"c%d" % i + b"x" * 900 for i in range(200)])
        with_timer = unique("later")  # the old primary's timer state (derived) must go with the cut
        with producer(a.endpoint, with_timer) as p:
            for i in range(10):
                m = make_message(with_timer, b"d%d" % i)
                m.delivery_timestamp = int(time.time()) + 3600
                p.send(m)
        wait_caught_up(b, cluster_status(a.endpoint).commit_end)
        b.proc.send_signal(signal.SIGSTOP)
        try:
            _send(a.endpoint, topic, [b"a%d" % i + b"y" * 900 for i in range(300)])  # past a segment
            kill_9(a)
        finally:
            b.proc.send_signal(signal.SIGCONT)
        assert cli("promote", "--endpoint", b.endpoint).returncode == 0
        _send(b.endpoint, topic, [b"b%d" % i + b"z" * 900 for i in range(400)])
        b_end = cluster_status(b.endpoint).commit_end
        paths = rejoin_paths(a.data_dir)
        assert {"timer/checkpoint.json", "consumequeue", "pop"} <= set(paths), paths
        for n, step in enumerate(STEPS):
            if step == "remove <seeded>":
                present = [p for p in paths if os.path.exists(os.path.join(a.data_dir, p))]
                step = f"remove {rng.choice(present)}"
            copy = str(tmp_path / f"a{n}")
            shutil.copytree(a.data_dir, copy, ignore=shutil.ignore_patterns("LOCK"))
            child = subprocess.run([sys.executable, os.path.abspath(__file__), copy, b.endpoint, step],
                                   cwd=os.path.dirname(os.path.abspath(__file__)), capture_output=True, text=True,
                                   timeout=120, env=dict(os.environ, PYTHONPATH=ROOT))
            assert child.returncode == -signal.SIGKILL, (step, child.stdout + child.stderr)
            assert os.path.exists(os.path.join(copy, "truncate.json")), step
            node = ChronoqProcess(copy, CONFIG, extra_args=("--replica-of", b.endpoint))
            try:
                recovery = next(line for line in node.lines if line.startswith("recovery:"))
                assert "finished an interrupted truncation" in recovery, (step, recovery)
                wait_until(lambda: _caught_up(node, b_end), 60, interval_s=0.1, what=f"{step}: following B")
            finally:
                node.stop()
            assert not os.path.exists(os.path.join(copy, "truncate.json")), step
            assert assert_log_is_prefix(copy, b.data_dir) == b_end, step
            live, rebuilt = _digest_and_rebuilt(copy, str(tmp_path / f"scratch{n}"))
            assert live == rebuilt, step
            # The timer's files were cut with the log; the replica's timer was rebuilt from what
            # remained and follows on (its checkpoint is that timer's, compared above).
            assert os.path.exists(os.path.join(copy, "timer", "checkpoint.json")), step
    finally:
        if b is not None:
            b.stop()
        a.stop(check=False)


if __name__ == "__main__":
    _child(sys.argv[1], sys.argv[2], sys.argv[3])
