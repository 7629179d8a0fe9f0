"""New consume queues' first files made off the event loop (chronoq/store/newqueues.py), with the
committer (chronoq/broker/committer.py) waiting for them: a send batch that creates topics before
it is written, any other writer's batch before it is dispatched.

A real broker on a temporary directory, the real committer and its threads; the maker's
``before_make`` hook holds its thread where a test needs it held.
"""

from __future__ import annotations

import asyncio
import os
import threading

from chronoq.broker.broker import Broker, OutgoingMessage
from chronoq.broker.committer import GroupCommitter
from chronoq.core.config import BrokerConfig
from chronoq.store.consumequeue import DIR_INDEX

WAIT_S = 10


def _run(tmp_path, scenario, **settings):
    async def main():
        # One queue a topic: a send to an existing topic goes to a queue that has its file.
        settings.setdefault("default_queues", 1)
        broker = Broker(BrokerConfig(data_dir=str(tmp_path), segment_bytes=1 << 20, **settings).validate())
        committer = GroupCommitter(broker)
        committer.start()
        try:
            return await asyncio.wait_for(scenario(broker, committer), 30)
        finally:
            await committer.close()
            broker.close()

    return asyncio.run(main())


def _gate(broker) -> tuple[threading.Event, list[tuple[str, str]]]:
    """Hold the maker's thread before each file until the event is set; (thread name, path) of each."""
    gate, seen = threading.Event(), []

    def before_make(path: str) -> None:
        seen.append((threading.current_thread().name, path))
        assert gate.wait(WAIT_S), "the gate was never opened"

    broker.store.new_files.before_make = before_make
    return gate, seen


def _read_all(broker, topic: str) -> list[bytes]:
    out = []
    for qid in range(broker.topics[topic].queues):
        out += [m.body for m in broker.read(topic, qid, 0, 1000).messages]
    return out


def test_a_batch_creating_topics_is_written_once_their_files_are_made_on_the_makers_thread(tmp_path):
    """The batch is not in the log while its files are made; a send to an existing topic meanwhile
    is answered (it is not dispatched behind the waiting batch); then the batch is answered and
    every message is readable."""
    async def scenario(broker, committer):
        await committer.send([OutgoingMessage("old", b"first")])
        made_before = broker.store.new_files.files_made  # ("old"'s)
        gate, seen = _gate(broker)
        new = asyncio.ensure_future(committer.send([OutgoingMessage(f"new-{i}", f"n{i}".encode()) for i in range(30)]))
        for _ in range(WAIT_S * 100):  # until the maker holds its first file
            if seen:
                break
            await asyncio.sleep(0.01)
        written = broker.store.log.written
        (r,) = await asyncio.wait_for(committer.send([OutgoingMessage("old", b"meanwhile")]), WAIT_S)
        assert not new.done()
        assert r.commit_offset >= written, "the waiting batch must not be in the log yet"
        assert all(f"new-{i}" in broker.topics for i in range(30)), "its topics are made (and saved) first"
        gate.set()
        results = await asyncio.wait_for(new, WAIT_S)
        assert min(x.commit_offset for x in results) > r.commit_offset
        assert {name for name, _ in seen} == {"chronoq-cq-newfiles"} and len(seen) == 30
        assert broker.store.new_files.files_made - made_before == 30 and not broker.store.new_files.busy()
        for i in range(30):
            assert _read_all(broker, f"new-{i}") == [f"n{i}".encode()]
            cq = broker.store.queues[(f"new-{i}", results[i].queue_id)]
            # the directory naming the made file is fsynced by the next checkpoint
            assert (DIR_INDEX, cq.directory) in cq.take_dirty()
        assert _read_all(broker, "old") == [b"first", b"meanwhile"]

    _run(tmp_path, scenario)


def test_another_writers_batch_to_a_queue_without_a_file_is_answered_only_once_dispatched(tmp_path):
    """A batch written without waiting first (here the embedded write, as the timer's and POP's
    copies are) asks for its files at once; its fsync is done before them, and its answer waits
    for the dispatch, which waits for the files (no create on the loop)."""
    async def scenario(broker, committer):
        await committer.send([OutgoingMessage("old", b"first")])
        gate, seen = _gate(broker)
        broker.write([OutgoingMessage(f"copy-{i}", b"c") for i in range(5)])
        ticket = broker.store.log.written
        durable = asyncio.ensure_future(committer.durable(ticket))
        for _ in range(WAIT_S * 100):
            if broker.store.log.synced >= ticket and seen:
                break
            await asyncio.sleep(0.01)
        assert broker.store.log.synced >= ticket
        for _ in range(5):
            await asyncio.sleep(0)
        assert not durable.done(), "answered before its records were dispatched"
        assert broker.store.dispatched < ticket
        assert not any(os.path.exists(path) for _, path in seen[1:]), "made on the loop meanwhile"
        gate.set()
        await asyncio.wait_for(durable, WAIT_S)
        assert broker.store.dispatched >= ticket
        assert all(_read_all(broker, f"copy-{i}") == [b"c"] for i in range(5))

    _run(tmp_path, scenario)


def test_async_policy_answers_a_batch_to_new_queues_once_their_files_are_made(tmp_path):
    async def scenario(broker, committer):
        await committer.send([OutgoingMessage("old", b"first")])
        gate, seen = _gate(broker)
        broker.write([OutgoingMessage("fresh", b"f")])  # waits for its file in the dispatch
        sent = asyncio.ensure_future(committer.send([OutgoingMessage("old", b"o")]))
        for _ in range(5):
            await asyncio.sleep(0)
        assert not sent.done(), "under async too, answered only once dispatched (behind the batch before it)"
        gate.set()
        await asyncio.wait_for(sent, WAIT_S)
        assert _read_all(broker, "fresh") == [b"f"] and _read_all(broker, "old") == [b"first", b"o"]

    _run(tmp_path, scenario, flush_policy="async", flush_interval_ms=10)


def test_files_made_off_the_loop_count_against_the_open_file_budget(tmp_path):
    async def scenario(broker, committer):
        await committer.send([OutgoingMessage(f"t{i}", b"x") for i in range(60)])
        budget = broker.store.cq_files
        assert broker.store.new_files.files_made >= 60
        assert len(budget) <= 16 and budget.evictions >= 44
        assert all(_read_all(broker, f"t{i}") == [b"x"] for i in range(60))

    _run(tmp_path, scenario, cq_open_files=16)


def test_a_failed_make_leaves_the_file_to_the_dispatch(tmp_path):
    """The maker's error is logged and reported as done: the dispatch creates the file itself."""
    async def scenario(broker, committer):
        def fail(path: str) -> None:
            raise OSError(28, "No space left on device (test)")

        broker.store.new_files.before_make = fail
        results = await asyncio.wait_for(committer.send([OutgoingMessage(f"f{i}", b"x") for i in range(3)]), WAIT_S)
        assert len(results) == 3 and broker.store.new_files.failures == 3
        assert all(_read_all(broker, f"f{i}") == [b"x"] for i in range(3))

    _run(tmp_path, scenario)
