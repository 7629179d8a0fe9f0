"""POP retry back-off follows the broker's delay-level table (``timer_delay_levels``).

Attempt n waits level min(n, levels), measured from the failed delivery; the retry topic has
1 + levels queues (queue k: level k) and grows, never shrinks, when a restart brings another
table. Driven by a FakeClock; nothing sleeps.
"""

from __future__ import annotations

import pytest
from popkit import Node
from rocketmq.grpc_protocol import definition_pb2 as pb

from chronoq.pop import names
from chronoq.pop.service import PopService
from chronoq.features.transactions import Transactions
from chronoq.server.messaging.clients import TelemetrySession
from chronoq.server.messaging.service import MessagingService

G = "grp"
T = "orders"
RETRY = names.retry_topic(G, T)
# The default timer_delay_levels, spelled out: POP's back-off must not drift from it.
DEFAULT_MS = (1_000, 5_000, 10_000, 30_000, 60_000, 120_000, 180_000, 240_000, 300_000, 360_000,
              420_000, 480_000, 540_000, 600_000, 1_200_000, 1_800_000, 3_600_000, 7_200_000)


def open_node(tmp_path, **config) -> Node:
    return Node(str(tmp_path), config=config).open()


@pytest.fixture
def nodes():
    opened: list[Node] = []
    yield opened
    for n in opened:
        if n.pop is not None and not n.pop.closed:
            n.close()


def receive(node, invisible_ms=1_000):
    return node.pop.receive(G, T, max_messages=32, invisible_ms=invisible_ms)


def copies(node):
    """(queue id, attempt, __NOT_BEFORE_MS) of every retry copy, in queue order."""
    out = []
    for qid in range(node.broker.topics[RETRY].queues):
        for m in node.broker.read(RETRY, qid, 0, 100).messages:
            nb = m.properties.get(names.PROP_NOT_BEFORE_MS)
            out.append((qid, int(m.properties[names.PROP_RECONSUME_TIMES]), None if nb is None else int(nb)))
    return out


def nack_now(node, mid, attempt) -> int:
    """Hand out ``mid`` (delivery ``attempt``) and nack it at once; returns when."""
    [p] = receive(node)
    assert p.message.message_id == mid and p.delivery_attempt == attempt
    nacked = node.clock.wall_ms()
    node.pop.change_invisible(G, T, p.receipt_handle, 0)  # its invisible time ends now
    node.advance(0)  # revived into the retry topic
    return nacked


def nack_and_wait(node, mid, attempt, wait_ms):
    """Hand out ``mid`` (delivery ``attempt``), nack it at once, and check it is handed out again
    exactly ``wait_ms`` later: not a millisecond sooner."""
    nacked = nack_now(node, mid, attempt)
    assert receive(node) == []
    assert node.pop.next_deadline_ms() == nacked + wait_ms
    node.advance(wait_ms - 1)
    assert receive(node) == []
    node.advance(1)
    return nacked


def test_nacked_message_backs_off_by_the_configured_levels_then_the_last_one(tmp_path, nodes):
    node = open_node(tmp_path, timer_delay_levels="2s 4s")
    nodes.append(node)
    assert node.pop.retry_delays_ms == (2_000, 4_000)
    assert node.pop.group(G).retry_delays_ms == (2_000, 4_000)  # also what a client's settings say
    mid = node.broker.send(T, b"x").message_id
    t1 = nack_and_wait(node, mid, 1, 2_000)
    t2 = nack_and_wait(node, mid, 2, 4_000)
    t3 = nack_and_wait(node, mid, 3, 4_000)  # past the table's end: its last level again
    [p] = receive(node)
    assert p.message.message_id == mid and p.delivery_attempt == 4
    node.pop.ack(G, T, p.receipt_handle)
    # One queue per level plus "due at once"; attempt 3 waits level 2, so it shares queue 2.
    assert node.broker.topics[RETRY].queues == 3
    assert copies(node) == [(1, 1, t1 + 2_000), (2, 2, t2 + 4_000), (2, 3, t3 + 4_000)]
    node.advance(60_000)
    assert receive(node) == []
    node.pop.check()


