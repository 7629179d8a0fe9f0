"""kill -9 while new schedule bucket files are being made ahead (``chronoq.timer.newfiles``).

A real ``chronoq serve`` with 20 ms schedule buckets takes delayed sends due 2-10 s ahead, each
message of a batch in a bucket of its own, so hundreds of buckets with no file yet come in every
second: their files are made on the maker's thread while the buffers wait, and the kills
(seeded, ``KILL_GAP_S`` after each start) land among the makes, the journal fsyncs and the
buffer writes that follow them. Consumers long-poll and ack all along. After the last restart
every due time passes, the consumers drain, the broker stops cleanly, and the data directory is
audited with the embedded broker. Checked:

- nothing lost: every acknowledged send is received, and its copy is in the topic;
- once: every acknowledged send has exactly one delivered copy in the topic (the timer's
  dispatch-once; a consumer's extra receives after a kill are POP redeliveries, not counted);
- nothing early: every copy's stored time and the consumer's clock when its receive returned
  are at or after the due time it was sent with;
- no temporary file of the maker is left in the schedule directory.

SIGKILL ends the process, not the machine (page cache survives). Seed:
``CHRONOQ_TIMER_NEWFILES_CRASH_SEED``; kills: ``CHRONOQ_TIMER_NEWFILES_CRASH_KILLS``.
"""

from __future__ import annotations

import asyncio
import os
import random
import time

import pytest

from chronoq.broker.broker import Broker
from chronoq.client.admin import AdminClient
from chronoq.client.client import Client, OutgoingMessage
from chronoq.core.config import load_config
from chronoq.timer import newfiles
from tests.integration.conftest import ChronoqProcess
from tests.integration.test_committer_crash import State, _consume, _lane, kill_9_repeatedly, timer_pending

SEED = int(os.environ.get("CHRONOQ_TIMER_NEWFILES_CRASH_SEED", "20261127"))
KILLS = int(os.environ.get("CHRONOQ_TIMER_NEWFILES_CRASH_KILLS", "4"))
BUCKET_MS = 20
DELAY_MS = (2_000, 10_000)  # 400 buckets ahead; ~50 new ones a second as time moves
KILL_GAP_S = (0.4, 2.0)
BATCH = 64
TOPIC, GROUP = "tnf-delay", "tnf-g"
CONFIG = f"""
checkpoint_interval_ms = 300
timer_bucket_ms = {BUCKET_MS}
timer_preload_ms = 500
default_queues = 2
"""


def _send(state: State, seq):
    async def step(client: Client) -> None:
        now_ms = int(time.time() * 1000)
        # Spread over the whole window in bucket-sized strides: most land in buckets with no file.
        base = now_ms + DELAY_MS[0]
        span = (DELAY_MS[1] - DELAY_MS[0]) // BUCKET_MS
        batch = [OutgoingMessage(TOPIC, f"n{next(seq)}".encode(),
                                 deliver_at_ms=base + state.rng.randrange(span) * BUCKET_MS + state.rng.randrange(BUCKET_MS))
                 for _ in range(BATCH)]
        for m, r in zip(batch, await client.send_batch(batch)):
            state.acked[r.message_id] = (TOPIC, m.deliver_at_ms)
        await asyncio.sleep(0.01)
    return step


async def _run(state: State) -> int:
    async with AdminClient(state.endpoint) as admin:
        await admin.create_topic(TOPIC)
    seq = iter(range(10**8))
    senders = [asyncio.create_task(_lane(state, _send(state, seq))) for _ in range(2)]
    consumers = [asyncio.create_task(_lane(state, _consume(state, GROUP, TOPIC), lambda state: state.consuming)) for _ in range(2)]
    return await kill_9_repeatedly(state, CONFIG, KILLS, lambda: asyncio.sleep(state.rng.uniform(*KILL_GAP_S)),
                                   senders, consumers)


def _audit(data_dir: str, config_path: str) -> dict[str, list[int]]:
    """message id -> the stored times of its copies in the topic."""
    cfg = load_config(config_path, env={}, overrides={"data_dir": data_dir})
    broker = Broker(cfg)
    try:
        copies: dict[str, list[int]] = {}
        for qid in range(broker.topics[TOPIC].queues):
            offset = 0
            for _ in range(100_000):
                got = broker.read(TOPIC, qid, offset, 1000)
                for m in got.messages:
                    copies.setdefault(m.message_id, []).append(m.stored_ms)
                if not got.messages or got.next_offset >= got.max_offset:
                    break
                offset = got.next_offset
    finally:
        broker.close()
    return copies


@pytest.mark.timeout(240)  # ~30 s on a quiet machine
def test_kill_9_while_new_bucket_files_are_made_delivers_every_acknowledged_send_once_never_early(tmp_path):
    print(f"\ntimer new-files crash test seed {SEED} (CHRONOQ_TIMER_NEWFILES_CRASH_SEED), {KILLS} kills")
    data_dir = str(tmp_path / "data")
    state = State(ChronoqProcess(data_dir, CONFIG), random.Random(SEED))
    pending = None  # delayed messages the broker had not delivered when the drain ended
    try:
        kills = asyncio.run(_run(state))
        pending = timer_pending(state.proc)
    finally:
        state.proc.stop(check=False)
    ctx = f"seed {SEED}"
    assert kills == KILLS and state.acked, ctx
    assert not state.refused, f"{ctx}: valid requests refused: {state.refused[:3]}"
    assert not state.early, f"{ctx}: {len(state.early)} received early: {state.early[:5]}"
    sched = os.path.join(data_dir, "timer", "schedule")
    leftovers = [n for n in os.listdir(sched) if n.endswith(newfiles.MAKING_SUFFIX)] if os.path.isdir(sched) else []
    assert not leftovers, f"{ctx}: temporary files left: {leftovers[:5]}"
    copies = _audit(data_dir, str(tmp_path / "data.toml"))
    missing = set(state.acked) - set(state.received)
    # (what tells a late delivery on a loaded machine from a lost one. Seed 20261127 on a loaded
    # machine failed here one run in three, 2 to 1,642 lost: a bucket file the roll-back cut to 0
    # bytes was taken for empty by its loader while its buffer was flushed to it; fixed in
    # chronoq/timer/bucketreader.py, 15 runs under two CPU burners passed after)
    assert not missing, f"{ctx}: {len(missing)} acknowledged sends never received, e.g. " \
                        f"{[(m, state.acked[m]) for m in sorted(missing)[:5]]}; {len(missing & set(copies))} of " \
                        f"them have a copy in the topic; the broker had {pending} delayed messages pending at the end"
    twice = {m: c for m, c in copies.items() if m in state.acked and len(c) != 1}
    assert not twice, f"{ctx}: {len(twice)} acknowledged sends delivered more than once, e.g. {list(twice.items())[:5]}"
    absent = set(state.acked) - set(copies)
    assert not absent, f"{ctx}: {len(absent)} acknowledged sends have no copy in the topic"
    early = [(m, c[0], state.acked[m][1]) for m, c in copies.items() if m in state.acked and c[0] < state.acked[m][1]]
    assert not early, f"{ctx}: {len(early)} copies stored before their due time: {early[:5]}"
    print(f"{ctx}: {len(state.acked)} delayed sends, {sum(state.received.values())} receives, {kills} kills")
