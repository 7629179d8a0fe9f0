"""Issue 21: rebuild every derived structure from the logs alone and compare it with the live state.

docs/storage.md ("The logs and what is derived from them") names the sources of a data directory
(the commit log, the POP log, topics/offsets/groups configs) and everything derived from them
(consume queues and the store checkpoint, the timer directory, the transaction and staging
replay cursors). These tests drive an embedded broker with mixed work on a FakeClock (so every
comparison is exact), stop it, delete every derived file, reopen, and compare the digests
(``chronoq.broker.digest``): consume-queue entries and holds per queue, the timer's pending set
(due time and message of every pending timer), the POP in-flight books, group offsets and
configs, and the pending transaction halves.

* clean stop: the live state before the stop equals the state rebuilt from the logs;
* ``kill -9`` at a seeded moment of the same load (a real child process): the state recovered
  with the derived files (the ordinary restart) equals the state rebuilt without them.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import sys
import time

import pytest

from chronoq.broker.broker import Broker, OutgoingMessage
from chronoq.broker.digest import derived_digest
from chronoq.core.clock import FakeClock
from chronoq.core.config import BrokerConfig
from chronoq.core.model import MessageType
from chronoq.features.transactions import Transactions
from chronoq.pop.service import PopService
from chronoq.timer.service import RecallOutcome, RescheduleOutcome

START_MS = 1_700_000_000_000
STEP_MS = 100
# Everything docs/storage.md lists as derived: deleting it loses nothing.
DERIVED = ("consumequeue", "checkpoint.json", "timer", "transactions.json", "staging.json")
# ... and the sources, which stay.
SOURCES = ("commitlog", "pop", "topics.json", "offsets.json", "groups.json")
CHILD_STEPS_MAX = 400
CHILD_WAIT_S = 120


class Node:
    """An embedded broker with its POP service and transactions on one data directory."""

    def __init__(self, data_dir: str, clock: FakeClock):
        self.clock = clock
        cfg = BrokerConfig(data_dir=data_dir, default_queues=2, segment_bytes=1 << 20, checkpoint_interval_ms=1000,
                           timer_checkpoint_interval_ms=1000, txn_check_after_ms=3_600_000)
        self.broker = Broker(cfg, clock=clock)
        self.pop = PopService(self.broker, clock, buffer_ms=2000, flush_interval_ms=100)
        self.txns = Transactions(self.broker)

    def digest(self) -> dict:
        out = derived_digest(self.broker, self.pop)
        out["txn_pending"] = sorted((h.offset, h.topic, h.message_id) for h in self.txns.pending.values())
        return out

    def advance(self, ms: int) -> None:
        """Move time as the shell would: timer ticks, POP ticks and maintenance every STEP_MS."""
        for _ in range(max(1, ms // STEP_MS)):
            self.clock.advance(STEP_MS)
            self.broker.timer_tick()
            self.pop.tick()
            self.broker.maintenance()
            self.txns.checkpoint()

    def close(self) -> None:
        self.pop.close()
        self.txns.checkpoint()
        self.broker.close()


class Load:
    """Mixed work, deterministic for a seed: sends of every kind, receives, acks, nacks, retries
    and dead letters, recalls, reschedules, offset commits, group and topic configuration."""

    def __init__(self, node: Node, seed: int):
        self.n = node
        self.rng = random.Random(seed)
        self.handles: list[str] = []
        self.txids: list[tuple[str, str, str]] = []
        self.round = 0
        b, pop = node.broker, node.pop
        b.create_topic("orders", 4)
        b.create_topic("fifo-t", 2, MessageType.FIFO)
        b.create_topic("later", 2)
        b.create_topic("txn-t", 2, MessageType.TRANSACTION)
        pop.set_group("g-conc", max_attempts=4)
        pop.set_group("g-fifo", fifo=True)

    def step(self) -> None:
        n, rng, r = self.n, self.rng, self.round
        b, pop, now = n.broker, n.pop, n.clock.wall_ms()
        self.round += 1
        b.send_batch([OutgoingMessage("orders", f"o{r}.{i}".encode() * rng.randint(1, 20), tag=rng.choice("ab"))
                      for i in range(rng.randint(5, 20))])
        b.send_batch([OutgoingMessage("fifo-t", f"f{r}.{i}".encode(), message_group=f"grp{i % 3}")
                      for i in range(4)])
        delayed = [OutgoingMessage("later", f"d{r}.{i}".encode(), deliver_at_ms=now + horizon)
                   for i, horizon in enumerate((150, 1_500, 4_000, 70_000, 7_200_000, rng.randint(1, 600_000)))]
        delayed += [OutgoingMessage("later", f"l{r}.{lv}".encode(), delay_level=lv) for lv in (1, 3)]
        self.handles += [res.recall_handle for res in b.send_batch(delayed)]
        if r % 2 == 0 and len(self.handles) > 8:
            handle = self.handles.pop(rng.randrange(len(self.handles)))
            assert b.recall(handle).outcome in tuple(RecallOutcome)
            handle = self.handles.pop(rng.randrange(len(self.handles)))
            res = b.reschedule(handle, now + rng.choice((200, 3_000, 90_000)))
            assert res.outcome in tuple(RescheduleOutcome)
            if res.recall_handle:
                self.handles.append(res.recall_handle)
        half = n.txns.half_message(OutgoingMessage("txn-t", f"t{r}".encode()))
        results = b.send_batch([half], system=True)
        self.txids.append(("txn-t", results[0].message_id, n.txns.accepted(results, [half])[0]))
        if len(self.txids) > 2:
            topic, mid, txid = self.txids.pop(0)
            n.txns.end(topic, mid, txid, commit=rng.random() < 0.6)
        for group, topic in (("g-conc", "orders"), ("g-fifo", "fifo-t"), ("g-conc", "later")):
            got = pop.receive(group, topic, max_messages=rng.randint(1, 8), invisible_ms=rng.choice((1_000, 3_000)))
            for p in got:
                roll = rng.random()
                if roll < 0.5:
                    pop.ack(group, topic, p.receipt_handle)
                elif roll < 0.6:
                    pop.change_invisible(group, topic, p.receipt_handle, rng.choice((1_000, 20_000)))
                # else: left to expire (retry, then %DLQ% after max_attempts; FIFO: redelivered in place)
        q = rng.randrange(4)
        lo, hi = b.queue_bounds("orders", q)
        b.commit_offset("pull-g", "orders", q, rng.randint(lo, hi))
        if r == 5:
            pop.set_group("g-conc", max_attempts=2)
            b.create_topic("orders", 6)
        n.advance(rng.choice((100, 300, 700, 1_500)))

    def leave_held(self) -> None:
        """End with timer copies written ahead of their due time and still held (``prewrite_ms``)."""
        b, now = self.n.broker, self.n.clock.wall_ms()
        b.send_batch([OutgoingMessage("later", f"h{i}".encode(), deliver_at_ms=now + STEP_MS + 20 + i)
                      for i in range(3)])
        self.n.advance(STEP_MS)


def _delete_derived(data_dir: str) -> None:
    for name in DERIVED:
        path = os.path.join(data_dir, name)
        if os.path.isdir(path):
            shutil.rmtree(path)
        elif os.path.exists(path):
            os.unlink(path)
    left = sorted(os.listdir(data_dir))
    assert set(left) <= set(SOURCES) | {"LOCK"}, f"unclassified files in the data directory: {left}"


def _assert_same(live: dict, rebuilt: dict) -> None:
    """Per structure, so a failure names what differs (and not a page of equal queues)."""
    assert live.keys() == rebuilt.keys()
    for key in live:
        a, b = live[key], rebuilt[key]
        if isinstance(a, dict):
            diff = {k: (a.get(k), b.get(k)) for k in a.keys() | b.keys() if a.get(k) != b.get(k)}
            assert not diff, f"{key} differ (live, rebuilt): {diff}"
        else:
            only_live, only_rebuilt = sorted(set(a) - set(b)), sorted(set(b) - set(a))
            assert a == b, f"{key} differ: only live {only_live[:5]}, only rebuilt {only_rebuilt[:5]}"


def _check_load_was_mixed(d: dict) -> None:
    """The load reached every structure the comparison is about (else equality proves little)."""
    queues = d["queues"]
    assert any(k.startswith("%RETRY%") for k in queues), sorted(queues)
    assert any(k.startswith("%DLQ%") for k in queues), sorted(queues)
    assert any(k.startswith("CHRONOQ_DELAY") for k in queues), sorted(queues)
    assert any(k.startswith("later/") for k in queues)
    lanes = {t.lane for t in d["timers"]}
    assert "timer" in lanes and any(lane.startswith("level-") for lane in lanes), lanes
    assert len({t.due_ms for t in d["timers"]}) > 10
    assert {e.group for e in d["inflight"]} == {"g-conc", "g-fifo"}
    assert any(e.attempt > 1 for e in d["inflight"])
    assert ("pull-g", "orders", 0) in d["offsets"] or ("pull-g", "orders", 1) in d["offsets"]
    assert d["txn_pending"]


def _check_held(d: dict) -> None:
    assert any(q.held for q in d["queues"].values()), "no held timer copy at the snapshot"


@pytest.mark.parametrize("seed", [1, 2])
def test_clean_stop_rebuild_equals_live(tmp_path, seed):
    data = str(tmp_path / "data")
    clock = FakeClock(START_MS)
    node = Node(data, clock)
    load = Load(node, seed)
    for _ in range(150):  # ~100 s: buckets finish (.done files), timers fall due at every step
        load.step()
    load.leave_held()
    # The live state as the stop leaves it: the POP service's close logs its merge buffer and
    # moves consume offsets past what became durable; the broker's close writes the trace buffer.
    node.pop.close()
    node.broker.write_trace()
    node.broker.flush()
    live = node.digest()
    _check_load_was_mixed(live)
    _check_held(live)
    node.close()

    _delete_derived(data)
    rebuilt_node = Node(data, clock)
    try:
        rebuilt = rebuilt_node.digest()
    finally:
        rebuilt_node.close()
    _assert_same(live, rebuilt)


@pytest.mark.xfail(strict=True, reason=(
    "the schedule log is the only copy of a timer message once retention deleted the segment it "
    "was sent in (the timer's cursor guards only what it has not absorbed: docs/storage.md, "
    "'Retention turns some derived files into the only copy'); rebuilding timer/ from the commit "
    "log then loses those timers"))
def test_rebuild_after_retention_loses_absorbed_timers(tmp_path):
    data = str(tmp_path / "data")
    clock = FakeClock(START_MS)
    cfg = BrokerConfig(data_dir=data, segment_bytes=64 * 1024, retention_max_bytes=1, checkpoint_interval_ms=1000,
                       timer_checkpoint_interval_ms=1000)
    broker = Broker(cfg, clock=clock)
    try:
        far = [r.recall_handle for r in broker.send_batch(
            [OutgoingMessage("later", f"far{i}".encode(), deliver_at_ms=START_MS + 7_200_000) for i in range(5)])]
        assert all(far)
        for i in range(40):  # ~10 segments of plain messages after them
            broker.send_batch([OutgoingMessage("orders", bytes(1024)) for _ in range(16)])
            clock.advance(STEP_MS)
            broker.timer_tick()
            broker.maintenance()  # the timer checkpoints: its cursor passes the delayed records
        broker.retention()
        assert broker.store.log.min_offset > 0, "retention deleted nothing"
        live = derived_digest(broker)
        assert len(live["timers"]) == 5
    finally:
        broker.close()
    _delete_derived(data)
    with Broker(cfg, clock=clock) as rebuilt:
        assert derived_digest(rebuilt)["timers"] == live["timers"]


def _child(data_dir: str, seed: int) -> None:
    """The load in a process of its own, until killed: reports each step's clock on stdout."""
    clock = FakeClock(START_MS)
    node = Node(data_dir, clock)
    load = Load(node, seed)
    for step in range(CHILD_STEPS_MAX):
        load.step()
        print(f"step {step} {clock.wall_ms()}", flush=True)
    print("done", flush=True)
    time.sleep(CHILD_WAIT_S)  # bounded: the parent kills us long before


