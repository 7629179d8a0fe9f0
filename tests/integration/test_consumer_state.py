"""The POP and transaction state belong to the broker's runtime, not to the gRPC front end: the
runtime opens them before any front end, every front end drives the same objects, and they stay
open (and are saved) until the runtime closes them, after the front ends stopped."""

from __future__ import annotations

import asyncio

import pytest

from chronoq.core import errors
from chronoq.core.config import BrokerConfig
from chronoq.broker.committer import GroupCommitter
from chronoq.server.grpc_server import GrpcFrontEnd
from chronoq.server.runtime import Runtime

from .conftest import free_port


def _runtime_with_consumers(tmp_path, **settings):
    """A runtime as ``serve`` builds it, without front ends: broker, committer, consumer state and
    loops (call in the event loop; the caller closes them)."""
    runtime = Runtime(BrokerConfig(data_dir=str(tmp_path / "data"), port=free_port(), http_port=-1,
                                   **settings).validate(), say=lambda _: None)
    broker = runtime.open_broker()
    runtime.committer = GroupCommitter(broker)
    runtime.committer.start()
    try:
        runtime.open_consumers()
    except BaseException:
        broker.close()
        raise
    return runtime, broker


def test_the_front_end_drives_the_runtimes_pop_and_transactions(tmp_path):
    async def scenario():
        runtime, broker = _runtime_with_consumers(tmp_path, extra={"groups": {"g-fifo": {"fifo": True}}})
        try:
            pop, txns = runtime.pop, runtime.txns
            assert pop is not None and txns is not None and pop.group("g-fifo").fifo  # [groups] applied
            front = GrpcFrontEnd(runtime)
            await front.start()
            assert front.service.pop is pop and front.service.txns is txns
            await front.stop()
            assert not pop.closed  # the front end leaves the broker's state to the runtime
            runtime.close_consumers()
            assert pop.closed and runtime.pop is None and runtime.txns is None
        finally:
            runtime.close_consumers()
            await runtime.committer.close()
            broker.close()

    asyncio.run(scenario())


def test_a_bad_groups_table_opens_nothing(tmp_path):
    runtime = Runtime(BrokerConfig(data_dir=str(tmp_path / "data"), port=free_port(), http_port=-1,
                                   extra={"groups": {"g": {"colour": "red"}}}).validate(), say=lambda _: None)
    broker = runtime.open_broker()
    try:
        with pytest.raises(errors.ClientError, match="unknown setting 'colour'"):
            runtime.open_consumers()
        assert runtime.pop is None and runtime.txns is None
    finally:
        broker.close()


def test_the_runtime_revives_and_rolls_back_without_any_front_end(tmp_path):
    """The POP ticker and the transaction checks are the runtime's loops: with no front end at
    all, a message not acked in time is revived (its retry copy made durable by the committer)
    and a transaction nobody resolves is rolled back."""
    from chronoq.broker.broker import OutgoingMessage
    from chronoq.pop import names

    async def scenario():
        runtime, broker = _runtime_with_consumers(tmp_path, txn_check_after_ms=0, txn_max_checks=0)
        try:
            pop, txns = runtime.pop, runtime.txns
            broker.create_topic("t", 1)
            broker.send("t", b"not acked")
            [_p] = pop.receive("g", "t", max_messages=1, invisible_ms=names.RECEIVE_INVISIBLE_MS_MIN)
            half = txns.half_message(OutgoingMessage("t", b"never resolved"))
            txns.accepted(broker.write([half], system=True), [half])
            broker.flush()
            assert pop.inflight_count() == 1 and len(txns.pending) == 1
            for _ in range(100):  # bounded: the revive is due in 1 s, a check pass runs every 1 s
                if pop.inflight_count() == 0 and not txns.pending:
                    break
                await asyncio.sleep(0.1)
            assert pop.inflight_count() == 0 and not txns.pending
            retry = names.retry_topic("g", "t")
            assert sum(broker.queue_bounds(retry, q)[1] for q in range(broker.topics[retry].queues)) == 1
            assert broker.store.log.synced == broker.store.log.written
        finally:
            runtime.close_consumers()
            await runtime.committer.close()
            broker.close()

    asyncio.run(scenario())
