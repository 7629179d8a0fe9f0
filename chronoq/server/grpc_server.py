"""The gRPC front end: ``apache.rocketmq.v2.MessagingService`` for the official RocketMQ 5 clients.

A thin shell. Each RPC decodes and validates (``convert``), calls the broker, the group committer
or the POP service, and encodes the answer. Errors never leave as gRPC errors: every RPC has one
``try`` boundary that turns any exception into the response's ``status`` (``status.fill``), the way
the reference proxy does (contract §0). Nothing a client sends may crash the server.

What the shell owns besides the RPCs:

- the ``PopService`` (created in ``start``, closed in ``stop``) and a ticker task that calls
  ``pop.tick()`` at ``pop.next_deadline_ms()``, at least every ``TICK_MAX_S``;
- long polling: parked receives wait on a ``_Waker`` that is woken, coalesced to at most once per
  event-loop pass, when messages arrive (broker arrival listener), when revived messages become
  visible (``tick`` returned > 0), and after acks of FIFO groups and DLQ forwards (they unblock
  a FIFO queue). Every parked receive then tries again: cheap for tens of parked consumers; a
  per-topic wait list is the next step if thousands park at once;
- Telemetry sessions keyed by the ``x-mq-client-id`` header, so later features (transaction checks)
  can push commands to a client.

Choices worth knowing (details in ``shared/protocol/rocketmq-v2-contract.md``):

- The port is served by ``h2grpc.Server`` (chronoq's own HTTP/2 gRPC server on this event
  loop) unless ``grpc_server = "grpcio"``; both take the same handlers and the access gate.

- Push consumers receive with ``auto_renew=true`` and no invisible duration: the messages stay
  invisible in slices of ``push_invisible_ms`` (60 s), renewed in place while the client is alive
  (Heartbeat, receives; NotifyClientTermination ends it) until acked or nacked, up to
  ``auto_renew_max_ms`` (``chronoq/pop/renew.py``). The receipt handles stay the same.
- Receives serve every queue of the topic for the group, whatever queue id the client names.
- ``chronoq.v1.Consume/ReceiveBatch`` (not RocketMQ): a ReceiveMessage answered in one unary
  response instead of a stream, for ``chronoq.client.client``; a server's per-streamed-message cost
  is what it saves (``wire.receive_batch``). ``AckAndReceive`` acks the last batch and receives
  the next in one call.
- A long poll answers by ``min(long_polling_timeout, deadline - POLL_MARGIN_S)``.
- Settings replies send ``metric{on:false}``. The Python PushConsumer 5.1.2 then stops reading its
  Telemetry stream after the first reply (a client bug, contract §3.3); consumption is unaffected.
  The workaround (``metric.on`` with an OTLP endpoint) makes every push consumer export metrics to
  that endpoint every minute and at exit, so it is not used.
- The namespace is echoed back but not used to separate resources.
"""

from __future__ import annotations

import asyncio
import logging
import operator

import grpc
from rocketmq.grpc_protocol import definition_pb2, service_pb2, service_pb2_grpc

from chronoq.core import errors, model, refusals, validate
from chronoq.protocol import wire
from chronoq.pop import names as pop_names
from chronoq.pop.service import PopService
from chronoq.server import admin, answers, auth, convert, h2grpc, h2limits, plainsend, status
from chronoq.timer import handle as recall_handles
from chronoq.features.transactions import Transactions

log = logging.getLogger("chronoq.grpc")

pb = definition_pb2
sv = service_pb2
_TRANSACTION = model.MessageType.TRANSACTION  # (an enum member lookup costs ~1 us on 3.11)

DEFAULT_INVISIBLE_MS = 60_000       # when a non-push receive names none
LONG_POLL_DEFAULT_S = 20.0          # when the request names none
LONG_POLL_MAX_S = 60.0              # never park longer than this, whatever the client asks
POLL_MARGIN_S = 1.0                 # answer at least this long before the client's deadline
RECEIVE_BATCH_MAX = pop_names.MAX_MESSAGES_MAX  # batch_size is clamped to this (32)
RECEIVE_BATCH_SIZE = 32             # what settings tell push consumers (Node uses it)
SEND_BATCH_MAX = 1024               # messages in one SendMessage request
TICK_MAX_S = 0.5                    # the POP ticker runs at least this often
TXN_SCAN_S = 1.0                    # how often unresolved transactions are looked at
STOP_GRACE_S = 1.0                  # in-flight RPCs get this long when the server stops

CLIENT_ID_HEADER = "x-mq-client-id"
# chronoq's own consume calls beside the RocketMQ service (chronoq.client.client uses them when offered).
MESSAGING_SERVICE = "apache.rocketmq.v2.MessagingService"
CONSUME_SERVICE = "chronoq.v1.Consume"

_PRODUCER_BACKOFF = pb.RetryPolicy(
    max_attempts=3,
    exponential_backoff=pb.ExponentialBackoff(initial=convert.duration_pb(10), max=convert.duration_pb(1000),
                                              multiplier=2.0),
)
_CONSUMER_TYPES = frozenset({pb.PUSH_CONSUMER, pb.SIMPLE_CONSUMER, pb.PULL_CONSUMER,
                             pb.LITE_PUSH_CONSUMER, pb.LITE_SIMPLE_CONSUMER})


def _ok_status(message: str = "OK"):
    return pb.Status(code=status.OK, message=message)


def _status_of(exc: BaseException, what: str):
    code, message = status.code_and_message(exc, what)
    return pb.Status(code=code, message=message)


def _header(context, key: str) -> str:
    for k, v in context.invocation_metadata() or ():
        if k == key:
            return v
    return ""


