"""Automatic failover through etcd: the role a node takes, its promotion, its fencing.

With ``etcd_endpoints`` set, ``Runtime.serve`` asks ``take_role`` what to be (docs/replication.md,
"Automatic failover with etcd"; the decisions are ``chronoq.replication.coordinator.decide``):

* a leader exists: follow it (``chronoq.server.replica.serve_replica`` with the leader's
  endpoint), while watching the leader key. When the key goes (its lease expired) and this node
  is in the recorded in-sync set with its log reaching the recorded position, it campaigns; the
  winner promotes through the replica's own path (``ReplicaNode.promote``) with the epoch it won;
  a loser follows the new leader (``take_role`` runs again). ``chronoq promote`` on such a
  replica is an operator's forced campaign (it still needs the leader key gone);
* no leader and no epoch ever: campaign; no leader but an epoch: campaign if in the in-sync set
  (or ``force_leader``), else wait for a leader to follow.

As the primary (``run_primary``): the committer acknowledges only while the lease surely holds
(``Leadership``, checked by ``chronoq.broker.committer``); the in-sync set is published (a shrink
*before* any acknowledgement a removed replica lacks: ``chronoq.replication.coordinator.InSyncTracker``);
under ``replication = "sync"`` an acknowledgement waits for every replica in the set. A primary
that lost its lease is fenced for good: every write is refused naming the new primary when known,
no timer fires, no receive takes a message and no ack is settled (``GroupCommitter.check_leader``),
its routes name the new leader instead of itself (``Leadership.successor``), and that broker never
acknowledges again (its ``Leadership`` keeps the lapsed deadline). It **steps down** by itself
(``PrimaryDuty._fenced``): a fresh etcd lease (the old one revoked; retried while etcd is away,
the broker still refusing meanwhile), then the runtime closes the broker (its waiters refused:
``GroupCommitter.close``) and goes back into ``take_role``: it follows the leader (a log that went
past the epoch boundary is cut there, ``chronoq.replication.follower``, as after a restart) or,
with no leader and this node eligible, campaigns for a new epoch.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging

from chronoq.core import errors
from chronoq.core.clock import SYSTEM_CLOCK
from chronoq.replication import coordinator as co
from chronoq.replication.etcd import EtcdAccess, EtcdCoordinator
from chronoq.replication.shipper import expiring, settle_now

log = logging.getLogger("chronoq.failover")

WATCH_S = 5.0        # a leader watch is renewed this often (the etcd session is checked with it)
PUBLISH_TICK_S = 0.1
ETCD_RETRY_S = 1.0
# A replica refused by the leader etcd names waits this many lease lifetimes for it to change
# before the refusal ends the process (a stale key outlives its holder by at most one).
REFUSED_WAIT_LEASES = 3
POSITIONS_EVERY_MS = 1000  # the in-sync set's recorded positions are refreshed this often (when they moved)
STEP_DOWN_CALL_S = 6.0  # a fenced leader's etcd calls (the leader's name, a fresh lease) give up after this


class Leadership:
    """What the committer asks before it acknowledges (``GroupCommitter.leadership``)."""

    def __init__(self, coord: EtcdCoordinator, epoch: int) -> None:
        self.coord = coord
        self.epoch = epoch
        # This term's lease, held here: a step-down gives the coordinator a new one (``fresh_lease``),
        # which must never make this broker acknowledge again.
        self.deadline = coord.deadline
        self.new_leader: str | None = None  # learnt once fenced

    def holds(self) -> bool:
        """While the term's lease surely holds. A lapse seen once is final: a keep-alive answered
        later (etcd only slow, or stopped, and still holding the lease) would otherwise make a
        broker that already refused acknowledge again (seen: a refusal, then OK once etcd resumed)."""
        if self.deadline.holds():
            return True
        self.deadline.lose("its lease deadline passed (no keep-alive answered in time, or the process was paused)")
        return False

    def refusal(self) -> str:
        why = self.deadline.lost or "its etcd lease may have expired (no keep-alive answered in time)"
        now = f"; the primary is now {self.new_leader}" if self.new_leader else ""
        return (f"this broker lost leadership of {self.coord.cluster}/{self.coord.group} (epoch {self.epoch}): {why}"
                f"{now}; nothing is acknowledged here")

    def successor(self) -> str:
        """The endpoint a fenced broker's route names instead of its own: the leader etcd named
        when last asked; none known yet: ``errors.ClosedError`` (INTERNAL_SERVER_ERROR, which the
        clients retry; they keep their last route meanwhile)."""
        if self.new_leader:
            return self.new_leader
        raise errors.ClosedError(
            f"this broker lost leadership of {self.coord.cluster}/{self.coord.group} (epoch {self.epoch}) and is "
            "stepping down; no new leader is known yet: ask again shortly (any node of the group answers routes)")


def start_coordinator(cfg, node_id: str) -> EtcdCoordinator:
    access = EtcdAccess.of(cfg.etcd_list, cfg.etcd_ca_file, cfg.etcd_cert_file, cfg.etcd_key_file, cfg.etcd_user,
                           cfg.etcd_password)
    coord = EtcdCoordinator(access, cfg.cluster_name, cfg.group_name, cfg.lease_ttl_ms, cfg.endpoint,
                            node_id, SYSTEM_CLOCK)
    coord.start()
    return coord


def _local_position(cfg, runtime=None) -> tuple[int, int]:
    """(durable log end, epoch) of this node's data directory (opened as a store, then closed).

    That open runs the crash recovery, and its clean close leaves a clean stop for the broker's
    own open to find: the first recovery report that was not clean is kept on ``runtime``
    (``crash_recovery``), for the start-up report and ``chronoq_recovery_*`` to tell the truth."""
    from chronoq.replication.position import current_epoch
    from chronoq.server.replica import _open_store

    store = _open_store(cfg)
    try:
        if runtime is not None and not store.report.clean and getattr(runtime, "crash_recovery", None) is None:
            runtime.crash_recovery = store.report
        return store.log.synced, current_epoch(store)
    finally:
        store.close()


async def take_role(runtime) -> int | None:
    """Follow, wait or campaign until this node leads (returns the epoch it won: the runtime
    opens the broker and records it) or is stopped (None)."""
    from chronoq.server.replica import serve_replica

    cfg, loop = runtime.config, asyncio.get_running_loop()
    coord = runtime.coordinator
    waiting_said = None
    while not runtime._stop.is_set():
        try:
            view = await coord.call(coord.view())
        except Exception as exc:  # noqa: BLE001 - etcd unavailable for a moment: no role without it
            log.warning("etcd: reading the group failed (%r); trying again", exc)
            await _wait(runtime, asyncio.sleep(ETCD_RETRY_S))
            continue
        position = log_epoch = 0
        if view.leader is None:
            position, log_epoch = await loop.run_in_executor(None, _local_position, cfg, runtime)
        kind, why = co.decide(view, cfg.endpoint, position, cfg.force_leader)
        if kind == co.CAMPAIGN:
            epoch = co.next_epoch(view, log_epoch)
            if cfg.force_leader and view.epoch:
                log.warning("forced campaign (force_leader): %s; what the last primary acknowledged and this node "
                            "lacks is lost", why)
            try:
                won = await coord.call(coord.campaign(view, epoch, cfg.endpoint, position))
            except Exception as exc:  # noqa: BLE001 - as above
                log.warning("etcd: the campaign failed (%r); trying again", exc)
                await _wait(runtime, asyncio.sleep(ETCD_RETRY_S))
                continue
            if won:
                runtime.say(f"etcd: this node leads {cfg.cluster_name}/{cfg.group_name} at epoch {epoch} ({why})")
                return epoch
            continue  # another node won meanwhile: look again
        if kind == co.WAIT:
            if why != waiting_said:
                runtime.say(f"etcd: waiting for a leader: {why}")
                waiting_said = why
            await _wait(runtime, coord.call(coord.wait_leader_change(view.leader, WATCH_S)))
            continue
        leader = view.leader
        runtime.say(f"etcd: following {leader.endpoint} (epoch {leader.epoch})")
        saved = runtime.config
        runtime.config = dataclasses.replace(cfg, replica_of=leader.endpoint)
        try:
            epoch = await serve_replica(runtime, on_start=lambda node: _replica_watch(runtime, node, leader))
        except errors.PreconditionFailed as exc:
            # Refused by the node etcd named: it may have lost the lead since (after an etcd outage
            # a fenced leader steps down while its key lives on until its lease expires; it then
            # answers "a replica, not a primary"). A refusal stands only while it still leads.
            if not await _leader_moved(runtime, leader):
                raise
            log.warning("etcd: %s refused this replica (%s), and no longer leads: taking a role again",
                        leader.node, exc.message)
            continue
        finally:
            runtime.config = saved
        if epoch is not None:
            return epoch
    return None


async def _leader_moved(runtime, leader: co.Leader) -> bool:
    """Whether ``leader`` stops leading within a few lease lifetimes (etcd failing: True, so the
    role loop asks again rather than the process ending on an answer etcd may contradict)."""
    coord = runtime.coordinator
    wait_s = REFUSED_WAIT_LEASES * runtime.config.lease_ttl_ms / 1000
    try:
        current = await asyncio.wait_for(coord.call(coord.wait_leader_change(leader, wait_s)), wait_s + WATCH_S)
    except Exception as exc:  # noqa: BLE001 - etcd unavailable: no verdict
        log.warning("etcd: reading the leader failed (%r)", exc)
        await _wait(runtime, asyncio.sleep(ETCD_RETRY_S))
        return True
    return current != leader


async def _wait(runtime, coro) -> None:
    task = asyncio.ensure_future(coro)
    stop = asyncio.ensure_future(runtime._stop.wait())
    await asyncio.wait([task, stop], return_when=asyncio.FIRST_COMPLETED)
    stop.cancel()
    if not task.done():
        task.cancel()
    elif task.exception() is not None:
        log.warning("watching the leader key failed: %r", task.exception())
        await asyncio.sleep(1)


def _said_if_failed(task: asyncio.Task) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("publishing the in-sync set stopped: %r", task.exception())


async def _replica_watch(runtime, node, leader: co.Leader) -> None:
    """Beside a following replica: register it, watch its leader; when the leader key goes,
    campaign if eligible and promote on a win; return (the replica then stops and ``take_role``
    follows whoever leads) when another node leads."""
    cfg, coord = runtime.config, runtime.coordinator
    follower = node.follower
    await _register(coord, "replica", cfg.endpoint, follower.commit, follower.epoch)

    async def elect() -> int:
        view = await coord.call(coord.view())
        if view.leader is not None:
            raise errors.PreconditionFailed(
                f"{view.leader.node} leads {cfg.cluster_name}/{cfg.group_name} (epoch {view.leader.epoch}) and holds "
                "its lease: stop it first (its lease then expires) before promoting this replica")
        ok, why = co.eligibility(view, cfg.endpoint, follower.commit)
        if not ok:
            raise errors.PreconditionFailed(
                f"{why}; to promote it all the same, restart it with --force-leader (what the last primary "
                "acknowledged and this node lacks is then lost)")
        epoch = co.next_epoch(view, follower.epoch)
        if not await coord.call(coord.campaign(view, epoch, cfg.endpoint, follower.commit)):
            raise errors.PreconditionFailed("another node won the campaign: this replica follows it")
        return epoch

    # ``chronoq promote``: a campaign on an operator's word, eligible nodes only (an unclean one: restart
    # the node with --force-leader).
    node.elect = elect
    seen = leader
    while True:
        try:
            current = await coord.call(coord.wait_leader_change(seen, WATCH_S))
        except Exception as exc:  # noqa: BLE001 - etcd unavailable for a moment: keep following
            log.warning("etcd: watching the leader failed (%r); trying again", exc)
            await asyncio.sleep(ETCD_RETRY_S)
            continue
        if current == seen:
            continue
        if current is not None:
            log.info("etcd: %s now leads (epoch %d); following it", current.node, current.epoch)
            return
        try:
            epoch = await elect()
        except Exception as exc:  # noqa: BLE001 - not eligible, lost the race, or etcd unavailable
            if not isinstance(exc, errors.PreconditionFailed):
                exc = errors.PreconditionFailed(f"etcd failed: {exc!r}")
            log.warning("etcd: the leader %s is gone; this replica does not campaign: %s", leader.node, exc.message)
            seen = None  # wait for whoever wins
            continue
        runtime.say(f"etcd: the leader {leader.node} is gone; this replica won epoch {epoch}: promoting")
        await node.promote(epoch=epoch)
        return


async def _register(coord: EtcdCoordinator, role: str, endpoint: str, position: int, epoch: int) -> None:
    try:
        await coord.call(coord.register(role, endpoint, position, epoch))
    except Exception as exc:  # noqa: BLE001 - membership is information: serve without it
        log.warning("etcd: registering this node as %s failed: %r", role, exc)


# ------------------------------------------------------------------------------------ the primary
class PrimaryDuty:
    """The leader's side while it serves: the in-sync set (published, and gating ``sync``
    acknowledgements), its member key, and noticing that it was fenced."""

    def __init__(self, runtime, epoch: int) -> None:
        cfg = runtime.config
        self.runtime = runtime
        self.coord: EtcdCoordinator = runtime.coordinator
        self.node = cfg.endpoint
        self.epoch = epoch
        self.leadership = Leadership(self.coord, epoch)
        self.tracker = co.InSyncTracker(cfg.replication_sync_timeout_ms)
        self.sync_timeout_ms = cfg.replication_sync_timeout_ms
        self.store = runtime.broker.store
        self.clock = runtime.broker.clock
        self._acks: list[list] = []  # ``expiring`` entries: [ticket, 0, settle, timer]
        self._wake = asyncio.Event()
        # Set once fenced and holding a fresh lease: the runtime closes this broker and takes a role again.
        self.stepped_down = asyncio.Event()

    def report(self, node: str, position: int) -> None:
        """A replica's pull (``PrimaryNode.on_report``)."""
        if node:
            self.tracker.report(node, position, self.store.log.synced, self.clock.wall_ms())
            self._release()
            self._wake.set()

    def replica_wait(self, ticket: int, settle) -> None:
        """``replication = "sync"`` with etcd: ``settle(None)`` once every replica of the in-sync
        set holds ``ticket``, or ``settle(errors.ReplicaTimeout)`` (the shape of
        ``PrimaryNode.replica_wait``)."""
        if self.tracker.acked(ticket):
            settle(None)
            return
        if not self.tracker.required:
            settle(errors.ReplicaTimeout(
                "replication = sync and no replica is in sync (the in-sync set is this primary alone): the message "
                "is stored on this primary only"))
            return
        # Twice the bound: a member silent for the bound is dropped (published first), then the
        # rest answer; only a set that neither answers nor shrinks in that time gets a refusal.
        self._acks.append(expiring([ticket, 0, settle, None], 2 * self.sync_timeout_ms / 1000, lambda: (
            f"replication = sync: the in-sync replicas did not report offset {ticket} durable within "
            f"{2 * self.sync_timeout_ms} ms: the message is stored on this primary")))

    def _release(self) -> None:
        keep = []
        for entry in self._acks:
            if entry[2] is None:  # settled already (expired)
                continue
            if self.tracker.acked(entry[0]):
                settle_now(entry, None)
            elif not self.tracker.required:
                settle_now(entry, errors.ReplicaTimeout(
                    "replication = sync: every replica left the in-sync set: the message is stored on this primary only"))
            else:
                keep.append(entry)
        self._acks = keep

    async def run(self) -> None:
        """Look at the lease every tick; the in-sync set is published beside (an etcd call that
        hangs must not hold up the step-down)."""
        await _register(self.coord, "primary", self.node, self.store.log.synced, self.epoch)
        publishing = asyncio.ensure_future(self._publish())
        publishing.add_done_callback(_said_if_failed)
        try:
            while not self.runtime._stop.is_set():
                if not self.leadership.holds():  # (final: a later keep-alive undoes nothing)
                    publishing.cancel()
                    await self._fenced()
                    return
                await asyncio.sleep(PUBLISH_TICK_S)
        finally:
            publishing.cancel()  # (not awaited: a call cut off on etcd's side may take its time to end)

    async def _publish(self) -> None:
        coord, tracker = self.coord, self.tracker
        published, published_ms = {}, self.clock.wall_ms()
        while self.leadership.holds():
            now = self.clock.wall_ms()
            want = tracker.wanted(now)
            changed = want != tracker.published
            members = {self.node: self.store.log.synced, **tracker.positions(want)}
            # The recorded positions are refreshed too (every POSITIONS_EVERY_MS when they moved): a
            # node whose directory is older than its recorded position may not campaign.
            if changed or (members != published and now - published_ms >= POSITIONS_EVERY_MS):
                if changed:
                    tracker.required |= want  # (a joiner gates acknowledgements before etcd names it)
                try:  # (bounded: a publish etcd never answers is tried again)
                    ok = await asyncio.wait_for(coord.call(coord.publish_insync(co.InSync(self.epoch, self.node, members))),
                                                STEP_DOWN_CALL_S)
                except Exception as exc:  # noqa: BLE001 - the set stays as published; retried next tick
                    log.warning("publishing the in-sync set failed: %r", exc)
                    ok = None
                if ok:
                    published, published_ms = members, now
                    if changed:
                        log.info("in-sync set of epoch %d: %s", self.epoch, ", ".join(sorted(members)))
                        tracker.published = want
                        tracker.required = set(want)  # (a leaver stops gating only now etcd no longer names it)
                        self._release()
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), PUBLISH_TICK_S)
            except asyncio.TimeoutError:
                pass

    async def _learn_leader(self) -> None:
        coord = self.coord
        try:
            view = await asyncio.wait_for(coord.call(coord.view()), STEP_DOWN_CALL_S)
        except Exception:  # noqa: BLE001 - the refusal and the route then name no successor
            return
        if view.leader is not None and view.leader.node != self.node:
            self.leadership.new_leader = view.leader.endpoint

    async def _fenced(self) -> None:
        """Fenced (final for this broker): refuse what waits, then step down. The broker keeps
        serving refusals (and routes naming the new leader, ``Leadership.successor``) until etcd
        grants this node a fresh lease; then ``stepped_down`` is set and the runtime closes the
        broker and takes a role again (``take_role``: follow the leader, cutting this log at its
        epoch boundary, or campaign when eligible)."""
        await self._learn_leader()
        acks, self._acks = self._acks, []
        for entry in acks:
            settle_now(entry, errors.PreconditionFailed(self.leadership.refusal()))
        log.error("%s. This node acknowledges nothing more and never campaigns again with epoch %d: it steps "
                  "down (a fresh etcd lease, the broker closed, then it follows the leader, cutting its log at "
                  "the epoch boundary if it went past it, or campaigns for a new epoch if eligible)",
                  self.leadership.refusal(), self.epoch)
        coord, said = self.coord, False
        while not self.runtime._stop.is_set():
            try:
                await asyncio.wait_for(coord.call(coord.fresh_lease()), STEP_DOWN_CALL_S)
                break
            except Exception as exc:  # noqa: BLE001 - etcd away: stay fenced (refusing everything) and retry
                if not said:
                    log.warning("etcd: stepping down needs a fresh lease and etcd granted none (%r): this broker "
                                "stays fenced, refusing every write, receive and ack, and tries again every %.0f s",
                                exc, ETCD_RETRY_S)
                    said = True
            await _wait(self.runtime, asyncio.sleep(ETCD_RETRY_S))
            await self._learn_leader()
        else:
            return
        await self._learn_leader()
        self.stepped_down.set()
