"""Recall and reschedule through the committer (what the server does), on a fake clock.

The tombstone (or moved record) is written on the loop and answered only once the committer's
thread has fsynced it and its dispatch has applied it; meanwhile its target is *in flight*: no
tick claims it, even past its due time, and a second recall answers what the first will. These
tests hold the flusher thread's fsync at a gate to look inside that window, and check that no
fsync ran on the loop's thread.
"""

from __future__ import annotations

import asyncio
import errno
import threading

import pytest
from popkit import Node
from timerkit import T0, TOPIC, crash, drain, open_broker, visible

from chronoq.broker.committer import GroupCommitter
from chronoq.core import errors
from chronoq.core.clock import FakeClock
from chronoq.proto import chronoq_admin_pb2 as apb
from chronoq.protocol.rocketmq.status import Code
from chronoq.server import admin
from chronoq.timer.service import RecallOutcome, RescheduleOutcome

WAIT_STEPS = 2_000  # loop turns a test waits for the flusher thread at most (each sleeps 1 ms)


@pytest.fixture
def clock():
    return FakeClock(T0)


class GatedSync:
    """The committer's fsyncs held at a gate (its fsync thread's ``before_fsync`` fault hook, set by
    ``_run``), and every thread that fsynced the commit log recorded: the fsync thread's rounds
    and any direct ``store.sync`` (an fsync on the loop would show up there)."""

    def __init__(self, store):
        self.real = store.sync
        self.gate = threading.Event()
        self.threads: list[int] = []  # every fsync's thread, until the committer closes
        self.fail: OSError | None = None
        store.sync = self.direct

    def direct(self) -> int:
        self.threads.append(threading.get_ident())
        return self.real()

    def hook(self, _fd: int) -> None:
        self.threads.append(threading.get_ident())
        if not self.gate.wait(30):
            raise AssertionError("the test never opened the gate")
        if self.fail is not None:
            exc, self.fail = self.fail, None
            raise exc


async def _until(predicate) -> None:
    for _ in range(WAIT_STEPS):
        if predicate():
            return
        await asyncio.sleep(0.001)
    raise AssertionError("condition not reached")


def _run(b, body):
    """Run ``body(committer, sync)`` on a loop with a started committer whose fsyncs are gated."""
    sync = GatedSync(b.store)

    async def main():
        committer = GroupCommitter(b)
        committer.start()
        committer.fsyncer.before_fsync = sync.hook
        try:
            return await body(committer, sync)
        finally:
            sync.gate.set()
            sync.threads, counted = [], sync.threads  # (the close's own flush runs on the loop)
            await committer.close()
            sync.threads = counted

    return asyncio.run(main()), sync


def test_a_recall_is_answered_once_durable_and_its_message_is_never_claimed_meanwhile(tmp_path, clock):
    b = open_broker(tmp_path, clock, timer_prewrite_ms=0)
    handle = b.send(TOPIC, b"m", deliver_at_ms=T0 + 1_000).recall_handle
    b.timer_tick()  # (its bucket loads: the message is in the wheel)
    loop_thread = threading.get_ident()

    async def body(committer, sync):
        task = asyncio.ensure_future(committer.recall(handle))
        await _until(lambda: sync.threads)  # the tombstone is written; its fsync waits at the gate
        assert not task.done()
        clock.advance(2_000)  # due while the recall is in flight: no tick may deliver it
        for _ in range(3):
            b.timer_step()
        assert visible(b) == [] and not b.timer.timer_lane.pending
        sync.gate.set()
        return await task

    result, sync = _run(b, body)
    assert result.outcome is RecallOutcome.CANCELLED
    assert sync.threads and loop_thread not in sync.threads  # every fsync on the flusher thread
    assert not b.timer._in_flight  # applied by the dispatch before the answer
    drain(b)
    assert visible(b) == []
    crash(b)
    b = open_broker(tmp_path, clock, timer_prewrite_ms=0)
    drain(b)
    assert visible(b) == []  # durable: a restart keeps it cancelled
    b.close()


