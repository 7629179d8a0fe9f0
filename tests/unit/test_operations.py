"""Day-two operations over a real Broker + PopService (``chronoq.features.operations`` and
``.deadletters``): reset-offset, topic and group delete, dead-letter resend, and the type change
refused on a topic that holds messages. Crashes are ``popkit.Node.crash`` (what kill -9 leaves)."""

from __future__ import annotations

import pytest
from popkit import Node

from chronoq.core import errors
from chronoq.features import catalog, deadletters, operations
from chronoq.pop import names

INVISIBLE_MS = 10_000


@pytest.fixture
def node(tmp_path):
    n = Node(str(tmp_path), queues=1).open()
    yield n
    if n.pop is not None and not n.pop.closed:
        n.close()


def send(node, topic: str, count: int, step_ms: int = 0) -> list[str]:
    ids = []
    for i in range(count):
        ids.append(node.broker.send(topic, f"m{i}".encode()).message_id)
        node.clock.advance(step_ms)
    node.broker.flush()
    return ids


def receive(node, group: str, topic: str, ack: bool = True, max_messages: int = 32) -> list[str]:
    got = node.pop.receive(group, topic, max_messages=max_messages, invisible_ms=INVISIBLE_MS)
    if ack:
        for p in got:
            node.pop.ack(group, topic, p.receipt_handle)
    return [p.message.message_id for p in got]


# ----------------------------------------------------------------------------- reset-offset
def receive_logged(node, group: str, topic: str) -> list[str]:
    """Receive and ack once the CKs are in the POP log (acked within ``buffer_ms`` they never
    are): a restart then knows their offsets as handed out already (the skip set)."""
    got = node.pop.receive(group, topic, max_messages=32, invisible_ms=INVISIBLE_MS)
    node.advance(3_000)
    for p in got:
        node.pop.ack(group, topic, p.receipt_handle)
    node.advance(1_000)
    return [p.message.message_id for p in got]


def test_reset_to_earliest_redelivers_and_holds_across_a_crash(node):
    ids = send(node, "orders", 5)
    assert receive_logged(node, "g", "orders") == ids
    [r] = operations.reset_offset(node.broker, node.pop, "g", "orders", "earliest")
    assert (r.queue_id, r.old_offset, r.new_offset) == (0, 5, 0)
    node.pop.check()
    node.restart()  # kill -9 right after the answer
    assert receive(node, "g", "orders") == ids


def test_reset_to_latest_skips_the_backlog_and_to_a_time_finds_the_first_stored_after(node):
    t0 = node.clock.wall_ms()
    ids = send(node, "orders", 6, step_ms=1_000)
    node.pop.set_group("g")
    [r] = operations.reset_offset(node.broker, node.pop, "g", "orders", "latest")
    assert r.new_offset == 6 and receive(node, "g", "orders") == []
    [r] = operations.reset_offset(node.broker, node.pop, "g", "orders", "timestamp", t0 + 3_500)
    assert (r.old_offset, r.new_offset) == (6, 4)
    assert receive(node, "g", "orders") == ids[4:]
    [r] = operations.reset_offset(node.broker, node.pop, "g", "orders", "timestamp", t0 + 60_000)
    assert r.new_offset == 6


def test_reset_one_queue_leaves_the_others(tmp_path):
    node = Node(str(tmp_path), queues=2).open()
    try:
        send(node, "orders", 4)
        assert len(receive(node, "g", "orders")) == 4
        rows = operations.reset_offset(node.broker, node.pop, "g", "orders", "earliest", queue_id=1)
        assert [(r.queue_id, r.new_offset) for r in rows] == [(1, 0)]
        again = node.pop.receive("g", "orders", max_messages=32, invisible_ms=INVISIBLE_MS)
        assert {p.message.queue_id for p in again} == {1} and len(again) == 2
    finally:
        node.close()


@pytest.mark.parametrize("group, topic, to, at, queue, error", [
    ("nobody", "orders", "earliest", 0, None, errors.GroupNotFound),
    ("g", "nothing", "earliest", 0, None, errors.TopicNotFound),
    ("g", "orders", "middle", 0, None, errors.ClientError),
    ("g", "orders", "timestamp", 0, None, errors.ClientError),
    ("g", "orders", "earliest", 0, 3, errors.InvalidQueue),
])
def test_reset_refuses_bad_requests(node, group, topic, to, at, queue, error):
    send(node, "orders", 1)
    node.pop.set_group("g")
    with pytest.raises(error):
        operations.reset_offset(node.broker, node.pop, group, topic, to, at, queue)


# ----------------------------------------------------------------------------- topic delete
def delete_topic(node, name: str, force: bool = False):
    node.broker.flush()  # the caller's part: everything written dispatched (the Admin service's barrier)
    return operations.delete_topic(node.broker, node.pop, name, force)


