"""The pure POP core: receipt-handle codec, naming and request rules, in-flight bookkeeping."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from chronoq.core import errors
from chronoq.pop import handle, names
from chronoq.pop.inflight import Inflight, QueueState


# --------------------------------------------------------------------------------- handles
@given(st.integers(0, 2**64 - 1), st.integers(0, 31), st.integers(0, 65535), st.integers(0, 2**63))
def test_handle_roundtrip(ck_id, index, queue_id, offset):
    text = handle.encode(ck_id, index, queue_id, offset)
    assert len(text) == handle.HANDLE_CHARS and text.isascii() and text.isprintable()
    assert handle.decode(text) == (ck_id, index, queue_id, offset)


@given(st.text(max_size=60))
def test_handle_decode_never_raises_anything_else(text):
    try:
        handle.decode(text)
    except errors.InvalidReceiptHandle:
        pass


def test_handle_detects_a_flipped_character():
    text = handle.encode(1 << 32 | 7, 3, 1, 99)
    for i in range(len(text)):
        flipped = text[:i] + ("1" if text[i] == "0" else "0") + text[i + 1:]
        with pytest.raises(errors.InvalidReceiptHandle):
            handle.decode(flipped)


# --------------------------------------------------------------------------------- names and rules
def test_retry_and_dlq_names():
    assert names.retry_topic("g", "t") == "%RETRY%g_t"
    assert names.dlq_topic("g") == "%DLQ%g"
    long = names.retry_topic("g" * 120, "t" * 127)
    assert long.startswith("%RETRY%") and len(long) <= 127
    assert long != names.retry_topic("g" * 120, "u" * 127)


@pytest.mark.parametrize("expr, expected", [
    ("*", None), ("", None), ("  ", None), ("A", {"A"}), ("A||B", {"A", "B"}),
    (" A || B || A ", {"A", "B"}), ("A || *", None), ("tag with space", {"tag with space"}),
    # Empty pieces are skipped, as RocketMQ's FilterAPI does.
    ("A ||", {"A"}), ("|| A", {"A"}), ("A |||| B", {"A", "B"}), ("A || ", {"A"}),
])
def test_tag_filter_parsing(expr, expected):
    result = names.parse_tag_filter(expr)
    assert result == (None if expected is None else frozenset(expected))


@pytest.mark.parametrize("expr", ["||", " || || ", "A | B", "x\x00", 5, None, "a" * 5000])
def test_bad_tag_filters(expr):
    with pytest.raises(errors.InvalidFilter):
        names.parse_tag_filter(expr)


def test_invisible_time_ranges():
    assert names.check_receive_invisible(1_000) == 1_000
    assert names.check_change_invisible(0) == 0
    assert names.check_change_invisible(names.INVISIBLE_MS_MAX) == names.INVISIBLE_MS_MAX
    for bad in (999, names.INVISIBLE_MS_MAX + 1, "10", None, True):
        with pytest.raises(errors.InvalidInvisibleTime):
            names.check_receive_invisible(bad)
    with pytest.raises(errors.InvalidInvisibleTime):
        names.check_change_invisible(-1)


def test_back_off_is_measured_from_the_delivery():
    delays = (1_000, 5_000)
    assert names.not_before_ms(1, delivered_ms=0, now_ms=60_000, delays_ms=delays) == 60_000
    assert names.not_before_ms(2, delivered_ms=0, now_ms=100, delays_ms=delays) == 5_000
    assert names.not_before_ms(9, delivered_ms=0, now_ms=100, delays_ms=delays) == 5_000  # last level repeats
    levels18 = tuple(range(1_000, 19_000, 1_000))
    assert names.retry_queues(levels18) == 19
    assert names.retry_queue(3, not_before_ms=10, now_ms=10, queues=19, delays_ms=levels18) == 0
    assert names.retry_queue(3, not_before_ms=11, now_ms=10, queues=19, delays_ms=levels18) == 3
    assert names.retry_queue(30, not_before_ms=11, now_ms=10, queues=19, delays_ms=levels18) == 18


def test_back_off_follows_the_table_it_is_given():
    """Attempt n waits level min(n, levels); queue k holds level k, clamped to the topic."""
    delays = (2_000, 4_000)
    assert [names.backoff_level(n, delays) for n in (1, 2, 3, 50)] == [1, 2, 2, 2]
    assert [names.not_before_ms(n, delivered_ms=0, now_ms=0, delays_ms=delays) for n in (1, 2, 3)] == \
        [2_000, 4_000, 4_000]
    assert names.retry_queues(delays) == 3
    # A topic made for a longer table (19 queues): later attempts still use their level's queue.
    assert [names.retry_queue(n, 1, 0, queues=19, delays_ms=delays) for n in (1, 2, 3, 9)] == [1, 2, 2, 2]
    # A topic capped below the table (max_queues): the top levels share its last queue.
    assert [names.retry_queue(n, 1, 0, queues=2, delays_ms=delays) for n in (1, 2, 3)] == [1, 1, 1]
    assert names.check_retry_delays([2_000, 4_000]) == delays
    for bad in ((), (0,), (1_000, -1), "1s", (1.5,), None, (True,)):
        with pytest.raises(errors.ClientError):
            names.check_retry_delays(bad)


# --------------------------------------------------------------------------------- in-flight books
class ListSink:
    def __init__(self):
        self.records = []

    def add_ck(self, ck):
        self.records.append(("ck", ck.ck_id, ck.bits))

    def add_ack(self, ck_id, index):
        self.records.append(("ack", ck_id, index))

    def add_done(self, ck_id):
        self.records.append(("done", ck_id))


def books(buffer_ms=1_000):
    sink = ListSink()
    inflight = Inflight(sink, generation=5, buffer_ms=buffer_ms)
    qs = inflight.add_queue(QueueState("g", "t", 0, 0, -1))
    return sink, inflight, qs


def test_consume_offset_waits_for_unsafe_entries():
    sink, inflight, qs = books()
    qs.pop_offset = 3
    ck = inflight.open(qs, "t", [0, 1, 2], [1, 1, 1], now_ms=0, invisible_ms=5_000, fifo=False)
    assert ck.ck_id >> 32 == 5
    assert qs.consume_offset() == 0
    inflight.settle(ck, 1)
    assert qs.consume_offset() == 0
    inflight.settle(ck, 0)
    assert qs.consume_offset() == 2
    assert sink.records == []  # merged in memory: nothing to log yet
    inflight.settle(ck, 2)
    assert qs.consume_offset() == 3 and not inflight.cks
    assert sink.records == []
    inflight.check()


def test_aging_logs_with_bitmap_and_durability_frees_the_queue():
    sink, inflight, qs = books(buffer_ms=1_000)
    qs.pop_offset = 2
    ck = inflight.open(qs, "t", [0, 1], [1, 1], now_ms=0, invisible_ms=60_000, fifo=False)
    inflight.settle(ck, 1)
    assert inflight.next_deadline() == 1_000
    assert inflight.age(999) == 0
    assert inflight.age(1_000) == 1
    assert sink.records == [("ck", ck.ck_id, 0b10)]
    assert qs.consume_offset() == 0  # logged, not yet fsynced
    inflight.mark_durable([ck])
    assert qs.consume_offset() == 2
    assert inflight.next_deadline() == 60_000
    inflight.check()


def test_successor_of_a_logged_ck_is_logged_before_the_settlement():
    sink, inflight, qs = books()
    qs.pop_offset = 1
    ck = inflight.open(qs, "t", [0], [1], now_ms=0, invisible_ms=60_000, fifo=False, log_now=True)
    new = inflight.change(ck, 0, now_ms=10, invisible_ms=5_000)
    assert sink.records == [("ck", ck.ck_id, 0), ("ck", new.ck_id, 0), ("ack", ck.ck_id, 0)]
    assert new.delivered_ms == 0 and new.deadline_ms == 5_010 and new.attempts == [1]
    inflight.check()


def test_a_source_logged_after_its_change_logs_its_successors_first():
    """I3 when the source is logged later (sealed by a revive, or aged): a record whose
    bitmap says an entry moved on is preceded by the successor holding it, down the chain."""
    sink, inflight, qs = books(buffer_ms=1_000)
    qs.pop_offset = 2
    ck = inflight.open(qs, "t", [0, 1], [1, 1], now_ms=0, invisible_ms=60_000, fifo=False)
    mid = inflight.change(ck, 0, now_ms=10, invisible_ms=5_000)
    last = inflight.change(mid, 0, now_ms=20, invisible_ms=5_000)  # mid is gone, only in memory
    assert sink.records == [] and not mid.live
    inflight.seal(ck)
    assert sink.records == [("ck", last.ck_id, 0), ("ck", ck.ck_id, 0b01)]
    inflight.check()


def test_a_fifo_successor_holding_several_moved_entries_is_logged_once():
    sink, inflight, qs = books(buffer_ms=1_000)
    qs.pop_offset = 3
    ck = inflight.open(qs, "t", [0, 1, 2], [1, 1, 1], now_ms=0, invisible_ms=500, fifo=True)
    [due] = inflight.due(500, 10)
    inflight.expire(due)
    again = inflight.open(qs, "t", [0, 1], [2, 2], now_ms=600, invisible_ms=5_000, fifo=True, aging_ms=0)
    inflight.settle(ck, 0, again)
    inflight.settle(ck, 1, again)
    inflight.seal(ck)  # e.g. its last entry forwarded to the DLQ
    assert sink.records == [("ck", again.ck_id, 0), ("ck", ck.ck_id, 0b011)]
    inflight.check()


def test_aging_logs_a_successor_before_its_source():
    sink, inflight, qs = books(buffer_ms=1_000)
    qs.pop_offset = 2
    ck = inflight.open(qs, "t", [0, 1], [1, 1], now_ms=0, invisible_ms=60_000, fifo=False)
    new = inflight.change(ck, 1, now_ms=10, invisible_ms=60_000)
    assert inflight.age(1_000) == 2  # same lineage, same log-by time
    assert sink.records == [("ck", new.ck_id, 0), ("ck", ck.ck_id, 0b10)]
    inflight.check()


def test_successor_inherits_the_lineage_age():
    sink, inflight, qs = books(buffer_ms=1_000)
    qs.pop_offset = 1
    ck = inflight.open(qs, "t", [0], [1], now_ms=0, invisible_ms=60_000, fifo=False)
    new = inflight.change(ck, 0, now_ms=900, invisible_ms=60_000)
    inflight.age(1_000)
    assert sink.records == [("ck", new.ck_id, 0)]  # logged at lineage start + buffer, not 1_900


def test_due_and_finish_and_stale_lookup():
    sink, inflight, qs = books()
    qs.pop_offset = 2
    ck = inflight.open(qs, "t", [0, 1], [1, 2], now_ms=0, invisible_ms=5_000, fifo=False)
    assert inflight.due(4_999, 10) == []
    assert inflight.due(5_000, 10) == [ck]
    assert inflight.find(ck.ck_id, 1, 0, 1, "g", "t") is ck
    inflight.finish(ck)
    with pytest.raises(errors.InvalidReceiptHandle):
        inflight.find(ck.ck_id, 1, 0, 1, "g", "t")
    assert qs.consume_offset() == 2
    assert inflight.next_deadline() is None
    inflight.check()


def test_due_stops_at_an_entry_budget_counting_unsettled_entries_only():
    sink, inflight, qs = books()
    qs.pop_offset = 96
    cks = [inflight.open(qs, "t", list(range(32 * i, 32 * i + 32)), [1] * 32, now_ms=i, invisible_ms=5_000,
                         fifo=False) for i in range(3)]
    for i in range(20):
        inflight.settle(cks[1], i)  # 12 unsettled left
    assert inflight.due(5_002, 10, entries_max=1) == cks[:1]  # the first is taken whatever its size
    for ck in cks[:1]:
        inflight.finish(ck)
    assert inflight.due(5_002, 10, entries_max=13) == cks[1:]  # 12 < 13: the next one too
    for ck in cks:
        inflight.postpone(ck, 6_000) if ck.live else None
    assert inflight.due(6_000, 10, entries_max=12) == cks[1:2]  # 12 reached: stop
    inflight.check()


def test_fifo_blocking_and_pending():
    sink, inflight, qs = books()
    qs.pop_offset = 2
    ck = inflight.open(qs, "t", [0, 1], [1, 1], now_ms=0, invisible_ms=5_000, fifo=True)
    assert qs.fifo_inflight == 1
    inflight.settle(ck, 0)
    [due] = inflight.due(5_000, 10)
    inflight.expire(due)
    assert qs.fifo_inflight == 0 and qs.pending == [ck]
    inflight.age(5_000)
    assert inflight.next_deadline() is None  # pending entries wait for a receive, not a timer
    again = inflight.open(qs, "t", [1], [2], now_ms=5_000, invisible_ms=5_000, fifo=True)
    inflight.settle(ck, 1)
    assert qs.pending == [] and qs.fifo_inflight == 1
    inflight.settle(again, 0)
    assert qs.fifo_inflight == 0 and qs.consume_offset() == 2
    inflight.check()


def test_ids_are_never_reused_across_generations():
    sink, inflight, qs = books()
    a = inflight.open(qs, "t", [0], [1], now_ms=0, invisible_ms=1_000, fifo=False)
    inflight.set_generation(6)
    b = inflight.open(qs, "t", [1], [1], now_ms=0, invisible_ms=1_000, fifo=False)
    assert a.ck_id != b.ck_id and b.ck_id >> 32 == 6


def test_attempt_cache_returns_only_entries_in_flight():
    sink, inflight, qs = books()
    ck = inflight.open(qs, "t", [0, 1], [1, 1], now_ms=0, invisible_ms=5_000, fifo=False)
    inflight.remember_attempt(("c", "g", "t", "a"), ["p0", "p1"], [(ck, 0), (ck, 1)])
    assert inflight.recall_attempt(("c", "g", "t", "a"), 10) == ["p0", "p1"]
    inflight.settle(ck, 0)
    assert inflight.recall_attempt(("c", "g", "t", "a"), 10) == ["p1"]
    assert inflight.recall_attempt(("c", "g", "t", "a"), 5_000) is None
    assert inflight.recall_attempt(("c", "g", "t", "other"), 10) is None


def test_deadline_heap_does_not_keep_acked_cks():
    sink, inflight, qs = books()
    for i in range(20_000):
        qs.pop_offset = i + 1
        ck = inflight.open(qs, "t", [i], [1], now_ms=0, invisible_ms=60_000, fifo=False)
        inflight.settle(ck, 0)
    assert not inflight.cks
    assert len(inflight._deadlines) <= 2 * len(inflight.cks) + 4096 + 1
    assert qs.consume_offset() == 20_000


def test_heap_rebuild_keeps_every_live_ck_once():
    sink, inflight, qs = books()
    live = []
    for i in range(10_000):
        qs.pop_offset = i + 1
        ck = inflight.open(qs, "t", [i], [1], now_ms=0, invisible_ms=1_000 + i % 7, fifo=False)
        if i % 100:
            inflight.settle(ck, 0)
        else:
            live.append(ck)
    due = inflight.due(10_000, 100_000)
    assert sorted(c.ck_id for c in due) == sorted(c.ck_id for c in live)
