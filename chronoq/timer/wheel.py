"""A hashed timing wheel for the near window of timer messages. Pure: no clock, no I/O.

Method: ``slots`` (a power of two) buckets of ``slot_ms`` each; an entry due at ``d`` lives in
slot ``(d // slot_ms) & mask``. One rotation covers ``slots * slot_ms`` ms; entries due further
ahead share slots with nearer ones and are told apart by their exact deadline. Every slot keeps
the lowest deadline it holds and the wheel keeps the lowest of all, so:

* ``expire(now, limit)`` with nothing due returns after one comparison (an idle tick is O(1));
* the shell arms *one* timer for ``next_deadline()``, never one per entry;
* ``expire`` returns at most ``limit`` entries, earliest first, so a burst is spread over ticks
  and the caller's bounded queue is never overfilled (flow control).

Cost: recomputing the global minimum after the slot that held it changes is O(slots) (a ``min``
over a list in C, ~30 µs for 4096 slots). ``expire`` first looks at the next ``NEAR_SLOTS``
slots after ``now`` (under steady load the next deadline is that close, so this is O(1)) and only
then falls back to the full ``min``; a ``remove`` of the minimum always takes the full ``min``.
A heap of slot minima would save it at the price of stale entries.

A crowded slot (a burst: 100,000 messages due at one instant share one slot) gets a *run*: its
keys grouped by deadline once, the deadlines sorted latest first, so each ``expire`` takes its
``limit`` earliest from the run's end and the slot's new minimum is the run's last live entry:
O(limit) a call, not O(slot). Without it every call collected and sorted the whole slot to take
2,000 (the delivery lane's room): 50 calls of 20-60 ms each for 100,000 due at once
(bench/stalls.py --due-burst 100000). Grouped, not sorted: a burst's slot holds a handful of
distinct deadlines, so the run costs one dict step per entry (300,000 entries: sorting them as
(deadline, key) pairs held the loop 80-190 ms, grouping them ~17 ms). Keys due at the same
millisecond leave in the order they were added (the schedule log's order), from a run or not:
``expire`` sorts what it found by deadline alone, a stable sort. A run
stays valid until something is added to its slot (then it is dropped: built again when needed);
an entry removed meanwhile is skipped where it is met (checked against the slot).

Keys are ints (the caller's entry identity); ``remove`` takes the deadline too, so the wheel needs
no key -> deadline map of its own (memory is per near-window entry, so it is kept small).

How many entries fall due when (``due_per_block``, for the timer's burst lead): a slot's size
cannot say, since a slot also holds entries a whole rotation later (the wheel holds the current
schedule bucket and the next, up to 120 s with the defaults, against a 65.5 s rotation: at a
steady 5,000/s every slot held two seconds' worth). So the wheel also counts its entries by
absolute block of deadline, at two sizes: ``FINE_MS`` (16 ms: what is due in the next second,
where tens of ms matter) and ``COARSE_MS`` (128 ms: seconds ahead, where a lead of seconds is
decided; 71 blocks over 9 s, not 563). Each is a dict holding one int per non-empty block (~7,500
and ~940 at most with the defaults), kept by ``add``/``remove``/``expire`` (two dict steps per
entry; ``expire`` one per block it empties from, its entries coming sorted).
"""

from __future__ import annotations

from operator import itemgetter

INF = float("inf")
NEAR_SLOTS = 64  # expire looks this many slots ahead for the next deadline before a full min()
RUN_MIN = 1024  # a slot with more entries than this is expired from a sorted run (see above)
FINE_SHIFT = 4  # ``due_per_block`` counts entries by deadline >> FINE_SHIFT ...
FINE_MS = 1 << FINE_SHIFT
COARSE_SHIFT = 7  # ... and by deadline >> COARSE_SHIFT (see above)
COARSE_MS = 1 << COARSE_SHIFT
_deadline = itemgetter(0)


