"""The replica's side: pull from the primary, append the bytes unchanged, fsync, report back.

One loop (``run``): a pull names this replica's durable position (``position``); the answer's
commit-log bytes are appended in the segment they belong to (``Store.append_shipped``, the
store's own append), fsynced, then dispatched into the consume queues as recovery's replay
would (``Store.dispatch_shipped``); then the POP log bytes (a new generation is written to a
temporary file, fsynced and renamed into place, as the primary's own compaction does; an
appended batch is written at the file's end and fsynced) and the changed snapshot files
(atomically, as their owners write them). The next pull reports the new position: that is the
report of what is durable here. The file work runs on one worker thread of the follower's own, an answer at
a time: ``write`` (commit log, POP log, snapshots, durable) then, on the same thread and in the
same job, ``dispatch`` (the consume queues, and a checkpoint now and then). The loop is told as
soon as ``write`` is done, so the next pull (which reports the durable position) goes out while
the dispatch runs, and the next answer's job waits behind it on the one thread. One hand-over
each way per answer (a job per step took two more thread wake-ups an answer). With a timer (``timer``, ``chronoq.server.replica``), ``dispatch``
also feeds it the dispatched records (``TimerService.follow``: absorbed, never fired) and runs its
``maintenance`` (its checkpoints); a rejoin closes it before the cut and opens it again after.

A crash anywhere leaves a state the store's recovery repairs (a torn commit-log tail is cut:
``chronoq.store.recovery``; a torn POP log tail likewise at promotion: ``chronoq.pop.poplog``)
and a position the next pull resumes from. The bytes come before the primary's own fsync of them
(``chronoq.replication.shipper``): a primary whose machine stopped may come back without some of
them, and then answers with a ``Divergence`` at the end its log restarted from, in this node's
own epoch: cut as a rejoin is, below.

A refusal (``PRECONDITION_FAILED``: pointed at itself, at a replica, not a prefix; or refused
credentials) stops the loop with ``refused`` set: nothing was written. Unreachable primaries
are retried with back-off, for ever (promotion is an operator's decision, ``chronoq promote``).

Rejoining after a failover (``chronoq.replication.divergence``): each pull names this node's
newest epoch and where it began; a primary whose next epoch began before this log's end answers
with a ``Divergence`` instead of bytes. ``rejoin`` then checks the bytes before the point are the
primary's (else refused, nothing changed), and that the cut stays within ``max_cut_bytes`` (else
refused, saying what it would cut), says what it cuts, closes the store, truncates
(``chronoq.store.truncate``: the intent first, the cut bytes kept aside, the derived state and
the copies the primary ships again deleted, the log cut, the intent cleared; a crash anywhere
is finished at the next open), opens the store again (recovery rebuilds the consume queues from
the remaining log) and follows from the point.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import time

from chronoq.core import errors, fsutil
from chronoq.protocol.rocketmq import status as codes
from chronoq.replication import position, role
from chronoq.store import truncate

log = logging.getLogger("chronoq.replication")

WAIT_MS = 1000
MAX_BYTES = 4 << 20
RETRY_MIN_S, RETRY_MAX_S = 0.1, 2.0
# Answers that stop following: the primary (or what it is) will not ship to this replica.
REFUSALS = frozenset({codes.Code.PRECONDITION_FAILED, codes.Code.UNAUTHORIZED, codes.Code.FORBIDDEN})
# A rejoin cuts at most this much of the log unless configured otherwise (rejoin_max_truncate_bytes).
MAX_CUT_BYTES = 256 << 20
# What a rejoin deletes besides the cut bytes (paths relative to the data directory): state
# derived from the log that may name cut records (rebuilt from the remaining log: the consume
# queues and their checkpoint at the next open, the timer's files and the transactions' and
# staging cursors at promotion), and the copies of the primary's POP log and position-bearing
# snapshots, which the primary ships again whole (a local one of the same generation or name
# would otherwise be kept, or appended to). Kept: topics.json and groups.json (configuration,
# shipped when the primary has them), commitlog/lost.json (an operator's decision), the timer's
# quarantine (forensic copies). ``rejoin_paths`` adds the timer's files.
REJOIN_REMOVE = ("consumequeue", "checkpoint.json", "transactions.json", "staging.json", "offsets.json",
                 "schedules.json", position.POP_DIR)
TIMER_DIR, TIMER_KEEP = "timer", ("quarantine",)


def _settled(fut: asyncio.Future, exc: BaseException | None) -> None:
    if not fut.done():  # (the waiting pull loop may be gone: stopped)
        if exc is None:
            fut.set_result(None)
        else:
            fut.set_exception(exc)


def rejoin_paths(data_dir: str) -> tuple[str, ...]:
    try:
        timer = sorted(os.listdir(os.path.join(data_dir, TIMER_DIR)))
    except FileNotFoundError:
        timer = []
    return REJOIN_REMOVE + tuple(os.path.join(TIMER_DIR, n) for n in timer if n not in TIMER_KEEP)


class Follower:
    def __init__(self, store, data_dir: str, client, node_id: str, endpoint: str, clock,
                 checkpoint_interval_ms: int = 1000, reopen=None, max_cut_bytes: int = MAX_CUT_BYTES,
                 sync_acks: bool = False, timer=None, open_timer=None) -> None:
        self.store = store
        # The replica's timer (``TimerService`` with ``following``): fed each dispatch, checkpointed
        # by its own ``maintenance``; ``open_timer(store)`` makes it again after a rejoin's cut.
        self.timer = timer
        self.open_timer = open_timer
        self.reopen = reopen  # () -> Store on the same directory (a rejoin closes and truncates it)
        self.max_cut_bytes = max_cut_bytes
        self.sync_acks = sync_acks  # this node acknowledged under replication = sync (what a cut may lose)
        self.rejoined: list[str] = []  # what each rejoin cut, as said in the log
        self.data_dir = data_dir
        self.client = client  # chronoq.replication.client.ReplicationClient to the primary
        self.node_id = node_id
        self.endpoint = endpoint
        self.clock = clock
        self.checkpoint_interval_ms = checkpoint_interval_ms
        self.pop_generation, self.pop_offset = position.pop_position(data_dir)
        self.snapshot_versions: dict[str, str] = {}  # the primary's versions held here
        self.state = "connecting"
        self.refused: str | None = None
        self.primary_synced = -1
        self.primary_epoch = -1
        self.primary_pop_generation = 0  # the newest POP log generation the primary reported
        self.caught_up_ms: int | None = None  # last time this replica held all the primary had
        self.pulls = 0
        # Kept by the writer thread (``write``, ``dispatch``): the store is theirs while they run.
        self.history = position.epoch_history(store)
        self.epoch = self.history[-1][0]
        self._tail = position.tail(store, store.log.synced)
        self._stopping = False
        self._pull: asyncio.Future | None = None
        # The file work's one thread (``_apply``: write then dispatch, an answer at a time; rejoins).
        self._worker = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="chronoq-follow")
        self._dispatching: concurrent.futures.Future | None = None  # the last answer's job, maybe running
        self._failed: BaseException | None = None  # a dispatch's failure (``_apply``)
        self._checkpointed_ms = clock.wall_ms()

    @property
    def commit(self) -> int:
        return self.store.log.synced

    def lag_bytes(self) -> int:
        return max(0, self.primary_synced - self.commit) if self.primary_synced >= 0 else -1

    def lag_ms(self) -> int:
        if self.caught_up_ms is None:
            return -1
        return 0 if self.lag_bytes() == 0 else max(0, self.clock.wall_ms() - self.caught_up_ms)

    def request(self):
        apb = self.client.apb
        tail_from, crc = self._tail
        return apb.PullRequest(
            node_id=self.node_id, endpoint=self.endpoint, tail_from=tail_from, tail_crc=crc, wait_ms=WAIT_MS,
            max_bytes=MAX_BYTES, snapshot_versions=self.snapshot_versions,
            position=apb.LogPosition(commit=self.commit, pop_generation=self.pop_generation,
                                     pop_offset=self.pop_offset),
            epoch=self.history[-1][0], epoch_start=self.history[-1][1])

    # ------------------------------------------------------------------ the loop
    async def run(self) -> None:
        try:
            await self._follow()
        finally:
            try:
                await self._settle()
            finally:
                self._worker.shutdown(wait=False)

    async def _follow(self) -> None:
        import grpc

        backoff = RETRY_MIN_S
        while not self._stopping:
            asked = self.history[-1]
            self._pull = asyncio.ensure_future(self.client.pull(self.request(), WAIT_MS / 1000))
            try:
                resp = await self._pull
            except asyncio.CancelledError:
                if self._stopping:
                    break
                raise
            except grpc.aio.AioRpcError as exc:
                self.state = f"unreachable: {exc.code().name}: {(exc.details() or '').strip()}"
                log.warning("replica: pulling from %s failed (%s); retrying", self.client.endpoint, self.state)
                await self._sleep(backoff)
                backoff = min(RETRY_MAX_S, backoff * 2)
                continue
            finally:
                self._pull = None
            if resp.status.code != codes.OK:
                if resp.status.code in REFUSALS:
                    self.refused = f"{codes.Code.Name(resp.status.code)}: {resp.status.message}"
                    self.state = f"refused: {self.refused}"
                    log.error("replica: %s refuses to ship to this replica: %s", self.client.endpoint, self.refused)
                    return
                self.state = f"primary error: {resp.status.message}"
                await self._sleep(backoff)
                backoff = min(RETRY_MAX_S, backoff * 2)
                continue
            backoff = RETRY_MIN_S
            loop = asyncio.get_running_loop()
            if resp.HasField("divergence"):
                await self._settle()  # (the epoch history follows the dispatch of the copied records)
                if asked != self.history[-1]:
                    continue  # the pull named an epoch this log has passed since: ask again
            refusal = self._refusal(resp)
            if refusal is not None:
                self.refused = refusal
                self.state = f"refused: {refusal}"
                log.error("replica: cannot follow %s: %s", self.client.endpoint, refusal)
                return
            if resp.HasField("divergence"):
                await self._settle()
                await loop.run_in_executor(self._worker, self.rejoin, resp.divergence)
                continue
            # Not cancelled by ``stop``: a write in progress finishes before the store closes. The
            # dispatch runs while the next pull (which reports the position) is under way.
            written = loop.create_future()
            self._dispatching = self._worker.submit(self._apply, resp, loop, written)
            await asyncio.shield(written)

    def _apply(self, resp, loop, written: asyncio.Future) -> None:
        """The worker's job for one answer: ``write``, the loop told (``written``), ``dispatch``.
        A dispatch that failed stops the following: the next answer is not written (its pull
        loop raises what the dispatch raised)."""
        try:
            if self._failed is not None:
                raise self._failed
            self.write(resp)
        except BaseException as exc:
            loop.call_soon_threadsafe(_settled, written, exc)
            raise
        loop.call_soon_threadsafe(_settled, written, None)
        # Let the loop take the interpreter now, to send the next pull (the report of this write),
        # rather than when the dispatch below first blocks: measured under sync load, the loop
        # waited 0.36-0.52 ms (p50) for it without this, 0.06-0.11 ms with it.
        time.sleep(0)
        try:
            self.dispatch(resp)
        except BaseException as exc:
            self._failed = exc
            raise

    async def _settle(self) -> None:
        """Wait for the last answer's job (its dispatch: before a rejoin, a divergence's check,
        and before the store closes); raises what it raised."""
        if self._dispatching is not None:
            dispatching, self._dispatching = self._dispatching, None
            if not dispatching.done():
                await asyncio.shield(asyncio.wrap_future(dispatching))
            dispatching.result()

    async def _sleep(self, seconds: float) -> None:
        for _ in range(int(seconds / 0.05) + 1):
            if self._stopping:
                return
            await asyncio.sleep(0.05)

    async def stop(self) -> None:
        """End the loop after the write in progress (a pull waiting for news is dropped)."""
        self._stopping = True
        if self._pull is not None:
            self._pull.cancel()

    # ------------------------------------------------------------------ rejoining
    def _refusal(self, resp) -> str | None:
        """Why this node must not apply ``resp`` (None: it may). Checked before anything changes."""
        if resp.epoch < self.epoch:
            return (f"{self.client.endpoint} is at epoch {resp.epoch}, older than this node's {self.epoch}: this node "
                    "was promoted after that one's term; it will not follow an older primary (serve it as the "
                    "primary, or point --replica-of at the newest one)")
        if not resp.HasField("divergence"):
            return None
        div, end = resp.divergence, self.commit
        if not self.store.log.min_offset <= div.offset < end or self.reopen is None:
            return f"the primary's divergence point {div.offset} is not within this log ({self.store.log.min_offset}..{end})"
        mine = position.tail(self.store, div.offset)
        if mine != (div.tail_from, div.tail_crc):
            return (f"this log's bytes before the epoch boundary {div.offset} differ from the primary's: a history "
                    "the epochs do not explain (another cluster, or one that diverged); nothing was cut")
        if end - div.offset > self.max_cut_bytes:
            return (f"rejoining would cut {end - div.offset} bytes of this log past the "
                    f"start of the primary's epoch {div.epoch} at {div.offset}, more than rejoin_max_truncate_bytes "
                    f"({self.max_cut_bytes}); nothing was cut (raise it, or copy the primary's data directory afresh)")
        return None

    def rejoin(self, div) -> None:
        """Truncate this log at ``div.offset`` and open it again (``_refusal`` passed). Worker thread."""
        store, end = self.store, self.commit
        summary = truncate.describe(store.log, div.offset, end)
        cut_epochs = [e for e, start in self.history if start >= div.offset]
        topics = ", ".join(f"{t} {n}" for t, n in sorted(summary.topics.items(), key=lambda kv: -kv[1])[:8])
        plan = truncate.Plan(div.offset, end, rejoin_paths(self.data_dir),
                             note=f"rejoin {self.client.endpoint} at epoch {div.epoch}")
        acked = ("none of them was acknowledged to a client (replication = sync)" if self.sync_acks else
                 "any of them acknowledged to a client (replication = async) is lost from the cluster")
        if div.epoch == self.epoch:  # (shipper._lost_tail: the same term, a primary that came back shorter)
            why = (f"its log restarted at {div.offset} without bytes it had shipped here before their fsync (its "
                   "machine stopped)")
            acked = "none of them was acknowledged to a client (that primary acknowledges only what it fsynced)"
        else:
            why = f"its epoch {div.epoch} began at {div.offset}"
        said = (f"rejoining {self.client.endpoint}: {why}; this log ends at {end}: cutting {summary.bytes} bytes, "
                f"{summary.records} records ({topics or 'none'})"
                f"{f', epochs {cut_epochs}' if cut_epochs else ''} written here after that point; {acked}; "
                f"the cut bytes are kept in {os.path.join(self.data_dir, plan.aside)}")
        log.warning("replica: %s", said)
        self.rejoined.append(said)
        if self.timer is not None:  # (its files are removed with the cut: rebuilt from the remaining log)
            self.timer.close()
            self.timer = None
        store.close()
        truncate.plan(self.data_dir, plan)
        truncate.run(self.data_dir, plan)
        self.store = store = self.reopen()
        assert store.log.synced <= div.offset, (store.log.synced, div.offset)
        if self.open_timer is not None:
            self.timer = self.open_timer(store)
        log.warning("replica: cut at %d; reopened: %s", div.offset, store.report.summary())
        self.history = position.epoch_history(store)
        self.epoch = self.history[-1][0]
        self._tail = position.tail(store, store.log.synced)
        self.pop_generation, self.pop_offset = position.pop_position(self.data_dir)
        self.snapshot_versions = {}
        self.state = "rejoined"

    # ------------------------------------------------------------------ applying an answer
    def write(self, resp) -> None:
        """Write what ``resp`` carries, durably, in order: commit log, POP log, snapshots."""
        store = self.store
        if self.pulls == 0 and role.clear(self.data_dir):  # following now: no longer the primary it was
            log.warning("replica: %s answered: this data directory follows it now (role.json removed)",
                        self.client.endpoint)
        data = resp.commit_bytes  # (once: each read of a protobuf bytes field is a copy of it)
        if data:
            store.append_shipped(resp.commit_offset, resp.segment_base, data)
            store.sync()
            self._tail = position.tail(store, store.log.synced)
        if resp.pop_generation:
            self._apply_pop(resp.pop_generation, resp.pop_offset, resp.pop_bytes)
        for snap in resp.snapshots:
            path = os.path.join(self.data_dir, snap.name)
            if snap.version:
                os.makedirs(os.path.dirname(path), exist_ok=True)
                fsutil.atomic_write(path, snap.content)
            elif os.path.exists(path):
                os.unlink(path)
                fsutil.fsync_dir(os.path.dirname(path))
            self.snapshot_versions[snap.name] = snap.version
        self.pulls += 1
        self.primary_synced, self.primary_epoch = resp.primary_synced, resp.epoch
        self.primary_pop_generation = max(self.primary_pop_generation, resp.pop_generation_now)
        now = self.clock.wall_ms()
        if self.commit >= resp.primary_synced:
            self.caught_up_ms = now
            self.state = "caught up"
        else:
            self.state = "following"

    def dispatch(self, resp) -> None:
        """The copied records into the consume queues (``Store.dispatch_shipped``) and the timer's
        schedule log (``TimerService.follow``: absorbed, never fired); a checkpoint every
        ``checkpoint_interval_ms`` (the queues durable: a restart replays less), the timer's by
        its own ``maintenance`` (a promotion replays only what came after it)."""
        store = self.store
        if store.log.synced > store.dispatched:  # copied records not dispatched yet (``write``'s)
            if self.timer is not None:  # one walk over the records for the queues and the timer
                self.timer.follow(store.dispatch_shipped)
            else:
                store.dispatch_shipped()
            self.history = position.epoch_history(store)
            self.epoch = self.history[-1][0]
        if self.timer is not None:
            self.timer.follow()
            try:
                self.timer.maintenance()
            except errors.StorageError as exc:  # kept in memory; the next answer's call retries
                log.warning("replica: the timer's checkpoint failed: %s", exc)
        now = self.clock.wall_ms()
        if now - self._checkpointed_ms >= self.checkpoint_interval_ms:
            self._checkpointed_ms = now
            store.checkpoint()

    def _apply_pop(self, generation: int, offset: int, data: bytes) -> None:
        path = position.pop_file(self.data_dir, generation)
        directory = os.path.dirname(path)
        os.makedirs(directory, exist_ok=True)
        if offset == 0:  # a whole file (a new generation, or sent again): in place at once, or not at all
            fsutil.atomic_write(path, data)
            for name in os.listdir(directory):
                if name.endswith(position.POP_SUFFIX) and os.path.join(directory, name) != path:
                    os.unlink(os.path.join(directory, name))
            fsutil.fsync_dir(directory)
        else:
            assert generation == self.pop_generation and offset == self.pop_offset, (generation, offset)
            fd = os.open(path, os.O_WRONLY)
            try:
                view = memoryview(data)
                pos = offset
                while view:
                    n = os.pwrite(fd, view, pos)
                    view, pos = view[n:], pos + n
                os.fsync(fd)
            finally:
                os.close(fd)
        self.pop_generation, self.pop_offset = generation, offset + len(data)
