"""kill -9 crash test for SendMessage's batches (``Broker.write_batch``/``Store.write_columns``).

Each round, on one data directory that every round continues: a real ``chronoq serve`` gets
batches of plain messages from several ``chronoq.client.client`` lanes (one topic, tags,
client ids) and is SIGKILLed at a seeded moment while batches are in flight; then it restarts on
the same directory and everything is received with a fresh group. Checked:

- every batch acknowledged before the kill is there, each message once, with its body and tag;
- a message whose batch was in flight is there whole or not at all (never torn, never twice);
- in every queue the offsets run without a gap or a repeat;
- after the restart, sends go on  and are received.

SIGKILL ends the process, not the machine (the fsync side is the unit tests' job). Seed:
``CHRONOQ_SEND_CRASH_SEED`` (printed); rounds: ``CHRONOQ_SEND_CRASH_KILLS``.
"""

from __future__ import annotations

import asyncio
import os
import random
import time

from chronoq.client.client import Client, OutgoingMessage
from tests.integration.conftest import ChronoqProcess

SEED = int(os.environ.get("CHRONOQ_SEND_CRASH_SEED", "20261122"))
KILLS = int(os.environ.get("CHRONOQ_SEND_CRASH_KILLS", "3"))
TOPIC = "sendcrash"
LANES = 4
BATCH = 50
SEND_BOUND_S = 6.0         # a lane stops sending after this long, kill or not
BATCHES_MAX = 400          # and after this many batches
RECEIVE_BOUND_S = 60.0


def body_for(rnd: int, lane: int, seq: int) -> bytes:
    return f"r{rnd} l{lane} s{seq} ".encode() * (1 + seq % 20)


def tag_for(seq: int) -> str:
    return ("", "red", "blue")[seq % 3]


async def produce(endpoint: str, rnd: int, proc: ChronoqProcess, kill_after_s: float) -> tuple[dict, dict]:
    """Send until the kill; returns (acknowledged, in flight or failed): message id -> (body, tag)."""
    acked: dict[str, tuple[bytes, str]] = {}
    unsure: dict[str, tuple[bytes, str]] = {}
    loop = asyncio.get_running_loop()
    loop.call_later(kill_after_s, proc.proc.kill)
    stop_at = time.monotonic() + SEND_BOUND_S
    async with Client(endpoint, request_timeout_s=5.0) as c:
        async def lane(index: int) -> None:
            for b in range(BATCHES_MAX):
                if time.monotonic() > stop_at:
                    return
                seqs = range(b * BATCH, (b + 1) * BATCH)
                batch = [OutgoingMessage(TOPIC, body_for(rnd, index, s), tag=tag_for(s),
                                         message_id=f"R{rnd}L{index}S{s:06d}") for s in seqs]
                try:
                    receipts = await c.send_batch(batch)
                except Exception:  # noqa: BLE001 - the kill: this batch's outcome is unknown
                    unsure.update((m.message_id, (m.body, m.tag)) for m in batch)
                    return
                assert [r.message_id for r in receipts] == [m.message_id for m in batch]
                acked.update((m.message_id, (m.body, m.tag)) for m in batch)
        await asyncio.gather(*(lane(i) for i in range(LANES)))
    return acked, unsure


async def receive_all(endpoint: str, group: str) -> list:
    got = []
    deadline = time.monotonic() + RECEIVE_BOUND_S
    empty = 0
    async with Client(endpoint, request_timeout_s=5.0) as c:
        while empty < 2 and time.monotonic() < deadline:
            batch = await c.receive(group, TOPIC, max_messages=32, invisible_s=120, wait_s=1)
            empty = 0 if batch else empty + 1
            got += batch
            await c.ack(group, TOPIC, batch)
    return got


async def send_more(endpoint: str, rnd: int) -> dict:
    sent = {}
    async with Client(endpoint, request_timeout_s=5.0) as c:
        for b in range(2):  # the first batch after a restart validates the topic; the second is bulk
            batch = [OutgoingMessage(TOPIC, body_for(rnd, 99, s), tag=tag_for(s), message_id=f"R{rnd}M{b}S{s}")
                     for s in range(BATCH)]
            await c.send_batch(batch)
            sent.update((m.message_id, (m.body, m.tag)) for m in batch)
    return sent


def test_kill_9_while_batches_are_sent_keeps_every_acknowledged_batch_whole(tmp_path):
    print(f"\nsend crash test seed {SEED} (set CHRONOQ_SEND_CRASH_SEED to replay), {KILLS} kills")
    rng = random.Random(SEED)
    data_dir = str(tmp_path / "data")
    proc = ChronoqProcess(data_dir)
    expected: dict[str, tuple[bytes, str]] = {}  # acknowledged, every round so far
    maybe: dict[str, tuple[bytes, str]] = {}
    try:
        for rnd in range(KILLS):
            kill_after = rng.uniform(0.5, 2.5)
            acked, unsure = asyncio.run(asyncio.wait_for(produce(proc.endpoint, rnd, proc, kill_after), 60))
            if proc.proc.poll() is None:  # (the lanes ended first: kill now)
                proc.proc.kill()
            proc.proc.wait(10)
            assert acked, f"seed {SEED} round {rnd}: nothing was acknowledged in {kill_after:.2f} s"
            expected.update(acked)
            maybe.update(unsure)
            proc = ChronoqProcess(data_dir)
            expected.update(asyncio.run(asyncio.wait_for(send_more(proc.endpoint, rnd), 60)))
            got = asyncio.run(receive_all(proc.endpoint, f"g{rnd}"))
            ctx = f"seed {SEED} round {rnd} (kill after {kill_after:.2f} s)"
            ids = [m.message_id for m in got]
            assert len(ids) == len(set(ids)), f"{ctx}: a message was stored twice"
            for m in got:
                want = expected.get(m.message_id) or maybe.get(m.message_id)
                assert want is not None, f"{ctx}: {m.message_id} was never sent"
                assert (m.body, m.tag) == want, f"{ctx}: {m.message_id} came back changed"
            missing = set(expected) - set(ids)
            assert not missing, f"{ctx}: {len(missing)} acknowledged messages lost, e.g. {sorted(missing)[:3]}"
            by_queue: dict[int, list[int]] = {}
            for m in got:
                by_queue.setdefault(m.queue_id, []).append(m.queue_offset)
            for qid, offsets in by_queue.items():
                offsets.sort()
                assert offsets == list(range(offsets[0], offsets[0] + len(offsets))), f"{ctx}: queue {qid} has gaps"
                assert offsets[0] == 0, f"{ctx}: queue {qid} starts at {offsets[0]}"
            print(f"round {rnd}: {len(acked)} acknowledged, {len(unsure)} in flight at the kill, "
                  f"{len(set(ids) & set(unsure))} of those stored")
        proc.stop()  # and it stops cleanly
    finally:
        if proc.proc.poll() is None:
            proc.stop(check=False)
