"""An ack repeated after its answer was lost: answered as done while the delivery's invisible time
lasts (RocketMQ's broker answers it OK), refused as stale after it, and never taken for another
group, topic or use of the handle (``chronoq.pop.recentacks``). Driven by a FakeClock."""

from __future__ import annotations

import pytest
from popkit import G, T, opened_node, send

from chronoq.core import errors
from chronoq.pop.recentacks import RecentAcks


@pytest.fixture
def node(tmp_path):
    yield from opened_node(tmp_path)


def test_a_repeated_ack_is_done_until_the_invisible_time_ends(node):
    send(node, 3)
    got = node.pop.receive(G, T, max_messages=32, invisible_ms=10_000)
    assert len(got) == 3
    first, second, third = (p.receipt_handle for p in got)
    node.pop.ack(G, T, first)
    node.pop.ack(G, T, first)  # the answer was lost; the client acks again: done
    assert node.pop.ack_many(G, T, [first, second, second]) == [None, None, None]
    acked = node.pop.counters.acked[(G, T)]
    assert acked == 2  # each delivery counted once
    node.advance(10_001)  # the invisible time is over: the handle has expired, as in RocketMQ
    with pytest.raises(errors.InvalidReceiptHandle):
        node.pop.ack(G, T, first)
    assert isinstance(node.pop.ack_many(G, T, [second])[0], errors.InvalidReceiptHandle)
    # The one never acked came back after its invisible time, with a higher attempt.
    again = node.pop.receive(G, T, max_messages=32, invisible_ms=10_000)
    assert [p.delivery_attempt for p in again] == [2] and again[0].message.message_id == got[2].message.message_id
    with pytest.raises(errors.InvalidReceiptHandle):  # its old handle is stale, not "acked"
        node.pop.ack(G, T, third)
    node.pop.ack(G, T, again[0].receipt_handle)
    node.pop.check()
    assert node.pop.lag(G, T) == 0


def test_an_acked_handle_is_not_taken_for_another_group_or_use(node):
    send(node, 1)
    node.pop.group("other")  # (another group, with its own deliveries)
    p = node.pop.receive(G, T, max_messages=1, invisible_ms=10_000)[0]
    node.pop.ack(G, T, p.receipt_handle)
    with pytest.raises(errors.InvalidReceiptHandle):
        node.pop.ack("other", T, p.receipt_handle)
    with pytest.raises(errors.InvalidReceiptHandle):
        node.pop.change_invisible(G, T, p.receipt_handle, 1_000)  # acked: nothing to make invisible


def test_a_handle_replaced_by_change_invisible_is_stale_not_acked(node):
    send(node, 1)
    p = node.pop.receive(G, T, max_messages=1, invisible_ms=10_000)[0]
    new = node.pop.change_invisible(G, T, p.receipt_handle, 10_000)
    with pytest.raises(errors.InvalidReceiptHandle):
        node.pop.ack(G, T, p.receipt_handle)
    node.pop.ack(G, T, new)
    node.pop.ack(G, T, new)


def test_the_memory_is_bounded_oldest_first():
    recent = RecentAcks(limit=3)
    for ck in range(5):
        recent.add(ck, 0, G, T, 1_000)
    assert len(recent) == 3
    assert [recent.repeated(ck, 0, G, T, 0) for ck in range(5)] == [False, False, True, True, True]
    assert not recent.repeated(4, 1, G, T, 0) and not recent.repeated(4, 0, G, "x", 0)
    assert not recent.repeated(4, 0, G, T, 1_000)  # at its deadline: over
    off = RecentAcks(limit=0)
    off.add(1, 0, G, T, 1_000)
    assert len(off) == 0 and not off.repeated(1, 0, G, T, 0)
