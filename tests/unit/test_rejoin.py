"""Rejoining after a failover, in process (docs/replication.md, "Rejoining after a failover"):
the epoch arithmetic (``chronoq.replication.divergence``), the epoch history read from a log,
and the truncation (``chronoq.store.truncate``): what it cuts, what it keeps aside, that the
state after it equals a copy made from scratch, and that an interrupted one is finished by the
next open."""

from __future__ import annotations

import os
import shutil

import pytest

from chronoq.replication import position
from chronoq.replication.divergence import Cut, Unexplained, decide
from chronoq.replication.follower import rejoin_paths
from chronoq.store import truncate
from chronoq.store.digest import queue_digest

from storekit import SMALL_SEGMENT, fill, open_store
from test_replication import copy, segment_files

H = [(0, 0), (1, 1000), (2, 5000)]


# ------------------------------------------------------------------------- the arithmetic
@pytest.mark.parametrize("epoch, start, end, expect", [
    (0, 0, 800, None),            # ends before epoch 1 began: a prefix (the tail check decides)
    (0, 0, 1000, None),           # ends exactly where epoch 1 began
    (0, 0, 1001, Cut(1000, 1)),   # the old primary wrote past the boundary: cut there
    (0, 0, 9000, Cut(1000, 1)),   # (whatever it wrote later)
    (1, 1000, 4000, None),
    (1, 1000, 7000, Cut(5000, 2)),
    (2, 5000, 7000, None),        # the primary's own epoch: no boundary after it
])
def test_the_divergence_point_is_the_start_of_the_first_epoch_after_the_replicas(epoch, start, end, expect):
    assert decide(H, epoch, start, end) == expect


@pytest.mark.parametrize("epoch, start, words", [
    (3, 9000, "newer than this primary's 2"),           # a node promoted after this one: never follow back
    (1, 1200, "started at 1200, this primary's at 1000"),  # the same number, another term
    (0, 77, "started at 77"),
])
def test_divergences_the_epochs_do_not_explain_are_refused(epoch, start, words):
    with pytest.raises(Unexplained, match=words):
        decide(H, epoch, start, 20_000)


def test_an_epoch_missing_from_the_history_is_refused():
    with pytest.raises(Unexplained, match="not in this primary's history"):
        decide([(0, 0), (2, 5000)], 1, 1000, 6000)


def test_the_epoch_history_is_read_from_the_log(tmp_path):
    store = open_store(tmp_path / "s")
    assert position.epoch_history(store) == [(0, 0)]
    fill(store, 5)
    first = store.log.written
    store.append([position.epoch_record(1, "n1", 1)])
    fill(store, 5, seed=1)
    second = store.log.written
    store.append([position.epoch_record(2, "n2", 2)])
    assert position.epoch_history(store) == [(0, 0), (1, first), (2, second)]
    assert position.current_epoch(store) == 2


def test_a_first_leaders_epoch_record_at_offset_0_is_its_epoch(tmp_path):
    # A new group's first leader (etcd) writes its epoch record on an empty log, at offset 0.
    store = open_store(tmp_path / "s")
    store.append([position.epoch_record(1, "n1", 1)])
    fill(store, 5)
    assert position.epoch_history(store) == [(0, 0), (1, 0)]
    assert position.current_epoch(store) == 1


@pytest.mark.parametrize("epoch, start, end, expect", [
    (0, 0, 0, None),              # a fresh replica of that leader: nothing to cut
    (1, 0, 900, None),            # its own replica, later
    (1, 0, 9000, Cut(5000, 2)),   # that leader, after a failover to epoch 2
])
def test_a_history_that_began_with_epoch_1_at_offset_0(epoch, start, end, expect):
    assert decide([(0, 0), (1, 0), (2, 5000)], epoch, start, end) == expect


def test_bytes_of_epoch_0_against_a_history_that_began_at_offset_0_are_never_cut():
    # Either that epoch's own first records, copied before the replica's history caught up with
    # them, or a node that served alone: the prefix check decides (a cut would drop a whole log).
    assert decide([(0, 0), (1, 0)], 0, 0, 700) is None


# ------------------------------------------------------------------------- a failover, in process
def _failover(tmp_path, ahead: int = 40):
    """A primary ``a`` copied by ``b``; ``a`` writes ``ahead`` more that ``b`` never gets; ``b`` is
    promoted (epoch record at its end) and written to. Returns (a, b, the boundary)."""
    a = open_store(tmp_path / "a", segment_bytes=SMALL_SEGMENT)
    b = open_store(tmp_path / "b", segment_bytes=SMALL_SEGMENT)
    fill(a, 150, batch=9)
    copy(a, b)
    fill(a, ahead, seed=7, batch=5)  # acknowledged by a (async), never copied
    boundary = b.log.written
    b.append([position.epoch_record(1, "b", 1)])
    fill(b, 60, seed=9, batch=4)
    return a, b, boundary


def _rejoin(data_dir: str, store, boundary: int) -> truncate.Plan:
    plan = truncate.Plan(boundary, store.log.synced, rejoin_paths(data_dir), note="test")
    store.close()
    truncate.plan(data_dir, plan)
    truncate.run(data_dir, plan)
    return plan


