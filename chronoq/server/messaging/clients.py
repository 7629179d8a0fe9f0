"""The clients as the broker knows them: routes and assignments, heartbeats, Telemetry sessions
(settings, server-initiated commands) keyed by the ``x-mq-client-id`` header, and the transaction
checks pushed to producers over those sessions.

Settings replies send ``metric{on:false}``. The Python PushConsumer 5.1.2 then stops reading its
Telemetry stream after the first reply (a client bug, contract §3.3); consumption is unaffected.
The workaround (``metric.on`` with an OTLP endpoint) makes every push consumer export metrics to
that endpoint every minute and at exit, so it is not used. The namespace is echoed back but not
used to separate resources.
"""

from __future__ import annotations

import asyncio
import logging

from rocketmq.grpc_protocol import definition_pb2 as pb
from rocketmq.grpc_protocol import service_pb2 as sv

from chronoq.core import errors
from chronoq.protocol.rocketmq.receive import transaction_check_message
from chronoq.server import convert
from chronoq.server.messaging.calls import boundary, client_id, status_of, status_only
from chronoq.server.messaging.receive import LONG_POLL_DEFAULT_S

log = logging.getLogger("chronoq.grpc")

RECEIVE_BATCH_SIZE = 32             # what settings tell push consumers (Node uses it)
_PRODUCER_BACKOFF = pb.RetryPolicy(
    max_attempts=3,
    exponential_backoff=pb.ExponentialBackoff(initial=convert.duration_pb(10), max=convert.duration_pb(1000),
                                              multiplier=2.0),
)
_CONSUMER_TYPES = frozenset({pb.PUSH_CONSUMER, pb.SIMPLE_CONSUMER, pb.PULL_CONSUMER,
                             pb.LITE_PUSH_CONSUMER, pb.LITE_SIMPLE_CONSUMER})


HALF_TOPICS_MAX = 1024  # topics a producer's session remembers it sent half messages to
# A Telemetry settings command: the broker keeps its reply (the client's settings merged with its
# own) for the stream's life, so each of up to max_streams streams may hold this much. An official
# client's settings name its topics or subscriptions: ~100 B each, some KiB in all; 7 MB ones (a
# hundred thousand topic names) held 55 MB a stream.
SETTINGS_BYTES_MAX = 64 * 1024
SETTINGS_TOPICS_MAX = 1024  # topics a producer's settings name, subscriptions a consumer's
NAMESPACE_CHARS_MAX = 128   # resource_namespace (echoed in every queue of a route, which is cached)
# The settings reply is written again this long after the first, then after the second wait: the
# Node client (1.0.8) opens its Telemetry stream, and sends its settings, while it still fetches the
# routes of its other topics, and only then starts waiting for the reply. With three topics or
# more the reply had always come in between, and its startup() hung until its own re-send five
# minutes later. The clients take settings at any time (contract §3.4); a stream ends its waits.
SETTINGS_AGAIN_S = (0.5, 2.0)


class TelemetrySession:
    """One client's Telemetry stream. Writes are serialised: gRPC allows one at a time.

    ``topics`` are a producer's publishing topics as of its last settings (the clients re-send
    settings every 5 minutes only, so a topic first used after start-up may be missing);
    ``half_topics`` the topics it sent a transactional message to on this stream's watch (up to
    HALF_TOPICS_MAX): its checker answers for those too.
    """

    __slots__ = ("client_id", "context", "lock", "client_type", "group", "topics", "half_topics", "settings")

    def __init__(self, client_id: str, context) -> None:
        self.client_id = client_id
        self.context = context
        self.lock = asyncio.Lock()
        self.client_type = pb.CLIENT_TYPE_UNSPECIFIED
        self.group = ""
        self.topics: frozenset[str] = frozenset()
        self.half_topics: set[str] = set()
        self.settings = None  # the last settings reply (written again: SETTINGS_AGAIN_S)

    def publishes(self, topic: str) -> bool:
        """A producer whose transaction checker may be asked about ``topic``'s half messages."""
        return self.client_type == pb.PRODUCER and (topic in self.topics or topic in self.half_topics)

    async def write(self, command) -> None:
        async with self.lock:
            await self.context.write(command)