def _boundary(response_type, what: str):
    """The one exception boundary of a unary RPC: any exception becomes the response's status."""

    def wrap(fn):
        async def handler(self, request, context):
            try:
                return await fn(self, request, context)
            except Exception as exc:  # noqa: BLE001 - this is the boundary
                self._count_refusal(exc, context, what)
                return response_type(status=_status_of(exc, what))

        handler.__name__ = fn.__name__
        handler.__doc__ = fn.__doc__
        return handler

    return wrap


def _ack_with_empty(pop, group: str, topic: str, handles: list[str]) -> list:
    """``pop.ack_many`` for a request where some receipt handles are empty (those fail)."""
    settled = iter(pop.ack_many(group, topic, [h for h in handles if h]))
    return [next(settled) if h else errors.InvalidReceiptHandle("the receipt handle is empty") for h in handles]


class AckAndReceiveRequest:
    """A ``chronoq.v1.Consume/AckAndReceive`` request (``wire``): an AckMessageRequest and a
    ReceiveMessageRequest. ``chronoq.server.auth`` reads ``ack`` and ``receive`` to check rights."""

    __slots__ = ("ack", "receive")

    def __init__(self, ack, receive) -> None:
        self.ack = ack
        self.receive = receive

    @classmethod
    def parse(cls, blob: bytes) -> "AckAndReceiveRequest":
        """ValueError (or protobuf's DecodeError) when malformed: the gate answers BAD_REQUEST."""
        parts = dict(wire.length_fields(blob))
        if set(parts) != {1, 2}:
            raise ValueError("AckAndReceive needs exactly an ack (1) and a receive (2)")
        return cls(sv.AckMessageRequest.FromString(parts[1]), sv.ReceiveMessageRequest.FromString(parts[2]))


class SendRequest:
    """A SendMessageRequest and the bytes it was parsed from: ``plainsend`` reads a batch's
    columns from the bytes (a third of the cost of reading the parsed messages). Parsed at once,
    so malformed bytes fail where any request's would. ``chronoq.server.auth`` reads ``messages``."""

    __slots__ = ("raw", "messages")

    def __init__(self, raw: bytes) -> None:
        self.raw = raw
        self.messages = sv.SendMessageRequest.FromString(raw).messages

    @classmethod
    def parse(cls, raw: bytes) -> "SendRequest":
        return cls(bytes(raw))


def serialize_answer(response) -> bytes:
    """A response serializer that lets a handler answer bytes it encoded itself (``chronoq.protocol.wire``)."""
    return response if type(response) is bytes else response.SerializeToString()


class _Waker:
    """Wakes parked long polls. Waking is coalesced to at most once per event-loop pass."""

    def __init__(self) -> None:
        self._event = asyncio.Event()
        self._scheduled = False
        self.parked = 0

    def current(self) -> asyncio.Event:
        return self._event

    def wake_soon(self) -> None:
        if self._scheduled or not self.parked:
            return
        self._scheduled = True
        asyncio.get_running_loop().call_soon(self._wake)

    def wake_now(self) -> None:
        event, self._event = self._event, asyncio.Event()
        event.set()

    def _wake(self) -> None:
        self._scheduled = False
        self.wake_now()


class _TelemetrySession:
    """One client's Telemetry stream. Writes are serialised: gRPC allows one at a time.

    ``topics`` are a producer's publishing topics as of its last settings (the clients re-send
    settings every 5 minutes only, so a topic first used after start-up may be missing).
    """

    __slots__ = ("client_id", "context", "lock", "client_type", "group", "topics")

    def __init__(self, client_id: str, context) -> None:
        self.client_id = client_id
        self.context = context
        self.lock = asyncio.Lock()
        self.client_type = pb.CLIENT_TYPE_UNSPECIFIED
        self.group = ""
        self.topics: frozenset[str] = frozenset()

    async def write(self, command) -> None:
        async with self.lock:
            await self.context.write(command)


_get_handle, _get_message_id = operator.attrgetter("receipt_handle"), operator.attrgetter("message_id")


