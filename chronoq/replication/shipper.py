"""The primary's side of replication: answer a replica's pull with what it lacks.

A pull names the replica's durable position (``chronoq.replication.position``). The answer
carries: the commit-log bytes from that position up to what is *written* here (whole records, one
segment, at most ``max_bytes``: ``Store.read_shipped``), the configuration snapshots that changed
(``position.CONFIG_FILES``: they name no log position), and, when those bytes reach the written
end, the POP log bytes the replica lacks and the other snapshot files that changed. POP log and
snapshots are read *before* the written end is taken, all on the event loop without a pause
between (the only thread that writes them, appends to the commit log or compacts the POP log), so
what a replica receives in one answer is the primary's state at one moment, with the commit log
at least as far as the POP log and the snapshots refer to.

Why written, not fsynced, bytes: a ``sync`` acknowledgement needs this node's fsync *and* a
replica's report of its own; shipping only fsynced bytes put the two fsyncs one after the other on
every acknowledgement's path (measured: ``sync`` at 0.43-0.48x the rate of no replica, batched).
Shipped at once, the replica's write and fsync run while this node's fsync does (the committer
wakes a waiting pull when it rings its fsync: ``GroupCommitter.add_written_listener``), and an
acknowledgement still waits for both (``GroupCommitter.barrier``). The cost: a replica may hold
bytes this node loses when its *machine* stops before their fsync (a kill -9 loses nothing: the
page cache keeps them). None of them was acknowledged under ``flush_policy = "sync"``, so when
this node comes back (its log then ends at ``Store.opened_end``) a replica past that point is
cut back to it (a ``Divergence`` at ``opened_end`` of this epoch: the replica checks its bytes
before the point are these, then truncates as a rejoin does) and follows. Under ``flush_policy =
"async"`` those bytes may have been acknowledged: the replica is refused with a message saying
so, nothing is cut (promote the replica, which holds them).

Long poll: with nothing new the pull is *parked* for up to ``wait_ms`` (at most ``WAIT_MAX_MS``)
and answered by whoever brings news: each fsync rung (the written listener above) answers the
parked pulls there and then (the ring is a loop callback of its own, between calls: a moment
as good as the pull's own), so a sync replica's bytes leave in the loop pass after the ring, not
after the three wake-ups an ``Event`` under ``wait_for`` takes (each behind a poll phase's reads
of other calls, under load). Each dispatch (``Broker.add_arrival_listener``, which may run in
the middle of a call's handler) asks for one look at the end of the pass, and each parked pull
looks again every ``WAIT_TICK_S`` (a snapshot file rewritten, say).

Rejoining (``chronoq.replication.divergence``): a replica whose log runs past the start of this
primary's first epoch after the replica's own is answered OK with a ``Divergence`` (the point,
that epoch, the CRC-32C of the bytes before the point) and no bytes: it truncates there and
pulls again, then as any replica.

Refused, changing nothing on either side (``errors.PreconditionFailed``): a pull from this
node's own id (a replica pointed at itself), a replica at an epoch this primary does not have
(newer than its own, or unknown, or begun elsewhere: ``divergence.decide``), a replica past this
log's written end or whose last bytes differ from this log's at the same offsets (not a prefix
the epochs or a lost tail explain: another cluster or a diverged history), and a replica behind
this log's oldest segment (retention deleted what it lacks: it needs a fresh copy).
"""

from __future__ import annotations

import asyncio
import collections
import heapq
import itertools
import logging
import os
from typing import Callable

import google_crc32c

from chronoq.core import errors, fsutil
from chronoq.proto import chronoq_admin_pb2 as apb
from chronoq.protocol.h2 import Parts
from chronoq.protocol.rocketmq import fields
from chronoq.protocol.rocketmq import status as codes
from chronoq.replication import divergence, position

log = logging.getLogger("chronoq.replication")

