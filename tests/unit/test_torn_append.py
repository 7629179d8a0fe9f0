"""Recovery row R11: an append (one ``Store.write``) torn anywhere is on disk whole or not at all.

``kill -9`` during a large ``pwrite`` leaves a prefix of it in the file (measured: 4-42 MiB of a
256 MiB write), and the rest of the preallocated segment stays zero. Before R11 the whole, CRC-valid
records of that prefix survived recovery though they were never acknowledged (a staged publish then
published them twice). Here the torn files are made by hand, at every kind of cut point.
"""

from __future__ import annotations

import os

from hypothesis import given, settings
from hypothesis import strategies as st
from storekit import body_for, crash, fill, open_store, prep, read_all, record_positions, segments

from chronoq.store import record

OPTS = {"segment_bytes": 1 << 20}


def _torn_batch(path, n: int, seed: int):
    """Acked messages, then an ``n``-record append written (page cache only) and "killed": returns
    what was acked, the append's ids and its [start, end) in the log, and the active segment."""
    store = open_store(path, **OPTS)
    acked = fill(store, 20, seed=seed)
    batch = [prep("a", i % 2, body_for(f"T{seed}-{i}", 200 + 97 * i), f"T{seed}-{i}") for i in range(n)]
    written = store.write(batch)
    start, end = written[0].commit_offset, written[-1].commit_offset + written[-1].size
    crash(store)
    return acked, {p.message_id.decode() for p in batch}, start, end, segments(path)[-1]


def _ids(store) -> set[str]:
    return {mid for mid, _commit, _body in read_all(store).values()}


@settings(derandomize=True, database=None, deadline=None, max_examples=60)
@given(n=st.integers(2, 9), where=st.floats(0, 1), seed=st.integers(0, 3), zero_tail=st.booleans())
def test_any_cut_of_a_multi_record_append_recovers_all_of_it_or_none(tmp_path_factory, n, where, seed, zero_tail):
    path = tmp_path_factory.mktemp("torn")
    acked, batch_ids, start, end, active = _torn_batch(path, n, seed)
    base = int(os.path.basename(active)[:20])
    cut = start + int(where * (end - start))  # where == 1: the write completed
    if zero_tail:  # as kill -9 leaves it: the preallocated rest of the segment is zeros
        with open(active, "r+b") as fh:
            fh.seek(cut - base)
            fh.write(bytes(end - cut))
    else:  # the file ends at the cut (no preallocation)
        os.truncate(active, cut - base)
    store = open_store(path, **OPTS)
    try:
        got = _ids(store)
        assert {a["id"] for a in acked} <= got, "an acknowledged message was lost"
        if cut == end:
            assert batch_ids <= got
        else:
            assert not batch_ids & got, f"part of a torn append survived: {sorted(batch_ids & got)}"
            assert store.log.written == start, "the log is cut back to where the append began"
            if cut > start:
                (lost,) = store.report.truncated
                assert (lost.start, lost.path) == (start, active)
    finally:
        store.close()


def test_an_append_cut_exactly_between_two_of_its_records_is_dropped_and_reported(tmp_path):
    """The hard case: every byte left is a whole, CRC-valid record; only the CONTINUES flag of the
    last one says the append did not end there."""
    acked, batch_ids, start, end, active = _torn_batch(tmp_path, 5, 7)
    base = int(os.path.basename(active)[:20])
    recs = [(p, n) for p, n in record_positions(active) if p + base >= start]
    assert len(recs) == 5 and all(record.continues(open(active, "rb").read(), p) for p, _ in recs[:-1])
    os.truncate(active, recs[3][0])  # three whole records of five
    store = open_store(tmp_path, **OPTS)
    try:
        assert not batch_ids & _ids(store)
        assert {a["id"] for a in acked} <= _ids(store)
        (lost,) = store.report.truncated
        assert (lost.start, lost.end) == (start, base + recs[3][0]) and "unfinished append" in lost.reason
        assert "unfinished append" in store.report.summary()
    finally:
        store.close()


def test_records_written_before_the_flag_existed_are_appends_of_one(tmp_path):
    """Old files (CONTINUES clear everywhere) read as before: a torn tail loses the torn record only."""
    store = open_store(tmp_path, **OPTS)
    store.write([prep("a", 0, body_for(f"O{i}", 300), f"O{i}") for i in range(4)])
    crash(store)
    active = segments(tmp_path)[-1]
    data = bytearray(open(active, "rb").read())
    recs = record_positions(active)
    for p, n in recs:  # rewrite as an older broker wrote them: no flag, CRC to match
        head = bytes(data[p:p + n])
        flags = int.from_bytes(head[10:12], "little") & ~record.FLAG_CONTINUES
        fields = record.decode(head)
        data[p:p + n] = record.encode(flags, fields["queue_id"], fields["queue_offset"], fields["born_ms"],
                                      fields["stored_ms"], fields["deliver_at_ms"], fields["topic"].encode(),
                                      fields["message_id"].encode(), fields["tag"].encode(),
                                      record.encode_keys(fields["keys"]),
                                      record.encode_properties(fields["properties"]), fields["body"])
    last = recs[-1]
    open(active, "wb").write(bytes(data[:last[0] + last[1] // 2]))  # the last record torn
    store = open_store(tmp_path, **OPTS)
    try:
        assert sorted(_ids(store)) == ["O0", "O1", "O2"]
        assert [lr.start for lr in store.report.truncated] == [last[0]]
    finally:
        store.close()
