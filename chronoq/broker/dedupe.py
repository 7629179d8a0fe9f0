"""The dedupe window: which (topic, client message id) pairs were stored lately, a few bytes each.

A producer that resends a message it already sent (its answer was lost) must get the original's
answer, not a second copy. The broker remembers, for ``window_ms`` and at most ``max_entries``
sends, a 64-bit hash of each stored message's key and where its record is. Everything else the
answer needs (topic, id, queue, queue offset, recall handle, body) is in that record, so on a hit
the broker reads the record back and confirms it (``original``, chronoq.broker.resends): a
hash collision is never answered as a duplicate, it only costs a read.

Pure: no I/O; ``now_ms`` is an argument; the key hash can be injected (tests force collisions).
Compiled (chronoq.COMPILED_MODULES) with the C types of ``dedupe.pxd``: the columns are read and
written as C integers; the pure-Python build runs this same source.

Format. Entries get consecutive sequence numbers ``seq``; ``tail <= seq < head`` are live, oldest
first, and ``M = max_entries``. Four typed columns (native byte order) form a ring of M slots,
entry ``seq`` at slot ``seq % M``::

    hashes   int64  hash of (topic, message id)
    commits  int64  commit-log offset of the stored record
    stored   int64  epoch ms the entry was added
    links    int32  seq minus the seq of the next older entry of the same cell, or 0

The index is ``heads``, 2*M int64 cells: cell ``hash % (2*M)`` holds seq + 1 of the newest entry
of that cell, or 0. A chain (a cell's head, then links) runs newest to oldest, so a walk stops at
the first seq below ``tail``: the rest is older still, and their slots may hold newer entries
already. Nothing is ever unlinked: expiry, by time or by count, only moves ``tail``. (A link
longer than M is stored as 0: the older entry was forgotten before the newer one was added.)
A lookup reads one cell and walks its chain, which is mostly empty or one long (at most 40% of
cells are taken, and 10% of keys meet a chain of two or more). Per entry: 28 B of ring and
16 B of cells, 44 B; no Python object per entry.

All columns live in anonymous memory maps: a page counts in RSS once written, so a window that
never filled costs what it holds (the cells are written all over, so they soon cost all of
theirs: 16 B x M).

Invariants (``check`` asserts them):
  * ``0 <= head - tail <= M``;
  * every live seq is on the chain of its cell; chains strictly decrease.
"""

from __future__ import annotations

import mmap
from array import array
from typing import Callable, Iterable, Iterator

MAX_ENTRIES_LIMIT = (1 << 31) - 1  # links are int32

KeyHash = Callable[[str, str], int]


def _zeros(typecode: str, n: int) -> memoryview:
    """``n`` zeroed items of ``typecode`` in an anonymous mapping of their own: its pages count in
    RSS only once written. (Heap arrays grown step by step left freed blocks behind: RSS was
    ~40% above what the window held.)"""
    itemsize = array(typecode).itemsize
    return memoryview(mmap.mmap(-1, max(n, 1) * itemsize)).cast(typecode)[:n]