class MessagingService(service_pb2_grpc.MessagingServiceServicer):
    def __init__(self, config, broker, committer, pop, txns: Transactions | None = None) -> None:
        self.config = config
        self.broker = broker
        self.committer = committer
        self.pop = pop
        self.txns = txns if txns is not None else Transactions(broker)
        self._txn_task: asyncio.Task | None = None
        self.clock = broker.clock
        self.sessions: dict[str, _TelemetrySession] = {}
        self._broker_pb = pb.Broker(name=config.broker_name, id=0, endpoints=convert.endpoints_pb(config.endpoint))
        self._store_host = config.endpoint
        self._store_host_field = convert.store_host_field(config.endpoint)
        self._routes: dict[tuple[str, str], tuple[object, sv.QueryRouteResponse]] = {}
        self._waker = _Waker()
        self._tick_kick = asyncio.Event()
        self._ticker: asyncio.Task | None = None
        self._stopping = False
        self._ok = _ok_status()
        self._ok_heartbeat = sv.HeartbeatResponse(status=self._ok)
        self._ok_termination = sv.NotifyClientTerminationResponse(status=self._ok)
        self._ok_forward = sv.ForwardMessageToDeadLetterQueueResponse(status=self._ok)
        self._receive_ok = sv.ReceiveMessageResponse(status=self._ok)
        self._receive_empty = sv.ReceiveMessageResponse(
            status=pb.Status(code=status.MESSAGE_NOT_FOUND, message="no new message"))
        self._receive_ok_bytes = self._receive_ok.SerializeToString()
        self._receive_empty_bytes = self._receive_empty.SerializeToString()
        # Receive answers not yet taken by their peers: bounded in bytes and time (answers.py).
        self.answers = answers.AnswerBudget(config.answer_budget_per_connection, config.answer_budget_total,
                                            config.answer_send_timeout_ms * 1_000_000, self.clock.monotonic_ns)

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        self.broker.add_arrival_listener(self._on_arrival)
        self._ticker = asyncio.get_running_loop().create_task(self._tick_loop(), name="chronoq-pop-ticker")
        self._txn_task = asyncio.get_running_loop().create_task(self._txn_loop(), name="chronoq-txn-checks")

    def begin_stop(self) -> None:
        """Answer parked long polls now and stop parking new ones."""
        self._stopping = True
        self._waker.wake_now()

    async def close(self) -> None:
        self._stopping = True
        for task in (self._ticker, self._txn_task):
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        self._ticker = self._txn_task = None
        try:
            self.txns.checkpoint()
        except errors.StorageError as exc:  # e.g. a full disk: the broker must still close; start-up replays more
            log.error("could not save the transaction state at stop: %s", exc.message)

    def expire_answers(self) -> int:
        """End the receives whose answers waited on their peers longer than answer_send_timeout_ms:
        their messages go back to the queue at once, their calls end (the ticker calls this)."""
        expired = self.answers.expire()
        for held in expired:
            self._release(held.group, held.topic, held.popped)
            if answers.end_call(held):  # (grpcio: held until its write returns or fails)
                self.answers.release(held)
            self.broker.refusals.refuse(refusals.ANSWER_BUDGET, held.peer, (
                f"a receive answer of {held.nbytes} bytes was not taken within answer_send_timeout_ms "
                f"({self.config.answer_send_timeout_ms} ms); its messages were released and the call ended"))
        return len(expired)

    def _on_arrival(self) -> None:
        if not self._stopping:
            self._waker.wake_soon()

    async def _tick_loop(self) -> None:
        pop, clock, kick = self.pop, self.clock, self._tick_kick
        failures = 0
        while not self._stopping:
            kick.clear()  # before the tick: a kick during it makes the next wait end at once
            try:
                self.expire_answers()
                if pop.tick():
                    self._waker.wake_soon()
                deadline_ms = pop.next_deadline_ms()
                failures = 0
            except Exception:  # keep ticking; the next pass retries (log the first of a streak)
                if failures % 120 == 0:
                    log.exception("POP tick failed (%d times in a row)", failures + 1)
                failures += 1
                deadline_ms = None
            delay = TICK_MAX_S
            if deadline_ms is not None:
                delay = min(TICK_MAX_S, max(0.001, (deadline_ms - clock.wall_ms()) / 1000))
            try:
                await asyncio.wait_for(kick.wait(), delay)
            except asyncio.TimeoutError:
                pass

    async def _txn_loop(self) -> None:
        """Check unresolved half messages with a producer of their topic; expire the hopeless."""
        txns = self.txns
        saved = None
        storage_fault = None  # the storage error last reported: a full disk is said once, not per pass
        while not self._stopping:
            await asyncio.sleep(TXN_SCAN_S)
            try:
                checks, expired = txns.due_checks(self.clock.wall_ms())
                for half, message in checks:
                    await self._check_transaction(half, message)
                for half in expired:
                    txns.expire(half)
                state = (len(txns.pending), min(txns.pending, default=-1))
                if state != saved:  # persist the replay floor only when it moved
                    txns.checkpoint()
                    saved = state
                if storage_fault is not None:
                    log.warning("transaction checks work again (storage recovered)")
                    storage_fault = None
            except (errors.StorageError, OSError) as exc:  # e.g. disk full: retried each pass, said once
                if str(exc) != storage_fault:
                    log.warning("transaction check pass failed, retrying every %.0f s: %s", TXN_SCAN_S, exc)
                    storage_fault = str(exc)
            except Exception:  # noqa: BLE001 - keep checking; the next pass retries
                log.exception("transaction check pass failed")

    async def _check_transaction(self, half, message) -> None:
        command = sv.TelemetryCommand(recover_orphaned_transaction_command=sv.RecoverOrphanedTransactionCommand(
            message=convert.stored_message_pb(message, pb.TRANSACTION), transaction_id=format(half.offset, "x")))
        # Producers that declared the topic first, then any producer: the clients only declare
        # the topics given at start-up (contract §6.2.13).
        candidates = sorted(self.sessions.values(), key=lambda s: half.topic not in s.topics)
        for session in candidates:
            if session.client_type == pb.PRODUCER and await self.push(session.client_id, command):
                return
        log.debug("no producer connected to check transaction %x of topic %s", half.offset, half.topic)

    # ------------------------------------------------------------------ routes
    @_boundary(sv.QueryRouteResponse, "QueryRoute")
    async def QueryRoute(self, request, context):
        name = convert.topic_name(request.topic)
        cfg = self.broker.topic(name)
        namespace = request.topic.resource_namespace
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

    @_boundary(sv.QueryAssignmentResponse, "QueryAssignment")
    async def QueryAssignment(self, request, context):
        name = convert.topic_name(request.topic)
        group = convert.group_name(request.group)
        cfg = self.broker.topic(name)
        namespace = request.topic.resource_namespace
        # FIFO groups get one assignment per queue (the proxy's "orderly" answer); others one
        # broker-wide assignment with id -1. Receives serve the whole topic either way.
        ids = None if self.pop.group(group).fifo else (-1,)
        queues = convert.route_queues(cfg, namespace, self._broker_pb, ids)
        return sv.QueryAssignmentResponse(status=self._ok,
                                          assignments=[pb.Assignment(message_queue=q) for q in queues])

    # ------------------------------------------------------------------ client sessions
    @_boundary(sv.HeartbeatResponse, "Heartbeat")
    async def Heartbeat(self, request, context):
        self.pop.client_seen(_header(context, CLIENT_ID_HEADER))  # keeps its auto-renewals going
        return self._ok_heartbeat

    @_boundary(sv.NotifyClientTerminationResponse, "NotifyClientTermination")
    async def NotifyClientTermination(self, request, context):
        self.pop.client_gone(_header(context, CLIENT_ID_HEADER))  # its messages are renewed no more
        return self._ok_termination

    async def Telemetry(self, request_iterator, context):
        client_id = _header(context, CLIENT_ID_HEADER)
        session = _TelemetrySession(client_id, context)
        self.sessions[client_id] = session
        try:
            async for command in request_iterator:
                reply = self._telemetry_reply(command, session)
                if reply is not None:
                    await session.write(reply)
        except Exception as exc:  # noqa: BLE001 - a broken stream ends this session only
            log.debug("telemetry stream of %r ended: %r", client_id, exc)
        finally:
            if self.sessions.get(client_id) is session:
                del self.sessions[client_id]

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

    def _telemetry_reply(self, command, session: _TelemetrySession):
        which = command.WhichOneof("command")
        if which != "settings":
            # Replies to our own commands (thread stack traces, verify results): nothing to answer.
            return None
        try:
            settings = self._merged_settings(command.settings, session)
            return sv.TelemetryCommand(status=self._ok, settings=settings)
        except Exception as exc:  # noqa: BLE001 - the boundary for one settings command
            return sv.TelemetryCommand(status=_status_of(exc, "Telemetry settings"), settings=command.settings)

    def _merged_settings(self, client, session: _TelemetrySession):
        """The client's settings with the server's values merged in (contract §3.3)."""
        out = pb.Settings()
        out.CopyFrom(client)
        session.client_type = client.client_type
        if client.client_type == pb.PRODUCER or (client.HasField("publishing")
                                                  and not client.HasField("subscription")):
            session.topics = frozenset(t.name for t in client.publishing.topics)
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

    # ------------------------------------------------------------------ sending
    @_boundary(sv.SendMessageResponse, "SendMessage")
    async def SendMessage(self, request, context):
        messages = request.messages
        if not messages:
            raise errors.ClientError("SendMessage carries no message")
        if len(messages) > SEND_BATCH_MAX:
            raise errors.ClientError(f"SendMessage carries {len(messages)} messages; at most {SEND_BATCH_MAX}")
        if len(messages) == 1:  # the official clients' only shape
            entry = await self._send_one(messages[0], context)
            return sv.SendMessageResponse(status=entry.status, entries=[entry])
        # The common batch (plain messages of one topic) is checked and stored in bulk
        # (Broker.write_plain); anything else, or any rule broken, takes _send_batch. Its columns
        # come from the request's bytes when it has them (plainsend), else from the messages.
        plain = plainsend.columns(request.raw) if type(request) is SendRequest else None
        if plain is None:
            plain = convert.plain_batch(messages)
        if plain is not None:
            offsets = await self.committer.send_plain(*plain)
            if offsets is not None:
                return wire.send_response_ok_plain(plain[1], offsets)  # (serialize_answer)
        return await self._send_batch(messages, context)

    async def _send_batch(self, messages, context=None):
        """A batch message by message (``outgoing_from_pb``, ``Broker.write``): every shape."""
        if any(m.system_properties.message_type == pb.TRANSACTION for m in messages):
            raise errors.ClientError("a transactional message must be sent alone, one per SendMessage")
        try:  # one group commit for the whole request
            decode, cfg, now = convert.outgoing_from_pb, self.config, self.clock.wall_ms()
            body_max, delay_max = cfg.max_body_bytes, cfg.timer_max_delay_ms  # (once per request)
            results = await self.committer.send([decode(m, body_max, now, delay_max) for m in messages])
        except (errors.ClientError, errors.NotYetImplemented, errors.Unsupported):
            # The broker refuses a batch with one bad message as a whole. Send them one by one
            # instead, so each gets its own answer (the committer still groups the fsyncs).
            entries = await asyncio.gather(*(self._send_one(m, context) for m in messages))
        else:
            # All accepted: encoded by hand (chronoq.protocol.wire), a third of the cost of building
            # SendResultEntry objects, and answered as bytes (serialize_answer).
            return wire.send_response_ok([(r.message_id, r.queue_offset, r.recall_handle) for r in results])
        # Clients read the top-level status only: report the first failure there.
        top = next((e.status for e in entries if e.status.code != status.OK), self._ok)
        return sv.SendMessageResponse(status=top, entries=entries)

    async def _send_one(self, msg, context=None):
        """Exactly one ``SendResultEntry`` for one message, failures included."""
        try:
            outgoing = self._outgoing(msg)
            if outgoing.message_type is _TRANSACTION:
                return await self._send_half(outgoing)
            r = (await self.committer.send([outgoing]))[0]
        except Exception as exc:  # noqa: BLE001 - the answer for this message
            self._count_refusal(exc, context, "SendMessage")
            return sv.SendResultEntry(status=_status_of(exc, "SendMessage"),
                                      message_id=msg.system_properties.message_id)
        return sv.SendResultEntry(status=self._ok, message_id=r.message_id, offset=r.queue_offset,
                                  recall_handle=r.recall_handle)

    def _count_refusal(self, exc: BaseException, context, what: str) -> None:
        """Count a request refused for what it carried (a field that failed validation) or for a
        full disk (chronoq.core.refusals); other failures (not found, a stale handle) are answers, not
        refusals. Limits count where they refuse (parked polls, the answer budget)."""
        if isinstance(exc, errors.DiskFull):
            reason = refusals.DISK_FULL
        elif isinstance(exc, errors.ClientError) and not isinstance(exc, errors.InvalidReceiptHandle):
            reason = refusals.INVALID
        else:
            return
        self.broker.refusals.refuse(reason, context.peer() if context is not None else "", f"{what}: {exc}")

    def _outgoing(self, msg):
        return convert.outgoing_from_pb(msg, self.config.max_body_bytes, self.clock.wall_ms(),
                                        self.config.timer_max_delay_ms)

    async def _send_half(self, outgoing):
        half = self.txns.half_message(outgoing)
        results = await self.committer.send([half], system=True)
        txid = self.txns.accepted(results, [half])[0]
        r = results[0]
        return sv.SendResultEntry(status=self._ok, message_id=r.message_id, offset=r.queue_offset,
                                  transaction_id=txid)

    @_boundary(sv.EndTransactionResponse, "EndTransaction")
    async def EndTransaction(self, request, context):
        if request.resolution not in (pb.COMMIT, pb.ROLLBACK):
            raise errors.ClientError("resolution must be COMMIT or ROLLBACK")
        topic = request.topic.name
        half, batch, system = self.txns.resolution_batch(topic, request.message_id, request.transaction_id,
                                                         request.resolution == pb.COMMIT)
        # Copy (if committing) then the op record, under one fsync; the half is resolved only
        # once both are durable, so a crash before that leaves it pending and checked again.
        for outgoing, is_system in zip(batch, system):
            self.broker.write([outgoing], system=is_system)
        await self.committer.barrier()
        self.txns.resolved(half)
        return sv.EndTransactionResponse(status=self._ok)

    @_boundary(sv.RecallMessageResponse, "RecallMessage")
    async def RecallMessage(self, request, context):
        """Cancel a pending delayed message. chronoq answers definitely (beyond RocketMQ's
        best effort): OK = cancelled for good; NOT_FOUND = unknown handle; BAD_REQUEST with
        "already delivered" = it became visible before the recall."""
        topic = convert.topic_name(request.topic)
        if not request.recall_handle:
            raise errors.ClientError("recall_handle is missing")
        handle_topic = recall_handles.decode(request.recall_handle).topic
        if handle_topic != topic:  # checked first: a recall for the wrong topic must change nothing
            raise errors.ClientError(f"recall handle belongs to topic {handle_topic}, not {topic}")
        result = self.broker.recall(request.recall_handle)
        outcome = result.outcome.value
        if outcome == "cancelled":
            return sv.RecallMessageResponse(status=self._ok, message_id=result.message_id)
        if outcome == "already_delivered":
            raise errors.ClientError(f"message {result.message_id} was already delivered; it cannot be recalled")
        raise errors.NotFound(f"no pending delayed message for this recall handle ({result.detail or 'unknown'})")

    # ------------------------------------------------------------------ receiving
    async def ReceiveMessage(self, request, context):
        popped = ()
        held = None
        try:
            group, topic, popped = await self._receive(request, context)
            # Serialized by hand (serialize_answer passes bytes on), with the MD5 digest.
            responses = convert.messages_bytes(popped, topic, request.message_queue.topic.resource_namespace,
                                               self._store_host_field, md5=True)
            if responses:
                held, popped, responses = self._hold(context, group, topic, popped, responses)
        except Exception as exc:  # noqa: BLE001 - the boundary: answer a status, never a gRPC error
            if popped:
                self._release(group, topic, popped)
            self._count_refusal(exc, context, "ReceiveMessage")
            yield sv.ReceiveMessageResponse(status=_status_of(exc, "ReceiveMessage"))
            return
        if not responses:
            yield self._receive_empty
            return
        written = 0
        try:
            yield self._receive_ok
            for response in responses:
                yield response
                written += 1
        finally:
            self.answers.release(held)  # taken by the transport, or the call is over
            # The client went away (cancelled, deadline, broken stream) before it had every
            # message: it drops the whole receive. A push consumer retries with the same
            # attempt_id and gets the same batch back; for others, make the messages visible
            # again now rather than after their invisible time. (An expired answer's messages
            # were released when it expired.)
            if written < len(responses) and not request.attempt_id and not held.abandoned:
                self._release(group, topic, popped)
        yield sv.ReceiveMessageResponse(delivery_timestamp=convert.timestamp_pb(self.clock.wall_ms()))

    async def ReceiveBatch(self, request, context):
        """``chronoq.v1.Consume/ReceiveBatch``: what ReceiveMessage streams, as one answer
        (``wire.receive_batch``), for ``chronoq.client.client``. Same request, validation and statuses.

        Streaming costs gRPC Python tens of microseconds of CPU per message; this answer costs
        about one unary call per batch. On the wire it is a unary answer; it is served as a
        one-message stream so that the handler learns when the transport took it (the ``yield``
        resumes): until then its bytes count in the answer budget, and if the call ends first
        (client gone, send timeout) its messages are released at once (``_hand_over``).
        """
        items, held = await self._receive_items(request, context, "ReceiveBatch")
        async for answer in self._hand_over(wire.receive_batch(items), held, request):
            yield answer

    async def AckAndReceive(self, request, context):
        """``chronoq.v1.Consume/AckAndReceive``: AckMessage, then (if every entry was acked)
        ReceiveBatch, in one call (``wire.ack_and_receive_response``): a consumer that acks
        each batch as it asks for the next pays one call per batch instead of two. Served as
        ReceiveBatch is (a one-message stream)."""
        try:
            acked, ack = self._ack(request.ack, entries=False)
        except Exception as exc:  # noqa: BLE001 - the boundary, as in AckMessage
            acked, ack = False, sv.AckMessageResponse(status=_status_of(exc, "AckMessage")).SerializeToString()
        items, held = (await self._receive_items(request.receive, context, "AckAndReceive")) if acked else ((), None)
        async for answer in self._hand_over(wire.ack_and_receive_response(ack, items), held, request.receive):
            yield answer

    async def _hand_over(self, answer: bytes, held, request):
        """Yield the one answer; then (or when the call ends first) return its reservation. An
        answer that did not get out takes its messages back to the queue, as ReceiveMessage does."""
        taken = False
        try:
            yield answer
            taken = True
        finally:
            if held is not None:
                self.answers.release(held)
                if not taken and not held.abandoned and not request.attempt_id:
                    self._release(held.group, held.topic, held.popped)

    async def _receive_items(self, request, context, what: str) -> tuple[list[bytes], answers.Held | None]:
        """ReceiveMessage's stream as serialized responses (status, messages, delivery timestamp)
        and the answer's reservation (None when it carries no message)."""
        popped = ()
        try:
            group, topic, popped = await self._receive(request, context)
            if not popped:
                return [self._receive_empty_bytes], None
            namespace = request.message_queue.topic.resource_namespace
            # By hand: no protobuf objects.
            messages = convert.messages_bytes(popped, topic, namespace, self._store_host_field)
            held, popped, messages = self._hold(context, group, topic, popped, messages)
            items = [self._receive_ok_bytes]
            items += messages
            items.append(sv.ReceiveMessageResponse(
                delivery_timestamp=convert.timestamp_pb(self.clock.wall_ms())).SerializeToString())
            return items, held
        except Exception as exc:  # noqa: BLE001 - the boundary: answer a status, never a gRPC error
            if popped:
                self._release(group, topic, popped)
            self._count_refusal(exc, context, what)
            return [sv.ReceiveMessageResponse(status=_status_of(exc, what)).SerializeToString()], None

    def _hold(self, context, group: str, topic: str, popped, responses: list[bytes]):
        """Reserve the encoded answer in the answer budget: (reservation, messages, responses),
        cut to what fits (the rest released at once); raises TooManyRequests when nothing fits
        (its messages released). Exact sizes, one dict update per call."""
        budget = self.answers
        peer = context.peer()
        nbytes = sum(map(len, responses))
        if budget.by_peer.get(peer, 0) + nbytes > budget.per_connection \
                or budget.held + nbytes > budget.total:  # (rare) the answer must be cut or refused
            n = budget.fit(peer, list(map(len, responses)))
            if n == 0:  # (the caller releases the messages, as for any failed receive)
                raise self._refuse_answer(peer, f"{len(responses)} messages of {nbytes} bytes do not fit")
            if n < len(popped):
                self._release(group, topic, popped[n:])
                budget.trimmed += 1
                popped, responses = popped[:n], responses[:n]
                nbytes = sum(map(len, responses))
        return budget.reserve(peer, nbytes, group, topic, popped, context), popped, responses

    def _refuse_answer(self, peer: str, detail: str) -> errors.TooManyRequests:
        budget = self.answers
        budget.refused += 1
        held = budget.by_peer.get(peer, 0)
        text = (f"answers not yet taken hold the answer budget (this connection {held} of "
                f"{budget.per_connection} bytes, the broker {budget.held} of {budget.total}): {detail}; "
                "read the answers already sent, or retry later")
        self.broker.refusals.refuse(refusals.ANSWER_BUDGET, peer, text)
        return errors.TooManyRequests(text)

    def _release(self, group: str, topic: str, popped) -> None:
        for p in popped:
            try:
                self.pop.change_invisible(group, topic, p.receipt_handle, 0)
            except Exception as exc:  # noqa: BLE001 - e.g. already stale; its invisible time ends anyway
                log.debug("could not release %s: %r", p.message.message_id, exc)
        self._tick_kick.set()

    async def _receive(self, request, context):
        group = convert.group_name(request.group)
        resource = request.message_queue.topic
        topic = convert.topic_name(resource)
        pop = self.pop
        tag_filter = "*"
        if request.HasField("filter_expression"):
            fe = request.filter_expression
            if fe.type == pb.SQL:
                raise errors.Unsupported("SQL92 filter expressions are not supported by chronoq; use tags")
            tag_filter = fe.expression
        batch = request.batch_size
        if batch <= 0:
            raise errors.ClientError(f"batch_size must be positive, not {batch}")
        batch = min(batch, RECEIVE_BATCH_MAX)
        auto_renew = request.auto_renew
        if request.HasField("invisible_duration"):  # its range is the POP service's rule
            invisible_ms = convert.duration_ms(request.invisible_duration)
        else:  # auto-renew: the POP service's slice (push_invisible_ms)
            invisible_ms = None if auto_renew else DEFAULT_INVISIBLE_MS
        wait_s = (convert.duration_ms(request.long_polling_timeout) / 1000
                  if request.HasField("long_polling_timeout") else LONG_POLL_DEFAULT_S)
        wait_s = min(wait_s, LONG_POLL_MAX_S)
        remaining = context.time_remaining()
        if remaining is not None:
            wait_s = min(wait_s, remaining - POLL_MARGIN_S)
        attempt_id = request.attempt_id or None
        client_id = _header(context, CLIENT_ID_HEADER)
        budget, peer = self.answers, context.peer()

        loop = asyncio.get_running_loop()
        deadline = loop.time() + max(0.0, wait_s)
        waker = self._waker
        while True:
            # What the answer budget has room for, before taking anything: a refusal costs no work.
            allowed = budget.allowance(peer, topic, batch)
            if not allowed:
                raise self._refuse_answer(peer, "no message was taken")
            event = waker.current()  # taken before trying, so no arrival is missed
            popped = pop.receive(group, topic, max_messages=allowed, invisible_ms=invisible_ms,
                                 tag_filter=tag_filter, attempt_id=attempt_id, client_id=client_id,
                                 auto_renew=auto_renew)
            if popped:
                break
            left = deadline - loop.time()
            if left <= 0 or self._stopping:
                return group, topic, ()
            if waker.parked >= self.config.max_parked_polls:  # a bound on parked work (docs/security.md)
                refused = (f"{waker.parked} receives are already waiting for messages (max_parked_polls); "
                           "retry later")
                self.broker.refusals.refuse(refusals.PARKED_POLLS, peer, refused)
                raise errors.TooManyRequests(refused)
            waker.parked += 1
            try:
                await asyncio.wait_for(event.wait(), left)
            except asyncio.TimeoutError:
                pass
            finally:
                waker.parked -= 1
        return group, topic, popped

    @_boundary(sv.AckMessageResponse, "AckMessage")
    async def AckMessage(self, request, context):
        _acked, answer = self._ack(request)
        return answer  # encoded by hand (serialize_answer passes it on)

    def _ack(self, request, *, entries: bool = True) -> tuple[bool, bytes]:
        """(every entry acked, the serialized ``AckMessageResponse``); raises for a bad request.
        Without ``entries`` a response where all succeeded carries the status alone."""
        group = convert.group_name(request.group)
        topic = convert.topic_name(request.topic)
        pop = self.pop
        items = request.entries
        if not items:
            raise errors.ClientError("AckMessage carries no entry")
        handles = list(map(_get_handle, items))
        # One call for the request: the POP bookkeeping after acks runs once, not per entry.
        failures = pop.ack_many(group, topic, handles) if all(handles) else _ack_with_empty(pop, group, topic, handles)
        if pop.group(group).fifo:
            self._waker.wake_soon()  # the next message of the FIFO queue may go out now
        if not any(failures):  # all acked (the usual case): no per-entry status to work out
            return True, wire.ack_response_ok(list(zip(map(_get_message_id, items), handles)) if entries else ())
        done = []  # (message id, handle, status or None for OK)
        top = self._ok
        for entry, handle, exc in zip(items, handles, failures):
            st = None
            if exc is not None:
                st = _status_of(exc, "AckMessage")
                if top is self._ok:
                    top = st  # clients ignore entry statuses: the first failure goes on top
            done.append((entry.message_id, handle, st))
        ok = self._ok
        return False, sv.AckMessageResponse(status=top, entries=[
            sv.AckMessageResultEntry(message_id=m, receipt_handle=h, status=st or ok)
            for m, h, st in done]).SerializeToString()

    async def ChangeInvisibleDuration(self, request, context):
        try:
            group = convert.group_name(request.group)
            topic = convert.topic_name(request.topic)
            pop = self.pop
            if not request.receipt_handle:
                raise errors.InvalidReceiptHandle("the receipt handle is empty")
            invisible_ms = convert.duration_ms(request.invisible_duration)
            handle = pop.change_invisible(group, topic, request.receipt_handle, invisible_ms)
        except Exception as exc:  # noqa: BLE001 - the boundary
            # The Python client stores the returned handle even on error (contract §6.2.14):
            # hand its old one back so a later ack is judged on that.
            return sv.ChangeInvisibleDurationResponse(status=_status_of(exc, "ChangeInvisibleDuration"),
                                                      receipt_handle=request.receipt_handle)
        # A short (or 0 s) invisible time may be the next deadline now; the tick that revives
        # the message wakes the parked polls.
        self._tick_kick.set()
        return sv.ChangeInvisibleDurationResponse(status=self._ok, receipt_handle=handle)

    @_boundary(sv.ForwardMessageToDeadLetterQueueResponse, "ForwardMessageToDeadLetterQueue")
    async def ForwardMessageToDeadLetterQueue(self, request, context):
        group = convert.group_name(request.group)
        topic = convert.topic_name(request.topic)
        pop = self.pop
        if not request.receipt_handle:
            raise errors.InvalidReceiptHandle("the receipt handle is empty")
        pop.forward_to_dlq(group, topic, request.receipt_handle)
        self._waker.wake_soon()  # the FIFO group behind it is free again
        return self._ok_forward

    # ------------------------------------------------------------------ not offered (yet)
    async def PullMessage(self, request, context):
        # Server-streaming: a one-item stream carrying the status.
        yield sv.PullMessageResponse(status=_status_of(
            errors.NotYetImplemented("PullMessage is not implemented; use ReceiveMessage"), "PullMessage"))

    @_boundary(sv.UpdateOffsetResponse, "UpdateOffset")
    async def UpdateOffset(self, request, context):
        raise errors.NotYetImplemented("UpdateOffset is not implemented in this chronoq build")

    @_boundary(sv.GetOffsetResponse, "GetOffset")
    async def GetOffset(self, request, context):
        raise errors.NotYetImplemented("GetOffset is not implemented in this chronoq build")

    @_boundary(sv.QueryOffsetResponse, "QueryOffset")
    async def QueryOffset(self, request, context):
        raise errors.NotYetImplemented("QueryOffset is not implemented in this chronoq build")

    @_boundary(sv.SyncLiteSubscriptionResponse, "SyncLiteSubscription")
    async def SyncLiteSubscription(self, request, context):
        raise errors.Unsupported("lite topics are not supported by chronoq")


