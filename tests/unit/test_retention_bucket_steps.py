"""Retention's roll of one schedule bucket in steps (``chronoq.timer.roll`` ``_bucket_batches``):
a bucket's roll records are written a chunk a step, and whatever happens to its messages between
two steps (a delivery, a recall, a reschedule) is never followed by a roll record of them; a
message whose recall is written but not yet absorbed (in flight) is not rolled at all. Each case
ends with the check that matters: a rebuild from the commit log alone holds exactly the live
timer's pending set, after retention deleted what it could."""

from __future__ import annotations

import shutil

from timerkit import T0, open_broker

from chronoq.broker.digest import derived_digest
from chronoq.broker.outgoing import OutgoingMessage
from chronoq.core.clock import FakeClock
from chronoq.store import record
from chronoq.timer import roll
from chronoq.timer.recall import RecallOutcome, RescheduleOutcome

TOPIC = "later"
PER_BUCKET = 1200  # ~5 chunks of ROLL_CHUNK, one parse pause
STEP_MS = 10       # due times 10 ms apart, the last sent the first due


def _one_bucket(path, n: int = PER_BUCKET, ahead_ms: int = 3_600_000):
    """A broker holding ``n`` pending timers in one bucket (due ``STEP_MS`` apart, the last sent
    due first), then segments of plain messages; retention may delete every sealed segment."""
    clock = FakeClock(T0)
    b = open_broker(path, clock, retention_max_bytes=1)
    base = (T0 + ahead_ms) // b.timer.width * b.timer.width
    handles = []
    for first in range(0, n, 100):
        results = b.send_batch([OutgoingMessage(TOPIC, b"far%d" % i, deliver_at_ms=base + (n - i) * STEP_MS)
                                for i in range(first, min(n, first + 100))])
        handles += [r.recall_handle for r in results]
    for _ in range(20):
        b.send_batch([OutgoingMessage("orders", bytes(1024)) for _ in range(16)])
    b.timer.checkpoint()
    b.checkpoint()
    return b, clock, handles, base


def _step(b, roll_):
    """One step with its deadline already passed (one batch); (records it wrote, the plan or None)."""
    before = roll_.kept
    plan = roll_.step(b.clock.monotonic_ns())
    return roll_.kept - before, plan


def _finish(b, roll_):
    while (plan := roll_.step(None)) is None:
        pass
    b.store.dispatch(b.store.sync())
    deleted, job = b.retention_apply(plan, True)
    if job is not None:
        job.run_here()
    return plan, deleted


def _rolled(b, since: int) -> list[int]:
    """The idents of the roll records in the log from ``since``, in log order."""
    out = []
    for _offset, raw in b.store.scan_flagged(since, b.store.log.written, record.FLAG_DELAYED):
        rolled = roll.unwrap(raw) if raw is not None else None
        if rolled is not None:
            out.append(rolled[0])
    return out


def _rebuilt_timers(b, path, tmp_path, now_ms: int):
    """Close ``b``; the pending timers of a copy of its directory rebuilt from the logs alone."""
    from tests.integration.test_rebuild_from_log import _delete_derived

    b.close()
    copy = str(tmp_path / "rebuilt")
    shutil.copytree(str(path), copy)
    _delete_derived(copy)
    again = open_broker(copy, FakeClock(now_ms), retention_max_bytes=1)
    try:
        return derived_digest(again)["timers"]
    finally:
        again.close()


def _idents(timers) -> set[int]:
    return {t.position for t in timers if t.lane == "timer"}


