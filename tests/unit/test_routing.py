"""The dispatch walk: ``chronoq.store.recovery.iter_chunks`` (runs of whole, checked records read
from the log) and ``chronoq.store.routing.route`` (their consume-queue entries and the records a
timer follows), held to a reference walk that reads each segment whole and checks record by
record with ``record.check``. Runs on both builds (tests/unit/test_compiled.py); the compiled
walk (routing.pxd) is also held to the source's loop, run in the same process."""

from __future__ import annotations

import zlib

import pytest

from chronoq.core import errors
from chronoq.store import record, recovery, routing
from chronoq.store.consumequeue import ENTRY

from sourcekit import from_source
from storekit import open_store, prep

SMALL_CHUNK = 4096


def loaded(tmp_path):
    """A store over several segments: two topics (one not ASCII), tags or none, delayed records,
    records with a delivery time, and bodies larger than a read chunk (SMALL_CHUNK)."""
    store = open_store(tmp_path, segment_bytes=64 << 10)
    batch = []
    for i in range(400):
        topic = "orders" if i % 3 else "zählung"
        flags = record.FLAG_DELAYED if i % 17 == 0 else 0
        due = 1_700_000_000_000 + i if i % 17 == 0 or i % 23 == 0 else 0
        size = 9000 if i % 41 == 0 else 100 + i % 300
        batch.append(prep(topic, i % 3, bytes([i % 256]) * size, f"M{i:06d}", tag=("", "red", "blue")[i % 3],
                          flags=flags, deliver_at_ms=due))
        if len(batch) == 7:
            store.append(batch)
            batch = []
    store.append(batch)
    assert len(store.log.segments) > 2
    return store


def reference(store) -> list[tuple[int, bytes]]:
    """(commit offset, record bytes) of every record, each segment read whole and walked by check."""
    out = []
    for seg in store.log.segments:
        data = store.log.read(seg.base, seg.size)
        pos = 0
        while pos < len(data):
            length = record.check(data, pos, len(data))
            out.append((seg.base + pos, data[pos:pos + length]))
            pos += length
    return out


@pytest.fixture
def store(tmp_path, monkeypatch):
    monkeypatch.setattr(recovery, "READ_CHUNK", SMALL_CHUNK)  # (records larger than a chunk come whole)
    store = loaded(tmp_path)
    yield store
    store.close()


