"""PopService behaviour: receive/ack, revive into the retry topic, stale handles, DLQ, FIFO,
attempt ids, filters, validation, limits (restart and crashes: test_pop_restart.py). Driven by a
FakeClock; nothing sleeps."""

from __future__ import annotations

import pytest
from popkit import G, T, Node, drain, opened_node, send

from chronoq.core import errors
from chronoq.broker.broker import OutgoingMessage
from chronoq.pop import names


@pytest.fixture
def node(tmp_path):
    yield from opened_node(tmp_path)


# --------------------------------------------------------------------------------- basics
def test_receive_then_ack_consumes_everything_once(node):
    ids = send(node, 10)
    got = node.pop.receive(G, T, max_messages=32, invisible_ms=10_000)
    assert sorted(p.message.message_id for p in got) == sorted(ids)
    assert all(p.delivery_attempt == 1 for p in got)
    assert all(p.invisible_until_ms == node.clock.wall_ms() + 10_000 for p in got)
    assert all(p.receipt_handle.isascii() and p.receipt_handle.isprintable() for p in got)
    assert node.pop.receive(G, T, max_messages=32, invisible_ms=10_000) == []
    for p in got:
        node.pop.ack(G, T, p.receipt_handle)
    node.pop.check()
    node.advance(60_000)
    assert node.pop.receive(G, T, max_messages=32, invisible_ms=10_000) == []
    assert node.pop.lag(G, T) == 0
    # Every message is acked, so the consume offsets reached the end of every queue.
    for qid in range(2):
        assert node.broker.get_offset(G, T, qid) == node.broker.queue_bounds(T, qid)[1]


def test_ack_many_answers_per_handle_as_ack_would(node):
    send(node, 4)
    got = node.pop.receive(G, T, max_messages=32, invisible_ms=10_000)
    handles = [p.receipt_handle for p in got]
    # A bad name fails every handle and settles none.
    for group, topic in (("bad group!", T), (G, "bad topic!")):
        out = node.pop.ack_many(group, topic, handles[:2])
        assert len(out) == 2 and all(isinstance(e, errors.ClientError) for e in out)
    out = node.pop.ack_many(G, T, [handles[0], "bogus", handles[1], handles[0]])
    assert out[0] is None and out[2] is None and out[3] is None  # acked twice: done (test_pop_repeated_ack.py)
    assert isinstance(out[1], errors.InvalidReceiptHandle)  # malformed
    assert node.pop.ack_many(G, T, iter(handles[2:])) == [None, None]
    node.pop.check()
    assert node.pop.lag(G, T) == 0


def test_receive_serves_all_queues_and_respects_max(node):
    send(node, 6)
    first = node.pop.receive(G, T, max_messages=4, invisible_ms=10_000)
    assert len(first) == 4
    rest = node.pop.receive(G, T, max_messages=32, invisible_ms=10_000)
    assert len(rest) == 2
    assert {p.message.queue_id for p in first + rest} == {0, 1}
    assert len({p.message.message_id for p in first + rest}) == 6


def test_groups_are_independent(node):
    send(node, 3)
    a = drain(node, "ga")
    b = drain(node, "gb")
    assert len(a) == len(b) == 3
    assert node.pop.lag("ga", T) == node.pop.lag("gb", T) == 0
    send(node, 2)
    assert node.pop.lag("ga", T) == 2


