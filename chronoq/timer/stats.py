"""Timer observability data: the lateness histogram. Pure: no I/O, no clock.

Lateness = the time a delivered copy became visible to readers (after its fsync, and for a copy
written ahead, when the timer's tick released its hold) minus its due time. It is
never negative unless a message was delivered early, which the timer counts separately
(``early``) so a test or an operator sees a violation of invariant 2 at once.
"""

from __future__ import annotations

import bisect
from collections import Counter

# Upper bounds (ms, inclusive) of the histogram buckets; one more bucket holds everything above.
LATENESS_BOUNDS_MS = (0, 1, 2, 5, 10, 20, 50, 100, 200, 500, 1_000, 2_000, 5_000, 10_000, 30_000, 60_000)


class LatenessHistogram:
    __slots__ = ("counts", "count", "sum_ms", "max_ms", "early")

    def __init__(self) -> None:
        self.counts = [0] * (len(LATENESS_BOUNDS_MS) + 1)
        self.count = 0
        self.sum_ms = 0
        self.max_ms = 0
        self.early = 0

    def record(self, lateness_ms: int) -> None:
        if lateness_ms < 0:
            self.early += 1
            lateness_ms = 0
        self.counts[bisect.bisect_left(LATENESS_BOUNDS_MS, lateness_ms)] += 1
        self.count += 1
        self.sum_ms += lateness_ms
        if lateness_ms > self.max_ms:
            self.max_ms = lateness_ms

    def record_many(self, visible_ms: int, dues_ms: list[int]) -> None:
        """``record(visible_ms - due)`` for each due time (a burst shares few distinct ones)."""
        counts, bounds = self.counts, LATENESS_BOUNDS_MS
        for due, n in Counter(dues_ms).items():
            lateness_ms = visible_ms - due
            if lateness_ms < 0:
                self.early += n
                lateness_ms = 0
            counts[bisect.bisect_left(bounds, lateness_ms)] += n
            self.count += n
            self.sum_ms += lateness_ms * n
            if lateness_ms > self.max_ms:
                self.max_ms = lateness_ms

    def quantile_ms(self, q: float) -> int | None:
        """Upper bound of the bucket holding quantile ``q`` (the max for the open last bucket)."""
        if not self.count:
            return None
        rank = max(1, int(q * self.count + 0.999999))
        seen = 0
        for i, c in enumerate(self.counts):
            seen += c
            if seen >= rank:
                return min(LATENESS_BOUNDS_MS[i], self.max_ms) if i < len(LATENESS_BOUNDS_MS) else self.max_ms
        return self.max_ms

    def snapshot(self) -> dict:
        buckets = [{"le_ms": b, "count": c} for b, c in zip(LATENESS_BOUNDS_MS, self.counts)]
        buckets.append({"le_ms": None, "count": self.counts[-1]})
        return {"count": self.count, "sum_ms": self.sum_ms, "max_ms": self.max_ms, "early": self.early,
                "p50_ms": self.quantile_ms(0.50), "p99_ms": self.quantile_ms(0.99),
                "p999_ms": self.quantile_ms(0.999), "buckets": buckets}
