"""A replica keeps its timer state current (docs/replication.md, "Derived state"): it absorbs the
shipped delayed records, recalls included, into its own schedule log and checkpoints its timer,
firing nothing; so a promotion starts the timer from that checkpoint instead of replaying the log,
and then fires every pending timer once, never early, the recalled ones never.

Real processes on loopback: a primary and a replica (``chronoq serve --replica-of``), sends and
recalls through ``chronoq.client.client``, ``kill -9`` of the primary, ``chronoq promote``; the
promoted node's replay length is read from its ``/metrics``
(``chronoq_recovery_timer_records_replayed``), not timed."""

from __future__ import annotations

import os
import time
import urllib.request

from chronoq.client.client import Client, OutgoingMessage, run
from chronoq.core import fsutil

from .conftest import HTTP_ANNOUNCED, ChronoqProcess, wait_until
from .test_replication import cli, cluster_status, kill_9, wait_caught_up

CONFIG = "segment_bytes = 1048576\ntimer_checkpoint_interval_ms = 200\n"
TIMERS = 3000  # timer messages (deliver_at_ms), in batches
LEVELS = 20  # delay-level messages
RECALLED = 40
DUE_AFTER_S = 12  # after the sends: past the kill and the promotion


def timer_cursor(data_dir: str) -> int:
    try:
        doc = fsutil.read_json(os.path.join(data_dir, "timer", "checkpoint.json"))
    except ValueError:  # (being replaced: atomically, so not torn; read again)
        return -1
    return -1 if doc is None else doc["cursor"]


def metric(url: str, name: str) -> float:
    text = urllib.request.urlopen(url + "metrics", timeout=10).read().decode()
    return float(next(line.split()[-1] for line in text.splitlines() if line.startswith(name + " ")))


def test_promotion_starts_the_timer_from_the_replicas_checkpoint_and_fires_each_timer_once(tmp_path):
    primary = ChronoqProcess(str(tmp_path / "p"), CONFIG)
    replica = None
    try:
        replica = ChronoqProcess(str(tmp_path / "r"), CONFIG, extra_args=("--replica-of", primary.endpoint))
        topic = f"rt-{os.getpid()}-{time.monotonic_ns()}"
        sent_at = time.time()
        due_ms = int((sent_at + DUE_AFTER_S) * 1000)
        due: dict[bytes, float] = {}  # body -> due time (s)

        async def send() -> list[str]:
            handles = []
            async with Client(primary.endpoint) as client:
                for b in range(0, TIMERS, 250):
                    batch = [OutgoingMessage(topic, b"t%d" % i, deliver_at_ms=due_ms + i)
                             for i in range(b, min(TIMERS, b + 250))]
                    receipts = await client.send_batch(batch)
                    handles += [r.recall_handle for r in receipts]
                    due.update({m.body: m.deliver_at_ms / 1000 for m in batch})
                for i in range(LEVELS):  # level 3: 10 s (the default table)
                    await client.send(topic, b"l%d" % i, delay_level=3)
                    due[b"l%d" % i] = sent_at + 10
                for i in range(RECALLED):  # recalled before the failover: never delivered
                    await client.recall(topic, handles[i * 7])
            return [b"t%d" % (i * 7) for i in range(RECALLED)]

        recalled = set(run(send()))
        end = cluster_status(primary.endpoint).commit_end
        wait_caught_up(replica, end)
        # The replica's timer absorbed all of it and checkpointed (every 200 ms): its cursor covers the log.
        wait_until(lambda: timer_cursor(replica.data_dir) >= end, 30, what="the replica's timer checkpoint")

        kill_9(primary)
        promoted = cli("promote", "--endpoint", replica.endpoint)
        assert promoted.returncode == 0, promoted.stderr
        assert cluster_status(replica.endpoint).role == "primary"
        # The promoted node announces its HTTP listener (a replica has none) once the broker is open.
        url = wait_until(lambda: next((m.group(1) for m in map(HTTP_ANNOUNCED.search, replica.lines) if m), None),
                         60, what="the promoted node's HTTP listener")
        # Without the replica's timer the whole log was replayed at promotion (TIMERS + LEVELS + RECALLED).
        replayed = metric(url, "chronoq_recovery_timer_records_replayed")
        assert replayed <= 10, replayed

        seen: dict[bytes, list[float]] = {}

        async def receive() -> None:
            async with Client(replica.endpoint) as client:
                deadline = time.monotonic() + DUE_AFTER_S + 60
                quiet_until = None
                while time.monotonic() < deadline:
                    got = await client.receive("rt-g", topic, max_messages=32, wait_s=1)
                    now = time.time()
                    for m in got:
                        seen.setdefault(m.body, []).append(now)
                    if got:
                        await client.ack("rt-g", topic, got)
                    if len(seen) >= len(due) - len(recalled):
                        quiet_until = quiet_until or time.monotonic() + 3  # then nothing more (no duplicate)
                    if quiet_until is not None and time.monotonic() >= quiet_until:
                        return

        run(receive())
        assert set(seen) == set(due) - recalled, (len(seen), sorted(set(due) - recalled - set(seen))[:5])
        twice = {b: len(t) for b, t in seen.items() if len(t) > 1}
        assert not twice, f"delivered more than once: {list(twice.items())[:5]}"
        early = {b: due[b] - t[0] for b, t in seen.items() if t[0] < due[b]}
        assert not early, f"delivered early (s): {list(early.items())[:5]}"
    finally:
        if replica is not None:
            replica.stop(check=False)
        primary.stop(check=False)
