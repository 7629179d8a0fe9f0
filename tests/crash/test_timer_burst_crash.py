"""kill -9 in the middle of a crowd's prewrite: a real ``chronoq serve`` writing ahead, seconds
before their due time, the held copies of 200,000 timers due at one instant (the burst lead grows
with the crowd: 200,000 / 40,000 copies/s + 0.25 s = 5.25 s, ``chronoq.timer.burstlead``).

1. Send ``CROWD`` timer messages due at one instant ``DUE_IN_S`` after sending starts (every send
   answered before anything is killed). Two consumer lanes long-poll and ack all along.
2. Watch the topic's consume-queue files (read-only: entries written so far, each one a copy
   written ahead and held) and SIGKILL the broker once a seeded share of the crowd is written:
   mid-prewrite, seconds before the due time. Restart it on the same directory (it restores the
   holds from the queues' tails and reloads the rest of the crowd), and kill it again once it has
   written more, if the due time is still ``KILL_BEFORE_DUE_MS`` away.
3. After the due time, drain; stop cleanly and audit the data directory with the embedded broker.

Checked:

- the kills landed mid-prewrite: some copies written, not all, before the due time;
- none early: no receive returned a message before its due time (consumer's clock, the broker's
  machine), and every copy's store time is its due time or later (held copies are stamped with it);
- none lost: every acknowledged send has a copy in the topic, and was received;
- none duplicated: each message has exactly one copy (docs/timers.md: a held copy is an ordinary
  durable record, so a restart replays it into its queue and holds it again; a copy not yet
  fsynced at a crash is written again only when its DISPATCHED entry did not exist, and the
  replay finds the copies after the cursor by their ``__TIMER_REF``: a restart never delivers a
  message twice). POP redeliveries to the consumers (acks lost in a kill) are counted apart.

SIGKILL ends the process, not the machine (page cache survives), as in the other crash tests.
Seed: ``CHRONOQ_TIMER_BURST_CRASH_SEED`` (printed); crowd size ``CHRONOQ_TIMER_BURST_CRASH_CROWD``.
"""

from __future__ import annotations

import asyncio
import glob
import os
import random
import signal
import time
from dataclasses import dataclass, field

import pytest

from chronoq.broker.broker import Broker
from chronoq.client.client import Client, ClientError, OutgoingMessage
from chronoq.core.config import load_config
from chronoq.store.consumequeue import ENTRY
from tests.integration.conftest import ChronoqProcess
from tests.integration.test_committer_crash import tally

SEED = int(os.environ.get("CHRONOQ_TIMER_BURST_CRASH_SEED", "20261128"))
CROWD = int(os.environ.get("CHRONOQ_TIMER_BURST_CRASH_CROWD", "200000"))
DUE_IN_S = 25.0               # the crowd falls due this long after sending starts
SHARES = ((0.1, 0.35), (0.15, 0.3))  # kill k once this share (seeded, uniform) more of the crowd is written
KILL_BEFORE_DUE_MS = 300      # ... and only while the due time is at least this far
WATCH_S = 0.05                # how often the queue files are looked at
SEND_BATCH, SEND_LANES = 1000, 4
RECEIVE_BATCH, INVISIBLE_S = 32, 10
DRAIN_TIMEOUT_S = 60.0
TOPIC, GROUP = "burst-crash", "burst-crash-g"
CONFIG = f"""
checkpoint_interval_ms = 1000
timer_checkpoint_interval_ms = 1000
segment_bytes = {64 << 20}
default_queues = 4
"""


@dataclass
class State:
    proc: ChronoqProcess
    stopping: bool = False
    received: dict[str, int] = field(default_factory=dict)
    early: list[tuple[str, int, int, int]] = field(default_factory=list)
    errors: int = 0


def written(data_dir: str) -> int:
    """Copies the broker has put into the topic's consume queues so far (their files, read-only;
    an all-zero entry is space not written yet)."""
    n = 0
    for path in glob.glob(os.path.join(data_dir, "consumequeue", TOPIC, "*", "*.cq")):
        with open(path, "rb") as fh:
            data = fh.read()
        n += sum(1 for _phys, size, _tag, _time in ENTRY.iter_unpack(data[:len(data) - len(data) % ENTRY.size])
                 if size)
    return n


async def send_crowd(endpoint: str, due_ms: int) -> dict[str, int]:
    plan = [OutgoingMessage(TOPIC, f"c{i}".encode(), deliver_at_ms=due_ms) for i in range(CROWD)]
    batches = [plan[i:i + SEND_BATCH] for i in range(0, CROWD, SEND_BATCH)]
    sent: dict[str, int] = {}
    async with Client(endpoint, request_timeout_s=30) as c:
        async def lane(todo):
            for batch in todo:
                for m, r in zip(batch, await c.send_batch(batch)):
                    sent[r.message_id] = m.deliver_at_ms
        await asyncio.gather(*(lane(batches[k::SEND_LANES]) for k in range(SEND_LANES)))
    assert len(sent) == CROWD
    return sent


