"""The hashed timing wheel, standalone: exact deadlines, bounded expiry, wrap-around, O(1) idle."""

from __future__ import annotations

import random

import pytest

from chronoq.timer.wheel import COARSE_MS, COARSE_SHIFT, FINE_MS, FINE_SHIFT, TimingWheel


def test_rejects_slots_that_are_not_a_power_of_two():
    with pytest.raises(ValueError):
        TimingWheel(slot_ms=10, slots=1000)
    with pytest.raises(ValueError):
        TimingWheel(slot_ms=0, slots=1024)


def test_expires_exactly_at_the_deadline_never_before():
    w = TimingWheel(slot_ms=16, slots=64)
    w.add(1, 1_000)
    assert w.next_deadline() == 1_000
    assert w.expire(999, 10) == []
    assert len(w) == 1
    assert w.expire(1_000, 10) == [(1, 1_000)]
    assert len(w) == 0 and w.next_deadline() is None


def test_expire_returns_the_earliest_first_and_respects_the_limit():
    w = TimingWheel(slot_ms=4, slots=16)
    deadlines = [105, 101, 130, 101, 99, 150]
    for key, d in enumerate(deadlines):
        w.add(key, d)
    got = w.expire(140, 3)
    assert got == [(4, 99), (1, 101), (3, 101)]
    assert w.next_deadline() == 105
    assert w.expire(140, 10) == [(0, 105), (2, 130)]
    assert w.next_deadline() == 150 and len(w) == 1


def test_entries_further_than_one_rotation_share_slots_but_keep_their_time():
    w = TimingWheel(slot_ms=1, slots=8)  # a rotation is 8 ms
    w.add(1, 3)
    w.add(2, 3 + 8)  # same slot, next rotation
    w.add(3, 3 + 80)
    assert w.expire(5, 10) == [(1, 3)]
    assert w.next_deadline() == 11
    assert w.expire(10, 10) == []
    assert w.expire(11, 10) == [(2, 11)]
    assert w.expire(1_000, 10) == [(3, 83)]


def test_a_long_pause_expires_everything_due_in_time_order():
    rng = random.Random(7)
    w = TimingWheel(slot_ms=2, slots=32)  # rotation 64 ms; the pause below spans many rotations
    items = {k: rng.randrange(0, 5_000) for k in range(300)}
    for k, d in items.items():
        w.add(k, d)
    out = []
    while len(w):
        batch = w.expire(10_000, 17)
        assert batch and len(batch) <= 17
        out.extend(batch)
    assert [d for _, d in out] == sorted(items.values())
    assert sorted(k for k, _ in out) == sorted(items)


def test_limit_takes_the_true_earliest_when_the_due_range_is_within_a_rotation():
    w = TimingWheel(slot_ms=10, slots=16)
    for k, d in enumerate([55, 12, 33, 12, 47, 21]):
        w.add(k, d)
    assert w.expire(60, 2) == [(1, 12), (3, 12)]
    assert w.expire(60, 2) == [(5, 21), (2, 33)]


def test_remove_and_replace():
    w = TimingWheel(slot_ms=8, slots=8)
    w.add(1, 50)
    w.add(2, 40)
    assert not w.remove(2, 41)  # wrong deadline: not there
    assert w.remove(2, 40)
    assert w.next_deadline() == 50
    assert not w.remove(2, 40)
    w.add(1, 52)  # same slot: replaces
    assert len(w) == 1 and w.next_deadline() == 52
    assert w.remove(1, 52) and len(w) == 0 and w.next_deadline() is None


def test_an_idle_tick_touches_no_slot():
    w = TimingWheel(slot_ms=1, slots=1024)
    w.add(1, 10_000)

    class Exploding(list):
        def __getitem__(self, i):
            raise AssertionError("an idle expire must not look at any slot")

    w._buckets = Exploding(w._buckets)
    w._slot_min = Exploding(w._slot_min)
    assert w.expire(9_999, 100) == []