def test_topic_delete_refused_while_a_group_lags_unless_forced(node):
    send(node, "orders", 3)
    receive(node, "g", "orders", max_messages=1)
    with pytest.raises(errors.ClientError, match="lag on topic orders: g .2 not received"):
        delete_topic(node, "orders")
    d = delete_topic(node, "orders", force=True)
    assert (d.messages, d.deleted, d.groups) == (3, ["orders"], ["g"])
    assert "orders" not in node.broker.topics and "orders" not in node.broker.offsets.get("g", {})


def test_topic_delete_refused_with_deliveries_in_flight_even_forced(node):
    send(node, "orders", 2)
    receive(node, "g", "orders", ack=False)
    with pytest.raises(errors.ClientError, match="in flight"):
        delete_topic(node, "orders", force=True)
    assert "orders" in node.broker.topics


def test_deleted_topic_stays_gone_after_a_crash_and_a_new_one_starts_afresh(node):
    send(node, "orders", 3)
    receive_logged(node, "g", "orders")  # a restart would skip their offsets
    delete_topic(node, "orders")
    node.restart()
    assert "orders" not in node.broker.topics and node.broker.queue_bounds("orders", 0) == (0, 0)
    [fresh] = send(node, "orders", 1)  # the same name again: offsets from 0, nothing skipped
    assert receive(node, "g", "orders") == [fresh]


def test_topic_delete_takes_the_retry_topics_and_refuses_system_topics(node):
    node.pop.set_group("g", max_attempts=5)
    send(node, "orders", 1)
    receive(node, "g", "orders", ack=False)
    node.advance(INVISIBLE_MS + 1_000)  # revived into %RETRY%g_orders
    retry = names.retry_topic("g", "orders")
    assert retry in node.broker.topics
    d = delete_topic(node, "orders", force=True)
    assert d.deleted == ["orders", retry] and retry not in node.broker.topics
    with pytest.raises(errors.ClientError):
        delete_topic(node, retry)


# ----------------------------------------------------------------------------- group delete
def test_group_delete_forgets_the_group_across_a_crash(node):
    send(node, "orders", 2)
    receive(node, "g", "orders", ack=False)
    with pytest.raises(errors.ClientError, match="in flight"):
        operations.delete_group(node.broker, node.pop, "g")
    node.advance(INVISIBLE_MS + 1_000)
    assert receive(node, "g", "orders")  # the retries, acked now
    receive(node, "g", "orders")
    assert operations.delete_group(node.broker, node.pop, "g") == [names.retry_topic("g", "orders"), "orders"]
    assert "g" not in catalog.known_groups(node.broker, node.pop)
    node.restart()
    assert "g" not in catalog.known_groups(node.broker, node.pop)
    with pytest.raises(errors.GroupNotFound):
        operations.delete_group(node.broker, node.pop, "g")


# ----------------------------------------------------------------------------- dead letters
def dead_letter(node, topic: str, count: int) -> list[str]:
    node.pop.set_group("g", max_attempts=1)
    ids = send(node, topic, count)
    assert len(receive(node, "g", topic, ack=False)) == count
    node.advance(INVISIBLE_MS + 1_000)  # attempt 1 of 1 failed: to %DLQ%g
    return ids


def resend(node, limit: int = 0, crash_before_cursor: bool = False):
    plan = deadletters.plan_resend(node.broker, "g", limit)
    results = node.broker.write(plan.messages)
    node.broker.flush()
    if crash_before_cursor:
        return plan, results
    deadletters.resent(node.broker, plan)
    return plan, results


def test_dlq_resend_sends_back_to_the_topic_once(node):
    ids = dead_letter(node, "orders", 3)
    listed = deadletters.list_dead(node.broker, "g")
    assert [v.message_id for _m, v, _r in listed.letters] == ids
    assert {v.topic for _m, v, _r in listed.letters} == {"orders"}
    plan, results = resend(node, limit=2)
    assert (len(plan.messages), plan.from_offset, plan.to_offset) == (2, 0, 2)
    assert [r.topic for r in results] == ["orders", "orders"]
    node.pop.set_group("h")
    operations.reset_offset(node.broker, node.pop, "h", "orders", "earliest")
    bodies = [p.message.body for p in node.pop.receive("h", "orders", max_messages=32, invisible_ms=INVISIBLE_MS)]
    assert bodies == [b"m0", b"m1", b"m2", b"m0", b"m1"]
    assert deadletters.list_dead(node.broker, "g").cursor == 2
    assert [r for _m, _v, r in deadletters.list_dead(node.broker, "g", everything=True).letters] == [True, True, False]
    plan, _ = resend(node)
    assert len(plan.messages) == 1
    plan, _ = resend(node)
    assert plan.messages == []


