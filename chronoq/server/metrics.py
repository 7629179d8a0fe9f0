"""Prometheus metrics of one broker: the registry and every metric definition (docs/metrics.md).

No prometheus_client object is touched on a hot path. The broker keeps what is measured in plain
ints, counted per batch where there is one (``Broker.sent_by_topic``: one dict update per send
batch; ``PopService.counters``: one per receive or ack call; the timer's lanes and lateness
histogram, ``CommitLog.sync_times``, the recovery report), and ``BrokerCollector`` reads them
when ``/metrics`` is scraped and turns them into metric families. Each broker gets its own
``CollectorRegistry`` (not prometheus_client's global one), so several brokers in one process
(tests) never collide.

A scrape runs on the event loop, between requests: it walks topics and queues (bounds only), the
in-flight checkpoints, and the timer's pending buckets (``TimerService.pending_by_horizon``:
each bucket counted once, then followed as entries are appended to it). The server renders it
in slices (``BrokerMetrics.render``): the collector pauses every PAUSE_SERIES series
(``collect_steps`` yields None there) and the text is formatted RENDER_CHUNK samples at a time,
the loop free between slices of RENDER_SLICE_S: at 2,000 topics and 200 groups (10,000 series) a
scrape held the loop 60-90 ms at once (bench/stalls.py --topics 2000 --groups 200).
"""

from __future__ import annotations

import asyncio
import time
from typing import Callable, Iterator

from prometheus_client import CollectorRegistry, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from chronoq.pop import names as pop_names
from chronoq.server.service_metrics import ServiceCollector
from chronoq.store.commitlog import FSYNC_BOUNDS_NS
from chronoq.timer.stats import LATENESS_BOUNDS_MS

# "Due within" horizons of chronoq_timer_pending_messages: label value -> seconds (None: all).
PENDING_HORIZONS: tuple[tuple[str, int | None], ...] = (
    ("1m", 60), ("10m", 600), ("1h", 3600), ("1d", 86_400), ("inf", None))
_HORIZONS_MS = tuple(1 << 62 if s is None else s * 1000 for _, s in PENDING_HORIZONS)  # 1 << 62: "all"
INF = float("inf")
# Rendering in slices (``BrokerMetrics.render``): the collector pauses every PAUSE_SERIES series of a
# family, the text is formatted RENDER_CHUNK samples at a time, and once a slice ran RENDER_SLICE_S
# the loop is let go for RENDER_PAUSE_S. A call takes several loop passes (read, commit, answer):
# with no pause (sleep(0)) each of them met a slice, and the sends' p99 during scrapes was 8 ms.
PAUSE_SERIES = 256
RENDER_CHUNK = 256
RENDER_SLICE_S = 0.002
RENDER_PAUSE_S = 0.003
_OM_SUFFIXES = ("_created", "_gsum", "_gcount")  # (generate_latest puts these after a family's samples)


class BrokerMetrics:
    """The registry of one broker. ``pop`` returns the running ``PopService`` or None; ``source``
    (the runtime, or None) gives the service figures (``chronoq.server.service_metrics``)."""

    def __init__(self, broker, pop: Callable[[], object] = lambda: None, source=None) -> None:
        self.collector = BrokerCollector(broker, pop)
        self.registry = CollectorRegistry(auto_describe=False)
        service = ServiceCollector(broker, source)
        self.registry.register(self.collector)
        self.registry.register(service)
        process = ProcessCollector(registry=self.registry)  # process_*: this process's CPU, memory, files
        self._collectors = (self.collector, service, process)  # (the registry's order)

    async def render(self, slice_s: float = RENDER_SLICE_S, pause_s: float = RENDER_PAUSE_S,
                     now: Callable[[], float] = time.perf_counter) -> bytes:
        """``generate_latest(self.registry)``, the same text, built on the loop in slices of about
        ``slice_s`` with the loop let go ``pause_s`` between. Families are read at slightly
        different instants (as a scrape of several processes is)."""
        parts: list[bytes] = []
        began = now()
        for collector in self._collectors:
            steps = collector.collect_steps() if isinstance(collector, BrokerCollector) else collector.collect()
            for family in steps:
                if family is not None:
                    for text in _formatted(family):
                        parts.append(text)
                        if now() - began >= slice_s:
                            await asyncio.sleep(pause_s)
                            began = now()
                elif now() - began >= slice_s:  # a collector's pause point
                    await asyncio.sleep(pause_s)
                    began = now()
        return b"".join(parts)

    def snapshot(self) -> dict:
        """The overview ``chronoq stats`` shows (plain numbers)."""
        return self.collector.snapshot()


