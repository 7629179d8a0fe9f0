"""A primary's part in a cluster of broker groups (docs/cluster.md): the placement it follows,
the route it answers, the placement calls it serves.

With ``etcd_endpoints`` set, the primary of each group runs one ``ClusterKeeper`` beside its
``PrimaryDuty`` (``chronoq.server.failover``):

* it **watches** every key under ``/chronoq/<cluster>/`` (``chronoq.replication.cluster.watch``, on
  the etcd coordinator's loop) and keeps the latest ``Snapshot`` (replaced whole: readers on the
  broker's loop see one revision);
* for every placement record naming its group it **creates its local part** (``topics.json``,
  through ``chronoq.features.catalog``, the Admin path) with the recorded queue count and type:
  the record in etcd is what an operator changes, each primary makes its own part of it, again
  after every restart or promotion (a watch, not a one-shot call, so a group that was down when
  the topic was created catches up when its primary starts);
* ``route(topic)``: the queues of every live group holding the topic, each with its group's
  primary's endpoint (QueryRoute and QueryAssignment, ``chronoq.server.messaging.clients``);
* ``place``, ``add_queues``, ``drain``, ``drain_group``, ``remove_group``: an operator's change
  (``chronoq topic create`` on a clustered node, ``topic add-queues``, ``cluster drain``, ``cluster
  remove-group``), written to etcd in a transaction per placement; the call waits (bounded) for
  this node's own local part. A removed group keeps its local part and its ``@groups/`` identity
  (it may be placed again with ``add-queues``);
* ``handle_owner`` and ``forward``: a recall or reschedule whose handle names another broker
  group (``chronoq.timer.handle`` version 2) is passed on to that group's primary and its answer
  returned (``RecallMessage`` of the messaging service, ``Recall``/``Reschedule`` of the Admin
  one): the official clients send recalls to their configured address, not to the group that
  stored the message, so the node asked must find it (docs/cluster.md, "Semantics across groups").
"""

from __future__ import annotations

import asyncio
import logging

from chronoq.core import errors
from chronoq.proto import chronoq_admin_pb2 as apb
from chronoq.protocol.rocketmq import status
from chronoq.replication import cluster as etcd_cluster
from chronoq.replication import placement as pl

log = logging.getLogger("chronoq.cluster")

LOCAL_PART_WAIT_S = 5.0  # an operator's change waits this long for this node's own part
FORWARD_TIMEOUT_S = 10.0  # a call passed on to another group's primary waits at most this long


