"""Retention's roll-forward in bounded steps (``chronoq.store.retention``, ``chronoq.timer.roll``
``keep_batches``, ``GroupCommitter.retention_roll``): a step writes at most one bucket's roll
records (a chunk of them for a big bucket: tests/unit/test_retention_bucket_steps.py), the loop
runs between slices, and the outcome is the one-call retention's."""

from __future__ import annotations

import asyncio

from timerkit import T0, open_broker

from chronoq.broker.digest import derived_digest
from chronoq.broker.outgoing import OutgoingMessage
from chronoq.core.clock import FakeClock
from chronoq.store import record
from chronoq.timer import roll
from chronoq.timer.recall import RecallOutcome

BUCKETS = 6
PER_BUCKET = 40
HOUR_MS = 3_600_000


def _loaded(path):
    """A broker holding BUCKETS x PER_BUCKET pending timers (one bucket of the timer's each), then
    segments of plain messages; retention may delete every sealed segment (max bytes 1)."""
    clock = FakeClock(T0)
    b = open_broker(path, clock, retention_max_bytes=1)
    handles = []
    for k in range(BUCKETS):
        for i in range(PER_BUCKET):
            due = T0 + HOUR_MS + k * b.timer.width + i
            handles.append(b.send("later", b"far", deliver_at_ms=due).recall_handle)
    for _ in range(20):
        b.send_batch([OutgoingMessage("orders", bytes(1024)) for _ in range(16)])
    b.timer.checkpoint()
    b.checkpoint()
    return b, clock, handles


def _run_steps(b, roll_):
    """Step with a deadline already passed (each step then takes one batch); the records each
    step wrote, and the plan."""
    written = []
    while True:
        before = b.store.log.written
        plan = roll_.step(b.clock.monotonic_ns())
        written.append(b.store.log.written - before)
        if plan is not None:
            return written, plan


def test_a_step_writes_at_most_one_buckets_roll_records_and_the_outcome_is_the_one_call_ones(tmp_path):
    b, _clock, _handles = _loaded(tmp_path / "a")
    pending = derived_digest(b)["timers"]
    one_call = [pair for batch in roll.keep_batches(b.timer, b.store.log.min_offset, b.store.log.written, T0)
                for pair in batch]
    roll_ = b.retention_begin()
    written, plan = _run_steps(b, roll_)
    assert plan.kept == len(one_call) == BUCKETS * PER_BUCKET
    biggest = max(written)
    # One bucket's batch a step (its roll records are ~3x a small record; never two buckets' worth).
    assert len([w for w in written if w]) == BUCKETS and biggest < 2 * min(w for w in written if w)
    assert plan.ticket == b.store.log.written
    b.store.dispatch(b.store.sync())
    deleted, job = b.retention_apply(plan, True)
    job.run_here()
    assert deleted and b.store.log.min_offset > 0
    assert derived_digest(b)["timers"] == pending
    b.close()


def test_a_message_recalled_between_steps_is_not_rolled(tmp_path):
    b, _clock, handles = _loaded(tmp_path / "b")
    roll_ = b.retention_begin()
    assert roll_.step(b.clock.monotonic_ns()) is None  # (the scan's first slice; no bucket read yet)
    last_bucket = handles[-PER_BUCKET:]
    for handle in last_bucket:
        assert b.recall(handle).outcome == RecallOutcome.CANCELLED
    b.store.dispatch(b.store.sync())
    _written, plan = _run_steps(b, roll_)
    assert plan.kept == (BUCKETS - 1) * PER_BUCKET
    b.store.dispatch(b.store.sync())
    _deleted, job = b.retention_apply(plan, True)
    job.run_here()
    assert len(derived_digest(b)["timers"]) == (BUCKETS - 1) * PER_BUCKET
    b.close()


def test_the_scan_pauses_in_a_long_run_of_other_records(tmp_path):
    b, _clock, _handles = _loaded(tmp_path / "c")
    lo, hi = b.store.log.min_offset, b.store.log.written
    marks = list(b.store.scan_flagged(lo, hi, record.FLAG_DELAYED, pause_every=16))
    found = [(o, r) for o, r in marks if r is not None]
    assert found == list(b.store.scan_flagged(lo, hi, record.FLAG_DELAYED))
    assert sum(1 for _o, r in marks if r is None) >= 20 * 16 // 16 - 1  # 320 plain records: ~20 pauses
    b.close()


def test_the_committers_roll_leaves_the_loop_free_between_slices(tmp_path):
    from chronoq.broker.committer import GroupCommitter

    b, _clock, _handles = _loaded(tmp_path / "d")
    pending = derived_digest(b)["timers"]

    async def main():
        committer = GroupCommitter(b)
        committer.start()
        ran = 0
        rolling = asyncio.ensure_future(committer.retention_roll(slice_s=0, pause_s=0))
        try:
            while not rolling.done():
                ran += 1
                await asyncio.sleep(0)
            plan, durable = rolling.result()
        finally:
            await committer.close()
        return ran, plan, durable

    ran, plan, durable = asyncio.run(main())
    assert durable and plan.kept == BUCKETS * PER_BUCKET
    assert ran > BUCKETS  # another task ran between the buckets' slices
    deleted, job = b.retention_apply(plan, durable)
    job.run_here()
    assert deleted and derived_digest(b)["timers"] == pending
    b.close()
