"""``chronoq.server.answers.AnswerBudget``: the bookkeeping of answers waiting on their peers."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from chronoq.core.clock import FakeClock
from chronoq.server.answers import AnswerBudget

MS = 1_000_000


def budget(per=100, total=250, timeout_ms=1000, clock=None):
    clock = clock or FakeClock()
    return AnswerBudget(per, total, timeout_ms * MS, clock.monotonic_ns), clock


def test_per_connection_and_broker_wide_limits():
    b, _ = budget()
    assert b.allowance("a", "t", 32) == 32  # nothing known of the topic yet: ask for the batch
    assert b.fit("a", [30, 30, 30, 30]) == 3  # 120 > 100: the fourth is cut
    held_a = b.reserve("a", 90, topic="t", popped=[1, 2, 3])
    assert b.held == 90 and b.by_peer == {"a": 90}
    assert b.allowance("a", "t", 32) == 0  # cut: full until one of its answers is taken
    assert b.allowance("b", "t", 32) == 3  # 100 bytes of room at 30 a message
    b.reserve("b", 90, topic="t", popped=[1, 2, 3])
    assert b.fit("c", [30, 30, 30]) == 2  # the broker has 70 left
    assert b.allowance("d", "t", 32) == 0  # the broker is full now
    b.release(held_a)
    assert b.by_peer == {"b": 90} and b.held == 90
    assert b.allowance("a", "t", 32) == 3 and b.allowance("d", "t", 1) == 1


def test_an_idle_connection_may_take_one_message_bigger_than_its_budget():
    b, _ = budget(per=100, total=250)
    assert b.fit("a", [150, 10]) == 1
    b.reserve("a", 150, topic="big", popped=[1])
    assert b.allowance("a", "big", 8) == 0
    assert b.allowance("b", "big", 8) == 1  # idle: one, however big (the broker has room)
    assert b.fit("b", [150]) == 0  # but not past the broker-wide budget
    assert b.allowance("b", "big", 8) == 0


def test_release_is_once_and_never_negative():
    b, _ = budget()
    held = b.reserve("a", 40, popped=[1])
    b.release(held)
    b.release(held)
    b.release(None)
    assert b.held == 0 and b.by_peer == {} and len(b) == 0


def test_expire_returns_old_answers_once_oldest_first():
    b, clock = budget(timeout_ms=1000)
    first = b.reserve("a", 10, popped=[1])
    clock.advance(600)
    second = b.reserve("b", 20, popped=[1])
    clock.advance(399)
    assert b.expire() == []
    clock.advance(1)
    assert b.expire() == [first] and first.abandoned and not second.abandoned
    assert b.expire() == []
    assert b.held == 30 and len(b) == 1  # expired but still counted until released
    b.release(first)
    clock.advance(600)
    assert b.expire() == [second]
    b.release(second)
    assert b.held == 0 and b.by_peer == {}


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from("abc"), st.lists(st.integers(1, 80), min_size=1, max_size=6),
                          st.integers(0, 3)), max_size=40))
def test_held_bytes_never_exceed_the_limits_nor_go_negative(steps):
    b, clock = budget(per=100, total=180)
    open_ = []
    for peer, sizes, action in steps:
        if action == 0 and open_:
            b.release(open_.pop(0))
        elif action == 1:
            clock.advance(700)
            b.expire()
        else:
            idle = b.by_peer.get(peer, 0) == 0
            n = b.fit(peer, sizes)
            if n:
                open_.append(b.reserve(peer, sum(sizes[:n]), popped=sizes[:n]))
            # Beyond a limit only by the one message an idle connection may always take.
            assert b.by_peer.get(peer, 0) <= b.per_connection or (idle and n == 1)
        assert b.held == sum(b.by_peer.values()) >= 0
        assert all(v > 0 for v in b.by_peer.values())
        assert b.held <= b.total or b.held == max(h.nbytes for h in open_)
    for held in open_:
        b.release(held)
    assert b.held == 0 and b.by_peer == {}