# --------------------------------------------------------------------------------- revive
def test_a_revive_waits_for_its_copies_fsync_and_its_handles_are_stale_meanwhile(node):
    """``tick`` returns the retry copy as an effect; until the shell reports it durable the CK is
    neither dropped nor ackable; a failed fsync postpones the revive, which then happens once."""
    from chronoq.core import errors
    from chronoq.pop.revive import REVIVE_RETRY_MS

    [mid] = send(node, 1)
    [p1] = node.pop.receive(G, T, max_messages=1, invisible_ms=5_000)
    node.clock.advance(5_000)
    effects = node.pop.tick()
    assert effects.handled == 0 and len(effects.revival.copies) == 1
    assert node.pop.write_copies(effects)
    with pytest.raises(errors.InvalidReceiptHandle):
        node.pop.ack(G, T, p1.receipt_handle)  # the copy is written: an ack could not stop it
    assert node.pop.inflight_count() == 1 and node.pop.tick().revival is None  # not revived twice
    assert node.pop.copies_durable(effects, errors.StorageError("fsync failed")) == 0
    node.clock.advance(REVIVE_RETRY_MS - 1)
    assert node.pop.tick_durably() == 0 and node.pop.inflight_count() == 1
    node.clock.advance(1)
    assert node.pop.tick_durably() == 1
    assert node.pop.inflight_count() == 0
    node.broker.flush()
    got = node.pop.receive(G, T, max_messages=4, invisible_ms=5_000)
    # The first copy was written before its fsync failed (page cache): at least once, maybe twice.
    assert {p.message.message_id for p in got} == {mid} and all(p.delivery_attempt == 2 for p in got)
    node.pop.check()


def test_no_ack_revives_into_retry_topic_with_attempt_two(node):
    [mid] = send(node, 1)
    [p1] = node.pop.receive(G, T, max_messages=1, invisible_ms=5_000)
    node.clock.advance(4_999)
    assert node.pop.tick_durably() == 0
    assert node.pop.receive(G, T, max_messages=1, invisible_ms=5_000) == []
    node.clock.advance(1)
    assert node.pop.next_deadline_ms() <= node.clock.wall_ms()
    assert node.pop.tick_durably() == 1
    retry = names.retry_topic(G, T)
    assert retry == f"%RETRY%{G}_{T}"
    assert node.broker.queue_bounds(retry, 0) == (0, 1)
    [p2] = node.pop.receive(G, T, max_messages=1, invisible_ms=5_000)
    assert p2.message.message_id == mid and p2.message.topic == T and p2.message.body == b"m0"
    assert p2.delivery_attempt == 2
    assert not any(k.startswith("__ORIGIN") for k in p2.message.properties)
    # The retry copy carries the origin and the attempt count in reserved properties.
    stored = node.broker.read(retry, 0, 0, 1).messages[0]
    assert stored.properties[names.PROP_ORIGIN_TOPIC] == T
    assert stored.properties[names.PROP_ORIGIN_MESSAGE_ID] == mid
    assert stored.properties[names.PROP_RECONSUME_TIMES] == "1"
    with pytest.raises(errors.InvalidReceiptHandle):
        node.pop.ack(G, T, p1.receipt_handle)  # stale after revive
    node.pop.ack(G, T, p2.receipt_handle)
    node.advance(60_000)
    assert drain(node) == []
    node.pop.check()


def test_a_tick_revives_a_bounded_number_of_messages_and_the_next_ticks_the_rest(node):
    # Every message is read and copied on the loop: 4,096 CKs of 32 in one tick held it ~1 s.
    from chronoq.pop.service import TICK_ENTRIES_MAX
    n = 3 * TICK_ENTRIES_MAX + 40
    node.broker.send_batch([OutgoingMessage(T, b"m%d" % i) for i in range(n)])
    assert len(drain(node, invisible_ms=5_000, ack=False)) == n
    node.clock.advance(4_999)
    assert node.pop.tick_durably() == 0  # never early
    node.clock.advance(1)
    handed = []
    while node.pop.next_deadline_ms() is not None and node.pop.next_deadline_ms() <= node.clock.wall_ms():
        handed.append(node.pop.tick_durably())
    assert sum(handed) == n and len(handed) == 4
    assert max(handed) <= TICK_ENTRIES_MAX + 31  # the budget, overshot by at most one CK's rest
    assert len(drain(node)) == n  # all come back, attempt two
    node.pop.check()


