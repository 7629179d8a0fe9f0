"""The gate in front of every RPC on the gRPC port: access control, hostile input, stream limits, TLS.

One ``grpc.aio`` server interceptor (``Gate``), so every service on the port passes through it —
``apache.rocketmq.v2.MessagingService``, ``chronoq.v1.Admin`` and any service added later — and
the services themselves stay unaware of it. Per RPC, in this order:

1. **Authentication** (when ``[auth] enabled``): the ``authorization`` and ``x-mq-date-time``
   headers are checked (``chronoq.core.acl``) *before the request body is parsed*. Without valid
   credentials the call gets a handler that never parses the body and answers UNAUTHORIZED.
2. **Parsing**: request bytes that are not a valid protobuf of the method's request type are
   answered BAD_REQUEST in the response body. (grpcio's own path would log a traceback and
   answer the gRPC status UNKNOWN for every such request.)
3. **Authorization** (when enabled): the request's fields name what it touches (``RULES``) and
   the user must hold each permission; otherwise FORBIDDEN. A method without a rule — chronoq's
   Admin service, and anything added without one — needs the admin role: deny by default.
4. **Telemetry streams** are counted per ``x-mq-client-id`` (of each user) and in all; over a limit the stream
   gets one TOO_MANY_REQUESTS command and ends. Inside a stream, a settings command naming a
   group or topic the user may not use is answered FORBIDDEN, and a transaction check (a
   ``recover_orphaned_transaction_command`` pushed by the broker) only reaches a client whose
   user may publish to that topic.

Refusals are answered the way the services answer errors — in the response's ``status``
(contract §0, §4.2), never as a gRPC error — so the official clients raise their usual
``UnauthorizedException``/``ForbiddenException``. Streaming calls answer with one status
message. A response type without a ``status`` field would get the gRPC status instead.

Cost: with access control off, a call pays one interceptor hop and a wrapper frame; handlers are
built once per method. With it on, a dictionary lookup of the signature (an HMAC-SHA1 once per
client and second: the signed date changes every second) and a memoized glob match per named
resource; handlers are built once per (method, user).

Secrets: nothing here logs headers; refusal messages name the access key, never the secret or
the signature.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import ssl
from typing import Callable

import grpc
from google.protobuf import descriptor_pool, message_factory
from google.protobuf.message import DecodeError

from chronoq.core import acl
from chronoq.core import errors, fairshare, refusals
from chronoq.core.clock import SYSTEM_CLOCK
from chronoq.core.refusals import Refusals
from chronoq.protocol.rocketmq import status

log = logging.getLogger("chronoq.auth")

MS = "/apache.rocketmq.v2.MessagingService/"
TELEMETRY = MS + "Telemetry"
CLIENT_ID_HEADER = "x-mq-client-id"
VERIFIED_MAX = 4096  # signatures remembered as verified (see Gate.intercept_service)
REFUSAL_READ_S = 1.0  # how long a refused Telemetry stream waits for the settings it will refuse

# What each method touches: request -> [(kind, name)]. An empty list: any authenticated user.
# A method missing here needs the admin role.
Rule = Callable[[object], list]


def _topic_and_group(topic_of: Callable, group_of: Callable) -> Rule:
    return lambda r: [(acl.SUBSCRIBE, topic_of(r).name), (acl.GROUP, group_of(r).name)]


def _settings_needs(settings) -> list:
    """A Telemetry settings command: a consumer's group and topics (a producer's need nothing:
    publishing topics are only a declaration; each send is checked)."""
    if not settings.HasField("subscription"):
        return []
    sub = settings.subscription
    needs = [(acl.GROUP, sub.group.name)]
    needs += [(acl.SUBSCRIBE, entry.topic.name) for entry in sub.subscriptions]
    return needs


RULES: dict[str, Rule] = {
    MS + "QueryRoute": lambda r: [(acl.TOPIC, r.topic.name)],
    MS + "Heartbeat": lambda r: [],
    MS + "NotifyClientTermination": lambda r: [],
    MS + "Telemetry": lambda r: [],  # opening the stream; each command is checked (_commands)
    MS + "SendMessage": lambda r: list({(acl.PUBLISH, m.topic.name) for m in r.messages}),
    MS + "EndTransaction": lambda r: [(acl.PUBLISH, r.topic.name)],
    MS + "RecallMessage": lambda r: [(acl.PUBLISH, r.topic.name)],
    MS + "QueryAssignment": _topic_and_group(lambda r: r.topic, lambda r: r.group),
    MS + "ReceiveMessage": _topic_and_group(lambda r: r.message_queue.topic, lambda r: r.group),
    MS + "AckMessage": _topic_and_group(lambda r: r.topic, lambda r: r.group),
    MS + "ChangeInvisibleDuration": _topic_and_group(lambda r: r.topic, lambda r: r.group),
    MS + "ForwardMessageToDeadLetterQueue": _topic_and_group(lambda r: r.topic, lambda r: r.group),
    MS + "PullMessage": _topic_and_group(lambda r: r.message_queue.topic, lambda r: r.group),
    MS + "UpdateOffset": _topic_and_group(lambda r: r.message_queue.topic, lambda r: r.group),
    MS + "GetOffset": _topic_and_group(lambda r: r.message_queue.topic, lambda r: r.group),
    MS + "QueryOffset": lambda r: [(acl.SUBSCRIBE, r.message_queue.topic.name)],
    # chronoq's ReceiveMessage in one answer (chronoq.server.messaging.receive: ReceiveBatch).
    "/chronoq.v1.Consume/ReceiveBatch": _topic_and_group(lambda r: r.message_queue.topic, lambda r: r.group),
    "/chronoq.v1.Consume/AckAndReceive": lambda r: [
        (acl.SUBSCRIBE, r.ack.topic.name), (acl.GROUP, r.ack.group.name),
        (acl.SUBSCRIBE, r.receive.message_queue.topic.name), (acl.GROUP, r.receive.group.name)],
}


def _handle_topic(r) -> list:
    """Recall/Reschedule by handle: the handle names the topic; publishing to it is the right."""
    from chronoq.timer import handle as recall_handles

    try:
        return [(acl.PUBLISH, recall_handles.decode(r.recall_handle).topic)]
    except errors.ChronoqError:  # not a handle: only an admin gets as far as being told so
        return [(acl.ADMIN, "")]


ADMIN_SERVICE = "/chronoq.v1.Admin/"
RULES.update({
    # Reads by (queue, offset) for the Spark source, and staged writes for the Spark sink.
    ADMIN_SERVICE + "QueueOffsets": lambda r: [(acl.SUBSCRIBE, r.topic)],
    ADMIN_SERVICE + "ReadMessages": lambda r: [(acl.SUBSCRIBE, r.topic)],
    ADMIN_SERVICE + "Stage": lambda r: [(acl.PUBLISH, r.topic)],
    # Publish/Abort name a batch, not a topic: its rows were checked when they were staged, and
    # a user's sink ids are its own (``SINK_SCOPED``). The user must publish somewhere: one
    # granted nothing filled max_stage_sinks with empty publishes, every Spark sink refused.
    ADMIN_SERVICE + "Publish": lambda r: [(acl.PUBLISHER, "")],
    ADMIN_SERVICE + "Abort": lambda r: [(acl.PUBLISHER, "")],
    ADMIN_SERVICE + "Recall": _handle_topic,
    ADMIN_SERVICE + "Reschedule": _handle_topic,
    # A lookup (chronoq message show) lists ids, keys and recall handles of any topic: admins,
    # like every other read of the Admin service.
    ADMIN_SERVICE + "LookupMessage": lambda r: [(acl.ADMIN, "")],
    # Everything else of chronoq.v1.Admin (topics, groups, timer stats, trace) is for admins.
})
_ADMIN_ONLY: Rule = lambda r: [(acl.ADMIN, "")]  # noqa: E731
# The staged-publish calls name a sink id (chronoq.features.staging). With access control on, a
# user who is not an admin has sink ids of its own: the broker keeps them as
# ``user:<access key>/<sink id>``, so one user can neither publish another's staged batch as
# empty (its rows then answered ``already_published`` and dropped) nor abort it. Admins name sinks
# as they are kept.
SINK_SCOPED = frozenset(ADMIN_SERVICE + name for name in ("Stage", "Publish", "Abort"))
# Calls whose client id (x-mq-client-id) names state the broker keeps per client (Telemetry
# sessions, heartbeats and auto-renewals, a producer's transaction checks, a receive's attempt
# id): with access control on, a client id is each user's own (``calls.client_id`` reads it as
# ``<access key>/<id>``). With ids shared, any user could take another's Telemetry session (its
# transaction checks went to the intruder), end its auto-renewals (NotifyClientTermination) or
# keep them going (Heartbeat).
CLIENT_SCOPED = frozenset([MS + name for name in ("Heartbeat", "NotifyClientTermination", "SendMessage",
                                                  "ReceiveMessage")]
                          + ["/chronoq.v1.Consume/ReceiveBatch", "/chronoq.v1.Consume/AckAndReceive"])


def scoped_sink_id(user: acl.User, sink_id: str) -> str:
    return f"user:{user.access_key}/{sink_id}"


class _Malformed:
    """What the safe deserializer returns for bytes that are not a valid request."""

    __slots__ = ("reason",)

    def __init__(self, reason: str) -> None:
        self.reason = reason


def _safe(deserializer):
    if deserializer is None:
        return None

    def parse(raw: bytes):
        try:
            return deserializer(raw)
        except (DecodeError, ValueError, TypeError, RecursionError) as exc:
            return _Malformed(type(exc).__name__)

    return parse


async def _returned(response, context):
    """A unary call's refusal: the answer (``Gate._guarded``)."""
    return response


