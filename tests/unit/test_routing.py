"""The dispatch walk: ``chronoq.store.recovery.iter_chunks`` (runs of whole, checked records read
from the log) and ``chronoq.store.routing.route`` (their consume-queue entries and the records a
timer follows), held to a reference walk that reads each segment whole and checks record by
record with ``record.check``. Runs on both builds (tests/unit/test_compiled.py)."""

from __future__ import annotations

import zlib

import pytest

from chronoq.core import errors
from chronoq.store import record, recovery, routing
from chronoq.store.consumequeue import ENTRY

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
