"""Every entry point stores a message byte-identical, field by field, or refuses it by name and
stores nothing (issue 20 §4, chronoq.core.validate).

Hypothesis draws messages whose topic, tag, keys, properties, message group and message id are
clean or hostile: control characters, the record's separators 0x01/0x02, unicode, lone
surrogates (no UTF-8 form), empty and very long strings. Each goes in through one entry point:
``Broker.send_batch`` and ``Broker.send``, gRPC SendMessage through a real in-process server
(one message, or a batch of two that takes the bulk path when plain), Stage then Publish, a
transaction half then its commit, and a delayed send delivered by the timer's copy. Then either

- it is refused with a ``chronoq.core.errors.ClientError`` subclass (a gRPC client error code) and
  the commit log did not grow and no queue moved, or
- it reads back (``Broker.read``) with every field equal to what was sent.

A message whose every field is clean must be accepted, so a validator refusing everything
fails too. Runtime: a few tens of seconds (``settings`` below).
"""

from __future__ import annotations

import asyncio
import itertools
from collections import Counter
from dataclasses import dataclass, field

import grpc
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from rocketmq.grpc_protocol import definition_pb2 as pb
from rocketmq.grpc_protocol import service_pb2 as sv
from rocketmq.grpc_protocol import service_pb2_grpc

from chronoq.core import errors
from chronoq.broker.broker import Broker, OutgoingMessage
from chronoq.core.clock import FakeClock
from chronoq.core.config import BrokerConfig
from chronoq.features.staging import Rows, Staging
from chronoq.features.transactions import Transactions

from .conftest import start_front_end, stop_front_end

