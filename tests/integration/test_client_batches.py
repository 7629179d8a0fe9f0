"""``chronoq.client``'s batched send against ``chronoq serve`` when some messages of a batch are
refused: the broker stores the others, and the client says which were stored (their receipts)
and which refused, so a caller sends again only those (a resend of the whole batch stored the
good ones twice: each send mints new message ids)."""

from __future__ import annotations

import asyncio
import uuid

from rocketmq.grpc_protocol import definition_pb2 as pb

from chronoq.client import BatchSendError, ClientError
from chronoq.client.client import Client, OutgoingMessage, SendReceipt
from chronoq.client.routed import RoutedSender


def test_a_batch_with_a_refused_message_names_it_and_keeps_the_receipts_of_the_stored_ones(chronoq_endpoint):
    topic, group = f"bs-{uuid.uuid4().hex[:8]}", f"bsg-{uuid.uuid4().hex[:8]}"

    async def scenario():
        async with Client(chronoq_endpoint) as client, RoutedSender(chronoq_endpoint) as routed:
            for sender in (client, routed):
                try:
                    await sender.send_batch([OutgoingMessage(topic, b"good-1"), OutgoingMessage(topic, b""),
                                             OutgoingMessage(topic, b"good-2")])
                except BatchSendError as exc:
                    refused = exc
                else:
                    raise AssertionError("a batch with an empty body was taken whole")
                assert isinstance(refused, ClientError) and refused.code == pb.Code.MESSAGE_BODY_EMPTY
                first, bad, last = refused.results
                assert isinstance(first, SendReceipt) and isinstance(last, SendReceipt)
                assert isinstance(bad, ClientError) and bad.code == pb.Code.MESSAGE_BODY_EMPTY
                assert "message 1 of the batch" in bad.status_message, bad.status_message
            got = []
            for _ in range(20):
                got += await client.receive(group, topic, max_messages=16, wait_s=0.5)
                if len(got) >= 4:
                    break
            await asyncio.sleep(0.5)
            got += await client.receive(group, topic, max_messages=16, wait_s=0.5)
            return sorted(m.body for m in got)

    assert asyncio.run(scenario()) == [b"good-1", b"good-1", b"good-2", b"good-2"]  # each batch's two, once
