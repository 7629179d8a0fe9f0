"""Producing: SendMessage (every shape of message through one columnar path; a transactional half,
always alone, through the transactions), EndTransaction and RecallMessage. Every SendMessage answer is encoded by
``chronoq.protocol.rocketmq.send.send_response``."""

from __future__ import annotations

import asyncio

from rocketmq.grpc_protocol import definition_pb2 as pb
from rocketmq.grpc_protocol import service_pb2 as sv

from chronoq.core import errors, model
from chronoq.protocol.rocketmq import status
from chronoq.protocol.rocketmq.send import send_columns, send_response
from chronoq.server import convert
from chronoq.server.messaging.calls import SendRequest, boundary, client_id, status_only
from chronoq.timer import handle as recall_handles

SEND_BATCH_MAX = 1024               # messages in one SendMessage request
_TRANSACTION = model.MessageType.TRANSACTION  # (an enum member lookup costs ~1 us on 3.11)
_PB_TRANSACTION = pb.TRANSACTION


def _send_refused(code: int, message: str) -> bytes:
    return send_response((), (), status=(code, message))


def _replaced_status(replaced: str) -> tuple[int, str] | None:
    """An accepted entry's status when its send carried a replace key (chronoq.timer.keyed): OK,
    with what it replaced in the message ("OK; replaced:<id>", "OK; already_delivered:<id>",
    "OK; none"), the one text field of an answer the official clients keep. None: plain "OK"."""
    return (status.OK, f"OK; {replaced}") if replaced else None


class SendRpcs:
    """The producer's RPCs of ``MessagingService`` (which holds ``config``, ``broker``, ``committer``,
    ``txns``, ``clock`` and ``_ok``, and counts refusals)."""

    @boundary(_send_refused, "SendMessage")
    async def SendMessage(self, request, context):
        messages = request.messages
        if not messages:
            raise errors.ClientError("SendMessage carries no message")
        if len(messages) > SEND_BATCH_MAX:
            raise errors.ClientError(f"SendMessage carries {len(messages)} messages; at most {SEND_BATCH_MAX}")
        # Every shape takes one path: the request's columns, the protocol's rules
        # (convert.outgoing_batch), the broker's (Broker.write_batch), one answer. The columns are
        # read from the request's bytes when it has them (send.send_columns: it pays for batches),
        # else through the generated classes, which read a lone message's fields in C. A message
        # with user properties is read from its bytes too: they keep the client's order of the
        # properties (upb's map has an order of its own), so its record is the same bytes alone or
        # in a batch.
        lone = len(messages) == 1 and not messages[0].user_properties
        columns = send_columns(request.raw) if not lone and type(request) is SendRequest else None
        if columns is None:
            columns = convert.send_columns(messages)
        if len(messages) == 1:  # the official clients' only shape: its failure is its entry's
            return send_response(*zip(await self._send_one(columns, context)))
        if _PB_TRANSACTION in columns.message_types:
            raise errors.ClientError("a transactional message must be sent alone, one per SendMessage")
        try:  # one group commit for the whole request
            cfg = self.config
            batch = convert.outgoing_batch(columns, cfg.max_body_bytes, self.clock.wall_ms(), cfg.timer_max_delay_ms)
            sent = await self.committer.send_batch(batch)
        except (errors.ClientError, errors.NotYetImplemented, errors.Unsupported):
            # The broker refuses a batch with one bad message as a whole. Send them one by one
            # instead, so each gets its own answer (the committer still groups the fsyncs).
            entries = await asyncio.gather(*(self._send_one(columns.take((i,)), context, i)
                                             for i in range(len(messages))))
            return send_response(*zip(*entries))  # (the first failure on top: clients read only that)
        return send_response(sent.message_ids, sent.queue_offsets, sent.recall_handles, None,
                             list(map(_replaced_status, sent.replaced)) if sent.replaced else None)

    async def _send_one(self, columns, context=None, place: int | None = None) -> tuple:
        """The ``send_response`` columns of a request's one message (``columns``), failures
        included: (message id, queue offset, recall handle, transaction id, failure or None).
        ``place``: its index in a batch sent one by one (a failure names it)."""
        try:
            cfg = self.config
            batch = convert.outgoing_batch(columns, cfg.max_body_bytes, self.clock.wall_ms(), cfg.timer_max_delay_ms)
            if batch.message_types[0] is _TRANSACTION:
                return await self._send_half(batch.message(0), context)
            sent = await self.committer.send_batch(batch)
        except Exception as exc:  # noqa: BLE001 - the answer for this message
            self._count_refusal(exc, context, "SendMessage")
            code, text = status.code_and_message(exc, "SendMessage")
            if place is not None:  # (the broker saw a batch of one: "message 0" would be wrong)
                text = f"message {place} of the batch: {text.replace('message 0 of the batch', 'the message', 1)}"
            return columns.message_ids[0], 0, "", "", (code, text)
        return (sent.message_ids[0], sent.queue_offsets[0], (sent.recall_handles or ("",))[0], "",
                _replaced_status(sent.replaced[0]) if sent.replaced else None)

    async def _send_half(self, outgoing, context) -> tuple:
        txns = self.txns
        half = txns.half_message(outgoing)  # refused past max_pending_transactions, before any write
        try:
            results = await self.committer.send([half], system=True)
        except BaseException:
            txns.abandoned([half])
            raise
        txid = txns.accepted(results, [half])[0]
        if context is not None:  # its producer is the one to check it with (ClientRpcs._check_transaction)
            self._sent_half(client_id(context), outgoing.topic)
        r = results[0]
        return r.message_id, r.queue_offset, "", txid, None

    @boundary(status_only(sv.EndTransactionResponse), "EndTransaction")
    async def EndTransaction(self, request, context):
        if request.resolution == pb.TRANSACTION_RESOLUTION_UNSPECIFIED:
            # "Not known yet": the Python client's checker answers a check so when it cannot tell
            # (its enum has no UNKNOWN). Nothing changes (a pending transaction's, else refused);
            # the half is checked again later.
            self.txns.pending_half(request.topic.name, request.message_id, request.transaction_id)
            return sv.EndTransactionResponse(status=self._ok)
        if request.resolution not in (pb.COMMIT, pb.ROLLBACK):
            raise errors.ClientError("resolution must be COMMIT or ROLLBACK (or unspecified: not known yet)")
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

    @boundary(status_only(sv.RecallMessageResponse), "RecallMessage")
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
        if self.cluster is not None:  # a handle of another broker group: its primary answers
            answer = await self.cluster.elsewhere(request.recall_handle, "/apache.rocketmq.v2.MessagingService/"
                                                  "RecallMessage", request, sv.RecallMessageResponse,
                                                  context.time_remaining())
            if answer is not None:
                return answer
        result = await self.committer.recall(request.recall_handle)  # answered once durable
        outcome = result.outcome.value
        if outcome == "cancelled":
            return sv.RecallMessageResponse(status=self._ok, message_id=result.message_id)
        if outcome == "already_delivered":
            raise errors.ClientError(f"message {result.message_id} was already delivered; it cannot be recalled")
        raise errors.NotFound(f"no pending delayed message for this recall handle ({result.detail or 'unknown'})")
