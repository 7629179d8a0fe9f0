"""Lateness over time: a bounded ring of per-interval percentiles. Pure: the caller passes ``now``.

The timer keeps one cumulative lateness histogram since start (``chronoq.timer.stats``). Every
``interval`` the console hands its snapshot to ``LatenessRing.observe``, which subtracts the
previous snapshot and keeps, for that interval, the count and p50/p99/max computed from the
difference with the timer's own quantile rule (``LatenessHistogram.quantile_ms``), so the console
and ``chronoq timers`` agree.

The interval's max is exact when the histogram's all-time max grew during the interval (then it
is the new max); otherwise it is the upper bound of the highest bucket that gained entries (the
histogram keeps no per-interval max). Percentiles are bucket upper bounds, as everywhere else.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from chronoq.timer.stats import LATENESS_BOUNDS_MS, LatenessHistogram

RING_SAMPLES_DEFAULT = 360  # an hour of 10 s samples


@dataclass(frozen=True, slots=True)
class Sample:
    start_ms: int   # the interval [start_ms, end_ms) of broker clock time
    end_ms: int
    count: int      # timer deliveries made visible in it
    p50_ms: int | None
    p99_ms: int | None
    max_ms: int | None
    early: int      # deliveries before their due time (invariant 2: must stay 0)


def interval(prev: dict | None, cur: dict, start_ms: int, end_ms: int) -> Sample:
    """The sample for the deliveries between two snapshots (``LatenessHistogram.snapshot``)."""
    counts = [b["count"] for b in cur["buckets"]]
    before = [b["count"] for b in prev["buckets"]] if prev else [0] * len(counts)
    assert len(counts) == len(before) == len(LATENESS_BOUNDS_MS) + 1
    delta = [c - b for c, b in zip(counts, before)]
    assert all(d >= 0 for d in delta), "the lateness histogram only grows"
    n = sum(delta)
    early = cur["early"] - (prev["early"] if prev else 0)
    if not n:
        return Sample(start_ms, end_ms, 0, None, None, None, early)
    top = max(i for i, d in enumerate(delta) if d)
    grew = prev is None or cur["max_ms"] > prev["max_ms"]
    if grew or top >= len(LATENESS_BOUNDS_MS):  # the open last bucket: the all-time max bounds it
        max_ms = cur["max_ms"]
    else:
        max_ms = min(LATENESS_BOUNDS_MS[top], cur["max_ms"])
    h = LatenessHistogram()
    h.counts, h.count, h.max_ms = delta, n, max_ms
    return Sample(start_ms, end_ms, n, h.quantile_ms(0.50), h.quantile_ms(0.99), max_ms, early)


class LatenessRing:
    """The last ``capacity`` interval samples, oldest first."""

    def __init__(self, capacity: int = RING_SAMPLES_DEFAULT) -> None:
        assert capacity >= 1
        self.samples: deque[Sample] = deque(maxlen=capacity)
        self._prev: dict | None = None
        self._prev_ms: int | None = None

    def observe(self, snapshot: dict, now_ms: int) -> Sample:
        """Close the interval ending ``now_ms`` with the histogram's ``snapshot``; return its sample.

        The first interval starts at the first call's ``now_ms`` minus nothing: it holds what
        the histogram gathered before the console started (since the broker started).
        """
        start = self._prev_ms if self._prev_ms is not None else now_ms
        sample = interval(self._prev, snapshot, start, max(now_ms, start))
        self.samples.append(sample)
        self._prev, self._prev_ms = snapshot, max(now_ms, start)
        return sample

    def current(self, snapshot: dict, now_ms: int) -> Sample:
        """The interval still open (since the last ``observe``), not stored."""
        start = self._prev_ms if self._prev_ms is not None else now_ms
        return interval(self._prev, snapshot, start, max(now_ms, start))
