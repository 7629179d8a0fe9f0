"""kill -9 while a real ``chronoq serve`` rolls pending timers forward in slices before retention.

The server's retention (``GroupCommitter.retention_roll``, run as a task of its own by
``Runtime._periodic``) writes the roll records of every pending timer whose copy lies in the range
about to be deleted a slice at a time (``RetentionRoll.step``, ``timer.roll.keep_batches``), with
the loop free between slices, then fsyncs them on the committer's thread and deletes the range.
``tests/crash/test_retention_crash.py`` kills the one-call path at chosen calls; this kills the
server itself while a roll is under way, with deliveries, recalls and sends going on between its
slices.

Set-up: 64 KiB segments, ``retention_max_bytes = 1`` (every segment below the timer's cursor
goes), a retention pass every second, so with FAR pending timers (due 10 min to 2 h ahead, ~110
one-minute buckets) every pass rolls nearly all of them again: a roll of ~1-2 s in ~100 slices.
Lanes meanwhile: sends of timers due 1-6 s ahead (``soon``), consumers of them, recalls of far
timers, and a consumer of the far topic (anything it receives is early).

Each kill: wait for the server's "retention rolling forward" line (the observable start of a roll:
stderr), sleep a seeded fraction of the last roll's measured length, SIGKILL, restart. After the
kill its log says where it landed (no "retention rolled" line after the start: mid-roll). After the
last restart two passes run to their end and the broker stops cleanly. Checked:

- nothing early: the soon timers' copies are received at or after their due time; no far timer
  is received at all;
- nothing lost, nothing extra: the broker's pending set is exactly the acknowledged far timers less
  those whose recall was acknowledged (a recall whose answer a kill lost may go either way); a
  rebuild from the logs alone (every derived file deleted) has exactly the same pending set; every
  one of them is delivered (an embedded broker on a clock past their due times), none recalled;
- retention ran (the log's first offset moved far past the load) and converged: after the
  undisturbed passes no pending timer has more than two records in the log (a killed pass leaves
  extra copies; the next passes fold them).

Seed: ``CHRONOQ_RETENTION_ROLL_CRASH_SEED``; kills: ``CHRONOQ_RETENTION_ROLL_CRASH_KILLS``.
"""

from __future__ import annotations

import asyncio
import collections
import datetime
import os
import random
import re
import shutil
import signal
import time
from dataclasses import dataclass, field

import pytest

from chronoq.broker.broker import Broker
from chronoq.broker.digest import derived_digest
from chronoq.client.admin import AdminClient
from chronoq.client.client import Client, ClientError, OutgoingMessage
from chronoq.core.clock import FakeClock
from chronoq.core.config import BrokerConfig
from chronoq.store import record
from chronoq.timer import copies, roll
from tests.integration.conftest import ChronoqProcess
from tests.integration.test_committer_crash import State, _lane, tally
from tests.integration.test_rebuild_from_log import _delete_derived

SEED = int(os.environ.get("CHRONOQ_RETENTION_ROLL_CRASH_SEED", "20261128"))
KILLS = int(os.environ.get("CHRONOQ_RETENTION_ROLL_CRASH_KILLS", "5"))
FAR = 40_000                   # pending timers loaded first: a roll of ~1-2 s here
FAR_DUE_MS = (600_000, 7_200_000)
SOON_DUE_S = (1.0, 6.0)
AIM = (0.05, 0.8)              # a kill lands this share of the last roll's length after its start
WAIT_S = 60.0                  # bound of every wait for a log line
FAR_TOPIC, SOON_TOPIC, GROUP, FAR_GROUP = "rr-far", "rr-soon", "rr-g", "rr-far-g"
CONFIG = """
segment_bytes = 65536
retention_max_bytes = 1
retention_interval_s = 1
checkpoint_interval_ms = 500
timer_checkpoint_interval_ms = 500
"""
BEGAN = "retention rolling forward"       # chronoq.broker.committer (GroupCommitter.retention_roll)
ROLLED = "retention rolled"               # chronoq.store.retention (RetentionRoll._done)
DELETED = "retention deleted"             # chronoq.server.runtime (Runtime._apply_retention)
LINE = re.compile(r"^(\S+Z) \S+ \S+: (.*)$")