def test_a_rejoining_primary_is_cut_at_the_boundary_and_then_holds_the_new_primarys_log(tmp_path):
    a, b, boundary = _failover(tmp_path)
    end = a.log.synced
    cut = decide(position.epoch_history(b), position.current_epoch(a), 0, end)
    assert cut == Cut(boundary, 1)
    assert position.tail(a, boundary) == position.tail(b, boundary)  # the replica's own check
    summary = truncate.describe(a.log, boundary, end)
    assert summary.records == 40 and summary.bytes == end - boundary
    cut_bytes = b"".join(a.log.read(max(s.base, boundary), min(s.end, end) - max(s.base, boundary))
                         for s in a.log.segments if s.end > boundary)
    data_dir = str(tmp_path / "a")
    plan = _rejoin(data_dir, a, boundary)
    with open(os.path.join(data_dir, plan.aside), "rb") as fh:  # kept aside, byte for byte
        assert fh.read() == cut_bytes
    a = open_store(tmp_path / "a", segment_bytes=SMALL_SEGMENT)
    assert a.log.synced == boundary and not os.path.exists(os.path.join(data_dir, truncate.MARKER))
    copy(b, a)
    fresh = open_store(tmp_path / "fresh", segment_bytes=SMALL_SEGMENT)  # a copy made from scratch
    copy(b, fresh)
    assert segment_files(a) == segment_files(b) == segment_files(fresh)
    assert queue_digest(a) == queue_digest(b) == queue_digest(fresh)
    assert position.epoch_history(a) == position.epoch_history(b)


def test_the_derived_state_and_the_shipped_copies_are_removed_the_rest_kept(tmp_path):
    data_dir = str(tmp_path / "d")
    store = open_store(data_dir)
    fill(store, 30)
    boundary = store.log.written
    fill(store, 10, seed=3)
    for rel in ("pop/00000000000000000003.poplog", "timer/schedule/x.sch", "timer/checkpoint.json",
                "timer/quarantine/q", "offsets.json", "schedules.json", "staging.json", "transactions.json",
                "topics.json", "groups.json"):
        os.makedirs(os.path.dirname(os.path.join(data_dir, rel)), exist_ok=True)
        with open(os.path.join(data_dir, rel), "wb") as fh:
            fh.write(b"old")
    _rejoin(data_dir, store, boundary)
    left = {os.path.relpath(os.path.join(d, f), data_dir) for d, _s, fs in os.walk(data_dir) for f in fs}
    assert {"timer/quarantine/q", "topics.json", "groups.json"} <= left
    for gone in ("pop", "timer/schedule", "timer/checkpoint.json", "offsets.json", "schedules.json",
                 "staging.json", "transactions.json", "consumequeue", "checkpoint.json"):
        assert not os.path.exists(os.path.join(data_dir, gone)), gone


def test_a_cut_at_a_segment_base_deletes_that_segment(tmp_path):
    data_dir = str(tmp_path / "d")
    store = open_store(data_dir, segment_bytes=SMALL_SEGMENT)
    fill(store, 200, batch=9)
    assert len(store.log.segments) >= 3
    base = store.log.segments[1].base
    kept = {os.path.basename(s.path) for s in store.log.segments[:1]}
    _rejoin(data_dir, store, base)
    assert set(os.listdir(os.path.join(data_dir, "commitlog"))) == kept
    store = open_store(data_dir, segment_bytes=SMALL_SEGMENT)
    assert store.log.synced == base


@pytest.mark.parametrize("step", ["marker", "aside", "remove", "cut"])
def test_an_interrupted_truncation_is_finished_by_the_next_open(tmp_path, step, monkeypatch):
    a, b, boundary = _failover(tmp_path)
    data_dir = str(tmp_path / "a")
    twin = str(tmp_path / "twin")  # the same directory, truncated without interruption
    a.close()
    shutil.copytree(data_dir, twin)
    plan = truncate.Plan(boundary, a.log.synced, rejoin_paths(data_dir))

    class Crash(Exception):
        pass

    def crash_after(name):
        if name == step:
            raise Crash(name)
    monkeypatch.setattr(truncate, "fault", crash_after)
    with pytest.raises(Crash):
        truncate.plan(data_dir, plan)
        truncate.run(data_dir, plan)
    monkeypatch.setattr(truncate, "fault", None)
    assert truncate.pending(data_dir) == plan
    reopened = open_store(data_dir, segment_bytes=SMALL_SEGMENT)  # finishes it
    assert "finished an interrupted truncation" in reopened.report.summary()
    truncate.plan(twin, plan)
    truncate.run(twin, plan)
    clean = open_store(twin, segment_bytes=SMALL_SEGMENT)
    assert reopened.log.synced == clean.log.synced == boundary
    copy(b, reopened)
    copy(b, clean)
    assert segment_files(reopened) == segment_files(clean) == segment_files(b)
    assert queue_digest(reopened) == queue_digest(clean) == queue_digest(b)
    with open(os.path.join(data_dir, plan.aside), "rb") as x, open(os.path.join(twin, plan.aside), "rb") as y:
        assert x.read() == y.read()


