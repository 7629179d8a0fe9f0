"""Failover through etcd under mixed load: the primary killed with SIGKILL ``KILLS`` times, the
replica taking over by itself, the killed node restarted on its own address and data directory
to rejoin as the new primary's replica (issue 22; docs/replication.md, "What the failover test
shows", the etcd mode).

Two nodes A and B, a real etcd (``tests/integration/etcd_fixture.py``), both started with
``etcd_endpoints`` and no ``--replica-of``, ``replication = "sync"``, ``lease_ttl_ms = 2000``.
Round i: the leader P, its replica R in the in-sync set, the load of ``failover_load.Load``
(fewer sends per round than the manual test: ``SENDS_PER_ROUND``). At a seeded moment P is killed
(in half the rounds R first stopped with SIGSTOP for 0.2-1.5 s: P then writes what it cannot
acknowledge, a tail past the coming epoch boundary); nobody promotes R: its watch of the leader
key sees P's lease expire and it campaigns. After a seeded pause P is restarted on the same port
and directory: it finds R leading, follows it, cuts its log at R's epoch boundary when it went
past it (counted), and once it is in the in-sync set again the next round starts with the roles
swapped. Checked besides ``test_failover_crash.check`` (nothing acknowledged lost, nothing early,
duplicates within its bound, FIFO, timers due in the outage delivered after the promotion): each
promotion raised etcd's epoch by one, the new primary's log says so, and its epoch history at the
end is 1, 2, ..., KILLS + 1; the last replica's log is the leader's byte for byte up to the
leader's end once it caught up.

``test_a_paused_primary_under_load_is_fenced_and_rejoins``: the primary SIGSTOPped under the same
load (a partition) until the replica took over; resumed, it answers none of the load's writes and
steps down by itself; restarted all the same, it rejoins and its log equals the new leader's.

Seed: ``CHRONOQ_CRASH_SEED`` (printed); kills: ``CHRONOQ_FAILOVER_KILLS`` (default 10).
"""

from __future__ import annotations

import random
import signal
import time

import pytest

from chronoq.replication.position import EPOCH_TOPIC, PROP_EPOCH
from chronoq.store.store import Store
from tests.crash import failover_load
from tests.crash.failover_load import INVISIBLE_S, Ledger, Load
from tests.crash.test_failover_crash import CONFIG, KILLS, SEED, check, missing
from tests.integration import conftest
from tests.integration.conftest import ChronoqProcess, free_port, wait_until
from tests.integration.etcd_fixture import etcd  # noqa: F401 - the fixture
from tests.integration.test_etcd_failover import in_sync, role_of, same_log
from tests.integration.test_replication import cluster_status

SENDS_PER_ROUND = 150  # (the manual test's 400: a round here also waits out a lease and a rejoin)
CLUSTER = "crash"


class Node:
    """One member (a fixed address and data directory) across its lives (``chronoq serve`` processes)."""

    def __init__(self, tmp_path, name: str, config: str) -> None:
        self.data_dir, self.config = str(tmp_path / name), config
        self.port = free_port()
        self.endpoint = f"127.0.0.1:{self.port}"
        self.proc: ChronoqProcess | None = None
        self.cuts: list[str] = []  # each rejoin's "cutting N bytes" line, of every life

    def start(self) -> None:
        self.proc = ChronoqProcess(self.data_dir, self.config, extra_args=("--port", str(self.port)))
        self.proc.port, self.proc.endpoint = self.port, self.endpoint  # (the last --port wins)

    def signal(self, sig) -> None:
        self.proc.proc.send_signal(sig)

    def end_life(self, *, kill: bool = False) -> None:
        """SIGKILL (``kill``) or SIGTERM, then keep what this life's stderr said of its rejoins
        (the next life's stderr overwrites the file)."""
        if kill:
            self.signal(signal.SIGKILL)
            self.proc.proc.wait(10)
        self.proc.stop(check=False)
        with open(self.proc.stderr_path, errors="replace") as fh:
            self.cuts += [line for line in fh if "replica: rejoining" in line and "cutting" in line]