def test_back_off_delays_a_quick_failure(node):
    """A delivery that failed fast waits out the back-off (measured from the delivery)."""
    node.pop.group(G).retry_delays_ms = (1_000, 20_000)
    [mid] = send(node, 1)
    [p] = node.pop.receive(G, T, max_messages=1, invisible_ms=1_000)
    node.advance(1_000)  # attempt 1 failed: back-off 1 s from delivery, already over
    [p] = node.pop.receive(G, T, max_messages=1, invisible_ms=1_000)
    assert p.delivery_attempt == 2
    start = node.clock.wall_ms()
    node.pop.change_invisible(G, T, p.receipt_handle, 0)  # nack at once
    node.advance(0)
    assert node.pop.receive(G, T, max_messages=1, invisible_ms=1_000) == []
    deadline = node.pop.next_deadline_ms()
    assert deadline == start + 20_000  # the retry queue's head waits out the back-off
    node.advance(19_999)
    assert node.pop.receive(G, T, max_messages=1, invisible_ms=1_000) == []
    node.advance(1)
    [p] = node.pop.receive(G, T, max_messages=1, invisible_ms=1_000)
    assert p.message.message_id == mid and p.delivery_attempt == 3


def test_dead_letter_after_max_attempts(node):
    node.pop.set_group(G, max_attempts=3)
    node.pop.group(G).retry_delays_ms = (1_000,)
    [mid] = send(node, 1)
    attempts = []
    for _ in range(3):
        [p] = node.pop.receive(G, T, max_messages=1, invisible_ms=2_000)
        attempts.append(p.delivery_attempt)
        node.advance(2_000)
    assert attempts == [1, 2, 3]
    assert drain(node) == []
    dlq = names.dlq_topic(G)
    assert dlq == f"%DLQ%{G}"
    [m] = node.broker.read(dlq, 0, 0, 10).messages
    assert m.body == b"m0"
    assert m.properties[names.PROP_DLQ_ORIGIN_TOPIC] == T
    assert m.properties[names.PROP_DLQ_ORIGIN_MESSAGE_ID] == mid
    # Consuming the DLQ topic shows the origin (the shell fills dead_letter_queue from it).
    [d] = node.pop.receive("ops", dlq, max_messages=1, invisible_ms=5_000)
    assert d.message.topic == T and d.message.message_id == mid and d.delivery_attempt == 1
    node.pop.ack("ops", dlq, d.receipt_handle)


def test_retry_keeps_user_properties_at_the_limit(node):
    props = {f"k{i}": "v" for i in range(128)}
    node.broker.send(T, b"x", properties=props, tag="TagA", keys=["key1"])
    [p] = node.pop.receive(G, T, max_messages=1, invisible_ms=1_000)
    node.advance(1_000)
    [p] = node.pop.receive(G, T, max_messages=1, invisible_ms=1_000)
    assert p.delivery_attempt == 2
    assert p.message.properties == props and p.message.tag == "TagA" and p.message.keys == ("key1",)


# --------------------------------------------------------------------------------- handles
def test_change_invisible_issues_a_new_handle_and_fences_the_old(node):
    send(node, 1)
    [p] = node.pop.receive(G, T, max_messages=1, invisible_ms=5_000)
    new = node.pop.change_invisible(G, T, p.receipt_handle, 60_000)
    assert new != p.receipt_handle
    with pytest.raises(errors.InvalidReceiptHandle):
        node.pop.ack(G, T, p.receipt_handle)
    with pytest.raises(errors.InvalidReceiptHandle):
        node.pop.change_invisible(G, T, p.receipt_handle, 1_000)
    node.advance(10_000)  # the old invisible time passes: nothing is revived
    assert drain(node, ack=False) == []
    node.pop.ack(G, T, new)
    node.pop.ack(G, T, new)  # already acked: done again (test_pop_repeated_ack.py)
    with pytest.raises(errors.InvalidReceiptHandle):
        node.pop.change_invisible(G, T, new, 1_000)  # but nothing left to make invisible
    node.advance(120_000)
    assert drain(node) == []


def test_change_invisible_keeps_the_attempt_and_zero_makes_it_due(node):
    send(node, 1)
    [p] = node.pop.receive(G, T, max_messages=1, invisible_ms=60_000)
    h = node.pop.change_invisible(G, T, p.receipt_handle, 30_000)
    node.clock.advance(2_000)
    h = node.pop.change_invisible(G, T, h, 0)
    assert node.pop.next_deadline_ms() == node.clock.wall_ms()
    node.advance(0)
    with pytest.raises(errors.InvalidReceiptHandle):
        node.pop.ack(G, T, h)
    [p2] = node.pop.receive(G, T, max_messages=1, invisible_ms=5_000)
    assert p2.delivery_attempt == 2


