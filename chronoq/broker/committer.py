"""The committer: the one owner of the commit log's fsync, of dispatch after it, and of the tickets
callers await.

Writers append on the event loop (page cache, microseconds) and hold a *ticket*: the commit-log
position their records end at. ``durable(ticket)`` returns once the log is fsynced to at least that
position and everything below it is dispatched (visible in its consume queue, absorbed by the timer).

One long-lived thread does every fsync of the commit log (``chronoq.store.fsyncer``: rung through a
pipe, it reports through another that the loop watches; compiled, it never takes the GIL for a
plain fsync). Each fsync is a *generation* with the futures of all its waiters. At most two are
asked of the thread at once (``AHEAD``): the one it runs and the one queued behind it, so the next
fsync starts the moment the last one ends, without waiting for the loop to hear of it; writes that
arrive while both are asked join one more, which waits, not asked, until the first reports (group
commit). On the loop the committer dispatches each report in commit-log order and resolves the
generation. The thread is rung as soon as a generation is asked for (``_ask``; in the pure-Python
build at the end of the loop pass), so the fsync overlaps the rest of the pass.

What a lone durable send costs beyond an ``async`` one (bench/send_receive.py --phase e, per thread
from /proc/<pid>/task/*/schedstat, on this project's 2-vCPU VM): the fsync thread 70-75 us (the
fsync's kernel path and its device waits), the loop thread 70-100 us more, which is what any wait
in the middle of a call costs here (the thread sleeps in epoll and is woken: bench/fsync_floor.py's
``pause`` way, no disk, costs ~40 us over ``none``). Before the thread ran without the GIL
(``chronoq.store.fsyncer``), it took 90-100 us and the lone send's p50 was 0.05-0.1 ms longer
(3 alternating pairs). An fsync on the loop thread sleeps as well (the device), and stalls every
other call meanwhile: one message per call from two processes ran 10% slower that way (and loop
stalls of 1-5 ms when other processes share the disk), so every fsync stays on that thread.

Under the ``async`` flush policy sends are answered once written and dispatched; a loop timer asks
for an fsync every ``flush_interval_ms`` when something was written (or sooner when someone asks:
the timer's copies, a barrier).

New queues' first files are made off the loop while their batch is fsynced
(``chronoq.store.newqueues``): acknowledgements whose dispatch waits for them, and sends that
create topics, wait in ``chronoq.broker.filewaits`` (``FileWaits``, owned here), in log order.
A keyed call waits for the timer's key index build in ``chronoq.broker.keywait``.

Positions and replication: a ticket is a byte offset in the one commit log, counted from the log's
first byte across segments (segments are named by their base offset), the same number on every node
holding the same bytes. A replica follows the log byte for byte: it fetches the bytes between its
end and the primary's written end (``log.written``: shipped while this thread fsyncs them, each
ring wakes the shipper, ``add_written_listener``), appends them at the same offsets, fsyncs, and
dispatches them in log order exactly as recovery's replay does (``Store._replay``), so its derived
data is a function of the position it reached. A ``sync`` acknowledgement (``barrier``) waits for
this node's fsync and then for a replica's report, each covering the ticket: one future, which the
fsync's generation hands on to the replica's wait (``replica_wait``) by callback, so the call
suspends once.

Callers: client sends of every type (``send_batch``; ``send`` for objects), transaction halves and ends
(``barrier``), staged publishes and trace flushes (``durable`` with the log's end as ticket), the
timer's delivered copies (``after_durable``, from the runtime's timer loop), recall and reschedule
(``recall``/``reschedule``: the record's ticket; the timer keeps the target from delivery until
the dispatch applies it), retention's roll-forward (``retention``: deletion after its records' fsync), POP's retry and DLQ copies (``after_durable`` and ``durable``,
``chronoq.server.consumers``), and the POP log, a second log this thread fsyncs right after the
commit log (``add_log``). The embedded one-call paths (``Broker.send_batch``/``flush``/``durable``,
``Broker.timer_tick``, ``PopService.tick_durably``) do the same fsync then dispatch in log order
on the caller's thread, for a broker without a loop.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from typing import Callable, Iterable

from chronoq.core import errors
from chronoq.core.jobs import Job
from chronoq.broker.broker import Broker, OutgoingBatch, OutgoingMessage, Sent
from chronoq.broker.filewaits import FileWaits, settle
from chronoq.broker.keywait import KeyIndexWait
from chronoq.broker.sending import WaitingFiles
from chronoq.core.model import SendResult
from chronoq.store import fsyncer as fsyncer_mod
from chronoq.store.fsyncer import Fsyncer
from chronoq.store.retention import RetentionPlan
from chronoq.timer.keyed import has_replace_keys
from chronoq.timer.service import RecallResult, RescheduleResult

log = logging.getLogger("chronoq.broker.committer")

DISPATCH_RETRY_S = 0.5  # after a failed dispatch, try again this soon
# Retention's roll-forward (``retention_roll``) writes a slice of this long, then leaves the loop
# free this long: at once, 100,000 pending timers held it 1.2-1.8 s (bench/stalls.py --retention).
# 2 ms, not the key index build's 5: a roll comes back every retention pass, and calls that wait
# behind a slice show in the p99 (that bench, main 1.6 ms: 5 ms slices 5.6 ms, 2 ms slices 3.1 ms).
RETENTION_SLICE_S = 0.002
RETENTION_PAUSE_S = 0.008
# Generations asked of the fsync thread at once: the running fsync and one queued behind it
# (``_ask``). One: the next is asked only once the running one's report reaches the loop.
AHEAD = 2


class _Generation:
    """One fsync: the position it must reach, the futures of the calls awaiting it and the
    callbacks to run once it is done (``after_durable``).

    A future per waiter, not one shared: the HTTP/2 server runs a call's first step outside any
    task and goes on with it from the done-callback of what it awaits (``h2calls._Waiting``, or
    a task, ``h2calls._Resumed``); two calls read in one go would both wait on one future, and a
    task's step would fail ("await wasn't used with future"). A future costs ~0.2 µs to make and resolve (uvloop)."""

    __slots__ = ("target", "rung", "logs", "waiters", "callbacks")

    def __init__(self) -> None:
        self.target = -1  # set when the fsync is asked for, raised when the thread is rung
        self.rung = False  # the thread was rung for it: later writes wait for the next one
        self.logs = False  # the second-tier logs sync after it (``after_durable`` asked)
        self.waiters: list[asyncio.Future] = []
        self.callbacks: list[Callable[[int, BaseException | None], None]] = []