@dataclass
class RollState(State):
    far: dict[str, int] = field(default_factory=dict)         # message id -> due ms
    handles: dict[str, str] = field(default_factory=dict)     # message id -> recall handle
    recalled: set[str] = field(default_factory=set)           # recall acknowledged
    recall_unknown: set[str] = field(default_factory=set)     # a kill took the answer
    far_received: list[str] = field(default_factory=list)     # early by definition
    landed: list[str] = field(default_factory=list)           # per kill: where in the pass


def _events(proc: ChronoqProcess) -> list[tuple[float, str]]:
    """(time in s, what) of the retention lines this process wrote so far."""
    out = []
    try:
        with open(proc.stderr_path, errors="replace") as fh:
            text = fh.read()
    except OSError:
        return out
    for line in text.splitlines():
        m = LINE.match(line)
        if m is None:
            continue
        for what in (BEGAN, ROLLED, DELETED):
            if m.group(2).startswith(what):
                stamp = datetime.datetime.strptime(m.group(1), "%Y-%m-%dT%H:%M:%S.%fZ")
                out.append((stamp.replace(tzinfo=datetime.timezone.utc).timestamp(), what))
    return out


async def _wait_for(proc: ChronoqProcess, what: str, after: int) -> int:
    """Wait until the process's log holds a ``what`` line past its first ``after`` retention lines;
    returns its index."""
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        events = _events(proc)
        for i in range(after, len(events)):
            if events[i][1] == what:
                return i
        await asyncio.sleep(0.01)
    raise AssertionError(f"no {what!r} line in {WAIT_S} s:\n{proc.output()}")


async def _roll_length(proc: ChronoqProcess) -> float:
    """The length of a whole roll: a start line and the rolled line after it."""
    began = await _wait_for(proc, BEGAN, 0)
    done = await _wait_for(proc, ROLLED, began)
    events = _events(proc)
    return events[done][0] - events[began][0]


def _landed(proc: ChronoqProcess) -> str:
    """Where the kill landed in the last pass it began."""
    events = _events(proc)
    starts = [i for i, (_t, what) in enumerate(events) if what == BEGAN]
    if not starts:
        return "no-pass"
    after = {what for _t, what in events[starts[-1] + 1:]}
    return "deleting" if DELETED in after else "syncing" if ROLLED in after else "mid-roll"


async def _load(state: RollState) -> None:
    async with AdminClient(state.endpoint) as admin:
        for topic in (FAR_TOPIC, SOON_TOPIC):
            await admin.create_topic(topic)
    async with Client(state.endpoint) as client:
        now_ms = int(time.time() * 1000)
        for first in range(0, FAR, 500):
            batch = [OutgoingMessage(FAR_TOPIC, f"far{first + i}".encode() * 8,
                                     deliver_at_ms=now_ms + state.rng.randrange(*FAR_DUE_MS)) for i in range(500)]
            for m, r in zip(batch, await client.send_batch(batch)):
                state.far[r.message_id] = m.deliver_at_ms
                state.handles[r.message_id] = r.recall_handle


def _send_soon(state: RollState, seq):
    async def step(client: Client) -> None:
        now_ms = time.time() * 1000
        batch = [OutgoingMessage(SOON_TOPIC, f"soon{next(seq)}".encode(),
                                 deliver_at_ms=int(now_ms + state.rng.uniform(*SOON_DUE_S) * 1000)) for _ in range(4)]
        for m, r in zip(batch, await client.send_batch(batch)):
            state.acked[r.message_id] = (SOON_TOPIC, m.deliver_at_ms)
        await asyncio.sleep(0.05)
    return step


def _consume_soon(state: RollState):
    async def step(client: Client) -> None:
        got = await client.receive(GROUP, SOON_TOPIC, max_messages=32, invisible_s=5, wait_s=0.5)
        tally(state, got, int(time.time() * 1000))
        if got:
            try:
                await client.ack(GROUP, SOON_TOPIC, got)
            except ClientError:  # handles from the broker before a kill are stale
                pass
    return step


