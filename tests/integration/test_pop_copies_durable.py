"""POP's retry and dead-letter copies are made durable by the committer's thread, never by an fsync
on the event loop (``chronoq/server/consumers.py``: ``perform``, ``forward_to_dlq``).

The gRPC front end in this process (``start_front_end``) on a real broker and committer; the commit
log's ``sync`` is wrapped to record which thread calls it (the fsync itself still runs). A revive
(a message not acked within its invisible time) and a client's ForwardMessageToDeadLetterQueue must
each leave their copy durable, fsynced only on the committer's thread, and the message settled
(its old receipt handle stale) only once that copy is durable.
"""

from __future__ import annotations

import asyncio
import threading

import grpc
from rocketmq.grpc_protocol import definition_pb2 as pb
from rocketmq.grpc_protocol import service_pb2 as sv
from rocketmq.grpc_protocol import service_pb2_grpc

from chronoq.client.client import Client
from chronoq.pop import names

from .conftest import start_front_end, stop_front_end

FSYNC_THREAD = "chronoq-fsync"  # chronoq/broker/committer.py


def _record_sync_threads(broker) -> list[str]:
    """Names of the threads that fsync the commit log from now on."""
    seen: list[str] = []
    log = broker.store.log
    sync = log.sync

    def recording_sync():
        seen.append(threading.current_thread().name)
        return sync()

    log.sync = recording_sync
    return seen


def _all(broker, topic: str) -> list:
    cfg = broker.topics.get(topic)
    out = []
    for qid in range(cfg.queues if cfg else 0):
        out += broker.read(topic, qid, 0, 100).messages
    return out


def test_a_revive_writes_its_retry_copy_through_the_committer(tmp_path):
    async def scenario():
        front = await start_front_end(str(tmp_path / "data"))
        broker, pop = front.runtime.broker, front.runtime.pop
        try:
            broker.create_topic("t", 1)
            async with Client(front.runtime.config.endpoint) as client:
                sent = await client.send("t", b"once")
                [first] = await client.receive("g", "t", max_messages=1, invisible_s=1, wait_s=2)
                synced = broker.store.log.synced
                threads = _record_sync_threads(broker)
                again = []
                for _ in range(20):  # long polls of up to 1 s: bounded
                    again = await client.receive("g", "t", max_messages=1, invisible_s=30, wait_s=1)
                    if again:
                        break
            [m] = again
            assert m.message_id == sent.message_id and m.delivery_attempt == 2
            [copy] = _all(broker, names.retry_topic("g", "t"))
            assert broker.store.log.synced > synced and broker.store.log.synced >= copy.commit_offset
            assert threads and set(threads) == {FSYNC_THREAD}, threads
            assert first.receipt_handle != m.receipt_handle
            pop.check()
        finally:
            await stop_front_end(front)

    asyncio.run(scenario())


def test_forward_to_dead_letter_queue_answers_once_the_copy_is_durable(tmp_path):
    async def scenario():
        front = await start_front_end(str(tmp_path / "data"))
        broker, pop = front.runtime.broker, front.runtime.pop
        try:
            broker.create_topic("f", 1)
            pop.set_group("gf", fifo=True)
            async with Client(front.runtime.config.endpoint) as client:
                sent = await client.send("f", b"give up", message_group="k")
                [got] = await client.receive("gf", "f", max_messages=1, invisible_s=30, wait_s=2)
            threads = _record_sync_threads(broker)
            async with grpc.aio.insecure_channel(front.runtime.config.endpoint) as channel:
                stub = service_pb2_grpc.MessagingServiceStub(channel)
                res = await stub.ForwardMessageToDeadLetterQueue(sv.ForwardMessageToDeadLetterQueueRequest(
                    group=pb.Resource(name="gf"), topic=pb.Resource(name="f"), receipt_handle=got.receipt_handle,
                    message_id=got.message_id, delivery_attempt=1, max_delivery_attempts=16), timeout=10)
                assert res.status.code == pb.OK, res.status
                # Answered: the copy is durable and the message settled (its handle stale).
                [copy] = _all(broker, names.dlq_topic("gf"))
                assert broker.store.log.synced >= copy.commit_offset + 1
                assert copy.properties[names.PROP_DLQ_ORIGIN_MESSAGE_ID] == sent.message_id
                assert threads and set(threads) == {FSYNC_THREAD}, threads
                ack = await stub.AckMessage(sv.AckMessageRequest(
                    group=pb.Resource(name="gf"), topic=pb.Resource(name="f"),
                    entries=[sv.AckMessageEntry(message_id=got.message_id, receipt_handle=got.receipt_handle)]),
                    timeout=10)
                assert ack.status.code == pb.INVALID_RECEIPT_HANDLE, ack.status
            assert pop.inflight_count() == 0
            pop.check()
        finally:
            await stop_front_end(front)

    asyncio.run(scenario())
