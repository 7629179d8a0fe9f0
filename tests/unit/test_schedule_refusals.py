"""Schedules whose occurrences the broker will not take: refused at create when that is known
then (a topic typed for other messages, a template with the broker's own properties), and set
aside alone when it changes later (the topic retyped or deleted), while every other schedule
fires each occurrence once (``ScheduleBook.write_round``)."""

from __future__ import annotations

from collections import Counter

import pytest

from chronoq.core import errors
from chronoq.core.clock import FakeClock
from chronoq.features.schedules.book import PROP_SCHEDULE, PROP_SCHEDULE_AT, REFUSED_BACKOFF_MAX_MS, ScheduleBook
from tests.unit.timerkit import T0, open_broker, run_schedules, visible

HEALTHY, TROUBLED = "healthy", "troubled"


def _fired(broker, topic: str, name: str) -> Counter:
    return Counter(int(m.properties[PROP_SCHEDULE_AT]) for m in visible(broker, topic)
                   if m.properties.get(PROP_SCHEDULE) == name)


@pytest.fixture
def setup(tmp_path):
    clock = FakeClock(T0)
    broker = open_broker(tmp_path, clock, timer_prewrite_ms=50)
    broker.create_topic(HEALTHY, 1)
    broker.create_topic(TROUBLED, 1)
    yield broker, ScheduleBook(broker), clock
    broker.close()


def test_create_refuses_a_topic_typed_for_other_messages(setup):
    broker, book, _clock = setup
    broker.create_topic("plain", 1, "normal")
    with pytest.raises(errors.MessageTypeMismatch, match="accepts NORMAL messages, not DELAY"):
        book.create("s", "plain", interval_ms=1000, body="x")
    assert book.schedules == {}
    broker.create_topic("later", 1, "delay")  # typed for delayed messages: fine
    book.create("s", "later", interval_ms=1000, body="x")


@pytest.mark.parametrize("prop", ["CHRONOQ_REPLACE_KEY", "CHRONOQ_DELAY_LEVEL", "CHRONOQ_SCHEDULE_AT", "CHRONOQ_X"])
def test_create_refuses_the_brokers_properties_in_a_template(setup, prop):
    # A replace key would make each occurrence handed over replace the one before: none would fire.
    _broker, book, _clock = setup
    with pytest.raises(errors.ClientError, match="CHRONOQ_"):
        book.create("s", HEALTHY, interval_ms=1000, body="x", properties={prop: "k"})
    assert book.schedules == {}


@pytest.mark.parametrize("trouble", ["retyped", "deleted"])
def test_a_refused_schedule_stops_alone_and_fires_again_once_accepted(setup, trouble):
    broker, book, clock = setup
    book.create(HEALTHY, HEALTHY, interval_ms=1000, body="h")
    book.create(TROUBLED, TROUBLED, interval_ms=1000, body="t", catch_up="skip")
    run_schedules(broker, book, clock, 3_000)
    # Its topic changes under it; the occurrences already handed over still fire (they are the
    # timer's), what is planned after is refused.
    if trouble == "retyped":
        broker.create_topic(TROUBLED, 1, "normal", force=True)
    else:
        book.broker.config.auto_create_topics = False
        broker.delete_topic(TROUBLED)
    run_schedules(broker, book, clock, 30_000)
    s = book.get(TROUBLED)
    assert s.refusal, "the reason is kept for `chronoq schedule show`"
    assert s.ahead == [] and s.cursor_ms < clock.wall_ms() - 10_000  # nothing handed over since
    assert book.next_round_ms() > clock.wall_ms()  # waits for its back-off (the loop above rests)
    healthy = _fired(broker, HEALTHY, HEALTHY)
    assert sorted(healthy) == list(range(T0 + 1000, clock.wall_ms() + 1, 1000))  # every one, once
    assert set(healthy.values()) == {1}
    stopped_at = clock.wall_ms()
    # Accepted again: it fires from then on (catch-up "skip": not the ones missed meanwhile).
    if trouble == "retyped":
        broker.create_topic(TROUBLED, 1, "mixed", force=True)
    else:
        broker.create_topic(TROUBLED, 1)
    run_schedules(broker, book, clock, REFUSED_BACKOFF_MAX_MS + 10_000)
    assert book.get(TROUBLED).refusal == ""
    troubled = _fired(broker, TROUBLED, TROUBLED)
    assert set(troubled.values()) == {1}
    again = sorted(at for at in troubled if at > stopped_at)
    assert again and again[-1] == clock.wall_ms() - clock.wall_ms() % 1000
    assert again == list(range(again[0], again[-1] + 1, 1000))
    assert sorted(_fired(broker, HEALTHY, HEALTHY)) == list(range(T0 + 1000, clock.wall_ms() + 1, 1000))


def test_an_id_taken_by_another_sender_sets_aside_that_schedule_only(setup, caplog):
    """A client message already using an occurrence's id (``<name>-<generation>-<instant>``) with
    another body is refused by the dedupe window: that schedule is set aside for its back-off
    (the other schedules of the round fire), then planned again past the taken instant."""
    broker, book, clock = setup
    book.create(HEALTHY, HEALTHY, interval_ms=1000, body="h")
    s = book.create(TROUBLED, TROUBLED, interval_ms=1000, body="t")
    from chronoq.broker.broker import OutgoingMessage
    broker.send_batch([OutgoingMessage(TROUBLED, b"squatter", message_id=s.message_id(T0 + 1000))])
    run_schedules(broker, book, clock, 8_000)
    assert "troubled: its occurrences are refused" in caplog.text and "already used" in caplog.text
    assert book.get(TROUBLED).refusal == ""  # accepted again since
    assert sorted(_fired(broker, HEALTHY, HEALTHY)) == list(range(T0 + 1000, T0 + 8001, 1000))
    troubled = _fired(broker, TROUBLED, TROUBLED)
    assert set(troubled.values()) == {1} and T0 + 1000 not in troubled
    assert sorted(troubled) == list(range(min(troubled), T0 + 8001, 1000))
