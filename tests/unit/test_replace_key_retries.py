"""A message sent with a replace key (debounce, chronoq.timer.keyed) is retried and dead-lettered
like any other once delivered: its retry and dead-letter copies carry no replace key. They
carried it, the broker refused to write them (a replace key needs a delivery time), and the
revive dropped the message: never redelivered after a nack or an expired invisible time."""

from __future__ import annotations

import pytest

from popkit import Node


@pytest.mark.parametrize("how", ["nack", "expiry"])
def test_a_delivered_replace_key_message_comes_back_then_goes_to_the_dead_letters(tmp_path, how):
    node = Node(str(tmp_path), flush_policy="sync").open()
    broker, pop, clock = node.broker, node.pop, node.clock
    pop.set_group("g", max_attempts=2)
    sent = broker.send("orders", b"debounced", deliver_at_ms=clock.wall_ms() + 5_000,
                       properties={"CHRONOQ_REPLACE_KEY": "cart-7"})
    broker.flush()
    clock.advance(5_000)
    broker.timer_tick()
    [first] = pop.receive("g", "orders", max_messages=4, invisible_ms=1_000)
    assert first.message.message_id == sent.message_id and first.delivery_attempt == 1
    if how == "nack":
        pop.change_invisible("g", "orders", first.receipt_handle, 1_000)
    node.advance(30_000)  # the retry comes due (a nack: after its 1 s; an expiry: its back-off)
    [again] = pop.receive("g", "orders", max_messages=4, invisible_ms=1_000)
    assert again.message.body == b"debounced" and again.delivery_attempt == 2
    node.advance(60_000)  # never acked: the group's last attempt is spent
    lo, hi = broker.queue_bounds("%DLQ%g", 0)
    assert hi - lo == 1 and broker.read("%DLQ%g", 0, lo, 1).messages[0].body == b"debounced"