def start_cluster(tmp_path, etcd) -> tuple[Node, Node]:  # noqa: F811 - the fixture's value
    config = etcd.config(CLUSTER) + CONFIG  # (top-level keys before CONFIG's [groups.*] tables)
    a, b = Node(tmp_path, "a", config), Node(tmp_path, "b", config)
    a.start()
    assert any(f"leads {CLUSTER}/default at epoch 1" in line for line in a.proc.lines), a.proc.output()
    b.start()
    wait_rejoined(etcd, b, a)
    return a, b


def wait_rejoined(etcd, replica: Node, leader: Node) -> None:  # noqa: F811
    """``replica`` follows ``leader``, has what it had when asked and is in the published in-sync set."""
    end = cluster_status(leader.endpoint).commit_end
    wait_until(lambda: (lambda st: st.following == leader.endpoint and st.commit_end >= end
                        and st.state == "caught up")(cluster_status(replica.endpoint)),
               60, interval_s=0.1, what=f"{replica.endpoint} to follow {leader.endpoint} and catch up")
    wait_until(lambda: in_sync(etcd, CLUSTER, replica.proc), 30, interval_s=0.1, what="the replica in the in-sync set")


def wait_takeover(etcd, replica: Node, epoch: int) -> float:  # noqa: F811
    """Waits for ``replica`` to lead at ``epoch`` by itself; checks etcd and its log say so."""
    wait_until(lambda: role_of(replica.proc) == "primary", 60, interval_s=0.05, what="the replica to take over")
    promoted = time.time()
    view = etcd.view(CLUSTER)
    assert (view.leader.endpoint, view.epoch) == (replica.endpoint, epoch), view
    status = cluster_status(replica.endpoint)
    assert (status.role, status.epoch) == ("primary", epoch), status  # (its newest epoch record)
    return promoted


def tear_down(load: Load | None, *nodes: Node) -> None:
    if load is not None:
        load.close()
    for node in nodes:
        if node.proc is not None and node.proc.proc.poll() is None:
            node.signal(signal.SIGCONT)  # (stopped mid-round by a failure)
            node.proc.stop(check=False)


def drain(ledger: Ledger, leader: Node, round_no: int) -> None:
    """Receives from ``leader`` until every message that must come came (and the last due time passed)."""
    load = Load(leader.endpoint, ledger, round_no, random.Random(0), produce=False)
    try:
        last_due = max((s.due for s in ledger.sends.values() if s.due), default=0)
        deadline = time.monotonic() + 60 + INVISIBLE_S  # (then ``check`` names what never came)
        while (missing(ledger) or time.time() <= last_due) and time.monotonic() < deadline:
            time.sleep(0.5)
        time.sleep(3)  # (a redelivery in flight is counted too)
    finally:
        load.close()


def compare_logs(leader: Node, replica: Node) -> int:
    """Stops both (the replica first, once it has the leader's whole log); the replica's log is the
    leader's byte for byte up to where it caught up, and the leader's epoch history is returned
    checked to be 1..n, one record per promotion."""
    same_log(leader, replica, lambda: (replica.end_life(), leader.end_life()), 60)
    epochs = log_epochs(leader.data_dir)
    assert epochs == list(range(1, len(epochs) + 1)), epochs  # one record per election, each one more
    return epochs[-1]


