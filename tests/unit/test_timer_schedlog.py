"""Schedule-log format: bucket math, entry codec, the S0-S4 decision table, bucket state."""

from __future__ import annotations

import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from chronoq.store import record
from chronoq.timer import schedlog
from chronoq.timer.buckets import LOADED, Bucket, count_pending, lookup
from chronoq.timer.schedlog import (CANCELLED, DISPATCHED, ENTRY_HEAD_SIZE, FILE_HEAD_SIZE, MESSAGE, MOVED,
                                    SchedLogError)

START = 1_700_000_040_000
WIDTH = 60_000


def rec(i: int, due: int = START + 5) -> bytes:
    return record.encode(record.FLAG_DELAYED, 0, 0, 1, 2, due, b"t", f"id-{i}".encode(), b"", b"", b"", b"x" * i)


def msg(i: int, due: int = START + 5) -> bytes:
    return schedlog.encode_entry(MESSAGE, 1000 + i, due, 0, rec(i, due))


def file_with(*entries: bytes) -> bytes:
    return schedlog.encode_header(START, WIDTH) + b"".join(entries)


# ----------------------------------------------------------------- bucket math and names
@pytest.mark.parametrize("due,start", [(0, 0), (59_999, 0), (60_000, 60_000), (START + 59_999, START),
                                       (-1, -60_000)])
def test_bucket_start(due, start):
    assert schedlog.bucket_start(due, WIDTH) == start


def test_file_names_roundtrip_and_ignore_strangers():
    name = schedlog.file_name(START)
    assert name == "0001700000040000.sch"
    assert schedlog.parse_file_name(name) == (START, ".sch")
    assert schedlog.parse_file_name(schedlog.file_name(START, ".done")) == (START, ".done")
    for other in ("0001700000040000.sch.tmp", "12.sch", "abc.done", "checkpoint.json"):
        assert schedlog.parse_file_name(other) is None


# ----------------------------------------------------------------- codec
def test_entry_roundtrip_and_sizes():
    e = msg(3)
    assert schedlog.check_entry(e, 0, len(e)) == len(e) == ENTRY_HEAD_SIZE + len(rec(3))
    assert schedlog.entry_fields(e, 0) == (len(e), MESSAGE, 1003, START + 5, 0)
    t = schedlog.encode_entry(CANCELLED, 1003, START + 5, 77)
    assert len(t) == ENTRY_HEAD_SIZE and schedlog.entry_fields(t, 0)[1:] == (CANCELLED, 1003, START + 5, 77)
    with pytest.raises(AssertionError):
        schedlog.encode_entry(MESSAGE, 1, 2)  # a message needs its record
    with pytest.raises(AssertionError):
        schedlog.encode_entry(DISPATCHED, 1, 2, 0, b"x")


@pytest.mark.parametrize("mutate,reason", [
    (lambda b: b[:20], "header needs"),
    (lambda b: b[:-1], "runs past the end"),
    (lambda b: b[:8] + b"\x00" + b[9:], "magic"),
    (lambda b: b[:9] + b"\x09" + b[10:], "magic/kind"),
    (lambda b: b[:-1] + bytes([b[-1] ^ 1]), "CRC"),
    (lambda b: bytes(36), "zero bytes"),
])
def test_check_entry_rejects(mutate, reason):
    bad = mutate(msg(5))
    with pytest.raises(SchedLogError, match=reason):
        schedlog.check_entry(bad, 0, len(bad))


def test_header_check():
    head = schedlog.encode_header(START, WIDTH)
    assert len(head) == FILE_HEAD_SIZE and schedlog.check_header(head, START) == WIDTH
    with pytest.raises(SchedLogError, match="file name says"):
        schedlog.check_header(head, START + WIDTH)
    with pytest.raises(SchedLogError, match="CRC"):
        schedlog.check_header(head[:17] + b"\x01" + head[18:], START)
    with pytest.raises(SchedLogError) as info:
        schedlog.check_header(head[:10], START)
    assert info.value.torn


# ----------------------------------------------------------------- the decision table
def test_s2_a_whole_file_needs_no_repair():
    data = file_with(msg(1), msg(2), schedlog.encode_entry(DISPATCHED, 1001, START, 9))
    assert schedlog.validate_tail("f", START, data) == (len(data), None)
    assert [k for _p, _t, k, *_ in schedlog.scan("f", START, data)] == [MESSAGE, MESSAGE, DISPATCHED]


