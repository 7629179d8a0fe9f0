"""The replica role of ``chronoq serve --replica-of HOST:PORT`` (docs/replication.md).

``serve_replica(runtime)`` runs until a stop (returns None), a promotion (returns the new
epoch: the runtime then opens the broker on the same data directory and serves as a primary),
or a refusal by the primary (raises ``errors.PreconditionFailed``: ``chronoq serve`` says why and
exits 1, nothing written). Meanwhile:

* the data directory is open as a ``Store`` (the lock, recovery of a torn tail, consume
  queues kept by ``Store.dispatch_shipped``) and a ``TimerService`` that follows
  (``following``: its recovery, then ``follow`` and checkpoints, never a tick): no POP service,
  nothing fires, nothing written to the commit log;
* ``chronoq.replication.follower.Follower`` pulls and writes;
* the gRPC port serves ``chronoq.v1.Replication`` (status, promote; a pull from another replica
  is refused) and answers every ``MessagingService`` and ``chronoq.v1.Admin`` call with
  ``PRECONDITION_FAILED`` naming the primary, behind the same access gate as a primary's port,
  except the route calls (``QueryRoute``, ``QueryAssignment``): those are passed on to the
  primary and its answer returned, so an official client given the replica's address is routed
  to the primary (the clients ask their configured address for routes only, every 30 s for the
  Python one, and send everything else to the route's endpoints). A primary that cannot be
  reached: ``PRECONDITION_FAILED`` saying so (the clients keep their last route).

Promotion (``ReplicaNode.promote``): the follower stops after the write in progress; the new
epoch is the larger of this log's and the primary's last known, plus one; the answer goes out,
then this front end stops, the store closes (a clean checkpoint), and the runtime opens the full
broker, whose recovery rebuilds the rest from the shipped logs (the timer replays the log from
its cursor: the replica's timer closed with a clean checkpoint, so only what came after it; the
POP service loads the POP log), and appends the epoch record. The role is
stored first (``chronoq.replication.role``: ``role.json``, with the POP generation floor).

The data directory's lock is held here for the whole replica time, not by the store: a rejoin
(``Follower.rejoin``) closes the store, truncates and opens it again.
"""

from __future__ import annotations

import asyncio
import logging
import os

import grpc
from google.protobuf import message_factory

from chronoq.core import errors
from chronoq.core.clock import SYSTEM_CLOCK
from chronoq.core.refusals import Refusals
from chronoq.proto import chronoq_admin_pb2 as apb
from chronoq.protocol.rocketmq import status as codes
from chronoq.replication import position, role, service
from chronoq.replication.client import ReplicationClient
from chronoq.replication.follower import Follower
from chronoq.server import auth, h2grpc, process
from chronoq.store.dirlock import DirLock
from chronoq.store.store import Store, StoreOptions
from chronoq.timer.service import TimerOptions, TimerService

log = logging.getLogger("chronoq.replication")


class ReplicaNode:
    role = "replica"

    def __init__(self, config, store: Store, follower: Follower, node_id: str) -> None:
        self.config = config
        self.store = store
        self.follower = follower
        self.node_id = node_id
        self.promoted = asyncio.Event()
        self.epoch = 0  # set by promote
        self.follow_task: asyncio.Task | None = None
        # With etcd (chronoq.server.failover): ``await elect()`` campaigns and returns the epoch won,
        # raising ``errors.PreconditionFailed`` when this node may not lead; None: no etcd.
        self.elect = None
        self.promoting = False

    def refusal(self) -> str:
        return (f"this broker is a replica of {self.config.replica_of}: it accepts no sends and serves no "
                f"consumers; use the primary, {self.config.replica_of}")

    async def pull(self, req):
        if req.node_id == self.node_id:
            raise errors.PreconditionFailed(
                f"the replica is pointed at itself (node {self.node_id}): --replica-of must name its primary")
        raise errors.PreconditionFailed(
            f"this node is a replica (of {self.config.replica_of}), not a primary: point --replica-of at "
            f"the primary, {self.config.replica_of}")

    async def status(self, _req=None):
        f = self.follower
        return apb.ClusterStatusResponse(
            status=apb.Status(code=codes.OK, message="OK"), role=self.role,
            epoch=f.epoch, node_id=self.node_id, commit_end=f.commit,
            pop_generation=f.pop_generation, pop_offset=f.pop_offset, following=self.config.replica_of,
            state=f.state, primary_synced=f.primary_synced, lag_bytes=f.lag_bytes(), lag_ms=f.lag_ms())

    async def promote(self, _req=None, epoch: int | None = None):
        """Stop following and become the primary; ``epoch``: the one won in etcd (else, or with
        etcd through ``elect``, one past what this log and its primary knew)."""
        if self.promoted.is_set():
            raise errors.PreconditionFailed(f"this replica is already being promoted (epoch {self.epoch})")
        if epoch is None and self.elect is not None:
            epoch = await self.elect()
        self.promoting = True  # (the follower's end below is not a reason to stop: serve_replica)
        await self.follower.stop()
        if self.follow_task is not None:
            await asyncio.wait([self.follow_task])
        self.epoch = epoch if epoch is not None else max(position.current_epoch(self.follower.store),
                                                         self.follower.primary_epoch) + 1
        # Stored before the answer: restarted with its old --replica-of, this directory stays the primary.
        f = self.follower
        pop_floor = max(f.pop_generation, f.primary_pop_generation) + role.POP_GENERATION_GAP
        await asyncio.get_running_loop().run_in_executor(
            None, role.write_promoted, self.config.data_dir, self.epoch, self.config.replica_of, self.node_id,
            SYSTEM_CLOCK.wall_ms(), pop_floor)
        self.promoted.set()
        log.warning("promoted to primary at epoch %d: log end %d (the primary had %d)", self.epoch,
                    self.follower.commit, self.follower.primary_synced)
        return apb.PromoteResponse(status=apb.Status(code=codes.OK, message="OK"), epoch=self.epoch,
                                   commit_end=self.follower.commit)