async def _written(response, context) -> None:
    """A context-writing stream's refusal: its one message (``Gate._guarded``)."""
    await context.write(response)


def _header(metadata, key: str) -> str:
    for k, v in metadata or ():
        if k == key:
            return v if isinstance(v, str) else ""
    return ""


class _Method:
    """One RPC method as the gate sees it; built on the first call of the method."""

    def __init__(self, path: str, handler) -> None:
        self.path = path
        self.name = path.rsplit("/", 1)[-1] or path
        self.original = handler
        self.rule = RULES.get(path, _ADMIN_ONLY)
        self.response_cls = _response_class(path)
        self.safe_deserializer = _safe(handler.request_deserializer)
        if handler.unary_unary is not None:
            self.kind, self.behavior = "unary_unary", handler.unary_unary
        elif handler.unary_stream is not None:
            self.kind, self.behavior = "unary_stream", handler.unary_stream
        elif handler.stream_unary is not None:
            self.kind, self.behavior = "stream_unary", handler.stream_unary
        else:
            self.kind, self.behavior = "stream_stream", handler.stream_stream
        self.by_user: dict[str, object] = {}  # access key -> handler (or "" -> the open handler)

    def response(self, code: int, message: str):
        """A response carrying ``code``/``message`` in its status, or None if it has no status."""
        if self.response_cls is None:
            return None
        resp = self.response_cls()
        resp.status.code = code
        resp.status.message = message
        return resp

    def make(self, behavior, deserializer):
        h = self.original
        factory = getattr(grpc, f"{self.kind}_rpc_method_handler")
        return factory(behavior, request_deserializer=deserializer, response_serializer=h.response_serializer)


