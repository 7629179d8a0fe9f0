"""The committer (chronoq/broker/committer.py): tickets, group commit, durability callbacks.

A real broker on a temporary directory and a real flusher thread; the loop is asyncio's.
"""

from __future__ import annotations

import asyncio
import threading

from chronoq.broker.broker import Broker, OutgoingMessage
from chronoq.broker.committer import GroupCommitter
from chronoq.core.config import BrokerConfig


def _run(tmp_path, scenario, **settings):
    async def main():
        broker = Broker(BrokerConfig(data_dir=str(tmp_path), segment_bytes=1 << 20, **settings).validate())
        committer = GroupCommitter(broker)
        committer.start()
        try:
            return await asyncio.wait_for(scenario(broker, committer), 20)
        finally:
            await committer.close()
            broker.close()

    return asyncio.run(main())


def test_a_send_is_answered_only_once_durable_and_visible(tmp_path):
    async def scenario(broker, committer):
        for i in range(20):
            (r,) = await committer.send([OutgoingMessage("orders", f"m{i}".encode())])
            end = broker.store.log.written
            assert broker.store.log.synced >= end and broker.store.dispatched >= end
            assert broker.read("orders", r.queue_id, r.queue_offset).messages[0].body == f"m{i}".encode()

    _run(tmp_path, scenario)


def test_concurrent_senders_share_fsyncs(tmp_path):
    """Group commit: writers that come while an fsync runs (or queued behind a lone one) join one
    group. 200 senders at once need a handful of fsyncs, not 200."""
    async def scenario(broker, committer):
        before = committer.fsyncs
        results = await asyncio.gather(*(committer.send([OutgoingMessage("orders", f"m{i}".encode())])
                                         for i in range(200)))
        assert len(results) == 200
        assert broker.store.log.synced == broker.store.log.written
        return committer.fsyncs - before

    fsyncs = _run(tmp_path, scenario)
    assert 1 <= fsyncs <= 10, fsyncs


def test_writers_after_a_lone_send_join_one_group(tmp_path):
    """After a lone writer's fsync, the writers that come next together share fsyncs: a lone
    writer's turn must not leave the committer fsyncing one writer at a time."""
    async def scenario(broker, committer):
        await committer.send([OutgoingMessage("orders", b"first")])  # a lone writer
        before = committer.fsyncs

        async def one(i):
            await committer.send([OutgoingMessage("orders", f"q{i}".encode())])

        await asyncio.gather(*(one(i) for i in range(50)))
        return committer.fsyncs - before

    assert _run(tmp_path, scenario) <= 5


def test_writers_of_one_loop_pass_share_at_most_two_fsyncs(tmp_path):
    """Compiled, the pass's first writer rings the fsync thread at once; every later writer of the
    same pass joins the next fsync, queued behind it at the end of the pass: a burst of 20 costs 2
    fsyncs, not 20 (nor 3: the queued one is not rung for the second writer alone), or 1 when the
    thread finds both requests waiting when it reads (it serves them with one fsync). In the
    pure-Python build the ring waits for the end of the pass (its thread needs the GIL), and the
    whole pass shares one (``fsyncer.RING_AT_ONCE``)."""
    from chronoq.store import fsyncer

    async def scenario(broker, committer):
        await committer.send([OutgoingMessage("orders", b"first")])  # nothing in flight after it
        before = committer.fsyncs
        # Tasks made together take their first step in one pass: each writes, then waits.
        sends = [asyncio.ensure_future(committer.send([OutgoingMessage("orders", f"p{i}".encode())]))
                 for i in range(20)]
        await asyncio.gather(*sends)
        assert broker.store.log.synced == broker.store.log.written
        return committer.fsyncs - before

    assert 1 <= _run(tmp_path, scenario) <= (2 if fsyncer.RING_AT_ONCE else 1)


def test_durable_waits_for_a_ticket_written_outside_a_send(tmp_path):
    """A writer that appended by itself (a recall's tombstone, a transaction's records) holds the
    log position its records end at and awaits it."""
    async def scenario(broker, committer):
        broker.write([OutgoingMessage("orders", b"x")])
        ticket = broker.store.log.written
        assert broker.store.log.synced < ticket
        await committer.durable(ticket)
        assert broker.store.log.synced >= ticket and broker.store.dispatched >= ticket
        assert broker.read("orders", 0, 0).messages or broker.read("orders", 1, 0).messages

    _run(tmp_path, scenario, default_queues=2)