def test_s0_a_torn_header_is_cut_to_nothing():
    end, damage = schedlog.validate_tail("f", START, schedlog.encode_header(START, WIDTH)[:9])
    assert end == 0 and damage.truncated and damage.reason == "torn file header"
    assert schedlog.validate_tail("f", START, b"") == (0, None)


@pytest.mark.parametrize("tail", [
    msg(7)[:50],                                  # short write
    msg(7)[:-3],                                  # missing the end of the record
    bytes(200),                                   # zero-filled blocks
    msg(7)[:-1] + bytes([msg(7)[-1] ^ 0xFF]),     # the last entry's CRC is wrong
])
def test_s3_a_torn_tail_is_cut_where_the_good_entries_end(tail):
    good = file_with(msg(1), msg(2))
    end, damage = schedlog.validate_tail("f", START, good + tail)
    assert end == len(good)
    assert damage.truncated and (damage.start, damage.end) == (len(good), len(good) + len(tail))


def test_s4_middle_damage_is_skipped_and_reported_not_cut():
    first, second, third = msg(1), msg(2), msg(3)
    data = bytearray(file_with(first, second, third))
    data[FILE_HEAD_SIZE + len(first) + 40] ^= 0x01  # inside the second entry's record
    data = bytes(data)
    end, damage = schedlog.validate_tail("f", START, data)
    assert end == len(data) and damage is None  # not a tail: nothing is truncated
    found = []
    got = [ident for _p, _t, _k, ident, _d, _a in schedlog.scan("f", START, data, found)]
    assert got == [1001, 1003]
    assert len(found) == 1 and not found[0].truncated and "CRC" in found[0].reason
    assert found[0].start == FILE_HEAD_SIZE + len(first)


def test_s1_a_bad_header_raises_for_quarantine():
    data = b"XXXX" + file_with(msg(1))[4:]
    with pytest.raises(SchedLogError, match="magic"):
        schedlog.validate_tail("f", START, data)


# ----------------------------------------------------------------- set semantics
def test_state_does_not_depend_on_entry_order():
    pairs = [(CANCELLED, 1), (MESSAGE, 1), (MESSAGE, 2), (MESSAGE, 2), (MESSAGE, 3), (DISPATCHED, 3),
             (MESSAGE, 4), (MOVED, 4)]
    assert schedlog.summarize(pairs) == {1: CANCELLED, 2: MESSAGE, 3: DISPATCHED, 4: MOVED}
    assert schedlog.summarize(reversed(pairs)) == schedlog.summarize(pairs)


def test_bucket_parse_is_bounded_and_tombstones_before_messages_win():
    b = Bucket(START, "f")
    b.append(schedlog.encode_entry(CANCELLED, 1002, START + 5, 1))
    for i in range(1, 6):
        b.append(msg(i))
    b.append(msg(3))  # replayed twice after a crash
    b.begin_load(b"")
    added, _removed, n = b.parse(4, [])
    assert n == 4 and not b.parsed
    b.parse(100, [])
    assert b.parsed
    assert sorted(ident for ident, _ in b.finish_load()) == [1001, 1003, 1004, 1005]
    assert b.state == LOADED and b.message_entries == 6
    raw = b.claim(1004)
    assert raw == rec(4) and b.state_of(1004) == MESSAGE
    b.append(schedlog.encode_entry(DISPATCHED, 1004, START + 5, 99))
    _a, removed, _n = b.parse(10, [])
    assert removed == [] and b.state_of(1004) is None  # delivered: no memory kept once loaded
    b.append(schedlog.encode_entry(MOVED, 1005, START + 5, 5000))
    _a, removed, _n = b.parse(10, [])
    assert removed == [(1005, START + 5)] and b.state_of(1005) == MOVED
    assert not b.finishable(START + WIDTH, WIDTH)  # 1001 and 1003 still pending
    done = b.done_entries()
    assert [schedlog.entry_fields(done, p)[1:3] for p in (0, ENTRY_HEAD_SIZE)] == [(CANCELLED, 1002), (MOVED, 1005)]