def _consume_far(state: RollState):
    async def step(client: Client) -> None:
        got = await client.receive(FAR_GROUP, FAR_TOPIC, max_messages=32, invisible_s=60, wait_s=0.5)
        state.far_received.extend(m.message_id for m in got)
    return step


def _recall(state: RollState, order: list[str]):
    async def step(client: Client) -> None:
        if not order:
            await asyncio.sleep(0.1)
            return
        message_id = order.pop()
        state.recall_unknown.add(message_id)  # until the broker answers
        await client.recall(FAR_TOPIC, state.handles[message_id])
        state.recall_unknown.discard(message_id)
        state.recalled.add(message_id)
        await asyncio.sleep(0.02)
    return step


async def _kill_during_rolls(state: RollState) -> float:
    """Load, then KILLS times: aim at a roll in progress, SIGKILL, restart. Ends after two whole
    passes of the last process. Returns the first roll's length (s)."""
    await _load(state)
    length = await _roll_length(state.proc)
    seq = iter(range(10**8))
    order = sorted(state.far)
    state.rng.shuffle(order)
    del order[:-KILLS * 200]  # (the recall lane's supply: about 10 a second)
    lanes = [asyncio.create_task(_lane(state, _send_soon(state, seq))),
             asyncio.create_task(_lane(state, _recall(state, order)))]
    consumers = [asyncio.create_task(_lane(state, make(state), lambda s: s.consuming))
                 for make in (_consume_soon, _consume_far)]
    try:
        for _ in range(KILLS):
            seen = len(_events(state.proc))
            await _wait_for(state.proc, BEGAN, seen)
            await asyncio.sleep(state.rng.uniform(*AIM) * length)
            state.proc.proc.send_signal(signal.SIGKILL)
            await asyncio.to_thread(state.proc.proc.wait, 10)
            state.proc.stop(check=False)
            assert state.proc.proc.returncode == -signal.SIGKILL, state.proc.output()
            state.landed.append(_landed(state.proc))
            state.proc = await asyncio.to_thread(ChronoqProcess, state.proc.data_dir, CONFIG)
        state.sending = False
        await asyncio.gather(*lanes)
        for _ in range(2):  # two undisturbed passes to their deletion
            seen = len(_events(state.proc))
            began = await _wait_for(state.proc, BEGAN, seen)
            await _wait_for(state.proc, DELETED, began)
        deadline = time.monotonic() + max(SOON_DUE_S) + 10
        while time.monotonic() < deadline and not set(state.acked) <= set(state.received):
            await asyncio.sleep(0.2)
    finally:
        state.sending = state.consuming = False
        await asyncio.gather(*lanes, *consumers, return_exceptions=True)
    return length


def _config(data_dir: str) -> BrokerConfig:
    return BrokerConfig(data_dir=data_dir, segment_bytes=64 * 1024, retention_max_bytes=1)


def _pending(data_dir: str, now_ms: int) -> dict[str, int]:
    with Broker(_config(data_dir), clock=FakeClock(now_ms)) as broker:
        timers = derived_digest(broker)["timers"]
    out = {t.message_id: t.due_ms for t in timers}
    assert len(out) == len(timers), "a timer pending twice"
    return out


def _log_copies(data_dir: str, now_ms: int) -> tuple[int, collections.Counter]:
    """(the log's first offset, message id -> its records in the log: sent or rolled)."""
    count: collections.Counter = collections.Counter()
    with Broker(_config(data_dir), clock=FakeClock(now_ms)) as broker:
        for _offset, raw in broker.store.scan_flagged(broker.store.log.min_offset, broker.store.log.written,
                                                      record.FLAG_DELAYED, 1 << 30):
            if raw is None:
                continue
            rolled = roll.unwrap(raw)
            inner = rolled[1] if rolled is not None else raw
            if rolled is None and copies.header_fields(raw)[3] == copies.CONTROL_TOPIC.encode():
                continue  # a recall
            count[copies.header_fields(inner)[4].decode()] += 1
        return broker.store.log.min_offset, count


