"""POP's retry and dead-letter copies, and the POP log's records of them, are made durable by the
committer's thread, never by an fsync on the event loop (``chronoq/server/consumers.py``:
``perform``, ``forward_to_dlq``, the POP log synced after the commit log).

The gRPC front end in this process (``start_front_end``) on a real broker and committer; ``os.fsync``
is wrapped to record which thread fsyncs the commit log or the POP log (the fsync itself still runs). A revive (a message not
acked within its invisible time) and a client's ForwardMessageToDeadLetterQueue must each leave
their copy durable and their POP-log records synced, every fsync on the committer's thread, and the
message settled (its old receipt handle stale) only once that copy is durable. (The system topics
are created first: creating a topic writes its config file, not this test's subject.)
"""

from __future__ import annotations

import asyncio
import os
import threading

import grpc
from rocketmq.grpc_protocol import definition_pb2 as pb
from rocketmq.grpc_protocol import service_pb2 as sv
from rocketmq.grpc_protocol import service_pb2_grpc

from chronoq.client.client import Client
from chronoq.pop import copies, names

from .conftest import start_front_end, stop_front_end

FSYNC_THREAD = "chronoq-fsync"  # chronoq/store/fsyncer.py


def _record_fsync_threads(monkeypatch) -> list[str]:
    """Names of the threads that fsync a commit-log segment or a POP log from now on."""
    seen: list[str] = []
    fsync = os.fsync

    def recording_fsync(fd):
        path = os.readlink(f"/proc/self/fd/{fd}")
        if f"{os.sep}commitlog{os.sep}" in path or path.endswith(".poplog"):
            seen.append(threading.current_thread().name)
        return fsync(fd)

    monkeypatch.setattr(os, "fsync", recording_fsync)
    return seen


async def _pop_log_synced(pop, flushes: int) -> None:
    """Wait (bounded) until the POP log has been synced since ``flushes``."""
    for _ in range(100):
        if pop._journal.log.flushes > flushes and not pop._journal.log.queued:
            return
        await asyncio.sleep(0.02)
    raise AssertionError("the POP log was not synced")


def _all(broker, topic: str) -> list:
    cfg = broker.topics.get(topic)
    out = []
    for qid in range(cfg.queues if cfg else 0):
        out += broker.read(topic, qid, 0, 100).messages
    return out


def _run(tmp_path, scenario) -> None:
    """``scenario(front, broker, pop)`` against a front end in this process, stopped after it."""
    async def run():
        front = await start_front_end(str(tmp_path / "data"))
        try:
            await scenario(front, front.runtime.broker, front.runtime.pop)
        finally:
            await stop_front_end(front)

    asyncio.run(run())


def test_a_revive_writes_its_retry_copy_through_the_committer(tmp_path, monkeypatch):
    async def scenario(front, broker, pop):
        broker.create_topic("t", 1)
        async with Client(front.runtime.config.endpoint) as client:
            sent = await client.send("t", b"once")
            [first] = await client.receive("g", "t", max_messages=1, invisible_s=1, wait_s=2)
            copies.system_topic(broker, names.retry_topic("g", "t"), names.retry_queues(pop.retry_delays_ms))
            synced, flushes = broker.store.log.synced, pop._journal.log.flushes
            threads = _record_fsync_threads(monkeypatch)
            again = []
            for _ in range(20):  # long polls of up to 1 s: bounded
                again = await client.receive("g", "t", max_messages=1, invisible_s=30, wait_s=1)
                if again:
                    break
        [m] = again
        assert m.message_id == sent.message_id and m.delivery_attempt == 2
        [copy] = _all(broker, names.retry_topic("g", "t"))
        assert broker.store.log.synced > synced and broker.store.log.synced >= copy.commit_offset
        await _pop_log_synced(pop, flushes)  # the revived CK's records
        assert threads and set(threads) == {FSYNC_THREAD}, threads
        assert first.receipt_handle != m.receipt_handle
        pop.check()

    _run(tmp_path, scenario)


def test_forward_to_dead_letter_queue_answers_once_the_copy_is_durable(tmp_path, monkeypatch):
    async def scenario(front, broker, pop):
        broker.create_topic("f", 1)
        pop.set_group("gf", fifo=True)
        async with Client(front.runtime.config.endpoint) as client:
            sent = await client.send("f", b"give up", message_group="k")
            [got] = await client.receive("gf", "f", max_messages=1, invisible_s=30, wait_s=2)
        copies.system_topic(broker, names.dlq_topic("gf"), names.DLQ_QUEUES)
        flushes = pop._journal.log.flushes
        threads = _record_fsync_threads(monkeypatch)
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
            await _pop_log_synced(pop, flushes)  # the settled entry's records
            assert threads and set(threads) == {FSYNC_THREAD}, threads
            ack = await stub.AckMessage(sv.AckMessageRequest(
                group=pb.Resource(name="gf"), topic=pb.Resource(name="f"),
                entries=[sv.AckMessageEntry(message_id=got.message_id, receipt_handle=got.receipt_handle)]),
                timeout=10)
            assert ack.status.code == pb.INVALID_RECEIPT_HANDLE, ack.status
        assert pop.inflight_count() == 0
        pop.check()

    _run(tmp_path, scenario)
