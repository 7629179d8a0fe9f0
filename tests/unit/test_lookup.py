"""Message lookup (chronoq.features.lookup, chronoq.features.lifeline) on a real embedded broker with a fake clock.

The traffic is real (broker, timer, POP service, trace recorder); the lookup's pieces are
checked against it: the bounded commit-log scan by id and key, the recall handles it rebuilds
(they must recall the message), and the life the trace search assembles.
"""

from __future__ import annotations

from chronoq.broker import trace
from chronoq.features import lifeline, lookup
from chronoq.broker.trace import TRACE_TOPIC

from popkit import Node, loop_turns_during

BIG = 1 << 30  # scan everything


def _trace_bodies(broker) -> list[bytes]:
    broker.write_trace()
    broker.flush()
    lo, hi = broker.queue_bounds(TRACE_TOPIC, 0)
    return [m.body for m in broker.read(TRACE_TOPIC, 0, lo, max(1, hi - lo)).messages]


def _life(broker, ids: set[str]) -> lifeline.TraceSearch:
    search = lifeline.TraceSearch(ids)
    for body in _trace_bodies(broker):
        search.feed(body)
    return search


def test_scan_finds_every_record_of_a_key_and_the_life_of_its_message(tmp_path):
    node = Node(str(tmp_path), flush_policy="sync").open()
    broker, pop, clock = node.broker, node.pop, node.clock
    pop.set_group("g", max_attempts=2)
    pop.set_group("h")
    poison = broker.send("orders", b"poison", keys=("order-7", "customer-3"))
    other = broker.send("orders", b"fine", keys=("order-8",))
    broker.write_trace()  # the deliveries and acks below go to later trace records
    [p1, p2] = pop.receive("g", "orders", max_messages=4, invisible_ms=1_000)
    [q1, q2] = pop.receive("h", "orders", max_messages=4, invisible_ms=1_000)
    for q in (q1, q2):
        pop.ack("h", "orders", q.receipt_handle)
    fine = p1 if p1.message.message_id == other.message_id else p2
    pop.ack("g", "orders", fine.receipt_handle)
    broker.write_trace()
    node.advance(60_000)  # invisible time ends: a retry copy, then (attempt 2) ...
    [r] = pop.receive("g", "orders", max_messages=4, invisible_ms=1_000)
    assert r.message.message_id == poison.message_id and r.delivery_attempt == 2
    node.advance(60_000)  # ... the dead letter
    broker.flush()

    now = clock.wall_ms()
    report = lookup.scan_log(broker.store.log, "customer-3", BIG, now)
    assert [f.kind for f in report.records] == ["stored", "retry copy", "dead letter"]
    assert {f.origin_id for f in report.records} == {poison.message_id}
    assert report.records[0].commit_offset == poison.commit_offset
    assert all(f.recall_handle is None for f in report.records)  # nothing pending to recall
    by_id = lookup.scan_log(broker.store.log, poison.message_id, BIG, now)
    assert [f.commit_offset for f in by_id.records] == [f.commit_offset for f in report.records]
    assert lookup.scan_log(broker.store.log, "order-", BIG, now).records == []  # whole keys only

    search = _life(broker, {poison.message_id})
    events = search.timeline()
    got = [(e["kind"], e["group"], e["attempt"]) for e in events]
    assert got[0] == ("stored", None, 0)
    assert sorted(got[1:]) == sorted([("delivered", "g", 1), ("delivered", "h", 1), ("acked", "h", 0),
                                      ("delivered", "g", 2), ("dead_lettered", "g", 0)])
    assert lifeline.summary(events, now)["status"] == "dead-lettered (g); acked (h)"
    # The other message's ack (same group, a neighbouring offset) is not mixed in.
    fine_life = _life(broker, {other.message_id}).timeline()
    assert [e["kind"] for e in fine_life] == ["stored", "delivered", "delivered", "acked", "acked"]
    assert lifeline.summary(fine_life, now)["status"] == "acked (g); acked (h)"
    node.close()


def test_rebuilt_recall_handles_recall_pending_messages(tmp_path):
    node = Node(str(tmp_path), flush_policy="sync").open()
    broker, clock = node.broker, node.clock
    now = clock.wall_ms()
    timer = broker.send("orders", b"timer", keys=("cancel-1",), deliver_at_ms=now + 3_600_000)
    level = broker.send("orders", b"level", keys=("cancel-2",), delay_level=3)
    due = broker.send("orders", b"due", keys=("cancel-3",), deliver_at_ms=now + 1_000)
    clock.advance(1_000)
    broker.timer_tick()
    now = clock.wall_ms()
    [t] = lookup.scan_log(broker.store.log, "cancel-1", BIG, now).records
    assert t.kind == "scheduled" and t.recall_handle == timer.recall_handle
    [lv] = lookup.scan_log(broker.store.log, "cancel-2", BIG, now).records
    assert lv.kind == "scheduled" and lv.origin_topic == "orders" and lv.recall_handle == level.recall_handle
    found = lookup.scan_log(broker.store.log, "cancel-3", BIG, now).records
    assert [f.kind for f in found] == ["scheduled", "made visible (timer copy)"]
    assert all(f.recall_handle is None for f in found)  # due: nothing to recall
    assert broker.recall(t.recall_handle).outcome.value == "cancelled"
    assert broker.recall(lv.recall_handle).outcome.value == "cancelled"
    events = _life(broker, {timer.message_id, due.message_id}).timeline()
    mine = [e["kind"] for e in events if e["message_id"] == timer.message_id]
    assert mine == ["stored", "recalled"]
    assert lifeline.summary([e for e in events if e["message_id"] == due.message_id], now)["status"] == \
        "visible, not yet received"
    node.close()


