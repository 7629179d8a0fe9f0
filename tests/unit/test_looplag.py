"""The event-loop lag probe (chronoq.server.looplag): the pure histogram, the probe's arithmetic
with an injected clock, and a real stall of a real loop seen as a lag."""

from __future__ import annotations

import asyncio
import time

from chronoq.server.looplag import LAG_BOUNDS_S, LoopLag, run_probe


def test_lags_fill_their_buckets_sum_and_max():
    lag = LoopLag()
    for seconds in (0.0004, 0.001, 0.003, 0.3, 7.0, -0.0001):
        lag.observe(seconds)
    assert lag.observations == 6
    by_bound = dict(lag.buckets())
    assert by_bound["0.001"] == 3  # 0.0004, exactly 0.001, and an early wake-up counted as 0
    assert by_bound["0.005"] == 4 and by_bound["0.25"] == 4 and by_bound["0.5"] == 5
    assert by_bound[repr(float(LAG_BOUNDS_S[-1]))] == 5 and by_bound["+Inf"] == 6
    assert lag.max_s == 7.0 and abs(lag.sum_s - 7.3044) < 1e-9


def test_the_probe_measures_each_wake_up_against_the_time_it_asked_for():
    readings = iter([10.0, 10.35, 10.35, 10.37, 10.37, 10.40])  # asked 10.1 -> came 10.35, asked 10.45 -> ...

    async def main():
        lag, stop = LoopLag(), asyncio.Event()

        def now() -> float:
            value = next(readings)
            if value == 10.40:
                stop.set()
            return value

        await run_probe(lag, stop, now=now, interval_s=0.1)
        return lag

    lag = asyncio.run(main())
    # lags: 10.35 - 10.1 = 0.25; 10.37 - 10.45 < 0 -> 0; 10.40 - 10.47 < 0 -> 0
    assert lag.observations == 3 and abs(lag.max_s - 0.25) < 1e-9 and dict(lag.buckets())["0.25"] == 3


def test_a_stalled_loop_shows_as_a_lag():
    async def main():
        lag, stop = LoopLag(), asyncio.Event()
        probe = asyncio.ensure_future(run_probe(lag, stop, interval_s=0.05))
        await asyncio.sleep(0.01)  # the probe sleeps now
        time.sleep(0.3)  # a step that holds the loop
        await asyncio.sleep(0.1)
        stop.set()
        await probe
        return lag

    lag = asyncio.run(main())
    assert lag.max_s >= 0.3 - 0.05  # the wake-up asked for during the stall came after it
