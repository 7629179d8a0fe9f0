"""The message life trace (chronoq.broker.trace): the codec, and the hooks in send, timer, POP, recall."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from popkit import Node
from sourcekit import from_source

from chronoq.broker import trace
from chronoq.broker.trace import TRACE_TOPIC


def test_codec_round_trip_and_rejects_garbage():
    events = [(trace.STORED, trace.FLAG_DELAYED, 0, "t", b"ID1", None, None, 0, 5, 6, 0),
              (trace.DELIVERED, 0, 2, "t", "ID1", "g", "%RETRY%g_t", 1, 7, 0, 9),
              (trace.ACKED, 0, 0, None, None, "g", "%RETRY%g_t", 1, 8, 0, 9)]
    body = trace.encode(events)
    table, _raw, n = trace.decode(body)
    # Names once each (str or bytes alike); message ids once per event that has one.
    assert n == 3 and sorted(table) == sorted(["t", "g", "%RETRY%g_t", "ID1", "ID1"])
    got = trace.decode_events(body)
    assert [e["kind"] for e in got] == ["stored", "delivered", "acked"]
    assert got[1] == {"kind": "delivered", "flags": 0, "attempt": 2, "topic": "t", "message_id": "ID1",
                      "group": "g", "ref_topic": "%RETRY%g_t", "ref_queue": 1, "ts_ms": 7, "due_ms": 0,
                      "ref_offset": 9}
    for bad in (b"", b"XXXX" + body[4:], body[:-1]):
        with pytest.raises(ValueError):
            trace.decode(bad)


def _events(broker) -> list[dict]:
    broker.write_trace()
    broker.flush()
    out = []
    for m in broker.read(TRACE_TOPIC, 0, 0, 10_000).messages:
        out += trace.decode_events(m.body)
    return out


def test_hooks_record_a_message_life(tmp_path):
    node = Node(str(tmp_path), flush_policy="sync").open()
    broker, pop, clock = node.broker, node.pop, node.clock
    pop.set_group("g", max_attempts=1)
    now = clock.wall_ms()
    later = broker.send("orders", b"later", deliver_at_ms=now + 5_000)
    soon = broker.send("orders", b"soon")
    gone = broker.send("orders", b"gone", deliver_at_ms=now + 60_000)
    broker.flush()  # (async flush policy) the timer absorbs what is durable
    assert broker.recall(gone.recall_handle).outcome.value == "cancelled"
    [p] = pop.receive("g", "orders", max_messages=4, invisible_ms=1_000)
    assert p.message.message_id == soon.message_id
    clock.advance(5_000)
    broker.timer_tick()
    [q] = pop.receive("g", "orders", max_messages=4, invisible_ms=1_000)
    pop.ack("g", "orders", q.receipt_handle)
    node.advance(2_000)  # "soon" was never acked: with max_attempts 1 it is dead-lettered
    ev = _events(broker)
    by = {}
    for e in ev:
        by.setdefault((e["kind"], e["message_id"]), []).append(e)
    assert by[("stored", later.message_id)][0]["flags"] == trace.FLAG_DELAYED
    assert by[("stored", later.message_id)][0]["due_ms"] == now + 5_000
    assert by[("stored", soon.message_id)][0]["flags"] == 0
    [vis] = by[("visible", later.message_id)]
    assert vis["due_ms"] == now + 5_000 and vis["ts_ms"] >= now + 5_000
    assert by[("recalled", gone.message_id)][0]["topic"] == "orders"
    [d1] = by[("delivered", soon.message_id)]
    [d2] = by[("delivered", later.message_id)]
    assert d1["group"] == "g" and d1["attempt"] == 1 and d1["ref_topic"] == "orders"
    [ack] = [e for e in ev if e["kind"] == "acked"]
    assert (ack["group"], ack["ref_topic"], ack["ref_queue"], ack["ref_offset"]) == \
        ("g", d2["ref_topic"], d2["ref_queue"], d2["ref_offset"])
    assert by[("dead_lettered", soon.message_id)][0]["group"] == "g"
    assert not any(e["topic"] and e["topic"].startswith("%") for e in ev if e["kind"] == "stored")
    node.close()


def test_trace_off_records_nothing(tmp_path):
    from chronoq.broker.broker import Broker
    from chronoq.core.config import BrokerConfig

    broker = Broker(BrokerConfig(data_dir=str(tmp_path), trace_enabled=False))
    broker.send("orders", b"x")
    assert broker.trace is None and broker.write_trace() == 0 and TRACE_TOPIC not in broker.topics
    broker.close()


def test_buffer_is_bounded(monkeypatch):
    monkeypatch.setattr(trace, "BUFFER_MAX", 3)
    rec = trace.TraceRecorder(1000, "DELAY")
    for i in range(5):
        rec.dead_lettered("g", "t", f"ID{i}", 1)
    assert len(rec.events) == 3 and rec.dropped == 2
    assert len(trace.bodies(rec.take_events())) == 1 and len(rec.events) == 0 and rec.written == 3
    rec.stored_plain("t", [b"A", b"B", b"C", b"D"], 2)  # a batch past the bound: its tail is dropped
    assert len(rec.events) == 3 and rec.events.consistent() and rec.dropped == 3
    assert [e[4] for e in rec.events.tuples()] == [b"A", b"B", b"C"]


def test_visible_adds_one_event_per_release_by_columns(monkeypatch):
    """``visible`` extends the columns for a whole release at once: the same events as one
    ``add`` per delivery, after what was there, and the buffer's bound still holds."""
    from types import SimpleNamespace as NS

    rec = trace.TraceRecorder(1000, "DELAY")
    rec.dead_lettered("g", "t", "ID0", 1)
    released = [NS(prepared=NS(topic=f"t{i % 3}", message_id=f"M{i}".encode()), due_ms=1_000 + i) for i in range(5)]
    columns = ([d.prepared.topic for d in released], [d.prepared.message_id for d in released],
               [d.due_ms for d in released])
    rec.visible(*columns, 2_000)
    expected = trace.Events.from_tuples(
        [(trace.VISIBLE, 0, 0, d.prepared.topic, d.prepared.message_id, None, None, 0, 2_000, d.due_ms, 0)
         for d in released])
    assert rec.events.consistent() and rec.events[1:].tuples() == expected.tuples()
    monkeypatch.setattr(trace, "BUFFER_MAX", 4)
    rec.visible(*columns, 3_000)  # past the bound: the tail is dropped, the columns stay aligned
    assert len(rec.events) == 4 and rec.events.consistent() and rec.dropped == 5 + 2


