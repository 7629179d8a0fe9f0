"""``apache.rocketmq.v2.MessagingService`` for the official RocketMQ 5 clients, and chronoq's own
``chronoq.v1.Consume`` (ReceiveBatch, AckAndReceive) beside it.

A thin shell. Each RPC decodes and validates (``chronoq.server.convert``), calls the broker, the
group committer or the POP service, and encodes the answer (the per-message answers by hand,
``chronoq.protocol.rocketmq``). Errors never leave as gRPC errors: every RPC has one ``try``
boundary that turns any exception into the response's ``status``
(``chronoq.protocol.rocketmq.status``), the way the reference proxy does (contract §0). Nothing a
client sends may crash the server.

The RPCs are grouped by job: ``send`` (SendMessage, EndTransaction, RecallMessage), ``receive``
(ReceiveMessage, ReceiveBatch, AckAndReceive, long polling), ``ack`` (AckMessage,
ChangeInvisibleDuration, ForwardMessageToDeadLetterQueue), ``clients`` (routes, heartbeats,
Telemetry, transaction checks). This class holds the state they share and its life. The POP ticker
and the transaction checks are the runtime's (``chronoq.server.consumers.ConsumerLoops``): this
front end attaches its parts to them (waking its parked long polls, expiring its receive answers,
pushing transaction checks over its Telemetry streams) and kicks the ticker when a deadline moves.

Choices worth knowing (details in ``shared/protocol/rocketmq-v2-contract.md``):

- Push consumers receive with ``auto_renew=true`` and no invisible duration: the messages stay
  invisible in slices of ``push_invisible_ms`` (60 s), renewed in place while the client is alive
  (Heartbeat, receives; NotifyClientTermination ends it) until acked or nacked, up to
  ``auto_renew_max_ms`` (``chronoq/pop/renew.py``). The receipt handles stay the same.
- Receives serve every queue of the topic for the group, whatever queue id the client names.
- ``chronoq.v1.Consume/ReceiveBatch`` (not RocketMQ): a ReceiveMessage answered in one unary
  response instead of a stream, for ``chronoq.client.client``; a server's per-streamed-message cost
  is what it saves (``receive.receive_batch``). ``AckAndReceive`` acks the last batch and receives
  the next in one call.
"""

from __future__ import annotations

import logging

from rocketmq.grpc_protocol import definition_pb2 as pb
from rocketmq.grpc_protocol import service_pb2 as sv
from rocketmq.grpc_protocol import service_pb2_grpc

from chronoq.core import errors, refusals
from chronoq.features.transactions import Transactions
from chronoq.protocol.rocketmq import status
from chronoq.protocol.rocketmq.receive import store_host_field
from chronoq.server import answers, convert
from chronoq.server.messaging.ack import AckRpcs
from chronoq.server.messaging.calls import boundary, status_of, status_only
from chronoq.server.messaging.clients import ClientRpcs, TelemetrySession
from chronoq.server.messaging.receive import ReceiveRpcs, Waker
from chronoq.server.messaging.send import SendRpcs

log = logging.getLogger("chronoq.grpc")


def _not_offered(response_type, what: str, error, text: str):
    """A unary RPC chronoq does not offer: it answers ``error(text)`` as its status."""

    @boundary(status_only(response_type), what)
    async def rpc(self, request, context):
        raise error(text)

    rpc.__name__ = what
    return rpc


class MessagingService(SendRpcs, ReceiveRpcs, AckRpcs, ClientRpcs, service_pb2_grpc.MessagingServiceServicer):
    """``apache.rocketmq.v2.MessagingService`` and ``chronoq.v1.Consume``: the state the RPCs share
    and its life; the RPCs themselves are grouped by job in the mixins."""

    def __init__(self, config, broker, committer, pop, txns: Transactions, loops=None) -> None:
        """``loops``: the runtime's ``ConsumerLoops`` (None: nothing ticks, for tests of single calls)."""
        self.config = config
        self.broker = broker
        self.committer = committer
        self.pop = pop
        self.txns = txns
        self.loops = loops
        self._detach = None
        self.clock = broker.clock
        self.sessions: dict[str, TelemetrySession] = {}
        self._broker_pb = pb.Broker(name=config.broker_name, id=0, endpoints=convert.endpoints_pb(config.endpoint))
        self._store_host = config.endpoint
        self._store_host_field = store_host_field(config.endpoint)
        self._routes: dict[tuple[str, str], tuple[object, sv.QueryRouteResponse]] = {}
        self.cluster = None  # chronoq.server.cluster.ClusterKeeper (etcd): routes over every broker group
        self._waker = Waker()
        self._stopping = False
        self._ok = pb.Status(code=status.OK, message="OK")
        self._ok_heartbeat = sv.HeartbeatResponse(status=self._ok)
        self._ok_termination = sv.NotifyClientTerminationResponse(status=self._ok)
        self._ok_forward = sv.ForwardMessageToDeadLetterQueueResponse(status=self._ok)
        # Receive answers not yet taken by their peers: bounded in bytes and time (answers.py).
        self.answers = answers.AnswerBudget(config.answer_budget_per_connection, config.answer_budget_total,
                                            config.answer_send_timeout_ms * 1_000_000, self.clock.monotonic_ns)

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        self.broker.add_arrival_listener(self._on_arrival)
        if self.loops is not None:
            self._detach = self.loops.attach(self._waker.wake_soon, self.expire_answers, self._check_transaction)

    def kick_ticker(self) -> None:
        """A POP deadline may be earlier now: the runtime's ticker looks at once."""
        if self.loops is not None:
            self.loops.kick()

    def begin_stop(self) -> None:
        """Answer parked long polls now and stop parking new ones."""
        self._stopping = True
        self._waker.wake_now()

    async def close(self) -> None:
        self._stopping = True
        if self._detach is not None:  # (the runtime stops its loops and saves the state: server/consumers.py)
            self._detach()
            self._detach = None

    def expire_answers(self) -> int:
        """End the receives whose answers waited on their peers longer than answer_send_timeout_ms:
        their messages go back to the queue at once, their calls end (the runtime's POP ticker calls
        this on every pass)."""
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

    # ------------------------------------------------------------------ not offered (yet)
    async def PullMessage(self, request, context):
        # Server-streaming: a one-item stream carrying the status.
        yield sv.PullMessageResponse(status=status_of(
            errors.NotYetImplemented("PullMessage is not implemented; use ReceiveMessage"), "PullMessage"))

    UpdateOffset = _not_offered(sv.UpdateOffsetResponse, "UpdateOffset", errors.NotYetImplemented,
                                "UpdateOffset is not implemented in this chronoq build")
    GetOffset = _not_offered(sv.GetOffsetResponse, "GetOffset", errors.NotYetImplemented,
                             "GetOffset is not implemented in this chronoq build")
    QueryOffset = _not_offered(sv.QueryOffsetResponse, "QueryOffset", errors.NotYetImplemented,
                               "QueryOffset is not implemented in this chronoq build")
    SyncLiteSubscription = _not_offered(sv.SyncLiteSubscriptionResponse, "SyncLiteSubscription", errors.Unsupported,
                                        "lite topics are not supported by chronoq")