class ClusterKeeper:
    def __init__(self, runtime) -> None:
        cfg = runtime.config
        self.runtime = runtime
        self.coord = runtime.coordinator
        self.cluster, self.group = cfg.cluster_name, cfg.group_name
        self.snapshot = pl.Snapshot()
        self.ready = asyncio.Event()   # the first snapshot arrived
        self._loop: asyncio.AbstractEventLoop | None = None
        self._future = None
        self._applied: dict[str, tuple[int, str]] = {}  # topic -> (queues, type) made locally
        self._failed: dict[str, tuple[int, str]] = {}   # topic -> the part that could not be made (said once)
        self._peers: dict = {}  # endpoint -> ReplicationClient: channels to other groups' primaries
        self._identity_lost = False  # said: etcd does not hold this group's identity (claimed at start)

    # ------------------------------------------------------------------ life
    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._future = asyncio.run_coroutine_threadsafe(etcd_cluster.watch(self.coord, self._deliver), self.coord._loop)

    def stop(self) -> None:
        if self._future is not None:
            self._future.cancel()
            self._future = None
        peers, self._peers = list(self._peers.values()), {}
        if peers and self._loop is not None and not self._loop.is_closed():
            for peer in peers:  # (closed on the loop; the runtime's own tasks are gathered after this)
                self._loop.create_task(peer.close())

    def _deliver(self, snap: pl.Snapshot) -> None:
        """On the coordinator's loop: hand the snapshot to the broker's loop."""
        loop = self._loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self._take, snap)

    def _take(self, snap: pl.Snapshot) -> None:
        if snap.revision < self.snapshot.revision:
            return  # (an older read overtaken by a newer one)
        self.snapshot = snap
        self.ready.set()
        self._check_identity(snap)
        self._make_local_parts(snap)

    def _check_identity(self, snap: pl.Snapshot) -> None:
        """Say it loudly when etcd no longer holds this group's identity it held: etcd's data was
        lost or wiped, and every topic's placement (kept in etcd only) with it. Nothing else would
        tell: routes go on from each node's own topics, each group showing its part alone."""
        # (The node recorded its identity in etcd before it served: ``claim_group``, at start.)
        if self.group in snap.identities:
            self._identity_lost = False
        elif snap.revision and not self._identity_lost:
            self._identity_lost = True  # (said once per loss)
            log.error("cluster %s: etcd no longer holds broker group %s's identity (@groups/%s): etcd's data was "
                      "lost or wiped, and every topic placement with it (clients now see each group's own part of "
                      "a spread topic only). Restore etcd from a snapshot, or place the topics again; a restart of "
                      "this node records the identity again (docs/cluster.md, keys in etcd)",
                      self.cluster, self.group, self.group)

    def _make_local_parts(self, snap: pl.Snapshot) -> None:
        from chronoq.features import catalog

        broker, pop = self.runtime.broker, self.runtime.pop
        if broker is None or pop is None:
            return
        for topic, placement in snap.placements.items():
            queues = placement.groups.get(self.group)
            if not queues:
                continue
            want = (queues, placement.message_type)
            if self._applied.get(topic) == want:
                continue
            existing = broker.topics.get(topic)
            if existing is not None and existing.queues >= queues \
                    and existing.message_type.name.lower() == placement.message_type:
                self._applied[topic] = want
                continue
            try:
                catalog.create_or_update_topic(broker, pop, topic, max(queues, existing.queues if existing else 0),
                                               placement.message_type)
                self._applied[topic] = want
                log.info("cluster %s: created this group's part of %s: %d queues, %s", self.cluster, topic, queues,
                         placement.message_type)
            except Exception as exc:  # noqa: BLE001 - said once, and tried again with each snapshot
                if self._failed.get(topic) == want:
                    continue
                self._failed[topic] = want
                log.error("cluster %s: cannot create this group's part of topic %s (%d queues, %s): %s",
                          self.cluster, topic, queues, placement.message_type, exc)

    # ------------------------------------------------------------------ the route
    def route(self, topic: str):
        """``[(group, endpoint, queue id, writable)]`` or None (no placement: the local route)."""
        return pl.route(self.snapshot, topic)

    def route_queues(self, topic: str, namespace: str, per_queue: bool = True) -> list | None:
        """``MessageQueue``s of ``topic`` over the cluster (broker name = group name, id 0, its
        primary's endpoint; a draining group's queues READ only); ``per_queue`` False: one
        broker-wide queue (id -1) per group (QueryAssignment for a non-FIFO group). None: the
        topic has no placement (the caller answers its local route)."""
        from rocketmq.grpc_protocol import definition_pb2 as pb

        from chronoq.core.model import MessageType
        from chronoq.server import convert

        queues = self.route(topic)
        if queues is None:
            return None
        resource = pb.Resource(name=topic, resource_namespace=namespace)
        types = convert.accept_types(MessageType.parse(self.snapshot.placements[topic].message_type))
        brokers, out = {}, []
        for group, endpoint, qid, writable in queues:
            broker = brokers.get(group)
            if broker is None:
                broker = brokers[group] = pb.Broker(name=group, id=0, endpoints=convert.endpoints_pb(endpoint))
            elif not per_queue:
                continue
            out.append(pb.MessageQueue(topic=resource, id=qid if per_queue else -1, broker=broker,
                                       permission=pb.READ_WRITE if writable else pb.READ, accept_message_types=types))
        return out

    # ------------------------------------------------------------------ calls for other groups
    def handle_owner(self, text: str) -> str | None:
        """The endpoint of the primary of the broker group that minted recall handle ``text`` when
        that is another group (the caller passes the call on there); None when the handle is this
        group's or names no group (version 1: minted outside a cluster, answered here as before).
        A malformed handle raises ``ClientError`` as the local path would; a group etcd does not
        know, ``NotFound``; a known group without a primary now, ``TooManyRequests`` (try again:
        its replica is taking over, or its primary restarting)."""
        from chronoq.timer import handle as recall_handles

        group = recall_handles.decode(text).group
        if not group or group == self.group:
            return None
        if not self.ready.is_set():  # (starting: etcd not read yet)
            raise errors.TooManyRequests(f"this recall handle belongs to broker group {group!r}; this node has not "
                                         "read the cluster from etcd yet: try again")
        state = self.snapshot.groups.get(group)
        if state is None:
            raise errors.NotFound(f"this recall handle was minted by broker group {group!r}, which cluster "
                                  f"{self.cluster} does not know (groups: {', '.join(sorted(self.snapshot.groups))})")
        if state.leader is None:
            raise errors.TooManyRequests(f"this recall handle belongs to broker group {group!r}, which has no "
                                         "primary now (no leader key in etcd); try again once it has one")
        return state.leader.endpoint

    async def elsewhere(self, handle: str, path: str, request, response_type, time_remaining: float | None = None):
        """The answer of the group that minted ``handle`` to ``request`` (``path``: its method)
        when that is another group; None when the call is this group's to answer."""
        owner = self.handle_owner(handle)
        if owner is None:
            return None
        return await self.forward(owner, path, request, response_type, time_remaining)

    async def forward(self, endpoint: str, path: str, request, response_type, time_remaining: float | None):
        """One unary call passed on to ``endpoint`` (another group's primary), its answer returned
        as it comes. The caller passed this node's access gate; the other primary sees this node's
        replication credentials (``replication_access_key``), as a replica's calls to its primary."""
        peer = self._peers.get(endpoint)
        if peer is None:
            from chronoq.replication.client import ReplicationClient

            cfg = self.runtime.config
            peer = self._peers[endpoint] = ReplicationClient(endpoint, **cfg.replication_connection())
        timeout = FORWARD_TIMEOUT_S if time_remaining is None else max(0.1, min(time_remaining, FORWARD_TIMEOUT_S))
        try:
            return await peer.forward(path, request, response_type, timeout)
        except Exception as exc:  # noqa: BLE001 - the other primary unreachable: a status, not a crash
            raise errors.TooManyRequests(f"the primary of the broker group holding this message ({endpoint}) "
                                         f"did not answer ({type(exc).__name__}); try again") from None

    # ------------------------------------------------------------------ operators' changes
    async def _write(self, topic: str, compute) -> pl.Placement:
        coord = self.coord
        written = await coord.call(etcd_cluster.write_placement(coord, topic, compute))
        if self.group in written.groups:  # this node's own part, before the answer
            deadline = asyncio.get_running_loop().time() + LOCAL_PART_WAIT_S
            while asyncio.get_running_loop().time() < deadline:
                if self._applied.get(topic, (0, ""))[0] >= written.groups[self.group]:
                    break
                await asyncio.sleep(0.05)
        return written

    async def place(self, topic: str, queues: int, message_type: str, groups: list[str]) -> pl.Placement:
        queues = queues or self.runtime.config.default_queues
        return await self._write(topic, lambda snap: pl.place(snap, self.cluster, topic, queues, message_type, groups))

    async def add_queues(self, topic: str, group: str, queues: int) -> pl.Placement:
        return await self._write(topic, lambda snap: pl.add_queues(snap, self.cluster, topic, group, queues or None))

    async def drain(self, topic: str, group: str) -> pl.Placement:
        return await self._write(topic, lambda snap: pl.drain(snap, self.cluster, topic, group))

    async def drain_group(self, group: str) -> list[pl.Placement]:
        """``group`` drained in every placement holding it (one transaction each, as ``drain``),
        after checking them all (``placement.group_topics``: nothing is written when one refuses)."""
        topics = pl.group_topics(await self.fresh(), self.cluster, group)
        return [await self._write(t, lambda snap, t=t: pl.drain(snap, self.cluster, t, group)) for t in topics]

    async def remove_group(self, topic: str, group: str) -> pl.Placement:
        return await self._write(topic, lambda snap: pl.remove_group(snap, self.cluster, topic, group))

    async def fresh(self) -> pl.Snapshot:
        """The cluster read now (not the watched copy: an operator's view)."""
        try:
            return await self.coord.call(etcd_cluster.read(self.coord))
        except Exception as exc:  # noqa: BLE001 - say what it is, not "a chronoq bug"
            raise errors.TooManyRequests(f"etcd did not answer ({type(exc).__name__}: {exc}); try again") from None

    def placement_of(self, snap: pl.Snapshot, topic: str) -> pl.Placement:
        found = snap.placements.get(topic)
        if found is None:
            raise errors.TopicNotFound(f"topic {topic!r} has no placement in cluster {self.cluster}")
        return found


