"""The unmodified official RocketMQ 5 Python client (rocketmq-python-client 5.1.2) against chronoq.

Every test talks to a real ``chronoq serve`` subprocess over loopback (``conftest.py``). The
client has slow timers (assignment scans every 5 s, heartbeats every 10 s), so tests use short
await durations, bounded loops with deadlines, and shut every client down in ``finally``.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections import defaultdict
from contextlib import contextmanager

import pytest
from rocketmq import (ClientConfiguration, ConsumeResult, Credentials, FilterExpression, Message,
                      MessageListener, Producer, PushConsumer, SimpleConsumer)

from .conftest import wait_until

AWAIT_S = 2  # SimpleConsumer long-poll duration


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:10]}"


def config(endpoint: str) -> ClientConfiguration:
    return ClientConfiguration(endpoint, Credentials("", ""), request_timeout=3)


def make_message(topic: str, body: bytes, *, tag: str | None = None, keys: tuple = (),
                 group: str | None = None, props: dict | None = None) -> Message:
    m = Message()
    m.topic = topic
    m.body = body
    if tag:
        m.tag = tag
    if keys:
        m.keys = keys[0]
    if group:
        m.message_group = group
    for k, v in (props or {}).items():
        m.add_property(k, v)
    return m


@contextmanager
def producer(endpoint: str, *topics: str):
    p = Producer(config(endpoint), topics or None)
    p.startup()
    try:
        yield p
    finally:
        p.shutdown()


@contextmanager
def simple_consumer(endpoint: str, group: str, topic: str, await_s: int = AWAIT_S):
    c = SimpleConsumer(config(endpoint), group, {topic: FilterExpression("*")}, await_duration=await_s)
    c.startup()
    try:
        yield c
    finally:
        c.shutdown()


@contextmanager
def push_consumer(endpoint: str, group: str, topic: str, listener: MessageListener, threads: int = 4):
    c = PushConsumer(config(endpoint), group, listener, {topic: FilterExpression("*")},
                     consumption_thread_count=threads)
    c.startup()
    try:
        yield c
    finally:
        c.shutdown()


def receive_all(consumer: SimpleConsumer, count: int, invisible_s: int = 30, timeout_s: float = 15.0) -> list:
    got: list = []
    deadline = time.monotonic() + timeout_s
    while len(got) < count and time.monotonic() < deadline:
        got += consumer.receive(32, invisible_s)
    return got


class Recorder(MessageListener):
    """Records every delivery; fails the ones ``fail(message)`` says to fail."""

    def __init__(self, fail=lambda message: False, delay_s: float = 0.0, name: str = ""):
        self.fail = fail
        self.delay_s = delay_s
        self.name = name
        self.lock = threading.Lock()
        self.deliveries: list[tuple[float, str, bytes, int, str | None, str]] = []

    def consume(self, message) -> ConsumeResult:
        with self.lock:
            self.deliveries.append((time.monotonic(), message.message_id, message.body, message.delivery_attempt,
                                    message.message_group, self.name))
        if self.delay_s:
            time.sleep(self.delay_s)
        return ConsumeResult.FAILURE if self.fail(message) else ConsumeResult.SUCCESS

    def bodies(self) -> list[bytes]:
        with self.lock:
            return [d[2] for d in self.deliveries]


# ------------------------------------------------------------------------------------ producer
def test_producer_send_sync_async_and_fifo(chronoq_endpoint):
    topic = unique("prod")
    with producer(chronoq_endpoint, topic) as p:
        normal = make_message(topic, b"sync", tag="TagA", keys=("order-1",), props={"color": "red"})
        receipt = p.send(normal)
        assert receipt.message_id == normal.message_id  # the client's id is echoed
        assert receipt.offset >= 0
        async_receipts = [p.send_async(make_message(topic, b"async-%d" % i)).result(10) for i in range(5)]
        assert len({r.message_id for r in async_receipts}) == 5
        fifo = [p.send(make_message(topic, b"fifo-%d" % i, group="group-1")) for i in range(3)]
        # One message group always lands in one queue (the server picks it), in order.
        assert fifo[1].offset == fifo[0].offset + 1 and fifo[2].offset == fifo[1].offset + 1


def test_bad_input_is_answered_with_the_right_status(chronoq_endpoint):
    from rocketmq.v5.exception import BadRequestException

    topic = unique("badin")
    with producer(chronoq_endpoint, topic) as p:
        # A property key reserved for the broker passes the client's checks; the server refuses it.
        with pytest.raises(BadRequestException) as info:
            p.send(make_message(topic, b"x", props={"__GROUP": "mine"}))
        assert info.value.code == 40007  # ILLEGAL_MESSAGE_PROPERTY_KEY
        # A topic the client accepts (its regex has no length limit) but chronoq does not.
        with pytest.raises(Exception) as route_error:
            p.send(make_message("t" * 200, b"x"))
        assert "route" in str(route_error.value)
        # Oversized bodies: the limit the server announced (4 MiB) is enforced before the wire;
        # the server's own answer (MESSAGE_BODY_TOO_LARGE) is pinned in test_grpc_protocol.py.
        with pytest.raises(Exception) as too_big:
            p.send(make_message(topic, b"x" * (4 * 1024 * 1024 + 1)))
        assert "exceeds" in str(too_big.value) or "41301" in str(too_big.value)
        # The producer still works afterwards.
        assert p.send(make_message(topic, b"fine")).message_id


# ------------------------------------------------------------------------------------ simple consumer
def test_simple_consumer_receive_and_ack(chronoq_endpoint):
    topic, group = unique("simple"), unique("sgrp")
    with producer(chronoq_endpoint, topic) as p:
        sent = {p.send(make_message(topic, b"m%d" % i, tag="TagA", keys=("k%d" % i,),
                                    props={"n": str(i)})).message_id: i for i in range(10)}
    with simple_consumer(chronoq_endpoint, group, topic) as c:
        got = receive_all(c, 10)
        assert sorted(m.message_id for m in got) == sorted(sent)
        for m in got:
            i = sent[m.message_id]
            assert m.body == b"m%d" % i and m.topic == topic and m.tag == "TagA"
            assert m.keys == {"k%d" % i} and m.properties == {"n": str(i)}
            assert m.delivery_attempt == 1 and not m.corrupted and m.born_timestamp > 0
            c.ack(m)
        start = time.monotonic()
        assert c.receive(32, 30) == []  # acked: nothing comes back, after one long poll
        assert time.monotonic() - start >= AWAIT_S - 0.5


def test_unacked_message_is_redelivered_with_a_higher_attempt(chronoq_endpoint):
    topic, group = unique("redeliver"), unique("rgrp")
    with producer(chronoq_endpoint, topic) as p:
        mid = p.send(make_message(topic, b"again")).message_id
    with simple_consumer(chronoq_endpoint, group, topic) as c:
        first = receive_all(c, 1, invisible_s=2)
        assert [m.message_id for m in first] == [mid] and first[0].delivery_attempt == 1
        t0 = time.monotonic()
        second = receive_all(c, 1, invisible_s=30, timeout_s=10)
        assert [m.message_id for m in second] == [mid]
        assert second[0].delivery_attempt == 2
        assert time.monotonic() - t0 < 8
        c.ack(second[0])
        with pytest.raises(Exception):  # the first handle is stale now
            c.ack(first[0])


def test_change_invisible_duration(chronoq_endpoint):
    topic, group = unique("cid"), unique("cgrp")
    with producer(chronoq_endpoint, topic) as p:
        p.send(make_message(topic, b"slow"))
        p.send(make_message(topic, b"later"))
    with simple_consumer(chronoq_endpoint, group, topic) as c:
        msgs = {m.body: m for m in receive_all(c, 2, invisible_s=30)}
        assert set(msgs) == {b"slow", b"later"}
        # Extend: the handle is replaced, and the ack with the new one works.
        old_handle = msgs[b"slow"].receipt_handle
        c.change_invisible_duration(msgs[b"slow"], 60)
        assert msgs[b"slow"].receipt_handle != old_handle
        c.ack(msgs[b"slow"])
        # Shorten: back after about a second, with the next attempt number.
        c.change_invisible_duration(msgs[b"later"], 1)
        again = receive_all(c, 1, timeout_s=10)
        assert [(m.body, m.delivery_attempt) for m in again] == [(b"later", 2)]
        c.ack(again[0])


# ------------------------------------------------------------------------------------ push consumer
def test_push_consumer_consumes_and_failed_messages_come_back_with_backoff(chronoq_endpoint):
    topic, group = unique("push"), unique("pgrp")
    failed_once: set[str] = set()

    def fail_first_time(message) -> bool:
        if message.body == b"fail-once" and message.message_id not in failed_once:
            failed_once.add(message.message_id)
            return True
        return False

    listener = Recorder(fail_first_time)
    with push_consumer(chronoq_endpoint, group, topic, listener):
        with producer(chronoq_endpoint, topic) as p:
            for body in (b"p1", b"p2", b"fail-once", b"p3"):
                p.send(make_message(topic, body))
        wait_until(lambda: listener.bodies().count(b"fail-once") >= 2, 20, what="the failed message to come back")
        wait_until(lambda: {b"p1", b"p2", b"p3"} <= set(listener.bodies()), 10, what="all messages")
    with listener.lock:
        retried = [d for d in listener.deliveries if d[2] == b"fail-once"]
    assert [d[3] for d in retried[:2]] == [1, 2]  # delivery_attempt counts up
    assert retried[1][0] - retried[0][0] >= 0.8   # back-off: the first retry delay is 1 s
    assert sorted(listener.bodies()).count(b"p1") == 1


def test_push_consumer_fifo_keeps_order_per_group_under_two_consumers(chronoq_endpoint):
    topic, group = unique("fifo"), "fifo-order"  # configured fifo = true
    recorders = [Recorder(delay_s=0.02, name="a"), Recorder(delay_s=0.02, name="b")]
    groups = [f"g{i}" for i in range(6)]
    per_group = 8
    with producer(chronoq_endpoint, topic) as p:
        with push_consumer(chronoq_endpoint, group, topic, recorders[0]) as first, \
                push_consumer(chronoq_endpoint, group, topic, recorders[1]) as second:
            assert first.fifo and second.fifo
            time.sleep(2.5)  # both have scanned their assignments and are polling
            for seq in range(per_group):
                for g in groups:
                    p.send(make_message(topic, f"{g}:{seq}".encode(), group=g))
                time.sleep(0.03)  # messages keep arriving while earlier ones are consumed

            def done():
                return sum(len(r.bodies()) for r in recorders) >= len(groups) * per_group

            wait_until(done, 40, what="every FIFO message")
    deliveries = sorted(d for r in recorders for d in r.deliveries)
    seen = defaultdict(list)
    for _, _, body, attempt, message_group, _ in deliveries:
        g, seq = body.decode().split(":")
        assert message_group == g
        seen[g].append(int(seq))
    shares = {r.name: len(r.deliveries) for r in recorders}
    for g in groups:
        assert seen[g] == list(range(per_group)), f"group {g} out of order: {seen[g]} (shares {shares})"
    assert all(shares.values()), f"both consumers should have had a share: {shares}"


def receive_dlq(endpoint: str, group: str, count: int, timeout_s: float) -> list:
    """Read (and ack) ``count`` messages of ``%DLQ%<group>``. The DLQ topic exists only once a
    message has died, so until then the route lookups fail: retry until the deadline."""
    got: list = []
    deadline = time.monotonic() + timeout_s
    with simple_consumer(endpoint, unique("dlq-reader"), "%DLQ%" + group) as reader:
        while len(got) < count and time.monotonic() < deadline:
            try:
                batch = reader.receive(32, 30)
            except Exception:  # noqa: BLE001 - "failed to fetch topic route" until the DLQ exists
                time.sleep(0.5)
                continue
            for m in batch:
                reader.ack(m)
            got += batch
    return got


def test_messages_go_to_the_dlq_after_max_attempts(chronoq_endpoint):
    topic, group = unique("dlq"), "dlq-concurrent"  # configured max_attempts = 2
    listener = Recorder(lambda m: m.body == b"poison")
    with push_consumer(chronoq_endpoint, group, topic, listener):
        with producer(chronoq_endpoint, topic) as p:
            poison = p.send(make_message(topic, b"poison")).message_id
            p.send(make_message(topic, b"good"))
        wait_until(lambda: listener.bodies().count(b"poison") >= 2 and b"good" in listener.bodies(), 20,
                   what="two deliveries of the poison message")
        dead = receive_dlq(chronoq_endpoint, group, 1, 30)
        assert [(m.body, m.message_id) for m in dead] == [(b"poison", poison)]
        time.sleep(1)
        # Dead, not retried: exactly max_attempts deliveries.
        assert listener.bodies().count(b"poison") == 2
        assert [d[3] for d in listener.deliveries if d[2] == b"poison"] == [1, 2]


def test_fifo_consumer_forwards_to_the_dlq_and_moves_on(chronoq_endpoint):
    topic, group = unique("fifodlq"), "fifo-dlq"  # configured fifo = true, max_attempts = 2
    listener = Recorder(lambda m: m.body == b"f-bad")
    with push_consumer(chronoq_endpoint, group, topic, listener):
        with producer(chronoq_endpoint, topic) as p:
            for body in (b"f-1", b"f-bad", b"f-3"):
                p.send(make_message(topic, body, group="only-group"))
        wait_until(lambda: b"f-3" in listener.bodies(), 30, what="the message after the poisoned one")
    bodies = listener.bodies()
    assert bodies.index(b"f-1") < bodies.index(b"f-bad") < bodies.index(b"f-3")
    assert bodies.count(b"f-bad") == 2  # retried locally up to max_attempts, then forwarded
    dead = receive_dlq(chronoq_endpoint, group, 1, 15)
    assert [m.body for m in dead] == [b"f-bad"]


def test_the_grpcio_server_still_serves_the_official_client(chronoq_process):
    """``grpc_server = "grpcio"`` (grpc.aio's server, kept for comparison) serves the same calls."""
    proc = chronoq_process('grpc_server = "grpcio"\n')
    topic, group = unique("grpcio"), unique("ggrp")
    with producer(proc.endpoint, topic) as p:
        sent = {p.send(make_message(topic, b"g%d" % i)).message_id for i in range(5)}
    with simple_consumer(proc.endpoint, group, topic) as c:
        got = receive_all(c, 5)
        assert {m.message_id for m in got} == sent
        for m in got:
            c.ack(m)