def test_a_nack_that_names_its_wait_is_due_at_its_end_with_no_back_off(tmp_path, nodes):
    """ChangeInvisibleDuration above 0 is the client's own wait (RocketMQ: a simple consumer's
    retry interval): due when it ends, even when the back-off's level would be longer; the flag
    is in the POP log, so a restart keeps it. A nack of 0 (no wait of its own) backs off."""
    node = open_node(tmp_path, timer_delay_levels="2s 4s")
    nodes.append(node)
    mid = node.broker.send(T, b"x").message_id
    for attempt in (1, 2, 3):
        [p] = receive(node)
        assert p.message.message_id == mid and p.delivery_attempt == attempt
        node.pop.change_invisible(G, T, p.receipt_handle, 1_000)  # levels 2 s, 4 s: shorter
        if attempt == 2:
            node.restart(clean=True)  # the flag survives a restart (the CK is logged with it)
        node.advance(999)
        assert receive(node) == []
        node.advance(1)
    [p] = receive(node)
    assert p.delivery_attempt == 4
    node.pop.change_invisible(G, T, p.receipt_handle, 0)  # no wait of its own: level 2 (4 s)
    nacked = node.clock.wall_ms()
    node.advance(0)
    assert receive(node) == [] and node.pop.next_deadline_ms() == nacked + 4_000


def test_unacked_message_backs_off_from_its_delivery(tmp_path, nodes):
    """Left unacked: due at the level's delay after the delivery, and never before the
    invisible time ends (the wait is not added on top of the invisible time)."""
    node = open_node(tmp_path, timer_delay_levels="2s 4s")
    nodes.append(node)
    mid = node.broker.send(T, b"x").message_id
    expected = [(1_000, 2_000), (1_000, 4_000), (1_000, 4_000), (6_000, 6_000)]  # (invisible, due after)
    for attempt, (invisible_ms, due_ms) in enumerate(expected, start=1):
        [p] = receive(node, invisible_ms)
        assert p.message.message_id == mid and p.delivery_attempt == attempt
        delivered = node.clock.wall_ms()
        node.advance(due_ms - 1)  # invisible, then (if the level is longer) backing off
        assert receive(node) == []
        node.advance(1)
        assert node.clock.wall_ms() == delivered + due_ms
    [p] = receive(node)
    assert p.delivery_attempt == 5
    node.pop.ack(G, T, p.receipt_handle)


def test_default_table_is_rocketmqs_and_unchanged(tmp_path, nodes):
    node = open_node(tmp_path)
    nodes.append(node)
    assert node.pop.retry_delays_ms == DEFAULT_MS
    assert node.pop.group(G).retry_delays_ms == DEFAULT_MS
    mid = node.broker.send(T, b"x").message_id
    t1 = nack_and_wait(node, mid, 1, 1_000)
    t2 = nack_and_wait(node, mid, 2, 5_000)
    assert node.broker.topics[RETRY].queues == 19
    assert copies(node) == [(1, 1, t1 + 1_000), (2, 2, t2 + 5_000)]
    [p] = receive(node)
    node.pop.ack(G, T, p.receipt_handle)


def test_an_explicit_table_overrides_the_config(tmp_path, nodes):
    node = open_node(tmp_path, timer_delay_levels="2s 4s")
    nodes.append(node)
    pop = PopService(node.broker, node.clock, retry_delays_ms=[3_000])
    try:
        assert pop.retry_delays_ms == (3_000,) and pop.group("other").retry_delays_ms == (3_000,)
    finally:
        pop.abandon()


def test_restart_with_a_shorter_table_neither_loses_nor_hurries_a_waiting_copy(tmp_path, nodes):
    node = open_node(tmp_path)  # the default table: attempt 3 waits 10 s
    nodes.append(node)
    mid = node.broker.send(T, b"x").message_id
    nack_and_wait(node, mid, 1, 1_000)
    nack_and_wait(node, mid, 2, 5_000)
    t3 = nack_now(node, mid, 3)
    assert (3, 3, t3 + 10_000) in copies(node)
    node.config["timer_delay_levels"] = "2s 4s"  # level 3 no longer exists
    node.restart()  # kill -9
    assert node.pop.retry_delays_ms == (2_000, 4_000)
    assert node.broker.topics[RETRY].queues == 19  # never shrinks; queue 3 drains
    node.advance(9_999 - (node.clock.wall_ms() - t3))
    assert receive(node) == []  # its __NOT_BEFORE_MS is absolute: not early
    node.advance(1)
    t4 = nack_now(node, mid, 4)
    assert (2, 4, t4 + 4_000) in copies(node)  # the new table's last level and its queue
    node.advance(4_000)
    [p] = receive(node)
    assert p.message.message_id == mid and p.delivery_attempt == 5
    node.pop.ack(G, T, p.receipt_handle)
    node.advance(60_000)
    assert receive(node) == []