def _response_class(path: str):
    """The method's response message class if it has a ``status`` message field, else None."""
    try:
        service_name, method_name = path.lstrip("/").split("/", 1)
        method = descriptor_pool.Default().FindServiceByName(service_name).FindMethodByName(method_name)
        out = method.output_type
    except (KeyError, ValueError, AttributeError):
        return None
    field = out.fields_by_name.get("status")
    if field is None or field.message_type is None or {"code", "message"} - set(field.message_type.fields_by_name):
        return None
    return message_factory.GetMessageClass(out)


_GRPC_CODE = {
    status.Code.UNAUTHORIZED: grpc.StatusCode.UNAUTHENTICATED,
    status.Code.FORBIDDEN: grpc.StatusCode.PERMISSION_DENIED,
    status.Code.TOO_MANY_REQUESTS: grpc.StatusCode.RESOURCE_EXHAUSTED,
}


async def _abort(context, code: int, message: str):
    await context.abort(_GRPC_CODE.get(code, grpc.StatusCode.INVALID_ARGUMENT), message)


class _ScopedContext:
    """A call's context whose client id is the signed-in user's own (``CLIENT_SCOPED``): the rest
    is the call's context."""

    __slots__ = ("_context", "client_scope")

    def __init__(self, context, user: acl.User | None) -> None:
        self._context = context
        self.client_scope = user.access_key if user is not None else ""

    def __getattr__(self, name: str):
        return getattr(self._context, name)


class _StreamContext(_ScopedContext):
    """A Telemetry stream's context: writes serialized (ours and the service's), transaction
    checks only for a user who may publish to the topic, and its client id the user's own."""

    __slots__ = ("_user", "_lock")

    def __init__(self, context, user: acl.User | None) -> None:
        super().__init__(context, user)
        self._user = user
        self._lock = asyncio.Lock()

    async def write(self, message) -> None:
        user = self._user
        if user is not None and message.HasField("recover_orphaned_transaction_command"):
            topic = message.recover_orphaned_transaction_command.message.topic.name
            if not user.allowed(acl.PUBLISH, topic):
                raise errors.Forbidden(f"access key {user.access_key!r} may not publish to topic {topic!r}")
        async with self._lock:
            await self._context.write(message)


