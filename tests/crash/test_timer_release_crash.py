"""kill -9 around timer due times, with receives running: nothing delivered early, nothing lost.

A real ``chronoq serve`` (timer copies written ahead by ``timer_prewrite_ms`` and held until due)
takes delayed sends due 0.3-4 s ahead while consumers long-poll and ack. Each kill is aimed at
an acknowledged send's due time, up to 0.9 s before it or 30 ms after it (seeded, ``AIM_MS``), so
it lands while copies are written ahead (``timer_prewrite_ms`` = 1 s) and held, being released,
or just released, and a restart finds held copies not yet due. After the last restart every
due time passes and the consumers drain. Checked:

- nothing early: a delivered copy's stored time and the consumer's clock when its receive returned
  are at or after its due time (a held copy must stay hidden across the restart too; the timer's
  tick, not a receive, makes it visible);
- nothing lost: every acknowledged send is received.

SIGKILL ends the process, not the machine (page cache survives): this checks ordering and
bookkeeping across restarts, not the fsync itself. Seed: ``CHRONOQ_TIMER_RELEASE_CRASH_SEED``;
kills: ``CHRONOQ_TIMER_RELEASE_CRASH_KILLS``.
"""

from __future__ import annotations

import asyncio
import os
import random
import time

import pytest

from chronoq.client.admin import AdminClient
from chronoq.client.client import Client, ClientError, OutgoingMessage
from tests.integration.conftest import ChronoqProcess
from tests.integration.test_committer_crash import State, _lane, kill_9_repeatedly, tally  # (lanes reconnect)

SEED = int(os.environ.get("CHRONOQ_TIMER_RELEASE_CRASH_SEED", "20261126"))
KILLS = int(os.environ.get("CHRONOQ_TIMER_RELEASE_CRASH_KILLS", "3"))
DELAY_S = (0.3, 4.0)       # sends fall due this far ahead
AIM_MS = (-900, 30)        # a kill lands this long (seeded) after an acknowledged due time
BATCH = 8                  # delayed messages per send, each its own due time
REQUEST_TIMEOUT_S = 5.0
TOPIC, GROUP = "trc-delay", "trc-g"
CONFIG = """
checkpoint_interval_ms = 500
timer_bucket_ms = 1000
timer_preload_ms = 2000
timer_prewrite_ms = 1000
default_queues = 2
"""


def _send(state: State, seq):
    async def step(client: Client) -> None:
        now_ms = time.time() * 1000
        batch = [OutgoingMessage(TOPIC, f"d{next(seq)}".encode(),
                                 deliver_at_ms=int(now_ms + state.rng.uniform(*DELAY_S) * 1000))
                 for _ in range(BATCH)]
        for m, r in zip(batch, await client.send_batch(batch)):
            state.acked[r.message_id] = (TOPIC, m.deliver_at_ms)
        await asyncio.sleep(0.02)
    return step


def _consume(state: State):
    async def step(client: Client) -> None:
        got = await client.receive(GROUP, TOPIC, max_messages=32, invisible_s=5, wait_s=0.5)
        tally(state, got, int(time.time() * 1000))
        if got:
            try:
                await client.ack(GROUP, TOPIC, got)
            except ClientError:  # handles from the broker before a kill are stale
                pass
    return step


async def _aim(state: State) -> None:
    """Sleep until (about) the due time of an acknowledged send still ahead."""
    for _ in range(200):
        now_ms = time.time() * 1000
        ahead = sorted(due for _, due in state.acked.values() if due > now_ms + 1200)
        if ahead:
            target = state.rng.choice(ahead[:50]) + state.rng.uniform(*AIM_MS)
            await asyncio.sleep(max(0.0, (target - time.time() * 1000) / 1000))
            return
        await asyncio.sleep(0.05)
    raise AssertionError("no acknowledged delayed send to aim a kill at")


async def _run(state: State) -> int:
    async with AdminClient(state.endpoint) as admin:
        await admin.create_topic(TOPIC)
    seq = iter(range(10**8))
    senders = [asyncio.create_task(_lane(state, _send(state, seq))) for _ in range(2)]
    consumers = [asyncio.create_task(_lane(state, _consume(state), lambda state: state.consuming)) for _ in range(2)]
    return await kill_9_repeatedly(state, CONFIG, KILLS, lambda: _aim(state), senders, consumers)


@pytest.mark.timeout(180)  # ~20 s on a quiet machine
def test_kill_9_around_due_times_delivers_nothing_early_and_loses_nothing(tmp_path):
    print(f"\ntimer release crash test seed {SEED} (CHRONOQ_TIMER_RELEASE_CRASH_SEED), {KILLS} kills")
    state = State(ChronoqProcess(str(tmp_path / "data"), CONFIG), random.Random(SEED))
    try:
        kills = asyncio.run(_run(state))
        ctx = f"seed {SEED}"
        assert kills == KILLS and state.acked, ctx
        assert not state.refused, f"{ctx}: valid requests refused: {state.refused[:3]}"
        assert not state.early, f"{ctx}: {len(state.early)} delivered early: {state.early[:5]}"
        missing = set(state.acked) - set(state.received)
        assert not missing, f"{ctx}: {len(missing)} acknowledged sends never received, e.g. " \
                            f"{[(m, state.acked[m]) for m in sorted(missing)[:5]]}"
        print(f"{ctx}: {len(state.acked)} delayed sends, {sum(state.received.values())} receives, {kills} kills")
    finally:
        state.proc.stop(check=False)
