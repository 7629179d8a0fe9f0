"""The running broker process: open the store, run periodic work, serve, stop cleanly.

``chronoq serve`` calls ``run``. SIGTERM and SIGINT trigger a clean stop: front ends stop taking
requests, pending writes are flushed, a clean checkpoint is written, files are closed.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import signal
import sys
from typing import Callable

from chronoq.broker.broker import Broker
from chronoq.broker.committer import GroupCommitter
from chronoq.core.config import BrokerConfig
from chronoq.server import process, sdnotify

log = logging.getLogger("chronoq.runtime")

TIMER_IDLE_S = 1.0  # the timer loop looks again at least this often
# The timer's key index build (chronoq.timer.keyed, begun by the first keyed call after a start)
# reads schedule files on the loop: a slice at a time (KEY_BUILD_SLICE_MS, 5 ms), then this pause,
# a quarter of the loop at most. One 4 MB step per maintenance tick held the loop 25-80 ms every
# 200 ms until the build was done (bench/stalls.py --keyed).
KEY_BUILD_PAUSE_S = 0.015
# Trace events are written this many at a time (a few ms of encoding), the loop served between.
TRACE_WRITE_STEP = 1024
# Cyclic-GC thresholds while serving (CPython's default is 700, 10, 10). Every message allocates a
# few short-lived container objects, so the default runs a young collection every ~100 messages
# and a full one (tens of ms, a pause for every client) every few seconds: ~9% of the server's CPU
# in the send benchmark; with these, ~1%. Young garbage is still collected every 20k allocations.
GC_THRESHOLDS = (20_000, 20, 20)
SWITCH_INTERVAL_S = 0.001  # sys.setswitchinterval while serving (the default is 0.005)


class Runtime:
    """Owns the broker and everything that runs beside it in one event loop."""

    def __init__(self, config: BrokerConfig, say: Callable[[str], None] = print):
        self.config = config
        self.say = say
        self.broker: Broker | None = None
        self.committer: GroupCommitter | None = None
        self.metrics = None  # chronoq.server.metrics.BrokerMetrics, once the broker is open
        # The broker's consumer state (chronoq.server.consumers), opened before the front ends.
        self.pop = None   # chronoq.pop.service.PopService
        self.txns = None  # chronoq.features.transactions.Transactions
        self.schedules = None  # chronoq.features.schedules.book.ScheduleBook (chronoq.server.scheduling)
        self.loops = None  # chronoq.server.consumers.ConsumerLoops: the POP ticker, transaction checks
        self.history = None  # chronoq.server.history.HistoryRing: recent traffic, for the console
        self.loop_lag = None  # chronoq.server.looplag.LoopLag: how late the loop wakes (metrics)
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task] = []
        # What /healthz reports (chronoq.server.http): "ready" only between the ready line and the stop.
        self.state = "starting"
        self._early: list = []  # front ends started before recovery (HTTP: /healthz)
        self.crash_recovery = None  # a crash recovered before the broker opened (failover._local_position)
        # Front ends (the gRPC server, ...) register (start, stop) coroutine functions here.
        self.front_ends: list = []
        # Replication (chronoq.replication): this process's node id, and the primary's side once serving.
        from chronoq.replication.position import new_node_id

        self.node_id = new_node_id()
        self.replication = None  # chronoq.replication.shipper.PrimaryNode
        # Automatic failover (etcd_endpoints; chronoq.server.failover): the etcd session, and the
        # primary's duties (in-sync set, fencing) while it leads.
        self.coordinator = None  # chronoq.replication.etcd.EtcdCoordinator
        self.duty = None  # chronoq.server.failover.PrimaryDuty
        self.cluster = None  # chronoq.server.cluster.ClusterKeeper: placement and the route over every group

    def open_broker(self) -> Broker:
        from chronoq.core.clock import SYSTEM_CLOCK
        from chronoq.server.progress import StartupProgress

        sdnotify.notify(f"STATUS=opening {self.config.data_dir}: recovery")  # (systemctl status)
        # Verify and rebuild progress: INFO log lines every 2 s, and a bar when stderr is a terminal.
        progress = StartupProgress(SYSTEM_CLOCK.monotonic_ns)
        try:
            self.broker = Broker(self.config, progress=progress)
        finally:
            progress.close()
        earlier = self.crash_recovery
        if earlier is not None and self.broker.recovery.clean:
            # The crash was recovered by the look at the log's position before the campaign
            # (failover._local_position), which closed the store cleanly: report that recovery.
            self.broker.recovery = earlier
        self.say(f"chronoq data directory: {self.config.data_dir}")
        self.say(f"recovery: {self.broker.recovery.summary()}")
        from chronoq.server.metrics import BrokerMetrics

        self.metrics = BrokerMetrics(self.broker, pop=lambda: self.pop, source=self)
        return self.broker

    def open_consumers(self) -> None:
        """Open the POP service and the transactions' book and start their loops (on this event
        loop, with the committer already started: the loops write through it)."""
        from chronoq.server.consumers import ConsumerLoops, open_consumers

        self.pop, self.txns = open_consumers(self.broker, self.config)
        assert self.committer is not None, "start the committer first"
        self.loops = ConsumerLoops(self.pop, self.txns, self.committer, self.broker.clock)
        self._tasks.extend(self.loops.start())

    def _start_history(self, loop) -> None:
        """The traffic history ring and its sampler ([console] history_*; chronoq.server.history)."""
        from chronoq.core import console_settings
        from chronoq.server.history import HistoryRing, run_sampler

        chosen = console_settings.parse(self.config.extra.get("console"))
        self.history = HistoryRing(chosen.history_samples, chosen.history_interval_s)
        self._tasks.append(loop.create_task(run_sampler(self, self.history, self._stop), name="chronoq-history"))
        from chronoq.server.looplag import LoopLag, run_probe

        self.loop_lag = LoopLag()
        self._tasks.append(loop.create_task(run_probe(self.loop_lag, self._stop), name="chronoq-loop-lag"))

    def close_consumers(self) -> None:
        """Stop the loops, then persist and close the state (before the broker closes)."""
        from chronoq.server.consumers import close_consumers

        if self.loops is not None:
            self.loops.close()
        pop, txns, self.pop, self.txns, self.loops = self.pop, self.txns, None, None, None
        close_consumers(pop, txns)

    async def _periodic(self) -> None:
        assert self.broker is not None
        tick = min(self.config.checkpoint_interval_ms, 200) / 1000
        last_retention = asyncio.get_running_loop().time()
        rolling: asyncio.Task | None = None  # retention's roll-forward, in slices (its own task)
        try:
            while not self._stop.is_set():
                try:
                    await asyncio.wait_for(self._stop.wait(), tick)
                except asyncio.TimeoutError:
                    pass
                try:
                    await self._write_trace_in_steps()
                    # Checkpoint fsyncs run on a worker thread (chronoq.core.jobs); one job at a time, and
                    # the next maintenance only after all of them finished.
                    jobs = self.broker.maintenance_jobs(build_keys=False)  # (``_build_key_index``)
                    try:
                        for job in jobs:
                            await _run_job(job)
                    finally:  # cancelled (shutdown): a job begun but not run is given up, cleanly
                        for job in jobs:
                            if not job.finished:
                                job.finish(asyncio.CancelledError())
                    now = asyncio.get_running_loop().time()
                    if rolling is None and now - last_retention >= self.config.retention_interval_s:
                        # The roll-forward takes many slices (GroupCommitter.retention_roll): a task of
                        # its own, so checkpoints go on meanwhile; the deletion and its checkpoint job
                        # are done here, between two maintenance passes (one job at a time).
                        rolling = asyncio.get_running_loop().create_task(self.committer.retention_roll(),
                                                                         name="chronoq-retention")
                    elif rolling is not None and rolling.done():
                        last_retention, finished, rolling = now, rolling, None
                        await self._apply_retention(*finished.result())
                except Exception:  # keep serving; the next tick retries
                    log.exception("periodic maintenance failed")
        finally:
            if rolling is not None:  # (shutdown: rolled records stay, harmless; nothing is deleted)
                rolling.cancel()
                await asyncio.gather(rolling, return_exceptions=True)

    async def _apply_retention(self, plan, durable: bool) -> None:
        deleted, job = self.broker.retention_apply(plan, durable)
        for path in deleted:
            log.info("retention deleted %s", path)
        if job is not None:  # the store checkpoint naming the queues' new starts
            await _run_job(job)

    async def _build_key_index(self) -> None:
        """The timer's key index build, a slice at a time (``keys_slice``) with KEY_BUILD_PAUSE_S
        between; idle, it looks every maintenance tick. (A keyed call that waits for the build
        reads slices too, with no pause: ``KeyIndexWait.built``, chronoq.broker.keywait.)"""
        timer = self.broker.timer
        tick = min(self.config.checkpoint_interval_ms, 200) / 1000
        while not self._stop.is_set():
            pause = tick
            try:
                if timer.keys_to_read:
                    timer.keys_slice()
                    pause = KEY_BUILD_PAUSE_S
            except Exception:  # keep serving; the next slice retries (keyed calls search unread buckets meanwhile)
                log.exception("building the timer's key index failed")
            try:
                await asyncio.wait_for(self._stop.wait(), pause)
            except asyncio.TimeoutError:
                pass

    async def _write_trace_in_steps(self) -> None:
        """Write due trace events a step at a time, yielding between steps: encoding a second of
        busy traffic (tens of thousands of events) at once held timer ticks for tens of ms."""
        broker = self.broker
        trace = broker.trace
        if trace is None or not trace.due(broker.clock.wall_ms()):
            return
        events = trace.take_events()
        done = 0
        try:
            while done < len(events):
                broker.write_trace_events(events[done:done + TRACE_WRITE_STEP])
                done += TRACE_WRITE_STEP
                await asyncio.sleep(0)
        finally:  # cancelled (shutdown): what was taken is still written, at once
            broker.write_trace_events(events[done:])

    async def _timer_loop(self) -> None:
        """Deliver due timers: sleep until the timer's next deadline or an earlier wake-up.

        Writing due copies never waits for an fsync: the tick writes them (page cache) at their
        due time and returns its ticket; the committer fsyncs it on its thread with everything
        else written meanwhile, then (on this loop, in log order) publishes them, and this loop
        hands the result to the timer (``timer_synced``), which completes its deliveries. Copies
        that fall due while an fsync runs are written on time and their ticket joins the next
        fsync (group commit), so a slow fsync delays when they become visible, never when they
        are written, and the tick after it is not a backlog.
        """
        assert self.broker is not None and self.committer is not None
        broker, committer = self.broker, self.committer
        wake = asyncio.Event()
        loop = asyncio.get_running_loop()
        broker.timer.add_wakeup_listener(lambda: loop.call_soon_threadsafe(wake.set))
        asked = 0  # the highest ticket asked of the committer and not yet reported

        def synced(upto: int, exc: BaseException | None) -> None:
            # Completions free room in full lanes (a full lane offers no deadline: it waits for this).
            nonlocal asked
            if exc is not None or upto >= asked:
                asked = 0
            wake.set()
            if exc is not None:
                broker.timer_sync_failed(exc)
                return
            try:
                broker.timer_synced(upto)
            except Exception:  # noqa: BLE001 - logged; the next tick asks again
                log.exception("completing timer deliveries after an fsync failed")

        failures = 0
        while not self._stop.is_set():
            if committer.fenced:  # a primary that lost its lease fires nothing (its copies are writes too)
                await asyncio.sleep(TIMER_IDLE_S)
                continue
            wake.clear()  # before the tick: a deadline added during it ends the next wait at once
            try:
                tick = broker.timer_step()
                if tick.ticket > asked:
                    asked = tick.ticket
                    committer.after_durable(synced)
                deadline_ms = tick.deadline_ms
                failures = 0
            except Exception:  # retry with back-off; the timer itself blocks a failing lane
                if failures % 100 == 0:
                    log.exception("timer tick failed (%d in a row)", failures + 1)
                failures += 1
                deadline_ms = broker.clock.wall_ms() + min(1000, 10 * failures)
            delay = TIMER_IDLE_S if deadline_ms is None else (deadline_ms - broker.clock.wall_ms()) / 1000
            if delay <= 0:
                await asyncio.sleep(0)  # more is due now: yield to the other tasks, then go on
                continue
            try:
                await asyncio.wait_for(wake.wait(), min(delay, TIMER_IDLE_S))
            except asyncio.TimeoutError:
                pass

    async def _recover(self) -> Broker:
        """Open the broker (recovery) on a worker thread, with the HTTP front end already
        listening: the loop answers ``/healthz`` with 503 "not ready: recovering" meanwhile. A
        stop asked for during recovery takes effect once it is over (it cannot be cut short)."""
        from chronoq.server import front_ends

        try:
            for front_end in front_ends.build_early(self):
                await front_end.start()
                self.front_ends.append(front_end)
                self.say(f"{front_end.describe()} (/healthz: not ready until recovery is over)")
            self._early = list(self.front_ends)
            self.state = "recovering"
            return await asyncio.get_running_loop().run_in_executor(None, self.open_broker)
        except BaseException:
            for front_end in reversed(self.front_ends):
                await front_end.stop()
            self.front_ends.clear()
            raise

    def request_stop(self) -> None:
        self._stop.set()

    async def serve(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.request_stop)
        if self.config.priority_boost:
            self.say(process.raise_priority(self.config.priority_boost))
        warning = self.config.open_replica_warning()
        if warning:
            log.warning("%s", warning)
        epoch = 0
        if self.config.replica_of and not self.config.rejoin:  # a promoted directory stays the primary
            import dataclasses

            from chronoq.replication.role import serve_as_primary_message

            stays = serve_as_primary_message(self.config.data_dir, self.config.replica_of)
            if stays is not None:
                self.say(stays)
                self.config = dataclasses.replace(self.config, replica_of="")
        if self.config.etcd_list:  # the role comes from etcd (chronoq.server.failover)
            await self._serve_by_etcd()
            return
        if self.config.replica_of:  # a replica until promoted (chronoq.server.replica)
            from chronoq.server.replica import serve_replica

            epoch = await serve_replica(self)
            if epoch is None:
                self.say("chronoq stopped cleanly")
                return
            self.say(f"promoted to primary: epoch {epoch}; opening the broker")
        await self._serve_primary(epoch)
        self.say("chronoq stopped cleanly")

    async def _serve_by_etcd(self) -> None:
        """The role loop with etcd: take a role (follow, wait or campaign: ``failover.take_role``),
        serve as the primary while leading; a primary that was fenced steps down (``PrimaryDuty``
        took a fresh lease; ``_serve_primary`` closed the broker) and goes around: it follows
        whoever leads now, or campaigns for a new epoch."""
        from chronoq.replication.cluster import claim_group  # two groups cannot share a name
        from chronoq.server import failover

        loop = asyncio.get_running_loop()
        self.coordinator = coord = await loop.run_in_executor(None, failover.start_coordinator, self.config,
                                                              self.node_id)
        try:
            await coord.call(claim_group(coord, self.config.data_dir, coord.clock.wall_ms()))
            while not self._stop.is_set():
                epoch = await failover.take_role(self)
                if epoch is None or not await self._serve_primary(epoch):
                    break
                self.say(f"etcd: stepped down from epoch {epoch}: the broker is closed; taking a role again "
                         "(following the leader, or campaigning if eligible)")
        finally:  # after the last acknowledgement: the lease (and a leader key) go now
            await loop.run_in_executor(None, coord.close)
        self.say("chronoq stopped cleanly")

    async def _serve_primary(self, epoch: int) -> bool:
        """Open the broker and serve as the primary until a stop (False) or, with etcd, until this
        primary was fenced and holds a fresh lease (True: it stepped down; everything is closed)."""
        loop = asyncio.get_running_loop()
        broker = await self._recover()
        self.committer = GroupCommitter(broker)
        if self.coordinator is not None:  # acknowledge only while the lease holds (from the epoch record on)
            from chronoq.server.failover import PrimaryDuty

            self.duty = PrimaryDuty(self, epoch)
            self.committer.leadership = self.duty.leadership
        self.committer.start()
        if epoch:  # the epoch record, durable before anything else is served
            from chronoq.replication.position import epoch_record

            written = broker.write_records([epoch_record(epoch, self.node_id, broker.clock.wall_ms())])[-1]
            await self.committer.durable(written.commit_offset + written.size)
        # The schedule files' journal and .done fsyncs on the committer's thread (timer/schedfiles.py),
        # new bucket files made on a thread of their own (timer/newfiles.py).
        timer, committer = broker.timer, self.committer
        remove_files_log = committer.add_log(timer.files.sync_side)
        timer.attach_files_syncer(lambda: committer.after_durable(lambda _synced, _exc: timer.files_synced()),
                                  made=lambda: loop.call_soon_threadsafe(timer.files_made))
        self._tasks.append(loop.create_task(self._periodic(), name="chronoq-periodic"))
        self._tasks.append(loop.create_task(self._timer_loop(), name="chronoq-timer"))
        self._tasks.append(loop.create_task(self._build_key_index(), name="chronoq-key-index"))
        from chronoq.server import front_ends

        self.state = "starting the gRPC front end"
        gc_thresholds, switch_interval = gc.get_threshold(), sys.getswitchinterval()
        # Worker threads (fsync completions, checkpoints) run a little Python; the loop thread
        # must not wait the default 5 ms for the GIL behind them (timer releases are due to the ms).
        sys.setswitchinterval(SWITCH_INTERVAL_S)
        stepped_down = False
        try:
            self.open_consumers()
            self._start_history(loop)
            from chronoq.replication.shipper import PrimaryNode

            self.replication = PrimaryNode(broker, self.pop, self.node_id)
            self.committer.add_written_listener(self.replication.written)
            if self.config.replication == "sync":  # acknowledgements wait for a replica too
                self.committer.replica_wait = self.replication.replica_wait
            if self.duty is not None:  # etcd: the in-sync set, published; under sync every member acks
                self.replication.on_report = self.duty.report
                tracker = self.duty.tracker  # (its ``published`` set is replaced at each publication)
                self.replication.published = lambda endpoint: endpoint in tracker.published
                if self.config.replication == "sync":
                    self.committer.replica_wait = self.duty.replica_wait
                self._tasks.append(loop.create_task(self.duty.run(), name="chronoq-leader"))
                from chronoq.server.cluster import ClusterKeeper  # broker groups: placement, one route

                self.cluster = ClusterKeeper(self)
                self.cluster.start()
                try:  # (the first snapshot: a route asked at once names every group)
                    await asyncio.wait_for(self.cluster.ready.wait(), 5)
                except asyncio.TimeoutError:
                    log.warning("no snapshot of the cluster from etcd within 5 s: routes are local until one comes")
            from chronoq.server.scheduling import open_schedules, run_schedules

            self.schedules, wake = open_schedules(broker), asyncio.Event()
            self.schedules.on_change = wake.set
            self._tasks.append(loop.create_task(run_schedules(self.schedules, self.committer, self._stop, wake),
                                                name="chronoq-schedules"))
            for front_end in front_ends.build(self):
                await front_end.start()
                self.front_ends.append(front_end)
            # What start-up made (modules, protobuf descriptors, recovered state) lives for good:
            # keep it out of every later full collection.
            gc.freeze()
            gc.set_threshold(*GC_THRESHOLDS)
            # gRPC first, as the ready line has always read (scripts parse it), then HTTP.
            named = sorted(self.front_ends, key=lambda fe: fe in self._early)
            ready = "chronoq is ready" + "".join(f"; {fe.describe()}" for fe in named)
            self.state = "ready"
            self.say(ready)
            sys.stdout.flush()
            sdnotify.notify("READY=1", f"STATUS={ready}")  # under systemd (Type=notify): started
            stepped_down = await self._until_stop_or_step_down()
            self.state = "stopping"
            if stepped_down:
                sdnotify.notify("STATUS=fenced: stepping down (closing the broker, then following the leader)")
                self.say(f"chronoq stepping down: this primary was fenced ({self.duty.leadership.refusal()}); "
                         "closing the broker (its unacknowledged writes stay unacknowledged)")
            else:
                sdnotify.notify("STOPPING=1", "STATUS=stopping: flushing and writing a clean checkpoint")
                self.say("chronoq stopping: flushing and writing a clean checkpoint")
        finally:  # also when a front end fails to start: close what is open, cleanly
            self.state = "stopping"
            for front_end in reversed(self.front_ends):
                await front_end.stop()
            if self.cluster is not None:
                self.cluster.stop()
            self.close_consumers()
            for task in self._tasks:
                task.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)
            timer.attach_files_syncer(None)  # the close's checkpoint fsyncs in place
            remove_files_log()
            await self.committer.close()  # (fenced: what still waits is refused, not acknowledged)
            broker.close()
            gc.set_threshold(*gc_thresholds)  # the process is the caller's again
            gc.unfreeze()
            sys.setswitchinterval(switch_interval)
            # Nothing of this term is left for a next one (a step-down goes around: chronoq.server.failover).
            self.front_ends, self._early, self._tasks = [], [], []
            self.broker = self.committer = self.metrics = self.history = self.schedules = self.loop_lag = None
            self.replication = self.duty = self.cluster = None
        return stepped_down

    async def _until_stop_or_step_down(self) -> bool:
        """Wait for a stop (False) or, with etcd, for this primary's step-down (True)."""
        if self.duty is None:
            await self._stop.wait()
            return False
        stop = asyncio.ensure_future(self._stop.wait())
        step = asyncio.ensure_future(self.duty.stepped_down.wait())
        try:
            await asyncio.wait([stop, step], return_when=asyncio.FIRST_COMPLETED)
        finally:
            stop.cancel()
            step.cancel()
        return self.duty.stepped_down.is_set() and not self._stop.is_set()


