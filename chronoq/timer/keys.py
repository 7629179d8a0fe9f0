"""The key index: which pending timer messages carry a given key, a few bytes each. Pure: no I/O.

Replace by key and cancel by key (docs/timers.md) must find the pending messages of a topic that
carry a key among millions without a Python object per message. The index maps a 64-bit hash of
(namespace, topic, key) to timer identities (the commit offset of the delayed record, the
message's schedule-entry ident) and the bucket that holds each one. Namespaces: ``REPLACE`` for
the replace key (``CHRONOQ_REPLACE_KEY``, at most one pending message per (topic, key)) and
``MESSAGE_KEY`` for each RocketMQ message key (any number per key). A hit is a *candidate*: the
caller reads the record and checks topic and key (a hash collision is another message; it only
costs a read).

Format: open addressing with linear probing over three columns of ``capacity`` slots, in
anonymous memory maps (a page counts in RSS once written; chronoq.broker.dedupe does the same)::

    cells   uint64  fingerprint << 48 | ident   (0: empty, 1: deleted; a live cell is >= 1 << 48)
    lows    uint32  the hash's low 32 bits (they place the cell: growing needs them)
    starts  uint32  bucket start // width - base, or NO_START when it does not fit

The home slot of a hash is ``(low32 * capacity) >> 32`` (any capacity, not only powers of two);
its fingerprint is bits 48..63 of the hash (0 turned into 1, so a live cell is never 0 or 1). A
probe compares 48 bits of the hash before the record is read. ``ident`` must be below 2 ** 48
(256 TiB of commit log).

Size: 16 B a slot. The table grows by half when live plus deleted cells pass 3/4 of it (and is
rebuilt at the same size when deleted cells are most of them), so it is between 1/2 and 3/4
full: at most 32 B of RAM per indexed key (about 21 B just before a growth; 24 B measured at
1,000,000 keys, bench/timers.py --parts g). A build that can estimate its size makes room once
(``reserve``: the restart build, chronoq.timer.keyed), so no growth stalls it on the way.

Hot keys. Every message under one key has the same home slot, so they form one probe run, and
the ``MESSAGE_KEY`` namespace allows any number per key (a tenant id as the key of every timer):
each add walked the whole run (20,000 timers of one key held the event loop 78 s), and so did
every other key placed in it. Once an add walks ``HOT_RUN`` cells of its own hash bits, that
key's cells move to ``hot``, a dict per key ({ident: bucket start}: ~100 B an entry, only for
such keys), and its later adds, removes and lookups are dict operations. A key stays hot until
it has no entry left.

Invariants (``check`` asserts them): every live cell is reachable from its home slot without
crossing an empty one; ``live`` and ``deleted`` count the cells that are so; no cell holds the
hash bits of a hot key.
"""

from __future__ import annotations

import mmap
from array import array

REPLACE = "r"
MESSAGE_KEY = "k"
EMPTY = 0
DELETED = 1
IDENT_BITS = 48
IDENT_MASK = (1 << IDENT_BITS) - 1
NO_START = 0xFFFFFFFF
_MASK64 = (1 << 64) - 1
_LOW32 = 0xFFFFFFFF
CAPACITY_MIN = 1024
SLOT_BYTES = 16
HOT_RUN = 64  # cells of one key's hash bits an add walks past before the key goes to ``hot``


def _zeros(typecode: str, n: int) -> memoryview:
    """``n`` zeroed items in an anonymous mapping of their own (RSS only once written)."""
    itemsize = array(typecode).itemsize
    assert itemsize == {"Q": 8, "I": 4}[typecode]
    return memoryview(mmap.mmap(-1, n * itemsize)).cast(typecode)


def key_hash(namespace: str, topic: str, key: str) -> int:
    """The 64-bit hash of a key (Python's string hash: randomized per process, so a client cannot
    choose keys that pile up on one probe run; the index is rebuilt at every start)."""
    return hash((namespace, topic, key)) & _MASK64


def _fingerprint(h: int) -> int:
    return ((h >> IDENT_BITS) or 1) << IDENT_BITS


