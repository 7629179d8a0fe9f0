"""What the timer reports: ``stats`` (docs/timers.md, "Observing the timer") and the pending
counts by horizon for metrics, with their per-bucket cache (``Horizon``, a part of
``TimerService``).

A bucket not loaded is counted from its file and buffer once; after that the count follows the
entries appended to it (``count_appended``), as long as each one provably changes it by a known
amount:

* a MESSAGE naming an ident above every ident the bucket has seen is a new pending message, +1
  (idents are commit offsets, absorbed in log order, so this is the common case);
* a CANCELLED or MOVED entry whose appender *proved* its target pending in this very bucket, -1:
  the absorb of a recall, reschedule, cancel-by-key or replacing record whose writer found the
  target pending in the bucket its reference names and marked it in flight (no tick claims it,
  no second tombstone is written for it), the mark still the one this record set
  (``SendSide._file_tombstone``); the ident must also be one the count has seen (at most the
  bucket's top), and one entry decrements once;
* anything else drops the count, and the next ask reads that bucket again: a MESSAGE that may be
  a replayed duplicate, a tombstone replayed at recovery or absorbed twice (no mark then), a
  DISPATCHED entry, a tombstone whose target state its appender did not know.

Writing a buffer to its file changes nothing counted. So a metrics scrape or the history
sampler costs per bucket, not per pending message: counting every file at each sample held the
event loop for a time that grew with the number of pending timers, and dropping a count at
every tombstone made replace-by-key traffic over many buckets re-read each of them at every
scrape (50-74 ms loop stalls, ``bench/stalls.py --keyed --replace``). ``warm_horizon_cache``
fills the cache a few buckets at a time.

A mixin, like ``chronoq.timer.absorb``: it reads every other part's state.
"""

from __future__ import annotations

import bisect
import itertools

from chronoq.core.delay_levels import DELAY_TOPIC
from chronoq.timer import schedlog
from chronoq.timer.buckets import LOADED, count_pending
from chronoq.timer.delivery import LevelLane

STATS_BUCKETS_MAX = 10_080  # a week of one-minute buckets
_TOMBSTONES = (schedlog.CANCELLED, schedlog.MOVED)  # what a recall-like record files for its target