async def consume(state: State) -> None:
    """Receive and ack until told to stop; reconnect to each new server process."""
    client = None
    while not state.stopping:
        if client is None:
            client = Client(state.proc.endpoint, request_timeout_s=5)
        try:
            got = await client.receive(GROUP, TOPIC, max_messages=RECEIVE_BATCH, invisible_s=INVISIBLE_S, wait_s=1)
            tally(state, got, int(time.time() * 1000))
            if got:
                await client.ack(GROUP, TOPIC, got)
        except ClientError:  # refused (a handle from before a kill): go on
            state.errors += 1
            await asyncio.sleep(0.05)
        except Exception:  # noqa: BLE001 - the server was killed: reconnect to the new one
            state.errors += 1
            await client.close()
            client = None
            await asyncio.sleep(0.05)
    if client is not None:
        await client.close()


async def kill_during_prewrite(state: State, rng: random.Random, due_ms: int) -> list[tuple[int, int]]:
    """Kill once a seeded share more of the crowd is written, for each of SHARES, while the due
    time is KILL_BEFORE_DUE_MS away; restart each time. Returns (copies written, ms before the
    due time) at each kill."""
    kills = []
    data_dir = state.proc.data_dir
    for low, high in SHARES:
        target = written(data_dir) + int(rng.uniform(low, high) * CROWD)
        while written(data_dir) < target and time.time() * 1000 < due_ms - KILL_BEFORE_DUE_MS:
            await asyncio.sleep(WATCH_S)
        left_ms = due_ms - int(time.time() * 1000)
        if left_ms < KILL_BEFORE_DUE_MS:
            break
        state.proc.proc.send_signal(signal.SIGKILL)
        await asyncio.to_thread(state.proc.proc.wait, 10)
        state.proc.stop(check=False)
        assert state.proc.proc.returncode == -signal.SIGKILL, state.proc.output()
        kills.append((written(data_dir), left_ms))
        state.proc = await asyncio.to_thread(ChronoqProcess, data_dir, CONFIG)
    return kills


async def run(state: State, rng: random.Random) -> tuple[dict[str, int], list[tuple[int, int]]]:
    due_ms = int(time.time() * 1000 + DUE_IN_S * 1000)
    sent = await send_crowd(state.proc.endpoint, due_ms)
    assert time.time() * 1000 < due_ms - 10_000, "sending took too long for a prewrite to kill"
    assert written(state.proc.data_dir) == 0  # nothing written ahead yet: the lead is 5.25 s
    consumers = [asyncio.create_task(consume(state)) for _ in range(2)]
    try:
        kills = await kill_during_prewrite(state, rng, due_ms)
        deadline = time.monotonic() + (due_ms / 1000 - time.time()) + DRAIN_TIMEOUT_S
        while len(state.received) < CROWD and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
    finally:
        state.stopping = True
        await asyncio.gather(*consumers, return_exceptions=True)
    return sent, kills


def audit(data_dir: str, config_path: str) -> dict[str, list]:
    """Every copy in the topic: message id -> [Message], read with the embedded broker."""
    broker = Broker(load_config(config_path, env={}, overrides={"data_dir": data_dir}))
    try:
        found: dict[str, list] = {}
        for qid in range(broker.topics[TOPIC].queues):
            offset = 0
            for _ in range(100_000):
                got = broker.read(TOPIC, qid, offset, 1000)
                for m in got.messages:
                    found.setdefault(m.message_id, []).append(m)
                if not got.messages or got.next_offset >= got.max_offset:
                    break
                offset = got.next_offset
    finally:
        broker.close()
    return found


@pytest.mark.slow
@pytest.mark.timeout(300)  # ~60 s on a quiet machine
def test_kill_9_during_a_long_lead_prewrite_delivers_every_copy_once_and_none_early(tmp_path):
    print(f"\ntimer burst crash test seed {SEED} (CHRONOQ_TIMER_BURST_CRASH_SEED), crowd {CROWD:,}")
    rng = random.Random(SEED)
    data_dir = str(tmp_path / "data")
    state = State(ChronoqProcess(data_dir, CONFIG))
    try:
        sent, kills = asyncio.run(run(state, rng))
        ctx = f"seed {SEED}, kills (copies written, ms before due) {kills}"
        assert kills and all(0 < n < CROWD for n, _ in kills), f"{ctx}: no kill landed mid-prewrite"
        assert not state.early, f"{ctx}: {len(state.early)} received early: {state.early[:5]}"
        missing = set(sent) - set(state.received)
        assert not missing, f"{ctx}: {len(missing)} acknowledged sends never received, e.g. {sorted(missing)[:5]}"
        state.proc.stop()
        found = audit(data_dir, str(tmp_path / "data.toml"))
        assert set(found) == set(sent), f"{ctx}: {len(set(sent) - set(found))} without a copy"
        twice = {mid: len(ms) for mid, ms in found.items() if len(ms) > 1}
        assert not twice, f"{ctx}: {len(twice)} messages with more than one copy, e.g. {list(twice.items())[:5]}"
        stamped_early = [(mid, m.stored_ms, m.deliver_at_ms) for mid, ms in found.items() for m in ms
                         if m.stored_ms < m.deliver_at_ms or m.deliver_at_ms != sent[mid]]
        assert not stamped_early, f"{ctx}: {len(stamped_early)} copies stamped before due: {stamped_early[:5]}"
        redelivered = sum(n - 1 for n in state.received.values())
        print(f"{ctx}: {len(sent):,} sent, {len(found):,} copies, {redelivered} POP redeliveries, "
              f"{state.errors} receive errors")
    finally:
        if state.proc.proc.returncode is None:
            state.proc.stop(check=False)
