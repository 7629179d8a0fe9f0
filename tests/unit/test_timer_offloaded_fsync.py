"""The timer and checkpoints with their fsyncs off the broker's thread (what the server runtime does).

A tick writes due copies without fsyncing them and returns a *ticket* (``Tick.ticket``): the
commit-log position the committer must make durable and dispatch, on its thread, then hand to
``synced``; here ``Broker.flush`` plays the committer. Checkpoints
are ``chronoq.core.jobs.Job``s: begun here, run elsewhere, finished here. These tests play the worker
thread's part by hand, in the orders that matter: nothing is visible or counted delivered before
its fsync, a failed fsync backs off and never writes a copy twice, a crash in between delivers
each message once, and bucket files are left alone while a timer checkpoint syncs them.
"""

from __future__ import annotations

import json

import pytest
from timerkit import T0, TOPIC, crash, drain, open_broker, visible

from chronoq.core import errors
from chronoq.core.clock import FakeClock
from chronoq.core.jobs import Job, run_all_here


@pytest.fixture
def clock():
    return FakeClock(T0)


def test_copies_become_visible_and_complete_only_after_the_callers_fsync(tmp_path, clock):
    b = open_broker(tmp_path, clock)
    for i in range(5):
        b.send(TOPIC, f"m{i}".encode(), deliver_at_ms=T0 + 1_000 + i)
    clock.advance(1_010)
    synced_before = b.store.log.synced
    tick = b.timer_step()
    lane = b.timer.timer_lane
    assert b.store.log.written > synced_before == b.store.log.synced  # written, not fsynced here
    assert visible(b) == [] and lane.delivered == 0 and b.timer.histogram.count == 0
    assert tick.ticket == b.store.log.written and b.timer.durability_wanted()
    done = b.timer_synced(b.flush())  # the committer's fsync and dispatch, handed back
    assert done == 5 and lane.delivered == 5 and not b.timer.durability_wanted()
    got = visible(b)
    assert sorted(m.body for m in got) == [f"m{i}".encode() for i in range(5)]
    assert all(m.stored_ms >= m.deliver_at_ms for m in got)  # never early
    assert b.timer.histogram.early == 0 and b.timer.histogram.count == 5
    b.close()


def test_a_failed_fsync_backs_off_then_completes_without_writing_a_copy_twice(tmp_path, clock):
    b = open_broker(tmp_path, clock, timer_retry_backoff_ms=100, timer_block_after_failures=3)
    for i in range(3):
        b.send(TOPIC, f"m{i}".encode(), deliver_at_ms=T0 + 1_000 + i)
    clock.advance(1_005)
    b.timer_step()
    written = b.store.log.written
    b.timer_sync_failed(errors.StorageError("fsync failed (injected)"))
    lane = b.timer.timer_lane
    assert lane.failures == 1 and lane.retry_at_ms == clock.wall_ms() + 100
    assert not b.timer.durability_wanted()  # backing off: no busy loop
    b.timer_step()
    assert b.store.log.written == written  # nothing written again
    clock.advance(100)
    assert b.timer.durability_wanted()
    assert b.timer_synced(b.flush()) == 3
    assert lane.failures == 0 and not lane.blocked
    assert sorted(m.body for m in visible(b)) == [b"m0", b"m1", b"m2"]
    b.close()


def test_a_crash_between_the_write_and_the_fsync_delivers_each_message_once(tmp_path, clock):
    b = open_broker(tmp_path, clock, timer_checkpoint_interval_ms=1_000)
    for i in range(50):
        b.send(TOPIC, f"m{i}".encode(), deliver_at_ms=T0 + 2_000 + i)
    clock.advance(1_000)
    b.maintenance()  # a timer checkpoint before the copies exist
    clock.advance(1_100)
    b.timer_step()  # copies in the page cache, never completed
    crash(b)
    b = open_broker(tmp_path, clock, timer_checkpoint_interval_ms=1_000)
    drain(b)
    bodies = [m.body for m in visible(b)]
    assert sorted(bodies) == sorted(f"m{i}".encode() for i in range(50))  # each exactly once
    b.close()