@pytest.mark.parametrize("seed", [3, 4, 5])
def test_kill9_recovered_equals_rebuilt(tmp_path, seed):
    data = str(tmp_path / "data")
    kill_after = random.Random(seed).randint(25, 60)
    child = subprocess.Popen([sys.executable, __file__, data, str(seed)], stdout=subprocess.PIPE, text=True,
                             cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    now = None
    try:
        for line in child.stdout:
            assert line.startswith("step "), line
            _, step, now = line.split()
            if int(step) >= kill_after:
                break
        os.kill(child.pid, signal.SIGKILL)  # in the middle of the next step's work
    finally:
        child.kill()
        child.wait(timeout=30)
    assert now is not None, "the load process died before its first step"
    recovered_dir, rebuilt_dir = str(tmp_path / "recovered"), str(tmp_path / "rebuilt")
    shutil.copytree(data, recovered_dir)
    shutil.copytree(data, rebuilt_dir)
    _delete_derived(rebuilt_dir)

    digests = []
    for d in (recovered_dir, rebuilt_dir):
        node = Node(d, FakeClock(int(now)))
        try:
            digests.append(node.digest())
        finally:
            node.close()
    recovered, rebuilt = digests
    _check_load_was_mixed(recovered)
    _assert_same(recovered, rebuilt)


if __name__ == "__main__":
    _child(sys.argv[1], int(sys.argv[2]))
