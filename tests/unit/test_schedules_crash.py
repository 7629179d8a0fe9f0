"""Pause and delete interrupted by a crash (``kill -9`` of the embedded broker) at each of their
saves: afterwards the schedule is either still active with every occurrence firing once, or
paused/deleted with nothing firing after the pause (``ScheduleBook.pause`` saves before it
recalls; ``_settle`` finishes the recalls at the next open)."""

from __future__ import annotations

from collections import Counter

import pytest

from chronoq.core.clock import FakeClock
from chronoq.features.schedules.book import PROP_SCHEDULE_AT, ScheduleBook
from tests.unit.timerkit import T0, crash, open_broker, run_schedules, visible

TOPIC = "t"


class Crash(Exception):
    pass


@pytest.mark.parametrize("op", ["pause", "delete"])
@pytest.mark.parametrize("crash_at_save", [1, 2])
def test_pause_and_delete_interrupted_at_a_save(tmp_path, op, crash_at_save):
    clock = FakeClock(T0)
    broker = open_broker(tmp_path, clock, timer_prewrite_ms=50)
    broker.create_topic(TOPIC, 1)
    book = ScheduleBook(broker)
    book.create("s", TOPIC, interval_ms=1000, body="x")
    run_schedules(broker, book, clock, 3_000)
    assert len(book.get("s").ahead) >= 5  # occurrences handed to the timer, not yet due
    op_at = clock.wall_ms()
    saves = [0]
    real_save = book.save

    def save():
        saves[0] += 1
        if saves[0] == crash_at_save:
            raise Crash  # the process dies here: this save never happened
        real_save()

    book.save = save
    with pytest.raises(Crash):
        getattr(book, op)("s")
    crash(broker)
    broker = open_broker(tmp_path, clock, timer_prewrite_ms=50)
    book = ScheduleBook(broker)
    run_schedules(broker, book, clock, 20_000)
    fired = Counter(int(m.properties[PROP_SCHEDULE_AT]) for m in visible(broker, TOPIC))
    assert all(n == 1 for n in fired.values()), fired
    if "s" in book.schedules and not book.schedules["s"].paused:  # the op never took effect
        want = list(range(T0 + 1000, clock.wall_ms() + 1, 1000))
        assert sorted(fired) == want
    else:  # it took effect: nothing after it fires (within the prewrite window at most)
        assert crash_at_save == 2
        assert not book.schedules.get("s") or book.schedules["s"].ahead == []
        assert max(fired) <= op_at + 50 and sorted(fired) == list(range(T0 + 1000, max(fired) + 1, 1000))
    broker.close()


def test_delete_during_a_round_then_crash_recalls_the_rounds_occurrences(tmp_path):
    """A round written (not completed), the schedule deleted, then ``kill -9``: at the next open
    the round's occurrences are found in the log and recalled (the intent names their topic)."""
    clock = FakeClock(T0)
    broker = open_broker(tmp_path, clock, timer_prewrite_ms=50)
    broker.create_topic(TOPIC, 1)
    book = ScheduleBook(broker)
    book.create("s", TOPIC, interval_ms=1000, body="x")
    rnd = book.begin_round()
    book.save()
    book.write_round(rnd)
    broker.flush()
    assert len(rnd.messages) >= 5
    book.delete("s")
    deleted_at = clock.wall_ms()
    crash(broker)
    broker = open_broker(tmp_path, clock, timer_prewrite_ms=50)
    book = ScheduleBook(broker)
    run_schedules(broker, book, clock, 20_000)
    fired = [int(m.properties[PROP_SCHEDULE_AT]) for m in visible(broker, TOPIC)]
    assert all(at <= deleted_at + 50 for at in fired), fired
    assert book.schedules == {} and book.intent is None
    broker.close()