class GrpcFrontEnd:
    """Serves ``MessagingService`` on ``config.host:config.port`` for the runtime's broker."""

    def __init__(self, runtime) -> None:
        self.runtime = runtime
        self.config = runtime.config
        self.server: grpc.aio.Server | None = None
        self.service: MessagingService | None = None
        self.pop = None
        self.bound = ""

    async def start(self) -> None:
        cfg = self.config
        broker = self.runtime.broker
        assert broker is not None and self.runtime.committer is not None, "open the broker first"
        gate, tls = auth.build_gate(cfg, broker.refusals), auth.server_credentials(cfg)  # access control, limits, TLS
        self.pop = PopService(broker, push_invisible_ms=cfg.push_invisible_ms,
                              auto_renew_max_ms=cfg.auto_renew_max_ms)
        try:
            apply_group_config(self.pop, cfg.extra.get("groups", {}))
        except Exception:
            self.pop.close()
            raise
        self.service = MessagingService(cfg, broker, self.runtime.committer, self.pop)
        # Big enough that an oversized body reaches us and gets MESSAGE_BODY_TOO_LARGE instead
        # of a transport error.
        receive_limit = 2 * cfg.max_body_bytes + (4 << 20)
        limits = h2limits.Limits.from_config(cfg)  # HTTP/2 caps and defences (docs/security.md)
        if cfg.grpc_server == "chronoq":
            server = h2grpc.Server(interceptors=[gate], max_receive_message_length=receive_limit,
                                   limits=limits, refusals=broker.refusals)
        else:
            server = grpc.aio.server(interceptors=[gate], options=[
                ("grpc.max_receive_message_length", receive_limit),
                ("grpc.max_send_message_length", -1),
                ("grpc.so_reuseport", 0),  # a second broker on this port must fail, not share it
                *limits.grpcio_options(),
            ])
        # SendMessage, AckMessage and ReceiveMessage first (generic handlers are asked in order):
        # their requests may keep their bytes and their answers may be bytes encoded by hand
        # (chronoq.protocol.wire, convert.messages_bytes).
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(MESSAGING_SERVICE, {
            "SendMessage": grpc.unary_unary_rpc_method_handler(
                self.service.SendMessage, request_deserializer=SendRequest.parse,
                response_serializer=serialize_answer),
            "AckMessage": grpc.unary_unary_rpc_method_handler(
                self.service.AckMessage, request_deserializer=sv.AckMessageRequest.FromString,
                response_serializer=serialize_answer),
            "ReceiveMessage": grpc.unary_stream_rpc_method_handler(
                self.service.ReceiveMessage, request_deserializer=sv.ReceiveMessageRequest.FromString,
                response_serializer=serialize_answer),
        }),))
        service_pb2_grpc.add_MessagingServiceServicer_to_server(self.service, server)
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(CONSUME_SERVICE, {
            # Both answer bytes (chronoq.protocol.wire); no .proto declares them. Unary on the wire, served
            # as one-message streams so the answer budget sees when the answer left (ReceiveBatch).
            "ReceiveBatch": grpc.unary_stream_rpc_method_handler(
                self.service.ReceiveBatch, request_deserializer=sv.ReceiveMessageRequest.FromString),
            "AckAndReceive": grpc.unary_stream_rpc_method_handler(
                self.service.AckAndReceive, request_deserializer=AckAndReceiveRequest.parse),
        }),))
        admin.add_to_server(server, broker, self.pop, self.runtime.committer)
        host = f"[{cfg.host}]" if ":" in cfg.host and not cfg.host.startswith("[") else cfg.host
        self.bound = f"{host}:{cfg.port}"
        try:
            port = server.add_secure_port(self.bound, tls) if tls else server.add_insecure_port(self.bound)
        except RuntimeError as exc:
            port = 0
            log.debug("bind failed: %s", exc)
        if not port:
            self.pop.close()
            raise errors.ClientError(f"cannot listen on {self.bound}: the address is in use or not local")
        await server.start()
        self.server = server
        self.service.start()
        if cfg.host in ("0.0.0.0", "::") and not cfg.advertised_address:
            log.warning("listening on %s but advertising %s to clients; set advertised_address to an address "
                        "clients can reach", cfg.host, cfg.endpoint)

    async def stop(self) -> None:
        if self.service is not None:
            self.service.begin_stop()
        if self.server is not None:
            await self.server.stop(STOP_GRACE_S)
            self.server = None
        if self.service is not None:
            await self.service.close()
        if self.pop is not None:
            pop, self.pop = self.pop, None
            try:
                pop.close()
            except Exception:  # the broker must still close cleanly after this
                log.exception("closing the POP service failed")

    def describe(self) -> str:
        return f"RocketMQ gRPC on {self.bound} (clients are told {self.config.endpoint})"


_GROUP_KEYS = {"fifo": bool, "max_attempts": int}


def apply_group_config(pop, groups: dict) -> None:
    """Apply ``[groups.<name>]`` tables of the config file (``fifo``, ``max_attempts``)."""
    if not isinstance(groups, dict):
        raise errors.ClientError("[groups] in the config file must be a table of group tables")
    for name, values in groups.items():
        validate.group_name(name)
        if not isinstance(values, dict):
            raise errors.ClientError(f"[groups.{name}] must be a table")
        kwargs = {}
        for key, value in values.items():
            kind = _GROUP_KEYS.get(key)
            if kind is None:
                raise errors.ClientError(f"unknown setting {key!r} in [groups.{name}]; known: "
                                         + ", ".join(sorted(_GROUP_KEYS)))
            if type(value) is not kind:
                raise errors.ClientError(f"[groups.{name}] {key} must be {kind.__name__}, not {value!r}")
            kwargs[key] = value
        pop.set_group(name, **kwargs)