def _against_reference(w: TimingWheel, rng: random.Random, steps: int, deadline_after, remove_below: float,
                       advance_max: int, limit_max: int) -> None:
    """Random adds (due ``deadline_after(rng)`` ms on), removes and expiries, each checked against a
    sorted reference: what expires (earliest first, up to the limit), the size, the next deadline."""
    ref: dict[int, int] = {}
    now = 0
    for step in range(steps):
        op = rng.random()
        if op < 0.5:
            d = now + deadline_after(rng)
            w.add(step, d)
            ref[step] = d
        elif op < remove_below and ref:
            key = rng.choice(list(ref))
            assert w.remove(key, ref.pop(key))
        else:
            now += rng.randrange(0, advance_max)
            limit = rng.randrange(1, limit_max)
            got = w.expire(now, limit)
            due = sorted((d, k) for k, d in ref.items() if d <= now)
            assert [d for _, d in got] == [d for d, _ in due[:limit]]
            for k, d in got:
                assert ref.pop(k) == d
        assert len(w) == len(ref)
        assert w.next_deadline() == (min(ref.values()) if ref else None)
    for shift, blocks in ((FINE_SHIFT, w._fine), (COARSE_SHIFT, w._coarse)):
        want: dict[int, int] = {}
        for d in ref.values():
            want[d >> shift] = want.get(d >> shift, 0) + 1
        assert blocks == want  # the counts by deadline follow every add, remove and expiry


def test_matches_a_sorted_reference_under_random_operations():
    _against_reference(TimingWheel(slot_ms=3, slots=16), random.Random(11), 3_000,
                       lambda rng: rng.randrange(0, 400), remove_below=0.6, advance_max=30, limit_max=20)


@pytest.mark.parametrize("slot_ms, slots, spread_ms, seed",
                         [(5, 256, 300, 1), (5, 256, 20_000, 2), (16, 4096, 90_000, 3)])
def test_next_deadline_after_expire_near_and_far(slot_ms, slots, spread_ms, seed):
    """``expire`` finds the next deadline by looking a few slots ahead (steady load) or, failing
    that, over all slots (sparse or far-future entries); both must agree with a reference."""
    rng = random.Random(seed)
    w = TimingWheel(slot_ms=slot_ms, slots=slots)
    ref: dict[int, int] = {}
    now = 0
    for step in range(2_000):
        for k in range(rng.randrange(0, 4)):
            d = now + rng.randrange(0, spread_ms)
            w.add(step * 10 + k, d)
            ref[step * 10 + k] = d
        now += rng.randrange(0, 2 * slot_ms)
        got = w.expire(now, 1_000)
        assert sorted(d for _, d in got) == sorted(d for d in ref.values() if d <= now)
        for k, d in got:
            assert ref.pop(k) == d
        assert w.next_deadline() == (min(ref.values()) if ref else None)