class ClientRpcs:
    """Routes, client sessions and transaction checks of ``MessagingService`` (which holds
    ``config``, ``broker``, ``pop``, ``txns``, ``clock``, ``sessions``, ``_routes``, ``_broker_pb``,
    ``_stopping`` and the cached OK answers)."""

    async def _check_transaction(self, half, message) -> bool:
        """Push a check of ``half`` to a producer (the runtime's check loop calls this); True
        when one took it."""
        command = sv.TelemetryCommand(recover_orphaned_transaction_command=sv.RecoverOrphanedTransactionCommand(
            message=transaction_check_message(message, half.topic), transaction_id=format(half.offset, "x")))
        # Only a producer of the topic: one that declared it in its settings or sent a half
        # message to it since its stream opened (the clients declare the topics given at
        # start-up only, contract §6.2.13). Never another application's producer: its checker
        # knows nothing of this transaction, and its answer (a ROLLBACK, say) would be taken.
        # With none connected the half waits for the next check, as RocketMQ's proxy has it.
        for session in [s for s in self.sessions.values() if s.publishes(half.topic)]:
            if await self.push(session.client_id, command):
                return True
        return False

    def _sent_half(self, client_id: str, topic: str) -> None:
        """A producer sent a transactional message to ``topic``: its checker answers for it."""
        session = self.sessions.get(client_id)
        if session is not None and len(session.half_topics) < HALF_TOPICS_MAX:
            session.half_topics.add(topic)

    # ------------------------------------------------------------------ routes
    def _away_from_here(self, queues: list) -> list:
        """A fenced primary (stepping down) never names itself in a route: its queues name the
        leader etcd names instead (``Leadership.successor``; none known: a retryable refusal)."""
        here, moved, successor = self._broker_pb.endpoints, [], None
        for queue in queues:
            if queue.broker.endpoints == here:
                if successor is None:  # (another group's queues need no successor)
                    successor = convert.endpoints_pb(self.committer.leadership.successor())
                copy = pb.MessageQueue()
                copy.CopyFrom(queue)
                copy.broker.endpoints.CopyFrom(successor)
                queue = copy
            moved.append(queue)
        return moved

    @boundary(status_only(sv.QueryRouteResponse), "QueryRoute")
    async def QueryRoute(self, request, context):
        name = convert.topic_name(request.topic)
        _check_namespace(request.topic.resource_namespace)
        fenced = self.committer is not None and self.committer.fenced
        if self.cluster is not None:  # a placed topic: every group's queues (chronoq.server.cluster)
            queues = self.cluster.route_queues(name, request.topic.resource_namespace)
            if queues is not None:
                return sv.QueryRouteResponse(status=self._ok,
                                             message_queues=self._away_from_here(queues) if fenced else queues)
        cfg = self.broker.topic(name)
        namespace = request.topic.resource_namespace
        if fenced:
            return sv.QueryRouteResponse(status=self._ok, message_queues=self._away_from_here(
                convert.route_queues(cfg, namespace, self._broker_pb)))
        key = (name, namespace)
        shape = (cfg.queues, cfg.message_type)
        cached = self._routes.get(key)
        if cached is not None and cached[0] == shape:
            return cached[1]
        response = sv.QueryRouteResponse(status=self._ok,
                                         message_queues=convert.route_queues(cfg, namespace, self._broker_pb))
        if len(self._routes) > 10_000:
            self._routes.clear()
        self._routes[key] = (shape, response)
        return response

    @boundary(status_only(sv.QueryAssignmentResponse), "QueryAssignment")
    async def QueryAssignment(self, request, context):
        name = convert.topic_name(request.topic)
        _check_namespace(request.topic.resource_namespace)
        group = convert.group_name(request.group)
        fenced = self.committer is not None and self.committer.fenced
        if self.cluster is not None:  # a placed topic: every group's queues (chronoq.server.cluster)
            queues = self.cluster.route_queues(name, request.topic.resource_namespace, self.pop.group(group).fifo)
            if queues is not None:
                queues = self._away_from_here(queues) if fenced else queues
                return sv.QueryAssignmentResponse(status=self._ok,
                                                  assignments=[pb.Assignment(message_queue=q) for q in queues])
        cfg = self.broker.topic(name)
        namespace = request.topic.resource_namespace
        # FIFO groups get one assignment per queue (the proxy's "orderly" answer); others one
        # broker-wide assignment with id -1. Receives serve the whole topic either way.
        ids = None if self.pop.group(group).fifo else (-1,)
        queues = convert.route_queues(cfg, namespace, self._broker_pb, ids)
        if fenced:
            queues = self._away_from_here(queues)
        return sv.QueryAssignmentResponse(status=self._ok,
                                          assignments=[pb.Assignment(message_queue=q) for q in queues])

    # ------------------------------------------------------------------ client sessions
    @boundary(status_only(sv.HeartbeatResponse), "Heartbeat")
    async def Heartbeat(self, request, context):
        self.pop.client_seen(client_id(context))  # keeps its auto-renewals going
        return self._ok_heartbeat

    @boundary(status_only(sv.NotifyClientTerminationResponse), "NotifyClientTermination")
    async def NotifyClientTermination(self, request, context):
        self.pop.client_gone(client_id(context))  # its messages are renewed no more
        return self._ok_termination

    async def Telemetry(self, request_iterator, context):
        try:
            cid = client_id(context)
        except errors.ClientError as exc:
            await context.write(sv.TelemetryCommand(status=status_of(exc, "Telemetry")))
            return
        session = TelemetrySession(cid, context)
        self.sessions[cid] = session
        again = None
        try:
            async for command in request_iterator:
                reply = self._telemetry_reply(command, session)
                if reply is not None:
                    await session.write(reply)
                    if reply.HasField("settings") and reply.status.code == self._ok.code:
                        session.settings = reply
                        if again is None:
                            again = asyncio.ensure_future(_settings_again(session))
        except Exception as exc:  # noqa: BLE001 - a broken stream ends this session only
            log.debug("telemetry stream of %r ended: %r", cid, exc)
        finally:
            if again is not None:
                again.cancel()
            if self.sessions.get(cid) is session:
                del self.sessions[cid]

    async def push(self, client_id: str, command) -> bool:
        """Write a server-initiated command (e.g. a transaction check) to a client's stream.

        False when the client has no open stream or the write fails.
        """
        session = self.sessions.get(client_id)
        if session is None:
            return False
        try:
            await session.write(command)
        except Exception as exc:  # noqa: BLE001 - a dead stream: the caller tries another client
            log.debug("push to %r failed: %r", client_id, exc)
            return False
        return True

    def _telemetry_reply(self, command, session: TelemetrySession):
        which = command.WhichOneof("command")
        if which != "settings":
            # Replies to our own commands (thread stack traces, verify results): nothing to answer.
            return None
        try:
            settings = self._merged_settings(command.settings, session)
            return sv.TelemetryCommand(status=self._ok, settings=settings)
        except Exception as exc:  # noqa: BLE001 - the boundary for one settings command
            return sv.TelemetryCommand(status=status_of(exc, "Telemetry settings"), settings=command.settings)

    def _merged_settings(self, client, session: TelemetrySession):
        """The client's settings with the server's values merged in (contract §3.3)."""
        size = client.ByteSize()
        if size > SETTINGS_BYTES_MAX:
            raise errors.ClientError(f"settings of {size} bytes; at most {SETTINGS_BYTES_MAX} allowed")
        listed = max(len(client.publishing.topics), len(client.subscription.subscriptions))
        if listed > SETTINGS_TOPICS_MAX:
            raise errors.ClientError(f"settings name {listed} topics; at most {SETTINGS_TOPICS_MAX} allowed")
        out = pb.Settings()
        out.CopyFrom(client)
        session.client_type = client.client_type
        if client.client_type == pb.PRODUCER or (client.HasField("publishing")
                                                  and not client.HasField("subscription")):
            session.topics = frozenset(convert.topic_name(t) for t in client.publishing.topics)
            out.publishing.max_body_size = self.config.max_body_bytes
            out.publishing.validate_message_type = True
            out.backoff_policy.CopyFrom(_PRODUCER_BACKOFF)
        elif client.client_type in _CONSUMER_TYPES or client.HasField("subscription"):
            group = convert.group_name(client.subscription.group)
            session.group = group
            gc = self.pop.group(group)  # an unknown group is created with the defaults
            sub = out.subscription
            if convert.duration_ms(sub.long_polling_timeout) <= 0:
                sub.long_polling_timeout.CopyFrom(convert.duration_pb(int(LONG_POLL_DEFAULT_S * 1000)))
            sub.fifo = bool(gc.fifo)
            sub.receive_batch_size = RECEIVE_BATCH_SIZE
            # Customized back-off is what the Python client reads (contract §3.3).
            out.backoff_policy.CopyFrom(pb.RetryPolicy(
                max_attempts=gc.max_attempts,
                customized_backoff=pb.CustomizedBackoff(next=[convert.duration_pb(ms) for ms in gc.retry_delays_ms]),
            ))
        else:
            raise errors.ClientError("settings carry neither publishing nor subscription")
        out.metric.Clear()
        out.metric.on = False
        return out


def _check_namespace(namespace: str) -> None:
    """Namespaces are echoed, not used (docs/rocketmq.md), but echoed in every queue of a route,
    and routes are cached: a megabyte namespace cost megabytes a call."""
    if len(namespace) > NAMESPACE_CHARS_MAX:
        raise errors.ClientError(f"resource_namespace is {len(namespace)} characters; at most "
                                 f"{NAMESPACE_CHARS_MAX} allowed")
    if not namespace.isprintable():
        raise errors.ClientError("resource_namespace holds a control character")


async def _settings_again(session: TelemetrySession) -> None:
    """Write the session's last settings reply again, SETTINGS_AGAIN_S apart (the Node client's
    startup misses one that comes too early). Cancelled when the stream ends."""
    for wait in SETTINGS_AGAIN_S:
        await asyncio.sleep(wait)
        try:
            await session.write(session.settings)
        except Exception as exc:  # noqa: BLE001 - the stream is going: its handler ends this task
            log.debug("settings again to %r failed: %r", session.client_id, exc)
            return