# What the official clients ask their configured address (the rest goes to the route's endpoints).
_ROUTE_CALLS = frozenset({"QueryRoute", "QueryAssignment"})
_FORWARD_TIMEOUT_S = 5.0


class _Refuse(grpc.GenericRpcHandler):
    """Every method of the client-facing services answered with PRECONDITION_FAILED, but the
    route calls, passed on to the primary through ``client``."""

    def __init__(self, message: str, client: ReplicationClient) -> None:
        from rocketmq.grpc_protocol import service_pb2

        self._handlers = {}
        for descriptor in (service_pb2.DESCRIPTOR.services_by_name["MessagingService"],
                           apb.DESCRIPTOR.services_by_name["Admin"]):
            for method in descriptor.methods:
                path = f"/{descriptor.full_name}/{method.name}"
                routed = descriptor.name == "MessagingService" and method.name in _ROUTE_CALLS
                self._handlers[path] = _handler(method, message, client if routed else None, path)

    def service(self, details):
        return self._handlers.get(details.method)


def _handler(method, message: str, client: ReplicationClient | None = None, path: str = ""):
    request = message_factory.GetMessageClass(method.input_type)
    response = message_factory.GetMessageClass(method.output_type)

    def answer(text: str = message):
        return response(status={"code": codes.Code.PRECONDITION_FAILED, "message": text})

    if client is not None:
        assert not method.client_streaming and not method.server_streaming, path

        async def forward(req, context):
            # Passed on with the caller's own headers (its signature): the primary decides what
            # the caller may do. With the replica's admin credentials instead, anyone reaching a
            # replica without access control of its own acted as that admin (a route lookup
            # creating topics on the primary).
            left = context.time_remaining()
            timeout = _FORWARD_TIMEOUT_S if left is None else max(0.1, min(left, _FORWARD_TIMEOUT_S))
            caller = [(k, v) for k, v in (context.invocation_metadata() or ())
                      if not k.startswith((":", "grpc-")) and isinstance(v, str)]
            try:
                return await client.forward(path, req, response, timeout, caller)
            except Exception as exc:  # noqa: BLE001 - the primary unreachable: a status, not a crash
                log.debug("%s passed on to %s failed: %r", method.name, client.endpoint, exc)
                return answer(f"this broker is a replica of {client.endpoint}, which cannot be reached "
                              f"for routes ({type(exc).__name__}); try again, or promote this replica")
        return grpc.unary_unary_rpc_method_handler(forward, request_deserializer=request.FromString,
                                                   response_serializer=response.SerializeToString)
    if not method.client_streaming and not method.server_streaming:
        async def unary(_request, _context):
            return answer()
        return grpc.unary_unary_rpc_method_handler(unary, request_deserializer=request.FromString,
                                                   response_serializer=response.SerializeToString)
    if not method.client_streaming:
        async def server_stream(_request, _context):
            yield answer()
        return grpc.unary_stream_rpc_method_handler(server_stream, request_deserializer=request.FromString,
                                                    response_serializer=response.SerializeToString)

    async def bidi(_requests, _context):
        yield answer()
    return grpc.stream_stream_rpc_method_handler(bidi, request_deserializer=request.FromString,
                                                 response_serializer=response.SerializeToString)


