"""A finished bucket made again before its file is deleted (``chronoq.timer.schedfiles``).

Under the server the ``.done`` file of a finished bucket is fsynced on the committer's thread and
the bucket's file is deleted after that. A record written just before the bucket's end but made
durable (so absorbed) only after the tick that finished it lands in that bucket again. The old
file lacks the entries only buffered at the finish (a delivered message's DISPATCHED; a recalled
one's CANCELLED went to the ``.done``), so the new life must never append to it: a checkpoint
would then pass the records that made those entries and a ``kill -9`` would load the file as a
live bucket (delivering a message twice and a recalled one). Here the committer is played by
hand (``attach_files_syncer`` with a request that does nothing; ``sync_side``/``files_synced``
called when the scenario says), on real files and a fake clock, and the broker is killed after
each step.
"""

from __future__ import annotations

import os

import pytest

from chronoq.core import errors
from chronoq.core.clock import FakeClock
from chronoq.timer.recall import RecallOutcome
from tests.unit.timerkit import T0, TOPIC, crash, drain, open_broker, visible

MIN = 60_000
B = (T0 // MIN + 1) * MIN  # the bucket that finishes and is made again
STEPS = ["finished", "remade", "done_synced", "old_file_deleted", "delivered", "finished_again",
         "checkpointed"]


def _open(path, clock):
    b = open_broker(path, clock, flush_policy="async", timer_prewrite_ms=0)
    if b.topics.get(TOPIC) is None:
        b.create_topic(TOPIC, 1)
    return b


def _side_sync(b) -> None:
    """What the committer's thread does after a commit-log fsync (twice: a journal record written
    by the first ``files_synced`` gets its fsync in the second)."""
    for _ in range(2):
        b.timer.files.sync_side()
        b.timer.files_synced()


def _step_without_fsync(b) -> None:
    """The server's timer tick (``timer_step``): the commit log is not fsynced by it."""
    while (b.timer_next_deadline_ms() or 1 << 62) <= b.clock.wall_ms():
        if b.timer_step().ticket:
            return


def _scenario(b, clock, sent: dict):
    """Yields after each step of ``STEPS``; ``sent`` gets the send results of a (delivered), c
    (recalled) and x (made durable after the bucket finished)."""
    file = b.timer.files.path(B)
    a = b.send(TOPIC, b"a", deliver_at_ms=B + 10_000)
    c = b.send(TOPIC, b"c", deliver_at_ms=B + 20_000)
    sent.update(a=a, c=c)
    b.flush()
    b.timer.checkpoint()  # a's and c's MESSAGE entries in the bucket's file
    assert b.recall(c.recall_handle).outcome is RecallOutcome.CANCELLED
    clock.set(B + 10_000)
    drain(b)  # a delivered: its DISPATCHED only buffered
    clock.set(B + MIN - 2)
    sent["x"] = b.send(TOPIC, b"x", deliver_at_ms=B + MIN - 1)  # written, not fsynced yet
    clock.set(B + MIN)
    _step_without_fsync(b)  # the bucket is finished before x's record is durable
    assert B not in b.timer.buckets and b.timer.files.awaits_deletion(B) and os.path.exists(file)
    size = os.path.getsize(file)
    yield "finished"
    b.store.sync()  # the committer's fsync: x is absorbed into the finished bucket
    b.timer.absorb_dispatched()
    assert B in b.timer.buckets
    yield "remade"
    _side_sync(b)
    assert os.path.getsize(file) == size, "the old file was appended to"
    yield "done_synced"
    _step_without_fsync(b)  # deletes the old file; claims x (its copy not durable yet)
    assert not os.path.exists(file)
    yield "old_file_deleted"
    b.flush()  # the committer's fsync of x's copy, then its completion
    b.timer_synced(b.store.log.synced)
    assert sorted(m.body for m in visible(b)) == [b"a", b"x"]
    yield "delivered"
    clock.advance(1)
    drain(b)
    assert B not in b.timer.buckets
    yield "finished_again"
    _side_sync(b)
    b.timer.checkpoint()
    yield "checkpointed"


@pytest.mark.parametrize("kill_after", STEPS)
def test_a_bucket_made_again_never_appends_to_its_old_file_and_survives_a_kill_9_at_each_step(tmp_path, kill_after):
    clock = FakeClock(T0)
    b = _open(tmp_path, clock)
    b.timer.attach_files_syncer(lambda: None)  # the committer's thread, played by _side_sync
    sent: dict = {}
    for step in _scenario(b, clock, sent):
        if step == kill_after:
            break
    b.timer.checkpoint()  # a checkpoint here must never claim what the old file lacks
    crash(b)
    b = _open(tmp_path, clock)
    clock.advance(2 * MIN)
    drain(b)
    got = sorted(m.body for m in visible(b))
    assert got == [b"a", b"x"], got  # nothing twice, the recalled c never, x not lost
    assert b.recall(sent["c"].recall_handle).outcome is RecallOutcome.CANCELLED  # (the .done kept it)
    b.close()


def test_the_scenario_runs_to_its_end_without_a_kill(tmp_path):
    clock = FakeClock(T0)
    b = _open(tmp_path, clock)
    b.timer.attach_files_syncer(lambda: None)
    assert list(_scenario(b, clock, {})) == STEPS  # (every step's assertions held)
    b.close()
    b = _open(tmp_path, clock)
    assert sorted(m.body for m in visible(b)) == [b"a", b"x"]
    b.close()


def test_while_the_old_file_cannot_be_deleted_the_new_entries_stay_off_it(tmp_path, monkeypatch):
    clock = FakeClock(T0)
    b = _open(tmp_path, clock)
    b.timer.attach_files_syncer(lambda: None)
    run = _scenario(b, clock, {})
    while next(run) != "remade":
        pass
    file = b.timer.files.path(B)
    size = os.path.getsize(file)
    unlink = os.unlink

    def failing_unlink(path, *args, **kwargs):
        if os.fspath(path) == file:
            raise OSError(5, "injected EIO")
        return unlink(path, *args, **kwargs)

    monkeypatch.setattr(os, "unlink", failing_unlink)
    _side_sync(b)
    _step_without_fsync(b)  # the deletion fails (logged): kept for the next try
    assert os.path.getsize(file) == size and b.timer.files.awaits_deletion(B)
    with pytest.raises(errors.StorageError):
        b.timer.checkpoint()  # would otherwise claim what the old file lacks
    assert os.path.getsize(file) == size
    monkeypatch.setattr(os, "unlink", unlink)
    b.timer.checkpoint()
    assert not b.timer.files.awaits_deletion(B)
    crash(b)
    b = _open(tmp_path, clock)
    clock.advance(2 * MIN)
    drain(b)
    assert sorted(m.body for m in visible(b)) == [b"a", b"x"]
    b.close()
