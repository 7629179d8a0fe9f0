"""A replica's dispatch in process, without the network: the shipped records go into the consume
queues and the replica's timer (``TimerService.follow`` with ``Store.dispatch_shipped``) in one
walk, and leave the replica's queues and pending timers what the primary's are."""

from __future__ import annotations

import pytest

from chronoq.core.clock import FakeClock
from chronoq.core.config import BrokerConfig
from chronoq.store import record
from chronoq.store.digest import queue_digest
from chronoq.timer.digest import pending_timers
from chronoq.timer.options import TimerOptions
from chronoq.timer.service import TimerService

from storekit import fill, open_store
from tests.unit.timerkit import T0, TOPIC, drain, open_broker

LEVELS = "1s 5s 1m"


def ship(primary, replica, timer, max_bytes: int) -> int:
    """What ``Follower.write`` then ``Follower.dispatch`` do, pull after pull; the pulls made."""
    pulls = 0
    while True:
        at = max(replica.log.synced, primary.log.min_offset)
        base, data = primary.read_shipped(at, max_bytes)
        if not data:
            return pulls
        replica.append_shipped(at, base, data)
        replica.sync()
        timer.follow(replica.dispatch_shipped)
        assert timer.replayed == replica.dispatched == replica.log.synced  # the timer walked with the store
        pulls += 1


def load(broker, clock) -> None:
    """Plain, delayed and level messages; some fired (delivered copies), a recall, a reschedule."""
    for i in range(40):
        broker.send(TOPIC, f"plain-{i}".encode(), queue_id=i % 2)
        broker.send(TOPIC, f"now-{i}".encode(), deliver_at_ms=T0, queue_id=i % 2)  # visible at once
    timers = [broker.send(TOPIC, f"t-{i}".encode(), deliver_at_ms=T0 + 500 * (i + 1)) for i in range(30)]
    for i in range(12):
        broker.send(TOPIC, f"L-{i}".encode(), delay_level=1 + i % 3)
    broker.recall(timers[20].recall_handle)
    broker.reschedule(timers[21].recall_handle, T0 + 90_000)
    clock.advance(4_000)  # the first timers and level 1 due: copies with their references
    drain(broker)


def loaded_pair(tmp_path):
    """A primary broker after ``load``; an empty replica store and its timer, following."""
    clock = FakeClock(T0)
    primary = open_broker(tmp_path / "p", clock, timer_delay_levels=LEVELS)
    primary.create_topic(TOPIC, 2)
    load(primary, clock)
    replica = open_store(tmp_path / "r", clock=clock)
    cfg = BrokerConfig(data_dir=str(tmp_path / "r"), timer_delay_levels=LEVELS)
    return primary, replica, TimerService(replica, TimerOptions.from_config(cfg), clock, cfg.data_dir, following=True)


@pytest.mark.parametrize("max_bytes", [1 << 20, 700])
def test_a_followed_replica_has_the_primary_queues_and_pending_timers(tmp_path, max_bytes):
    primary, replica, timer = loaded_pair(tmp_path)
    try:
        assert ship(primary.store, replica, timer, max_bytes) > (1 if max_bytes < 1000 else 0)
        assert replica.dispatched == replica.log.synced == primary.store.log.synced
        assert timer.replayed == replica.dispatched and timer.followed > 0
        assert queue_digest(replica) == queue_digest(primary.store)
        assert pending_timers(timer) == pending_timers(primary.timer)
        assert [lane.offset for lane in timer.level_lanes] == [lane.offset for lane in primary.timer.level_lanes]
    finally:
        timer.close()
        replica.close()
        primary.close()


@pytest.mark.parametrize("max_bytes", [1 << 30, 300])
def test_each_shipped_record_is_parsed_once(tmp_path, monkeypatch, max_bytes):
    """The queues and the timer share the store's walk (``tap``): a header object only for each
    record the timer follows (delayed, or with a delivery time), once, and none for the others
    (chronoq.store.routing reads their fields in its walk), not another for the timer's own scan
    of the same bytes."""
    primary, replica, timer = loaded_pair(tmp_path)
    parsed = []

    class Counted(record.RecordHeader):
        __slots__ = ()

        def __init__(self, buf, pos):
            super().__init__(buf, pos)
            parsed.append(pos)

    try:
        monkeypatch.setattr(record, "RecordHeader", Counted)
        records, followed = 0, []
        base, data = primary.store.read_shipped(0, 1 << 30)
        pos = 0
        while pos < len(data):
            fields = record.decode(data, pos)
            if fields["flags"] & record.FLAG_DELAYED or fields["deliver_at_ms"]:
                followed.append(pos)
            pos += record.check(data, pos, len(data))
            records += 1
        pulls = ship(primary.store, replica, timer, max_bytes)
        assert pulls == 1 if max_bytes > len(data) else pulls > 10, pulls
        timer.follow()  # (as Follower.dispatch does after: nothing is left to walk)
        assert records > 100 and 0 < len(followed) < records
        assert len(parsed) == len(followed), (len(parsed), len(followed))
    finally:
        timer.close()
        replica.close()
        primary.close()