class Gate(grpc.aio.ServerInterceptor):
    """See the module docstring. ``access`` is None when access control is off."""

    def __init__(self, access: acl.AccessControl | None, *, max_streams_per_client: int, max_streams: int,
                 refusals: Refusals | None = None) -> None:
        self.access = access
        # Every refusal is counted by reason and logged at a bounded rate (chronoq.core.refusals).
        self.refusals = refusals if refusals is not None else Refusals(SYSTEM_CLOCK.monotonic_ns)
        self.max_streams_per_client = max_streams_per_client
        self.max_streams = max_streams
        self.streams: dict[tuple[str, str], int] = {}  # open Telemetry streams per (access key, client id)
        self.streams_total = 0
        # The tasks of the open Telemetry streams by connection (peer), oldest first: at
        # ``max_streams`` a new stream takes the place of the oldest one of the connection holding
        # the most (``_make_room``), as the parked long polls are shared out (messaging/receive.py):
        # one client opening thousands under invented client ids cannot shut every new client out
        # of settings and transaction checks. The client of the stream ended opens it again.
        self._streams_by_peer: dict[str, list[Callable[[], bool]]] = {}  # each stream's ``_ender``
        self._methods: dict[str, _Method] = {}
        self._verified: dict[tuple[str, str], acl.User] = {}  # (authorization, date) -> user
        self.refused = 0  # calls refused for credentials or permissions (for tests)

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None:  # unknown method: grpc answers UNIMPLEMENTED
            return None
        path = handler_call_details.method
        method = self._methods.get(path)
        if method is None or method.original is not handler:
            method = self._methods[path] = _Method(path, handler)
        access = self.access
        if access is None:
            h = method.by_user.get("")
            if h is None:
                h = method.by_user[""] = self._build(method, None)
            return h
        metadata = handler_call_details.invocation_metadata
        signed = (_header(metadata, acl.AUTH_HEADER), _header(metadata, acl.DATE_HEADER))
        user = self._verified.get(signed)
        if user is None:
            try:
                user = access.authenticate(*signed)
            except errors.Unauthorized as exc:
                # Counted when the refusing handler runs: only the call's context knows the peer.
                return self._refusal(method, status.Code.UNAUTHORIZED, f"{method.name}: {exc.message}")
            # A client's date changes once a second: remember the pairs that verified (only those),
            # so its other calls in that second skip the HMAC.
            if len(self._verified) >= VERIFIED_MAX:
                self._verified.clear()
            self._verified[signed] = user
        h = method.by_user.get(user.access_key)
        if h is None:
            h = method.by_user[user.access_key] = self._build(method, user)
        return h

    # ------------------------------------------------------------------ refusing without parsing
    def _refuse(self, reason: str, context, message: str) -> None:
        self.refused += 1
        self.refusals.refuse(reason, context.peer(), message)

    def _refusal(self, method: _Method, code: int, message: str):
        response = method.response(code, message)
        refuse = self._refuse

        if method.kind in ("unary_unary", "stream_unary"):
            async def unary(_request, context):
                refuse(refusals.UNAUTHENTICATED, context, message)
                if response is None:
                    await _abort(context, code, message)
                return response
            return method.make(unary, None)

        if method.path == TELEMETRY or method.kind == "stream_stream":
            async def stream(_requests, context):
                refuse(refusals.UNAUTHENTICATED, context, message)
                if response is None:
                    await _abort(context, code, message)
                await context.write(response)
            return method.make(stream, None)

        async def server_stream(_request, context):
            refuse(refusals.UNAUTHENTICATED, context, message)
            if response is None:
                await _abort(context, code, message)
            yield response
        return method.make(server_stream, None)

    # ------------------------------------------------------------------ the guarded handlers
    def _check(self, method: _Method, request, user: acl.User | None, context) -> tuple[int, str] | None:
        """(code, message) when the request must be refused, else None."""
        if type(request) is _Malformed:
            message = f"{method.name}: the request is not a valid protobuf message ({request.reason})"
            self.refusals.refuse(refusals.INVALID, context.peer(), message)
            return status.Code.BAD_REQUEST, message
        if user is not None:
            try:
                try:
                    needs = method.rule(request)
                except Exception:  # noqa: BLE001 - a rule that cannot read the request: admins only
                    log.exception("access rule of %s failed; only admins may call it", method.name)
                    needs = _ADMIN_ONLY(request)
                acl.AccessControl.require(user, needs, method.name)
            except errors.Forbidden as exc:
                self._refuse(refusals.PERMISSION, context, exc.message)
                return status.Code.FORBIDDEN, exc.message
        return None

    def _build(self, method: _Method, user: acl.User | None):
        if method.path == TELEMETRY:
            return method.make(self._telemetry(method, user), method.safe_deserializer)
        original, check = method.behavior, self._check
        if method.kind == "unary_unary":
            return method.make(self._guarded(method, user, _returned), method.safe_deserializer)

        if method.kind == "unary_stream":
            if not inspect.isasyncgenfunction(original):
                # A handler that writes through the context itself (ReceiveBatch): a coroutine
                # around it too, as cheap as a unary call's (no async generator per call).
                return method.make(self._guarded(method, user, _written), method.safe_deserializer)

            client_scoped = user is not None and method.path in CLIENT_SCOPED

            async def server_stream(request, context):
                refusal = check(method, request, user, context)
                if refusal is not None:
                    response = method.response(*refusal)
                    if response is None:
                        await _abort(context, *refusal)
                    yield response
                    return
                responses = original(request, _ScopedContext(context, user) if client_scoped else context)
                try:
                    async for response in responses:
                        yield response
                finally:  # close it now (its cleanup releases received messages), not at GC
                    await responses.aclose()
            return method.make(server_stream, method.safe_deserializer)

        # Client-streaming methods: each request is checked as it arrives.
        async def requests(request_iterator, context):
            async for request in request_iterator:
                refusal = check(method, request, user, context)
                if refusal is not None:
                    await _abort(context, *refusal)
                yield request

        if method.kind == "stream_unary":
            async def client_stream(request_iterator, context):
                return await original(requests(request_iterator, context), context)
            return method.make(client_stream, method.safe_deserializer)

        async def bidi(request_iterator, context):
            result = original(requests(request_iterator, context), context)
            if inspect.isasyncgen(result):
                async for response in result:
                    await context.write(response)
            else:
                await result
        return method.make(bidi, method.safe_deserializer)

    def _guarded(self, method: _Method, user: acl.User | None, refused):
        """A unary call's handler, or a stream's that writes through the context, behind the gate:
        the request checked, then the handler awaited; a refusal's answer goes out through
        ``refused(response, context)`` (``_returned``, ``_written``)."""
        original, check = method.behavior, self._check

        scoped = user is not None and not user.admin and method.path in SINK_SCOPED
        client_scoped = user is not None and method.path in CLIENT_SCOPED

        async def guarded(request, context):
            refusal = check(method, request, user, context)
            if refusal is None:
                if scoped and request.sink_id:
                    request.sink_id = scoped_sink_id(user, request.sink_id)
                return await original(request, _ScopedContext(context, user) if client_scoped else context)
            response = method.response(*refusal)
            if response is None:
                await _abort(context, *refusal)
            return await refused(response, context)
        return guarded

    def _telemetry(self, method: _Method, user: acl.User | None):
        original = method.behavior

        async def telemetry(request_iterator, context):
            client_id = _header(context.invocation_metadata(), CLIENT_ID_HEADER)
            # Counted per user too: one user cannot use up another's quota by borrowing its id.
            key = (user.access_key if user is not None else "", client_id)
            open_now = self.streams.get(key, 0)
            peer = context.peer()
            if open_now >= self.max_streams_per_client or (self.streams_total >= self.max_streams
                                                           and not self._make_room(peer)):
                which = (f"client {client_id!r} already has {open_now} open Telemetry streams (max_streams_per_client)"
                         if open_now >= self.max_streams_per_client
                         else f"the broker has {self.streams_total} open Telemetry streams (max_streams)")
                # Take the client's first command (its settings) before answering: a client whose
                # write races with the stream's end gets a transport error instead of this reason.
                try:
                    await asyncio.wait_for(anext(aiter(request_iterator), None), REFUSAL_READ_S)
                except Exception:  # noqa: BLE001 - nothing sent, cancelled or garbled: refuse anyway
                    pass
                self.refusals.refuse(refusals.TELEMETRY_STREAMS, context.peer(), which)
                await context.write(method.response(status.Code.TOO_MANY_REQUESTS, f"Telemetry refused: {which}"))
                return
            self.streams[key] = open_now + 1
            self.streams_total += 1
            ender = _ender(context)
            self._streams_by_peer.setdefault(peer, []).append(ender)
            guarded = _StreamContext(context, user)
            try:
                await original(self._commands(method, request_iterator, guarded, user), guarded)
            finally:
                mine = self._streams_by_peer.get(peer)
                if mine is not None and ender in mine:
                    mine.remove(ender)
                    if not mine:
                        del self._streams_by_peer[peer]
                self.streams_total -= 1
                left = self.streams.get(key, 1) - 1
                if left > 0:
                    self.streams[key] = left
                else:
                    self.streams.pop(key, None)

        return telemetry

    def _make_room(self, peer: str) -> bool:
        """At ``max_streams``: end the oldest Telemetry stream of the connection that gives a place
        up (``fairshare.give_up_one``); False if none does. Its count is given back when its task
        ends (the next loop pass)."""
        heaviest = fairshare.give_up_one(self._streams_by_peer, peer)
        if heaviest is None:
            return False
        streams = self._streams_by_peer[heaviest]
        for i, end in enumerate(streams):
            if end():  # (a stream whose call is still starting cannot be ended yet: the next one)
                del streams[i]
                if not streams:
                    del self._streams_by_peer[heaviest]
                self.refusals.refuse(refusals.TELEMETRY_STREAMS, heaviest,
                                     f"its oldest Telemetry stream ended for a new one of {peer} (max_streams)")
                return True
        return False

    async def _commands(self, method: _Method, request_iterator, context: _StreamContext, user):
        """The client's Telemetry commands, minus malformed ones and forbidden settings (each
        answered with a status command instead)."""
        async for command in request_iterator:
            if type(command) is _Malformed:
                await context.write(method.response(
                    status.Code.BAD_REQUEST, f"Telemetry: a command is not a valid protobuf message ({command.reason})"))
                continue
            if user is not None and command.HasField("settings"):
                try:
                    acl.AccessControl.require(user, _settings_needs(command.settings), "Telemetry settings")
                except errors.Forbidden as exc:
                    self._refuse(refusals.PERMISSION, context, exc.message)
                    await context.write(method.response(status.Code.FORBIDDEN, exc.message))
                    continue
            yield command


