"""The timer horizon: pending delayed messages by due time, binned for the console's charts. Pure.

The source is ``TimerService.pending_by_horizon(horizons)``: how many pending delayed messages
(timer and delay-level messages together; overdue ones in every horizon) fall due within each
horizon from now. It counts a schedule bucket (``bucket_ms`` wide, one minute by default) at its
start and reads an unloaded bucket's file only when the file changed since it last counted it,
so the metrics and this page share the cost. The console asks it for the cumulative counts at
the bin edges and takes differences:

* bins start at the current bucket (``first``) and are ``step_ms`` wide: per minute for the next
  hour, per hour for the next week (never narrower than a bucket);
* an edge is placed half a bucket before each bin boundary, so every bucket start (a multiple of
  the width) falls on the right side of it even if the timer's clock reads a few ms later than
  ours; a delay-level message (an exact due time) so counts in the bin of its due time rounded to
  the nearest bucket;
* the first bin also holds what is overdue (due, not yet delivered).

The page's tables link each bin to ``/console/timers/pending`` with the bin's window
(``chronoq.console.pending``); the first bin's link has no start, as it holds the overdue ones.
"""

from __future__ import annotations

MINUTE_MS = 60_000
HOUR_MS = 3_600_000
MINUTE_BINS = 60   # the next hour
HOUR_BINS = 168    # the next week
HORIZON_MS = HOUR_BINS * HOUR_MS


def view_plan(now_ms: int, width_ms: int) -> dict:
    """The two views' bins: ``first`` (start of the current bucket) and per view its step and bin
    count, plus the horizons (ms from ``now_ms``, sorted, distinct) to ask the timer for."""
    assert width_ms > 0
    first = now_ms - now_ms % width_ms
    views = {"minutes": (max(MINUTE_MS, width_ms), MINUTE_BINS), "hours": (max(HOUR_MS, width_ms), HOUR_BINS)}
    edges = sorted({_edge(first, i, step, width_ms, now_ms) for step, count in views.values()
                    for i in range(1, count + 1)})
    return {"now_ms": now_ms, "first_ms": first, "width_ms": width_ms, "views": views, "horizons_ms": edges}


def _edge(first: int, i: int, step: int, width: int, now: int) -> int:
    """Horizon (from now) of the end of bin ``i - 1``: half a bucket before its boundary; 0 when
    that is already past (then no bucket starts between now and it)."""
    return max(0, first + i * step - width // 2 - now)


def bins(plan: dict, cumulative: list[int]) -> dict:
    """Per-bin counts of both views from ``pending_by_horizon(plan["horizons_ms"])``.

    Returns ``start_ms``, ``minutes`` and ``hours`` (each ``{"step_ms", "starts_ms",
    "pending"}``) and ``total_week`` (everything due before the end of the last hour bin,
    overdue included). Ensures every count is >= 0 and each view sums to its last edge's count.
    """
    at = dict(zip(plan["horizons_ms"], cumulative))
    assert len(at) == len(cumulative) == len(plan["horizons_ms"])
    first, width, now = plan["first_ms"], plan["width_ms"], plan["now_ms"]
    out: dict = {"start_ms": first}
    for name, (step, count) in plan["views"].items():
        totals = [at[_edge(first, i, step, width, now)] for i in range(1, count + 1)]
        pending = [totals[0]] + [b - a for a, b in zip(totals, totals[1:])]
        assert all(p >= 0 for p in pending), "cumulative counts must not decrease"
        out[name] = {"step_ms": step, "starts_ms": [first + i * step for i in range(count)], "pending": pending}
    out["total_week"] = sum(out["hours"]["pending"])
    return out
