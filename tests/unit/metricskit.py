"""Helpers for the metrics tests (test_metrics.py, test_metrics_kept_counts.py): a scrape parsed
as Prometheus would, an in-process broker on a fake clock, POP ticks driven through time."""

from __future__ import annotations

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from chronoq.broker.broker import Broker
from chronoq.core.clock import FakeClock
from chronoq.core.config import BrokerConfig
from chronoq.pop.service import PopService
from chronoq.server.metrics import BrokerMetrics

T0 = 1_700_000_000_000
INVISIBLE_MS = 10_000
TICKS_MAX = 200


def scrape(metrics: BrokerMetrics) -> dict:
    """{(sample name, frozenset of labels): value} of one scrape, parsed as Prometheus would."""
    text = generate_latest(metrics.registry).decode()
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(samples: dict, name: str, **labels) -> float:
    return samples[(name, frozenset(labels.items()))]


def open_broker(path, clock: FakeClock, **cfg) -> Broker:
    return Broker(BrokerConfig(data_dir=str(path), segment_bytes=64 * 1024, default_queues=1, **cfg), clock=clock)


def advance_pop(pop: PopService, clock: FakeClock, ms: int) -> None:
    """Move time by ``ms`` and run the POP ticks due on the way (bounded)."""
    end = clock.wall_ms() + ms
    for _ in range(TICKS_MAX):
        pop.tick_durably()
        deadline = pop.next_deadline_ms()
        if deadline is None or deadline > end:
            clock.set(end)
            pop.tick_durably()
            return
        clock.set(max(deadline, clock.wall_ms()))
    raise AssertionError("POP still busy")


def served(path) -> tuple[FakeClock, Broker, PopService, BrokerMetrics]:
    """A broker (at ``path``/data), its POP service and its metrics, on a fake clock at T0."""
    clock = FakeClock(T0)
    broker = open_broker(path / "data", clock)
    pop = PopService(broker, clock)
    return clock, broker, pop, BrokerMetrics(broker, lambda: pop)