@pytest.mark.parametrize("bad", ["", "x", "zz" * 24, "00" * 24, 42, None, "0" * 47 + "g"])
def test_malformed_handles_are_rejected(node, bad):
    with pytest.raises(errors.InvalidReceiptHandle):
        node.pop.ack(G, T, bad)
    with pytest.raises(errors.InvalidReceiptHandle):
        node.pop.change_invisible(G, T, bad, 1_000)
    with pytest.raises(errors.InvalidReceiptHandle):
        node.pop.forward_to_dlq(G, T, bad)


def test_handle_is_bound_to_its_group_and_topic(node):
    send(node, 1)
    node.broker.create_topic("other")
    [p] = node.pop.receive(G, T, max_messages=1, invisible_ms=5_000)
    with pytest.raises(errors.InvalidReceiptHandle):
        node.pop.ack("another", T, p.receipt_handle)
    with pytest.raises(errors.InvalidReceiptHandle):
        node.pop.ack(G, "other", p.receipt_handle)
    tampered = p.receipt_handle[:-1] + ("0" if p.receipt_handle[-1] != "0" else "1")
    with pytest.raises(errors.InvalidReceiptHandle):
        node.pop.ack(G, T, tampered)
    node.pop.ack(G, T, p.receipt_handle)


# --------------------------------------------------------------------------------- validation
@pytest.mark.parametrize("kwargs, exc", [
    ({"max_messages": 0}, errors.ClientError),
    ({"max_messages": 33}, errors.ClientError),
    ({"max_messages": True}, errors.ClientError),
    ({"invisible_ms": 999}, errors.InvalidInvisibleTime),
    ({"invisible_ms": 12 * 3600 * 1000 + 1}, errors.InvalidInvisibleTime),
    ({"invisible_ms": 1.5e3}, errors.InvalidInvisibleTime),
    ({"tag_filter": "||"}, errors.InvalidFilter),
    ({"tag_filter": "A | B"}, errors.InvalidFilter),
    ({"tag_filter": "a\x01"}, errors.InvalidFilter),
    ({"tag_filter": None}, errors.InvalidFilter),
])
def test_receive_validation(node, kwargs, exc):
    args = {"max_messages": 1, "invisible_ms": 10_000, **kwargs}
    with pytest.raises(exc):
        node.pop.receive(G, T, **args)


def test_names_are_validated(node):
    with pytest.raises(errors.InvalidGroup):
        node.pop.receive("bad group", T, max_messages=1, invisible_ms=10_000)
    with pytest.raises(errors.InvalidGroup):
        node.pop.receive("CHRONOQ_internal", T, max_messages=1, invisible_ms=10_000)
    with pytest.raises(errors.InvalidTopic):
        node.pop.receive(G, "bad topic", max_messages=1, invisible_ms=10_000)
    with pytest.raises(errors.TopicNotFound):
        node.pop.receive(G, "%DLQ%nobody", max_messages=1, invisible_ms=10_000)
    with pytest.raises(errors.InvalidGroup):
        node.pop.ack("bad group", T, "00" * 24)
    with pytest.raises(errors.InvalidInvisibleTime):
        node.pop.change_invisible(G, T, "00" * 24, -1)
    with pytest.raises(errors.ClientError):
        node.pop.set_group(G, max_attempts=0)
    with pytest.raises(errors.ClientError):
        node.pop.set_group(G, fifo="yes")


def test_change_invisible_accepts_zero_and_twelve_hours(node):
    send(node, 2)
    a, b = node.pop.receive(G, T, max_messages=2, invisible_ms=1_000)
    node.pop.change_invisible(G, T, a.receipt_handle, 0)
    node.pop.change_invisible(G, T, b.receipt_handle, 12 * 3600 * 1000)
    with pytest.raises(errors.InvalidInvisibleTime):
        node.pop.change_invisible(G, T, b.receipt_handle, 12 * 3600 * 1000 + 1)


