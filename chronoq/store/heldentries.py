"""One consume queue's held entries (``ConsumeQueue.held``): (queue offset, due ms) pairs, offsets
ascending, released from the first while the first is due. Pure: no I/O.

Two arrays of 64-bit ints and the index of the first unreleased pair, not a deque of tuples: a
burst of 300,000 copies written ahead of one due instant is 300,000 held entries in one queue,
which as tuples of two ints cost 29-38 MB (tracemalloc) and took ~30 ms of the event loop to free at their
release (each tuple and its two ints deallocated one by one); as arrays they take 4.9 MB and are
released by resetting an index, and freed as two buffers.
"""

from __future__ import annotations

from array import array

COMPACT_MIN = 4096  # released pairs kept at the arrays' front before they are cut away


class HeldEntries:
    __slots__ = ("_offsets", "_dues", "_first", "_due_max")

    def __init__(self) -> None:
        self._offsets = array("q")
        self._dues = array("q")
        self._first = 0  # pairs before it are released
        # The latest due time appended since the entries were last empty (at least the latest
        # held): once it is due, ``release`` releases them all with no walk (a burst's copies).
        self._due_max = 0

    def __len__(self) -> int:
        return len(self._offsets) - self._first

    def __bool__(self) -> bool:
        return len(self._offsets) > self._first

    def __iter__(self):
        """The held (offset, due ms) pairs, first first."""
        first = self._first
        return zip(self._offsets[first:], self._dues[first:])

    def first_offset(self) -> int:
        assert self, "no entry is held"
        return self._offsets[self._first]

    def first_due(self) -> int:
        assert self, "no entry is held"
        return self._dues[self._first]

    def last_offset(self) -> int:
        assert self, "no entry is held"
        return self._offsets[-1]

    def append(self, offset: int, due_ms: int) -> None:
        """Hold the entry at ``offset`` (past every offset held)."""
        if not self:
            self._clear()
            self._due_max = due_ms
        else:
            assert offset > self._offsets[-1], (offset, self._offsets[-1])
            if due_ms > self._due_max:
                self._due_max = due_ms
        self._offsets.append(offset)
        self._dues.append(due_ms)

    def release(self, now_ms: int) -> bool:
        """Release the held pairs due at or before ``now_ms``, from the first on (a later-due one
        keeps those after it held). Returns whether any was released."""
        if not self or self._dues[self._first] > now_ms:
            return False
        if self._due_max <= now_ms:  # every one is due
            self._clear()
            return True
        dues, i, end = self._dues, self._first, len(self._dues)
        while i < end and dues[i] <= now_ms:
            i += 1
        self._first = i
        if i >= COMPACT_MIN and i * 2 >= end:  # (the released front: cut once it is half)
            del self._offsets[:i], self._dues[:i]
            self._first = 0
        return True

    def drop_from(self, offset: int) -> None:
        """Forget the held pairs at ``offset`` and beyond (the queue was cut there)."""
        offsets = self._offsets
        n = len(offsets)
        while n > self._first and offsets[n - 1] >= offset:
            n -= 1
        del offsets[n:], self._dues[n:]
        if not self:
            self._clear()

    def _clear(self) -> None:
        self._offsets = array("q")
        self._dues = array("q")
        self._first = 0