def test_a_damaged_marker_stops_the_open(tmp_path):
    data_dir = str(tmp_path / "d")
    open_store(data_dir).close()
    with open(os.path.join(data_dir, truncate.MARKER), "wb") as fh:
        fh.write(b"chronoq-json v1 crc32c=00000000\n{}")
    with pytest.raises(Exception, match="truncation marker"):
        open_store(data_dir)


def test_divergence_is_pure():
    from test_layers import imports_of

    assert imports_of("replication")["chronoq/replication/divergence.py"] == set()


# ------------------------------------------------------------------------- the POP generation floor
def test_a_promoted_nodes_pop_log_starts_past_every_generation_its_old_primary_reported(tmp_path):
    """The old primary compacted its POP log (generation G) after the copy this node holds (g <
    G); handles it minted in G, G + 1, ... must never name a checkpoint the promoted node mints:
    its POP service opens past the floor stored at promotion (``role.json``)."""
    from popkit import Node

    from chronoq.pop import handle
    from chronoq.replication import role
    from chronoq.server.consumers import open_consumers

    n = Node(str(tmp_path)).open()
    n.broker.send("orders", b"m")
    copied = n.pop._journal.log.generation  # what the replica copied
    n.close()
    reported = copied + 5  # the primary compacted five times since
    floor = max(copied, reported) + role.POP_GENERATION_GAP
    role.write_promoted(str(tmp_path), 1, "old:1", "n", 0, floor)
    n = Node(str(tmp_path)).open()
    n.pop.close()  # (the popkit's own service: replaced by the one the server opens)
    pop, _txns = open_consumers(n.broker, n.broker.config)
    try:
        got = pop.receive("g", "orders", max_messages=1, invisible_ms=30_000)
        ck_id = handle.decode(got[0].receipt_handle)[0]
        assert ck_id >> 32 == pop._journal.log.generation > reported + role.POP_GENERATION_GAP - 1
        assert role.pop_generation_floor(str(tmp_path)) == floor
    finally:
        pop.close()
        n.broker.close()


# ------------------------------------------------------------------------- the replica's checks
def _follower(store, data_dir: str, **kw):
    from types import SimpleNamespace

    from chronoq.core.clock import FakeClock
    from chronoq.proto import chronoq_admin_pb2 as apb
    from chronoq.replication.follower import Follower

    return Follower(store, data_dir, SimpleNamespace(endpoint="b:1", apb=apb), "me", "", FakeClock(),
                    reopen=lambda: open_store(data_dir, segment_bytes=SMALL_SEGMENT), **kw)


def _answer(epoch: int, offset: int, tail: tuple[int, int]):
    from chronoq.proto import chronoq_admin_pb2 as apb

    return apb.PullResponse(epoch=epoch, divergence=apb.Divergence(offset=offset, epoch=epoch, tail_from=tail[0],
                                                                   tail_crc=tail[1]))


def test_the_replica_checks_the_bytes_before_the_point_and_the_bound_before_it_cuts(tmp_path):
    a, b, boundary = _failover(tmp_path)
    data_dir = str(tmp_path / "a")
    f = _follower(a, data_dir)
    good = _answer(1, boundary, position.tail(b, boundary))
    assert f._refusal(good) is None
    tail_from, crc = position.tail(b, boundary)
    assert "differ from the primary's" in f._refusal(_answer(1, boundary, (tail_from, crc ^ 1)))
    small = _follower(a, data_dir, max_cut_bytes=a.log.synced - boundary - 1)
    assert "more than rejoin_max_truncate_bytes" in small._refusal(good)
    assert "more than rejoin_max_truncate_bytes" in _follower(a, data_dir, max_cut_bytes=0)._refusal(good)
    before = segment_files(a)
    f.rejoin(good.divergence)  # (what the follower does once nothing refuses)
    assert f.store.log.synced == boundary and segment_files(f.store) != before
    assert f.history == [(0, 0)] and f.pop_generation == 0 and "40 records" in f.rejoined[0]


def test_a_promoted_replica_does_not_follow_an_older_primary(tmp_path):
    from chronoq.proto import chronoq_admin_pb2 as apb

    store = open_store(tmp_path / "s")
    fill(store, 3)
    store.append([position.epoch_record(2, "me", 1)])
    f = _follower(store, str(tmp_path / "s"))
    assert "older than this node's 2" in f._refusal(apb.PullResponse(epoch=1))
    assert f._refusal(apb.PullResponse(epoch=2)) is None


def test_describe_counts_records_longer_than_its_read_step(tmp_path, monkeypatch):
    from storekit import prep

    store = open_store(tmp_path / "s")
    fill(store, 3)
    start = store.log.written
    store.append([prep("big", 0, b"x" * 5000, "m1"), prep("small", 0, b"y", "m2"), prep("big", 0, b"z" * 6000, "m3")])
    monkeypatch.setattr(truncate, "_READ_STEP", 4096)
    summary = truncate.describe(store.log, start, store.log.written)
    assert (summary.records, summary.topics) == (3, {"big": 2, "small": 1})
