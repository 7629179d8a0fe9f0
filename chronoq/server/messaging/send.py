"""Producing: SendMessage (plain batches in bulk, every other shape message by message, transaction
halves), EndTransaction and RecallMessage. Every SendMessage answer is encoded by
``chronoq.protocol.rocketmq.send.send_response``."""

from __future__ import annotations

import asyncio
import operator

from rocketmq.grpc_protocol import definition_pb2 as pb
from rocketmq.grpc_protocol import service_pb2 as sv

from chronoq.core import errors, model
from chronoq.protocol.rocketmq import status
from chronoq.protocol.rocketmq.send import plain_columns, send_response
from chronoq.server import convert
from chronoq.server.messaging.calls import SendRequest, boundary, status_only
from chronoq.timer import handle as recall_handles

SEND_BATCH_MAX = 1024               # messages in one SendMessage request
_TRANSACTION = model.MessageType.TRANSACTION  # (an enum member lookup costs ~1 us on 3.11)
_get_ids, _get_offsets, _get_recalls = map(operator.attrgetter, ("message_id", "queue_offset", "recall_handle"))


def _send_refused(code: int, message: str) -> bytes:
    return send_response((), (), status=(code, message))


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
        if len(messages) == 1:  # the official clients' only shape
            return send_response(*zip(await self._send_one(messages[0], context)))
        # The common batch (plain messages of one topic) is checked and stored in bulk
        # (Broker.write_plain); anything else, or any rule broken, takes _send_batch. Its columns
        # come from the request's bytes when it has them (plain_columns), else from the messages.
        plain = plain_columns(request.raw) if type(request) is SendRequest else None
        if plain is None:
            plain = convert.plain_batch(messages)
        if plain is not None:
            offsets = await self.committer.send_plain(*plain)
            if offsets is not None:
                return send_response(plain[1], offsets)  # (bytes: serialize_answer passes them on)
        return await self._send_batch(messages, context)

    async def _send_batch(self, messages, context=None) -> bytes:
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
            return send_response(*zip(*entries))  # (the first failure on top: clients read only that)
        return send_response(list(map(_get_ids, results)), list(map(_get_offsets, results)),
                             list(map(_get_recalls, results)))

    async def _send_one(self, msg, context=None) -> tuple:
        """The ``send_response`` columns of one message, failures included: (message id, queue
        offset, recall handle, transaction id, failure or None)."""
        try:
            outgoing = self._outgoing(msg)
            if outgoing.message_type is _TRANSACTION:
                return await self._send_half(outgoing)
            r = (await self.committer.send([outgoing]))[0]
        except Exception as exc:  # noqa: BLE001 - the answer for this message
            self._count_refusal(exc, context, "SendMessage")
            return msg.system_properties.message_id, 0, "", "", status.code_and_message(exc, "SendMessage")
        return r.message_id, r.queue_offset, r.recall_handle, "", None

    def _outgoing(self, msg):
        return convert.outgoing_from_pb(msg, self.config.max_body_bytes, self.clock.wall_ms(),
                                        self.config.timer_max_delay_ms)

    async def _send_half(self, outgoing) -> tuple:
        half = self.txns.half_message(outgoing)
        results = await self.committer.send([half], system=True)
        txid = self.txns.accepted(results, [half])[0]
        r = results[0]
        return r.message_id, r.queue_offset, "", txid, None

    @boundary(status_only(sv.EndTransactionResponse), "EndTransaction")
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
        result = await self.committer.recall(request.recall_handle)  # answered once durable
        outcome = result.outcome.value
        if outcome == "cancelled":
            return sv.RecallMessageResponse(status=self._ok, message_id=result.message_id)
        if outcome == "already_delivered":
            raise errors.ClientError(f"message {result.message_id} was already delivered; it cannot be recalled")
        raise errors.NotFound(f"no pending delayed message for this recall handle ({result.detail or 'unknown'})")