async def _run_in_thread(fn, done, failed) -> None:
    """``fn()`` on the default executor, then ``done(result)`` or ``failed(exc)`` back on the loop.

    A cancellation (shutdown) still waits for ``fn`` and calls ``done``/``failed`` before it is
    re-raised: the broker is closed right after, and must not race a thread still syncing.
    """
    fut = asyncio.get_running_loop().run_in_executor(None, fn)
    try:
        result = await asyncio.shield(fut)
    except asyncio.CancelledError:
        await asyncio.wait([fut])
        _settle(fut, done, failed)
        raise
    except Exception as exc:  # noqa: BLE001 - handed to ``failed``
        failed(exc)
    else:
        done(result)


def _settle(fut, done, failed) -> None:
    exc = fut.exception()
    if exc is not None:
        failed(exc)
    else:
        done(fut.result())


async def _run_job(job) -> None:
    """Run a ``chronoq.core.jobs.Job`` on a worker thread and finish it on the loop (logged on failure)."""
    def failed(exc: BaseException) -> None:
        job.finish(exc)
        log.error("%s failed (retried later): %s", job.name, exc)

    await _run_in_thread(job.run, lambda _result: job.finish(None), failed)


def run(config: BrokerConfig) -> None:
    from chronoq.server.logsetup import announce

    log.debug(process.keep_freed_memory())  # (this process is the broker's alone, not an in-process Runtime)
    log.debug(process.raise_open_files_limit())  # before the store opens: its file budget reads the limit
    runtime = Runtime(config, say=announce)  # the start-up story on stdout (logsetup)
    try:
        import uvloop  # optional: a faster event loop when installed

        uvloop.run(runtime.serve())
    except ImportError:
        asyncio.run(runtime.serve())
