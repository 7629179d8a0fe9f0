"""send.send_columns (a SendMessage request's columns read from its bytes) against
convert.send_columns (the same read through the generated classes), which it stands in for: on
every shape of message (keys, groups, delivery timestamps, properties, delay levels, priorities,
lite topics, compressed bodies), on the batches chronoq's client writes, and on random requests."""

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
    return convert.send_columns(sv.SendMessageRequest.FromString(raw).messages)


def _agrees(raw: bytes):
    """send.send_columns answers what the generated classes read, or None (then the caller asks them)."""
    got = send.send_columns(raw)
    if got is not None:
        assert got == _truth(raw)
    return got


def _message(mid: str, body: bytes, topic: str = "orders", props=None, **sp) -> pb.Message:
    return pb.Message(topic=pb.Resource(name=topic), body=body, user_properties=props or {},
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
    assert got.topics == ["orders"] * len(bodies) and got.bodies == bodies and got.tags == [""] * len(bodies)
    assert len(set(got.message_ids)) == len(bodies) and all(b is not None and b > 0 for b in got.born_ms)
    assert got.message_types == [pb.NORMAL] * len(bodies) and got.delivery_timestamps == [None] * len(bodies)


def test_a_chronoq_client_delayed_batch_is_read_whole():
    """The delayed batch (every message its own delivery time, nanos of every width) is read from
    its bytes, each timestamp where the generated classes find it."""
    dues = [1_800_000_000_000 + i * 7 for i in range(150)] + [1_800_000_000_000, 1_800_000_001_999]
    messages = [OutgoingMessage("orders", b"x" * (i % 3 + 1), deliver_at_ms=d) for i, d in enumerate(dues)]
    got = _agrees(_client_request(messages))
    assert got is not None
    assert got.delivery_timestamps == [(d // 1000, d % 1000 * 1_000_000) for d in dues]
    assert got.message_types == [pb.DELAY] * len(dues)


def test_every_shape_of_message_is_read():
    base = [_message("a", b"1"), _message("b", b"2")]
    for extra in (_message("c", b"3", keys=["k", "k2"]), _message("c", b"3", message_group="g"),
                  _message("c", b"3", message_group=""),
                  _message("c", b"3", delivery_timestamp={"seconds": 5}), _message("c", b"3", priority=0),
                  _message("c", b"3", lite_topic="lt"), _message("c", b"3", message_type=pb.FIFO),
                  _message("c", b"3", body_encoding=pb.GZIP), _message("c", b"3", topic="other"),
                  _message("c", b"3", props={"k": "v", convert.DELAY_LEVEL_PROPERTY: "2"}),
                  _message("c", b"3", message_type=pb.TRANSACTION, tag="")):
        raw = sv.SendMessageRequest(messages=base + [extra]).SerializeToString()
        assert _agrees(raw) is not None, extra


def test_shapes_change_within_a_batch():
    messages = [_message(f"id-{i}", b"b" * (i * 50 + 1), tag=("", "red", "blue")[i % 3],
                         born_timestamp={"seconds": 1_700_000_000 + i % 2, "nanos": 5_000_000 * i})
                for i in range(30)]
    messages += [_message("x" * 40, b"tail"), _message("y", b"tail2", message_type=pb.NORMAL)]
    raw = sv.SendMessageRequest(messages=messages).SerializeToString()
    got = _agrees(raw)
    assert got is not None and got.tags[:3] == ["", "red", "blue"] and got.message_ids[-2:] == ["x" * 40, "y"]


def test_bytes_protobuf_merges_are_left_to_protobuf():
    one = _message("a", b"1").SerializeToString()
    # A second system-properties field: protobuf merges it (the id changes); the reader gives up.
    twice = one + fields.field(fields.K_MESSAGE_SP, fields.string_field(fields.K_SP_MESSAGE_ID, "z"))
    raw = fields.field(fields.K_SEND_MESSAGES, twice) * 2
    assert send.send_columns(raw) is None
    assert _truth(raw).message_ids == ["z", "z"]
    # The body given twice: the last wins, in both readers.
    body_twice = one + fields.field(fields.K_MESSAGE_BODY, b"second")
    raw = fields.field(fields.K_SEND_MESSAGES, body_twice) * 3
    assert _agrees(raw).bodies == [b"second"] * 3
    # An id given twice in the system properties: the last wins, in both readers.
    sp = fields.string_field(fields.K_SP_MESSAGE_ID, "first") + fields.string_field(fields.K_SP_MESSAGE_ID, "last")
    raw = fields.field(fields.K_SEND_MESSAGES, fields.field(fields.K_MESSAGE_SP, sp)
                       + fields.field(fields.K_MESSAGE_BODY, b"b")) * 3
    assert _agrees(raw).message_ids == ["last"] * 3
    # A delivery timestamp given twice: protobuf merges it; the reader gives up.
    ts = fields.field(fields.K_SP_DELIVERY_TIMESTAMP, fields.timestamp(5_000))
    sp = fields.string_field(fields.K_SP_MESSAGE_ID, "a") + ts + ts
    raw = fields.field(fields.K_SEND_MESSAGES, fields.field(fields.K_MESSAGE_SP, sp)) * 2
    assert send.send_columns(raw) is None
    # An unknown message field after the body: the shape does not hold, each message is read whole.
    tail = one + fields.key(9, fields.VARINT) + fields.varint(7)
    raw = fields.field(fields.K_SEND_MESSAGES, tail) * 3
    assert _agrees(raw) is not None
    # Unknown fixed-width fields (64 and 32 bits) are skipped, as protobuf keeps them aside.
    fixed = one + fields.key(10, 1) + bytes(8) + fields.key(11, 5) + bytes(4)
    raw = fields.field(fields.K_SEND_MESSAGES, fixed) * 2
    assert _agrees(raw) is not None
    # A group (wire type 3) is not read: the reader gives up.
    group = fields.key(12, 3) + fields.key(12, 4)
    assert send.send_columns(fields.field(fields.K_SEND_MESSAGES, one + group) * 2) is None


_ids = st.text(alphabet=st.characters(min_codepoint=33, max_codepoint=0x2FF), min_size=0, max_size=40)
_text = st.text(alphabet=st.characters(min_codepoint=1, max_codepoint=0x2FF), max_size=8)
_ts = st.fixed_dictionaries({"seconds": st.integers(-10, 2_000_000_000_000), "nanos": st.integers(-999_999_999, 999_999_999)})


@st.composite
def _messages(draw):
    sp = {"message_type": draw(st.sampled_from([pb.NORMAL, pb.MESSAGE_TYPE_UNSPECIFIED, pb.FIFO, pb.DELAY,
                                                pb.TRANSACTION, pb.LITE, 77])),
          "body_encoding": draw(st.sampled_from([pb.IDENTITY, pb.ENCODING_UNSPECIFIED, pb.GZIP, 9]))}
    for name, strategy in (("tag", _text), ("keys", st.lists(_text, max_size=3)), ("born_timestamp", _ts),
                           ("delivery_timestamp", _ts), ("message_group", _text), ("lite_topic", _text),
                           ("priority", st.integers(-3, 3)), ("born_host", _text)):
        if draw(st.booleans()):
            sp[name] = draw(strategy)
    props = draw(st.one_of(st.none(), st.dictionaries(_text, _text, max_size=3)))
    return _message(draw(_ids), draw(st.binary(max_size=300)), topic=draw(st.sampled_from(["orders", "o2", ""])),
                    props=props, **sp)


@settings(max_examples=300, deadline=None)
@given(st.lists(_messages(), min_size=1, max_size=8), st.lists(st.tuples(_ids, st.binary(max_size=200), _ts),
                                                                max_size=6))
def test_generated_requests_agree(messages, variants):
    """Random messages of every shape, and runs of one message with only its id, body and delivery
    timestamp changed (as batching producers send): the bytes read as the generated classes read
    them, and every request protobuf writes is read whole (it writes no merge, no group)."""
    first = messages[0]
    for mid, body, ts in variants:
        copy = pb.Message()
        copy.CopyFrom(first)
        copy.system_properties.message_id = mid
        copy.body = body
        if copy.system_properties.HasField("delivery_timestamp"):
            copy.system_properties.delivery_timestamp.seconds = ts["seconds"]
            copy.system_properties.delivery_timestamp.nanos = ts["nanos"]
        messages.append(copy)
    raw = sv.SendMessageRequest(messages=messages).SerializeToString()
    got = _agrees(raw)
    assert got is not None


@settings(max_examples=200, deadline=None)
@given(_text, st.lists(_text, max_size=2), _ts, st.lists(st.tuples(_ids.filter(bool), st.binary(max_size=200), _ts),
                                                          min_size=1, max_size=6))
def test_runs_of_delayed_messages_agree(tag, keys, born, variants):
    """A run of delayed messages that differ in id, body and delivery timestamp only (the delayed
    batch): read from the first one's shape, each timestamp as the generated classes read it."""
    messages = [_message(mid, body, message_type=pb.DELAY, tag=tag, keys=keys, born_timestamp=born,
                         delivery_timestamp=ts) for mid, body, ts in variants]
    got = _agrees(sv.SendMessageRequest(messages=messages).SerializeToString())
    assert got is not None