def log_epochs(data_dir: str) -> list[int]:
    """The epoch of every epoch record in the log, in log order (the ``CHRONOQ_EPOCH`` queue; not
    ``epoch_history``, which leaves out epoch 1 when its record is the log's first: it starts where
    epoch 0 does)."""
    store = Store(data_dir)
    try:
        first, nxt = store.bounds(EPOCH_TOPIC, 0)
        assert first == 0, first  # (no retention here)
        entries = store.entries(EPOCH_TOPIC, 0, 0, nxt)
        assert len(entries) == nxt, (len(entries), nxt)
        return [int(store.read_properties(offset)[PROP_EPOCH]) for offset, _size, _tag, _t in entries]
    finally:
        store.close()


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_sigkill_of_the_primary_fails_over_through_etcd_and_the_killed_node_rejoins(tmp_path, monkeypatch, etcd):  # noqa: F811
    monkeypatch.setattr(conftest, "READY_TIMEOUT_S", 120.0)  # (a start on two shared, busy cores)
    monkeypatch.setattr(failover_load, "SENDS_MAX", SENDS_PER_ROUND)
    print(f"\netcd failover crash test: seed {SEED} (CHRONOQ_CRASH_SEED), {KILLS} kills")
    rng = random.Random(SEED)
    ledger = Ledger()
    outages: list[tuple[float, float, float, int]] = []  # (replica's last copy, kill, takeover, round)
    began = time.monotonic()
    a, b = start_cluster(tmp_path, etcd)
    primary, replica = a, b
    load = None
    try:
        for round_no in range(KILLS):
            load = Load(primary.endpoint, ledger, round_no, random.Random(rng.randrange(1 << 30)))
            time.sleep(rng.uniform(1.0, 3.0))  # the seeded moment, into the load
            stall = rng.uniform(0.2, 1.5) if rng.random() < 0.5 else 0.0
            cut = time.time()
            if stall:  # the replica stops copying: the primary writes a tail it cannot acknowledge
                replica.signal(signal.SIGSTOP)
                time.sleep(stall)
            primary.signal(signal.SIGKILL)
            killed = time.time()
            if stall:
                replica.signal(signal.SIGCONT)
            load.close()
            assert not load.errors, load.errors
            load = None
            primary.end_life(kill=True)
            promoted = wait_takeover(etcd, replica, round_no + 2)  # nobody promotes it: its lease watch does
            outages.append((cut, killed, promoted, round_no))
            time.sleep(rng.uniform(0.0, 1.0))
            primary.start()  # the same address and directory: it follows the new leader, cutting if it must
            wait_rejoined(etcd, primary, replica)
            primary, replica = replica, primary
        drain(ledger, primary, KILLS)
        last_epoch = compare_logs(primary, replica)
    finally:
        tear_down(load, a, b)
    cuts = a.cuts + b.cuts
    print(f"etcd failover crash test: {len(outages)} kills in {time.monotonic() - began:.0f} s; "
          f"{len(cuts)} rejoins cut their log at the epoch boundary; epochs 1..{last_epoch}")
    for line in cuts:
        print("  ", line.strip()[:300])
    assert last_epoch == KILLS + 1
    check(ledger, outages)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_paused_primary_under_load_is_fenced_and_rejoins(tmp_path, monkeypatch, etcd):  # noqa: F811
    monkeypatch.setattr(conftest, "READY_TIMEOUT_S", 120.0)
    monkeypatch.setattr(failover_load, "SENDS_MAX", SENDS_PER_ROUND)
    rng = random.Random(SEED)
    ledger = Ledger()
    a, b = start_cluster(tmp_path, etcd)
    load = None
    try:
        load = Load(a.endpoint, ledger, 0, random.Random(rng.randrange(1 << 30)))
        time.sleep(rng.uniform(1.0, 3.0))
        cut = time.time()
        a.signal(signal.SIGSTOP)  # a partition: alive, silent past its lease
        try:
            promoted = wait_takeover(etcd, b, 2)
        finally:
            a.signal(signal.SIGCONT)
        resumed = time.time()
        # The load goes on against the old primary for a while (it steps down by itself; a route
        # refreshed through it then names the new one).
        time.sleep(3)
        load.close()
        assert not load.errors, load.errors
        print(f"\npartition: the load's last write answered OK {resumed - load.last_ok:.2f} s before the resume, "
              f"its last ack {resumed - load.last_ack_ok:.2f} s before")
        assert load.last_ok < resumed, f"the fenced primary answered a write OK {load.last_ok - resumed:.2f} s after resuming"
        assert load.last_ack_ok < resumed, f"the fenced primary answered an ack OK {load.last_ack_ok - resumed:.2f} s after resuming"
        handed = [d.body for d in ledger.deliveries if d.epoch == 0 and d.at >= resumed and d.endpoint == a.endpoint]
        assert not handed, f"the fenced primary delivered {len(handed)} messages after resuming: {handed[:10]}"
        load = None
        a.end_life()
        assert etcd.view(CLUSTER).leader.endpoint == b.endpoint
        a.start()
        wait_rejoined(etcd, a, b)
        drain(ledger, b, 1)
        assert compare_logs(b, a) == 2
    finally:
        tear_down(load, a, b)
    print(f"partition: {len(a.cuts)} cut at the epoch boundary: {[c.strip()[:300] for c in a.cuts]}")
    check(ledger, [(cut, cut, promoted, 0)])
