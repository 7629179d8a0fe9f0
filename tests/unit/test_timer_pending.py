"""The pending list (``chronoq.timer.pending``) through the embedded broker on a fake clock:
order, filters, the due window, bounds, empty answers, paging that stays stable while timers
fire and messages are recalled or rescheduled, far-future buckets read from their files (also
after a crash), delay-level messages, and the scan budget."""

from __future__ import annotations

import pytest

from chronoq.core import errors
from chronoq.core.clock import FakeClock
from chronoq.timer import pending as pend
from chronoq.timer.pending import PendingQuery
from chronoq.timer.service import RecallOutcome
from tests.unit.timerkit import T0, TOPIC, crash, drain, open_broker

DAY = 86_400_000
OTHER = "other"


@pytest.fixture
def clock():
    return FakeClock(T0)


@pytest.fixture
def broker(tmp_path, clock):
    b = open_broker(tmp_path, clock, timer_delay_levels="1s 5s 1m")
    b.create_topic(TOPIC, 2)
    b.create_topic(OTHER, 1)
    yield b
    if not b.closed:
        b.close()


def listed(b, **q) -> list:
    return b.pending(PendingQuery(**q)).messages


def all_pages(b, between=None, **q) -> list:
    """Every page of a query, following the cursor (``between(i)`` runs after page i)."""
    out, cursor = [], ""
    for i in range(1000):
        page = b.pending(PendingQuery(cursor=cursor, **q))
        out.extend(page.messages)
        if not page.next_cursor:
            return out
        cursor = page.next_cursor
        if between is not None:
            between(i)
    raise AssertionError("the cursor never ended")


def ids(messages) -> list[str]:
    return [m.parts.message_id.decode() for m in messages]


def test_lists_pending_timer_messages_in_due_order_with_their_fields(broker):
    late = broker.send(TOPIC, b"late", deliver_at_ms=T0 + 90_000, keys=["k1"], tag="tg", queue_id=1)
    early = broker.send(OTHER, b"early", deliver_at_ms=T0 + 5_000, properties={"a": "b"})
    tie_a = broker.send(TOPIC, b"tie-a", deliver_at_ms=T0 + 30_000)
    tie_b = broker.send(TOPIC, b"tie-b", deliver_at_ms=T0 + 30_000)
    broker.send(TOPIC, b"now", deliver_at_ms=T0)  # due at once: never pending
    got = listed(broker)
    assert ids(got) == [early.message_id, tie_a.message_id, tie_b.message_id, late.message_id]
    assert tie_a.commit_offset < tie_b.commit_offset  # the tie-break is the ident (commit offset)
    assert [(m.due_ms, m.ident, m.level, m.topic, m.queue_id) for m in got][-1] == (
        T0 + 90_000, late.commit_offset, 0, TOPIC, 1)
    parts = got[-1].parts
    assert (parts.body, parts.tag, parts.keys) == (b"late", b"tg", b"k1")


def test_filters_by_topic_key_and_due_window(broker):
    a = broker.send(TOPIC, b"a", deliver_at_ms=T0 + 10_000, keys=["order-1", "x"])
    b = broker.send(TOPIC, b"b", deliver_at_ms=T0 + 70_000, keys=["order-10"])
    c = broker.send(OTHER, b"c", deliver_at_ms=T0 + 130_000, keys=["order-1"])
    assert ids(listed(broker, topic=TOPIC)) == [a.message_id, b.message_id]
    assert ids(listed(broker, topic=OTHER)) == [c.message_id]
    assert ids(listed(broker, key="order-1")) == [a.message_id, c.message_id]  # exact keys, not prefixes
    assert ids(listed(broker, key="order-1", topic=OTHER)) == [c.message_id]
    assert ids(listed(broker, from_ms=T0 + 10_001)) == [b.message_id, c.message_id]
    assert ids(listed(broker, from_ms=T0 + 10_000, to_ms=T0 + 70_000)) == [a.message_id]  # [from, to)
    assert ids(listed(broker, to_ms=T0 + 70_001)) == [a.message_id, b.message_id]
    assert listed(broker, topic="nope") == [] and listed(broker, key="y") == []
    assert listed(broker, from_ms=T0 + 200_000) == []


def test_empty_broker_and_bounds(broker):
    page = broker.pending(PendingQuery())
    assert page.messages == [] and page.next_cursor == ""
    for bad in (PendingQuery(limit=0), PendingQuery(limit=pend.LIMIT_MAX + 1),
                PendingQuery(from_ms=T0 + 5, to_ms=T0 + 5), PendingQuery(cursor="nonsense"),
                PendingQuery(cursor=pend.CURSOR_PREFIX + "!!")):
        with pytest.raises(errors.ClientError):
            broker.pending(bad)
    for i in range(pend.LIMIT_MAX + 5):
        broker.send(TOPIC, b"%d" % i, deliver_at_ms=T0 + 1_000 + i)
    big = broker.pending(PendingQuery(limit=pend.LIMIT_MAX))
    assert len(big.messages) == pend.LIMIT_MAX and big.next_cursor
    assert len(broker.pending(PendingQuery()).messages) == pend.LIMIT_DEFAULT
    rest = broker.pending(PendingQuery(cursor=big.next_cursor, limit=pend.LIMIT_MAX))
    assert len(rest.messages) == 5 and rest.next_cursor == ""