def test_restart_with_a_longer_table_grows_the_retry_topic(tmp_path, nodes):
    node = open_node(tmp_path, timer_delay_levels="1s 2s")
    nodes.append(node)
    mid = node.broker.send(T, b"x").message_id
    nack_and_wait(node, mid, 1, 1_000)
    nack_and_wait(node, mid, 2, 2_000)
    t3 = nack_now(node, mid, 3)
    assert node.broker.topics[RETRY].queues == 3
    assert (2, 3, t3 + 2_000) in copies(node)  # clamped to level 2
    node.config["timer_delay_levels"] = "1s 2s 3s 4s"
    node.restart()
    node.advance(1_999 - (node.clock.wall_ms() - t3))
    assert receive(node) == []
    node.advance(1)
    [p] = receive(node)
    assert p.message.message_id == mid and p.delivery_attempt == 4
    t4 = node.clock.wall_ms()
    node.pop.change_invisible(G, T, p.receipt_handle, 0)
    node.advance(0)
    assert node.broker.topics[RETRY].queues == 5  # grown for level 4, not clamped into queue 2
    assert (4, 4, t4 + 4_000) in copies(node)
    node.restart(clean=True)
    assert node.broker.topics[RETRY].queues == 5  # the growth is saved
    node.advance(4_000 - (node.clock.wall_ms() - t4))
    [p] = receive(node)
    assert p.message.message_id == mid and p.delivery_attempt == 5
    node.pop.ack(G, T, p.receipt_handle)


def test_max_queues_caps_the_retry_topic_and_later_levels_share_its_last_queue(tmp_path, nodes):
    node = open_node(tmp_path, timer_delay_levels="1s 2s 3s", max_queues=2)
    nodes.append(node)
    mid = node.broker.send(T, b"x").message_id
    nack_and_wait(node, mid, 1, 1_000)
    nack_and_wait(node, mid, 2, 2_000)
    nack_and_wait(node, mid, 3, 3_000)
    [p] = receive(node)
    node.pop.ack(G, T, p.receipt_handle)
    assert node.broker.topics[RETRY].queues == 2
    assert [(q, a) for q, a, _ in copies(node)] == [(1, 1), (1, 2), (1, 3)]


def test_consumer_settings_announce_the_configured_table(tmp_path, nodes):
    """The gRPC glue tells consumers the same back-off (customized_backoff, contract §3.3)."""
    node = open_node(tmp_path, timer_delay_levels="2s 4s 500ms")
    nodes.append(node)
    service = MessagingService(node.broker.config, node.broker, None, node.pop, Transactions(node.broker))
    settings = pb.Settings(client_type=pb.SIMPLE_CONSUMER, subscription=pb.Subscription(group=pb.Resource(name=G)))
    out = service._merged_settings(settings, TelemetrySession("client-1", None))
    assert out.backoff_policy.WhichOneof("strategy") == "customized_backoff"
    assert [d.ToMilliseconds() for d in out.backoff_policy.customized_backoff.next] == [2_000, 4_000, 500]


def test_a_named_nack_survives_kill_9(tmp_path, nodes):
    """The NAMED flag is in the POP log's CK record: after a kill -9 (the successor CK logged
    and fsynced, nothing else saved) the nacked message is still due at the end of its own wait,
    not at the back-off level's."""
    node = open_node(tmp_path, timer_delay_levels="10s 20s")
    nodes.append(node)
    mid = node.broker.send(T, b"x").message_id
    [p] = receive(node, 30_000)
    node.advance(2_500)  # the CK's lineage is past the merge buffer: logged, and so its successor
    node.pop.change_invisible(G, T, p.receipt_handle, 3_000)  # level 1 is 10 s: shorter
    nacked = node.clock.wall_ms()
    node.advance(200)  # the POP log's flush: the successor is durable
    node.crash()
    node.open()
    node.advance(nacked + 2_999 - node.clock.wall_ms())
    assert receive(node) == []
    node.advance(1)
    [p] = receive(node)
    assert p.message.message_id == mid and p.delivery_attempt == 2
