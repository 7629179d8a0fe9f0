"""The traffic history ring (chronoq.server.history): bounded, ordered, rates per second."""

from __future__ import annotations

import pytest

from chronoq.server.history import HistoryRing, Sample


def _s(ts_ms: int, sent: int, received: int = 0, acked: int = 0, lag: int = 0) -> Sample:
    return Sample(ts_ms, sent, received, acked, lag, 0, 0)


def test_the_ring_keeps_only_the_newest_samples():
    ring = HistoryRing(capacity=3, interval_s=1)
    for i in range(10):
        ring.add(_s(1_000 * i, 5 * i))
    assert [s.ts_ms for s in ring.samples] == [7_000, 8_000, 9_000]
    assert len(ring.samples) == ring.capacity == 3


def test_rates_are_per_second_between_consecutive_samples():
    ring = HistoryRing(capacity=10, interval_s=5)
    ring.add(_s(10_000, 100, 50, 40))
    ring.add(_s(15_000, 600, 50, 45))   # 5 s: 500 sent, none delivered, 5 acked
    ring.add(_s(17_000, 600, 250, 245))  # a sample late or early: rates use the real interval
    rates = ring.rates()
    assert [(r.start_ms, r.end_ms) for r in rates] == [(10_000, 15_000), (15_000, 17_000)]
    assert [(r.sent, r.received, r.acked) for r in rates] == [(100.0, 0.0, 1.0), (0.0, 100.0, 100.0)]
    assert HistoryRing(capacity=2, interval_s=1).rates() == []


def test_time_goes_forward_and_counters_never_shrink():
    ring = HistoryRing(capacity=4, interval_s=1)
    ring.add(_s(1_000, 10, 5, 5))
    with pytest.raises(AssertionError):
        ring.add(_s(1_000, 11))
    with pytest.raises(AssertionError):
        ring.add(_s(2_000, 9, 5, 5))
    ring.add(_s(2_000, 10, 5, 5, lag=0))  # levels (lag) may go down, counters stay
    assert len(ring.samples) == 2