def test_lookup_and_count_in_an_unloaded_bucket():
    data = file_with(msg(1), msg(2), schedlog.encode_entry(CANCELLED, 1001, START + 5, 3))
    extra = schedlog.encode_entry(DISPATCHED, 1002, START + 5, 4) + msg(6)
    assert lookup("f", START, data, extra, 1001) == (CANCELLED, None)
    assert lookup("f", START, data, extra, 1002) == (DISPATCHED, None)
    assert lookup("f", START, data, extra, 1006) == (MESSAGE, rec(6))
    assert lookup("f", START, data, b"", 9999) == (None, None)
    assert count_pending("f", START, data, extra) == (1, 1006)  # pending, the highest ident named
    assert lookup("f", START, b"XXXX" + data[4:], b"", 1001) == (None, None)  # bad header: nothing trusted


def test_bulk_message_encoding_equals_one_entry_at_a_time():
    """encode_messages (the bulk absorb path) files each record exactly as encode_entry would, in
    the bucket of its due time, or of its store time when it was already due when stored."""
    stored = START + 1
    recs = [record.encode(record.FLAG_DELAYED, 0, 0, 1, stored, due, b"t", f"id-{i}".encode(), b"", b"", b"",
                          b"x" * (i + 1))
            for i, due in enumerate([START + 5, START + WIDTH + 7, START + 9, START - 3 * WIDTH, START + 2 * WIDTH])]
    blob = b"".join(recs)
    idents = [5000 + 7 * i for i in range(len(recs))]
    got = schedlog.encode_messages(blob, [(ident, len(r), 0) for ident, r in zip(idents, recs)], WIDTH)
    want: dict[int, list[bytes]] = {}
    for ident, r in zip(idents, recs):
        due = record.HEADER.unpack_from(r, 0)[9]
        start = schedlog.bucket_start(max(due, stored), WIDTH)
        assert start == schedlog.bucket_of_record(stored, due, WIDTH)
        want.setdefault(start, []).append(schedlog.encode_entry(MESSAGE, ident, due, 0, r))
    assert got == {start: b"".join(entries) for start, entries in want.items()}
    assert sorted(got) == [START, START + WIDTH, START + 2 * WIDTH]  # the past one went to its store time
    for start, data in got.items():
        assert [f[2] for f in schedlog.scan("x", START, schedlog.encode_header(START, WIDTH) + data)] == \
            [MESSAGE] * len(want[start])


_TIMES = st.integers(-(2**62), 2**62)


@settings(derandomize=True, database=None, deadline=None, max_examples=150)
@given(st.lists(st.tuples(_TIMES, _TIMES, st.binary(max_size=300), st.integers(-(2**63), 2**63 - 1)), max_size=8),
       st.sampled_from([1, 7, 1000, 60_000, 3_600_000]), st.booleans())
def test_bulk_message_encoding_of_any_records(rows, width, crc_in_cpu):
    """Compiled, encode_messages runs in C (schedlog.pxd): for any store and due times (negative
    ones too: the bucket is a floor), idents, bodies and widths it files the entries encode_entry
    makes, with the CRC by the CPU's instruction or by google_crc32c."""
    recs = [record.encode(record.FLAG_DELAYED, 0, 0, 1, stored, due, b"t", b"m", b"", b"", b"", body)
            for stored, due, body, _ident in rows]
    want: dict[int, list[bytes]] = {}
    for (stored, due, _body, ident), r in zip(rows, recs):
        want.setdefault(schedlog.bucket_of_record(stored, due, width), []).append(
            schedlog.encode_entry(MESSAGE, ident, due, 0, r))
    saved = schedlog._CRC_IN_CPU
    schedlog._CRC_IN_CPU = crc_in_cpu and saved
    try:
        got = schedlog.encode_messages(b"".join(recs), [(ident, len(r), 0) for (*_, ident), r in zip(rows, recs)], width)
    finally:
        schedlog._CRC_IN_CPU = saved
    assert got == {start: b"".join(entries) for start, entries in want.items()}


def test_bulk_message_encoding_refuses_records_past_the_blob():
    """(The C loop checks each record's bounds before it reads; the pure loop's struct read fails.)"""
    r = record.encode(record.FLAG_DELAYED, 0, 0, 1, START, START + 5, b"t", b"m", b"", b"", b"", b"body")
    with pytest.raises((AssertionError, struct.error)):
        schedlog.encode_messages(r, [(1, len(r), 0), (2, len(r), 0)], WIDTH)
