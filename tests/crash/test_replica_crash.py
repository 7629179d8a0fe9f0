"""kill -9 of a replica in the middle of an append: it restarts from its durable position, no
torn record survives, and it ends as a byte-for-byte prefix of its primary (docs/replication.md).

The primary is a real ``chronoq serve`` with a backlog of several segments. The replica under
test is this module run as a child (``_child``): the follower of ``chronoq serve --replica-of``
(``chronoq.replication.follower.Follower`` on a ``Store``) with ``writer.tear_next_log_write``'s
fault hook, so a seeded ``which``-th commit-log ``pwrite`` writes a seeded prefix of its bytes and
the process SIGKILLs itself (an external kill almost never lands inside the system call). Then
the real ``chronoq serve --replica-of`` is started on that directory: its recovery must cut the
torn tail, and it must follow on from there to the primary's end. Seed: ``CHRONOQ_CRASH_SEED``.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

SEED = int(os.environ.get("CHRONOQ_CRASH_SEED", "20261126"))
RUNS = 3
CONFIG = "segment_bytes = 1048576\n"


def _child(data_dir: str, primary: str, seed: int, which: int) -> None:
    from chronoq.core.clock import SYSTEM_CLOCK
    from chronoq.replication.client import ReplicationClient
    from chronoq.replication.follower import Follower
    from chronoq.replication.position import new_node_id
    from chronoq.store.store import Store, StoreOptions
    from writer import tear_next_log_write

    store = Store(data_dir, StoreOptions(segment_bytes=1 << 20))
    tear_next_log_write(type("B", (), {"store": store})(), random.Random(seed), which)

    async def follow():
        client = ReplicationClient(primary)
        await Follower(store, data_dir, client, new_node_id(), "", SYSTEM_CLOCK).run()

    asyncio.run(follow())


def test_replica_killed_mid_append_resumes_without_a_torn_record(tmp_path):
    from tests.integration.conftest import ChronoqProcess, wait_until
    from tests.integration.test_replication import assert_log_is_prefix, cluster_status

    from chronoq.client.client import Client, OutgoingMessage, run

    rng = random.Random(SEED)
    primary = ChronoqProcess(str(tmp_path / "p"), CONFIG)
    try:
        async def fill(batches: int):  # appends of 40 records of ~1 KiB: several in each pull
            async with Client(primary.endpoint) as client:
                for b in range(batches):
                    await client.send_batch([OutgoingMessage("bulk", bytes([b % 251]) * 1000 + b"%d" % i)
                                             for i in range(40)])
        replica_dir = str(tmp_path / "r")
        for attempt in range(RUNS):
            # A backlog of several segments (1 MiB each: a pull never spans two) for this run to tear
            # into, whatever the last run's replica copied before it stopped.
            run(fill(150))
            end = cluster_status(primary.endpoint).commit_end
            seed, which = rng.randrange(1 << 30), rng.randint(1, 3)
            child = subprocess.run([sys.executable, os.path.abspath(__file__), replica_dir, primary.endpoint,
                                    str(seed), str(which)], cwd=os.path.dirname(os.path.abspath(__file__)),
                                   capture_output=True, text=True, timeout=120,
                                   env=dict(os.environ, PYTHONPATH=ROOT))
            assert child.returncode == -signal.SIGKILL, child.stdout + child.stderr
            replica = ChronoqProcess(replica_dir, CONFIG, extra_args=("--replica-of", primary.endpoint))
            try:
                recovery = next(line for line in replica.lines if line.startswith("recovery:"))
                assert "truncated" in recovery, recovery  # the torn tail was found and cut
                if attempt < RUNS - 1:
                    continue  # killed again, from wherever it got to
                wait_until(lambda: cluster_status(replica.endpoint).commit_end >= end, 60, interval_s=0.1,
                           what="the replica to catch up")
            finally:
                replica.stop()
        assert assert_log_is_prefix(replica_dir, primary.data_dir) >= end
    finally:
        primary.stop()


if __name__ == "__main__":
    _child(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