WAIT_MAX_MS = 30_000
WAIT_TICK_S = 0.05
MAX_BYTES_DEFAULT = 4 << 20
MAX_BYTES_LIMIT = 64 << 20
# PullResponse.commit_bytes: field 4, length-delimited (wire type 2); ``wire`` writes it by hand.
_COMMIT_BYTES_KEY = fields.key(4, 2)
assert apb.PullResponse.DESCRIPTOR.fields_by_name["commit_bytes"].number == 4
WRITTEN_SAMPLES = 20  # samples of the written end per sync bound (``PrimaryNode.in_sync``)
REPLICA_FORGET_MS = 600_000  # a replica that has not pulled for this long leaves status and metrics
# The replicas a primary keeps track of (status, metrics, the in-sync set, sync acknowledgements);
# each is a node id, one per replica process. A new one past the cap takes the place of the one
# silent longest, once that one has been silent for QUIET_MS (a live replica pulls at least every
# WAIT_MAX_MS); else its pull is refused until one is (TOO_MANY_REQUESTS: the replica retries).
MAX_REPLICAS = 32
QUIET_MS = 2 * WAIT_MAX_MS
NODE_ID_MAX = 128  # characters of a pull's node id, and of its endpoint (host:port) at most
ENDPOINT_MAX = 256


