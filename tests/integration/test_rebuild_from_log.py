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
import threading
import time

import pytest
from rocketmq import FilterExpression, Producer, SimpleConsumer, TransactionChecker, TransactionResolution

from chronoq.broker.broker import Broker, OutgoingMessage
from chronoq.broker.digest import derived_digest
from chronoq.core.clock import FakeClock
from chronoq.core.config import BrokerConfig
from chronoq.core.model import MessageType
from chronoq.features.staging import Rows, Staging
from chronoq.features.transactions import Transactions
from chronoq.pop.service import PopService
from chronoq.timer.service import RecallOutcome, RescheduleOutcome

from .conftest import ROOT, groups_toml, wait_until
from .test_official_python_client import config, make_message

START_MS = 1_700_000_000_000
STEP_MS = 100
# Everything docs/storage.md lists as derived: deleting it loses nothing.
DERIVED = ("consumequeue", "checkpoint.json", "timer", "transactions.json", "staging.json")
# ... and the sources, which stay.
SOURCES = ("commitlog", "pop", "topics.json", "offsets.json", "groups.json")
SEGMENT_BYTES = 1 << 20  # small segments: cheap to copy, and the load rolls a few
CHILD_STEPS_MAX = 400
CHILD_WAIT_S = 120


class Node:
    """An embedded broker with its POP service and transactions on one data directory."""

    def __init__(self, data_dir: str, clock: FakeClock, **settings):
        self.clock = clock
        settings = {"default_queues": 2, "segment_bytes": SEGMENT_BYTES, "checkpoint_interval_ms": 1000,
                    "timer_checkpoint_interval_ms": 1000, "txn_check_after_ms": 3_600_000, **settings}
        cfg = BrokerConfig(data_dir=data_dir, **settings)
        self.broker = Broker(cfg, clock=clock)
        self.pop = PopService(self.broker, clock, buffer_ms=2000, flush_interval_ms=100)
        self.txns = Transactions(self.broker)
        self.staging = Staging(self.broker)

    def digest(self) -> dict:
        out = derived_digest(self.broker, self.pop)
        out["txn_pending"] = sorted((h.offset, h.topic, h.message_id) for h in self.txns.pending.values())
        st = self.staging
        # What a publish decides on: which batch ids are published (however ``below`` folds them)
        # and what each unpublished batch has staged, begun and published chunk by chunk.
        out["staged"] = sorted((key, b.first_ms, tuple(b.begun or ()),
                                tuple(sorted((stage, seq, c.queue_offset, c.rows, c.published)
                                             for stage, chunks in b.stages.items() for seq, c in chunks.items())))
                               for key, b in st.batches.items())
        out["published"] = sorted((sink, batch) for sink, state in st.sinks.by_name.items()
                                  for batch in range(max(state.published | {state.below}) + 1) if state.has(batch))
        return out

    def advance(self, ms: int) -> None:
        """Move time as the shell would: timer ticks, POP ticks and maintenance every STEP_MS."""
        for _ in range(max(1, ms // STEP_MS)):
            self.clock.advance(STEP_MS)
            self.broker.timer_tick()
            self.pop.tick_durably()
            self.broker.maintenance()
            if self.clock.wall_ms() % 1000 == 0:  # the server's is on the broker's checkpoint interval
                self.txns.checkpoint()
                self.staging.checkpoint()  # itself at most every CHECKPOINT_EVERY_MS

    def close(self) -> None:
        self.pop.close()
        self.txns.checkpoint()
        self.staging.checkpoint(force=True)
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
        b.create_topic("staged", 2)
        pop.set_group("g-conc", max_attempts=4)
        pop.set_group("g-fifo", fifo=True)
        # A transaction left open for good (its producer never answers): the transaction state's
        # replay floor stays at it while later ones are resolved above it.
        half = node.txns.half_message(OutgoingMessage("txn-t", b"never resolved"))
        node.txns.accepted(b.send_batch([half], system=True), [half])

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
        if r % 3 == 0:  # Spark-style staged publishes: published, left staged, aborted
            batch, stage = r // 3, f"st{r}"
            for seq in range(2):
                n.staging.stage("sink-1", batch, stage, seq, "staged",
                                Rows([f"s{r}.{seq}.{i}".encode() for i in range(3)],
                                     deliver_at_ms=[0, now + 2_000, 0]))
            b.flush()
            if batch % 4 != 3:
                for _ in n.staging.publish("sink-1", batch, [(stage, 2, 6)]).steps(n.staging):
                    pass
                b.flush()
            elif batch % 8 == 7:
                n.staging.abort("sink-1", batch)
                b.flush()
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
    # (a kill -9 inside ``fsutil.atomic_write`` leaves ``<file>.tmp``: the next write of that file
    # truncates it, and it is never read; a derived file's is derived too)
    for name in os.listdir(data_dir):
        if name.endswith(".tmp") and name[:-4] in DERIVED:
            os.unlink(os.path.join(data_dir, name))
    left = sorted(os.listdir(data_dir))
    assert set(left) <= {*SOURCES, *(f"{n}.tmp" for n in SOURCES if "." in n), "LOCK"}, \
        f"unclassified files in the data directory: {left}"


def _assert_same(a_state: dict, b_state: dict, names: tuple[str, str] = ("live", "rebuilt")) -> None:
    """Per structure, so a failure names what differs (and not a page of equal queues)."""
    assert a_state.keys() == b_state.keys()
    first, second = names
    for key in a_state:
        a, b = a_state[key], b_state[key]
        if isinstance(a, dict):
            diff = {k: (a.get(k), b.get(k)) for k in a.keys() | b.keys() if a.get(k) != b.get(k)}
            assert not diff, f"{key} differ ({first}, {second}): {diff}"
        else:
            only_a, only_b = sorted(set(a) - set(b)), sorted(set(b) - set(a))
            assert a == b, f"{key} differ: only {first} {only_a[:5]}, only {second} {only_b[:5]}"


def _check_load_was_mixed(d: dict, killed: bool = False) -> None:
    """The load reached every structure the comparison is about (else equality proves little).
    ``killed``: which in-flight deliveries survive depends on where the kill lands (the POP merge
    buffer holds a CK back for ``buffer_ms``), so only some must."""
    queues = d["queues"]
    assert any(k.startswith("%RETRY%") for k in queues), sorted(queues)
    assert any(k.startswith("%DLQ%") for k in queues), sorted(queues)
    assert any(k.startswith("CHRONOQ_DELAY") for k in queues), sorted(queues)
    assert any(k.startswith("later/") for k in queues)
    lanes = {t.lane for t in d["timers"]}
    assert "timer" in lanes and any(lane.startswith("level-") for lane in lanes), lanes
    assert len({t.due_ms for t in d["timers"]}) > 10
    assert d["inflight"]
    if not killed:
        assert {e.group for e in d["inflight"]} == {"g-conc", "g-fifo"}
        assert any(e.attempt > 1 for e in d["inflight"])
    assert ("pull-g", "orders", 0) in d["offsets"] or ("pull-g", "orders", 1) in d["offsets"]
    assert d["txn_pending"]
    assert d["staged"] and d["published"]


def _check_held(d: dict) -> None:
    assert any(q.held for q in d["queues"].values()), "no held timer copy at the snapshot"


@pytest.mark.parametrize("seed", [1])
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

    recovered, rebuilt = _recovered_and_rebuilt(tmp_path, data, clock.wall_ms())
    _assert_same(live, recovered, ("live", "restarted"))  # the ordinary restart
    _assert_same(live, rebuilt)  # from the logs alone


def test_rebuild_after_retention_keeps_absorbed_timers(tmp_path):
    """Retention deletes the segment far timers were sent in (the timer's cursor has passed
    them); their roll records (chronoq.timer.roll) keep them in the log, so a timer rebuilt from
    the log alone has them all, under the same idents, with the same bytes."""
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
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    stderr = open(str(tmp_path / "child.stderr"), "w+")
    child = subprocess.Popen([sys.executable, "-m", "tests.integration.test_rebuild_from_log", data, str(seed)],
                             stdout=subprocess.PIPE, stderr=stderr, stdin=subprocess.DEVNULL, text=True, cwd=ROOT,
                             env=env)
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
        stderr.seek(0)
        child_err = stderr.read()[-4000:]
        stderr.close()
    assert now is not None, f"the load process died before its first step:\n{child_err}"
    recovered, rebuilt = _recovered_and_rebuilt(tmp_path, data, int(now))
    _check_load_was_mixed(recovered, killed=True)
    _assert_same(recovered, rebuilt, ("recovered", "rebuilt"))


def _recovered_and_rebuilt(tmp_path, data: str, now_ms: int, **settings) -> tuple[dict, dict]:
    """Digests of two copies of a killed broker's directory opened at ``now_ms``: one with its
    derived files (the ordinary restart), one with them deleted (the rebuild from the logs)."""
    recovered_dir, rebuilt_dir = str(tmp_path / "recovered"), str(tmp_path / "rebuilt")
    shutil.copytree(data, recovered_dir)
    shutil.copytree(data, rebuilt_dir)
    _delete_derived(rebuilt_dir)
    digests = []
    for d in (recovered_dir, rebuilt_dir):
        node = Node(d, FakeClock(now_ms), **settings)
        try:
            digests.append(node.digest())
        finally:
            node.close()
    return digests[0], digests[1]


SERVE_GROUPS = {"rb-conc": {"max_attempts": 2}, "rb-fifo": {"fifo": True}}
SERVE_LOAD_SENDS_MAX = 3_000
SERVE_LOAD_S = 60.0


def _serve_producer(endpoint: str, stop: threading.Event, counts: dict, seed: int) -> None:
    rng = random.Random(seed)
    p = Producer(config(endpoint), ("rb-orders", "rb-fifo", "rb-later", "rb-txn"), _Commit())
    p.startup()
    try:
        far: list = []
        deadline = time.monotonic() + SERVE_LOAD_S
        for i in range(SERVE_LOAD_SENDS_MAX):
            if stop.is_set() or time.monotonic() > deadline:
                return
            p.send(make_message("rb-orders", f"o{i}".encode() * rng.randint(1, 30), tag=rng.choice("ab")))
            if i % 3 == 0:
                p.send(make_message("rb-fifo", f"f{i}".encode(), group=f"grp{i % 4}"))
            if i % 4 == 0:
                m = make_message("rb-later", f"d{i}".encode())
                m.delivery_timestamp = int(time.time()) + rng.choice((1, 2, 4, 3600))
                receipt = p.send(m)
                if m.delivery_timestamp > time.time() + 60:
                    far.append(receipt.recall_handle)
            if i % 10 == 9 and far:
                p.recall_message("rb-later", far.pop(rng.randrange(len(far))))
            if i % 7 == 0:
                tx = p.begin_transaction()
                p.send(make_message("rb-txn", f"t{i}".encode()), tx)
                if i % 3 == 0:
                    tx.commit()
                elif i % 3 == 1:
                    tx.rollback()
                # else: left open (the broker checks it later)
            counts["sent"] = i + 1
    except Exception as exc:  # noqa: BLE001 - the broker is killed under us: expected
        counts.setdefault("errors", []).append(repr(exc))
    finally:
        p.shutdown()


def _serve_consumer(endpoint: str, group: str, topics: tuple, stop: threading.Event, counts: dict,
                    seed: int) -> None:
    rng = random.Random(seed)
    c = SimpleConsumer(config(endpoint), group, {t: FilterExpression("*") for t in topics}, await_duration=1)
    c.startup()
    try:
        deadline = time.monotonic() + SERVE_LOAD_S
        while not stop.is_set() and time.monotonic() < deadline:
            for m in c.receive(16, rng.choice((2, 5))):
                roll = rng.random()
                if roll < 0.5:
                    c.ack(m)
                elif roll < 0.6:
                    c.change_invisible_duration(m, 10)
                counts["received"] = counts.get("received", 0) + 1
    except Exception as exc:  # noqa: BLE001 - the broker is killed under us: expected
        counts.setdefault("errors", []).append(repr(exc))
    finally:
        c.shutdown()


class _Commit(TransactionChecker):
    def check(self, message):
        return TransactionResolution.COMMIT


@pytest.mark.parametrize("seed", [7])
def test_kill9_of_serve_under_client_load_recovers_what_a_rebuild_gives(tmp_path, chronoq_process, seed):
    """A real ``chronoq serve`` under the official client (sends of every kind, recalls,
    transactions, receives, acks, nacks), killed with SIGKILL mid-load: the directory's ordinary
    recovery and a rebuild from its logs alone give the same state."""
    proc = chronoq_process(f"segment_bytes = {SEGMENT_BYTES}\n" + groups_toml(SERVE_GROUPS))
    kill_after = random.Random(seed).randint(300, 700)
    stop, counts = threading.Event(), {}
    threads = [threading.Thread(target=_serve_producer, args=(proc.endpoint, stop, counts, seed)),
               threading.Thread(target=_serve_consumer,
                                args=(proc.endpoint, "rb-conc", ("rb-orders", "rb-later"), stop, counts, seed)),
               threading.Thread(target=_serve_consumer,
                                args=(proc.endpoint, "rb-fifo", ("rb-fifo",), stop, counts, seed + 1))]
    for t in threads:
        t.start()
    try:
        wait_until(lambda: counts.get("sent", 0) >= kill_after and counts.get("received", 0) > 50
                   or not threads[0].is_alive(), SERVE_LOAD_S, what="client load")
        assert threads[0].is_alive(), f"the producer stopped before the kill: {counts}"
        proc.proc.send_signal(signal.SIGKILL)
        assert proc.proc.wait(20) == -signal.SIGKILL
    finally:
        stop.set()
        for t in threads:
            t.join(60)
        proc.stop(check=False)
    recovered, rebuilt = _recovered_and_rebuilt(tmp_path, proc.data_dir, int(time.time() * 1000),
                                                default_queues=BrokerConfig().default_queues)
    assert any(k.startswith("rb-orders/") for k in recovered["queues"])
    assert any(t.due_ms > START_MS for t in recovered["timers"]), "no timer pending at the kill"
    assert recovered["txn_pending"] or any(k.startswith("CHRONOQ_TXN_OP") for k in recovered["queues"])
    _assert_same(recovered, rebuilt, ("recovered", "rebuilt"))


if __name__ == "__main__":
    _child(sys.argv[1], int(sys.argv[2]))