def _deliver_all(data_dir: str, after_ms: int, count: int) -> dict[str, int]:
    """The ``count`` pending timers delivered by an embedded broker on a clock past their due
    times: message id -> its copy's stored time (that clock's)."""
    clock = FakeClock(after_ms)
    out: dict[str, int] = {}
    with Broker(_config(data_dir), clock=clock) as broker:
        visible = 0
        for _ in range(1000):  # (bounded: ~2,000 deliveries a tick)
            clock.advance(100)
            visible += broker.timer_tick()
            broker.maintenance()
            if visible >= count:
                break
        assert not derived_digest(broker)["timers"], "timers still pending past every due time"
        for queue_id in range(broker.topic(FAR_TOPIC).queues):
            offset = 0
            while True:
                got = broker.read(FAR_TOPIC, queue_id, offset, 1000)
                for m in got.messages:
                    out[m.message_id] = m.stored_ms
                if got.next_offset >= got.max_offset or got.next_offset <= offset:
                    break
                offset = got.next_offset
    return out


@pytest.mark.timeout(240)  # ~40 s on a quiet machine
def test_kill_9_during_sliced_retention_roll_keeps_every_pending_timer(tmp_path):
    print(f"\nretention roll crash test seed {SEED} (CHRONOQ_RETENTION_ROLL_CRASH_SEED), {KILLS} kills")
    data = str(tmp_path / "data")
    state = RollState(ChronoqProcess(data, CONFIG), random.Random(SEED))
    try:
        length = asyncio.run(_kill_during_rolls(state))
    finally:
        state.proc.stop(check=False)
    assert state.proc.proc.returncode == 0, state.proc.output()
    ctx = f"seed {SEED}, kills landed {state.landed}, roll {length:.2f} s"
    print(ctx)
    # The kills hit rolls under way (the line says so), most of them mid-roll.
    assert len(state.landed) == KILLS and state.landed.count("mid-roll") * 2 > KILLS, ctx
    assert not state.refused, f"{ctx}: valid requests refused: {state.refused[:3]}"
    assert not state.early and not state.far_received, \
        f"{ctx}: early: {state.early[:5]}, far timers received: {state.far_received[:5]}"
    missing = set(state.acked) - set(state.received)
    assert not missing, f"{ctx}: {len(missing)} soon timers never received: {sorted(missing)[:5]}"

    now_ms = int(time.time() * 1000)
    pending = _pending(data, now_ms)
    must = {m: due for m, due in state.far.items() if m not in state.recalled and m not in state.recall_unknown}
    may = {m: state.far[m] for m in state.recall_unknown}
    assert set(pending) >= set(must), f"{ctx}: lost {len(set(must) - set(pending))} pending timers"
    extra = set(pending) - set(must) - set(may)
    assert not extra, f"{ctx}: {len(extra)} pending that were recalled or never sent: {sorted(extra)[:5]}"
    assert all(pending[m] == state.far[m] for m in pending), f"{ctx}: a due time changed"

    rebuilt = str(tmp_path / "rebuilt")
    shutil.copytree(data, rebuilt)
    _delete_derived(rebuilt)
    assert _pending(rebuilt, now_ms) == pending, f"{ctx}: the log alone holds another pending set"

    first, held = _log_copies(data, now_ms)
    assert first > 8 * 1024 * 1024, f"{ctx}: retention deleted little: the log starts at {first}"
    assert set(held) >= set(pending), f"{ctx}: pending timers with no record in the log"
    most = max(held[m] for m in pending)
    assert most <= 2, f"{ctx}: a pending timer has {most} records in the log after two whole passes"

    last_due = max(pending.values())
    delivered = _deliver_all(data, last_due + 1, len(pending))
    assert set(delivered) == set(pending), \
        f"{ctx}: delivered {len(delivered)} of {len(pending)}: missing {sorted(set(pending) - set(delivered))[:5]}"
    assert all(delivered[m] >= pending[m] for m in delivered), f"{ctx}: delivered early"
    print(f"{ctx}: {len(pending)} pending, {len(state.recalled)} recalled (+{len(state.recall_unknown)} unknown), "
          f"{len(state.acked)} soon sent and received, log from {first}, most records of one timer {most}")