def _ender(context) -> Callable[[], bool]:
    """A function that ends the call of ``context`` from elsewhere (True if it did): chronoq's
    HTTP/2 server runs a call's first step outside any task and then in its ``Stream.task``;
    grpcio runs each call in a task of its own."""
    stream = getattr(context, "_stream", None)
    if stream is not None and hasattr(stream, "task"):
        return lambda: stream.task is not None and not stream.task.done() and stream.task.cancel()
    task = asyncio.current_task()
    return lambda: task is not None and not task.done() and task.cancel()


def build_gate(config, refusals: Refusals | None = None) -> Gate:
    """The interceptor for ``config`` (raises ``errors.ClientError`` on a bad ``[auth]`` table);
    it counts what it refuses in ``refusals`` (the broker's)."""
    access = acl.from_config(config.extra.get("auth"))
    if access is not None:
        log.info("access control is on: %d users", len(access.users))
    return Gate(access, max_streams_per_client=config.max_streams_per_client, max_streams=config.max_streams,
                refusals=refusals)


def server_credentials(config):
    """TLS for the gRPC port from ``tls_cert_file``/``tls_key_file`` (PEM), or None for plaintext:
    an ``ssl.SSLContext`` for chronoq's own server, ``grpc.ServerCredentials`` for grpcio's."""
    if not config.tls_cert_file:
        return None
    pem = {}
    for key in ("tls_cert_file", "tls_key_file"):
        path = getattr(config, key)
        try:
            with open(path, "rb") as fh:
                pem[key] = fh.read()
        except OSError as exc:
            raise errors.ClientError(f"cannot read {key} {path}: {exc.strerror or exc}") from None
        if b"-----BEGIN " not in pem[key]:
            raise errors.ClientError(f"{key} {path} is not a PEM file")
    if config.grpc_server == "chronoq":
        from chronoq.server.h2grpc import server_ssl_context

        try:
            return server_ssl_context(pem["tls_cert_file"], pem["tls_key_file"])
        except ssl.SSLError as exc:
            raise errors.ClientError(f"cannot use tls_cert_file/tls_key_file: {exc}") from None
    return grpc.ssl_server_credentials([(pem["tls_key_file"], pem["tls_cert_file"])])
