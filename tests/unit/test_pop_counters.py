"""POP counters forget a deleted group's or topic's keys (each is a series on /metrics), and keep
what those keys had counted in the totals, which never shrink (the console's history)."""

from __future__ import annotations

from chronoq.pop.counters import PopCounters


def _filled() -> PopCounters:
    c = PopCounters()
    c.received.update({("g", "t"): 5, ("g", "u"): 2, ("h", "t"): 3})
    c.acked.update({("g", "t"): 4, ("h", "t"): 1})
    c.nacked.update({("g", "u"): 1, ("h", "t"): 2})
    c.revive_outcome("g", 2, 1, 1)
    c.revive_outcome("h", 1, 1, 0)
    return c


def test_a_deleted_group_takes_its_keys_and_totals_stay():
    c = _filled()
    c.forget("g")
    assert c.received == {("h", "t"): 3} and c.acked == {("h", "t"): 1} and c.nacked == {("h", "t"): 2}
    assert c.revived == {"h": 1} and c.retried == {"h": 1} and c.dead_lettered == {}
    assert (c.total_received(), c.total_acked()) == (10, 5)


def test_a_deleted_topic_takes_its_keys_of_every_group_but_not_the_groups():
    c = _filled()
    c.forget(None, ("t",))
    assert c.received == {("g", "u"): 2} and c.acked == {} and c.nacked == {("g", "u"): 1}
    assert c.revived == {"g": 2, "h": 1}  # per group: the groups live on
    assert (c.total_received(), c.total_acked()) == (10, 5)
    c.forget("g", ("u",))  # one group's keys of one topic
    assert c.received == {} and c.nacked == {} and c.total_received() == 10
