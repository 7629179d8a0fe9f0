"""kill -9 while send batches create many topics, their queues' first files made off the loop
(``chronoq.store.newqueues``).

A real ``chronoq serve`` takes, from two lanes at once, batches that each create ``NEW_PER_BATCH``
topics (a message each, auto-created: the batch waits for their consume queues' first files
before it is written) plus a few messages to one existing topic, and from a third lane single
sends to that existing topic (written while the other batches wait, and dispatched behind them).
The broker is SIGKILLed at seeded moments (``KILL_GAP_S`` after each start), among the topic
table's saves, the files' makes, the commit log's fsyncs and the dispatches; the last kill is not
followed by a restart: the data directory is opened by the embedded broker, whose recovery runs
on what the kill left. Checked:

- nothing lost: every acknowledged message is in its topic's consume queues, and its topic exists;
- once: no acknowledged message is in its topic twice.

SIGKILL ends the process, not the machine (page cache survives). Seed:
``CHRONOQ_NEW_QUEUES_CRASH_SEED``; kills: ``CHRONOQ_NEW_QUEUES_CRASH_KILLS``.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal

import pytest

from chronoq.broker.broker import Broker
from chronoq.client.admin import AdminClient
from chronoq.client.client import Client, OutgoingMessage
from chronoq.core.config import load_config
from tests.integration.conftest import ChronoqProcess
from tests.integration.test_committer_crash import State, _lane, kill_9_and_restart

SEED = int(os.environ.get("CHRONOQ_NEW_QUEUES_CRASH_SEED", "20261128"))
KILLS = int(os.environ.get("CHRONOQ_NEW_QUEUES_CRASH_KILLS", "4"))
KILL_GAP_S = (0.3, 1.5)
NEW_PER_BATCH = 40
OLD_PER_BATCH = 4
OLD = "nq-old"
CONFIG = """
checkpoint_interval_ms = 300
default_queues = 2
max_topics = 100000
"""


def _batches(state: State, lane: int, seq):
    async def step(client: Client) -> None:
        n = next(seq)
        batch = [OutgoingMessage(f"nq-{lane}-{n}-{i}", f"n{lane}-{n}-{i}".encode()) for i in range(NEW_PER_BATCH)]
        batch += [OutgoingMessage(OLD, f"o{lane}-{n}-{i}".encode()) for i in range(OLD_PER_BATCH)]
        state.rng.shuffle(batch)
        for m, r in zip(batch, await client.send_batch(batch)):
            state.acked[r.message_id] = (m.topic, 0)
        await asyncio.sleep(0.02)
    return step


def _singles(state: State, seq):
    async def step(client: Client) -> None:
        r = await client.send(OLD, f"s{next(seq)}".encode())
        state.acked[r.message_id] = (OLD, 0)
        await asyncio.sleep(0.005)
    return step


async def _run(state: State) -> int:
    async with AdminClient(state.endpoint) as admin:
        await admin.create_topic(OLD)
    seq = iter(range(10**8))
    lanes = [asyncio.create_task(_lane(state, _batches(state, lane, seq))) for lane in range(2)]
    lanes.append(asyncio.create_task(_lane(state, _singles(state, seq))))
    made = 0
    try:
        for k in range(KILLS):
            await asyncio.sleep(state.rng.uniform(*KILL_GAP_S))
            if k < KILLS - 1:
                await kill_9_and_restart(state, CONFIG)
            else:  # the last: no restart, the audit's open recovers what it left
                state.proc.proc.send_signal(signal.SIGKILL)
                await asyncio.to_thread(state.proc.proc.wait, 10)
                assert state.proc.proc.returncode == -signal.SIGKILL, state.proc.output()
            made += 1
    finally:
        state.sending = False
        await asyncio.gather(*lanes, return_exceptions=True)
    return made


def _audit(data_dir: str, config_path: str, topics: set[str]) -> tuple[dict[str, int], set[str]]:
    """(message id -> its copies in its topic's queues, the topics missing) after recovery."""
    cfg = load_config(config_path, env={}, overrides={"data_dir": data_dir})
    broker = Broker(cfg)
    try:
        copies: dict[str, int] = {}
        missing = {t for t in topics if t not in broker.topics}
        for topic in sorted(topics - missing):
            for qid in range(broker.topics[topic].queues):
                offset = 0
                for _ in range(100_000):
                    got = broker.read(topic, qid, offset, 1000)
                    for m in got.messages:
                        copies[m.message_id] = copies.get(m.message_id, 0) + 1
                    if not got.messages or got.next_offset >= got.max_offset:
                        break
                    offset = got.next_offset
    finally:
        broker.close()
    return copies, missing


@pytest.mark.timeout(240)  # ~20 s on a quiet machine
def test_kill_9_while_batches_create_topics_keeps_every_acknowledged_message_once(tmp_path):
    print(f"\nnew queues crash test seed {SEED} (CHRONOQ_NEW_QUEUES_CRASH_SEED), {KILLS} kills")
    data_dir = str(tmp_path / "data")
    state = State(ChronoqProcess(data_dir, CONFIG), random.Random(SEED))
    try:
        kills = asyncio.run(_run(state))
    finally:
        state.proc.stop(check=False)
    ctx = f"seed {SEED}"
    assert kills == KILLS and state.acked, ctx
    assert not state.refused, f"{ctx}: valid requests refused: {state.refused[:3]}"
    new_acked = sum(1 for topic, _ in state.acked.values() if topic != OLD)
    assert new_acked, f"{ctx}: no batch creating topics was acknowledged"
    copies, missing = _audit(data_dir, str(tmp_path / "data.toml"), {t for t, _ in state.acked.values()})
    assert not missing, f"{ctx}: {len(missing)} topics of acknowledged sends do not exist, e.g. {sorted(missing)[:5]}"
    absent = [m for m in state.acked if m not in copies]
    assert not absent, f"{ctx}: {len(absent)} acknowledged messages are in no queue, e.g. " \
                       f"{[(m, state.acked[m]) for m in absent[:5]]}"
    twice = {m: n for m, n in copies.items() if m in state.acked and n != 1}
    assert not twice, f"{ctx}: {len(twice)} acknowledged messages are in their topic more than once: " \
                      f"{list(twice.items())[:5]}"
    print(f"{ctx}: {len(state.acked)} acknowledged ({new_acked} to new topics), {state.errors} calls lost to kills, "
          f"{kills} kills")