class PrimaryNode:
    role = "primary"

    def __init__(self, broker, pop, node_id: str) -> None:
        self.broker = broker
        self.pop = pop
        self.store = broker.store
        self.data_dir = broker.config.data_dir
        self.node_id = node_id
        self._history = position.epoch_history(self.store)  # [(epoch, start)]: chronoq.replication.divergence
        self.epoch = self._history[-1][0]
        # node id -> the replica's last pull: (endpoint, durable position, wall ms)
        self.replicas: dict[str, tuple[str, int, int]] = {}
        self._caught_up_ms: dict[str, int] = {}  # node id -> when it last held the whole durable log
        # Pulls waiting for news (``pull``): each one's future -> its request. Answered by
        # ``_answer_parked``: at a ring (``written``), at the end of a pass that dispatched
        # (``_arrived``), or by its own tick (None: look again).
        self._parked: dict[asyncio.Future, object] = {}
        self._look_asked = False
        self._snapshot_paths = tuple((name, os.path.join(self.data_dir, name)) for name in position.SNAPSHOT_FILES)
        self._versions: tuple[int, int, tuple[tuple[str, str], ...]] | None = None  # (``_snapshot_versions``)
        broker.add_arrival_listener(self._arrived)
        # Sync replication (``replica_wait``): the highest position a replica reported durable, and
        # the acknowledgements waiting for one: a heap of ``expiring`` entries
        # ``[ticket, sequence, settle, timer]``.
        self.sync_timeout_ms = broker.config.replication_sync_timeout_ms
        # (wall ms, log.written then), sampled as fsyncs are rung, at most every 1/SAMPLES of
        # the bound (so at most ~SAMPLES+2 kept): a replica is in sync while it holds what was
        # written a bound ago (``in_sync``), however busy the log is now.
        self._written_at: collections.deque[tuple[int, int]] = collections.deque()
        self.acked = 0
        self._acks: list[list] = []
        self._ack_seq = itertools.count()
        # With etcd: ``on_report(endpoint, position)`` at each pull (chronoq.server.failover's in-sync set),
        # and ``published(endpoint)``, that set's membership (what ``counts_in_sync`` answers then).
        self.on_report = None
        self.published = None

    def _arrived(self) -> None:
        """A dispatch (maybe inside a call's handler): look at the parked pulls once this pass is done."""
        if self._parked and not self._look_asked:
            self._look_asked = True
            asyncio.get_running_loop().call_soon(self._look)

    def _look(self) -> None:
        self._look_asked = False
        self._answer_parked()

    def _answer_parked(self) -> None:
        """Answer each parked pull that has news now (``_answer``: no await, one moment)."""
        for fut, req in list(self._parked.items()):
            if fut.done():
                continue
            try:
                resp, data, news = self._answer(req)
            except Exception as exc:  # noqa: BLE001 - the pull's own failure, raised where it waits
                del self._parked[fut]
                fut.set_exception(exc)
                continue
            if news:
                del self._parked[fut]
                fut.set_result(wire(resp, data))

    def written(self) -> None:
        """``GroupCommitter.add_written_listener``: bytes to ship before their fsync (answer the
        parked pulls now: the ring is a callback of its own), and a sample of the written end
        for ``in_sync``."""
        if self._parked:
            self._answer_parked()
        now, samples = self.broker.clock.wall_ms(), self._written_at
        if not samples or now - samples[-1][0] >= self.sync_timeout_ms // WRITTEN_SAMPLES:
            samples.append((now, self.store.log.written))
            while len(samples) > 1 and samples[1][0] <= now - self.sync_timeout_ms:
                samples.popleft()  # (the newest sample a bound old or older stays: ``in_sync`` reads it)

    def in_sync(self, position_: int, seen_ms: int, now_ms: int) -> bool:
        """A replica that pulled at ``seen_ms`` reporting ``position_`` is in sync: it pulled within
        the bound (``replication_sync_timeout_ms``) and holds everything written a bound ago (it
        keeps up, though a round or more behind under load)."""
        bound = self.sync_timeout_ms
        if now_ms - seen_ms > bound:
            return False
        then = 0  # the written end a bound ago (nothing sampled that long ago: nothing required)
        for at, written in self._written_at:
            if at > now_ms - bound:
                break
            then = written
        return position_ >= then

    def counts_in_sync(self, endpoint: str, position_: int, seen_ms: int, now_ms: int) -> bool:
        """Whether status and the console show a replica in sync: with etcd, membership of the
        published in-sync set; without, ``in_sync``."""
        if self.published is not None:
            return self.published(endpoint)
        return self.in_sync(position_, seen_ms, now_ms)

    # ------------------------------------------------------------------ pull
    async def pull(self, req) -> apb.PullResponse | Parts:
        """The answer to a replica's pull, as it leaves (``wire``: commit-log bytes as ``Parts``)."""
        if not 0 < len(req.node_id) <= NODE_ID_MAX or len(req.endpoint) > ENDPOINT_MAX:
            raise errors.ClientError(f"a pull names its node id (1 to {NODE_ID_MAX} characters) and its endpoint "
                                     f"({ENDPOINT_MAX} at most): got {len(req.node_id)} and {len(req.endpoint)}")
        if req.node_id == self.node_id:
            raise errors.PreconditionFailed(
                f"the replica is pointed at itself (node {self.node_id}): --replica-of must name its primary")
        div = self._divergence(req)
        if div is None:
            try:
                self._check_prefix(req)
            except errors.PreconditionFailed:  # (not a prefix: a tail this node lost explains it, or nothing)
                div = self._lost_tail(req)
                if div is None:
                    raise
        if div is not None:  # nothing recorded of this replica yet: its position is about to move back
            return apb.PullResponse(status=_ok(), divergence=div, commit_offset=req.position.commit,
                                    primary_synced=self.store.log.written, epoch=self.epoch, node_id=self.node_id,
                                    wall_ms=self.broker.clock.wall_ms())
        now = self.broker.clock.wall_ms()
        if req.node_id not in self.replicas:
            self._make_room(now)
        self.replicas[req.node_id] = (req.endpoint, req.position.commit, now)
        if len(self.replicas) > 1:  # a node id per replica process: forget the ones gone quiet
            for node in [n for n, (_e, _p, seen) in self.replicas.items() if now - seen > REPLICA_FORGET_MS]:
                self._forget(node)
        self._replica_acked(req.position.commit)
        if self.on_report is not None:
            self.on_report(req.endpoint, req.position.commit)
        if req.position.commit >= self.store.log.written or req.node_id not in self._caught_up_ms:
            self._caught_up_ms[req.node_id] = now
        loop = asyncio.get_running_loop()
        # An idle pull is answered within half the sync bound: its answer is the replica's next
        # report, and a caught-up replica parked in a long poll must not look silent to the in-sync
        # set (chronoq.replication.coordinator.InSyncTracker drops one silent for the bound).
        wait_ms = min(max(req.wait_ms, 0), WAIT_MAX_MS, self.sync_timeout_ms // 2)
        deadline = loop.time() + wait_ms / 1000
        while True:
            resp, data, news = self._answer(req)
            if news or loop.time() >= deadline:
                return wire(resp, data)
            parked = loop.create_future()
            self._parked[parked] = req
            tick = loop.call_later(min(WAIT_TICK_S, deadline - loop.time()), _look_again, parked)
            try:
                resp = await parked
            finally:
                tick.cancel()
                self._parked.pop(parked, None)
            if resp is not None:
                return resp

    def _make_room(self, now: int) -> None:
        """Room for one more replica (``MAX_REPLICAS``), or ``TooManyRequests``."""
        if len(self.replicas) < MAX_REPLICAS:
            return
        node, (endpoint, _pos, seen) = min(self.replicas.items(), key=lambda kv: kv[1][2])
        if now - seen < QUIET_MS:
            raise errors.TooManyRequests(
                f"{MAX_REPLICAS} replicas pulled from this primary in the last {QUIET_MS // 1000} s: another is "
                "refused until one of them has been silent that long (a replica process that restarts pulls under "
                "a new node id)")
        log.warning("replication: forgetting replica %s (%s), silent for %d s, to track a new one (%d at most)",
                    node, endpoint or "no endpoint", (now - seen) // 1000, MAX_REPLICAS)
        self._forget(node)

    def _forget(self, node: str) -> None:
        del self.replicas[node]
        self._caught_up_ms.pop(node, None)

    def _divergence(self, req) -> apb.Divergence | None:
        """The point a rejoining replica must truncate at first (None: none), or a refusal."""
        if self._history[-1][0] != self.epoch:  # (read once per term: a few records)
            self._history = position.epoch_history(self.store)
        try:
            cut = divergence.decide(self._history, req.epoch, req.epoch_start, req.position.commit)
        except divergence.Unexplained as exc:
            raise errors.PreconditionFailed(str(exc)) from None
        if cut is None:
            return None
        tail_from, crc = position.tail(self.store, cut.offset)
        return apb.Divergence(offset=cut.offset, epoch=cut.epoch, tail_from=tail_from, tail_crc=crc)

    def _lost_tail(self, req) -> apb.Divergence | None:
        """For a replica that failed the prefix check: one of this epoch past ``Store.opened_end``
        holds bytes this log lacks or holds otherwise, shipped before their fsync by this node's
        previous process and lost with its machine (see the module's docstring). Under
        ``flush_policy = "sync"`` none was acknowledged: cut it back to that point (the replica
        checks its bytes before it). None: not that case (the prefix check's refusal stands)."""
        store, at = self.store, req.position.commit
        opened = store.opened_end
        if req.epoch != self.epoch or at <= opened or opened <= store.log.min_offset:
            # (an empty start leaves no bytes to compare before the point: another cluster's log
            # would be cut whole; the prefix check refuses it instead, as ``divergence`` does)
            return None
        if self.broker.config.flush_policy != "sync":
            raise errors.PreconditionFailed(
                f"the replica's log ends at {at}, past where this primary's log ended when it started ({opened}): "
                "it holds bytes this node shipped before their fsync and lost since (a crash of its machine); "
                "under flush_policy = async they may have been acknowledged: refusing to ship, nothing was cut "
                "(promote the replica, which holds them, or copy this node's data directory to it afresh)")
        tail_from, crc = position.tail(store, opened)
        return apb.Divergence(offset=opened, epoch=self.epoch, tail_from=tail_from, tail_crc=crc)

    def _check_prefix(self, req) -> None:
        commit_log, at = self.store.log, req.position.commit
        written = commit_log.written
        if at > written:
            raise errors.PreconditionFailed(
                f"the replica's log ends at {at}, past this primary's end {written}: it is not a "
                "prefix of this log (another cluster, or a history that diverged); refusing to ship")
        if at < commit_log.min_offset and at != 0:
            raise errors.PreconditionFailed(
                f"the replica's log ends at {at}, before this primary's oldest segment ({commit_log.min_offset}): "
                "retention deleted what it lacks; it needs a fresh copy of the data directory")
        if at > commit_log.min_offset:
            tail_from = req.tail_from
            if not (commit_log.segment_for(at - 1).base <= tail_from < at and at - tail_from <= position.TAIL_BYTES):
                raise errors.PreconditionFailed(f"tail range {tail_from}..{at} is not within one segment here")
            if google_crc32c.value(commit_log.read(tail_from, at - tail_from)) != req.tail_crc:
                raise errors.PreconditionFailed(
                    f"the replica's last bytes before {at} differ from this primary's: its log is not a prefix "
                    "of this one (another cluster, or a history that diverged); refusing to ship")

    def _snapshot_versions(self) -> tuple[tuple[str, str], ...]:
        """``(name, position.snapshot_version)`` of each snapshot file, looked at again only when
        a file was rewritten here since (``fsutil.rewrites``: every owner writes through
        ``atomic_write``) or ``WAIT_TICK_S`` passed: six ``stat`` calls were about half of an answer's
        cost. A change the count misses waits that long at most, as if made just after."""
        count, now, cached = fsutil.rewrites(), self.broker.clock.monotonic_ns(), self._versions
        if cached is None or cached[0] != count or now - cached[1] >= WAIT_TICK_S * 1e9:
            versions = tuple((name, position.snapshot_version(path)) for name, path in self._snapshot_paths)
            self._versions = cached = (count, now, versions)
        return cached[2]

    def _answer(self, req) -> tuple[apb.PullResponse, bytes, bool]:
        """The answer now: the response without its commit-log bytes, those bytes (``wire`` puts
        them together), and whether it carries anything new. No await inside: one moment."""
        journal = self.pop._journal if self.pop is not None else None
        pop_log = journal.log if journal is not None else None
        pop_gen, pop_size = (pop_log.generation, pop_log.size) if pop_log is not None else (0, 0)
        held = req.snapshot_versions
        changed = [(name, version) for name, version in self._snapshot_versions() if version != held.get(name, "")]
        end = self.store.log.written
        at = max(req.position.commit, self.store.log.min_offset)
        wanted = req.max_bytes if 0 < req.max_bytes <= MAX_BYTES_LIMIT else MAX_BYTES_DEFAULT
        base, data = self.store.read_shipped(at, wanted)
        resp = apb.PullResponse(status=_ok(), segment_base=base,
                                commit_offset=at, primary_synced=end, epoch=self.epoch,
                                node_id=self.node_id, wall_ms=self.broker.clock.wall_ms(),
                                pop_generation_now=pop_gen)
        news = bool(data)
        caught_up = at + len(data) >= end
        for name, version in changed:  # POP log and most snapshots only with a log that reaches them
            if caught_up or name in position.CONFIG_FILES:
                resp.snapshots.append(_snapshot(self.data_dir, name, version))
                news = True
        if not caught_up:
            return resp, data, news
        have_gen, have_off = req.position.pop_generation, req.position.pop_offset
        if pop_gen and (have_gen != pop_gen or have_off != pop_size):
            start = have_off if have_gen == pop_gen and have_off < pop_size else 0
            resp.pop_generation, resp.pop_offset = pop_gen, start
            resp.pop_bytes = _read_file(pop_log.path, start, pop_size)
            news = True
        return resp, data, news

    # ------------------------------------------------------------------ sync replication
    def replica_wait(self, ticket: int, settle: Callable[[BaseException | None], None]) -> None:
        """``settle(None)`` once a replica reported the log durable up to ``ticket`` (its next pull
        after it copied it: one report settles every acknowledgement waiting at or below it, so
        group commit covers the round trip), or ``settle(errors.ReplicaTimeout)``: at once when no
        replica pulled in the last ``replication_sync_timeout_ms`` holding what was written a bound
        ago (none in sync), or when none reports in that time. Exactly once, on the loop, maybe
        before this returns. A callback, not a coroutine: the committer chains it to the fsync's
        own so that a sync send waits once (``GroupCommitter.barrier``)."""
        if self.acked >= ticket:
            settle(None)
            return
        now, timeout_ms = self.broker.clock.wall_ms(), self.sync_timeout_ms
        if not any(self.in_sync(pos, seen, now) for _ep, pos, seen in self.replicas.values()):
            settle(errors.ReplicaTimeout(
                f"replication = sync and no replica is in sync (none pulled in the last {timeout_ms} ms holding "
                f"what was written {timeout_ms} ms ago): the message is stored on this primary only"))
            return
        heapq.heappush(self._acks, expiring([ticket, next(self._ack_seq), settle, None], timeout_ms / 1000, lambda: (
            f"replication = sync: no replica reported offset {ticket} durable within {timeout_ms} ms "
            "(replication_sync_timeout_ms): the message is stored on this primary")))

    def _replica_acked(self, position_: int) -> None:
        if position_ <= self.acked:
            return
        self.acked = position_
        acks = self._acks
        while acks and acks[0][0] <= position_:
            settle_now(heapq.heappop(acks), None)

    # ------------------------------------------------------------------ status and promotion
    async def status(self, _req=None) -> apb.ClusterStatusResponse:
        synced = self.store.log.synced
        journal = self.pop._journal if self.pop is not None else None
        gen, size = (journal.log.generation, journal.log.size) if journal is not None else (0, 0)
        now = self.broker.clock.wall_ms()
        replicas = [apb.ReplicaState(node_id=node, endpoint=ep, position=pos, lag_bytes=max(0, synced - pos),
                                     last_pull_ms=seen, in_sync=self.counts_in_sync(ep, pos, seen, now))
                    for node, (ep, pos, seen) in sorted(self.replicas.items())]
        return apb.ClusterStatusResponse(status=_ok(), role=self.role, epoch=self.epoch, node_id=self.node_id,
                                         commit_end=synced, pop_generation=gen, pop_offset=size,
                                         replicas=replicas)

    async def promote(self, _req=None):
        raise errors.PreconditionFailed(f"this node is already the primary (epoch {self.epoch}); "
                                        "promote a replica")

    def lag_figures(self) -> dict[str, tuple[int, float]]:
        """Per replica (endpoint, or node id): (bytes of the durable log it lacks, seconds since it
        last held all of it), as of its last pull (for /metrics)."""
        synced, now = self.store.log.synced, self.broker.clock.wall_ms()
        out = {}
        for node, (ep, pos, _seen) in self.replicas.items():
            behind = max(0, synced - pos)
            out[ep or node] = (behind, (now - self._caught_up_ms.get(node, now)) / 1000 if behind else 0.0)
        return out


def expiring(entry: list, timeout_s: float, refusal: Callable[[], str]) -> list:
    """A waiting acknowledgement, ``[ticket, sequence, settle, timer]``, given its timer: past
    ``timeout_s`` it is settled with ``errors.ReplicaTimeout(refusal())``. One timer of its own
    (``asyncio.wait_for`` wrapped each waiting send in two more futures and their callbacks)."""
    entry[3] = asyncio.get_running_loop().call_later(timeout_s, _expire, entry, refusal)
    return entry


def settle_now(entry: list, exc: BaseException | None) -> None:
    """Settle a waiting acknowledgement (``expiring``) unless it was already: its timer stops."""
    settle = entry[2]
    if settle is not None:
        entry[2] = None
        if entry[3] is not None:
            entry[3].cancel()
        settle(exc)


def _expire(entry: list, refusal: Callable[[], str]) -> None:
    if entry[2] is not None:
        settle_now(entry, errors.ReplicaTimeout(refusal()))


def _look_again(parked: asyncio.Future) -> None:
    if not parked.done():
        parked.set_result(None)


def wire(resp: apb.PullResponse, data: bytes) -> apb.PullResponse | Parts:
    """The answer as it leaves: ``resp`` serialized, then ``data`` as its ``commit_bytes`` field
    (protobuf readers take fields in any order), in ``Parts``: the bytes as read, not copied into
    the message, its serialization, the gRPC message, the DATA frame and the pass's output (about
    3% of a primary's loop under sync load, ~0.5 MB an answer). No bytes: the response itself."""
    if not data:
        return resp
    return Parts(resp.SerializeToString() + _COMMIT_BYTES_KEY + fields.varint(len(data)), data)


def _ok() -> apb.Status:
    return apb.Status(code=codes.OK, message="OK")


def _snapshot(data_dir: str, name: str, version: str) -> apb.SnapshotFile:
    content = b""
    if version:
        with open(os.path.join(data_dir, name), "rb") as fh:
            content = fh.read()
    return apb.SnapshotFile(name=name, version=version, content=content)


def _read_file(path: str, start: int, end: int) -> bytes:
    fd = os.open(path, os.O_RDONLY)
    try:
        data = os.pread(fd, end - start, start)
    finally:
        os.close(fd)
    if len(data) != end - start:
        raise errors.StorageError(f"short read of {path}: {len(data)} of {end - start} bytes at {start}")
    return data