class GroupCommitter:
    def __init__(self, broker: Broker):
        self.broker = broker
        self.store = broker.store
        self.sync_policy = broker.config.flush_policy == "sync"
        self._interval_s = broker.config.flush_interval_ms / 1000
        self._loop: asyncio.AbstractEventLoop | None = None
        self._asked: list[_Generation] = []  # asked of the thread, not reported yet, oldest first (<= AHEAD)
        self._waiting: _Generation | None = None  # for writes after the last asked one's target
        self._fsyncer: Fsyncer | None = None  # the thread, once started
        self._periodic: asyncio.TimerHandle | None = None  # ``async``: the next interval's fsync
        self.fsyncs = 0
        # Second-tier logs (docs/storage.md: the POP log), synced by the thread right after an
        # fsync of the commit log, so their records never reach disk before the commit-log
        # records they follow (a revive's DONE after its retry copy). Each asks for it with
        # ``after_durable`` and hears on the loop through that callback; only such a generation
        # runs them (a plain send's fsync stays off the GIL).
        self._logs: list[Callable[[], None]] = []
        self._dispatch_failures = 0
        self._dispatch_retry: asyncio.TimerHandle | None = None
        # ``replication = "sync"``: ``replica_wait(ticket, settle)`` calls ``settle(None)`` once a
        # replica holds the log up to the ticket durably, or ``settle(errors.ReplicaTimeout)``
        # (chronoq.replication.shipper.PrimaryNode.replica_wait); None: async.
        self.replica_wait: Callable[[int, Callable[[BaseException | None], None]], None] | None = None
        # ``replication_sync_fallback = "async"``: a send no replica reported in time is answered
        # OK all the same (durable here only, as under async), counted, and the switch logged;
        # "refuse" (default): ``errors.ReplicaTimeout``.
        self.sync_fallback = broker.config.replication_sync_fallback == "async"
        self.sync_fallbacks = 0  # acknowledgements made without a replica's report (a metric)
        self.sync_degraded = False  # the last sync acknowledgement fell back (logged on each change)
        # Automatic failover (etcd): ``leadership.holds()`` while this primary surely holds its lease;
        # once it does not, nothing more is acknowledged (``check_leader``): every waiter is answered
        # ``leadership.refusal()``, nothing more is made visible. None: no etcd, always the primary.
        self.leadership = None
        # Called on the loop each time an fsync is rung, the log written to ``gen.target`` then
        # (``add_written_listener``: the replication shipper, whose waiting pulls ship those bytes
        # while the fsync runs).
        self._written_listeners: list[Callable[[], None]] = []
        self._keys = KeyIndexWait(broker.timer)  # a keyed call's wait for the timer's key index build
        # Acknowledgements and topic-creating sends waiting for new queues' first files, made off
        # the loop (``chronoq.store.newqueues``).
        self._files = FileWaits(self.store, self._dispatch_acknowledged, self._refusal)

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._fsyncer = Fsyncer(self._sync_logs)
        self._loop.add_reader(self._fsyncer.reports, self._reported)
        self._files.start(self._loop)  # (new queues' first files made while their batch is fsynced)
        self._fsyncer.start()
        if not self.sync_policy:
            self._periodic = self._loop.call_later(self._interval_s, self._interval_fsync)

    @property
    def fsyncer(self) -> Fsyncer | None:
        """The fsync thread (tests set its ``before_fsync`` fault hook)."""
        return self._fsyncer

    # ------------------------------------------------------------------ writers
    async def send(self, messages: Iterable[OutgoingMessage], *, system: bool = False) -> list[SendResult]:
        """``send_batch`` for ``OutgoingMessage`` objects, answered with ``SendResult`` objects."""
        return (await self.send_batch(OutgoingBatch.of(messages), system=system)).results()

    async def send_batch(self, batch: OutgoingBatch, *, system: bool = False) -> Sent:
        """Write a batch (``Broker.write_batch``, the one send path) and return once it is
        acknowledged under the flush policy.

        Every caller is a new send (transactional halves come as ``system``): all are refused
        while the disk is below its reserve.
        """
        if batch.properties is not None and self.broker.timer.keys_building and has_replace_keys(batch.properties):
            await self._keys.built()
        self.broker.check_space()
        self.check_leader()  # (a fenced node does not even write what it will not acknowledge)
        try:
            sent = self.broker.write_batch(batch, system=system, files_ahead=self._files.ahead)
            if type(sent) is WaitingFiles:  # new topics: written once their queues' files are made
                await sent.made
                self.broker.check_space()
                self.check_leader()
                sent = self.broker.write_waited(sent)
        except errors.DiskFull:  # the disk filled between looks: look again at the next send
            self.broker.disk.recheck_soon()
            raise
        if sent.message_ids:
            # Duplicates answer with the original's offset: it too must be durable before we reply.
            if self.replica_wait is None:  # (``barrier``'s wait, awaited here: no coroutine per send for it)
                fut = self._written_acknowledged()
                if fut is not None:
                    await fut
            else:
                await self.barrier()
        return sent

    async def recall(self, handle: str) -> RecallResult:
        """``Broker.recall`` with the fsync on the fsync thread: the tombstone is written, its
        target kept from delivery meanwhile (``chronoq.timer.recall``), and CANCELLED answered
        once it is durable and applied (under either flush policy: a recall is always durable)."""
        answer = self.broker.timer_recall(handle)
        await self.durable(answer.ticket)
        result = self.broker.timer_answered(answer)
        await self._on_a_replica(answer.ticket)
        return result

    async def reschedule(self, handle: str, deliver_at_ms: int) -> RescheduleResult:
        """``Broker.reschedule`` as ``recall``: the moved record durable before the new handle."""
        answer = self.broker.timer_reschedule(handle, deliver_at_ms)
        await self.durable(answer.ticket)
        result = self.broker.timer_answered(answer)
        await self._on_a_replica(answer.ticket)
        return result

    async def cancel_by_key(self, topic: str, key: str):
        """``Broker.cancel_by_key`` as ``recall``: the recall records durable before the answer."""
        if self.broker.timer.keys_building:
            await self._keys.built()
        answer = self.broker.timer_cancel_by_key(topic, key)
        await self.durable(answer.ticket)
        result = self.broker.timer_key_answered(answer)
        await self._on_a_replica(answer.ticket)
        return result

    async def _on_a_replica(self, ticket: int) -> None:
        """``replication = "sync"``: a recall's (reschedule's) record is on a replica before it is
        answered, as a send is (``barrier``): one answered by the primary alone would be undone by
        a failover, and the promoted node deliver what its producer was told was cancelled. The
        record is applied here all the same (raises ``errors.ReplicaTimeout``: outcome unknown,
        as any refused write; recalling again answers from the stored record)."""
        if self.replica_wait is not None and ticket > 0:
            await self._replica_holds(ticket)

    async def retention(self) -> tuple[list[str], Job | None]:
        """``Broker.retention`` with the roll-forward's fsync on the fsync thread: the records
        the timer still needs from the range to delete are written at the head, and the range is
        deleted once they are durable (their fsync failed: only what lies below the first).
        Returns the deleted paths and the store checkpoint to run on a worker thread next
        (``Store.retention_apply``)."""
        plan, durable = await self.retention_roll()
        return self.broker.retention_apply(plan, durable)

    async def retention_roll(self, slice_s: float = RETENTION_SLICE_S,
                             pause_s: float = RETENTION_PAUSE_S) -> tuple[RetentionPlan, bool]:
        """``retention``'s roll-forward: the records the keepers still need written in slices of
        ``slice_s`` with ``pause_s`` between (``Broker.retention_begin``), then made durable on
        the fsync thread. Returns (the plan, whether its records are durable) for
        ``Broker.retention_apply``. Cancelled midway: what was written stays (harmless, the
        records are idempotent) and nothing is deleted."""
        roll = self.broker.retention_begin()
        clock = self.broker.clock
        if roll.plan is None:  # (a start line: with the done one, operators and the crash test see the window)
            log.info("retention rolling forward what the timer still needs from [%d, %d) of the log", roll.lo, roll.cut)
        try:
            while (plan := roll.step(clock.monotonic_ns() + int(slice_s * 1e9))) is None:
                await asyncio.sleep(pause_s)
        finally:  # (cancelled: a bucket's read under way lets go of its watch now)
            roll.close()
        durable = True
        if plan.ticket:
            try:
                await self.durable(plan.ticket)
            except (errors.StorageError, OSError) as exc:
                durable = False
                log.warning("retention keeps the log from %d: syncing %d records it still needs failed (%s)",
                            plan.fallback, plan.kept, exc)
        return plan, durable

    async def barrier(self) -> None:
        """Return once everything written so far is acknowledged under the flush policy: durable
        and dispatched (``sync``), or dispatched (``async``); with ``replica_wait`` set (``replication
        = "sync"``), also durable on a replica (raises ``errors.ReplicaTimeout`` when none says so
        in time: the records stay stored here)."""
        if self.replica_wait is None:
            fut = self._written_acknowledged()
            if fut is not None:
                await fut
            return
        await self._replicated_waiter(self.store.log.written)
        self.check_leader()  # (the wait may have outlasted the lease)

    def _written_acknowledged(self) -> asyncio.Future | None:
        """``barrier`` without replication: None when everything written is acknowledged now
        (``async``: dispatched here), else the future that resolves once it is (``_waiter``)."""
        if not self.sync_policy:
            self.check_leader()
            store = self.store
            store.dispatch(wait_files=True)
            self.broker.notify_arrivals()
            if store.files_waited(store.log.written):  # new queues' files first (``FileWaits.made``)
                return self._files.wait(store.log.written)
            return None
        return self._waiter(self.store.log.written)

    def _replicated_waiter(self, ticket: int) -> asyncio.Future:
        """``barrier``'s one wait under ``replication = "sync"``: a future done once ``ticket`` is
        durable and dispatched here (a callback of its fsync's generation) and then held by a
        replica (``replica_wait``, chained from that callback), or failed with the first failure.
        One future, not a wait for each: a call that waits twice costs a task
        (``chronoq.server.h2calls``), and one report answers a whole group either way."""
        fut = self._loop.create_future()
        store = self.store
        if store.log.synced >= ticket and store.dispatched >= ticket:
            self._then_replica(fut, ticket, store.log.synced, None)
        else:
            self._generation_for(ticket).callbacks.append(functools.partial(self._then_replica, fut, ticket))
        return fut

    def _then_replica(self, fut: asyncio.Future, ticket: int, _synced: int, exc: BaseException | None) -> None:
        if fut.done():  # its caller was cancelled
            return
        if exc is not None:
            fut.set_exception(exc)
            return
        self.replica_wait(ticket, functools.partial(self._replica_settled, fut))

    def _replica_settled(self, fut: asyncio.Future, exc: BaseException | None) -> None:
        """A replica's answer for ``fut``: under ``replication_sync_fallback = "async"`` a
        ``errors.ReplicaTimeout`` answers OK all the same (counted, the switch logged)."""
        if fut.done():  # its caller was cancelled: no acknowledgement to make or count
            return
        if exc is None:
            if self.sync_degraded:
                self.sync_degraded = False
                log.warning("replication = sync: a replica reported again; sends wait for one from now on")
        elif isinstance(exc, errors.ReplicaTimeout) and self.sync_fallback:
            self.sync_fallbacks += 1
            if not self.sync_degraded:
                self.sync_degraded = True
                log.warning("replication = sync falls back to async (replication_sync_fallback): %s; sends are "
                            "acknowledged once durable on this primary alone until a replica reports again", exc)
            exc = None
        if exc is None:
            fut.set_result(None)
        else:
            fut.set_exception(exc)

    async def _replica_holds(self, ticket: int) -> None:
        """``replica_wait(ticket)`` awaited, its refusal (``errors.ReplicaTimeout``) turned into an
        answer under ``replication_sync_fallback = "async"`` (``_replica_settled``)."""
        fut = self._loop.create_future()
        self.replica_wait(ticket, functools.partial(self._replica_settled, fut))
        await fut

    async def durable(self, ticket: int) -> None:
        """Return once the commit log is fsynced to at least ``ticket`` and dispatched below it
        (under either policy: a caller that needs its record on disk says so with its ticket).
        A dispatch that failed (a consume-queue write on a full disk) is retried later: the
        records are durable, so the caller is answered without waiting for it."""
        fut = self._waiter(ticket)
        if fut is not None:
            await fut

    def _waiter(self, ticket: int) -> asyncio.Future | None:
        """``durable``'s wait: None when ``ticket`` is durable and dispatched already (the
        leadership checked), else a future of the generation that covers it."""
        store = self.store
        if store.log.synced >= ticket and store.dispatched >= ticket:
            self.check_leader()
            return None
        fut = self._loop.create_future()
        self._generation_for(ticket).waiters.append(fut)
        return fut

    @property
    def fenced(self) -> bool:
        """This node may have lost its leadership: it acknowledges nothing (timers need not tick)."""
        return self.leadership is not None and not self.leadership.holds()

    def check_leader(self) -> None:
        """Where writes are acknowledged (with ``_synced``), and before a receive takes messages or
        an ack settles one (``chronoq.server.messaging``: a fenced node's deliveries and acks would
        live on it only): refuse once leadership may be lost."""
        if self.leadership is not None and not self.leadership.holds():
            raise errors.PreconditionFailed(self.leadership.refusal())

    def after_durable(self, callback: Callable[[int, BaseException | None], None]) -> None:
        """Ask for an fsync of everything written now and a sync of the second-tier logs after
        it; ``callback(synced, None)`` runs on the loop once both are done and dispatched,
        ``callback(-1, exc)`` if it failed. Never waits."""
        gen = self._generation_for(self.store.log.written, logs=True)
        if gen.rung and not gen.logs:  # under way without the logs: the next fsync runs them
            gen = self._next_generation(logs=True)
        gen.logs = True
        gen.callbacks.append(callback)

    def add_written_listener(self, listener: Callable[[], None]) -> None:
        """``listener()`` on the loop at the end of each pass that rang the fsync thread: what it
        syncs is written (page cache) by then, and what the rest of the pass wrote too."""
        self._written_listeners.append(listener)

    def add_log(self, sync: Callable[[], None]) -> Callable[[], None]:
        """Have the fsync thread call ``sync()`` after each fsync of the commit log that
        ``after_durable`` asked for (it must not raise). Returns the function that removes it."""
        self._logs.append(sync)
        return lambda: self._logs.remove(sync) if sync in self._logs else None

    def _generation_for(self, ticket: int, logs: bool = False) -> _Generation:
        for gen in self._asked:
            if ticket <= gen.target or not gen.rung:
                return gen  # (not rung yet: the ring raises its target to what is written then)
        return self._next_generation(logs)

    def _next_generation(self, logs: bool = False) -> _Generation:
        """The generation after the last asked one (asked now while fewer than ``AHEAD`` are;
        ``logs``: a new one runs the second-tier logs, set before it may be rung)."""
        if self._waiting is not None:
            return self._waiting
        gen = _Generation()
        gen.logs = logs
        if len(self._asked) < AHEAD:
            self._ask(gen)
        else:
            self._waiting = gen
        return gen

    def _ask(self, gen: _Generation) -> None:
        """Ask the fsync thread for ``gen``: ring it for what is written now (``_ring``); writes
        later in this pass join the next generation. The written listeners (the replication
        shipper) hear at the end of the pass, so one answer ships what the whole pass wrote.

        Asked while another fsync runs, ``gen`` waits in the thread's pipe and starts as soon as
        that one ends (its target was written before it is rung, so the later fsync covers it).
        Measured against asking only once the running fsync's report reached the loop: one
        message per call from two processes (bench/send_receive.py --phase f, where nearly every
        fsync carries one message and the other arrives while it runs) +5-9%, single sends with 8
        in flight +10-25% (figures in docs/storage.md, "Write path"). The queued one is rung at
        the end of the pass, so every writer of that pass joins it (a burst costs two fsyncs).

        The first (none running) is rung at once: its fsync overlaps the rest of the pass.
        Measured against a ring at the end of the pass (a loop callback), one message per call
        from two processes (bench/send_receive.py --phase f's sends, 2 pairs): 3,429 -> 3,733 and 3,306 -> 3,848
        msgs/s, the fsync's own time 152-158 -> 115-127 us (the thread starts while this vCPU is
        still awake). The pure-Python build's thread needs the GIL, which this thread holds for
        the rest of the pass: there the ring stays at the end of the pass
        (``fsyncer.RING_AT_ONCE``), when the loop thread is about to sleep in epoll."""
        assert len(self._asked) < AHEAD and gen not in self._asked
        gen.target = self.store.log.written
        self._asked.append(gen)
        if fsyncer_mod.RING_AT_ONCE and len(self._asked) == 1:
            self._ring(gen)
        else:  # queued behind a running fsync: the rest of this pass's writes join it first
            self._loop.call_soon(self._ring, gen)
        if self._written_listeners:
            self._loop.call_soon(self._tell_written)

    def _ring(self, gen: _Generation) -> None:
        if gen.rung or gen not in self._asked or self._fsyncer is None:  # failed (``_fail_all``) or closed meanwhile
            return
        fd, gen.target = self.store.log.fsync_ask()  # what is written by now joins
        gen.rung = True
        self._fsyncer.ring(fd, gen.target, gen.logs)

    def _tell_written(self) -> None:
        for listener in self._written_listeners:
            listener()

    def _interval_fsync(self) -> None:
        """``async``: an fsync every flush interval while something is written and not durable."""
        self._periodic = self._loop.call_later(self._interval_s, self._interval_fsync)
        log_ = self.store.log
        if log_.written > log_.synced and not self._asked:
            self._generation_for(log_.written)

    def _sync_logs(self) -> None:
        """On the fsync thread, after an fsync rung with ``logs``: the second-tier logs."""
        for sync_log in list(self._logs):
            try:
                sync_log()
            except Exception:  # noqa: BLE001 - its own failures are its to report
                log.exception("syncing a second-tier log failed")

    def _reported(self) -> None:
        """The fsync thread's reports (``Fsyncer.take``), each finished on the loop."""
        if self._fsyncer is None:  # closed in this pass: ``close`` flushes what is left
            return
        for target, err, took_ns in self._fsyncer.take():
            if took_ns != fsyncer_mod.COVERED:
                self.fsyncs += 1
            if err:
                self._synced(-1, self.store.log.fsync_failed(err))
            else:
                self._synced(self.store.log.fsynced(target, took_ns), None)

    # ------------------------------------------------------------------ on the loop, after an fsync
    def _synced(self, synced: int, exc: BaseException | None) -> None:
        if exc is None and self.leadership is not None and not self.leadership.holds():
            # Fenced: another node may lead by now. Nothing written since is made visible or
            # acknowledged (timer copies included: their deliveries fail and stay pending).
            exc = errors.PreconditionFailed(self.leadership.refusal())
            self._fail_all(exc)
            return
        if exc is not None:
            log.error("fsync failed: %s", exc)
            self._fail_all(exc)
            return
        self._dispatch(synced)  # (under ``async`` sends dispatched already; other writers had not)
        running = self._asked[0] if self._asked else None
        if running is None or not running.rung or running.target > synced:
            # A periodic fsync (async), or one begun before the running one's target; before the
            # ring the target is not final (writers still join): the rung fsync's report finishes it.
            return
        del self._asked[0]
        if self._files.waits(running.target):  # answered once its files are made
            self._files.park(running.target, functools.partial(self._finish, running), synced)
        else:
            self._finish(running, synced, None)
        if self._waiting is not None:
            waiting, self._waiting = self._waiting, None
            self._ask(waiting)

    def _dispatch(self, synced: int) -> None:
        """Make durable records visible, in log order. A failure (a consume-queue write on a full
        disk) must not stop the committer: the records are durable, so their sends are still
        acknowledged, and the store keeps the undispatched batches, so a retry shortly after makes
        them visible."""
        try:
            self.store.dispatch(synced, wait_files=True)
        except Exception as exc:  # noqa: BLE001 - retried; the committer must keep running
            self._dispatch_failures += 1
            if self._dispatch_failures % 100 == 1:
                log.error("making written messages visible failed (%d in a row; retrying): %s",
                          self._dispatch_failures, exc)
            if self._dispatch_retry is None:
                self._dispatch_retry = self._loop.call_later(DISPATCH_RETRY_S, self._retry_dispatch)
        else:
            self._dispatch_failures = 0
        self.broker.notify_arrivals()

    def _dispatch_acknowledged(self) -> None:
        """``FileWaits``' dispatch once files are made: what is durable (``sync``), or all that
        is written (``async``, where a send is acknowledged once dispatched)."""
        log_ = self.store.log
        self._dispatch(log_.synced if self.sync_policy else log_.written)

    def _refusal(self) -> BaseException | None:
        """What ``FileWaits`` answers its parked acknowledgements with instead while fenced."""
        return errors.PreconditionFailed(self.leadership.refusal()) if self.fenced else None

    def _retry_dispatch(self) -> None:
        self._dispatch_retry = None
        self._dispatch(self.store.log.synced)

    def _finish(self, gen: _Generation, synced: int, exc: BaseException | None) -> None:
        for callback in gen.callbacks:
            try:
                callback(synced, exc)
            except Exception:  # noqa: BLE001 - one listener must not keep the others waiting
                log.exception("a durability callback failed")
        for fut in gen.waiters:
            settle(fut, exc)

    def _fail_all(self, exc: BaseException) -> None:
        """The data written since the last good fsync is not acknowledged: fail every waiter."""
        gens = self._asked + ([self._waiting] if self._waiting is not None else [])
        self._asked, self._waiting = [], None
        for gen in gens:
            self._finish(gen, -1, exc)

    # ------------------------------------------------------------------ shutdown
    async def close(self) -> None:
        """Stop the thread (after the fsync it may be running), then flush what is left."""
        if self._periodic is not None:
            self._periodic.cancel()
        self._keys.close()
        fsyncer, self._fsyncer = self._fsyncer, None
        self._files.stop()  # (a report from now on is answered below, after the flush)
        if fsyncer is not None:
            self._loop.remove_reader(fsyncer.reports)
            await asyncio.get_running_loop().run_in_executor(None, fsyncer.close)
        if self._dispatch_retry is not None:
            self._dispatch_retry.cancel()
        try:
            synced, exc = self.broker.flush(), None
        except Exception as failure:  # noqa: BLE001 - handed to the waiters
            synced, exc = -1, failure
        if exc is None and self.fenced:  # a fenced primary stepping down acknowledges nothing, even now
            exc = errors.PreconditionFailed(self.leadership.refusal())
        gens = self._asked + ([self._waiting] if self._waiting is not None else [])
        self._asked, self._waiting = [], None
        self._files.close(exc)
        for gen in gens:
            self._finish(gen, synced, exc)