def test_paging_is_stable_while_timers_fire_and_messages_are_recalled(broker, clock):
    due = [T0 + 1_000 * (i // 3 + 1) for i in range(60)]  # three per due time: ties across page boundaries
    sent = [broker.send(TOPIC, b"m%03d" % i, deliver_at_ms=due[i], keys=[f"k{i}"]) for i in range(60)]
    recalled, moved = {sent[40].message_id, sent[50].message_id}, sent[55]
    by_id = {r.message_id: r for r in sent}

    def between(i):
        if i == 0:
            clock.advance(4_000)  # the first messages fire (some of them not listed yet)
            drain(broker)
        if i == 1:
            for mid in recalled:
                broker.recall(by_id[mid].recall_handle)
            broker.reschedule(moved.recall_handle, T0 + 2_000_000)

    got = all_pages(broker, between, limit=7)
    keys = [(m.due_ms, m.ident) for m in got]
    assert keys == sorted(keys) and len(set(keys)) == len(keys)  # ordered, nothing twice
    listed_ids = ids(got)
    # Everything pending throughout is listed once; the recalled ones are not.
    fired_before = {r.message_id for r, d in zip(sent, due) if d <= T0 + 4_000}
    throughout = [r.message_id for r in sent if r.message_id not in fired_before | recalled]
    assert set(throughout) <= set(listed_ids) and not recalled & set(listed_ids)
    assert set(listed_ids) - set(throughout) <= fired_before  # the first page, listed before they fired
    assert listed_ids.count(moved.message_id) == 1  # the moved entry (new ident, new due time)
    assert got[-1].due_ms == T0 + 2_000_000
    # A fresh listing now: exactly what is pending.
    assert sorted(ids(all_pages(broker, limit=7))) == sorted(throughout)


def test_far_future_buckets_are_read_from_their_files_also_after_a_crash(tmp_path, clock):
    b = open_broker(tmp_path, clock)
    b.create_topic(TOPIC, 1)
    far = [b.send(TOPIC, b"far%d" % i, deliver_at_ms=T0 + (i + 1) * DAY, keys=["far"]) for i in range(5)]
    near = b.send(TOPIC, b"near", deliver_at_ms=T0 + 1_000)
    b.recall(far[2].recall_handle)
    b.timer.checkpoint()  # the bucket files written, their buffers empty
    assert not any(b.timer.buckets[s].buffer for s in b.timer.buckets if s > T0 + DAY // 2)
    want = [near.message_id] + [r.message_id for i, r in enumerate(far) if i != 2]
    assert ids(listed(b)) == want
    late = b.send(TOPIC, b"after-checkpoint", deliver_at_ms=T0 + 3 * DAY + 1)  # in a buffer, not the file
    want.insert(3, late.message_id)
    assert ids(listed(b)) == want
    crash(b)
    b2 = open_broker(tmp_path, clock)
    try:
        assert ids(listed(b2)) == want
        assert ids(listed(b2, key="far", from_ms=T0 + 2 * DAY, to_ms=T0 + 4 * DAY)) == [far[1].message_id]
        clock.advance(1_000)
        drain(b2)
        assert ids(listed(b2)) == want[1:]  # fired: absent
    finally:
        b2.close()


def test_delay_level_messages_are_listed_in_due_order_with_their_real_topic(broker, clock):
    lv2 = broker.send(TOPIC, b"level-2", delay_level=2, queue_id=1, keys=["lk"])   # due T0 + 5 s
    t = broker.send(OTHER, b"timer", deliver_at_ms=T0 + 3_000)
    lv1 = broker.send(TOPIC, b"level-1", delay_level=1)                            # due T0 + 1 s
    lv1b = broker.send(TOPIC, b"level-1b", delay_level=1)
    got = listed(broker)
    assert ids(got) == [lv1.message_id, lv1b.message_id, t.message_id, lv2.message_id]
    assert [(m.level, m.topic, m.queue_id, m.due_ms) for m in got][-1] == (2, TOPIC, 1, T0 + 5_000)
    assert ids(listed(broker, topic=OTHER)) == [t.message_id]
    assert ids(listed(broker, key="lk")) == [lv2.message_id]
    assert ids(listed(broker, from_ms=T0 + 3_000)) == [t.message_id, lv2.message_id]
    broker.recall(lv1b.recall_handle)
    clock.advance(1_000)
    drain(broker)
    assert ids(listed(broker)) == [t.message_id, lv2.message_id]  # fired or recalled: absent
    # A listed message's handle is the one its send answered: it recalls it (level and timer).
    assert [m.recall_handle() for m in listed(broker)] == [t.recall_handle, lv2.recall_handle]
    assert broker.recall(listed(broker)[-1].recall_handle()).outcome is RecallOutcome.CANCELLED
    assert ids(listed(broker)) == [t.message_id]


def test_a_filter_that_matches_little_stops_at_the_scan_budget_and_continues(broker, monkeypatch):
    monkeypatch.setattr(pend, "SCAN_MAX", 5)
    for i in range(12):
        broker.send(TOPIC, b"%d" % i, deliver_at_ms=T0 + 1_000 + i)
    rare = broker.send(OTHER, b"rare", deliver_at_ms=T0 + 50_000)
    first = broker.pending(PendingQuery(topic=OTHER))
    assert first.messages == [] and first.scanned == 5 and first.next_cursor
    got = all_pages(broker, topic=OTHER)
    assert ids(got) == [rare.message_id]
