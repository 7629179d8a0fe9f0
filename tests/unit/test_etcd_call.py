"""``EtcdCoordinator.call``: the broker's loop awaiting a coroutine on the coordinator's own loop
(chronoq/replication/etcd.py). A call cut off on that loop (the keep-alive closed the gRPC channel
under it) must reach the caller as an error, never as a cancellation of the caller's task: a
replica's leader watch caught ``Exception`` only and ended as if stopped, and the console's
cluster page dropped its connection unanswered (CI, session 16)."""

from __future__ import annotations

import asyncio
import threading

import pytest

from chronoq.core.clock import FakeClock
from chronoq.replication.etcd import EtcdCoordinator


@pytest.fixture

def coord():
    c = EtcdCoordinator(["127.0.0.1:1"], "c", "g", 2000, "n", "id", FakeClock())
    loop = asyncio.new_event_loop()

    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    c._loop = loop  # the thread ``start`` makes, without connecting to an etcd
    yield c
    loop.call_soon_threadsafe(loop.stop)
    thread.join(5)
    loop.close()


async def _cut_off():
    never = asyncio.get_running_loop().create_future()
    asyncio.get_running_loop().call_later(0.01, never.cancel)  # as grpc.aio does when its channel closes
    await never


async def _answer(value, pause=0.0):
    await asyncio.sleep(pause)
    return value


def test_a_call_cut_off_on_the_coordinators_loop_is_a_connection_error(coord):
    async def main():
        assert await coord.call(_answer(7)) == 7
        with pytest.raises(ConnectionError, match="cut off"):
            await coord.call(_cut_off())
        return "the caller's task goes on"

    assert asyncio.run(main()) == "the caller's task goes on"


def test_a_caller_cancelled_or_timed_out_still_sees_its_own_cancellation(coord):
    async def main():
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(coord.call(_answer(1, pause=5)), 0.05)
        task = asyncio.ensure_future(coord.call(_answer(1, pause=5)))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
