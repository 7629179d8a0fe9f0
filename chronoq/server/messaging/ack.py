"""Settling received messages: AckMessage, ChangeInvisibleDuration and
ForwardMessageToDeadLetterQueue. Every AckMessage answer is encoded by
``chronoq.protocol.rocketmq.ack.ack_response``."""

from __future__ import annotations

import operator

from rocketmq.grpc_protocol import service_pb2 as sv

from chronoq.core import errors
from chronoq.pop import names as pop_names
from chronoq.protocol.rocketmq import status
from chronoq.protocol.rocketmq.ack import ack_response
from chronoq.server import consumers, convert
from chronoq.server.messaging.calls import boundary, status_of, status_only

_get_handle, _get_message_id = operator.attrgetter("receipt_handle"), operator.attrgetter("message_id")


def _ack_refused(code: int, message: str) -> bytes:
    return ack_response((), (), status=(code, message))


def _ack_with_empty(pop, group: str, topic: str, handles: list[str]) -> list:
    """``pop.ack_many`` for a request where some receipt handles are empty (those fail)."""
    settled = iter(pop.ack_many(group, topic, [h for h in handles if h]))
    return [next(settled) if h else errors.InvalidReceiptHandle("the receipt handle is empty") for h in handles]


class AckRpcs:
    """The RPCs of ``MessagingService`` that settle a received message (it holds ``pop``, the
    long-poll ``_waker``, ``kick_ticker`` and ``_ok``)."""

    @boundary(_ack_refused, "AckMessage")
    async def AckMessage(self, request, context):
        _acked, answer = self._ack(request)
        return answer  # encoded by hand (serialize_answer passes it on)

    def _ack(self, request, *, entries: bool = True) -> tuple[bool, bytes]:
        """(every entry acked, the serialized ``AckMessageResponse``); raises for a bad request.
        Without ``entries`` a response where all succeeded carries the status alone."""
        group = convert.group_name(request.group)
        topic = convert.topic_name(request.topic)
        self.committer.check_leader()  # (etcd: a fenced primary's ack would live on it only)
        pop = self.pop
        items = request.entries
        if not items:
            raise errors.ClientError("AckMessage carries no entry")
        if len(items) > pop_names.ACK_ENTRIES_MAX:  # 100,000 entries held the loop ~0.3 s
            raise errors.ClientError(f"AckMessage carries {len(items)} entries; at most {pop_names.ACK_ENTRIES_MAX}")
        handles = list(map(_get_handle, items))
        # One call for the request: the POP bookkeeping after acks runs once, not per entry.
        failures = pop.ack_many(group, topic, handles) if all(handles) else _ack_with_empty(pop, group, topic, handles)
        if pop.is_fifo(group):  # (an ack never creates a group: its handles name their own)
            self._waker.wake_soon()  # the next message of the FIFO queue may go out now
        if not any(failures):  # all acked (the usual case): no per-entry status to work out
            return True, (ack_response(list(map(_get_message_id, items)), handles) if entries else ack_response((), ()))
        # Clients ignore entry statuses: the first failure goes on top (ack_response).
        return False, ack_response(list(map(_get_message_id, items)), handles, [
            None if exc is None else status.code_and_message(exc, "AckMessage") for exc in failures])

    async def ChangeInvisibleDuration(self, request, context):
        try:
            group = convert.group_name(request.group)
            topic = convert.topic_name(request.topic)
            pop = self.pop
            if not request.receipt_handle:
                raise errors.InvalidReceiptHandle("the receipt handle is empty")
            self.committer.check_leader()
            invisible_ms = convert.duration_ms(request.invisible_duration)
            handle = pop.change_invisible(group, topic, request.receipt_handle, invisible_ms)
        except Exception as exc:  # noqa: BLE001 - the boundary
            # The Python client stores the returned handle even on error (contract §6.2.14):
            # hand its old one back so a later ack is judged on that.
            return sv.ChangeInvisibleDurationResponse(status=status_of(exc, "ChangeInvisibleDuration"),
                                                      receipt_handle=request.receipt_handle)
        # A short (or 0 s) invisible time may be the next deadline now; the tick that revives
        # the message wakes the parked polls.
        self.kick_ticker()
        return sv.ChangeInvisibleDurationResponse(status=self._ok, receipt_handle=handle)

    @boundary(status_only(sv.ForwardMessageToDeadLetterQueueResponse), "ForwardMessageToDeadLetterQueue")
    async def ForwardMessageToDeadLetterQueue(self, request, context):
        group = convert.group_name(request.group)
        topic = convert.topic_name(request.topic)
        pop = self.pop
        if not request.receipt_handle:
            raise errors.InvalidReceiptHandle("the receipt handle is empty")
        await consumers.forward_to_dlq(pop, self.committer, group, topic, request.receipt_handle)
        self._waker.wake_soon()  # the FIFO group behind it is free again
        return self._ok_forward
