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


def test_what_a_caller_is_likely_to_pass_is_taken_as_meant(chronoq_endpoint):
    """A text body is sent as its UTF-8, one key given as a string is one key (it was one per
    character), a property that is not text is a TypeError naming it, no messages no call."""
    import pytest

    topic, group = f"bs-{uuid.uuid4().hex[:8]}", f"bsg-{uuid.uuid4().hex[:8]}"
    with pytest.raises(TypeError, match="'n': 5"):
        OutgoingMessage(topic, b"x", properties={"n": 5})

    async def scenario():
        async with Client(chronoq_endpoint) as client:
            assert await client.send_batch([]) == []
            await client.send(topic, "héllo", keys="order-42")
            for _ in range(20):
                got = await client.receive(group, topic, wait_s=0.5)
                if got:
                    return got

    [m] = asyncio.run(scenario())
    assert m.body == "héllo".encode() and m.keys == ["order-42"]