def test_a_buckets_roll_records_are_written_a_chunk_a_step(tmp_path):
    b, clock, _handles, _base = _one_bucket(tmp_path / "a")
    pending = derived_digest(b)["timers"]
    roll_ = b.retention_begin()
    per_step = []
    while True:
        wrote, plan = _step(b, roll_)
        per_step.append(wrote)
        if plan is not None:
            break
    assert plan.kept == PER_BUCKET
    assert max(per_step) == roll.ROLL_CHUNK  # never the whole bucket in one step
    assert len([w for w in per_step if w]) == -(-PER_BUCKET // roll.ROLL_CHUNK)
    assert not b.timer.roll_watch  # the bucket's watch ended with its roll
    b.store.dispatch(b.store.sync())
    deleted, job = b.retention_apply(plan, True)
    job.run_here()
    assert deleted and derived_digest(b)["timers"] == pending
    assert _rebuilt_timers(b, tmp_path / "a", tmp_path, clock.wall_ms()) == pending


def test_what_happens_between_two_steps_of_a_bucket_gets_no_roll_record_after_it(tmp_path):
    b, clock, handles, base = _one_bucket(tmp_path / "b", ahead_ms=600_000)
    began = b.store.log.written
    roll_ = b.retention_begin()
    while not roll_.kept:  # the scan, the bucket's read, its first chunk
        assert _step(b, roll_)[1] is None
    assert roll_.kept == roll.ROLL_CHUNK and b.timer.roll_watch  # the bucket's roll is half done
    # Between two steps, all in the bucket's last chunk (the last sent): a recall, a reschedule,
    # and deliveries (the last sent falls due first; copies are written a little ahead).
    assert b.recall(handles[-2]).outcome == RecallOutcome.CANCELLED
    assert b.reschedule(handles[-3], base + 7_200_000).outcome == RescheduleOutcome.RESCHEDULED
    clock.set(base + STEP_MS)
    for _ in range(50):
        b.timer_tick()
        clock.advance(1)
    delivered = [m for q in range(b.topic(TOPIC).queues) for m in b.read(TOPIC, q, 0, 100).messages]
    assert delivered and all(m.stored_ms >= m.deliver_at_ms for m in delivered)
    plan, deleted = _finish(b, roll_)
    assert deleted
    live = derived_digest(b)["timers"]
    rolled = _rolled(b, began)
    assert len(rolled) == len(set(rolled)) == plan.kept
    # Every message pending at the end was rolled (but the rescheduled one's new record, sent after
    # the range), and nothing else: not the recalled, moved or delivered ones.
    moved_to = {t.position for t in live if t.due_ms == base + 7_200_000}
    assert set(rolled) == _idents(live) - moved_to
    # (copies written ahead and durable, held until due, are delivered too: not rolled)
    assert len(rolled) <= PER_BUCKET - 2 - len(delivered)
    assert _rebuilt_timers(b, tmp_path / "b", tmp_path, clock.wall_ms()) == live


def test_a_message_whose_recall_is_in_flight_is_not_rolled_after_its_recall_record(tmp_path):
    """The recall's record is written (page cache), not yet absorbed (the server's committer
    fsyncs it on its thread meanwhile) when the roll reads the bucket: a roll record written then
    would follow the recall record in the log, and a later pass that deletes the recall record's
    segment but not the roll record's would bring the recalled message back in a rebuild."""
    path = tmp_path / "c"
    b, clock, handles, _base = _one_bucket(path, n=10)
    answer = b.timer_recall(handles[4])  # written, in flight
    assert answer.result.outcome == RecallOutcome.CANCELLED
    # A segment's worth of other records after it (written, like the recall, not yet durable):
    # the recall record's segment is sealed before any roll record is written.
    b.store.write(b.prepare_batch([OutgoingMessage("orders", bytes(1024)) for _ in range(70)])[0])
    began = b.store.log.written
    roll_ = b.retention_begin()
    plan, deleted = _finish(b, roll_)  # (the fsync, the dispatch: the recall is absorbed)
    assert deleted and plan.kept == 9
    assert b.timer_answered(answer).outcome == RecallOutcome.CANCELLED
    assert len(_rolled(b, began)) == 9
    live = derived_digest(b)["timers"]
    assert len(live) == 9
    # The next pass deletes every sealed segment, the recall record's too.
    b.timer.checkpoint()
    b.checkpoint()
    assert b.retention()
    assert b.store.log.min_offset >= answer.ticket  # the recall record is gone
    assert _rebuilt_timers(b, path, tmp_path, clock.wall_ms()) == live


def test_a_pass_given_up_midway_lets_go_of_the_buckets_watch(tmp_path):
    b, _clock, _handles, _base = _one_bucket(tmp_path / "d")
    pending = derived_digest(b)["timers"]
    roll_ = b.retention_begin()
    while not roll_.kept:
        _step(b, roll_)
    assert b.timer.roll_watch
    roll_.close()  # (the server's task cancelled: GroupCommitter.retention_roll)
    assert not b.timer.roll_watch
    # What was written stays (the same set facts), nothing was deleted, the next pass is whole.
    assert derived_digest(b)["timers"] == pending
    assert b.retention()
    assert derived_digest(b)["timers"] == pending
    b.close()