def test_a_copy_written_ahead_is_not_shown_as_visible_before_its_due_time(tmp_path):
    node = Node(str(tmp_path), flush_policy="sync", config={"timer_prewrite_ms": 50}).open()
    broker, clock = node.broker, node.clock
    broker.send("orders", b"soon", keys=("ahead-1",), deliver_at_ms=clock.wall_ms() + 1_000)
    broker.timer_tick()  # loads the bucket
    clock.advance(975)  # half the lead ahead: the copy is written (and fsynced), held
    broker.timer_tick()
    kinds = [f.kind for f in lookup.scan_log(broker.store.log, "ahead-1", BIG, clock.wall_ms()).records]
    assert kinds == ["scheduled", lifeline.KIND_HELD_COPY]
    clock.advance(25)  # its due time
    broker.timer_tick()
    kinds = [f.kind for f in lookup.scan_log(broker.store.log, "ahead-1", BIG, clock.wall_ms()).records]
    assert kinds == ["scheduled", "made visible (timer copy)"]
    node.close()


def test_a_bounded_scan_starts_on_a_record_boundary(tmp_path):
    node = Node(str(tmp_path), flush_policy="sync").open()
    broker = node.broker
    sent = [broker.send("bulk", b"x" * (100 + i % 37), keys=(f"k{i}",)) for i in range(400)]
    log = broker.store.log
    end = log.segments[-1].end
    starts = {s.commit_offset for s in sent}
    for window in (1, 500, 4096, 20_000):
        report = lookup.scan_log(log, "k399", window, broker.clock.wall_ms())
        assert report.damage == ""
        assert report.scanned_to == end
        assert report.scanned_from in starts or report.scanned_from == end
        assert report.scanned_from >= end - window
    last = lookup.scan_log(log, "k399", 4096, broker.clock.wall_ms())
    assert [f.message_id for f in last.records] == [sent[-1].message_id]
    assert lookup.scan_log(log, "k0", 4096, broker.clock.wall_ms()).records == []  # outside the window
    node.close()


def test_trace_search_skips_records_that_do_not_mention_the_message():
    e = (trace.STORED, 0, 0, "t", "other-id", None, None, 0, 1, 0, 0)
    body = trace.encode([e] * 100)
    search = lifeline.TraceSearch({"wanted"})
    search.feed(body)
    assert search.events == [] and search.records == 1
    # An id whose 4-byte string index appears in other fields (a ts of 0) is only matched in place.
    events = [(trace.STORED, 0, 0, "t", "wanted", None, None, 0, 0, 0, 0),
              (trace.STORED, 0, 0, "t", "x", None, None, 0, 0, 0, 0)]
    search.feed(trace.encode(events))
    assert [ev["message_id"] for ev in search.events] == ["wanted"]


def test_a_scan_whose_query_is_in_every_record_lets_the_event_loop_go_between_steps(tmp_path):
    """A query whose bytes are in every record (here the key prefix shared by all) walks and
    decodes them all: the lookup's scan lets other work run between steps of
    ``SCAN_STEP_RECORDS`` records (it ran in one go: 25 s at the 1 GiB allowed), and finds what
    the scan in one go finds."""
    import asyncio

    node = Node(str(tmp_path), flush_policy="async").open()
    broker = node.broker
    n = 3 * lookup.SCAN_STEP_RECORDS + 100
    for i in range(n):
        broker.send("busy", b"x", keys=(f"shared-{i}",))
    broker.send("busy", b"x", keys=("shared",))
    broker.flush()
    now = node.clock.wall_ms()

    report, turns = asyncio.run(loop_turns_during(lookup.scan_log_stepped(broker.store.log, "shared", BIG, now)))
    assert turns >= n // lookup.SCAN_STEP_RECORDS  # (in one go: 0)
    assert [f.commit_offset for f in report.records] == [
        f.commit_offset for f in lookup.scan_log(broker.store.log, "shared", BIG, now).records]
    assert len(report.records) == 1 and report.records[0].keys == ("shared",)
