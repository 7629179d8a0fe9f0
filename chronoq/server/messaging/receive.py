"""Receiving: ReceiveMessage (a stream), chronoq's ReceiveBatch and AckAndReceive (one answer), long
polling, and the answer budget's hold on encoded answers. Every answer is made of
``chronoq.protocol.rocketmq.receive``'s ``ReceiveMessageResponse`` bytes.

Long polling: parked receives wait on a ``Waker`` that is woken, coalesced to at most once per
event-loop pass, when messages arrive (broker arrival listener), when revived messages become
visible (the POP tick returned > 0), and after acks of FIFO groups and DLQ forwards (they unblock
a FIFO queue). Every parked receive then tries again: cheap for tens of parked consumers; a
per-topic wait list is the next step if thousands park at once. A long poll answers by
``min(long_polling_timeout, deadline - POLL_MARGIN_S)``.
"""

from __future__ import annotations

import asyncio
import logging

from rocketmq.grpc_protocol import definition_pb2 as pb

from chronoq.core import errors, fairshare, refusals
from chronoq.pop import names as pop_names
from chronoq.protocol.rocketmq import status
from chronoq.protocol.rocketmq.ack import ack_and_receive_response, ack_response
from chronoq.protocol.rocketmq.receive import (messages_bytes, receive_batch, receive_delivery,
                                               receive_status)
from chronoq.server import answers, convert
from chronoq.server.messaging.calls import LANGUAGE_HEADER, client_id, header

log = logging.getLogger("chronoq.grpc")

DEFAULT_INVISIBLE_MS = 60_000       # when a non-push receive names none
LONG_POLL_DEFAULT_S = 20.0          # when the request names none
LONG_POLL_MAX_S = 60.0              # never park longer than this, whatever the client asks
POLL_MARGIN_S = 1.0                 # answer at least this long before the client's deadline
RECEIVE_BATCH_MAX = pop_names.MAX_MESSAGES_MAX  # batch_size is clamped to this (32)
_RECEIVE_OK = receive_status(status.OK, "OK")
# The official Node client (1.0.x) names its language "HTTP" and keeps grpc-js's default limit on
# a received message, 4 MiB (its envelope included). One answer over it fails the client's whole
# receive (RESOURCE_EXHAUSTED), and every message of that receive came back after its invisible
# time with one more attempt: a body near max_body_bytes took the others of its receives to the
# dead letters with it. Such a message is left out of a Node client's answer (``_fit_client``).
NODE_LANGUAGE = "HTTP"
NODE_ANSWER_MAX = 4 << 20
_RECEIVE_EMPTY = receive_status(status.MESSAGE_NOT_FOUND, "no new message")


class Waker:
    """Wakes parked long polls. Waking is coalesced to at most once per event-loop pass.

    Also the book of who is parked, by connection (``peer``): at ``max_parked_polls`` a new long
    poll takes the place of the oldest poll of the connection holding the most (``make_room``),
    if that one holds at least two more than the newcomer's; the poll that gives its place up is
    answered empty at once, as at the end of its wait, and its client polls again. So one client
    parking thousands of polls (each bounded, all legal) cannot shut every other consumer out
    of long polling: the places are shared out, and only a connection already holding its
    share is refused."""

    def __init__(self) -> None:
        self._event = asyncio.Event()
        self._scheduled = False
        self.parked = 0
        self._by_peer: dict[str, list[asyncio.Future]] = {}  # peer -> its parked polls' kicks, oldest first

    def current(self) -> asyncio.Event:
        return self._event

    def park(self, peer: str) -> asyncio.Future:
        """A poll of ``peer`` parks: the future is set if it must give its place up."""
        kick = asyncio.get_running_loop().create_future()
        self._by_peer.setdefault(peer, []).append(kick)
        self.parked += 1
        return kick

    def unpark(self, peer: str, kick: asyncio.Future) -> None:
        """The poll ended (woken, timed out, cancelled or kicked); idempotent."""
        kicks = self._by_peer.get(peer)
        if kicks is not None and kick in kicks:
            kicks.remove(kick)
            self.parked -= 1
            if not kicks:
                del self._by_peer[peer]
        assert self.parked >= 0

    def make_room(self, peer: str) -> bool:
        """At the limit: kick the oldest poll of the connection that gives a place up
        (``fairshare.give_up_one``); False if none does."""
        heaviest = fairshare.give_up_one(self._by_peer, peer)
        if heaviest is None:
            return False
        kick = self._by_peer[heaviest][0]
        self.unpark(heaviest, kick)
        kick.set_result(None)
        return True

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



