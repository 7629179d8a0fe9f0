"""The write pipeline's per-batch encoders give exactly what the per-message ones give, and the
store hands dispatched delayed records to the timer without calling it (issue 21)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from sourcekit import from_source
from storekit import open_store

from chronoq.broker import trace
from chronoq.core.clock import FakeClock
from chronoq.store import record
from chronoq.store.store import Prepared
from chronoq.timer import handle

NOW = 1_700_000_000_000
_ASCII_ID = st.binary(min_size=1, max_size=128).map(lambda b: bytes(0x21 + x % 94 for x in b))
_TOPIC = st.text(st.characters(min_codepoint=0x21, max_codepoint=0x2FF), min_size=1, max_size=60)
_I64 = st.integers(-(2**63), 2**63 - 1)
_GROUP = st.one_of(st.just(""), st.text(st.characters(min_codepoint=0x21, max_codepoint=0x7E), min_size=1, max_size=40))


@settings(derandomize=True, database=None, deadline=None, max_examples=300)
@given(st.sampled_from([handle.TIMER, handle.IMMEDIATE]),
       st.lists(st.tuples(_I64, _I64, _TOPIC, _ASCII_ID, st.booleans()), max_size=30), _GROUP, st.booleans())
def test_handles_of_a_batch_are_the_handles_one_at_a_time(kind, rows, group, crc_in_cpu):
    """encode_many (the delayed send path; compiled, handle.pxd's C loop, the CRC by the CPU's
    instruction or by google_crc32c) == encode per message (struct, binascii and google_crc32c),
    for any position, due time, topic (non-ASCII too), id (bytes or str) and minting group,
    whatever base64 padding each needs."""
    ids = [mid if as_bytes else mid.decode() for _p, _d, _t, mid, as_bytes in rows]
    saved = handle._CRC_IN_CPU
    handle._CRC_IN_CPU = crc_in_cpu and saved
    try:
        got = handle.encode_many(kind, [r[0] for r in rows], [r[1] for r in rows], [r[2] for r in rows], ids, group)
    finally:
        handle._CRC_IN_CPU = saved
    assert got == [handle.encode(kind, 0, p, d, t, mid.decode(), group) for p, d, t, mid, _b in rows]
    for text, (p, d, t, mid, _b) in zip(got, rows):
        assert handle.decode(text) == handle.RecallHandle(kind, 0, p, d, t, mid.decode(), group)


def test_handles_at_the_field_bounds():
    """255-byte topic, id and group (the longest a length byte holds): the C loop's buffers hold
    them; 256 is refused as ``encode`` refuses it."""
    topic, mid, group = "t" * 253 + "é", b"i" * 255, "g" * 255  # 255 bytes each (é is two)
    got = handle.encode_many(handle.TIMER, [2**63 - 1], [-(2**63)], [topic], [mid], group)
    assert got == [handle.encode(handle.TIMER, 0, 2**63 - 1, -(2**63), topic, mid.decode(), group)]
    for bad in ((["t" * 256], [mid]), ([topic], [b"i" * 256])):
        with pytest.raises(AssertionError):
            handle.encode_many(handle.TIMER, [1], [1], *bad)


_PREPARED = st.builds(
    lambda topic, qid, flags, born, due, mid, tag, keys, props, body: Prepared(
        topic, qid, flags, born, due if flags & record.FLAG_DELAYED else 0, mid, tag.encode(),
        record.encode_keys(keys), record.encode_properties(props), body),
    st.sampled_from(["a", "b", "ü-topic"]), st.integers(0, 3),
    st.sampled_from([0, record.FLAG_DELAYED, record.FLAG_SYSTEM]), st.integers(0, 2**62),
    st.integers(NOW + 1, NOW + 10**9), _ASCII_ID, st.sampled_from(["", "red", "ß"]),
    st.lists(st.text(st.characters(min_codepoint=0x30, max_codepoint=0x7A), min_size=1, max_size=5), max_size=3),
    st.dictionaries(st.text(st.characters(min_codepoint=0x41, max_codepoint=0x5A), min_size=1, max_size=4),
                    st.text(st.characters(min_codepoint=0x30, max_codepoint=0x39), max_size=4), max_size=3),
    st.binary(min_size=1, max_size=300))


@settings(derandomize=True, database=None, deadline=None, max_examples=40)
@given(st.lists(st.lists(_PREPARED, min_size=1, max_size=12), min_size=1, max_size=4))
def test_store_write_lays_down_the_records_the_codec_encodes(tmp_path_factory, batches):
    """Store.write encodes a batch with one record.encode_batch call (the codec's loop): every record is
    byte for byte ``record.encode`` of its fields, with its queue offset, store time and the
    CONTINUES flag of all but the batch's last, back to back from where the batch begins."""
    store = open_store(tmp_path_factory.mktemp("s"), clock=FakeClock(NOW), segment_bytes=4096)
    try:
        next_qoff: dict[tuple[str, int], int] = {}
        for batch in batches:
            written = store.write(batch)
            for i, (p, w) in enumerate(zip(batch, written)):
                delayed = p.flags & record.FLAG_DELAYED
                qoff = 0 if delayed else next_qoff.get((p.topic, p.queue_id), 0)
                if not delayed:
                    next_qoff[(p.topic, p.queue_id)] = qoff + 1
                # One append: every record but the last says another follows (record.FLAG_CONTINUES).
                flags = p.flags | (record.FLAG_CONTINUES if i < len(batch) - 1 else 0)
                want = record.encode(flags, p.queue_id, qoff, p.born_ms, NOW, p.deliver_at_ms, p.topic.encode(),
                                     p.message_id, p.tag, p.keys, p.properties, p.body)
                assert (w.queue_offset, w.size) == (qoff, len(want))
                assert store.log.read(w.commit_offset, w.size) == want
            store.dispatch(store.sync())
    finally:
        store.close()


@settings(derandomize=True, database=None, deadline=None, max_examples=200)
@given(st.lists(_PREPARED, max_size=20), st.booleans())
def test_stored_events_of_a_batch_are_the_events_one_at_a_time(rows, level_records):
    """TraceRecorder.stored (columns per batch) adds the events the per-message rule gives: a
    system record skipped unless it is a delay-level record (traced under its real topic,
    delayed), a FLAG_DELAYED one flagged delayed, with its due time."""
    delay_topic = "%DELAY%"
    if level_records:  # some system records become delay-level records
        rows = [p._replace(topic=delay_topic, properties=record.encode_properties({"__DELAY_TOPIC": "real"}))
                if p.flags & record.FLAG_SYSTEM and i % 2 else p for i, p in enumerate(rows)]
    recorder = trace.TraceRecorder(1000, delay_topic)
    recorder.stored(rows, NOW)
    want = []
    for p in rows:  # the rule, one message at a time
        if p.flags & record.FLAG_SYSTEM:
            if p.topic != delay_topic:
                continue
            topic, flags = record.decode_properties(p.properties).get("__DELAY_TOPIC", p.topic), trace.FLAG_DELAYED
        else:
            topic, flags = p.topic, trace.FLAG_DELAYED if p.flags & record.FLAG_DELAYED else 0
        want.append((trace.STORED, flags, 0, topic, p.message_id, None, None, 0, NOW, p.deliver_at_ms, 0))
    assert recorder.events.tuples() == want
    assert recorder.events.consistent()


def test_a_plain_or_delayed_batch_of_one_topic_adds_the_events_stored_gives():
    """TraceRecorder.stored_plain (a batch of one topic, all plain or all delayed: the send path's
    batches) adds exactly the events ``stored`` gives for the same records."""
    ids = [b"ID%d" % i for i in range(5)]
    dues = [NOW + 60_000 + i for i in range(5)]
    for flags, due_col in ((0, [0] * 5), (record.FLAG_DELAYED, dues)):
        rows = [Prepared("t", 0, flags, NOW, d, m, b"", b"", b"", b"x") for d, m in zip(due_col, ids)]
        by_rows, by_batch = trace.TraceRecorder(1000, "%DELAY%"), trace.TraceRecorder(1000, "%DELAY%")
        by_rows.stored(rows, NOW)
        by_batch.stored_plain("t", ids, NOW, due_col if flags else None)
        assert by_batch.events.tuples() == by_rows.events.tuples() and by_batch.events.consistent()


def test_the_store_queues_dispatched_delayed_records_for_the_timer_to_take(tmp_path):
    """A store with no timer attached dispatches delayed records onto ``delayed_dispatched``
    (the store calls nothing above it), in log order, once each, only once they are dispatched."""
    store = open_store(tmp_path, clock=FakeClock(NOW))
    try:
        rows = [Prepared("t", 0, record.FLAG_DELAYED, NOW, NOW + 60_000 + i, b"D%d" % i, b"", b"", b"", b"x")
                for i in range(3)]
        plain = Prepared("t", 0, 0, NOW, 0, b"P", b"", b"", b"", b"y")
        written = store.write([rows[0], plain, rows[1]])
        assert not store.delayed_dispatched  # written, not yet dispatched
        store.dispatch(store.sync())
        written += store.write([rows[2]])
        store.dispatch(store.sync())
        store.dispatch(store.sync())  # nothing new: nothing queued twice
        delayed = [w for w, p in zip(written, [rows[0], plain, rows[1], rows[2]]) if p.flags]
        records = [(w.commit_offset, w.size, NOW + 60_000 + i) for i, w in enumerate(delayed)]
        # One entry per append: its delayed records and their bytes back to back (the timer reads
        # nothing back), the span from the first one's offset to the last one's end.
        read = [store.log.read(w.commit_offset, w.size) for w in delayed]
        heads = [r[record.CRC_START:len(r) - 1] for r in read]  # (each body is one byte)
        first, last = delayed[0], delayed[1]
        assert list(store.delayed_dispatched) == [
            (first.commit_offset, last.commit_offset + last.size - first.commit_offset, records[:2], read[0] + read[1],
             heads[0] + heads[1]),
            (delayed[2].commit_offset, delayed[2].size, records[2:], read[2], heads[2])]
        assert store.bounds("t", 0) == (0, 1)  # only the plain record has a consume-queue entry
    finally:
        store.close()


def test_one_dispatch_writes_a_queues_entries_of_several_batches_at_once_and_again_after_a_failure(
        tmp_path, monkeypatch):
    """Lone sends of one group commit are one batch each: dispatch joins a queue's entries of
    every batch below the limit into one run (one consume-queue write per queue). A write that
    fails leaves every batch pending: the next dispatch writes them all (positional, harmless)
    and queues their delayed records once."""
    from chronoq.store.consumequeue import ConsumeQueue

    store = open_store(tmp_path, clock=FakeClock(NOW))
    puts = []
    real_put = ConsumeQueue.put
    fail = [True]

    def put(cq, first, entries):
        if fail[0]:
            fail[0] = False
            raise OSError(28, "No space left on device")
        puts.append((cq.queue_id, first, len(entries) // 20))
        return real_put(cq, first, entries)

    monkeypatch.setattr(ConsumeQueue, "put", put)
    try:
        delayed = Prepared("t", 0, record.FLAG_DELAYED, NOW, NOW + 60_000, b"D", b"", b"", b"", b"x")
        for i in range(3):
            store.write([Prepared("t", 0, 0, NOW, 0, b"P%d" % i, b"", b"", b"", b"y")])
            store.write([Prepared("t", 1, 0, NOW, 0, b"Q%d" % i, b"", b"", b"", b"y")])
        store.write([delayed])
        synced = store.sync()
        try:
            store.dispatch(synced)
        except OSError:
            pass
        assert store.dispatched == 0 and not store.delayed_dispatched and not puts
        assert store.dispatch(synced) == synced
        assert sorted(puts) == [(0, 0, 3), (1, 0, 3)]  # one write per queue for the seven batches
        assert store.bounds("t", 0) == (0, 3) and store.bounds("t", 1) == (0, 3)
        assert len(store.delayed_dispatched) == 1
        assert [m.message_id for m in store.read("t", 0, 0, 10)[0]] == ["P0", "P1", "P2"]
    finally:
        store.close()


def test_kept_stored_batches_become_events_in_the_order_of_the_hooks():
    """The send path's hook keeps its batch (``stored_plain``); any other hook, and reading the
    events, turns the kept batches into events first, so the buffer keeps the hooks' order."""
    rec = trace.TraceRecorder(1000, "%DELAY%")
    rec.stored_plain("t", [b"A", b"B"], NOW)
    rec.dead_lettered("g", "t", "X", NOW + 1)
    rec.stored_plain("t", [b"C"], NOW + 2, [NOW + 60_000])
    rec.stored_plain("u", [b"D"], NOW + 3)
    assert rec.due(NOW + 3 + 1000) and not rec.due(NOW + 2)
    got = [(e[0], e[1], e[3], e[4], e[8], e[9]) for e in rec.events.tuples()]
    assert got == [(trace.STORED, 0, "t", b"A", NOW, 0), (trace.STORED, 0, "t", b"B", NOW, 0),
                   (trace.DEAD_LETTERED, 0, "t", "X", NOW + 1, 0),
                   (trace.STORED, trace.FLAG_DELAYED, "t", b"C", NOW + 2, NOW + 60_000),
                   (trace.STORED, 0, "u", b"D", NOW + 3, 0)]
    assert rec.events.consistent() and len(rec.take_events()) == 5 and not rec.due(NOW + 10**6)


def _receive_from_source():
    """receive.py loaded from its source: the pure build's ``_message``, whichever build ``receive`` is."""
    from chronoq.protocol.rocketmq import receive

    return from_source(receive, "receive_from_source")


_BYTES = st.binary(max_size=300)


@settings(derandomize=True, database=None, deadline=None, max_examples=300)
@given(st.lists(_BYTES, min_size=9, max_size=9), st.lists(_I64, min_size=5, max_size=5),
       st.integers(-5, 300), st.binary(max_size=20_000))
def test_a_received_message_is_written_as_the_python_writer_writes_it(parts, numbers, attempt, body):
    """receive.messages_bytes' per-message writer: compiled, receive.pxd's C writer (sizes worked
    out first, one buffer); it gives the bytes of receive.py's own writer for any parts (empty or
    not), any times (negative ones too: divmod's floor), any queue id and offset (negative ones
    as ten-byte varints), an attempt below 1 (written as 1) and bodies past one length byte."""
    from chronoq.protocol.rocketmq import receive

    source = _receive_from_source()
    head, user, tag_keys, mid, digest_field, digest, type_field, group_field, dlq_field = parts
    born, stored, due, queue_id, offset = numbers
    host = receive.store_host_field("127.0.0.1:8081")
    for deliver_at in (0, due):
        args = (head, user, tag_keys, mid, digest_field, digest, type_field, born, stored, host, deliver_at,
                b"handle-" + mid, queue_id, offset, attempt, group_field, dlq_field, body)
        assert receive._message(*args) == source._message(*args)
    with pytest.raises(TypeError):  # (the C writer reads its parts as bytes: None is refused)
        receive._message(head, user, tag_keys, mid, digest_field, digest, type_field, born, stored, host, 0,
                         b"h", queue_id, offset, attempt, group_field, dlq_field, None)
