"""The timer counts a copy visible only when the store shows it (chronoq/timer/delivery.py,
``_count_visible``/``_release``), whatever order its completions come in.

Driven as the server's runtime drives the timer: ``timer_step`` per tick, the committer's fsync
reported later by ``timer_synced``, here one fsync covering the write groups of two ticks:

  T0        a delay-level-1 message L (due T0+1000) and timer messages t1 (due T0+1020) and t2
            (due T0+1060), all to queue 0 of one topic; prewrite lead 50 ms
  T0+1000   tick 1 writes group 1: t1 (held copy, queue offset 0) and L (due, offset 1)
  T0+1040   tick 2 writes group 2: t2 (held copy, offset 2)
            one synced() completes both groups: timer lane [t1, t2], then level lane [L], so the
            queue's parked copies came as [t2 (offset 2), L (offset 1)]
  T0+1041   the store still holds t2; ``_release`` took the last parked copy (L, below the
            visible end) as the sign that all were visible, t2 included: "a copy became visible
            before its due time" (an AssertionError that stopped every tick until t2 was due; with
            python -O, t2 counted visible 19 ms early). Found by a soak, 4 times in 22 minutes.
"""

from __future__ import annotations

import pytest

from chronoq.core.clock import FakeClock

from popkit import Node

T0 = 1_700_000_000_000
TOPIC, GROUP = "mixed", "g"
LEAD = 50


@pytest.fixture
def node(tmp_path):
    n = Node(str(tmp_path), clock=FakeClock(T0), config={"timer_prewrite_ms": LEAD}).open()
    yield n
    if n.pop is not None and not n.pop.closed:
        n.close()


def _received(node) -> list[bytes]:
    got = node.pop.receive(GROUP, TOPIC, max_messages=32, invisible_ms=60_000)
    for p in got:
        node.pop.ack(GROUP, TOPIC, p.receipt_handle)
    return [p.message.body for p in got]


def test_level_and_held_timer_copies_completed_by_one_fsync_are_counted_visible_only_when_due(node):
    b, clock = node.broker, node.clock
    b.create_topic(TOPIC, 1)
    counted: list[tuple[bytes, int, int]] = []  # (message id, due, counted-visible time)
    chained = b.timer.on_visible

    def on_visible(topics, ids, dues, visible_ms):
        counted.extend((i, d, visible_ms) for i, d in zip(ids, dues))
        if chained is not None:
            chained(topics, ids, dues, visible_ms)

    b.timer.on_visible = on_visible
    due = {b"L": T0 + 1_000, b"t1": T0 + 1_020, b"t2": T0 + 1_060}
    b.send(TOPIC, b"L", delay_level=1, queue_id=0)
    b.send(TOPIC, b"t1", deliver_at_ms=due[b"t1"], queue_id=0)
    b.send(TOPIC, b"t2", deliver_at_ms=due[b"t2"], queue_id=0)
    b.flush()
    b.timer_step()  # loads the bucket
    b.timer_synced(b.flush())

    clock.set(T0 + 1_000)
    b.timer_step()  # group 1: t1 (held), L
    clock.set(T0 + 1_040)
    b.timer_step()  # group 2: t2 (held); its fsync not reported yet (the server's committer thread)
    b.timer_synced(b.flush())  # one fsync completes both groups
    assert sorted(_received(node)) == [b"L", b"t1"]

    clock.set(T0 + 1_041)
    b.timer_step()  # (it raised: "a copy became visible before its due time")
    b.timer_synced(b.flush())
    assert _received(node) == []  # t2 is held by the store: no consumer sees it early
    assert b.timer.histogram.early == 0, "the timer counted a copy visible before its due time"
    assert all(visible_ms >= d for _mid, d, visible_ms in counted), counted

    clock.set(T0 + 1_060)
    b.timer_step()
    b.timer_synced(b.flush())
    assert _received(node) == [b"t2"]
    assert b.timer.histogram.count == 3 and b.timer.histogram.early == 0
    assert sorted(d for _mid, d, _v in counted) == sorted(due.values())  # each counted once, none lost
    assert all(visible_ms >= d for _mid, d, visible_ms in counted), counted
    assert not b.timer._awaiting
