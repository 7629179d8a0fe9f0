"""Nearly-full disk: new sends are refused below the reserve, everything else goes on; a failed
consume-queue write is retried, never dropped.

The file system is faked through ``DiskSpace``'s ``statvfs`` hook; the real thing (a tmpfs the
test mounts) is in ``tests/integration/test_disk_full.py``.
"""

from __future__ import annotations

import errno
import os
from types import SimpleNamespace

import pytest
from storekit import body_for, fill, open_store, prep, read_all

from chronoq.core import errors
from chronoq.broker.broker import Broker
from chronoq.core.clock import FakeClock
from chronoq.core.config import BrokerConfig
from chronoq.pop.service import PopService
from chronoq.store import consumequeue
from chronoq.store.diskspace import DiskSpace

MIB = 1 << 20


class FakeFs:
    def __init__(self, free: int) -> None:
        self.free = free
        self.looks = 0
        self.broken = False

    def statvfs(self, path: str):
        self.looks += 1
        if self.broken:
            raise OSError(errno.EIO, "statvfs failed")
        return SimpleNamespace(f_bavail=self.free // 4096, f_frsize=4096)


def test_the_reserve_is_checked_at_most_every_interval():
    clock, fs = FakeClock(), FakeFs(free=100 * MIB)
    disk = DiskSpace("/data", 10 * MIB, 500, clock, statvfs=fs.statvfs)
    for _ in range(100):
        disk.check()
    assert fs.looks == 1
    fs.free = 5 * MIB
    disk.check()  # still the old answer: the interval has not passed
    clock.advance(500)
    with pytest.raises(errors.DiskFull) as info:
        disk.check()
    assert "below the reserve of 10.0 MiB" in info.value.message and "receives and acks go on" in info.value.message
    fs.free = 50 * MIB
    clock.advance(499)
    with pytest.raises(errors.DiskFull):
        disk.check()
    clock.advance(1)
    disk.check()  # space came back: accepted again, by itself
    assert fs.looks == 3


def test_reserve_zero_never_looks_and_a_failing_statvfs_does_not_block():
    clock, fs = FakeClock(), FakeFs(free=0)
    DiskSpace("/data", 0, 500, clock, statvfs=fs.statvfs).check()
    assert fs.looks == 0
    fs.broken = True
    DiskSpace("/data", MIB, 500, clock, statvfs=fs.statvfs).check()


def test_sends_are_refused_while_receives_acks_and_system_writes_go_on(tmp_path):
    clock, fs = FakeClock(), FakeFs(free=100 * MIB)
    cfg = BrokerConfig(data_dir=str(tmp_path), disk_reserve_bytes=10 * MIB, disk_check_interval_ms=100,
                       segment_bytes=1 << 20)
    broker = Broker(cfg, clock=clock)
    broker.disk._statvfs = fs.statvfs
    pop = PopService(broker, clock)
    try:
        sent = [broker.send("orders", b"body-%d" % i).message_id for i in range(6)]
        fs.free = 1 * MIB
        clock.advance(100)
        with pytest.raises(errors.DiskFull, match="new messages are refused"):
            broker.send("orders", b"refused")
        with pytest.raises(errors.DiskFull):
            broker.send_batch([])
        got = pop.receive("billing", "orders", max_messages=32, invisible_ms=60_000)
        assert sorted(p.message.message_id for p in got) == sorted(sent)
        for p in got[:5]:
            pop.ack("billing", "orders", p.receipt_handle)
        pop.forward_to_dlq("billing", "orders", got[5].receipt_handle)  # a system write: allowed
        broker.checkpoint()
        fs.free = 50 * MIB
        clock.advance(100)
        broker.send("orders", b"accepted again")
        got = pop.receive("billing", "orders", max_messages=32, invisible_ms=60_000)
        assert [p.message.body for p in got] == [b"accepted again"]
    finally:
        pop.close()
        broker.close()


def test_a_failed_consume_queue_write_is_retried_not_dropped(tmp_path, monkeypatch):
    store = open_store(tmp_path, segment_bytes=64 * 1024)
    sent = fill(store, 20, seed=7)
    batch = [prep("a", 0, body_for(f"D{i}", 100), f"D{i}") for i in range(3)]
    store.write(batch)
    synced = store.sync()

    real_put = consumequeue.ConsumeQueue.put

    def enospc(*_args, **_kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(consumequeue.ConsumeQueue, "put", enospc)
    before = store.dispatched
    with pytest.raises(OSError):
        store.dispatch(synced)
    assert store.dispatched == before  # not claimed as visible
    monkeypatch.setattr(consumequeue.ConsumeQueue, "put", real_put)
    assert store.dispatch(synced) == synced
    got = read_all(store)
    assert len(got) == len(sent) + 3
    assert sorted(v[0] for v in got.values() if v[0].startswith("D")) == ["D0", "D1", "D2"]
    store.close()


def test_the_flusher_survives_a_failed_dispatch_and_makes_the_send_visible_later(tmp_path, monkeypatch):
    import asyncio

    from chronoq.broker import committer as committer_mod
    from chronoq.broker.committer import GroupCommitter
    from chronoq.broker.broker import OutgoingMessage

    monkeypatch.setattr(committer_mod, "DISPATCH_RETRY_S", 0.01)

    async def scenario():
        broker = Broker(BrokerConfig(data_dir=str(tmp_path), segment_bytes=1 << 20))
        committer = GroupCommitter(broker)
        committer.start()
        real_dispatch = broker.store.dispatch
        failures = []

        def flaky_dispatch(upto=None, wait_files=False):
            if len(failures) < 3:
                failures.append(upto)
                raise errors.DiskFull("consume queue: no space")
            return real_dispatch(upto, wait_files)

        broker.store.dispatch = flaky_dispatch
        try:
            # Durable, so acknowledged, although not yet visible.
            (result,) = await asyncio.wait_for(committer.send([OutgoingMessage("orders", b"x")]), 5)
            for _ in range(200):
                if broker.store.dispatched >= broker.store.log.synced and len(failures) == 3:
                    break
                await asyncio.sleep(0.01)
            assert len(failures) == 3
            assert broker.read("orders", result.queue_id, result.queue_offset).messages[0].body == b"x"
            (again,) = await asyncio.wait_for(committer.send([OutgoingMessage("orders", b"y")]), 5)
            assert again.queue_offset >= 0  # the flusher still runs
        finally:
            broker.store.dispatch = real_dispatch
            await committer.close()
            broker.close()

    asyncio.run(scenario())
