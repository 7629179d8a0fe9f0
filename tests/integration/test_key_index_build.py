"""The server's runtime builds the timer's key index in slices of its own (chronoq.server.runtime
``_build_key_index``), not in the maintenance tick: after a restart the first keyed call begins
the build and the runtime's task finishes it, while keyed calls answer meanwhile."""

from __future__ import annotations

import asyncio
import logging

from chronoq.broker.broker import Broker
from chronoq.core.config import BrokerConfig
from chronoq.server import runtime as runtime_mod
from chronoq.server.runtime import Runtime

from .conftest import free_port

DAY_MS = 86_400_000


def test_the_runtime_finishes_a_key_index_build_a_keyed_call_began(tmp_path, caplog):
    config = BrokerConfig(data_dir=str(tmp_path / "data"), port=free_port(), http_port=-1).validate()
    with Broker(config) as broker:  # a previous life: keyed timers over many buckets
        broker.create_topic("orders", 2)
        now = broker.clock.wall_ms()
        ids = [broker.send("orders", b"m%d" % i, keys=[f"order-{i}"], deliver_at_ms=now + DAY_MS + i * 600_000).message_id
               for i in range(120)]

    async def scenario():
        runtime = Runtime(config, say=lambda _: None)
        broker = runtime.open_broker()
        task = asyncio.ensure_future(runtime._build_key_index())
        try:
            timer = broker.timer
            assert timer.keys is None  # nothing keyed asked yet in this life: no build
            await asyncio.sleep(0.05)
            assert timer.keys is None
            assert [m for m, _ in broker.cancel_by_key("orders", "order-7").cancelled] == [ids[7]]
            assert timer.keys_to_read
            for _ in range(500):  # the runtime's slices, a few buckets each (no maintenance runs here)
                if not timer.keys_building:
                    break
                await asyncio.sleep(runtime_mod.KEY_BUILD_PAUSE_S)
            assert not timer.keys_building and len(timer.keys) == 119
            timer.keys.check()
            assert [m for m, _ in broker.cancel_by_key("orders", "order-8").cancelled] == [ids[8]]
            assert len(timer.keys) == 118
        finally:
            runtime._stop.set()
            await asyncio.wait_for(task, 5)
            broker.close()

    with caplog.at_level(logging.INFO, logger="chronoq.timer"):
        asyncio.run(scenario())
    assert any("timer key index built: 119 keys" in r.getMessage() for r in caplog.records)


def test_keyed_calls_through_the_committer_read_the_build_first(tmp_path):
    """A cancel by key or a replacing send while the index is not built (here: the first keyed
    calls after a restart, no runtime task) reads the build to its end in slices first
    (``KeyIndexWait.built``, chronoq.broker.keywait), instead of searching every unread bucket on the loop;
    the answers are the same."""
    from chronoq.broker.broker import OutgoingMessage
    from chronoq.broker.committer import GroupCommitter
    from chronoq.timer.keyed import REPLACE_PROP

    config = BrokerConfig(data_dir=str(tmp_path / "data"), port=free_port(), http_port=-1).validate()
    with Broker(config) as broker:
        broker.create_topic("orders", 2)
        now = broker.clock.wall_ms()
        ids = [broker.send("orders", b"m%d" % i, keys=[f"order-{i}"], properties={REPLACE_PROP: f"r{i}"},
                           deliver_at_ms=now + DAY_MS + i * 600_000).message_id for i in range(60)]

    async def scenario(first: str):
        broker = Broker(config)
        committer = GroupCommitter(broker)
        committer.start()
        try:
            timer = broker.timer
            assert timer.keys is None
            if first == "cancel":
                got = await committer.cancel_by_key("orders", "order-3")
                assert [m for m, _ in got.cancelled] == [ids[3]]
            else:
                due = broker.clock.wall_ms() + 2 * DAY_MS
                [r] = await committer.send([OutgoingMessage("orders", b"new", properties={REPLACE_PROP: "r5"},
                                                            deliver_at_ms=due)])
                assert r.replaced == f"replaced:{ids[5]}"
            assert timer.keys is not None and not timer.keys_building  # read to the end first
            timer.keys.check()
            later = 4 if first == "cancel" else 6  # (a message the other run left alone)
            assert [m for m, _ in (await committer.cancel_by_key("orders", f"order-{later}")).cancelled] == [ids[later]]
        finally:
            await committer.close()
            broker.close()

    asyncio.run(scenario("cancel"))
    asyncio.run(scenario("replace"))


def test_keyed_calls_waiting_together_share_one_reader_of_the_build(tmp_path, monkeypatch):
    """Twenty cancels by key at once right after a restart: one task reads the build for all of
    them (a reader per call would hold the loop a slice per waiting call in every pass), and each
    is answered as if the index had been there."""
    from chronoq.broker.committer import GroupCommitter
    from chronoq.timer import keyed

    monkeypatch.setattr(keyed, "KEY_BUILD_SLICE_MS", 0)  # a bucket a slice: many slices

    config = BrokerConfig(data_dir=str(tmp_path / "data"), port=free_port(), http_port=-1).validate()
    with Broker(config) as broker:
        broker.create_topic("orders", 2)
        now = broker.clock.wall_ms()
        ids = [broker.send("orders", b"m%d" % i, keys=[f"order-{i}"], deliver_at_ms=now + DAY_MS + i * 600_000).message_id
               for i in range(80)]

    async def scenario():
        broker = Broker(config)
        committer = GroupCommitter(broker)
        committer.start()
        timer, readers = broker.timer, []
        slice_ = timer.keys_slice

        def watched_slice():  # (a witness: which task reads)
            readers.append(asyncio.current_task())
            return slice_()

        timer.keys_slice = watched_slice
        try:
            answers = await asyncio.gather(*(committer.cancel_by_key("orders", f"order-{i}") for i in range(20)))
            assert [[m for m, _ in a.cancelled] for a in answers] == [[ids[i]] for i in range(20)]
            assert len(readers) > 20 and len(set(readers)) == 1 and not timer.keys_building
            assert len(timer.keys) == 60
        finally:
            await committer.close()
            broker.close()

    asyncio.run(scenario())