@pytest.mark.parametrize("checked", [False, True])
def test_chunks_hold_every_record_once_in_order(store, checked):
    want = reference(store)
    assert any(len(raw) > SMALL_CHUNK for _, raw in want)
    checked_end = store.log.written if checked else 0  # (below it: stepped over by length)
    got = []
    for at, chunk, p, stop in recovery.iter_chunks(store.log, store.log.min_offset, checked_end):
        while p < stop:
            length = record.check(chunk, p, stop)
            got.append((at + p, chunk[p:p + length]))
            p += length
    assert got == want
    middle = want[len(want) // 2][0]  # from a record boundary inside the log
    assert list(recovery.iter_records(store.log, middle)) == [r for r in want if r[0] >= middle]


def test_route_makes_the_entries_each_record_decodes_to(store):
    want_entries: dict[tuple[str, int], list[tuple[int, bytes]]] = {}
    want_taps = []
    for offset, raw in reference(store):
        f = record.decode(raw)
        if f["flags"] & record.FLAG_DELAYED or f["deliver_at_ms"]:
            want_taps.append(offset)
        if not f["flags"] & record.FLAG_DELAYED:
            entry = ENTRY.pack(offset, len(raw), zlib.crc32(f["tag"].encode()), f["stored_ms"])
            want_entries.setdefault((f["topic"], f["queue_id"]), []).append((f["queue_offset"], entry))

    runs_started, again = [], {}

    def add_entry(batch, key, qoff, entry):  # (Store._add_entry's first case: a queue's first run)
        assert key not in batch, key  # within one replay every queue's offsets follow on
        if batch is not again:
            runs_started.append(key)
        batch[key] = (qoff, bytearray(entry))

    batch, taps, made = {}, [], 0
    for at, chunk, p, stop in recovery.iter_chunks(store.log, store.log.min_offset):
        before = len(taps)
        made += routing.route(chunk, p, stop, at, batch, taps, add_entry)
        taps[before:] = [at + q for q in taps[before:]]
    assert taps == want_taps and len(want_taps) > 20
    assert made == sum(len(v) for v in want_entries.values())
    assert sorted(runs_started) == sorted(want_entries)
    for key, entries in want_entries.items():
        first, raw = batch[key]
        assert first == entries[0][0]
        assert bytes(raw) == b"".join(e for _, e in entries)
    # Without a follower (recovery, taps None) the same entries, and nothing listed.
    assert made == sum(routing.route(chunk, p, stop, at, again, None, add_entry)
                       for at, chunk, p, stop in recovery.iter_chunks(store.log, store.log.min_offset))
    assert {k: (q, bytes(e)) for k, (q, e) in again.items()} == {k: (q, bytes(e)) for k, (q, e) in batch.items()}


def test_damage_is_a_named_corruption_unless_below_checked_end(store):
    offset, raw = reference(store)[150]
    seg = store.log.segment_for(offset)
    with open(seg.path, "r+b") as fh:  # a flipped bit in the record's body
        fh.seek(offset - seg.base + len(raw) - 3)
        byte = fh.read(1)
        fh.seek(-1, 1)
        fh.write(bytes([byte[0] ^ 0x10]))
    with pytest.raises(errors.CorruptionError) as info:
        for _ in recovery.iter_chunks(store.log, store.log.min_offset):
            pass
    assert seg.path in str(info.value) and str(offset - seg.base) in str(info.value)
    # Below checked_end (what this process checked as it wrote it) records are not checked again.
    walked = sum(1 for _ in recovery.iter_records(store.log, store.log.min_offset, store.log.written))
    assert walked == len(reference_lengths(store))


def reference_lengths(store) -> list[int]:
    """Record lengths by the length fields alone (the damaged store's reference cannot check)."""
    out = []
    for seg in store.log.segments:
        data = store.log.read(seg.base, seg.size)
        pos = 0
        while pos < len(data):
            length = int.from_bytes(data[pos:pos + 4], "little")
            out.append(length)
            pos += length
    return out


def source_routing():
    """routing.py loaded from its source under another name: the pure build's loop, whichever build
    ``routing`` is (compiled, ``route`` walks in C)."""
    return from_source(routing, "routing_from_source")


def mixed_chunks() -> list[tuple[bytes, int, int, int]]:
    """(chunk, p, stop, at) chunks of hand-laid records: plain, DELAYED, with a delivery time, three
    topics (one not ASCII) and queues interleaved (1 and 65 share the compiled walk's slot; 300 has
    an id past its slots), tags changing or repeated or none, runs broken by another queue, a gap
    (quarantined records), a queue going back to an offset (a new run), and the last chunk after
    the topic-name cache was emptied (new name objects for the same topics)."""
    plan = []  # (topic, queue id, queue offset, flags, deliver_at_ms, tag)
    nxt: dict = {}

    def add(topic, qid, *, flags=0, due=0, tag=b"", skip=0, back=False):
        qoff = nxt.get((topic, qid), 100 * qid) + skip
        if back:
            qoff -= 5
        if not flags & record.FLAG_DELAYED:
            nxt[(topic, qid)] = qoff + 1
        plan.append((topic, qid, qoff, flags, due, tag))

    for i in range(60):
        add("orders", i % 3, tag=(b"", b"red", b"red", b"blue")[i % 4])
    for i in range(40):  # a run of one queue, broken now and then by another
        add("orders", 7, tag=b"red")
        if i % 9 == 0:
            add("zählung", 7, tag=b"\xc3\xa9t\xc3\xa9")
    for i in range(30):
        add(("orders", "zählung", "x" * 127)[i % 3], (1, 65, 300)[i % 3], tag=b"t%d" % (i % 5))
        if i % 4 == 0:
            add("orders", 1, flags=record.FLAG_DELAYED, due=1_700_000_000_000 + i)
        if i % 5 == 0:
            add("zählung", 65, due=1_700_000_000_000 + i, tag=b"late")
    add("orders", 7, skip=3)  # a gap: add_entry's holes
    add("orders", 7)
    add("orders", 2, back=True)  # not contiguous: add_entry writes the run so far, starts anew
    add("orders", 2)
    add("orders", 1, flags=record.FLAG_DELAYED | record.FLAG_CONTINUES, due=1_700_000_000_001)
    blobs = [record.encode(flags, qid, qoff, 1_600_000_000_000, 1_650_000_000_000 + n, due, topic.encode(),
                           b"M%06d" % n, tag, b"", b"", bytes([n % 256]) * (n % 50))
             for n, (topic, qid, qoff, flags, due, tag) in enumerate(plan)]
    chunks, at, n = [], 1 << 40, 0
    for size in (1, 7, 50, 3, 90, len(blobs)):  # (the last takes the rest)
        part = blobs[n:n + size]
        lead = b"\0" * (n % 3)  # records from p > 0, and bytes after stop
        chunk = lead + b"".join(part) + b"\0" * (n % 2)
        chunks.append((chunk, len(lead), len(lead) + sum(map(len, part)), at))
        at += len(chunk)
        n += size
        if n >= len(blobs):
            break
    return chunks


def walk(route, chunks, with_taps: bool):
    """What ``route`` makes of ``chunks``, one batch across them as ``Store._replay`` keeps it, with
    ``Store._add_entry``'s rules; every add_entry call is logged."""
    calls, written, batch, made, taps_seen = [], [], {}, [], []

    def add_entry(batch, key, qoff, entry):
        calls.append((key, qoff, entry))
        run = batch.get(key)
        run_end = None if run is None else run[0] + len(run[1]) // len(entry)
        if run_end is not None and run_end < qoff <= run_end + 16:
            run[1].extend(bytes((qoff - run_end) * len(entry)) + entry)
            return
        if run is not None:
            written.append((key, run[0], bytes(run[1])))
        batch[key] = (qoff, bytearray(entry))

    for i, (chunk, p, stop, at) in enumerate(chunks):
        if i == len(chunks) - 1:
            record._topics.clear()
        taps = [] if with_taps else None
        made.append(route(chunk, p, stop, at, batch, taps, add_entry))
        taps_seen.append(taps)
    return made, taps_seen, calls, written, {k: (q, bytes(e)) for k, (q, e) in batch.items()}


@pytest.mark.parametrize("with_taps", [True, False])
def test_the_compiled_walk_makes_what_the_source_loop_does(with_taps):
    chunks = mixed_chunks()
    want = walk(source_routing().route, chunks, with_taps)
    got = walk(routing.route, chunks, with_taps)
    assert got == want
    made, taps, calls, written, batch = want
    assert sum(made) > 120 and len(written) == 1
    assert len(calls) == 9  # add_entry: each of the 7 queues' first entry, the gap, the step back
    assert (not with_taps) or sum(len(t) for t in taps) > 10
    size = ENTRY.size
    assert any(bytes(size) in [e[i:i + size] for i in range(0, len(e), size)] for _, e in batch.values())  # holes
    # The entries are ENTRY's, from the records' fields.
    chunk, p, _, at = chunks[0]
    first = record.decode(chunk, p)
    assert batch[(first["topic"], first["queue_id"])][1][:size] == ENTRY.pack(
        at + p, record.check(chunk, p, len(chunk)), 0, first["stored_ms"])


def test_a_misread_length_fails_the_assert_on_both_builds():
    chunk, p, stop, at = mixed_chunks()[2]
    for route in (routing.route, source_routing().route):
        with pytest.raises(AssertionError):
            route(chunk, p, stop - 1, at, {}, [], lambda batch, key, qoff, entry: batch.__setitem__(
                key, (qoff, bytearray(entry))))