class TimingWheel:
    __slots__ = ("slot_ms", "slots", "_mask", "_buckets", "_slot_min", "_lowest", "_count", "_runs", "_fine",
                 "_coarse", "changes")

    def __init__(self, slot_ms: int = 16, slots: int = 4096):
        if slot_ms <= 0 or slots <= 0 or slots & (slots - 1):
            raise ValueError(f"need slot_ms > 0 and slots a power of two, got {slot_ms}, {slots}")
        self.slot_ms = slot_ms
        self.slots = slots
        self._mask = slots - 1
        # Slot i: {key: deadline} or None when empty (most slots are empty most of the time).
        self._buckets: list[dict[int, int] | None] = [None] * slots
        self._slot_min: list[float] = [INF] * slots
        self._lowest: float = INF
        self._count = 0
        # Slot i -> its run (crowded slots only): (its deadlines, latest first; deadline -> its keys,
        # last added first), both consumed from the end.
        self._runs: dict[int, tuple[list[int], dict[int, list[int]]]] = {}
        # deadline >> FINE_SHIFT (COARSE_SHIFT) -> entries due in that block (non-empty blocks only).
        self._fine: dict[int, int] = {}
        self._coarse: dict[int, int] = {}
        self.changes = 0  # bumped by every add, remove and expire that changes the wheel

    def __len__(self) -> int:
        return self._count

    def add(self, key: int, deadline_ms: int) -> None:
        """Add ``key`` due at ``deadline_ms``. A key already present in that slot is replaced."""
        i = (deadline_ms // self.slot_ms) & self._mask
        bucket = self._buckets[i]
        if bucket is None:
            bucket = self._buckets[i] = {}
        if self._runs:
            self._runs.pop(i, None)  # (a run holds its slot's entries as they were)
        old = bucket.get(key)
        bucket[key] = deadline_ms
        self.changes += 1
        if old is not None:
            self._uncount(old, 1)
        fine, coarse = self._fine, self._coarse
        blk = deadline_ms >> FINE_SHIFT
        fine[blk] = fine.get(blk, 0) + 1
        blk = deadline_ms >> COARSE_SHIFT
        coarse[blk] = coarse.get(blk, 0) + 1
        if old is None:
            self._count += 1
        elif old == self._slot_min[i] and deadline_ms > old:
            self._slot_min[i] = min(bucket.values())
            self._lowest = min(self._slot_min)
        if deadline_ms < self._slot_min[i]:
            self._slot_min[i] = deadline_ms
            if deadline_ms < self._lowest:
                self._lowest = deadline_ms

    def remove(self, key: int, deadline_ms: int) -> bool:
        """Remove ``key`` (added with ``deadline_ms``). Returns whether it was there."""
        i = (deadline_ms // self.slot_ms) & self._mask
        bucket = self._buckets[i]
        if bucket is None or bucket.get(key) != deadline_ms:
            return False
        del bucket[key]
        self._count -= 1
        self.changes += 1
        self._uncount(deadline_ms, 1)
        if deadline_ms == self._slot_min[i]:
            self._reslot(i)
            if deadline_ms == self._lowest:
                self._lowest = min(self._slot_min)
        return True

    def next_deadline(self) -> int | None:
        """The earliest deadline held, or None when empty."""
        return None if self._lowest == INF else int(self._lowest)

    def due_per_block(self, from_ms: int, until_ms: int, coarse: bool = False) -> list[int]:
        """Entries due in each ``FINE_MS`` (``coarse``: ``COARSE_MS``) block of deadline, from
        ``from_ms``'s block to ``until_ms``'s: exact (by deadline, not by slot; a block's entries
        may lie anywhere inside it). O(blocks spanned)."""
        shift = COARSE_SHIFT if coarse else FINE_SHIFT
        get = (self._coarse if coarse else self._fine).get
        return [get(b, 0) for b in range(from_ms >> shift, (until_ms >> shift) + 1)]

    def _uncount(self, deadline_ms: int, n: int) -> None:
        """``n`` entries due at ``deadline_ms`` (or in its fine block) left the wheel."""
        for blocks, blk in ((self._fine, deadline_ms >> FINE_SHIFT), (self._coarse, deadline_ms >> COARSE_SHIFT)):
            left = blocks[blk] - n
            assert left >= 0
            if left:
                blocks[blk] = left
            else:
                del blocks[blk]

    def expire(self, now_ms: int, limit: int) -> list[tuple[int, int]]:
        """Remove and return up to ``limit`` entries due at or before ``now_ms``, earliest first
        (entries due at the same instant in the order they were added).

        Ensures: every returned deadline <= now_ms; no entry left in the wheel is due before the
        last one returned (the ``limit`` earliest are taken); ``len`` drops by what is returned.
        """
        if self._lowest > now_ms or limit <= 0:
            return []
        slot_ms, mask = self.slot_ms, self._mask
        first_tick = int(self._lowest) // slot_ms
        ticks = now_ms // slot_ms - first_tick + 1
        # Within one rotation slot order is time order, so the scan may stop once it has enough;
        # after a longer pause every slot can hold something due, so all are looked at.
        one_rotation = ticks <= self.slots
        found: list[tuple[int, int, int]] = []
        for tick in range(first_tick, first_tick + min(ticks, self.slots)):
            i = tick & mask
            if self._slot_min[i] > now_ms:
                continue
            bucket = self._buckets[i]
            assert bucket is not None
            if len(bucket) > RUN_MIN:
                self._take_from_run(i, bucket, now_ms, limit, found)
            else:
                found.extend((d, k, i) for k, d in bucket.items() if d <= now_ms)
            if one_rotation and len(found) >= limit:
                break
        found.sort(key=_deadline)  # (stable: keys due at the same instant stay in the order added)
        del found[limit:]
        touched = set()
        buckets = self._buckets
        run_block, run_due, run = -1, 0, 0  # (found is sorted: one count step per fine block)
        for deadline_ms, key, i in found:
            del buckets[i][key]  # type: ignore[index]
            touched.add(i)
            if deadline_ms >> FINE_SHIFT != run_block:
                if run:
                    self._uncount(run_due, run)
                run_block, run_due, run = deadline_ms >> FINE_SHIFT, deadline_ms, 0
            run += 1
        if run:
            self._uncount(run_due, run)
        for i in touched:
            self._reslot(i)
        self._count -= len(found)
        if found:
            self.changes += 1
        # Fewer than ``limit`` found: everything due by now_ms was taken (the scan above did not
        # stop early), which ``_lowest_after`` needs.
        self._lowest = self._lowest_after(now_ms) if len(found) < limit else min(self._slot_min)
        assert not found or found[-1][0] <= now_ms
        return [(key, deadline_ms) for deadline_ms, key, _ in found]

    def _lowest_after(self, after_ms: int) -> float:
        """The lowest deadline held, given that none is <= ``after_ms``.

        Slot ``t & mask`` holding a deadline below ``(t + 1) * slot_ms``, for the first tick ``t``
        from ``after_ms``'s: that deadline is due in tick ``t`` itself (an earlier rotation's would
        be <= after_ms), and every tick before ``t`` holds none, so it is the lowest. Entries of
        later rotations in the same slots are larger. Not found within ``NEAR_SLOTS``: full min.
        """
        slot_ms, mask, slot_min = self.slot_ms, self._mask, self._slot_min
        tick = after_ms // slot_ms
        for t in range(tick, tick + min(NEAR_SLOTS, self.slots)):
            low = slot_min[t & mask]
            if low < (t + 1) * slot_ms:
                return low
        return min(slot_min)

    def _take_from_run(self, i: int, bucket: dict[int, int], now_ms: int, limit: int,
                       found: list[tuple[int, int, int]]) -> None:
        """Append to ``found`` the (at most ``limit``) earliest entries of slot ``i`` due by
        ``now_ms``, from its run (made once, when first needed)."""
        run = self._runs.get(i)
        if run is None:
            run = self._runs[i] = _run(bucket)
        dues, keys_by_due = run
        taken, j = 0, len(dues) - 1
        while j >= 0 and taken < limit:
            d = dues[j]
            if d > now_ms:
                break
            keys = keys_by_due[d]
            m = len(keys) - 1
            while m >= 0 and taken < limit:
                k = keys[m]
                if bucket.get(k) == d:  # (else removed since the run was made)
                    found.append((d, k, i))
                    taken += 1
                m -= 1
            j -= 1

    def _reslot(self, i: int) -> None:
        bucket = self._buckets[i]
        if not bucket:
            self._buckets[i] = None
            self._slot_min[i] = INF
            self._runs.pop(i, None)
            return
        run = self._runs.get(i)
        if run is None:
            self._slot_min[i] = min(bucket.values())
            return
        dues, keys_by_due = run
        while dues:  # drop what left the slot
            d = dues[-1]
            keys = keys_by_due[d]
            while keys and bucket.get(keys[-1]) != d:
                keys.pop()
            if keys:
                break
            del keys_by_due[d]
            dues.pop()
        assert dues, "a run holds every entry of its slot"
        self._slot_min[i] = dues[-1]

    def items(self):
        """Every (key, deadline), in no particular order (for tests and stats)."""
        for bucket in self._buckets:
            if bucket:
                yield from bucket.items()


def _run(bucket: dict[int, int]) -> tuple[list[int], dict[int, list[int]]]:
    """A crowded slot's run (see the module's docstring): its keys grouped by deadline, each group
    last added first, and the deadlines latest first."""
    keys_by_due: dict[int, list[int]] = {}
    for k, d in bucket.items():
        keys = keys_by_due.get(d)
        if keys is None:
            keys_by_due[d] = [k]
        else:
            keys.append(k)
    for keys in keys_by_due.values():
        keys.reverse()
    return sorted(keys_by_due, reverse=True), keys_by_due