def test_dlq_resend_repeated_before_the_cursor_moved_is_answered_by_the_dedupe_window(node):
    dead_letter(node, "orders", 2)
    resend(node, crash_before_cursor=True)  # e.g. the cursor's write failed: nothing moved
    plan, results = resend(node)
    assert len(plan.messages) == 2 and all(r.duplicate for r in results)
    assert node.broker.queue_bounds("orders", 0) == (0, 4)  # 2 sent + 2 resent once, not twice


def test_dlq_resend_after_a_crash_before_the_cursor_sends_again(node):
    dead_letter(node, "orders", 2)
    resend(node, crash_before_cursor=True)
    node.restart()  # kill -9: the dedupe window is memory only, the cursor did not move
    plan, results = resend(node)
    assert len(plan.messages) == 2 and not any(r.duplicate for r in results)
    assert node.broker.queue_bounds("orders", 0) == (0, 6)  # at least once: delivered twice, never lost
    node.restart()
    assert resend(node)[0].messages == []  # the cursor was durable before the answer


def test_dlq_of_a_group_without_dead_letters_is_not_found(node):
    with pytest.raises(errors.NotFound):
        deadletters.list_dead(node.broker, "g")


# ----------------------------------------------------------------------------- topic type
def test_type_change_refused_on_a_topic_that_holds_messages_unless_forced(node):
    node.broker.create_topic("empty", 1, "normal")
    assert node.broker.create_topic("empty", 1, "fifo").message_type.name == "FIFO"  # empty: allowed
    send(node, "orders", 1)
    with pytest.raises(errors.ClientError, match="holds 1 message of type mixed"):
        catalog.create_or_update_topic(node.broker, node.pop, "orders", 0, "fifo")
    assert catalog.create_or_update_topic(node.broker, node.pop, "orders", 0, "fifo", force=True) \
        .message_type.name == "FIFO"


@pytest.mark.parametrize("crash_in", ["remove", "drop_topic", "checkpoint"])
def test_a_crash_in_the_middle_of_a_topic_delete_loses_nothing(node, crash_in):
    """kill -9 after the queue files went and before the delete finished: the broker opens, and
    the topic is either gone or back whole (the old checkpoint still lists its queues, so
    recovery rebuilds them from the log: back, in each of these cases): never half."""
    ids = send(node, "orders", 3)
    node.broker.flush()

    class Killed(BaseException):
        pass

    def kill(*_args, **_kw):
        raise Killed()

    target = {"remove": node.broker.topic_registry, "drop_topic": node.broker.consumer_offsets,
              "checkpoint": node.broker.store}[crash_in]
    setattr(target, crash_in, kill)
    with pytest.raises(Killed):
        operations.delete_topic(node.broker, node.pop, "orders")
    node.restart()
    if "orders" in node.broker.topics:
        assert receive(node, "g", "orders") == ids
    else:
        assert node.broker.queue_bounds("orders", 0) == (0, 0)


def test_dlq_resend_to_fifo_and_delay_topics_keeps_them_acceptable(node):
    node.broker.create_topic("ordered", 1, "fifo")
    node.broker.create_topic("later", 1, "delay")
    node.pop.set_group("g", max_attempts=1)
    node.broker.send("ordered", b"f", message_group="order-7")
    node.broker.send("later", b"d", deliver_at_ms=node.clock.wall_ms())
    node.advance(1_000)  # the delay message falls due
    node.broker.flush()
    for topic in ("ordered", "later"):
        assert len(receive(node, "g", topic, ack=False)) == 1
    node.advance(INVISIBLE_MS + 1_000)
    plan, results = resend(node)
    by_topic = {m.topic: m for m in plan.messages}
    assert by_topic["ordered"].message_group == "order-7" and by_topic["later"].deliver_at_ms is not None
    assert len(results) == 2


def test_resend_rpc_answers_once_the_copies_and_the_cursor_are_durable(node):
    import asyncio

    from chronoq.proto import chronoq_admin_pb2 as apb
    from chronoq.server import admin

    dead_letter(node, "orders", 3)
    svc = admin.AdminService(node.broker, node.pop)
    r = asyncio.run(svc.ResendDeadLetters(apb.ResendDeadLettersRequest(group="g", limit=2), None))
    assert (r.status.code, r.resent, r.from_offset, r.to_offset, r.remaining) == (20000, 2, 0, 2, 1)
    node.restart()  # kill -9 right after the answer: both the copies and the cursor survive
    assert node.broker.queue_bounds("orders", 0) == (0, 5)
    assert deadletters.list_dead(node.broker, "g").cursor == 2