class KeyIndex:
    """hash -> (ident, bucket start) candidates; several idents may share a hash."""

    def __init__(self, width_ms: int, base_ms: int, capacity: int = CAPACITY_MIN):
        assert capacity >= CAPACITY_MIN
        self.width = width_ms
        # Bucket numbers are kept relative to the bucket of ``base_ms`` (the start time), 2 ** 31
        # of them either side: 4,000 years at the default one-minute width.
        self._base = base_ms // width_ms - (1 << 31)
        self.live = 0
        self.deleted = 0
        # Hot keys (module docstring): fingerprint | low 32 bits -> {ident: bucket start or None}.
        self.hot: dict[int, dict[int, int | None]] = {}
        self.hot_entries = 0
        self._alloc(capacity)

    def _alloc(self, capacity: int) -> None:
        self.capacity = capacity
        self._cells = _zeros("Q", capacity)
        self._lows = _zeros("I", capacity)
        self._starts = _zeros("I", capacity)

    def __len__(self) -> int:
        return self.live + self.hot_entries

    def memory_bytes(self) -> int:
        """RAM the columns take once every page was written (hot keys: ~100 B an entry)."""
        return SLOT_BYTES * self.capacity + 100 * self.hot_entries

    # ----------------------------------------------------------------- lookups
    def candidates(self, h: int) -> list[tuple[int, int | None]]:
        """(ident, bucket start or None) of every live cell whose hash bits match ``h``'s."""
        cells, lows, cap = self._cells, self._lows, self.capacity
        fp, low = _fingerprint(h), h & _LOW32
        slot = (low * cap) >> 32
        hot = self.hot.get(fp | low) if self.hot else None
        out = list(hot.items()) if hot is not None else []
        while True:
            c = cells[slot]
            if c == EMPTY:
                return out
            if c & ~IDENT_MASK == fp and lows[slot] == low:
                rel = self._starts[slot]
                out.append((c & IDENT_MASK, None if rel == NO_START else (rel + self._base) * self.width))
            slot += 1
            if slot == cap:
                slot = 0

    # ----------------------------------------------------------------- changes
    def add(self, h: int, ident: int, start: int) -> bool:
        """Index ``ident`` (in bucket ``start``) under ``h``; False when it already is."""
        assert 0 <= ident <= IDENT_MASK, f"ident {ident} does not fit in {IDENT_BITS} bits"
        cells, lows, cap = self._cells, self._lows, self.capacity
        fp, low = _fingerprint(h), h & _LOW32
        if self.hot:
            hot = self.hot.get(fp | low)
            if hot is not None:
                if ident in hot:
                    return False
                hot[ident] = self._start_of(start)
                self.hot_entries += 1
                return True
        cell = fp | ident
        slot = (low * cap) >> 32
        free = -1
        mine = 0  # cells of this key's hash bits walked past
        while True:
            c = cells[slot]
            if c == cell and lows[slot] == low:
                return False
            if c == EMPTY:
                break
            if c == DELETED:
                if free < 0:
                    free = slot
            elif c & ~IDENT_MASK == fp and lows[slot] == low:
                mine += 1
            slot += 1
            if slot == cap:
                slot = 0
        if mine >= HOT_RUN:  # a hot key: its cells go to a dict of its own, and this entry too
            self._make_hot(fp, low)
            self.hot[fp | low][ident] = self._start_of(start)
            self.hot_entries += 1
            return True
        if free >= 0:
            slot = free
            self.deleted -= 1
        cells[slot] = cell
        lows[slot] = low
        rel = start // self.width - self._base
        self._starts[slot] = rel if 0 <= rel < NO_START else NO_START
        self.live += 1
        if (self.live + self.deleted) * 4 > cap * 3:
            self._rebuild()
        return True

    def remove(self, h: int, ident: int) -> bool:
        """Forget ``ident`` under ``h``; False when it was not there."""
        cells, lows, cap = self._cells, self._lows, self.capacity
        cell, low = _fingerprint(h) | ident, h & _LOW32
        if self.hot:
            hk = (cell & ~IDENT_MASK) | low
            hot = self.hot.get(hk)
            if hot is not None and ident in hot:
                del hot[ident]
                self.hot_entries -= 1
                if not hot:
                    del self.hot[hk]
                return True
        slot = (low * cap) >> 32
        while True:
            c = cells[slot]
            if c == EMPTY:
                return False
            if c == cell and lows[slot] == low:
                nxt = slot + 1 if slot + 1 < cap else 0
                # An empty successor ends every probe run through here: the slot can be empty too.
                if cells[nxt] == EMPTY:
                    cells[slot] = EMPTY
                else:
                    cells[slot] = DELETED
                    self.deleted += 1
                self.live -= 1
                return True
            slot += 1
            if slot == cap:
                slot = 0

    def _start_of(self, start: int) -> int | None:
        """A bucket start as ``candidates`` answers it (None when it does not fit the column)."""
        rel = start // self.width - self._base
        return (rel + self._base) * self.width if 0 <= rel < NO_START else None

    def _make_hot(self, fp: int, low: int) -> None:
        """Move every cell of these hash bits to ``hot`` (module docstring), leaving DELETED."""
        cells, lows, starts, cap = self._cells, self._lows, self._starts, self.capacity
        entries: dict[int, int | None] = {}
        slot = (low * cap) >> 32
        while True:
            c = cells[slot]
            if c == EMPTY:
                break
            if c > DELETED and c & ~IDENT_MASK == fp and lows[slot] == low:
                rel = starts[slot]
                entries[c & IDENT_MASK] = None if rel == NO_START else (rel + self._base) * self.width
                cells[slot] = DELETED
                self.live -= 1
                self.deleted += 1
            slot += 1
            if slot == cap:
                slot = 0
        self.hot[fp | low] = entries
        self.hot_entries += len(entries)
        if self.deleted * 2 > cap:  # mostly tombstones now: rebuilt at the same size
            self._rebuild(cap)

    def reserve(self, count: int) -> None:
        """Make room for ``count`` keys at once (a build that can estimate its size): no growth
        on the way there, each growth being O(capacity) in one call."""
        if count * 3 // 2 > self.capacity:
            self._rebuild(count * 3 // 2)

    def _rebuild(self, capacity: int = 0) -> None:
        """Half again the capacity (or the same, when deleted cells were most of the load; or
        ``capacity``), the live cells re-placed from their stored low hash bits: O(capacity),
        amortized O(1) a key."""
        old_cells, old_lows, old_starts, old_cap = self._cells, self._lows, self._starts, self.capacity
        cap = capacity or (old_cap + old_cap // 2 if self.live * 2 > old_cap else old_cap)
        self._alloc(cap)
        cells, lows, starts = self._cells, self._lows, self._starts
        for slot in range(old_cap):
            c = old_cells[slot]
            if c <= DELETED:
                continue
            low = old_lows[slot]
            s = (low * cap) >> 32
            while cells[s] != EMPTY:
                s = s + 1 if s + 1 < cap else 0
            cells[s] = c
            lows[s] = low
            starts[s] = old_starts[slot]
        self.deleted = 0
        for view in (old_cells, old_lows, old_starts):
            view.release()

    # ----------------------------------------------------------------- inspection
    def check(self) -> None:
        """Assert the invariants in the module docstring (tests; O(capacity))."""
        cells, lows, cap = self._cells, self._lows, self.capacity
        live = deleted = 0
        for slot in range(cap):
            c = cells[slot]
            if c == DELETED:
                deleted += 1
            elif c != EMPTY:
                live += 1
                s = (lows[slot] * cap) >> 32
                while s != slot:
                    assert cells[s] != EMPTY, "a live cell is reachable from its home slot"
                    s = s + 1 if s + 1 < cap else 0
        assert (live, deleted) == (self.live, self.deleted)
        assert (live + deleted) * 4 <= cap * 3
        assert self.hot_entries == sum(map(len, self.hot.values())) and all(self.hot.values())
        for slot in range(cap):
            c = cells[slot]
            assert c <= DELETED or ((c & ~IDENT_MASK) | lows[slot]) not in self.hot, "a hot key's cell"
