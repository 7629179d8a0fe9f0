"""A short memory of the broker's traffic: a bounded ring of counter samples, for the console's
"rates over time" and "queue depth over time" charts (docs/console.md, "Traffic history").

Every ``history_interval_s`` (5 s) the runtime's sampler task reads counters the broker already
keeps (nothing is counted twice on a hot path) into one ``Sample``:

- ``sent``: messages accepted from producers (``Broker.sent_by_topic``, every topic, the one
  ``chronoq_messages_sent_total`` counts), cumulative;
- ``received``, ``acked``: deliveries handed to consumers and acknowledgements
  (``PopService.counters``), cumulative;
- ``lag``, ``inflight``: messages the consumer groups have not received yet, and received but not
  acked (the figures of ``chronoq group list``); ``timers``: delayed messages not yet due;
- ``repl_bytes``, ``repl_s``: on a primary with replicas, the worst replica's lag (bytes of the
  durable log it lacked at its last pull, seconds it has lacked something: ``PrimaryNode.lag_figures``,
  what ``chronoq_replication_lag_*`` export); None without a replica.

``HistoryRing`` keeps the newest ``history_samples`` (720: an hour of 5 s samples; ~100 bytes
each, so well under 1 MB) and turns consecutive samples into per-second rates. It lives in memory
only: a restart starts it again. The ring is pure (the caller passes each sample's time, from the
broker's clock); ``run_sampler`` is the shell.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable

from chronoq.core import errors

log = logging.getLogger("chronoq.history")

_PENDING_ALL = (1 << 62,)  # a horizon past every due time: all pending delayed messages
SLICE_S = 0.002  # a sample holds the loop about this long at a time (chronoq.server.metrics too) ...
PAUSE_S = 0.003  # ... and lets it go this long between


@dataclass(frozen=True, slots=True)
class Sample:
    ts_ms: int       # broker wall-clock time of the sample
    sent: int        # cumulative counters ...
    received: int
    acked: int
    lag: int         # ... and levels at ts_ms
    inflight: int
    timers: int
    repl_bytes: int | None = None    # worst replica's lag (None: no replica)
    repl_s: float | None = None


@dataclass(frozen=True, slots=True)
class Rate:
    """Per-second rates over the interval (start_ms, end_ms]."""
    start_ms: int
    end_ms: int
    sent: float
    received: float
    acked: float


class HistoryRing:
    """The newest ``capacity`` samples, oldest first."""

    def __init__(self, capacity: int, interval_s: float) -> None:
        assert capacity >= 2 and interval_s > 0
        self.capacity = capacity
        self.interval_s = interval_s
        self.samples: deque[Sample] = deque(maxlen=capacity)

    def add(self, sample: Sample) -> None:
        """Append ``sample``. Ensures: times increase and the cumulative counters never shrink
        (a sample that breaks either is refused: the counters live as long as the process)."""
        last = self.samples[-1] if self.samples else None
        if last is not None:
            assert sample.ts_ms > last.ts_ms, "samples must be taken at increasing times"
            assert (sample.sent >= last.sent and sample.received >= last.received
                    and sample.acked >= last.acked), "cumulative counters never shrink"
        self.samples.append(sample)
        assert len(self.samples) <= self.capacity

    def rates(self) -> list[Rate]:
        """Per-second rates between each pair of consecutive samples (one fewer than samples)."""
        out = []
        pairs = zip(self.samples, list(self.samples)[1:])
        for a, b in pairs:
            seconds = (b.ts_ms - a.ts_ms) / 1000
            out.append(Rate(a.ts_ms, b.ts_ms, (b.sent - a.sent) / seconds, (b.received - a.received) / seconds,
                            (b.acked - a.acked) / seconds))
        return out


async def take_sample(broker, pop, now_ms: int, replication=None, slice_s: float = SLICE_S,
                      pause_s: float = PAUSE_S, clock: Callable[[], float] = time.perf_counter) -> Sample | None:
    """The broker's counters now. Reads what ``/metrics`` reads (lag per consumed topic, pending
    timers through the timer's per-bucket cache, the replicas' lag), so a sample costs about a
    scrape. ``replication``: the runtime's ``PrimaryNode`` (None: not serving as a primary yet).

    The lag is summed over every (group, topic) consumed: with 10,000 of each that held the loop
    ~260 ms a sample, so it is summed in slices of ``slice_s`` with the loop let go ``pause_s``
    between (as a scrape is). A topic deleted meanwhile counts no more; None if the broker
    closed meanwhile, or the timer has not yet counted its pending messages once since the start
    (``TimerService.horizon_ready``: reading every schedule file at once held the loop seconds
    after a restart with millions pending): no sample."""
    if not broker.timer.horizon_ready():
        return None
    sent = sum(broker.sent_by_topic.values()) + broker.sent_gone
    c = pop.counters
    received, acked = c.total_received(), c.total_acked()
    inflight = sum(pop.inflight_by_topic().values())
    timers = broker.timer.pending_by_horizon(_PENDING_ALL)[0]
    lags = list(replication.lag_figures().values()) if replication is not None else []
    lag, began = 0, clock()
    for group, topics in list(pop.consumed_topics().items()):
        for topic in topics:
            if clock() - began >= slice_s:
                await asyncio.sleep(pause_s)
                if broker.closed or pop.closed:
                    return None
                began = clock()
            try:
                lag += pop.lag(group, topic)
            except errors.TopicNotFound:  # deleted while the loop was let go
                pass
    return Sample(now_ms, sent, received, acked, lag, inflight, timers,
                  max((b for b, _s in lags), default=None), max((s for _b, s in lags), default=None))


async def run_sampler(runtime, ring: HistoryRing, stop: asyncio.Event) -> None:
    """Add one sample to ``ring`` every ``ring.interval_s`` until ``stop`` is set (the runtime's
    task). Skips while the broker or the consumer state is not open (start, stop)."""
    while not stop.is_set():
        broker, pop = runtime.broker, runtime.pop
        if broker is not None and not broker.closed and pop is not None:
            try:
                now = broker.clock.wall_ms()
                if not ring.samples or now > ring.samples[-1].ts_ms:
                    sample = await take_sample(broker, pop, now, runtime.replication)
                    if sample is not None:
                        ring.add(sample)
            except Exception:  # noqa: BLE001 - a bad sample must not end the sampler
                log.exception("traffic history sample failed")
        try:
            await asyncio.wait_for(stop.wait(), ring.interval_s)
        except asyncio.TimeoutError:
            pass