# --------------------------------------------------------------------------------- filters
def test_tag_filters(node):
    for tag in ["A", "B", "C", "", "A"]:
        node.broker.send(T, tag.encode() or b"none", tag=tag)
    got = drain(node, "ga", tag_filter="A")
    assert sorted(p.message.tag for p in got) == ["A", "A"]
    got = drain(node, "gab", tag_filter=" A || B ")
    assert sorted(p.message.tag for p in got) == ["A", "A", "B"]
    got = drain(node, "gall", tag_filter="*")
    assert len(got) == 5
    # Filtered-out messages count as consumed for that group: nothing is left behind.
    assert node.pop.lag("ga", T) == 0


def test_filter_scans_past_many_rejected_messages(node):
    node.broker.send_batch([OutgoingMessage(T, b"x", tag="B", queue_id=0) for _ in range(300)])
    node.broker.send(T, b"wanted", tag="A", queue_id=0)
    got = node.pop.receive(G, T, max_messages=32, invisible_ms=10_000, tag_filter="A")
    assert [p.message.body for p in got] == [b"wanted"]


# --------------------------------------------------------------------------------- FIFO
def test_fifo_group_order_under_two_consumers(node):
    node.pop.set_group(G, fifo=True)
    ids = send(node, 4, group="order-1")
    [a1] = node.pop.receive(G, T, max_messages=1, invisible_ms=10_000, client_id="A")
    assert a1.message.message_id == ids[0] and a1.message_group == "order-1"
    # Consumer B may not get the next message of the group while the first is in flight.
    assert node.pop.receive(G, T, max_messages=32, invisible_ms=10_000, client_id="B") == []
    node.pop.ack(G, T, a1.receipt_handle)
    [b2] = node.pop.receive(G, T, max_messages=1, invisible_ms=10_000, client_id="B")
    assert b2.message.message_id == ids[1]
    # B fails to ack: after the invisible time the same message comes back first, attempt 2.
    node.advance(10_000)
    [a2] = node.pop.receive(G, T, max_messages=1, invisible_ms=10_000, client_id="A")
    assert a2.message.message_id == ids[1] and a2.delivery_attempt == 2
    assert a2.message.queue_offset == b2.message.queue_offset
    assert not node.broker.topics.get(names.retry_topic(G, T))  # FIFO never uses the retry topic
    node.pop.ack(G, T, a2.receipt_handle)
    rest = node.pop.receive(G, T, max_messages=32, invisible_ms=10_000, client_id="B")
    assert [p.message.message_id for p in rest] == ids[2:]
    assert [p.delivery_attempt for p in rest] == [1, 1]
    node.pop.check()


def test_fifo_partial_ack_then_expiry_keeps_order(node):
    node.pop.set_group(G, fifo=True)
    ids = send(node, 3, group="g")
    batch = node.pop.receive(G, T, max_messages=32, invisible_ms=5_000)
    assert [p.message.message_id for p in batch] == ids
    node.pop.ack(G, T, batch[0].receipt_handle)
    node.pop.change_invisible(G, T, batch[2].receipt_handle, 20_000)
    node.advance(5_000)  # batch[1] expired, batch[2] still invisible: the queue stays blocked
    assert node.pop.receive(G, T, max_messages=32, invisible_ms=5_000) == []
    node.advance(15_000)
    again = node.pop.receive(G, T, max_messages=32, invisible_ms=5_000)
    assert [p.message.message_id for p in again] == ids[1:]
    assert [p.delivery_attempt for p in again] == [2, 2]


def test_fifo_forward_to_dlq_unblocks_the_group(node):
    node.pop.set_group(G, fifo=True)
    ids = send(node, 2, group="g")
    [p] = node.pop.receive(G, T, max_messages=1, invisible_ms=10_000)
    assert node.pop.receive(G, T, max_messages=1, invisible_ms=10_000) == []
    node.pop.forward_to_dlq(G, T, p.receipt_handle)
    with pytest.raises(errors.InvalidReceiptHandle):
        node.pop.ack(G, T, p.receipt_handle)
    [m] = node.broker.read(names.dlq_topic(G), 0, 0, 10).messages
    assert m.properties[names.PROP_DLQ_ORIGIN_MESSAGE_ID] == ids[0]
    [q] = node.pop.receive(G, T, max_messages=1, invisible_ms=10_000)
    assert q.message.message_id == ids[1]