BODY_MAX = 512
EXAMPLES = settings(max_examples=150, deadline=None, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
FORGED_GROUP = "g\x02evil\x01yes"

# Characters that matter to the record and to the rules, mixed with ordinary ones.
_HOSTILE_CHARS = ["\x00", "\x01", "\x02", "\x1f", "\x7f", "\x85", "\u00a0", "\u2028", "\ud800", "\udfff",
                  " ", "|", "%", "_", "-", "=", "é", "中", "\U0001f600", "a", "Z", "0"]
_hostile = st.one_of(
    st.text(st.sampled_from(_HOSTILE_CHARS), max_size=12),
    st.text(max_size=12),  # any unicode (Hypothesis leaves out surrogates here)
    st.just(FORGED_GROUP),
    st.builds(lambda s, n: s * n, st.sampled_from(["a", "é", "\x01", "ab"]), st.integers(60, 20_000)),
)
_clean = st.text("abcXYZ019_-", max_size=11).map(lambda s: "c" + s)  # (never "__", a reserved prefix)
_ids = itertools.count()
# Outcomes per test (printed with -s): each test checks that some messages were accepted and
# some refused, so neither half of the property goes untested.
TALLY: Counter = Counter()


def _tallied(check) -> None:
    TALLY.clear()
    check()
    print(dict(TALLY))
    accepted = TALLY["accepted"] + TALLY[f"status {pb.OK}"]
    assert accepted >= 5 and sum(TALLY.values()) - accepted >= 5, dict(TALLY)


@dataclass
class Spec:
    """One message as drawn, with which fields are clean."""

    topic: str
    body: bytes
    tag: str
    keys: list
    properties: dict
    group: str | None
    message_id: str
    clean: dict = field(default_factory=dict)

    def is_clean(self, *fields: str) -> bool:
        return all(self.clean[f] for f in fields)


_FIELDS = ("topic", "body", "tag", "keys", "properties", "group", "message_id")


@st.composite
def specs(draw, topic: str) -> Spec:
    # A few fields hostile, the rest clean: a message with one bad field must be refused for it,
    # and one with none must go through (about a third of the draws).
    hostile = draw(st.one_of(st.just(frozenset()), st.frozensets(st.sampled_from(_FIELDS), min_size=1, max_size=3)))

    def pick(name, clean, bad):
        return (draw(bad), False) if name in hostile else (draw(clean), True)

    clean = {}
    t, clean["topic"] = pick("topic", st.just(topic), _hostile)
    body, clean["body"] = pick("body", st.binary(min_size=1, max_size=64),
                               st.one_of(st.just(b""), st.binary(min_size=BODY_MAX + 1, max_size=BODY_MAX + 8)))
    tag, clean["tag"] = pick("tag", st.sampled_from(["", "tag-a"]) | _clean, _hostile)
    keys, clean["keys"] = pick("keys", st.lists(_clean, max_size=3),
                               st.lists(_clean | _hostile, min_size=1, max_size=3))
    props, clean["properties"] = pick("properties", st.dictionaries(_clean, _clean | st.just(""), max_size=3),
                                      st.dictionaries(_clean | _hostile, _clean | _hostile, min_size=1, max_size=3))
    group, clean["group"] = pick("group", st.one_of(st.none(), _clean), _hostile)
    mid, clean["message_id"] = pick("message_id", _clean, _hostile)
    # A counter keeps ids unique (a repeated id would be answered as a duplicate of another message).
    return Spec(t, body, tag, keys, props, group, f"{mid}-{next(_ids)}", clean)


# ------------------------------------------------------------------------------ reading back
def _spec(topic: str, **kw) -> Spec:
    """A hand-made draw for ``@example``: the cases each entry point must meet every run."""
    fields = dict(body=b"x", tag="", keys=[], properties={}, group=None, message_id=f"ex-{next(_ids)}")
    bad = set(kw)
    fields.update(kw)
    return Spec(topic, clean={f: f not in bad for f in _FIELDS}, **fields)


FORGED = _spec("vf", group=FORGED_GROUP)
SURROGATE = _spec("vf", tag="\ud800", properties={"k": "v\udfff"})
NEW_TOPIC_BAD_TAG = _spec("new-topic", tag="a|b")


def _snapshot(broker: Broker) -> tuple:
    """The commit log's end and every queue's end: whatever a refused send must leave alone."""
    return broker.store.log.written, {name: [broker.queue_bounds(name, q)[1] for q in range(cfg.queues)]
                                      for name, cfg in broker.topics.items()}


def _new_messages(broker: Broker, topic: str, before: tuple) -> list:
    cfg = broker.topics.get(topic)
    if cfg is None:
        return []
    ends = before[1].get(topic, [0] * cfg.queues)
    return [m for q in range(cfg.queues) for m in broker.read(topic, q, ends[q] if q < len(ends) else 0,
                                                               1000).messages]


def _assert_same(spec: Spec, m, *, message_id: bool = True, group: bool = True) -> None:
    assert m.topic == spec.topic
    assert m.body == spec.body
    assert m.tag == spec.tag
    assert m.keys == tuple(spec.keys)
    assert {k: v for k, v in m.properties.items() if not k.startswith("__")} == spec.properties
    if group:
        assert m.properties.get("__GROUP") == (spec.group or None)
    if message_id:
        assert m.message_id == spec.message_id


def _outcome(broker: Broker, spec: Spec, run, fields: tuple, **same) -> None:
    """Run one entry point on ``spec``: accepted and read back identical, or refused by name
    with nothing stored. ``fields``: those the entry point takes (all clean: must be accepted)."""
    before = _snapshot(broker)
    try:
        got = run()
    except errors.ClientError as exc:
        TALLY[f"refused: {type(exc).__name__}"] += 1
        assert type(exc) is not errors.ChronoqError and exc.message
        assert _snapshot(broker) == before, f"refused ({exc.message}) yet something was stored"
        assert not spec.is_clean(*fields), f"a clean message was refused: {exc.message}"
        return
    TALLY["accepted"] += 1
    assert len(got) == 1, got
    _assert_same(spec, got[0], **same)


_ALL = _FIELDS


def _outgoing(spec: Spec, **kw) -> OutgoingMessage:
    return OutgoingMessage(spec.topic, spec.body, tag=spec.tag, keys=list(spec.keys), properties=dict(spec.properties),
                           message_group=spec.group, message_id=spec.message_id, **kw)


@pytest.fixture
def broker(tmp_path):
    b = Broker(BrokerConfig(data_dir=str(tmp_path / "data"), max_body_bytes=BODY_MAX), clock=FakeClock())
    yield b
    b.close()


# ------------------------------------------------------------------------------ embedded
def test_send_batch_and_send(broker):
    @EXAMPLES
    @given(specs("vt"), st.booleans())
    @example(FORGED, True)
    @example(FORGED, False)
    @example(SURROGATE, False)
    @example(NEW_TOPIC_BAD_TAG, False)
    def check(spec, one):
        def run():
            if one:
                r = broker.send(spec.topic, spec.body, tag=spec.tag, keys=list(spec.keys),
                                properties=dict(spec.properties), message_group=spec.group, message_id=spec.message_id)
            else:
                r = broker.send_batch([_outgoing(spec)])[0]
            return broker.read(r.topic, r.queue_id, r.queue_offset, 1).messages
        _outcome(broker, spec, run, _ALL)
    _tallied(check)


def test_delayed_send_through_the_timer_copy(broker):
    @EXAMPLES
    @given(specs("vd"))
    @example(FORGED)
    @example(SURROGATE)
    def check(spec):
        def run():
            before = _snapshot(broker)
            due = broker.clock.wall_ms() + 5_000
            broker.send_batch([_outgoing(spec, deliver_at_ms=due)])
            assert _new_messages(broker, spec.topic, before) == []  # never early
            broker.clock.advance(5_000)
            for _ in range(100):
                deadline = broker.timer_next_deadline_ms()
                if deadline is None or deadline > broker.clock.wall_ms():
                    break
                broker.timer_tick()
            got = _new_messages(broker, spec.topic, before)
            assert all(m.deliver_at_ms == due for m in got)
            return got
        _outcome(broker, spec, run, _ALL)
    _tallied(check)


def test_stage_then_publish(broker):
    staging = Staging(broker)
    batches = itertools.count()

    @EXAMPLES
    @given(specs("vs"))
    @example(FORGED)
    @example(SURROGATE)
    @example(NEW_TOPIC_BAD_TAG)
    def check(spec):
        def run():
            before = _snapshot(broker)
            rows = Rows([spec.body], tags=[spec.tag], keys=[list(spec.keys)], properties=[dict(spec.properties)],
                        groups=[spec.group or ""])
            batch = next(batches)
            staging.stage("sink", batch, "s0", 0, spec.topic, rows)
            job = staging.publish("sink", batch, [("s0", 1, 1)])
            for _ in job.steps(staging):
                pass
            broker.flush()
            return _new_messages(broker, spec.topic, before)
        # Stage chooses the message ids.
        _outcome(broker, spec, run, ("topic", "body", "tag", "keys", "properties", "group"), message_id=False)
    _tallied(check)


def test_transaction_half_then_commit(broker):
    txns = Transactions(broker)

    @EXAMPLES
    @given(specs("vx"))
    @example(SURROGATE)
    @example(_spec("new-txn-topic", body=b""))
    def check(spec):
        spec.group = None  # (a transactional message has none: refused as a type mismatch)

        def run():
            before = _snapshot(broker)
            half = txns.half_message(_outgoing(spec))
            results = broker.send_batch([half], system=True)
            txid = txns.accepted(results, [half])[0]
            # Once the half is accepted, the commit's copy must be too: no error is allowed here.
            try:
                txns.end(spec.topic, spec.message_id, txid, commit=True)
            except errors.ChronoqError as exc:
                raise AssertionError(f"a stored half could not be committed: {exc.message}") from exc
            return _new_messages(broker, spec.topic, before)
        _outcome(broker, spec, run, ("topic", "body", "tag", "keys", "properties", "message_id"))
    _tallied(check)


# ------------------------------------------------------------------------------ gRPC
def _pb_message(spec: Spec, transactional: bool = False):
    """The message as an official client sends it; None when protobuf cannot encode it (a
    lone surrogate: such a string cannot reach the server as a protobuf string)."""
    kind = pb.TRANSACTION if transactional else pb.FIFO if spec.group is not None else pb.NORMAL
    sp = {"message_id": spec.message_id, "message_type": kind}
    if spec.tag:
        sp["tag"] = spec.tag
    if spec.keys:
        sp["keys"] = spec.keys
    if spec.group is not None:
        sp["message_group"] = spec.group
    try:
        m = pb.Message(topic=pb.Resource(name=spec.topic), user_properties=spec.properties,
                       system_properties=pb.SystemProperties(**sp), body=spec.body)
        m.SerializeToString()
    except (UnicodeEncodeError, ValueError):
        return None
    return m


async def _front_end(tmp_path):
    return await start_front_end(str(tmp_path / "grpc"), max_body_bytes=BODY_MAX)


async def _close(front) -> None:
    await stop_front_end(front)


def test_grpc_send_message(tmp_path):
    loop = asyncio.new_event_loop()
    front = loop.run_until_complete(_front_end(tmp_path))
    broker = front.runtime.broker

    async def open_channel():  # (created inside the loop it serves)
        return grpc.aio.insecure_channel(front.config.endpoint)

    channel = loop.run_until_complete(open_channel())
    stub = service_pb2_grpc.MessagingServiceStub(channel)
    drawn = st.lists(specs("vg"), min_size=1, max_size=2)

    @EXAMPLES
    @given(drawn, st.booleans())
    @example([FORGED], False)
    @example([NEW_TOPIC_BAD_TAG], True)
    def check(batch, transactional):
        # A transactional message goes alone (a half, then EndTransaction COMMIT) and has no group.
        transactional = transactional and len(batch) == 1 and batch[0].group is None
        messages = [_pb_message(s, transactional) for s in batch]
        if any(m is None for m in messages):
            TALLY["not encodable by protobuf"] += 1
            return  # the client library refuses it: see test_grpc_refuses_the_forged_group_and_invalid_utf8
        before = _snapshot(broker)
        reply = loop.run_until_complete(stub.SendMessage(sv.SendMessageRequest(messages=messages), timeout=10))
        entries = reply.entries
        assert len(entries) == len(batch)
        if transactional and entries[0].status.code == pb.OK:
            TALLY["transaction committed"] += 1
            end = loop.run_until_complete(stub.EndTransaction(sv.EndTransactionRequest(
                topic=pb.Resource(name=batch[0].topic), message_id=entries[0].message_id,
                transaction_id=entries[0].transaction_id, resolution=pb.COMMIT), timeout=10))
            assert end.status.code == pb.OK, end.status  # a stored half always commits
        new = {}
        for s in batch:
            for m in _new_messages(broker, s.topic, before):
                new[(m.topic, m.message_id)] = m
        accepted = 0
        for s, e in zip(batch, entries):
            TALLY[f"status {e.status.code}"] += 1
            if e.status.code == pb.OK:
                accepted += 1
                _assert_same(s, new[(s.topic, s.message_id)])
            else:
                assert 40000 <= e.status.code < 50000 and e.status.message, e.status
                assert (s.topic, s.message_id) not in new
                # One refused message of a batch may take the others with it; alone, a clean one never.
                assert len(batch) > 1 or not s.is_clean(*_ALL), e.status.message
        assert len(new) == accepted
        if accepted == 0:
            assert _snapshot(broker) == before
    try:
        _tallied(check)
    finally:
        loop.run_until_complete(channel.close())
        loop.run_until_complete(_close(front))
        loop.close()


def test_grpc_refuses_the_forged_group_and_invalid_utf8(tmp_path):
    async def scenario():
        front = await _front_end(tmp_path)
        broker = front.runtime.broker
        try:
            async with grpc.aio.insecure_channel(front.config.endpoint) as channel:
                stub = service_pb2_grpc.MessagingServiceStub(channel)
                before = _snapshot(broker)
                forged = pb.Message(topic=pb.Resource(name="vu"), body=b"x", system_properties=pb.SystemProperties(
                    message_id="m-1", message_type=pb.FIFO, message_group=FORGED_GROUP))
                reply = await stub.SendMessage(sv.SendMessageRequest(messages=[forged]), timeout=10)
                assert reply.status.code == pb.ILLEGAL_MESSAGE_GROUP, reply.status
                # A tag whose bytes are not UTF-8 (a lone surrogate's encoding): refused, nothing stored.
                ok = pb.Message(topic=pb.Resource(name="vu"), body=b"x", system_properties=pb.SystemProperties(
                    message_id="m-2", tag="QQQ"))
                raw = sv.SendMessageRequest(messages=[ok]).SerializeToString().replace(b"QQQ", b"\xed\xa0\x80")
                send_raw = channel.unary_unary("/apache.rocketmq.v2.MessagingService/SendMessage",
                                               request_serializer=None,
                                               response_deserializer=sv.SendMessageResponse.FromString)
                try:
                    reply = await send_raw(raw, timeout=10)
                    assert reply.status.code != pb.OK
                except grpc.aio.AioRpcError as exc:  # (a transport-level refusal is a refusal too)
                    assert exc.code() != grpc.StatusCode.OK
                assert _snapshot(broker) == before
        finally:
            await _close(front)

    asyncio.run(scenario())