class DedupeWindow:
    """Recently stored (topic, id) keys: ``hash -> commit offsets``, oldest first, bounded."""

    def __init__(self, max_entries: int, window_ms: int, key_hash: KeyHash | None = None):
        if not max_entries <= MAX_ENTRIES_LIMIT:
            raise ValueError(f"max_entries must be at most {MAX_ENTRIES_LIMIT}, not {max_entries}")
        self.max_entries = max(0, max_entries)  # 0 (or less): the window remembers nothing
        self.window_ms = window_ms
        # Default: Python's hash of the (topic, id) tuple. Strings hash with a per-process random
        # key (SipHash), so a client cannot choose ids that pile up on one chain.
        self._key_hash = key_hash
        self._head = 0
        self._tail = 0
        m = self.max_entries
        self._hashes = _zeros("q", m)
        self._commits = _zeros("q", m)
        self._stored = _zeros("q", m)
        self._links = _zeros("i", m)
        self._heads = _zeros("q", 2 * m)

    def __len__(self) -> int:
        return self._head - self._tail

    # ----------------------------------------------------------------- keys
    def hash_keys(self, topics: Iterable[str], ids: Iterable[str]) -> list[int]:
        """The hash of each (topic, id) pair (zipped)."""
        if self._key_hash is None:
            return list(map(hash, zip(topics, ids)))  # (C loops: no Python call per key)
        return list(map(self._key_hash, topics, ids))

    def hash_key(self, topic: str, message_id: str) -> int:
        return hash((topic, message_id)) if self._key_hash is None else self._key_hash(topic, message_id)

    # ----------------------------------------------------------------- lookups
    def candidates(self, h: int, now_ms: int) -> list[int]:
        """Commit offsets of the live entries with hash ``h`` still inside the window at
        ``now_ms``, newest first. Any of them may be another key with the same hash."""
        m = self.max_entries
        if not m:
            return []
        horizon = now_ms - self.window_ms
        tail, hashes, stored, links = self._tail, self._hashes, self._stored, self._links
        found = []
        seq = self._heads[h % (2 * m)] - 1
        while seq >= tail:  # (below the tail: forgotten, and so is the rest of the chain)
            slot = seq % m
            if hashes[slot] == h and stored[slot] >= horizon:
                found.append(self._commits[slot])
            step = links[slot]
            if not step:
                break
            seq -= step
        return found

    def any_present(self, hs: list[int]) -> bool:
        """Whether any of the hashes ``hs`` has a live entry (expired by time or not): the bulk
        test of the plain-batch path, which declines a batch on True (another key with the same
        hash then only sends the batch the slow way, where ``candidates`` and the record decide).

        A loop over the keys: each reads its cell and, when taken (at most 40% of cells),
        the newest entry of its chain. (Gathering the cells and entries with ``itemgetter``s
        cost a lone send five times as much; a batch pays a few hundred instructions a key in
        pure Python, ~130 compiled: callgrind, batches of 32.)"""
        tail = self._tail
        if self._head == tail:
            return False
        m, heads, hashes, links = self.max_entries, self._heads, self._hashes, self._links
        cells = 2 * m
        for h in hs:
            seq = heads[h % cells] - 1
            while seq >= tail:  # (below the tail: forgotten, and so is the rest of the chain)
                slot = seq % m
                if hashes[slot] == h:
                    return True
                step = links[slot]
                if not step:
                    break
                seq -= step
        return False

    # ----------------------------------------------------------------- changes
    def add(self, hs: list[int], commits: list[int], now_ms: int) -> None:
        """Remember entries (hash, commit offset) stored at ``now_ms``, in this order (the
        newest last); the oldest are forgotten beyond ``max_entries``. One loop over the
        entries writes each one's columns and links it: no column built per call (a lone send,
        the common call, paid ~10k instructions for them); a batch pays ~450 a key for the
        memoryview stores in pure Python (callgrind: batches of 100 with client ids, ~1% a
        message), ~250 compiled (batches of 32, the call included)."""
        n = len(hs)
        assert len(commits) == n
        m = self.max_entries
        if not m:
            return
        start = 0
        if n > m:  # only the last max_entries of the batch can be kept
            self._head += n - m
            self._tail = self._head
            start = n - m
        heads, links, cells = self._heads, self._links, 2 * m
        hashes, commit_col, stored = self._hashes, self._commits, self._stored
        seq = self._head
        for i in range(start, n):  # (by index: compiled, a C loop with no tuple per entry)
            h = hs[i]
            slot = seq % m
            hashes[slot] = h
            commit_col[slot] = commits[i]
            stored[slot] = now_ms
            c = h % cells
            newer = heads[c]  # seq + 1 of the cell's newest entry so far, or 0
            step = seq + 1 - newer
            links[slot] = step if newer and step <= m else 0
            seq += 1
            heads[c] = seq
        self._head = seq
        if seq - m > self._tail:  # forget the oldest beyond the bound
            self._tail = seq - m

    def expire(self, now_ms: int, step: int) -> int:
        """Forget, from the oldest end, at most ``step`` entries added before ``now_ms -
        window_ms``; stops at the first younger one (as the clock may step back, an older entry
        behind it waits for it). Returns how many were forgotten."""
        horizon = now_ms - self.window_ms
        tail, m, stored = self._tail, self.max_entries, self._stored
        limit = min(self._head, tail + step)
        while tail < limit and stored[tail % m] < horizon:
            tail += 1
        done = tail - self._tail
        self._tail = tail
        return done

    # ----------------------------------------------------------------- inspection
    def items(self) -> Iterator[tuple[int, int, int]]:
        """(hash, commit offset, stored ms) of each live entry, oldest first."""
        m = self.max_entries
        slots = [seq % m for seq in range(self._tail, self._head)]
        return iter([(self._hashes[s], self._commits[s], self._stored[s]) for s in slots])

    def memory_bytes(self) -> int:
        """Bytes the columns and cells take once every page was written (RSS is less until the
        ring has come round once)."""
        return 44 * self.max_entries

    def check(self) -> None:
        """Assert the invariants in the module docstring (tests; O(max_entries))."""
        head, tail, m = self._head, self._tail, self.max_entries
        assert 0 <= head - tail <= m
        seen = set()
        heads = self._heads
        for c in range(2 * m):
            seq = heads[c] - 1
            while seq >= tail:
                assert seq < head and seq not in seen
                slot = seq % m
                assert self._hashes[slot] % (2 * m) == c, "an entry is on its own cell's chain"
                seen.add(seq)
                step = self._links[slot]
                assert step >= 0, "chains strictly decrease"
                if not step:
                    break
                seq -= step
        assert seen == set(range(tail, head))