class BrokerCollector(Collector):
    def __init__(self, broker, pop: Callable[[], object]) -> None:
        self.broker = broker
        self._pop = pop

    # ----------------------------------------------------------------- collect
    def collect(self) -> Iterator[Metric]:
        return (family for family in self.collect_steps() if family is not None)

    def collect_steps(self) -> Iterator[Metric | None]:
        """``collect`` with pause points: None every PAUSE_SERIES series of a big family (the
        caller may let the loop go there, ``BrokerMetrics.render``)."""
        broker = self.broker
        if broker.closed:
            return
        pop = self._pop()
        yield from self._sends_and_storage(broker)
        if pop is not None:
            yield from self._consumption(broker, pop)
        yield from self._timer(broker)
        yield from self._commit_log(broker)
        yield from self._recovery(broker)
        yield self._refusals(broker)

    @staticmethod
    def _refusals(broker) -> Metric:
        refused = CounterMetricFamily("chronoq_requests_refused", "Requests and connections turned away, "
                                      "by reason (docs/security.md lists them).", labels=["reason"])
        for reason, count in broker.refusals.counts.items():
            refused.add_metric([reason], count)
        return refused

    def _sends_and_storage(self, broker) -> Iterator[Metric]:
        sent = CounterMetricFamily("chronoq_messages_sent", "Messages accepted from producers (duplicates "
                                   "answered from the dedupe window not counted).", labels=["topic"])
        topics = broker.list_topics()
        counts = broker.sent_by_topic
        # Every user topic has a series from the start (0 until a send), so rate() sees the first.
        for topic in sorted(counts.keys() | {cfg.name for cfg in topics}):
            sent.add_metric([topic], counts.get(topic, 0))
        yield sent
        stored = GaugeMetricFamily("chronoq_topic_messages", "Messages stored in a topic's queues (oldest "
                                   "retained to newest, consumed or not).", labels=["topic"])
        for i, cfg in enumerate(topics, 1):
            stored.add_metric([cfg.name], self._stored(broker, cfg.name))
            if i % PAUSE_SERIES == 0:
                yield None
        yield stored
        yield GaugeMetricFamily("chronoq_topics", "User topics.", value=len(topics))

    def _consumption(self, broker, pop) -> Iterator[Metric]:
        counters = pop.counters
        by_pair = (("received", "Messages handed to consumers by receives (each delivery attempt)."),
                   ("acked", "Messages acknowledged."),
                   ("nacked", "Negative acknowledgements: changes of invisible time."))
        for name, doc in by_pair:
            family = CounterMetricFamily(f"chronoq_messages_{name}", doc, labels=["topic", "group"])
            for (group, topic), n in sorted(getattr(counters, name).items()):
                family.add_metric([topic, group], n)
            yield family
        by_group = (("revived", "Deliveries whose invisible time ended unacked (then retried, "
                                "dead-lettered or, FIFO, handed out again)."),
                    ("retried", "Copies written to the group's retry topic."),
                    ("dead_lettered", "Copies written to the group's dead-letter topic %DLQ%{group}."))
        for name, doc in by_group:
            family = CounterMetricFamily(f"chronoq_messages_{name}", doc, labels=["group"])
            for group, n in sorted(getattr(counters, name).items()):
                family.add_metric([group], n)
            yield family
        inflight = GaugeMetricFamily("chronoq_inflight_messages", "Deliveries handed out, not yet acked "
                                     "and still invisible.", labels=["topic", "group"])
        by_topic = pop.inflight_by_topic()
        for (group, topic), n in sorted(by_topic.items()):
            inflight.add_metric([topic, group], n)
        yield inflight
        lag = GaugeMetricFamily("chronoq_consumer_lag_messages", "Messages of a topic (and the group's retry "
                                "copies) the group has not received yet.", labels=["topic", "group"])
        done = 0
        for group, topics in sorted(pop.consumed_topics(by_topic).items()):
            for topic in sorted(topics):
                if topic in broker.topics:  # (one may have been deleted at a pause point)
                    lag.add_metric([topic, group], pop.lag(group, topic))
                done += 1
                if done % PAUSE_SERIES == 0:
                    yield None
        yield lag
        groups = pop.list_groups()
        dlq = GaugeMetricFamily("chronoq_dlq_messages", "Messages stored in the group's dead-letter topic.",
                                labels=["group"])
        for i, g in enumerate(groups, 1):
            dlq.add_metric([g.name], self._stored(broker, pop_names.dlq_topic(g.name)))
            if i % PAUSE_SERIES == 0:
                yield None
        yield dlq
        yield GaugeMetricFamily("chronoq_consumer_groups", "Consumer groups.", value=len(groups))

    def _timer(self, broker) -> Iterator[Metric]:
        timer = broker.timer
        hist = timer.histogram
        yield _histogram("chronoq_timer_lateness_seconds", "Visible time minus due time of delivered "
                         "delayed messages.", [b / 1000 for b in LATENESS_BOUNDS_MS], hist.counts, hist.sum_ms / 1000)
        yield CounterMetricFamily("chronoq_timer_early_deliveries", "Delayed messages made visible before "
                                  "their due time (must stay 0).", value=hist.early)
        if timer.horizon_ready():  # (until the start's count is done, absent: it would read every file at once)
            pending = GaugeMetricFamily("chronoq_timer_pending_messages", "Delayed messages not yet delivered "
                                        "that fall due within the horizon from now (cumulative; inf: all).",
                                        labels=["horizon"])
            counts = timer.pending_by_horizon(_HORIZONS_MS)
            for (label, _s), n in zip(PENDING_HORIZONS, counts):
                pending.add_metric([label], n)
            yield pending
        lanes = [timer.timer_lane, *timer.level_lanes]
        for name, attr, doc in (
                ("chronoq_timer_delivered", "delivered", "Delayed messages made visible, per delivery lane."),
                ("chronoq_timer_flow_control_pauses", "times_full", "Times a lane's pending queue filled up so "
                 "scanning for due messages paused."),
                ("chronoq_timer_lane_blocks", "times_blocked", "Times a lane blocked after repeated write "
                 "failures.")):
            family = CounterMetricFamily(name, doc, labels=["lane"])
            for lane in lanes:
                family.add_metric([lane.name], getattr(lane, attr))
            yield family

    def _commit_log(self, broker) -> Iterator[Metric]:
        size, segments, times = broker.log_figures()
        yield GaugeMetricFamily("chronoq_commitlog_bytes", "Bytes in the commit log (oldest retained "
                                "segment to the end).", value=size)
        yield GaugeMetricFamily("chronoq_commitlog_segments", "Commit-log segment files.", value=segments)
        yield _histogram("chronoq_commitlog_fsync_seconds", "Latency of commit-log fsyncs.",
                         [b / 1e9 for b in FSYNC_BOUNDS_NS], list(times.counts), times.sum_ns / 1e9)

    def _recovery(self, broker) -> Iterator[Metric]:
        report = broker.recovery
        figures = (
            ("chronoq_recovery_duration_seconds", "Time to open the broker at start (store and timer recovery).",
             broker.open_duration_ns / 1e9),
            ("chronoq_recovery_clean", "1 if the last stop was clean, 0 after a crash.", int(report.clean)),
            ("chronoq_recovery_records_replayed", "Commit-log records replayed into the consume queues at "
             "start.", report.records_replayed),
            ("chronoq_recovery_timer_records_replayed", "Delayed records the timer caught up on at start.",
             broker.timer.caught_up),
            ("chronoq_recovery_truncated_bytes", "Bytes of torn tail truncated at start.",
             sum(r.end - r.start for r in report.truncated)),
            ("chronoq_recovery_quarantined_bytes", "Bytes of damaged log quarantined at start.",
             sum(r.end - r.start for r in report.quarantined)),
        )
        for name, doc, value in figures:
            yield GaugeMetricFamily(name, doc, value=value)

    # ----------------------------------------------------------------- helpers
    @staticmethod
    def _stored(broker, topic: str) -> int:
        cfg = broker.topics.get(topic)
        if cfg is None:
            return 0
        total = 0
        for qid in range(cfg.queues):
            lo, hi = broker.queue_bounds(topic, qid)
            total += hi - lo
        return total

    # ----------------------------------------------------------------- overview
    def snapshot(self) -> dict:
        """Figures for ``chronoq stats``, read the same way as a scrape."""
        values: dict[str, float] = {}
        labelled: dict[str, dict[tuple, float]] = {}
        for family in self.collect():
            for sample in family.samples:
                if sample.labels:
                    labelled.setdefault(sample.name, {})[tuple(sorted(sample.labels.items()))] = sample.value
                else:
                    values[sample.name] = sample.value
        hist = self.broker.timer.histogram
        lateness = {"count": hist.count, "p50_ms": hist.quantile_ms(0.50), "p99_ms": hist.quantile_ms(0.99)}

        def total(name: str) -> int:
            return int(sum(labelled.get(name, {}).values()))

        pending = {dict(k)["horizon"]: int(v) for k, v in labelled.get("chronoq_timer_pending_messages", {}).items()}
        return {
            "messages_sent": total("chronoq_messages_sent_total"),
            "messages_received": total("chronoq_messages_received_total"),
            "messages_acked": total("chronoq_messages_acked_total"),
            "messages_dead_lettered": total("chronoq_messages_dead_lettered_total"),
            "topics": int(values.get("chronoq_topics", 0)),
            "groups": int(values.get("chronoq_consumer_groups", 0)),
            "messages_stored": total("chronoq_topic_messages"),
            "in_flight": total("chronoq_inflight_messages"),
            "dlq": total("chronoq_dlq_messages"),
            "pending_timers": pending.get("inf", 0),
            "pending_by_horizon": {label: pending.get(label, 0) for label, _s in PENDING_HORIZONS},
            "commitlog_bytes": int(values.get("chronoq_commitlog_bytes", 0)),
            "commitlog_segments": int(values.get("chronoq_commitlog_segments", 0)),
            "lateness_count": lateness["count"],
            "lateness_p50_ms": lateness["p50_ms"],
            "lateness_p99_ms": lateness["p99_ms"],
        }


