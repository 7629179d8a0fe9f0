"""kill -9 of a replica while its timer absorbs the shipped log, then a promotion: the timer state
equals a from-scratch rebuild from the log (docs/replication.md, "Derived state").

A real primary holds a backlog of timer messages (due hours ahead, so nothing fires), delay-level
messages and recalls of both; a real replica (``chronoq serve --replica-of``, its timer
checkpointing every 50 ms) is started on it and SIGKILLed a seeded moment after it is ready, while
it copies and absorbs; more backlog, again, ``RUNS`` times. After each kill the replica's directory
is opened as a broker (what a promotion does: the timer's recovery from the replica's checkpoint,
journal roll-back, replay after the cursor) and compared with the same directory rebuilt without
its derived files (``tests/integration/test_rebuild_from_log.py``'s comparison). Last, the killed
replica is started again, promoted, stopped, and compared the same way. Seed: ``CHRONOQ_CRASH_SEED``.
"""

from __future__ import annotations

import os
import random
import shutil
import sys
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

SEED = int(os.environ.get("CHRONOQ_CRASH_SEED", "20261126"))
RUNS = 3
BATCHES = 120  # a round's backlog: batches of 250 timer messages, a few level messages and recalls
CONFIG = "segment_bytes = 1048576\n"
REPLICA_CONFIG = CONFIG + "timer_checkpoint_interval_ms = 50\n"
LEVEL = 18  # 2 h in the default table: nothing fires during the test


def _fill(endpoint: str, topic: str, rng: random.Random) -> None:
    from chronoq.client.client import Client, OutgoingMessage, run

    async def go():
        due = int(time.time() * 1000) + 3 * 3600 * 1000
        async with Client(endpoint, request_timeout_s=60) as client:
            for b in range(BATCHES):
                batch = [OutgoingMessage(topic, b"t%d-%d" % (b, i), deliver_at_ms=due + rng.randrange(600_000))
                         for i in range(250)]
                batch += [OutgoingMessage(topic, b"l%d-%d" % (b, i), delay_level=LEVEL) for i in range(2)]
                receipts = await client.send_batch(batch)
                for r in rng.sample(receipts, 3):  # recalls of both kinds, shipped among the sends
                    await client.recall(topic, r.recall_handle)

    run(go())


def _compare(tmp_path, data_dir: str, name: str) -> tuple[dict, dict]:
    from tests.integration.test_rebuild_from_log import _assert_same, _recovered_and_rebuilt

    scratch = tmp_path / name
    scratch.mkdir()
    copy = str(scratch / "data")
    # (role.json, a promoted node's role, is neither a source nor derived from one)
    shutil.copytree(data_dir, copy, ignore=shutil.ignore_patterns("LOCK", "role.json"))
    recovered, rebuilt = _recovered_and_rebuilt(scratch, copy, int(time.time() * 1000))
    _assert_same(recovered, rebuilt, ("recovered", "rebuilt"))
    return recovered, rebuilt


def test_replica_killed_mid_absorb_then_promoted_equals_a_rebuild(tmp_path):
    from chronoq.core import fsutil
    from tests.integration.conftest import HTTP_ANNOUNCED, ChronoqProcess, wait_until
    from tests.integration.test_replication import cli, cluster_status, kill_9, wait_caught_up

    rng = random.Random(SEED)
    primary = ChronoqProcess(str(tmp_path / "p"), CONFIG)
    replica_dir = str(tmp_path / "r")
    topic = "crash-timers"
    checkpointed = 0
    try:
        for attempt in range(RUNS):
            _fill(primary.endpoint, topic, rng)
            replica = ChronoqProcess(replica_dir, REPLICA_CONFIG, extra_args=("--replica-of", primary.endpoint))
            time.sleep(rng.uniform(0.05, 1.5))  # copying and absorbing the round's backlog
            kill_9(replica)
            doc = fsutil.read_json(os.path.join(replica_dir, "timer", "checkpoint.json"))
            checkpointed += doc is not None and doc["cursor"] > 0
            recovered, _ = _compare(tmp_path, replica_dir, f"kill{attempt}")
            assert recovered["timers"], "no pending timer at the kill: the comparison proves little"
        assert checkpointed, "no kill found a timer checkpoint on the replica: nothing of its own was recovered"

        end = cluster_status(primary.endpoint).commit_end
        replica = ChronoqProcess(replica_dir, REPLICA_CONFIG, extra_args=("--replica-of", primary.endpoint))
        try:
            wait_caught_up(replica, end, timeout_s=60)
            wait_until(lambda: (fsutil.read_json(os.path.join(replica_dir, "timer", "checkpoint.json")) or {})
                       .get("cursor", 0) >= end, 30, what="the replica's timer checkpoint")
            kill_9(primary)
            assert cli("promote", "--endpoint", replica.endpoint).returncode == 0
            url = wait_until(lambda: next((m.group(1) for m in map(HTTP_ANNOUNCED.search, replica.lines) if m), None),
                             60, what="the promoted node's HTTP listener")
            text = urllib.request.urlopen(url + "metrics", timeout=10).read().decode()
            replayed = float(next(line.split()[-1] for line in text.splitlines()
                                  if line.startswith("chronoq_recovery_timer_records_replayed ")))
            assert replayed <= 10, replayed  # the promotion started from the replica's own timer checkpoint
        finally:
            replica.stop()
        promoted, _ = _compare(tmp_path, replica_dir, "promoted")
        assert len(promoted["timers"]) >= RUNS * BATCHES * 200
    finally:
        primary.stop(check=False)