# ---------------------------------------------------------------------------- the Admin calls
_OK = apb.Status(code=status.OK, message="OK")


def placement_pb(p: pl.Placement):
    return apb.TopicPlacement(topic=p.topic, message_type=p.message_type, groups=p.groups,
                              draining=list(p.draining), revision=p.revision)


def groups_pb(snap: pl.Snapshot) -> list:
    return [apb.BrokerGroup(name=g.name, live=g.leader is not None, leader=g.leader.endpoint if g.leader else "",
                            epoch=g.epoch, members=[f"{n} {m.get('role', '?')}" for n, m in sorted(g.members.items())])
            for g in (snap.groups[n] for n in sorted(snap.groups))]


class ClusterRpcs:
    """``PlaceTopic``, ``ClusterGroups`` and a clustered ``CreateTopic`` of ``chronoq.v1.Admin``
    (``AdminService`` holds ``cluster``: this node's ``ClusterKeeper``, None without etcd)."""

    cluster: ClusterKeeper | None = None

    def _keeper(self) -> ClusterKeeper:
        if self.cluster is None:
            raise errors.PreconditionFailed("this broker is not part of a cluster (no etcd_endpoints): topics are "
                                            "created on it alone (chronoq topic create without --groups)")
        return self.cluster

    async def _boundary(self, response_type, what: str, work):
        try:
            return await work()
        except Exception as exc:  # noqa: BLE001 - this is the boundary
            code, message = status.code_and_message(exc, what)
            return response_type(status=apb.Status(code=code, message=message))

    async def _create_placed_topic(self, request):
        """``CreateTopic`` on a clustered node: the topic's placement over the live groups."""
        async def work():
            want = request.topic
            placed = await self._keeper().place(want.name, want.queues, want.message_type, [])
            return apb.CreateTopicResponse(status=_OK, topic=apb.Topic(
                name=placed.topic, queues=placed.queues(), message_type=placed.message_type))
        return await self._boundary(apb.CreateTopicResponse, "CreateTopic", work)

    async def PlaceTopic(self, request, context):
        async def work():
            keeper, groups = self._keeper(), list(request.groups)
            action = request.action or "create"
            if action == "create":
                placed = await keeper.place(request.topic, request.queues, request.message_type, groups)
            elif action in ("add-queues", "drain", "drain-group", "remove-group"):
                if len(groups) != 1:
                    raise errors.ClientError(f"{action} names exactly one group, not {len(groups)}")
                if action == "drain-group":
                    drained = await keeper.drain_group(groups[0])
                    return apb.PlaceTopicResponse(status=_OK, placements=[placement_pb(p) for p in drained])
                placed = await (keeper.add_queues(request.topic, groups[0], request.queues) if action == "add-queues"
                                else keeper.drain(request.topic, groups[0]) if action == "drain"
                                else keeper.remove_group(request.topic, groups[0]))
            else:
                raise errors.ClientError(f"unknown placement action {action!r} (create, add-queues, drain, "
                                         "drain-group, remove-group)")
            return apb.PlaceTopicResponse(status=_OK,
                                          placement=placement_pb(placed))
        return await self._boundary(apb.PlaceTopicResponse, "PlaceTopic", work)

    async def ClusterGroups(self, request, context):
        async def work():
            keeper = self._keeper()
            snap = await keeper.fresh()
            if request.topic:
                placements = [keeper.placement_of(snap, request.topic)]
            else:
                placements = [snap.placements[t] for t in sorted(snap.placements)]
            return apb.ClusterGroupsResponse(status=_OK, cluster=keeper.cluster,
                                             group=keeper.group, groups=groups_pb(snap),
                                             placements=[placement_pb(p) for p in placements])
        return await self._boundary(apb.ClusterGroupsResponse, "ClusterGroups", work)
