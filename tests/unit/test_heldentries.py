"""``chronoq.store.heldentries.HeldEntries`` against the plain rule it keeps: a deque of (offset,
due) pairs released from the front while the front is due, cut from the back at a truncation."""

from __future__ import annotations

import random
from collections import deque

import pytest

from chronoq.store import heldentries
from chronoq.store.heldentries import HeldEntries


def _release(ref: deque, now: int) -> bool:
    released = False
    while ref and ref[0][1] <= now:
        ref.popleft()
        released = True
    return released


@pytest.mark.parametrize("seed", range(6))
def test_matches_a_deque_of_pairs_under_random_holds_releases_and_cuts(seed, monkeypatch):
    monkeypatch.setattr(heldentries, "COMPACT_MIN", 8)  # (the front is cut often)
    rng = random.Random(seed)
    held, ref = HeldEntries(), deque()
    offset, now = 0, 1_000
    for _ in range(4_000):
        op = rng.random()
        if op < 0.55:
            offset += rng.randrange(1, 4)
            # bursts share a due time; others spread, some before the ones already held
            due = rng.choice((now + 50, now + 50, now + rng.randrange(0, 200)))
            held.append(offset, due)
            ref.append((offset, due))
        elif op < 0.9:
            now += rng.randrange(0, 30)
            assert held.release(now) == _release(ref, now)
        else:
            cut = offset - rng.randrange(0, 6)
            held.drop_from(cut)
            while ref and ref[-1][0] >= cut:
                ref.pop()
            offset = max(offset, cut)
        assert list(held) == list(ref) and len(held) == len(ref) and bool(held) == bool(ref)
        if ref:
            assert (held.first_offset(), held.first_due(), held.last_offset()) == (ref[0][0], ref[0][1], ref[-1][0])


def test_a_burst_due_at_one_instant_is_released_whole_and_nothing_before_its_time():
    held = HeldEntries()
    for k in range(300_000):
        held.append(10 + k, 5_000)
    assert not held.release(4_999) and len(held) == 300_000
    assert held.release(5_000) and not held and list(held) == []
    held.append(400_000, 6_000)  # (usable again after)
    assert held.first_offset() == 400_000 and not held.release(5_999) and held.release(6_000)


def test_a_later_due_entry_keeps_the_ones_after_it_held():
    held = HeldEntries()
    for offset, due in ((1, 100), (2, 300), (3, 100), (4, 200)):
        held.append(offset, due)
    assert held.release(250) and list(held) == [(2, 300), (3, 100), (4, 200)]
    assert held.release(300) and not held


def test_offsets_must_grow():
    held = HeldEntries()
    held.append(5, 10)
    with pytest.raises(AssertionError):
        held.append(5, 11)