def test_bucket_files_are_not_touched_while_a_timer_checkpoint_job_runs(tmp_path, clock):
    b = open_broker(tmp_path, clock, timer_checkpoint_interval_ms=1_000)
    for i in range(20):
        b.send(TOPIC, f"a{i}".encode(), deliver_at_ms=T0 + 90_000 + i)
    clock.advance(1_500)
    jobs = b.maintenance_jobs()
    timer_jobs = [j for j in jobs if j.name == "timer checkpoint"]
    assert len(timer_jobs) == 1
    sizes = {p.name: p.stat().st_size for p in (tmp_path / "timer" / "schedule").iterdir()}
    # Meanwhile the broker goes on: more timers arrive and ticks run, but only buffers grow.
    for i in range(20):
        b.send(TOPIC, f"b{i}".encode(), deliver_at_ms=T0 + 90_000 + 100 + i)
    b.timer_step()
    assert {p.name: p.stat().st_size for p in (tmp_path / "timer" / "schedule").iterdir()} == sizes
    cursor_before = b.timer.cursor
    run_all_here(jobs)  # the worker thread, then finish back here
    assert b.timer.cursor > cursor_before
    checkpoint = json.loads((tmp_path / "timer" / "checkpoint.json").read_text().split("\n", 1)[1])
    assert checkpoint["cursor"] == b.timer.cursor
    b.timer_step()  # writes resume after the job finished
    clock.advance(90_000)
    drain(b)
    assert len(visible(b)) == 40
    b.close()


def test_a_failed_store_checkpoint_job_marks_its_queue_files_dirty_again(tmp_path, clock):
    b = open_broker(tmp_path, clock)
    b.send(TOPIC, b"x")
    job = b.store.checkpoint_job()
    dirty = {key: set(cq._dirty) for key, cq in b.store.queues.items()}
    assert not any(dirty.values())  # taken by the job
    job.finish(errors.StorageError("fsync failed (injected)"))
    assert any(cq._dirty for cq in b.store.queues.values())  # synced by the next checkpoint
    b.close()


def test_a_job_finishes_once_and_run_here_reraises_after_finishing():
    calls = []

    def boom() -> None:
        raise errors.StorageError("boom")

    job = Job("j", boom, lambda exc: calls.append(type(exc).__name__))
    with pytest.raises(errors.StorageError):
        job.run_here()
    assert calls == ["StorageError"] and job.finished
    with pytest.raises(AssertionError):
        job.finish(None)
    ok = Job("ok", lambda: None, lambda exc: calls.append(exc))
    with pytest.raises(errors.StorageError):  # the others still run and finish
        run_all_here([Job("bad", boom, lambda exc: calls.append("bad")), ok])
    assert calls[-2:] == ["bad", None]


def test_copies_falling_due_while_an_fsync_runs_are_written_at_once_and_join_the_next(tmp_path, clock):
    """The runtime ticks on while its fsync thread runs: a later copy is written by the tick that
    finds it due (its store time is that tick's), not after the fsync, and only the fsync that
    covers it makes it visible."""
    b = open_broker(tmp_path, clock, timer_prewrite_ms=0)  # copies written at their due time
    for i in range(4):
        b.send(TOPIC, f"m{i}".encode(), deliver_at_ms=T0 + 1_000 + 10 * i)
    clock.advance(1_000)
    b.timer_step()  # m0 written
    in_flight = b.store.sync()  # the committer's fsync, not handed back yet
    clock.advance(30)
    b.timer_step()  # m1..m3 fell due meanwhile
    assert b.store.log.written > in_flight  # written without waiting for that fsync
    assert visible(b) == [] and b.timer.timer_lane.delivered == 0
    b.store.dispatch(in_flight)  # the committer dispatches what that fsync covered
    assert b.timer_synced(in_flight) == 1  # the fsync that ran covers m0 only
    assert [m.body for m in visible(b)] == [b"m0"]
    assert b.timer.durability_wanted()
    assert b.timer_synced(b.flush()) == 3
    stored = {m.body: m.stored_ms for m in visible(b)}
    assert stored == {b"m0": T0 + 1_000, b"m1": T0 + 1_030, b"m2": T0 + 1_030, b"m3": T0 + 1_030}
    assert b.timer.histogram.early == 0
    b.close()