def test_take_events_then_bodies_in_slices_keep_order():
    """The server takes the events at once and encodes/writes them in slices (runtime)."""
    rec = trace.TraceRecorder(flush_ms=1_000, delay_topic="CHRONOQ_DELAY")
    rec.events = trace.Events.from_tuples(
        [(trace.STORED, 0, 0, "t", f"ID{i}", None, None, 0, i, 0, 0) for i in range(10)])
    rec._first_ms = 5
    assert rec.due(5 + 1_000)
    events = rec.take_events()
    assert len(rec.events) == 0 and rec.written == 10 and not rec.due(10**12)
    got = [e["message_id"] for part in (events[:4], events[4:]) for b in trace.bodies(part)
           for e in trace.decode_events(b)]
    assert got == [f"ID{i}" for i in range(10)]


_TEXT = st.one_of(st.none(), st.sampled_from(["t", "orders", "%RETRY%g_t", "ü-topic"]))
_ID = st.one_of(st.none(), st.text(st.characters(min_codepoint=0x21, max_codepoint=0x7E), min_size=1, max_size=8))


@settings(derandomize=True, database=None, deadline=None, max_examples=200)
@given(st.lists(st.tuples(
    st.integers(1, 7), st.integers(0, 255), st.integers(0, 0xFFFF), _TEXT, _ID, _TEXT, _TEXT,
    st.integers(0, 0xFFFF), st.integers(-(2**63), 2**63 - 1), st.integers(-(2**63), 2**63 - 1),
    st.integers(0, 2**63 - 1), st.booleans()), min_size=1, max_size=40))
def test_columns_encode_every_event_as_given(rows):
    """Events go in as columns (message ids as str or UTF-8 bytes) and come out of a record body
    field for field, each name (topic, group) once in the table."""
    events = [(k, f, a, t, (m.encode() if as_bytes and m is not None else m), g, rt, rq, ts, due, ro)
              for k, f, a, t, m, g, rt, rq, ts, due, ro, as_bytes in rows]
    columns = trace.Events.from_tuples(events)
    assert columns.tuples() == events
    body = trace.encode(columns)
    table, _raw, n = trace.decode(body)
    names = {r[i] for r in rows for i in (3, 5, 6)} - {None}  # topic, group, ref_topic
    ids = [r[4] for r in rows if r[4] is not None]
    assert n == len(events) and len(table) == len(names) + len(ids)
    got = trace.decode_events(body)
    for e, (k, f, a, t, m, g, rt, rq, ts, due, ro, _b) in zip(got, rows):
        assert (e["kind"], e["flags"], e["attempt"], e["topic"], e["message_id"], e["group"], e["ref_topic"],
                e["ref_queue"], e["ts_ms"], e["due_ms"], e["ref_offset"]) == (
            trace.KIND_NAMES[k], f, a, t, m, g, rt, rq, ts, due, ro)
    # Slices (the server writes a buffer in steps) encode the same events.
    half = len(columns) // 2
    parts = [columns[:half], columns[half:]] if half else [columns]
    assert [e for part in parts for e in trace.decode_events(trace.encode(part))] == got


_PURE = from_source(trace, "chronoq_trace_pure")


def _receive_refs(rows):
    """(popped, refs) of a receive: each row (topic, id, attempt, ref topic, queue id, offset)."""
    from types import SimpleNamespace as NS

    popped, refs = [], []
    for topic, mid, attempt, ref_topic, queue_id, offset in rows:
        popped.append(NS(message=NS(topic=topic, message_id=mid), delivery_attempt=attempt))
        ck = NS(queue=NS(topic=ref_topic, queue_id=queue_id), offsets=[-1, offset])
        refs.append((ck, 1))
    return popped, refs