def test_after_durable_runs_once_an_fsync_covers_what_was_written(tmp_path):
    async def scenario(broker, committer):
        heard = []
        done = asyncio.Event()
        broker.write([OutgoingMessage("orders", b"x")])
        written = broker.store.log.written

        def callback(synced, exc):
            heard.append((synced, exc))
            done.set()

        committer.after_durable(callback)
        await done.wait()
        assert len(heard) == 1 and heard[0][1] is None and heard[0][0] >= written
        assert broker.store.log.synced >= written and broker.store.dispatched >= written

    _run(tmp_path, scenario)


def test_async_policy_fsyncs_on_its_interval_and_on_request(tmp_path):
    async def scenario(broker, committer):
        await committer.send([OutgoingMessage("orders", b"x")])  # answered once written
        written = broker.store.log.written
        for _ in range(200):  # the flusher's interval (10 ms here) fsyncs it
            if broker.store.log.synced >= written:
                break
            await asyncio.sleep(0.01)
        assert broker.store.log.synced >= written
        broker.write([OutgoingMessage("orders", b"y")])
        ticket = broker.store.log.written
        await committer.durable(ticket)  # asked for: no wait for the interval
        assert broker.store.log.synced >= ticket

    _run(tmp_path, scenario, flush_policy="async", flush_interval_ms=10)


def test_a_sync_replicated_send_waits_once_for_its_fsync_and_a_replicas_report(tmp_path):
    """``replication = "sync"``: a send is answered only once its records are durable here *and* a
    replica reported them (``PrimaryNode.replica_wait``), in either order, and it suspends once on
    the way (``GroupCommitter._replicated_waiter``: a second wait would cost the HTTP/2 server a
    task per call). Driven step by step as ``h2calls._launch`` drives a handler."""
    from chronoq.broker.broker import OutgoingBatch
    from chronoq.replication.shipper import PrimaryNode

    async def scenario(broker, committer):
        node = PrimaryNode(broker, None, "primary")
        committer.replica_wait = node.replica_wait
        node.replicas["r"] = ("r:1", 0, broker.clock.wall_ms())  # as its pull would: in sync
        # (made first: a send that creates its topic waits once more, for its queue's file first)
        broker.create_topic("orders")

        async def until(cond) -> None:
            for _ in range(2000):
                if cond():
                    return
                await asyncio.sleep(0.001)
            raise AssertionError("never")

        for report_first in (False, True):
            coro = committer.send_batch(OutgoingBatch.of([OutgoingMessage("orders", b"x" * 100)]))
            waiting_on = coro.send(None)  # written; waits for the group commit and the replica
            end = broker.store.log.written
            if report_first:
                node._replica_acked(end)  # the replica holds it before this node's fsync is done
                assert not waiting_on.done()
                await until(waiting_on.done)
            else:
                await until(lambda: broker.store.log.synced >= end and broker.store.dispatched >= end)
                for _ in range(5):
                    await asyncio.sleep(0)
                assert not waiting_on.done(), "answered before a replica reported it"
                node._replica_acked(end)
                assert waiting_on.done()
            try:
                coro.send(None)
            except StopIteration as stop:
                assert stop.value.message_ids
            else:
                raise AssertionError("the send waited a second time")

    _run(tmp_path, scenario)


def test_a_sync_replicated_send_no_replica_reports_is_refused_or_falls_back(tmp_path):
    """No replica in sync: refused at once (``errors.ReplicaTimeout``), or with
    ``replication_sync_fallback = "async"`` answered once durable here, counted and flagged;
    the next reported send clears the flag."""
    from chronoq.core import errors
    from chronoq.replication.shipper import PrimaryNode

    def scenario_for(fallback: bool):
        async def scenario(broker, committer):
            node = PrimaryNode(broker, None, "primary")
            committer.replica_wait = node.replica_wait
            if not fallback:
                try:
                    await committer.send([OutgoingMessage("orders", b"alone")])
                except errors.ReplicaTimeout as exc:
                    assert "no replica is in sync" in str(exc)
                else:
                    raise AssertionError("acknowledged with no replica")
                return
            await committer.send([OutgoingMessage("orders", b"alone")])
            assert broker.store.log.synced >= broker.store.log.written
            assert committer.sync_fallbacks == 1 and committer.sync_degraded
            node.replicas["r"] = ("r:1", broker.store.log.written, broker.clock.wall_ms())
            node._replica_acked(broker.store.log.written)
            send = asyncio.ensure_future(committer.send([OutgoingMessage("orders", b"reported")]))
            while broker.store.log.synced < broker.store.log.written or not node._acks:
                await asyncio.sleep(0.001)
            node._replica_acked(broker.store.log.written)
            await send
            assert committer.sync_fallbacks == 1 and not committer.sync_degraded
        return scenario

    _run(tmp_path / "refuse", scenario_for(False))
    _run(tmp_path / "fallback", scenario_for(True), replication_sync_fallback="async")


