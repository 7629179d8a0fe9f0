"""send.plain_columns (a SendMessage batch's columns read from its bytes) against
convert.plain_batch (the same read from the parsed request), which it stands in for."""

from __future__ import annotations

import asyncio
import os

from hypothesis import given, settings
from hypothesis import strategies as st
from rocketmq.grpc_protocol import definition_pb2 as pb
from rocketmq.grpc_protocol import service_pb2 as sv

from chronoq.protocol.rocketmq import fields, send
from chronoq.client.client import Client, OutgoingMessage
from chronoq.server import convert


def _truth(raw: bytes):
    return convert.plain_batch(sv.SendMessageRequest.FromString(raw).messages)


def _agrees(raw: bytes):
    """plain_columns answers what plain_batch answers, or None (then the caller asks plain_batch)."""
    got = send.plain_columns(raw)
    if got is not None:
        assert got == _truth(raw)
    return got


def _message(mid: str, body: bytes, topic: str = "orders", **sp) -> pb.Message:
    return pb.Message(topic=pb.Resource(name=topic), body=body,
                      system_properties=pb.SystemProperties(message_id=mid, **sp))


def _client_request(messages: list[OutgoingMessage]) -> bytes:
    """The SendMessageRequest bytes chronoq.client.client sends for ``messages`` (nothing is sent)."""
    async def encode() -> bytes:
        async with Client("127.0.0.1:1") as client:
            return client._send_request_bytes(messages)
    return asyncio.run(encode())


def test_a_chronoq_client_batch_is_read_whole():
    bodies = [os.urandom(n) for n in (1, 127, 128, 1024, 1024, 16383, 16384, 70_000, 5)]
    raw = _client_request([OutgoingMessage("orders", b) for b in bodies])
    got = _agrees(raw)
    assert got is not None
    topic, ids, tags, read_bodies, borns = got
    assert topic == "orders" and read_bodies == bodies and tags == [""] * len(bodies)
    assert len(set(ids)) == len(ids) and all(b is not None and b > 0 for b in borns)


def test_shapes_change_within_a_batch():
    messages = [_message(f"id-{i}", b"b" * (i * 50 + 1), tag=("", "red", "blue")[i % 3],
                         born_timestamp={"seconds": 1_700_000_000 + i % 2, "nanos": 5_000_000 * i})
                for i in range(30)]
    messages += [_message("x" * 40, b"tail"), _message("y", b"tail2", message_type=pb.NORMAL)]
    raw = sv.SendMessageRequest(messages=messages).SerializeToString()
    got = _agrees(raw)
    assert got is not None and got[2][:3] == ["", "red", "blue"] and got[1][-2:] == ["x" * 40, "y"]


def test_what_is_not_plain_is_declined():
    base = [_message("a", b"1"), _message("b", b"2")]
    for extra in (_message("c", b"3", keys=["k"]), _message("c", b"3", message_group="g"),
                  _message("c", b"3", delivery_timestamp={"seconds": 5}), _message("c", b"3", priority=0),
                  _message("c", b"3", lite_topic="lt"), _message("c", b"3", message_type=pb.FIFO),
                  _message("c", b"3", body_encoding=pb.GZIP), _message("c", b"3", topic="other"),
                  pb.Message(topic=pb.Resource(name="orders"), body=b"3", user_properties={"k": "v"},
                             system_properties=pb.SystemProperties(message_id="c"))):
        raw = sv.SendMessageRequest(messages=base + [extra]).SerializeToString()
        assert send.plain_columns(raw) is None
        assert _truth(raw) is None


def test_bytes_protobuf_merges_are_left_to_protobuf():
    one = _message("a", b"1").SerializeToString()
    # A second system-properties field: protobuf merges it (the id changes); columns gives up.
    twice = one + fields.field(fields.K_MESSAGE_SP, fields.string_field(fields.K_SP_MESSAGE_ID, "z"))
    raw = fields.field(fields.K_SEND_MESSAGES, twice) * 2
    assert send.plain_columns(raw) is None
    assert _truth(raw)[1] == ["z", "z"]
    # The body given twice: the last wins, in both readers.
    body_twice = one + fields.field(fields.K_MESSAGE_BODY, b"second")
    raw = fields.field(fields.K_SEND_MESSAGES, body_twice) * 3
    assert _agrees(raw)[3] == [b"second"] * 3
    # An unknown message field after the body: the shape does not hold, each message is read whole.
    tail = one + fields.key(9, fields.VARINT) + fields.varint(7)
    raw = fields.field(fields.K_SEND_MESSAGES, tail) * 3
    assert _agrees(raw) is not None
    # Unknown fixed-width fields (64 and 32 bits) are skipped, as protobuf keeps them aside.
    fixed = one + fields.key(10, 1) + bytes(8) + fields.key(11, 5) + bytes(4)
    raw = fields.field(fields.K_SEND_MESSAGES, fixed) * 2
    assert _agrees(raw) is not None
    # A group (wire type 3) is not read: columns gives up.
    group = fields.key(12, 3) + fields.key(12, 4)
    assert send.plain_columns(fields.field(fields.K_SEND_MESSAGES, one + group) * 2) is None


_ids = st.text(alphabet=st.characters(min_codepoint=33, max_codepoint=0x2FF), min_size=0, max_size=40)
_messages = st.builds(
    lambda mid, body, tag, born, mtype, enc, topic: _message(
        mid, body, topic=topic, message_type=mtype, body_encoding=enc,
        **({"tag": tag} if tag is not None else {}), **({"born_timestamp": born} if born else {})),
    _ids, st.binary(min_size=0, max_size=300), st.one_of(st.none(), st.sampled_from(["", "t", "tag-2"])),
    st.one_of(st.none(), st.fixed_dictionaries({"seconds": st.integers(-10, 2_000_000_000),
                                                "nanos": st.integers(-999_999_999, 999_999_999)})),
    st.sampled_from([pb.NORMAL, pb.MESSAGE_TYPE_UNSPECIFIED, pb.NORMAL, pb.FIFO]),
    st.sampled_from([pb.IDENTITY, pb.ENCODING_UNSPECIFIED, pb.IDENTITY, pb.GZIP]),
    st.sampled_from(["orders", "orders", "orders", "o2"]))


@settings(max_examples=300, deadline=None)
@given(st.lists(_messages, min_size=2, max_size=12), st.booleans())
def test_generated_batches_agree(messages, repeat_first):
    if repeat_first:  # runs of one shape, as batching producers send
        messages = [messages[0]] * 3 + messages
    raw = sv.SendMessageRequest(messages=messages).SerializeToString()
    got = _agrees(raw)
    truth = _truth(raw)
    if truth is None:
        assert got is None
    else:  # every plain batch protobuf writes is read whole
        assert got == truth
