"""``Store.scan_flagged``: the records retention's keepers look at, found without reading the rest."""

from __future__ import annotations

import pytest
from storekit import flip_bit, open_store, prep, segments

from chronoq.core import errors
from chronoq.store import record

DUE = 2_000_000_000_000


def _fill(store) -> list[tuple[int, bytes]]:
    """Plain and delayed records over a few segments; returns (offset, bytes) of the delayed."""
    want = []
    for b in range(30):
        batch = [prep("a", i % 2, bytes(700 + i), f"m{b}-{i}",
                      flags=record.FLAG_DELAYED if i == b % 5 else 0, deliver_at_ms=DUE if i == b % 5 else 0)
                 for i in range(6)]
        for p, w in zip(batch, store.append(batch)):
            if p.flags & record.FLAG_DELAYED:
                want.append((w.commit_offset, store.log.read_record(w.commit_offset, w.size)))
    return want


def test_scan_flagged_yields_exactly_the_flagged_records_of_a_range(tmp_path):
    store = open_store(tmp_path, segment_bytes=64 * 1024)
    try:
        want = _fill(store)
        assert len(store.log.segments) > 2
        everything = list(store.scan_flagged(0, store.log.written, record.FLAG_DELAYED))
        assert everything == want
        lo, hi = store.log.segments[1].base, store.log.segments[2].end
        assert list(store.scan_flagged(lo, hi, record.FLAG_DELAYED)) == [(o, r) for o, r in want if lo <= o < hi]
        assert list(store.scan_flagged(0, store.log.written, record.FLAG_HELD)) == []
    finally:
        store.close()


def test_scan_flagged_names_a_damaged_record_it_meets(tmp_path):
    store = open_store(tmp_path, segment_bytes=64 * 1024)
    want = _fill(store)
    store.close()
    first = segments(tmp_path)[0]
    offset, raw = want[0]
    flip_bit(first, offset + len(raw) - 1)  # in the delayed record's body: its CRC fails
    store = open_store(tmp_path, segment_bytes=64 * 1024)
    try:
        with pytest.raises(errors.CorruptionError) as info:
            list(store.scan_flagged(0, store.log.written, record.FLAG_DELAYED))
        assert (info.value.path, info.value.offset) == (first, offset)
    finally:
        store.close()
