"""``chronoq.client.client``: an asyncio client for chronoq (and any RocketMQ 5 gRPC proxy).

What it adds over the official Python client: many messages per SendMessage call (the protocol
allows it; the official client sends one), many receipts per AckMessage, and plain asyncio
coroutines. It speaks ``apache.rocketmq.v2.MessagingService``, so it works against a RocketMQ 5
proxy as well (``delay_level`` excepted: it is a chronoq property). One extension: receives use
chronoq's ``chronoq.v1.Consume/ReceiveBatch`` (the same request, answered in one response rather
than a stream: much cheaper for gRPC Python) and fall back to ReceiveMessage for a server that
does not offer it; ``ack_and_receive`` acks one batch and receives the next in one such call. The
operator-side clients (``AdminClient``, ``SignedChannel``) are ``chronoq.client.admin``'s.

    async with Client("127.0.0.1:8081") as client:
        receipts = await client.send_batch([OutgoingMessage("orders", b"...") for _ in range(100)])
        messages = await client.receive("billing", "orders", max_messages=16, invisible_s=30)
        await client.ack("billing", "orders", messages)
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import itertools
import operator
import os
import socket
import ssl
import time
import uuid
from dataclasses import dataclass, field
from typing import Iterable, Sequence

import grpc
from google.protobuf import duration_pb2
from rocketmq.grpc_protocol import definition_pb2 as pb
from rocketmq.grpc_protocol import service_pb2 as spb
from rocketmq.grpc_protocol import service_pb2_grpc

from chronoq import __version__
from chronoq.client import h2channel as h2client
from chronoq.protocol.rocketmq import fields
from chronoq.protocol.rocketmq.ack import ack_and_receive_request, ack_request, split_ack_and_receive_response
from chronoq.protocol.rocketmq.receive import split_receive_batch
from chronoq.protocol.rocketmq.outgoing import SendRequestEncoder, send_results
from chronoq.core import delay_levels
from chronoq.core.msgid import new_message_id, new_message_ids
from chronoq.pop.names import ACK_ENTRIES_MAX

OK_CODES = (pb.Code.OK, pb.Code.MULTIPLE_RESULTS)
_MS = "/apache.rocketmq.v2.MessagingService/"
_NOT_FOUND = pb.Code.MESSAGE_NOT_FOUND
RECEIVE_BATCH_PATH = "/chronoq.v1.Consume/ReceiveBatch"  # chronoq only (chronoq.server.messaging.receive)
ACK_AND_RECEIVE_PATH = "/chronoq.v1.Consume/AckAndReceive"
# How chronoq's gate refuses calls whose answer has no status field (chronoq.server.auth).
_REFUSALS = {grpc.StatusCode.PERMISSION_DENIED: pb.Code.FORBIDDEN,
             grpc.StatusCode.UNAUTHENTICATED: pb.Code.UNAUTHORIZED,
             grpc.StatusCode.RESOURCE_EXHAUSTED: pb.Code.TOO_MANY_REQUESTS}
# The user property that asks chronoq for a delay level (chronoq.server.convert reads it).
DELAY_LEVEL_PROPERTY = delay_levels.DELAY_LEVEL_PROPERTY


class ClientError(Exception):
    """The server answered a non-OK status."""

    def __init__(self, code: int, message: str):
        name = pb.Code.Name(code) if code in pb.Code.values() else str(code)
        super().__init__(f"{name} ({code}): {message}")
        self.code = code
        self.status_message = message


class BatchSendError(ClientError):
    """Some messages of a ``send_batch`` were refused, others stored: ``results`` holds, in the
    batch's order, a ``SendReceipt`` for each message stored and a ``ClientError`` for each
    refused. Its own code and message are the first refusal's. Send again only the refused ones
    (the stored ones would be stored twice: each send mints new message ids unless the message
    names its own ``message_id``)."""

    def __init__(self, code: int, message: str, results: list):
        super().__init__(code, message)
        self.results = results


@dataclass(slots=True)
class OutgoingMessage:
    topic: str
    body: bytes
    tag: str = ""
    keys: Sequence[str] = ()
    properties: dict[str, str] = field(default_factory=dict)
    message_group: str | None = None
    deliver_at_ms: int | None = None
    message_id: str | None = None
    # A delay level (1..N of the broker's timer_delay_levels), sent as the user property
    # DELAY_LEVEL_PROPERTY (docs/timers.md); give it or deliver_at_ms, not both.
    delay_level: int | None = None
    # Replace by key (docs/timers.md): sent as the user property REPLACE_KEY_PROPERTY; the
    # receipt's ``replaced`` says what the send replaced.
    replace_key: str | None = None

    def __post_init__(self) -> None:
        # What a caller is likely to pass that the encoder would take wrongly: a body as text
        # (sent as its UTF-8), one key as a string (it was sent as a key per character), a
        # property that is not text (an AttributeError from deep in the encoder).
        if type(self.body) is str:
            self.body = self.body.encode()
        if type(self.keys) is str:
            self.keys = (self.keys,)
        if self.properties:
            for name, value in self.properties.items():
                if type(name) is not str or type(value) is not str:
                    raise TypeError(f"message properties are text: {name!r}: {value!r} is not str: str")


REPLACE_KEY_PROPERTY = "CHRONOQ_REPLACE_KEY"  # (chronoq.timer.keyed.REPLACE_PROP)
# An accepted entry's status message that says what a send with a replace key replaced: "OK; "
# and "none", "replaced:<id>" or "already_delivered:<id>" (SendReceipt.replaced).
_REPLACED_PREFIX = "OK; "
_REPLACED_LEN = len(_REPLACED_PREFIX)


def _with_replace_key(m: OutgoingMessage) -> OutgoingMessage:
    return OutgoingMessage(m.topic, m.body, m.tag, m.keys, {**m.properties, REPLACE_KEY_PROPERTY: m.replace_key},
                           m.message_group, m.deliver_at_ms, m.message_id, m.delay_level)


_replace_key = operator.attrgetter("replace_key")


@dataclass(slots=True)
class SendReceipt:
    message_id: str
    offset: int
    recall_handle: str
    transaction_id: str
    replaced: str = ""  # sends with a replace key: "none", "replaced:<id>", "already_delivered:<id>"


@dataclass(slots=True)
class ReceivedMessage:
    topic: str
    message_id: str
    body: bytes
    tag: str
    keys: list[str]
    properties: dict[str, str]
    receipt_handle: str
    delivery_attempt: int
    queue_id: int
    queue_offset: int
    born_ms: int
    store_ms: int
    deliver_at_ms: int
    message_group: str


def _duration(seconds: float) -> duration_pb2.Duration:
    d = duration_pb2.Duration()
    d.FromNanoseconds(int(seconds * 1e9))
    return d


def _signature_metadata(access_key: str, secret_key: str) -> list[tuple[str, str]]:
    """The ``x-mq-date-time`` and ``authorization`` headers (MQv2-HMAC-SHA1; docs/security.md)."""
    date = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    sig = hmac.new(secret_key.encode(), date.encode(), hashlib.sha1).hexdigest()
    return [("x-mq-date-time", date),
            ("authorization", f"MQv2-HMAC-SHA1 Credential={access_key}, SignedHeaders=x-mq-date-time, Signature={sig}")]


def _open_channel(endpoint: str, tls: bool, tls_ca_file: str, options=None, interceptors=None):
    """A plaintext or TLS channel. ``tls_ca_file``: PEM roots to trust (default: the system's)."""
    if not tls and not tls_ca_file:
        return grpc.aio.insecure_channel(endpoint, options=options, interceptors=interceptors)
    roots = None
    if tls_ca_file:
        with open(tls_ca_file, "rb") as fh:
            roots = fh.read()
    return grpc.aio.secure_channel(endpoint, grpc.ssl_channel_credentials(root_certificates=roots),
                                   options=options, interceptors=interceptors)


def _tls_context(tls: bool, tls_ca_file: str) -> ssl.SSLContext | None:
    """The h2 transport's TLS: as ``_open_channel``'s (system roots unless a CA file is given)."""
    return ssl.create_default_context(cafile=tls_ca_file or None) if tls or tls_ca_file else None


class Client:
    def __init__(self, endpoint: str, *, namespace: str = "", access_key: str = "", secret_key: str = "",
                 request_timeout_s: float = 10.0, tls: bool = False, tls_ca_file: str = "",
                 extensions: bool = True, transport: str = "h2"):
        """``extensions``: use chronoq's ``chronoq.v1.Consume`` calls when the server offers them
        (False: only RocketMQ's calls, e.g. to compare).

        ``transport``: ``"h2"`` (default) sends the unary calls over ``chronoq.client.h2channel``, an
        HTTP/2 transport that runs on the event loop thread (a fraction of grpc.aio's CPU per
        call); ``"grpc"`` sends everything through grpc.aio. The streamed ReceiveMessage (used
        only against servers without chronoq's extensions) always goes through grpc.aio."""
        if transport not in ("h2", "grpc"):
            raise ValueError(f"transport must be 'h2' or 'grpc', not {transport!r}")
        self.endpoint = endpoint
        self.namespace = namespace
        self.access_key = access_key
        self.secret_key = secret_key
        self.timeout = request_timeout_s
        self._host = socket.gethostname()
        self.client_id = f"{self._host}@{os.getpid()}@{uuid.uuid4().hex[:8]}@chronoq"
        options = [("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)]
        self._channel = _open_channel(endpoint, tls, tls_ca_file, options)
        self._stub = service_pb2_grpc.MessagingServiceStub(self._channel)
        self._h2: h2client.Channel | None = None
        unary = self._channel
        if transport == "h2":
            unary = self._h2 = h2client.Channel(endpoint, ssl=_tls_context(tls, tls_ca_file))
        self._routes: dict[str, list] = {}
        self._query_route = unary.unary_unary(_MS + "QueryRoute", spb.QueryRouteRequest.SerializeToString,
                                              spb.QueryRouteResponse.FromString)
        self._recall = unary.unary_unary(_MS + "RecallMessage", spb.RecallMessageRequest.SerializeToString,
                                         spb.RecallMessageResponse.FromString)
        self._change_invisible = unary.unary_unary(_MS + "ChangeInvisibleDuration",
                                                   spb.ChangeInvisibleDurationRequest.SerializeToString,
                                                   spb.ChangeInvisibleDurationResponse.FromString)
        # The per-message calls take requests already encoded (chronoq.protocol.rocketmq): no protobuf object
        # per message on this side. Answers are parsed by the generated classes as usual.
        # (its answer read by hand, outgoing.send_results: no generated class per call)
        self._send_raw = unary.unary_unary(_MS + "SendMessage", response_deserializer=send_results)
        self._ack_raw = unary.unary_unary(_MS + "AckMessage", response_deserializer=spb.AckMessageResponse.FromString)
        # chronoq's ReceiveMessage in one answer (receive.receive_batch); a RocketMQ proxy answers
        # UNIMPLEMENTED and the client streams from then on.
        self._receive_batch = unary.unary_unary(
            RECEIVE_BATCH_PATH, request_serializer=spb.ReceiveMessageRequest.SerializeToString)
        self._ack_and_receive = unary.unary_unary(ACK_AND_RECEIVE_PATH)  # bytes both ways
        self._batch_offered = extensions
        # Metadata: the date changes once a second (``_md_fixed`` with it, a tuple the h2 transport
        # encodes once); request ids are a random prefix and a counter.
        self._md_second = -1
        self._md_fixed: tuple[tuple[str, str], ...] = ()
        self._md_tail = (("x-mq-language", "PYTHON"), ("x-mq-protocol", "v2"),
                         ("x-mq-client-version", f"chronoq-{__version__}"))
        if namespace:
            self._md_tail += (("x-mq-namespace", namespace),)
        self._request_prefix = uuid.uuid4().hex[:16]
        self._request_seq = itertools.count()
        self._encoder = SendRequestEncoder(namespace, self._host)
        self._receive_requests: dict[tuple, spb.ReceiveMessageRequest] = {}
        self._ack_heads: dict[tuple[str, str], tuple[bytes, bytes]] = {}

    async def __aenter__(self) -> "Client":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        if self._h2 is not None:
            await self._h2.close()
        await self._channel.close()

    # ----------------------------------------------------------------- plumbing
    def _metadata(self) -> tuple:
        """Every call's metadata: ``_md_fixed`` (``_unary`` keeps it apart) and a request id."""
        second = int(time.time())
        if second != self._md_second:
            self._new_second(second)
        return (*self._md_fixed, ("x-mq-request-id", f"{self._request_prefix}{next(self._request_seq):016x}"))

    def _new_second(self, second: int) -> None:
        """The date (and so the signature) changes once a second."""
        date = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(second))
        head = (("x-mq-client-id", self.client_id), ("x-mq-date-time", date))
        if self.access_key:
            sig = hmac.new(self.secret_key.encode(), date.encode(), hashlib.sha1).hexdigest()
            head += (("authorization", f"MQv2-HMAC-SHA1 Credential={self.access_key}, "
                                       f"SignedHeaders=x-mq-date-time, Signature={sig}"),)
        self._md_fixed, self._md_second = head + self._md_tail, second

    def _unary(self, method, request, timeout: float):
        """``method(request)`` (a unary callable of the channel) with this client's metadata: a
        coroutine. Over h2 the metadata that stays the same all second goes apart (``fixed``), so
        its header fields are encoded once."""
        second = int(time.time())
        if second != self._md_second:
            self._new_second(second)
        request_id = (("x-mq-request-id", f"{self._request_prefix}{next(self._request_seq):016x}"),)
        if self._h2 is not None:
            return method(request, metadata=request_id, timeout=timeout, fixed=self._md_fixed)
        return method(request, metadata=self._md_fixed + request_id, timeout=timeout)

    def _resource(self, name: str) -> pb.Resource:
        return pb.Resource(name=name, resource_namespace=self.namespace)

    @staticmethod
    def _check(status: pb.Status) -> None:
        if status.code not in OK_CODES:
            raise ClientError(status.code, status.message)

    async def route(self, topic: str) -> list:
        """The topic's message queues (cached)."""
        queues = self._routes.get(topic)
        if queues is None:
            host, _, port = self.endpoint.rpartition(":")
            req = spb.QueryRouteRequest(topic=self._resource(topic), endpoints=pb.Endpoints(
                scheme=pb.AddressScheme.IPv4, addresses=[pb.Address(host=host, port=int(port))]))
            resp = await self._unary(self._query_route, req, self.timeout)
            self._check(resp.status)
            queues = self._routes[topic] = list(resp.message_queues)
        return queues

    # ----------------------------------------------------------------- send
    def _send_request_bytes(self, messages: Iterable[OutgoingMessage]) -> bytes:
        """The SendMessageRequest for ``messages``, encoded (chronoq.protocol.rocketmq.outgoing)."""
        now = int(time.time() * 1000)
        if type(messages) is not list:
            messages = list(messages)
        if any(map(_replace_key, messages)):
            messages = [_with_replace_key(m) if m.replace_key else m for m in messages]
        # (one message, the usual call of most applications: its id without the bulk minting)
        ids = (new_message_id(now).encode(),) if len(messages) == 1 else new_message_ids(now, len(messages))
        return self._encoder.encode(messages, now, iter(ids))

    async def send_batch(self, messages: Iterable[OutgoingMessage]) -> list[SendReceipt]:
        """Send many messages in one SendMessage call; one receipt per message, in order.
        ``BatchSendError`` when the broker refused some and stored the others (its ``results``
        say which); ``ClientError`` when it refused the call as a whole. No messages: [] (no call)."""
        if type(messages) is not list:
            messages = list(messages)
        if not messages:
            return []
        code, message, entries = await self._unary(self._send_raw, self._send_request_bytes(messages), self.timeout)
        if code not in OK_CODES and len(entries) < 2:
            raise ClientError(code, message)
        receipts = []
        add = receipts.append
        failed = None
        for entry_code, entry_message, message_id, offset, recall_handle, transaction_id in entries:
            if entry_code not in OK_CODES:
                add(ClientError(entry_code, entry_message))
                failed = failed or receipts[-1]
                continue
            add(SendReceipt(message_id, offset, recall_handle, transaction_id,
                            entry_message[_REPLACED_LEN:] if entry_message.startswith(_REPLACED_PREFIX) else ""))
        if failed is not None or code not in OK_CODES:
            raise BatchSendError(code, message, receipts)
        return receipts

    async def send(self, topic: str, body: bytes, **kwargs) -> SendReceipt:
        return (await self.send_batch([OutgoingMessage(topic, body, **kwargs)]))[0]

    async def recall(self, topic: str, recall_handle: str) -> str:
        resp = await self._unary(self._recall, spb.RecallMessageRequest(
            topic=self._resource(topic), recall_handle=recall_handle), self.timeout)
        self._check(resp.status)
        return resp.message_id

    # ----------------------------------------------------------------- receive
    async def _receive_request(self, group: str, topic: str, max_messages: int, invisible_s: float,
                               wait_s: float, tag: str) -> spb.ReceiveMessageRequest:
        shape = (group, topic, max_messages, invisible_s, wait_s, tag)
        req = self._receive_requests.get(shape)  # a consumer asks the same way again and again
        if req is None:
            queues = await self.route(topic)
            mq = pb.MessageQueue()
            mq.CopyFrom(queues[0])
            mq.id = -1  # the broker serves every queue of the topic
            req = spb.ReceiveMessageRequest(
                group=self._resource(group), message_queue=mq,
                filter_expression=pb.FilterExpression(type=pb.FilterType.TAG, expression=tag),
                batch_size=max_messages, invisible_duration=_duration(invisible_s), auto_renew=False,
                long_polling_timeout=_duration(wait_s),
            )
            if len(self._receive_requests) > 256:
                self._receive_requests.clear()
            self._receive_requests[shape] = req
        return req

    async def receive(self, group: str, topic: str, *, max_messages: int = 16, invisible_s: float = 30,
                      wait_s: float = 5, tag: str = "*") -> list[ReceivedMessage]:
        """POP up to ``max_messages``; long-polls up to ``wait_s`` when nothing is ready."""
        req = await self._receive_request(group, topic, max_messages, invisible_s, wait_s, tag)
        timeout = wait_s + self.timeout
        if self._batch_offered:
            blob = await self._chronoq_call(self._receive_batch, req, timeout)
            if blob is not None:
                return self._received(split_receive_batch(blob))
        stream = self._stub.ReceiveMessage(req, metadata=self._metadata(), timeout=timeout)
        return self._messages_of([resp async for resp in stream])

    async def ack_and_receive(self, group: str, topic: str, acked: Sequence[ReceivedMessage], *,
                              max_messages: int = 16, invisible_s: float = 30, wait_s: float = 5,
                              tag: str = "*") -> list[ReceivedMessage]:
        """``ack(acked)`` then ``receive(...)``, in one call on chronoq (two elsewhere). When the
        ack fails (ClientError), nothing is received."""
        if not acked:
            return await self.receive(group, topic, max_messages=max_messages, invisible_s=invisible_s,
                                      wait_s=wait_s, tag=tag)
        req = await self._receive_request(group, topic, max_messages, invisible_s, wait_s, tag)
        if self._batch_offered:
            both = ack_and_receive_request(self._ack_request(group, topic, acked), req.SerializeToString())
            blob = await self._chronoq_call(self._ack_and_receive, both, wait_s + self.timeout)
            if blob is not None:
                items, ack = split_ack_and_receive_response(blob)
                self._check_ack(spb.AckMessageResponse.FromString(ack))
                return self._received(items)
        await self.ack(group, topic, acked)
        return await self.receive(group, topic, max_messages=max_messages, invisible_s=invisible_s,
                                  wait_s=wait_s, tag=tag)

    async def _chronoq_call(self, call, request, timeout: float):
        """A ``chronoq.v1.Consume`` call; None (and never again) when the server lacks it."""
        try:
            return await self._unary(call, request, timeout)
        except grpc.aio.AioRpcError as exc:
            code = exc.code()
            if code in _REFUSALS:  # the broker's gate refuses these calls with a gRPC code, not a status
                raise ClientError(_REFUSALS[code], exc.details() or "") from None
            if code != grpc.StatusCode.UNIMPLEMENTED:
                raise
            self._batch_offered = False
            return None

    def _received(self, items) -> list[ReceivedMessage]:
        """The messages of serialized ReceiveMessageResponses; raises for a failed status."""
        return self._messages_of(map(spb.ReceiveMessageResponse.FromString, items))

    def _messages_of(self, responses) -> list[ReceivedMessage]:
        """The messages of ReceiveMessageResponses; raises for a failed status (not NOT_FOUND)."""
        out: list[ReceivedMessage] = []
        add = out.append
        status = None
        for resp in responses:
            if resp.HasField("message"):
                add(_decode(resp.message))
            elif resp.HasField("status"):
                status = resp.status
        if status is not None and status.code != _NOT_FOUND:
            self._check(status)
        return out

    def _ack_request(self, group: str, topic: str, messages: Sequence[ReceivedMessage]) -> bytes:
        heads = self._ack_heads.get((group, topic))
        if heads is None:
            if len(self._ack_heads) > 256:
                self._ack_heads.clear()
            heads = self._ack_heads[(group, topic)] = (fields.resource(group, self.namespace),
                                                       fields.resource(topic, self.namespace))
        return ack_request(heads[0], heads[1], [(m.message_id, m.receipt_handle) for m in messages])

    def _check_ack(self, resp: spb.AckMessageResponse) -> None:
        self._check(resp.status)
        for entry in resp.entries:
            self._check(entry.status)

    async def ack(self, group: str, topic: str, messages: Sequence[ReceivedMessage]) -> None:
        """Acknowledge many messages, in one call per ``ACK_ENTRIES_MAX`` (1,024, the broker's limit)."""
        for start in range(0, len(messages), ACK_ENTRIES_MAX):
            req = self._ack_request(group, topic, messages[start:start + ACK_ENTRIES_MAX])
            self._check_ack(await self._unary(self._ack_raw, req, self.timeout))

    async def change_invisible(self, group: str, topic: str, message: ReceivedMessage, invisible_s: float) -> str:
        req = spb.ChangeInvisibleDurationRequest(
            group=self._resource(group), topic=self._resource(topic), receipt_handle=message.receipt_handle,
            invisible_duration=_duration(invisible_s), message_id=message.message_id)
        resp = await self._unary(self._change_invisible, req, self.timeout)
        self._check(resp.status)
        message.receipt_handle = resp.receipt_handle
        return resp.receipt_handle


def _ms(ts) -> int:
    # Timestamp.ToMilliseconds is Python code; this is the same for the non-negative times here.
    return ts.seconds * 1000 + ts.nanos // 1_000_000


def _decode(msg: pb.Message) -> ReceivedMessage:
    sp = msg.system_properties
    keys, props = sp.keys, msg.user_properties
    return ReceivedMessage(
        msg.topic.name, sp.message_id, msg.body, sp.tag, list(keys) if keys else [],
        dict(props) if props else {}, sp.receipt_handle, sp.delivery_attempt, sp.queue_id, sp.queue_offset,
        _ms(sp.born_timestamp), _ms(sp.store_timestamp),
        _ms(sp.delivery_timestamp) if sp.HasField("delivery_timestamp") else 0, sp.message_group,
    )


def run(coro):
    """Run a coroutine with uvloop when available (for scripts and the CLI)."""
    try:
        import uvloop

        return uvloop.run(coro)
    except ImportError:
        return asyncio.run(coro)