def test_a_second_recall_in_flight_waits_for_the_first_and_writes_nothing(tmp_path, clock):
    b = open_broker(tmp_path, clock)
    handle = b.send(TOPIC, b"m", deliver_at_ms=T0 + 60_000).recall_handle

    async def body(committer, sync):
        first = asyncio.ensure_future(committer.recall(handle))
        await _until(lambda: sync.threads)
        written = b.store.log.written
        second = asyncio.ensure_future(committer.recall(handle))
        moved = asyncio.ensure_future(committer.reschedule(handle, T0 + 90_000))
        await asyncio.sleep(0.01)
        assert b.store.log.written == written and not (first.done() or second.done() or moved.done())
        sync.gate.set()
        return await first, await second, await moved

    (first, second, moved), _sync = _run(b, body)
    assert first.outcome is second.outcome is RecallOutcome.CANCELLED
    assert moved.outcome is RescheduleOutcome.CANCELLED
    clock.advance(100_000)
    drain(b)
    assert visible(b) == []
    b.close()


def test_a_level_message_recalled_in_flight_holds_its_lane_until_applied(tmp_path, clock):
    b = open_broker(tmp_path, clock)
    gone = b.send(TOPIC, b"gone", delay_level=1).recall_handle  # level 1: 1 s
    b.send(TOPIC, b"kept", delay_level=1)

    async def body(committer, sync):
        task = asyncio.ensure_future(committer.recall(gone))
        await _until(lambda: sync.threads)
        clock.advance(1_500)
        b.timer_step()
        lane = b.timer.level_lanes[0]
        assert not lane.pending and lane.scan_offset == 0  # stopped at it: nothing claimed behind
        deadline = b.timer_next_deadline_ms()
        assert deadline is None or deadline > clock.wall_ms()  # no busy loop while it waits
        sync.gate.set()
        return await task

    result, _sync = _run(b, body)
    assert result.outcome is RecallOutcome.CANCELLED
    drain(b)
    assert [m.body for m in visible(b)] == [b"kept"]
    b.close()


def test_a_recall_whose_fsync_fails_is_an_error_and_its_message_waits_for_the_tombstone(tmp_path, clock):
    b = open_broker(tmp_path, clock, timer_prewrite_ms=0)
    handle = b.send(TOPIC, b"m", deliver_at_ms=T0 + 1_000).recall_handle

    async def body(committer, sync):
        sync.fail = OSError(errno.EIO, "fsync failed (injected)")
        task = asyncio.ensure_future(committer.recall(handle))
        await _until(lambda: sync.threads)
        sync.gate.set()
        with pytest.raises(errors.StorageError):
            await task
        clock.advance(2_000)
        b.timer_step()
        assert visible(b) == []  # the tombstone is in the log, not yet durable: not delivered
        await committer.barrier()  # a later fsync succeeds: the tombstone is applied
        return None

    _run(b, body)
    assert not b.timer._in_flight
    drain(b)
    assert visible(b) == []
    b.close()


def test_the_admin_recall_and_reschedule_never_fsync_on_the_loop(tmp_path):
    """The server's Admin Recall/Reschedule answer through the committer: before, they called the
    broker, which fsynced the tombstone on the loop's thread."""
    node = Node(str(tmp_path), flush_policy="sync").open()
    b = node.broker
    now = node.clock.wall_ms()
    later = b.send("orders", b"a", deliver_at_ms=now + 60_000).recall_handle
    soon = b.send("orders", b"b", deliver_at_ms=now + 30_000).recall_handle
    loop_thread = threading.get_ident()

    async def body(committer, sync):
        svc = admin.AdminService(b, node.pop, committer)
        sync.gate.set()
        r = await svc.Recall(apb.RecallRequest(recall_handle=later), None)
        m = await svc.Reschedule(apb.RescheduleRequest(recall_handle=soon, deliver_at_ms=now + 40_000), None)
        return r, m

    (r, m), sync = _run(b, body)
    assert (r.status.code, r.outcome) == (Code.OK, "cancelled")
    assert (m.status.code, m.outcome) == (Code.OK, "rescheduled")
    assert sync.threads and loop_thread not in sync.threads
    node.close()
