"""kill -9 crash test for replace by key (chronoq.timer.keyed): a real ``chronoq serve`` is SIGKILLed
at seeded moments while sender lanes keep replacing a few keys' pending messages.

Each lane (``chronoq.client.client``) sends, again and again, a timer message due 0.3-2.5 s ahead
with one of ``KEYS`` replace keys; a send in flight at a kill has an unknown outcome. After the
last kill the broker is restarted, the senders stop, every due time passes, the broker is stopped
cleanly and the data directory is audited with the embedded broker (the topic's consume queues,
and the commit log's delayed records with what each replaced). Checked:

- nothing delivered twice (dispatch-once), nothing early (a copy's store time is at or after its
  due time: copies written ahead are held and stamped with it);
- never both: a message that any record in the log replaced is never delivered;
- an acknowledged send answered ``replaced:X`` names a message that is never delivered; one
  answered ``already_delivered:X`` names a message that is delivered;
- every acknowledged send that was not replaced (by any record in the log) is delivered.

SIGKILL ends the process, not the machine (page cache survives), as in the other crash tests.
Seed: ``CHRONOQ_REPLACE_CRASH_SEED`` (printed); kills: ``CHRONOQ_REPLACE_CRASH_KILLS``.
"""

from __future__ import annotations

import asyncio
import os
import random
import time
from dataclasses import dataclass, field

import pytest

from chronoq.broker.broker import Broker
from chronoq.core.config import load_config
from chronoq.store import record
from chronoq.timer import copies
from chronoq.timer.keyed import PROP_REPLACED
from tests.integration.conftest import ChronoqProcess
from tests.integration.test_committer_crash import _lane, kill_9_and_restart, timer_pending
from tests.unit.timerkit import visible

SEED = int(os.environ.get("CHRONOQ_REPLACE_CRASH_SEED", "20261126"))
KILLS = int(os.environ.get("CHRONOQ_REPLACE_CRASH_KILLS", "6"))
KEYS = 12
LANES = 3
DUE_MS = (300, 2_500)
KILL_GAP_S = (0.4, 1.5)
SEND_PHASE_MAX_S = 120.0
SETTLE_S = 4.0  # after the last due time: the timer delivers what is due
# ... and then until its pending count is 0: on a loaded machine a restart's recovery and replay
# can take longer than SETTLE_S (seed 777 once failed so under heavy load, with a due message neither delivered nor replaced; it passed alone).
SETTLE_MAX_S = 60.0
TOPIC = "replace-crash"
CONFIG = """
timer_bucket_ms = 1000
timer_preload_ms = 2000
timer_checkpoint_interval_ms = 500
checkpoint_interval_ms = 500
default_queues = 2
"""


@dataclass
class State:
    proc: ChronoqProcess
    rng: random.Random
    sending: bool = True
    acked: dict[str, tuple[str, int, str]] = field(default_factory=dict)  # id -> (key, due ms, replaced answer)
    refused: list[str] = field(default_factory=list)
    errors: int = 0
    seq: int = 0

    @property
    def endpoint(self) -> str:
        return self.proc.endpoint


async def send_one(state: State, client) -> None:
    """One replacing send (``_lane`` of test_committer_crash runs it, reconnecting after kills)."""
    key = f"key-{state.rng.randrange(KEYS)}"
    due = int(time.time() * 1000) + state.rng.randrange(*DUE_MS)
    state.seq += 1
    r = await client.send(TOPIC, b"%d" % state.seq, deliver_at_ms=due, replace_key=key)
    state.acked[r.message_id] = (key, due, r.replaced)


def audit(data_dir: str, config_path: str) -> tuple[dict[str, list], dict[str, str]]:
    """(message id -> delivered copies in the topic, replaced message id -> the record that replaced it)."""
    cfg = load_config(config_path, env={}, overrides={"data_dir": data_dir})
    broker = Broker(cfg)
    try:
        delivered: dict[str, list] = {}
        for m in visible(broker, TOPIC):
            delivered.setdefault(m.message_id, []).append(m)
        replaced: dict[str, str] = {}
        for _offset, header, raw in broker.store.scan(0):
            if header.flags & record.FLAG_DELAYED and header.topic == TOPIC:
                parts = copies.split(raw)
                value = record.decode_properties(parts.properties).get(PROP_REPLACED, "")
                if value.startswith("replaced:"):
                    replaced[value.rsplit(":", 1)[1]] = parts.message_id.decode()
    finally:
        broker.close()
    return delivered, replaced


def settle(proc: ChronoqProcess) -> int:
    """Wait (at most SETTLE_MAX_S) until the broker has no delayed message pending; returns what
    is left."""
    deadline = time.monotonic() + SETTLE_MAX_S
    while (left := timer_pending(proc)) and time.monotonic() < deadline:
        time.sleep(0.5)
    return left


@pytest.mark.timeout(400)
def test_kill_9_while_replacing_by_key_never_delivers_both(tmp_path):
    print(f"\nreplace-by-key crash test seed {SEED} (CHRONOQ_REPLACE_CRASH_SEED), {KILLS} kills")
    rng = random.Random(SEED)
    data_dir = str(tmp_path / "data")
    state = State(ChronoqProcess(data_dir, CONFIG), rng)

    async def run() -> None:
        senders = [asyncio.ensure_future(_lane(state, lambda client: send_one(state, client)))
                   for _ in range(LANES)]
        started = time.monotonic()
        for _ in range(KILLS):
            await asyncio.sleep(rng.uniform(*KILL_GAP_S))
            assert time.monotonic() - started < SEND_PHASE_MAX_S
            await kill_9_and_restart(state, CONFIG)
        await asyncio.sleep(rng.uniform(*KILL_GAP_S))
        state.sending = False
        await asyncio.gather(*senders)

    asyncio.run(run())
    last_due = max(due for _k, due, _r in state.acked.values())
    time.sleep(max(0.0, last_due / 1000 - time.time()) + SETTLE_S)
    left = settle(state.proc)
    assert left == 0, f"{left} delayed messages still pending {SETTLE_MAX_S} s after the last due time"
    state.proc.stop()
    delivered, replaced = audit(data_dir, str(tmp_path / "data.toml"))
    print(f"acknowledged {len(state.acked)} sends, {state.errors} lost to kills, {len(delivered)} delivered, "
          f"{len(replaced)} replaced")
    assert not state.refused, state.refused[:5]
    assert len(state.acked) > 50 and state.errors > 0, "the kills should have hit the senders"
    twice = {mid: len(c) for mid, c in delivered.items() if len(c) > 1}
    assert not twice, f"delivered more than once: {twice}"
    early = [(mid, c[0].stored_ms, c[0].deliver_at_ms) for mid, c in delivered.items()
             if c[0].stored_ms < c[0].deliver_at_ms]
    assert not early, early[:5]
    both = sorted(set(replaced) & set(delivered))
    assert not both, f"replaced yet delivered: {both[:5]}"
    for mid, (key, _due, answer) in state.acked.items():
        kind, _, old = answer.partition(":")
        if kind == "replaced":
            assert replaced.get(old) == mid and old not in delivered, (mid, answer)
        elif kind == "already_delivered":
            assert old in delivered, (mid, answer)
        else:
            assert answer == "none", (mid, answer)
        assert mid in delivered or mid in replaced, f"acknowledged {mid} ({key}) neither delivered nor replaced"
