"""How late the event loop runs what falls due on it: a probe for stalls (docs/metrics.md).

Every call, timer delivery, scrape and maintenance step of ``chronoq serve`` runs on one event
loop thread. A step that holds it (a scan that grows with what the broker holds, a long encode,
the GIL kept by another thread) delays everything else, due timers included, and shows nowhere
else: a call's latency counts its own work, the timer's lateness only what was due meanwhile.

``LoopLag`` is pure: told how late each wake-up came, it keeps a histogram of those lags
(``LAG_BOUNDS_S``), their sum and the largest. ``run_probe`` is the shell: it sleeps
``PROBE_INTERVAL_S`` at a time on the loop and reports how much later than asked each wake-up
came, so a stall of S seconds is seen as a lag of at least S - ``PROBE_INTERVAL_S`` within one
interval. Its cost is ten wake-ups a second (a few microseconds each).
"""

from __future__ import annotations

import asyncio
import bisect
from typing import Callable

PROBE_INTERVAL_S = 0.1
# Upper bounds of the lag buckets, seconds (the last bucket is +Inf). An idle loop wakes within
# ~0.1-1 ms of the time asked; a busy one by a few ms; tens of ms and up is a stall.
LAG_BOUNDS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


class LoopLag:
    """Lags seen so far: ``counts[i]`` of them at most ``LAG_BOUNDS_S[i]`` (and above the bound
    before); the last slot, the ones past every bound. Ensures: sum(counts) == observations."""

    __slots__ = ("counts", "sum_s", "max_s")

    def __init__(self) -> None:
        self.counts = [0] * (len(LAG_BOUNDS_S) + 1)
        self.sum_s = 0.0
        self.max_s = 0.0

    def observe(self, lag_s: float) -> None:
        lag_s = max(lag_s, 0.0)  # (a clock's rounding can wake a hair early: no lag)
        self.counts[bisect.bisect_left(LAG_BOUNDS_S, lag_s)] += 1
        self.sum_s += lag_s
        if lag_s > self.max_s:
            self.max_s = lag_s

    @property
    def observations(self) -> int:
        return sum(self.counts)

    def buckets(self) -> list[tuple[str, int]]:
        """Cumulative (upper bound, count) pairs in Prometheus' form, ``+Inf`` last."""
        out, seen = [], 0
        for bound, n in zip((*LAG_BOUNDS_S, None), self.counts):
            seen += n
            out.append(("+Inf" if bound is None else repr(float(bound)), seen))
        return out


async def run_probe(lag: LoopLag, stop: asyncio.Event, now: Callable[[], float] | None = None,
                    interval_s: float = PROBE_INTERVAL_S) -> None:
    """Until ``stop`` is set: sleep ``interval_s``, observe how late the wake-up came. ``now`` is
    the loop's clock (``loop.time``, the one its sleeps are scheduled by) unless given."""
    now = now or asyncio.get_running_loop().time
    while not stop.is_set():
        asked = now() + interval_s
        await asyncio.sleep(interval_s)
        lag.observe(now() - asked)