@settings(derandomize=True, database=None, deadline=None, max_examples=200)
@given(st.lists(st.tuples(_TEXT, _ID, st.integers(1, 2**20), st.sampled_from(["t", "%RETRY%g_t"]),
                          st.integers(0, 2**32 - 1), st.integers(-(2**63), 2**63 - 1)), max_size=40),
       st.integers(0, 3), st.integers(-(2**63), 2**63 - 1))
def test_receive_and_ack_events_as_the_pure_build_appends_them(rows, before, now_ms):
    """``_add_refs`` (a receive's events, an ack's) appends what the pure build's column extends
    append, after what the buffer held: on the compiled build that is trace.pxd's C loop, held
    here to the Python one (attempts past 0xFFFF are stored as 0xFFFF)."""
    popped, refs = _receive_refs(rows)
    held = [(trace.STORED, 1, 0, "t", f"ID{i}", None, None, 0, i, 5, 0) for i in range(before)]
    for kind, given_popped in ((trace.DELIVERED, popped), (trace.ACKED, None)):
        got, want = trace.Events.from_tuples(held), _PURE.Events.from_tuples(held)
        trace._add_refs(got, kind, "g", given_popped, refs, now_ms)
        _PURE._add_refs(want, kind, "g", given_popped, refs, now_ms)
        assert got.consistent() and got.tuples() == want.tuples()
        for name in trace.Events.__slots__:  # (the same column types: encode casts the arrays)
            assert type(getattr(got, name)) is type(getattr(want, name))
            assert getattr(getattr(got, name), "typecode", None) == getattr(getattr(want, name), "typecode", None)
        if kind == trace.DELIVERED:
            assert [e[2] for e in got.tuples()[before:]] == [min(r[2], 0xFFFF) for r in rows]


def test_receive_events_refuse_what_the_columns_cannot_hold():
    """A queue id past 32 bits, a count of popped messages other than of refs: refused by both
    builds (the columns are arrays of fixed-size integers)."""
    for module in (trace, _PURE):
        popped, refs = _receive_refs([("t", "ID", 1, "t", 2**32, 0)])
        with pytest.raises(OverflowError):
            module._add_refs(module.Events(), trace.DELIVERED, "g", popped, refs, 1)
        popped, refs = _receive_refs([("t", "ID", 1, "t", 0, 0)] * 2)
        with pytest.raises(AssertionError):
            module._add_refs(module.Events(), trace.DELIVERED, "g", popped[:1], refs, 1)


@settings(derandomize=True, database=None, deadline=None, max_examples=200)
@given(st.lists(st.tuples(st.sampled_from(["t", "orders", "ü-topic"]), st.lists(st.binary(min_size=1, max_size=6), max_size=33),
                          st.integers(-(2**63), 2**63 - 1), st.booleans(), st.integers(-(2**63), 2**63 - 1)),
                max_size=6), st.integers(0, 3))
def test_kept_send_batches_spill_as_the_pure_build_appends_them(batches, before):
    """``_add_runs`` (``stored_plain``'s kept batches, plain or delayed, as events) appends what
    the pure build's column extends append: on the compiled build trace.pxd's C loop."""
    runs = [(topic, ids, now_ms, [due + i for i in range(len(ids))] if delayed else None)
            for topic, ids, now_ms, delayed, due in batches if not delayed or due + len(ids) < 2**63]
    held = [(trace.ACKED, 0, 0, None, None, "g", "t", 1, 5, 0, 7) for _ in range(before)]
    got, want = trace.Events.from_tuples(held), _PURE.Events.from_tuples(held)
    trace._add_runs(got, runs)
    _PURE._add_runs(want, runs)
    assert got.consistent() and got.tuples() == want.tuples()
    events = got.tuples()[before:]
    assert [(e[0], e[1], e[3], e[4], e[8], e[9]) for e in events] == [
        (trace.STORED, 0 if dues is None else trace.FLAG_DELAYED, topic, mid, now_ms, 0 if dues is None else dues[i])
        for topic, ids, now_ms, dues in runs for i, mid in enumerate(ids)]


def test_stored_plain_batches_become_the_events_a_reader_sees():
    """The recorder keeps send batches and spills them, in order, before any other hook adds."""
    rec = trace.TraceRecorder(1000, "DELAY")
    rec.stored_plain("t", [b"A", b"B"], 10)
    rec.stored_plain("t", [b"C"], 11, [99])
    popped, refs = _receive_refs([("t", b"A", 1, "t", 0, 0)])
    rec.delivered("g", popped, refs, 12)
    assert [(e[0], e[1], e[4], e[8], e[9]) for e in rec.events.tuples()] == [
        (trace.STORED, 0, b"A", 10, 0), (trace.STORED, 0, b"B", 10, 0), (trace.STORED, trace.FLAG_DELAYED, b"C", 11, 99),
        (trace.DELIVERED, 0, b"A", 12, 0)]