class _Only:
    """One family as a registry, for ``generate_latest``."""

    def __init__(self, family: Metric) -> None:
        self.family = family

    def collect(self) -> list[Metric]:
        return [self.family]


def _formatted(family: Metric) -> Iterator[bytes]:
    """``generate_latest``'s text of ``family``, RENDER_CHUNK samples at a time (its HELP and
    TYPE lines once); a family with OpenMetrics-only samples (``_created``...) whole."""
    samples = family.samples
    if len(samples) <= RENDER_CHUNK or any(s.name.endswith(_OM_SUFFIXES) for s in samples):
        yield generate_latest(_Only(family))
        return
    for first in range(0, len(samples), RENDER_CHUNK):
        part = Metric(family.name, family.documentation, family.type, family.unit)
        part.samples = samples[first:first + RENDER_CHUNK]
        text = generate_latest(_Only(part))
        if first:  # the HELP and TYPE lines once, at the family's head
            text = text.split(b"\n", 2)[2]
        yield text


def _histogram(name: str, doc: str, bounds: list[float], counts: list[int], total: float) -> HistogramMetricFamily:
    """A histogram family from per-bucket counts (the last is the +Inf overflow bucket)."""
    assert len(counts) == len(bounds) + 1
    buckets, seen = [], 0
    for bound, n in zip([*bounds, INF], counts):
        seen += n
        buckets.append(("+Inf" if bound == INF else _le(bound), seen))
    return HistogramMetricFamily(name, doc, buckets=buckets, sum_value=total)


def _le(bound: float) -> str:
    return repr(float(bound))
