"""Pending timer messages of each topic by due time: the console's per-topic horizon.

``TimerService.pending_by_horizon`` (``chronoq.timer.horizon``) counts every topic together, and
its per-bucket cache keeps totals only. ``TopicCounts`` keeps, per schedule bucket, the count of
pending messages by topic, read from the message entries themselves: a bucket entry's payload is
the whole commit-log record, whose topic sits at a fixed place (``record`` bytes 46 and 60..), so
telling topics apart costs a byte compare per message, no decoding.

- A LOADED bucket is counted from memory (``Bucket.pending`` and its entry data) at every call.
- Any other bucket is counted from its file plus its unflushed buffer, and the count is kept with
  the file's size and modification time and the buffer's length as its key: schedule files only
  grow (entries, then tombstones, are appended), so a key that changed means a new count. Those
  counts are made off the event loop (``refresh``: the keys and copies of the buffers taken on
  the loop, the files read up to the size in their key and counted on a worker thread): the
  first view after a start reads every bucket file, and while sends go on every view reads the
  buckets they changed; counted on the loop, that held it for 0.6 s with 500,000 timers pending.
- Messages claimed for delivery this very moment (``Bucket.claimed``: due, their copy being
  written) are not counted; nor are delay-level messages, whose topic is a property of each
  record in the level queues (the timer-horizon page counts both, for all topics).

It reads the timer's state as the ``Horizon`` mixin does, on the event loop thread; only the
files and the buffers' copies are read on the worker thread.
"""

from __future__ import annotations

import asyncio
import bisect
import os
from collections import Counter

from chronoq.timer import schedlog
from chronoq.timer.buckets import LOADED
from chronoq.timer.schedlog import ENTRY_HEAD_SIZE, MESSAGE

_TOPIC_LEN_AT = 46  # chronoq.store.record: topic_len (u8) at byte 46, the topic from byte 60
_TOPIC_AT = 60


def _topic_of(data, entry_pos: int) -> bytes:
    """The topic of the record in the MESSAGE entry at ``entry_pos`` of ``data``."""
    p = entry_pos + ENTRY_HEAD_SIZE
    return bytes(data[p + _TOPIC_AT:p + _TOPIC_AT + data[p + _TOPIC_LEN_AT]])


def count_entries(path: str, start: int, file_data: bytes, extra: bytes) -> Counter:
    """Pending messages by topic (bytes) of an unloaded bucket: its file and unflushed entries."""
    where: dict[int, tuple[bytes, int]] = {}  # ident -> (data, pos) of its MESSAGE entry
    pairs = []
    if file_data:
        try:
            for pos, _total, kind, ident, _due, _aux in schedlog.scan(path, start, file_data):
                pairs.append((kind, ident))
                if kind == MESSAGE:
                    where.setdefault(ident, (file_data, pos))
        except schedlog.SchedLogError:  # a bad file header: nothing in the file can be trusted
            pass
    pos = 0
    while pos < len(extra):
        total, kind, ident, _due, _aux = schedlog.entry_fields(extra, pos)
        pairs.append((kind, ident))
        if kind == MESSAGE:
            where.setdefault(ident, (extra, pos))
        pos += total
    out: Counter = Counter()
    for ident, kind in schedlog.summarize(pairs).items():
        if kind == MESSAGE:
            data, at = where[ident]
            out[_topic_of(data, at)] += 1
    return out


class TopicCounts:
    """Per-topic pending counts of a ``TimerService``'s buckets, with a per-bucket cache."""

    def __init__(self, timer) -> None:
        self.timer = timer
        self._cache: dict[int, tuple[tuple, Counter]] = {}  # bucket start -> (key, counts)

    async def refresh(self) -> None:
        """Bring the counts of buckets not loaded up to date, the files read and counted on a
        worker thread (module docstring); call it on the loop before ``pending_by_horizon``."""
        stale = self._stale()
        if stale:
            for start, key, counts in await asyncio.to_thread(_count_files, stale):
                self._cache[start] = (key, counts)

    def _stale(self) -> list[tuple[int, str, tuple, bytes]]:
        """(start, path, key, copy of the buffer) of each live bucket not loaded whose count is
        missing or older than its file and buffer."""
        timer, cache, stale = self.timer, self._cache, []
        for start in timer._in_heap | timer.buckets.keys():
            b = timer.buckets.get(start)
            if b is not None and b.state == LOADED:
                continue
            path = timer._path(start)
            key = _key(path, b)
            hit = cache.get(start)
            if hit is None or hit[0] != key:
                stale.append((start, path, key, bytes(b.buffer) if b is not None else b""))
        return stale

    def _bucket(self, start: int) -> Counter:
        timer = self.timer
        b = timer.buckets.get(start)
        if b is not None and b.state == LOADED:
            assert b.data is not None
            return Counter(_topic_of(b.data, pos) for _due, pos, _len in b.pending.values())
        hit = self._cache.get(start)
        if hit is None:  # (a bucket begun since ``refresh``: new, so small)
            path = timer._path(start)
            (_s, key, counts), = _count_files([(start, path, _key(path, b), bytes(b.buffer) if b is not None else b"")])
            hit = self._cache[start] = (key, counts)
        return hit[1]

    def pending_by_horizon(self, topic: str, horizons_ms: tuple[int, ...]) -> list[int]:
        """Pending timer messages of ``topic`` due within each horizon from now (cumulative;
        overdue ones in every horizon): ``TimerService.pending_by_horizon`` for one topic, timer
        messages only (module docstring)."""
        assert list(horizons_ms) == sorted(horizons_ms) and all(h >= 0 for h in horizons_ms)
        timer, name = self.timer, topic.encode()
        now = timer._now()
        by_first = [0] * (len(horizons_ms) + 1)
        live = timer._in_heap | timer.buckets.keys()
        for start in live:
            n = self._bucket(start).get(name, 0)
            if n:
                by_first[bisect.bisect_left(horizons_ms, start - now)] += n
        for gone in self._cache.keys() - live:
            del self._cache[gone]
        out, total = [], 0
        for n in by_first[:-1]:
            total += n
            out.append(total)
        return out


def _key(path: str, b) -> tuple[int, int, int]:
    """What a bucket's count is kept with: its file's size and modification time, its buffer's length."""
    try:
        st = os.stat(path)
        return st.st_size, st.st_mtime_ns, len(b.buffer) if b is not None else 0
    except FileNotFoundError:
        return 0, 0, len(b.buffer) if b is not None else 0


def _count_files(stale: list[tuple[int, str, tuple, bytes]]) -> list[tuple[int, tuple, Counter]]:
    """``count_entries`` of each (start, path, key, buffer): the file read up to the size in its key,
    the part the buffer's copy follows (the file may have grown by that buffer since). Reads no
    timer state: safe on a worker thread."""
    out = []
    for start, path, key, extra in stale:
        # (removed since, finished: read as empty, and gone from the live buckets at the next view)
        file_data = schedlog.read_file(path)[:key[0]] if key[0] else b""
        out.append((start, key, count_entries(path, start, file_data, extra)))
    return out