def test_a_full_lane_offers_no_deadline_until_its_fsync_frees_room(tmp_path, clock):
    """Flow control without a busy loop: while the lane is full nothing more can be claimed, so
    the due time of the next message is not a deadline (the runtime ticks after each fsync)."""
    b = open_broker(tmp_path, clock, timer_pending_max=3)
    for i in range(5):
        b.send(TOPIC, f"m{i}".encode(), deliver_at_ms=T0 + 1_000 + i)
    clock.advance(1_100)
    b.timer_step()
    lane = b.timer.timer_lane
    assert len(lane.pending) == 3 and lane.room(clock.wall_ms()) == 0
    deadline = b.timer_next_deadline_ms()
    assert deadline is None or deadline > clock.wall_ms()
    assert b.timer_synced(b.flush()) == 3
    assert b.timer_next_deadline_ms() <= clock.wall_ms()  # room again: the rest is due now
    b.timer_step()
    assert b.timer_synced(b.flush()) == 2
    assert sorted(m.body for m in visible(b)) == [f"m{i}".encode() for i in range(5)]
    b.close()


def test_copies_made_durable_by_another_fsync_are_completed_at_the_next_tick(tmp_path, clock):
    """The send path's group commit may fsync and dispatch the timer's copies first: nothing is
    left for the timer's own fsync, but the timer still ticks at once to complete them."""
    b = open_broker(tmp_path, clock)
    for i in range(3):
        b.send(TOPIC, f"m{i}".encode(), deliver_at_ms=T0 + 1_000 + i)
    clock.advance(1_100)
    b.timer_step()
    b.store.dispatch(b.store.sync())  # what the committer does for the sends around it
    assert not b.timer.durability_wanted()
    assert b.timer_next_deadline_ms() <= clock.wall_ms()
    assert b.timer_step().visible == 3 and b.timer.timer_lane.delivered == 3
    deadline = b.timer_next_deadline_ms()
    assert deadline is None or deadline > clock.wall_ms()
    b.close()


def test_records_waiting_for_the_callers_fsync_are_not_a_deadline(tmp_path, clock):
    """Async flush policy: delayed records are dispatched before they are fsynced and are
    absorbed only once durable. Once a tick has asked for their fsync (its ticket), that wait is
    the committer's work, not a reason to tick again at once (no busy loop meanwhile); before,
    it is (a tick must ask: nothing else would absorb them under this policy)."""
    b = open_broker(tmp_path, clock, flush_policy="async", timer_prewrite_ms=0)
    b.send(TOPIC, b"m", deliver_at_ms=T0 + 5_000)
    assert b.timer_next_deadline_ms() <= clock.wall_ms()  # not asked yet
    tick = b.timer_step()
    assert tick.ticket and b.timer.durability_wanted()
    deadline = b.timer_next_deadline_ms()
    assert deadline is None or deadline > clock.wall_ms()
    assert tick.deadline_ms is None or tick.deadline_ms > clock.wall_ms()
    b.timer_synced(b.flush())
    assert b.timer_next_deadline_ms() == T0 + 5_000 and not b.timer.durability_wanted()
    clock.advance(5_000)
    b.timer_step()
    assert b.timer_synced(b.flush()) == 1
    assert [m.body for m in visible(b)] == [b"m"]
    b.close()


def test_a_tick_never_fsyncs_and_returns_its_effects(tmp_path, clock, monkeypatch):
    """The one tick: what it wrote or needs absorbed comes back as a ticket, with its next
    deadline; the fsync is always the committer's (here ``flush``), never the tick's own."""
    b = open_broker(tmp_path, clock, flush_policy="async", timer_prewrite_ms=0)
    b.send(TOPIC, b"m", deliver_at_ms=T0 + 1_000)
    real_sync = b.store.sync

    def no_fsync() -> int:
        raise AssertionError("a tick fsynced")

    monkeypatch.setattr(b.store, "sync", no_fsync)
    tick = b.timer_step()  # the record waits to be absorbed: it needs an fsync first
    assert tick.visible == 0 and tick.ticket == b.store.log.written
    assert tick.deadline_ms is None or tick.deadline_ms > clock.wall_ms()  # asked: no busy loop
    monkeypatch.setattr(b.store, "sync", real_sync)
    b.timer_synced(b.flush())
    assert b.timer_next_deadline_ms() == T0 + 1_000
    clock.advance(1_000)
    monkeypatch.setattr(b.store, "sync", no_fsync)
    tick = b.timer_step()  # the copy is written, not fsynced
    assert (tick.visible, tick.ticket) == (0, b.store.log.written) and visible(b) == []
    monkeypatch.setattr(b.store, "sync", real_sync)
    assert b.timer_synced(b.flush()) == 1 and [m.body for m in visible(b)] == [b"m"]
    assert b.timer_step().ticket == 0  # nothing more to make durable
    b.close()