def test_due_per_block_counts_by_deadline_not_by_slot():
    """Exact counts per block of deadline (FINE_MS and COARSE_MS): an entry a whole rotation later
    shares a slot with a near one but not its block (a slot's size counted it: a steady 5,000/s
    looked like 10,000/s)."""
    w = TimingWheel(slot_ms=10, slots=64)  # one rotation: 640 ms
    assert w.due_per_block(0, 1_000) == [0] * (1_000 // FINE_MS + 1)
    assert w.due_per_block(0, 1_000, coarse=True) == [0] * (1_000 // COARSE_MS + 1)
    for k, d in enumerate([1_000, 1_003, 1_009, 1_015, 1_200]):
        w.add(k, d)
    w.add(9, 1_005 + 640)  # a rotation later, in the first slot
    fine = w.due_per_block(1_000, 1_000 + 640)
    assert len(fine) == (1_640 >> FINE_SHIFT) - (1_000 >> FINE_SHIFT) + 1
    assert fine[0] == 2 and fine[1] == 2 and fine[(1_200 >> FINE_SHIFT) - (1_000 >> FINE_SHIFT)] == 1  # 992.., 1008..
    assert fine[-1] == 1 and sum(fine) == 6
    coarse = w.due_per_block(1_000, 1_000 + 640, coarse=True)  # 896.., 1024.., ..
    assert coarse[0] == 4 and coarse[(1_200 >> COARSE_SHIFT) - (1_000 >> COARSE_SHIFT)] == 1 and sum(coarse) == 6
    assert sum(w.due_per_block(1_000, 1_500)) == 5 == sum(w.due_per_block(1_000, 1_500, coarse=True))
    w.add(9, 1_001)  # moved (same key, same slot): its old blocks forget it
    assert w.due_per_block(1_000, 1_000) == [3] and w.due_per_block(1_000, 1_000, coarse=True) == [5]
    assert w.remove(3, 1_015) and w.due_per_block(1_000, 1_000, coarse=True) == [4]
    assert len(w.expire(1_009, 10)) == 4  # what is left: 1_200 alone
    assert w.due_per_block(0, 2_000) == [1 if b == 1_200 >> FINE_SHIFT else 0 for b in range(2_000 // FINE_MS + 1)]
    assert w._coarse == {1_200 >> COARSE_SHIFT: 1}


class _CountingDict(dict):
    """A slot's dict that counts the entries handed out by ``items`` and ``values`` (a whole-slot walk)."""

    walked = 0

    def items(self):
        _CountingDict.walked += len(self)
        return super().items()

    def values(self):
        _CountingDict.walked += len(self)
        return super().values()


def test_a_burst_in_one_slot_is_expired_a_limit_at_a_time_without_walking_the_slot_each_time():
    """100,000 entries due at one instant share a slot; each expire of 2,000 must not walk all
    of them again (it did: 50 walks and sorts of the slot, 20-60 ms each). One walk to sort the
    slot once (a run), then O(limit) a call; still the earliest first, never early."""
    import chronoq.timer.wheel as wheel_mod

    w = TimingWheel(slot_ms=16, slots=4096)
    n, limit, due = 100_000, 2_000, 1_000_000
    for k in range(n):
        w.add(k, due + (k % 7))  # one slot (16 ms), seven deadlines
    i = (due // 16) & (4096 - 1)
    w._buckets[i] = _CountingDict(w._buckets[i])
    _CountingDict.walked = 0
    assert w.expire(due - 1, limit) == []  # nothing is early
    taken = []
    while True:
        got = w.expire(due + 6, limit)
        if not got:
            break
        assert len(got) <= limit
        taken.extend(got)
    assert sorted(k for k, _ in taken) == list(range(n)) and len(w) == 0
    assert [d for _, d in taken] == sorted(d for _, d in taken)  # earliest first, across calls too
    assert _CountingDict.walked <= 2 * n  # (one walk to sort; without a run: n per call, 50 n)
    assert wheel_mod.RUN_MIN < limit


def test_a_crowded_slot_hands_out_keys_due_at_one_instant_in_the_order_they_were_added():
    """A run groups a slot's keys by deadline (no sort of the entries): within one deadline the
    keys leave in the order they were added (the schedule log's), across calls; an entry removed
    after the run was made is skipped, and one added makes a new run."""
    w = TimingWheel(slot_ms=16, slots=64)
    due, limit = 1_000, 300
    keys = random.Random(3).sample(range(10**9), 3_000)  # (not in key order)
    for k in keys:
        w.add(k, due)
    w.add(7, due - 1)
    first = w.expire(due, limit)
    assert first == [(7, due - 1)] + [(k, due) for k in keys[:limit - 1]]
    assert w.remove(keys[limit], due)  # (inside the run, not taken yet)
    w.add(11, due)  # (the run is made again: 11 is the last added)
    order = [k for k in keys[limit - 1:] if k != keys[limit]] + [11]  # what is left, in the order added
    while got := w.expire(due, limit):  # (from a run, then from the plain slot once under RUN_MIN)
        assert got == [(k, due) for k in order[:limit]]
        del order[:limit]
    assert order == []
    assert len(w) == 0


def test_matches_a_sorted_reference_with_crowded_slots(monkeypatch):
    """The reference test with runs in play (RUN_MIN small): adds into a slot with a run, removes
    of entries in a run, expiry across runs and plain slots."""
    import chronoq.timer.wheel as wheel_mod

    monkeypatch.setattr(wheel_mod, "RUN_MIN", 4)
    _against_reference(TimingWheel(slot_ms=8, slots=16), random.Random(12), 4_000,
                       lambda rng: rng.choice((0, 5, 40, rng.randrange(0, 300))),  # (crowded: a few deadlines recur)
                       remove_below=0.65, advance_max=12, limit_max=10)