class Horizon:
    """Mixed into ``TimerService``: reads its state; owns ``_horizon_cache``, ``_warm_todo`` and
    ``_horizon_warm`` (``BucketLife`` drops cache entries)."""

    def stats(self, horizon_ms: int = 600_000) -> dict:
        """Plain-dict observability data (see docs/timers.md, "Observing the timer")."""
        now = self._now()
        first = schedlog.bucket_start(now, self.width)
        count = min(max(horizon_ms, 0) // self.width + 1, STATS_BUCKETS_MAX)
        due_by_bucket = [{"start_ms": first + i * self.width, "end_ms": first + (i + 1) * self.width,
                          "pending": self._pending_cached(first + i * self.width)} for i in range(count)]
        overdue = sum(len(self.buckets[s].pending) + len(self.buckets[s].claimed) for s in self._loaded if s < first)
        levels = []
        for lane in self.level_lanes:
            lo, hi = self.store.bounds(DELAY_TOPIC, lane.queue_id)
            backlog = max(0, hi - max(lane.offset, lo))
            head = lane.head_due if lane.head_due is not None or not backlog else self._peek_level(lane)
            levels.append({"level": lane.level, "delay_ms": lane.delay_ms, "offset": lane.offset,
                           "next_offset": hi, "backlog": backlog, "head_due_ms": head, "lane": lane.stats()})
        return {
            "now_ms": now, "cursor": self.cursor, "bucket_ms": self.width, "deliver_mode": self.opts.deliver_mode,
            "lateness": self.histogram.snapshot(),
            "due_by_bucket": due_by_bucket, "overdue_pending": overdue,
            "wheel": {"entries": len(self.wheel), "next_deadline_ms": self.wheel.next_deadline(),
                      "burst_claims": self.burst_claims, "burst_lead_last_ms": self.burst_lead_last_ms,
                      "burst_lead_top_ms": self.burst_lead_top_ms},
            "buckets": {"loaded": sum(1 for s in self._loaded if self.buckets[s].state == LOADED),
                        "loading": len(self._loading), "waiting_on_disk": len(self._in_heap),
                        "done_files": len(self._done), "finished": self.buckets_finished},
            "timer_lane": self.timer_lane.stats(), "levels": levels,
            "buffered_bytes": self._buffered, "records_replayed_at_start": self.caught_up, "lost": self.lost,
            "damage": [vars(d) for d in self.damage], "notes": list(self.notes),
        }

    def pending_by_horizon(self, horizons_ms: tuple[int, ...]) -> list[int]:
        """Pending delayed messages due within each horizon from now (cumulative; overdue ones
        count in every horizon), timer messages and delay-level messages together. For metrics.

        Unloaded buckets are counted once and then kept by ``count_appended`` (module docstring).
        Level queues are in due order, so each horizon is a binary search over the queue.
        """
        assert list(horizons_ms) == sorted(horizons_ms) and all(h >= 0 for h in horizons_ms)
        now = self._now()
        # by_first[i]: messages whose bucket is first inside horizon i (the last slot: none).
        by_first = [0] * (len(horizons_ms) + 1)
        cache, buckets, count = self._horizon_cache, self.buckets, self._pending_cached
        where = bisect.bisect_left
        live = self._in_heap | buckets.keys()
        for start in live:
            # A bucket's messages are due inside [start, start + width): count them at its start
            # (overdue: start - now < 0, inside every horizon).
            by_first[where(horizons_ms, start - now)] += count(start)
        for gone in cache.keys() - live:  # finished buckets (C-level set difference)
            del cache[gone]
        out = list(itertools.accumulate(by_first[:-1]))
        for lane in self.level_lanes:
            lo, hi = self.store.bounds(DELAY_TOPIC, lane.queue_id)
            first = max(lane.offset, lo)
            for i, horizon in enumerate(horizons_ms):
                out[i] += self._level_due_before(lane, first, hi, now + horizon) - first
        return out

    def horizon_ready(self, budget_ns: int = 2_000_000) -> bool:
        """Whether every bucket on disk has been counted once since the start; if not, count a
        few more (``warm_horizon_cache``, ``budget_ns``). Until then ``pending_by_horizon`` may
        read many schedule files at once (2 million pending timers: 4,000 files, 5-7 s on the
        loop), so the periodic readers (the history sampler, ``/metrics``) wait for it."""
        return self._horizon_warm or self.warm_horizon_cache(budget_ns)

    def warm_horizon_cache(self, budget_ns: int) -> bool:
        """Count the buckets on disk into ``pending_by_horizon``'s cache a few at a time (at most
        ``budget_ns`` per call, on the caller's thread), so the first metrics scrape or console view
        after a start with many pending timers does not read every schedule file at once. Returns
        True once a full pass is done; later changes keep or drop single entries (``count_appended``)."""
        if self._horizon_warm:
            return True
        if self._warm_todo is None:
            self._warm_todo = list(self._in_heap | self.buckets.keys())
        todo, deadline = self._warm_todo, self.clock.monotonic_ns() + budget_ns
        while todo:
            start = todo.pop()
            if start in self._in_heap or start in self.buckets:
                self._pending_cached(start)
            if self.clock.monotonic_ns() >= deadline:
                break
        if not todo:
            self._horizon_warm, self._warm_todo = True, None
        return self._horizon_warm

    def _level_due_before(self, lane: LevelLane, lo: int, hi: int, limit_ms: int) -> int:
        """First queue offset in [lo, hi) of ``lane`` due after ``limit_ms`` (hi if none): its
        entries are in arrival order, so in due order (stored time + the level's delay)."""
        while lo < hi:
            mid = (lo + hi) // 2
            entry = self.store.entries(DELAY_TOPIC, lane.queue_id, mid, 1)
            if entry and entry[0][3] + lane.delay_ms > limit_ms:
                hi = mid
            else:
                lo = mid + 1
        return lo

    def _pending_cached(self, start: int) -> int:
        """``_pending_in``, with the count of an unloaded bucket kept (``count_appended``)."""
        b = self.buckets.get(start)
        if b is not None and b.state == LOADED:
            return len(b.pending) + len(b.claimed)
        if b is None and start not in self._in_heap:
            return 0
        hit = self._horizon_cache.get(start)
        if hit is None:
            hit = self._horizon_cache[start] = self._pending_in(start)
        return hit[0]

    def count_appended(self, start: int, entries: bytes, pending_target: int | None = None) -> None:
        """``entries`` were appended to bucket ``start``: keep its cached count exact, or drop it.

        ``pending_target``: the ident of a CANCELLED/MOVED entry among them whose appender proved
        that message pending in this bucket until now (module docstring); None: no such proof.

        Exact because the pending set is {MESSAGE idents} minus {idents a tombstone names}: an
        ident above every ident the bucket's entries name was neither counted nor cancelled, and
        a proven pending one was counted (its MESSAGE came first: it is at most the top) and is
        cancelled now, once."""
        hit = self._horizon_cache.get(start)
        if hit is None:
            return
        count, top = hit
        pos, end = 0, len(entries)
        while pos < end:
            total, kind, ident, _due, _aux = schedlog.entry_fields(entries, pos)
            if kind == schedlog.MESSAGE and ident > top:
                count, top = count + 1, ident
            elif ident == pending_target and kind in _TOMBSTONES and ident <= top and count > 0:
                count, pending_target = count - 1, None  # (a second tombstone for it: dropped)
            else:
                del self._horizon_cache[start]
                return
            pos += total
        self._horizon_cache[start] = (count, top)

    def _pending_in(self, start: int) -> tuple[int, int]:
        """(pending, highest ident named) of a bucket not loaded, read from its file and buffer."""
        b = self.buckets.get(start)
        assert b is None or b.state != LOADED, "a loaded bucket is counted from memory"
        path = self._path(start)
        file_data = schedlog.read_file(path) if start in self._in_heap or b is not None else b""
        extra = bytes(b.buffer) if b is not None else b""
        if not file_data and not extra:
            return 0, -1
        return count_pending(path, start, file_data, extra)