def test_fifo_dead_letters_after_max_attempts(node):
    node.pop.set_group(G, fifo=True, max_attempts=2)
    ids = send(node, 2, group="g")
    [p] = node.pop.receive(G, T, max_messages=1, invisible_ms=1_000)
    node.advance(1_000)
    [p] = node.pop.receive(G, T, max_messages=1, invisible_ms=1_000)
    assert p.message.message_id == ids[0] and p.delivery_attempt == 2
    node.advance(1_000)
    [q] = node.pop.receive(G, T, max_messages=1, invisible_ms=1_000)
    assert q.message.message_id == ids[1]
    assert len(node.broker.read(names.dlq_topic(G), 0, 0, 10).messages) == 1


def test_attempt_id_returns_the_same_batch(node):
    node.pop.set_group(G, fifo=True)
    send(node, 3, group="g")
    first = node.pop.receive(G, T, max_messages=32, invisible_ms=10_000, attempt_id="att-1", client_id="c")
    again = node.pop.receive(G, T, max_messages=32, invisible_ms=10_000, attempt_id="att-1", client_id="c")
    assert [p.receipt_handle for p in again] == [p.receipt_handle for p in first]
    assert node.pop.receive(G, T, max_messages=32, invisible_ms=10_000, attempt_id="att-2", client_id="c") == []
    node.pop.ack(G, T, first[0].receipt_handle)
    again = node.pop.receive(G, T, max_messages=32, invisible_ms=10_000, attempt_id="att-1", client_id="c")
    assert [p.receipt_handle for p in again] == [p.receipt_handle for p in first[1:]]
    node.advance(10_000)  # no longer in flight: a fresh receive (the redelivery)
    again = node.pop.receive(G, T, max_messages=32, invisible_ms=10_000, attempt_id="att-1", client_id="c")
    assert [p.delivery_attempt for p in again] == [2, 2]


def test_groups_stop_at_max_groups_and_an_ack_creates_none(tmp_path):
    node = Node(str(tmp_path), config={"max_groups": 2}).open()
    try:
        send(node, 2)
        node.pop.receive("g1", T, max_messages=1, invisible_ms=5_000)
        node.pop.receive("g2", T, max_messages=1, invisible_ms=5_000)
        with pytest.raises(errors.GroupNotFound, match=r"max_groups \(2\)"):
            node.pop.receive("g3", T, max_messages=1, invisible_ms=5_000)
        with pytest.raises(errors.ClientError, match="max_groups"):
            node.pop.set_group("g3", fifo=True)
        assert not node.pop.is_fifo("g4")  # an ack's look at a group it does not know creates none
        assert [g.name for g in node.pop.list_groups()] == ["g1", "g2"]
        node.pop.set_group("g1", max_attempts=3)  # existing ones still change and receive
        assert node.pop.receive("g1", T, max_messages=1, invisible_ms=5_000)
    finally:
        node.close()


def test_group_topic_pairs_stop_at_max_subscriptions_before_anything_is_handed_out(tmp_path):
    node = Node(str(tmp_path), config={"max_subscriptions": 2}).open()
    try:
        for topic in ("t1", "t2"):
            node.broker.send(topic, b"x")
        assert node.pop.receive("g1", "t1", max_messages=1, invisible_ms=5_000)
        assert node.pop.receive("g1", "t2", max_messages=1, invisible_ms=5_000)
        with pytest.raises(errors.ClientError, match=r"max_subscriptions \(2\)"):
            node.pop.receive("g2", "t1", max_messages=1, invisible_ms=5_000)
        assert node.pop.receive("g1", "t1", max_messages=1, invisible_ms=5_000) == []  # a known pair goes on
        node.config["max_subscriptions"] = 1
        node.restart(clean=True)  # the POP log's pairs come back whatever the limit
        assert sorted(node.pop._inflight.pairs) == [("g1", "t1"), ("g1", "t2")]
        node.advance(6_000)  # both revived: their retry topics now exist
        with pytest.raises(errors.ClientError, match="max_subscriptions"):
            node.pop.receive("g1", "t1", max_messages=1, invisible_ms=5_000)  # its retry topic would be a third pair
    finally:
        node.close()