def test_the_second_tier_logs_sync_only_after_an_fsync_asked_for_them(tmp_path):
    """``add_log``'s syncs run on the fsync thread after an fsync that ``after_durable`` asked for
    (a plain send's fsync stays off Python); asked while an fsync without them runs, they run after
    the next one, before the callback."""
    import threading

    from chronoq.store.fsyncer import THREAD_NAME

    async def scenario(broker, committer):
        loop = asyncio.get_running_loop()
        ran: list[str] = []
        committer.add_log(lambda: ran.append(threading.current_thread().name))
        await committer.send([OutgoingMessage("orders", b"plain")])
        assert ran == []

        def asked() -> asyncio.Future:
            fut = loop.create_future()
            committer.after_durable(lambda synced, exc: fut.set_result((synced, exc, list(ran))))
            return fut

        synced, exc, seen = await asked()
        assert exc is None and synced == broker.store.log.written and seen == [THREAD_NAME]

        held, gate = threading.Event(), threading.Event()
        committer.fsyncer.before_fsync = lambda _fd: (held.set(), gate.wait(10))
        send = asyncio.ensure_future(committer.send([OutgoingMessage("orders", b"held")]))
        while not held.is_set():  # the send's fsync (no logs) is under way, held at the gate
            await asyncio.sleep(0.001)
        late = asked()
        gate.set()
        await send
        assert not late.done() or len(late.result()[2]) == 2
        committer.fsyncer.before_fsync = None
        synced, exc, seen = await late
        assert exc is None and seen == [THREAD_NAME] * 2  # the next fsync ran them, before the callback
        assert synced >= broker.store.log.written

    _run(tmp_path, scenario)


def test_the_next_fsync_is_asked_while_one_runs_and_later_writers_wait_for_a_third(tmp_path):
    """While an fsync runs, the next writer's fsync is already asked of the thread (queued behind
    it, so it starts the moment the first ends, not once the loop has heard of it); a writer after
    that joins a third generation, asked only once the first reports. Every writer is answered
    only after an fsync that covers it, in log order."""
    from chronoq.broker import committer as committer_mod

    async def scenario(broker, committer):
        await committer.send([OutgoingMessage("orders", b"first")])  # nothing in flight after it
        held, gate = threading.Event(), threading.Event()
        committer.fsyncer.before_fsync = lambda _fd: (held.set(), gate.wait(10))
        log_ = broker.store.log
        one = asyncio.ensure_future(committer.send([OutgoingMessage("orders", b"one")]))
        while not held.is_set():  # its fsync is under way, held at the gate
            await asyncio.sleep(0.001)
        one_end = log_.written
        two = asyncio.ensure_future(committer.send([OutgoingMessage("orders", b"two")]))
        await asyncio.sleep(0.01)  # a few passes: two's generation is asked (rung), not answered
        assert len(committer._asked) == committer_mod.AHEAD and all(g.rung for g in committer._asked)
        assert [g.target for g in committer._asked] == [one_end, log_.written]
        three = asyncio.ensure_future(committer.send([OutgoingMessage("orders", b"three")]))
        await asyncio.sleep(0.01)
        assert committer._waiting is not None and not committer._waiting.rung and committer._waiting.waiters
        assert not any(t.done() for t in (one, two, three)) and log_.synced < one_end
        committer.fsyncer.before_fsync = None
        before = committer.fsyncs
        gate.set()
        await asyncio.gather(one, two, three)
        assert log_.synced == log_.written and broker.store.dispatched == log_.written
        assert committer.fsyncs - before == 3 and not committer._asked and committer._waiting is None

    _run(tmp_path, scenario)