def _server(cfg, node: ReplicaNode, client: ReplicationClient):
    gate, tls = auth.build_gate(cfg, Refusals(SYSTEM_CLOCK.monotonic_ns)), auth.server_credentials(cfg)
    if cfg.grpc_server == "chronoq":
        server = h2grpc.Server(interceptors=[gate], limits=process.connection_limits(cfg))
    else:
        server = grpc.aio.server(interceptors=[gate], options=[("grpc.so_reuseport", 0)])
    service.add_to_server(server, node)
    server.add_generic_rpc_handlers((_Refuse(node.refusal(), client),))
    host = f"[{cfg.host}]" if ":" in cfg.host and not cfg.host.startswith("[") else cfg.host
    bound = f"{host}:{cfg.port}"
    try:
        port = server.add_secure_port(bound, tls) if tls else server.add_insecure_port(bound)
    except RuntimeError:
        port = 0
    if not port:
        raise errors.ClientError(f"cannot listen on {bound}: the address is in use or not local")
    return server, bound


def _open_store(cfg, lock: DirLock | None = None) -> Store:
    """The data directory as a store; ``lock`` held by the caller (None: the store takes it)."""
    return Store(cfg.data_dir, StoreOptions(segment_bytes=cfg.segment_bytes, cq_entries_per_file=cfg.cq_entries_per_file,
                                            cq_open_files_max=cfg.cq_open_files or None,
                                            verify_extra_segments=cfg.verify_extra_segments,
                                            quarantine=cfg.quarantine), dir_lock=lock)


def _open_timer(cfg, store: Store) -> TimerService:
    """The replica's timer (``following``): its recovery as a primary's (journal roll-back, replay
    from its checkpoint), then fed by the follower; it never ticks."""
    return TimerService(store, TimerOptions.from_config(cfg), SYSTEM_CLOCK, cfg.data_dir, following=True)


async def serve_replica(runtime, on_start=None) -> int | None:
    cfg, loop = runtime.config, asyncio.get_running_loop()
    runtime.state = "recovering"
    # Held here, not by the store: a rejoin closes the store, truncates and opens it again.
    os.makedirs(cfg.data_dir, exist_ok=True)
    lock = DirLock.acquire(cfg.data_dir)
    try:
        store = await loop.run_in_executor(None, _open_store, cfg, lock)
    except BaseException:
        lock.release()
        raise
    try:
        timer = await loop.run_in_executor(None, _open_timer, cfg, store)
    except BaseException:
        store.close()
        lock.release()
        raise
    runtime.say(f"chronoq data directory: {cfg.data_dir}")
    runtime.say(f"recovery: {store.report.summary()}")
    client = ReplicationClient(cfg.replica_of, **cfg.replication_connection())
    follower = Follower(store, cfg.data_dir, client, runtime.node_id, cfg.endpoint, SYSTEM_CLOCK,
                        cfg.checkpoint_interval_ms, reopen=lambda: _open_store(cfg, lock),
                        max_cut_bytes=cfg.rejoin_max_truncate_bytes, sync_acks=cfg.replication == "sync",
                        timer=timer, open_timer=lambda opened: _open_timer(cfg, opened))
    node = ReplicaNode(cfg, store, follower, runtime.node_id)
    server = None
    try:
        server, bound = _server(cfg, node, client)
        await server.start()
        node.follow_task = loop.create_task(follower.run(), name="chronoq-follower")
        runtime.state = "replica"
        runtime.say(f"chronoq is ready (a replica of {cfg.replica_of}: no sends, no consumers, no timers); "
                    f"replication on {bound} (log end {follower.commit})")
        stop = loop.create_task(runtime._stop.wait())
        promoted = loop.create_task(node.promoted.wait())
        # ``on_start(node)``: a coroutine beside the follower (etcd: chronoq.server.failover); when it
        # returns without a promotion, this replica stops following (its primary changed).
        watch = loop.create_task(on_start(node)) if on_start is not None else None
        await asyncio.wait([stop, promoted, node.follow_task] + ([watch] if watch else []),
                           return_when=asyncio.FIRST_COMPLETED)
        stop.cancel()
        promoted.cancel()
        if watch is not None:
            if not node.promoting:
                watch.cancel()  # (a promotion it began finishes: it returns right after)
            for result in await asyncio.gather(watch, return_exceptions=True):
                if isinstance(result, Exception):
                    log.error("the etcd watch beside this replica failed: %r", result)
    finally:
        if server is not None:
            await server.stop(1.0)
        await follower.stop()
        if node.follow_task is not None:
            await asyncio.gather(node.follow_task, return_exceptions=True)
        await client.close()
        if follower.timer is not None:  # a clean timer checkpoint: a promotion replays from it
            await loop.run_in_executor(None, follower.timer.close)
        await loop.run_in_executor(None, follower.store.close)
        lock.release()
    if follower.refused is not None:
        raise errors.PreconditionFailed(f"a replica cannot follow {cfg.replica_of}: {follower.refused}")
    if node.follow_task.done() and not node.follow_task.cancelled() and node.follow_task.exception():
        raise node.follow_task.exception()
    return node.epoch if node.promoted.is_set() else None