def test_shipped_records_are_checked_once_as_they_are_written(tmp_path, monkeypatch):
    """``append_shipped`` checks each record before writing it; the dispatch of those records
    (several appends, one after another) steps over them by length instead of checking them
    again."""
    primary = open_store(tmp_path / "p")
    fill(primary, 300, batch=9)
    replica = open_store(tmp_path / "r")
    checked = []  # bytes checked: the span of each walk over records
    real_check_all = record.check_all

    def counted(buf, pos, end):
        stop = real_check_all(buf, pos, end)
        checked.append(stop - pos)
        return stop

    try:
        monkeypatch.setattr(record, "check_all", counted)
        pulls = 0
        while True:
            at = replica.log.written
            base, data = primary.read_shipped(at, 50_000)
            if not data:
                break
            replica.append_shipped(at, base, data)
            pulls += 1
        replica.sync()
        shipped = sum(checked)
        assert pulls > 2 and shipped == replica.log.written - replica.log.min_offset  # every byte, once
        replica.dispatch_shipped()
        assert sum(checked) == shipped  # none checked twice
        assert queue_digest(replica) == queue_digest(primary)
    finally:
        replica.close()
        primary.close()


class InProcess:
    """The transport to a primary, replaced by its store in this process (the follower's loop is
    what is tested): each pull is answered with what the primary holds past the pull's position."""

    from chronoq.proto import chronoq_admin_pb2 as apb

    endpoint = "in-process"

    def __init__(self, primary, max_bytes: int) -> None:
        self.primary, self.max_bytes = primary, max_bytes
        self.follower = None
        self.positions: list[int] = []  # each pull's reported position

    async def pull(self, req, _timeout_s):
        import asyncio

        self.positions.append(req.position.commit)
        at = max(req.position.commit, self.primary.log.min_offset)
        base, data = self.primary.read_shipped(at, self.max_bytes)
        if not data:  # caught up: the test is over
            await self.follower.stop()
            await asyncio.sleep(1)  # (cancelled by stop)
        from chronoq.protocol.rocketmq import status as codes

        return self.apb.PullResponse(status=self.apb.Status(code=codes.OK), segment_base=base, commit_offset=at,
                                     commit_bytes=data, primary_synced=self.primary.log.synced)


def following(tmp_path, max_bytes: int = 4000):
    from chronoq.replication.follower import Follower

    primary = open_store(tmp_path / "p")
    fill(primary, 300, batch=9)
    replica = open_store(tmp_path / "r")
    client = InProcess(primary, max_bytes)
    client.follower = Follower(replica, str(tmp_path / "r"), client, "replica-1", "127.0.0.1:1", FakeClock())
    return primary, replica, client


def test_the_follow_loop_writes_then_dispatches_each_answer_in_order(tmp_path):
    """One worker job an answer (write, then dispatch): every pull reports the durable end of the
    answers before it, and the replica ends with the primary's queues."""
    import asyncio

    primary, replica, client = following(tmp_path)
    try:
        asyncio.run(client.follower.run())
        assert replica.log.synced == replica.dispatched == primary.log.synced
        assert len(client.positions) > 10
        assert client.positions == sorted(client.positions) and client.positions[-1] == primary.log.synced
        assert queue_digest(replica) == queue_digest(primary)
    finally:
        replica.close()
        primary.close()


def test_a_failed_dispatch_stops_the_follow_loop_before_the_next_write(tmp_path, monkeypatch):
    import asyncio

    primary, replica, client = following(tmp_path)
    calls = []
    real = replica.dispatch_shipped

    def failing(*args):
        calls.append(replica.log.synced)
        if len(calls) == 3:
            raise OSError(28, "No space left on device")
        return real(*args)

    monkeypatch.setattr(replica, "dispatch_shipped", failing)
    try:
        with pytest.raises(OSError, match="No space left"):
            asyncio.run(client.follower.run())
        # The answer after the failed dispatch was not written (its write would have moved the end).
        assert replica.log.written == replica.log.synced == calls[2] < primary.log.synced
        assert replica.dispatched < replica.log.synced
    finally:
        replica.close()
        primary.close()
