"""Consume-queue file math: entry n at file n // per_file, byte (n % per_file) * ENTRY_SIZE."""

from __future__ import annotations

import os

import pytest

from chronoq.store.consumequeue import CQ_SUFFIX, ENTRY, ENTRY_SIZE, ConsumeQueue

PER_FILE = 4
RECORD = 100  # every fake record is 100 bytes long, entry n's record starts at 1000 + 100 n


def entry(n: int) -> bytes:
    return ENTRY.pack(1000 + RECORD * n, RECORD, n & 0xFFFFFFFF, 1_700_000_000_000 + n)


def entries(first: int, count: int) -> bytes:
    return b"".join(entry(n) for n in range(first, first + count))


def open_cq(path, per_file: int = PER_FILE) -> ConsumeQueue:
    return ConsumeQueue(str(path), "t", 0, per_file)


def file_path(directory, index: int, per_file: int = PER_FILE) -> str:
    return os.path.join(str(directory), f"{index * per_file:020d}{CQ_SUFFIX}")


def listing(directory) -> list[str]:
    return sorted(n for n in os.listdir(directory) if n.endswith(CQ_SUFFIX))


def test_entry_n_lives_at_file_n_div_per_file(tmp_path):
    cq = open_cq(tmp_path)
    cq.put(0, entries(0, 10))
    assert (cq.min_offset, cq.next_offset) == (0, 10)
    assert listing(tmp_path) == [f"{i:020d}.cq" for i in (0, 4, 8)]
    cq.sync()
    for n in range(10):
        with open(file_path(tmp_path, n // PER_FILE), "rb") as fh:
            fh.seek((n % PER_FILE) * ENTRY_SIZE)
            assert fh.read(ENTRY_SIZE) == entry(n), n
    assert [os.path.getsize(file_path(tmp_path, i)) for i in range(3)] == [96, 96, 48]
    cq.close()


def test_put_in_pieces_crossing_file_boundaries(tmp_path):
    cq = open_cq(tmp_path)
    cq.put(0, entries(0, 3))
    cq.put(3, entries(3, 6))  # 3 | 4 5 6 7 | 8
    cq.put(9, entries(9, 1))
    assert cq.next_offset == 10
    got = b"".join(cq.get(n, 1) for n in range(10))
    assert got == entries(0, 10)
    # Positional and idempotent: writing the same entries again changes nothing.
    cq.put(2, entries(2, 5))
    assert cq.next_offset == 10
    assert b"".join(cq.get(n, 1) for n in range(10)) == entries(0, 10)
    cq.close()


def test_get_never_crosses_a_file(tmp_path):
    cq = open_cq(tmp_path)
    cq.put(0, entries(0, 10))
    assert cq.get(0, 100) == entries(0, 4)
    assert cq.get(2, 100) == entries(2, 2)
    assert cq.get(3, 1) == entry(3)
    assert cq.get(4, 3) == entries(4, 3)
    assert cq.get(5, 100) == entries(5, 3)
    assert cq.get(8, 100) == entries(8, 2)
    assert cq.get(9, 100) == entry(9)
    assert cq.get(10, 100) == b""  # at the end
    assert cq.get(11, 1) == b""
    assert cq.get(0, 0) == b""
    cq.close()


@pytest.mark.parametrize("cut", range(0, 11))
def test_truncate(tmp_path, cut):
    cq = open_cq(tmp_path)
    cq.put(0, entries(0, 10))
    cq.truncate(cut)
    assert cq.next_offset == cut
    assert b"".join(cq.get(n, 1) for n in range(10)) == entries(0, cut)
    # Files wholly past the cut are gone, the file holding the cut is cut to the slot.
    index, slot = divmod(cut, PER_FILE)
    assert all(int(n[:-3]) // PER_FILE <= index for n in listing(tmp_path))
    if os.path.exists(file_path(tmp_path, index)):
        assert os.path.getsize(file_path(tmp_path, index)) == slot * ENTRY_SIZE
    cq.close()
    again = open_cq(tmp_path)
    assert (again.min_offset, again.next_offset) == (0, cut)
    assert b"".join(again.get(n, 1) for n in range(10)) == entries(0, cut)
    # Appending after a truncate continues densely.
    again.put(cut, entries(cut, 3))
    assert b"".join(again.get(n, 1) for n in range(cut + 3)) == entries(0, cut + 3)
    again.close()


def test_truncate_past_binary_search(tmp_path):
    """For every log end, exactly the entries whose record ends beyond it are dropped."""
    count = 13
    for log_end in range(0, 1000 + RECORD * (count + 1), RECORD // 4):
        d = tmp_path / str(log_end)
        cq = open_cq(d)
        cq.put(0, entries(0, count))
        cq.truncate_past(log_end)
        keep = sum(1 for n in range(count) if 1000 + RECORD * (n + 1) <= log_end)
        assert cq.next_offset == keep, log_end
        assert b"".join(cq.get(n, 1) for n in range(count)) == entries(0, keep)
        cq.close()
        assert open_cq(d).next_offset == keep


def test_truncate_past_on_a_queue_not_starting_at_zero(tmp_path):
    cq = open_cq(tmp_path)
    cq.put(6, entries(6, 7))  # 6..12
    cq.truncate_past(1000 + RECORD * 9)  # records 6, 7, 8 end at or before it
    assert (cq.min_offset, cq.next_offset) == (6, 9)
    cq.truncate_past(0)
    assert cq.next_offset == cq.min_offset == 6
    cq.close()


def test_delete_below(tmp_path):
    cq = open_cq(tmp_path)
    cq.put(0, entries(0, 10))
    # Record 3 ends at 1400: file 0 (entries 0..3) lies wholly below 1400, file 1 does not.
    assert cq.delete_below(1000 + RECORD * 4 - 1) == 0
    assert cq.delete_below(1000 + RECORD * 4) == 1
    assert (cq.min_offset, cq.next_offset) == (4, 10)
    assert listing(tmp_path) == [f"{i:020d}.cq" for i in (4, 8)]
    assert cq.get(0, 10) == b"" and cq.get(3, 1) == b""
    assert cq.get(4, 10) == entries(4, 4)
    # Everything is below: still never the file being appended to.
    assert cq.delete_below(1 << 60) == 1
    assert (cq.min_offset, cq.next_offset) == (8, 10)
    cq.close()
    again = open_cq(tmp_path)
    assert (again.min_offset, again.next_offset) == (8, 10)
    assert again.get(8, 10) == entries(8, 2)
    again.close()


def test_delete_below_keeps_the_queue_position_when_the_last_file_is_full(tmp_path):
    """A queue whose last file is exactly full must not lose its next offset to retention."""
    cq = open_cq(tmp_path)
    cq.put(0, entries(0, 8))  # files 0 and 4, both full
    cq.delete_below(1 << 60)
    assert cq.next_offset == 8
    cq.close()
    again = open_cq(tmp_path)
    assert again.next_offset == 8, "offsets would be reused after a restart"
    assert again.min_offset <= 8
    again.put(8, entries(8, 1))
    assert again.get(8, 1) == entry(8)
    again.close()


def test_reopen_recomputes_next_offset(tmp_path):
    cq = open_cq(tmp_path)
    cq.put(0, entries(0, 7))
    cq.sync()
    cq.close()
    again = open_cq(tmp_path)
    assert (again.min_offset, again.next_offset) == (0, 7)
    assert again.get(4, 10) == entries(4, 3)
    again.close()


@pytest.mark.parametrize("zero_bytes", [ENTRY_SIZE, 2 * ENTRY_SIZE, 10, ENTRY_SIZE + 5, 5 * ENTRY_SIZE])
def test_reopen_ignores_trailing_zero_entries(tmp_path, zero_bytes):
    """Space the file system allocated but nothing wrote (or a torn entry) is not an entry."""
    cq = open_cq(tmp_path, per_file=8)
    cq.put(0, entries(0, 3))
    cq.close()
    with open(file_path(tmp_path, 0, 8), "ab") as fh:
        fh.write(bytes(zero_bytes))
    again = open_cq(tmp_path, per_file=8)
    assert again.next_offset == 3
    assert again.get(0, 10) == entries(0, 3)
    again.put(3, entry(3))
    assert again.get(0, 10) == entries(0, 4)
    again.close()


def test_reopen_ignores_a_torn_last_entry(tmp_path):
    cq = open_cq(tmp_path, per_file=8)
    cq.put(0, entries(0, 3))
    cq.close()
    with open(file_path(tmp_path, 0, 8), "ab") as fh:
        fh.write(entry(3)[:10])
    again = open_cq(tmp_path, per_file=8)
    assert again.next_offset == 3
    again.close()


@pytest.mark.parametrize("first", [1, 3, 4, 6, 250])
def test_queue_starting_at_a_non_zero_offset(tmp_path, first):
    cq = open_cq(tmp_path)
    assert (cq.min_offset, cq.next_offset) == (0, 0)
    cq.put(first, entries(first, 6))
    assert (cq.min_offset, cq.next_offset) == (first, first + 6)
    assert cq.get(first - 1, 5) == b""
    assert b"".join(cq.get(n, 1) for n in range(first, first + 6)) == entries(first, 6)
    cq.close()
    again = open_cq(tmp_path)
    assert (again.min_offset, again.next_offset) == (first, first + 6)
    assert again.get(first, 1) == entry(first)
    again.close()


def test_is_whole_detects_missing_and_short_files(tmp_path):
    cq = open_cq(tmp_path)
    assert cq.is_whole()
    cq.put(0, entries(0, 14))  # files 0, 4, 8, 12
    assert cq.is_whole()
    cq.close()
    os.truncate(file_path(tmp_path, 3), ENTRY_SIZE)  # the last file may be short
    assert open_cq(tmp_path).is_whole()
    os.truncate(file_path(tmp_path, 1), 3 * ENTRY_SIZE)  # a middle one may not
    assert not open_cq(tmp_path).is_whole()
    os.unlink(file_path(tmp_path, 1))
    assert not open_cq(tmp_path).is_whole()


def test_put_before_the_start_moves_the_start_down(tmp_path):
    """A rebuild that restores entries before the queue's first file (R8) extends the queue."""
    cq = open_cq(tmp_path)
    cq.put(8, entries(8, 3))
    assert (cq.min_offset, cq.next_offset) == (8, 11)
    cq.put(0, entries(0, 8))
    assert (cq.min_offset, cq.next_offset) == (0, 11)
    assert b"".join(cq.get(n, 1) for n in range(11)) == entries(0, 11)
    cq.close()
    again = open_cq(tmp_path)
    assert (again.min_offset, again.next_offset) == (0, 11)
    again.close()
