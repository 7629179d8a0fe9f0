"""Delayed (timer) messages with the unmodified official Python client.

The client's ``delivery_timestamp`` is epoch SECONDS (contract §5.3). Every delivered message is
checked against the broker clock: never before its due time.
"""

from __future__ import annotations

import time

import pytest
from rocketmq.v5.exception import BadRequestException

from .test_official_python_client import make_message, producer, receive_all, simple_consumer, unique


def test_delivery_timestamps_are_honoured_and_recall_cancels(chronoq_endpoint):
    topic, group = unique("delay"), unique("delay-g")
    now = int(time.time())
    plan = {b"d1": now + 2, b"d3": now + 3, b"d4": now + 4, b"recalled": now + 3}
    with producer(chronoq_endpoint, topic) as p, simple_consumer(chronoq_endpoint, group, topic) as c:
        receipts = {}
        for body, due in plan.items():
            m = make_message(topic, body)
            m.delivery_timestamp = due
            receipts[body] = p.send(m)
        assert all(r.recall_handle for r in receipts.values())
        assert p.recall_message(topic, receipts[b"recalled"].recall_handle) == receipts[b"recalled"].message_id
        got = receive_all(c, 3, timeout_s=15)
        for m in got:
            seen_ms = time.time() * 1000
            due_ms = plan[m.body] * 1000
            # the broker stamped it visible no earlier than due; the message carries its due time
            assert m.delivery_timestamp == due_ms
            assert seen_ms >= due_ms, (m.body, seen_ms - due_ms)
            c.ack(m)
        assert sorted(m.body for m in got) == [b"d1", b"d3", b"d4"]
        assert receive_all(c, 1, timeout_s=3) == []  # the recalled one never arrives
        # Recalling again is idempotent (still cancelled); a delivered one cannot be recalled.
        assert p.recall_message(topic, receipts[b"recalled"].recall_handle) == receipts[b"recalled"].message_id
        with pytest.raises(BadRequestException) as info:
            p.recall_message(topic, receipts[b"d1"].recall_handle)
        assert "already delivered" in str(info.value)
        with pytest.raises(BadRequestException):
            p.recall_message(topic, "not-a-handle")


def test_milliseconds_passed_as_seconds_get_a_clear_error(chronoq_endpoint):
    topic = unique("delay-ms")
    with producer(chronoq_endpoint, topic) as p:
        m = make_message(topic, b"oops")
        m.delivery_timestamp = int(time.time() * 1000) + 10_000  # ms, though the client wants seconds
        with pytest.raises(BadRequestException) as info:
            p.send(m)
        assert "seconds" in str(info.value)