class ReceiveRpcs:
    """The consumer's receive RPCs of ``MessagingService`` (which holds ``pop``, ``broker``,
    ``config``, ``clock``, ``answers``, the ``_waker``, ``_stopping`` and ``_store_host_field``,
    and counts refusals)."""

    async def ReceiveMessage(self, request, context):
        popped = ()
        held = None
        try:
            group, topic, popped = await self._receive(request, context)
            # Serialized by hand (serialize_answer passes bytes on), with the MD5 digest.
            responses = messages_bytes(popped, topic, request.message_queue.topic.resource_namespace,
                                       self._store_host_field, md5=True)
            if responses and max(map(len, responses)) > NODE_ANSWER_MAX:
                popped, responses = self._fit_client(context, group, topic, popped, responses)
            if responses:
                held, popped, responses = self._hold(context, group, topic, popped, responses)
        except Exception as exc:  # noqa: BLE001 - the boundary: answer a status, never a gRPC error
            if popped:
                self._release(group, topic, popped)
            self._count_refusal(exc, context, "ReceiveMessage")
            yield receive_status(*status.code_and_message(exc, "ReceiveMessage"))
            return
        if not responses:
            yield _RECEIVE_EMPTY
            return
        written = 0
        try:
            yield _RECEIVE_OK
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
        yield receive_delivery(self.clock.wall_ms())

    async def ReceiveBatch(self, request, context):
        """``chronoq.v1.Consume/ReceiveBatch``: what ReceiveMessage streams, as one answer
        (``receive_batch``), for ``chronoq.client.client``. Same request, validation and statuses.

        Streaming costs gRPC Python tens of microseconds of CPU per message; this answer costs
        about one unary call per batch. On the wire it is a unary answer; it is served as a
        one-message stream written through the context so that the handler learns when the
        transport took it (``context.write`` returns): until then its bytes count in the answer
        budget, and if the call ends first (client gone, send timeout) its messages are released
        at once (``_hand_over``). A coroutine, not an async generator: a generator (and the gate's
        around it) cost the call its first-iteration hook, a weak reference and an ``aclose``.
        """
        items, held = await self._receive_items(request, context, "ReceiveBatch")
        await self._hand_over(context, receive_batch(items), held, request)

    async def AckAndReceive(self, request, context):
        """``chronoq.v1.Consume/AckAndReceive``: AckMessage, then (if every entry was acked)
        ReceiveBatch, in one call (``ack_and_receive_response``): a consumer that acks
        each batch as it asks for the next pays one call per batch instead of two. Served as
        ReceiveBatch is (a one-message stream written through the context)."""
        try:
            acked, ack = self._ack(request.ack, entries=False)
        except Exception as exc:  # noqa: BLE001 - the boundary, as in AckMessage
            acked, ack = False, ack_response((), (), status=status.code_and_message(exc, "AckMessage"))
        items, held = (await self._receive_items(request.receive, context, "AckAndReceive")) if acked else ((), None)
        await self._hand_over(context, ack_and_receive_response(ack, items), held, request.receive)

    async def _hand_over(self, context, answer: bytes, held, request) -> None:
        """Write the one answer; then (or when the call ends first) return its reservation. An
        answer that did not get out takes its messages back to the queue, as ReceiveMessage does."""
        taken = False
        try:
            await context.write(answer)
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
                return [_RECEIVE_EMPTY], None
            namespace = request.message_queue.topic.resource_namespace
            # By hand: no protobuf objects.
            messages = messages_bytes(popped, topic, namespace, self._store_host_field)
            held, popped, messages = self._hold(context, group, topic, popped, messages)
            items = [_RECEIVE_OK]
            items += messages
            items.append(receive_delivery(self.clock.wall_ms()))
            return items, held
        except Exception as exc:  # noqa: BLE001 - the boundary: answer a status, never a gRPC error
            if popped:
                self._release(group, topic, popped)
            self._count_refusal(exc, context, what)
            return [receive_status(*status.code_and_message(exc, what))], None

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

    def _fit_client(self, context, group: str, topic: str, popped, responses: list[bytes]):
        """(messages, responses) less those the client cannot take (``NODE_ANSWER_MAX``): each is
        released as a failed delivery (``_release``: the retry back-off, an attempt counted, the
        dead letters at the group's maximum), so other consumers of the group may take it and
        the rest of the receive reaches this one."""
        if header(context, LANGUAGE_HEADER) != NODE_LANGUAGE:
            return popped, responses
        fits = [len(r) <= NODE_ANSWER_MAX for r in responses]
        left_out = [p for p, ok in zip(popped, fits) if not ok]
        self.broker.refusals.refuse(  # (logged at a bounded rate)
            refusals.MESSAGE_TOO_LARGE, context.peer(),
            f"ReceiveMessage: {len(left_out)} message(s) of {topic}/{group} left out of a Node client's answer, "
            f"over its {NODE_ANSWER_MAX}-byte limit on a received message "
            f"({', '.join(p.message.message_id for p in left_out[:3])})")
        self._release(group, topic, left_out)
        return ([p for p, ok in zip(popped, fits) if ok], [r for r, ok in zip(responses, fits) if ok])

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
        self.kick_ticker()

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
        client = client_id(context)
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
            self.committer.check_leader()  # (etcd: a fenced primary hands out nothing more)
            popped = pop.receive(group, topic, max_messages=allowed, invisible_ms=invisible_ms,
                                 tag_filter=tag_filter, attempt_id=attempt_id, client_id=client,
                                 auto_renew=auto_renew)
            if popped:
                break
            left = deadline - loop.time()
            if left <= 0 or self._stopping:
                return group, topic, ()
            # A bound on parked work (docs/security.md), shared out between connections (Waker).
            if waker.parked >= self.config.max_parked_polls and not waker.make_room(peer):
                refused = (f"{waker.parked} receives are already waiting for messages (max_parked_polls); "
                           "retry later")
                self.broker.refusals.refuse(refusals.PARKED_POLLS, peer, refused)
                raise errors.TooManyRequests(refused)
            kick = waker.park(peer)
            woken = asyncio.ensure_future(event.wait())
            try:
                await asyncio.wait((woken, kick), timeout=left, return_when=asyncio.FIRST_COMPLETED)
            finally:
                woken.cancel()
                waker.unpark(peer, kick)
            if kick.done():  # its place went to another connection's poll: answered empty
                return group, topic, ()
        return group, topic, popped

