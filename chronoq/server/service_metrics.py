"""The service's own metrics beside the broker's (docs/metrics.md, "Service"): build, process, gRPC
transport, event-loop lag (``chronoq.server.looplag``), disk, recalls, transactions.

``BrokerMetrics`` (``chronoq.server.metrics``) registers a ``ServiceCollector`` and prometheus_client's
process collector (``process_*``: CPU seconds, resident memory, open file descriptors, start time)
on the broker's own registry. Like the broker's collector this one reads, at scrape time only,
what is counted elsewhere in plain ints: ``chronoq.server.callstats.CallStats`` (calls, latency,
bytes, kept by chronoq's HTTP/2 server), ``Broker.recall_outcomes``, the refusal counts, and state
that exists anyway (open connections and streams, parked long polls, pending transaction halves).
Free space is one ``statvfs`` per scrape. Sends refused for space are
``chronoq_requests_refused_total{reason="disk_reserve"}`` (the broker's collector).

``source`` gives what the runtime has (``chronoq.server.runtime.Runtime``: ``front_ends``, ``txns``);
an embedded broker without one shows the broker-level families only.
"""

from __future__ import annotations

import logging
import os
from typing import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

import chronoq
from chronoq.protocol.rocketmq.status import Code
from chronoq.server.callstats import CALL_BOUNDS_S, UNKNOWN_METHOD

log = logging.getLogger("chronoq.metrics")

# gRPC status codes by number (the label value is the name, as grpcio and grpc-go's metrics show it).
GRPC_CODES = ("OK", "CANCELLED", "UNKNOWN", "INVALID_ARGUMENT", "DEADLINE_EXCEEDED", "NOT_FOUND", "ALREADY_EXISTS",
              "PERMISSION_DENIED", "RESOURCE_EXHAUSTED", "FAILED_PRECONDITION", "ABORTED", "OUT_OF_RANGE",
              "UNIMPLEMENTED", "INTERNAL", "UNAVAILABLE", "DATA_LOSS", "UNAUTHENTICATED")


def grpc_code_name(code: int) -> str:
    return GRPC_CODES[code] if 0 <= code < len(GRPC_CODES) else str(code)


def _calls_by_code(name: str, text: str, label: str, counts: dict[tuple[str, int], int], namer) -> Metric:
    """A counter of calls by service, method and a status code (``namer`` gives the code's name)."""
    family = CounterMetricFamily(name, text, labels=["service", "method", label])
    for (path, code), n in sorted(counts.items()):
        family.add_metric([*split_method(path), namer(code)], n)
    return family


_ROCKETMQ_CODES = frozenset(Code.values())


def rocketmq_code_name(code: int) -> str:
    """The ``Code`` enum's name (``OK``, ``BAD_REQUEST``, ...); ``OTHER`` for a value outside it,
    so the label keeps the enum's bounded set of values."""
    return Code.Name(code) if code in _ROCKETMQ_CODES else "OTHER"


def split_method(path: str) -> tuple[str, str]:
    """``/pkg.Service/Method`` -> (``pkg.Service``, ``Method``); a call with no handler -> ("unknown", "unknown")."""
    if path == UNKNOWN_METHOD:
        return "unknown", "unknown"
    service, _, method = path.lstrip("/").rpartition("/")
    return service, method


class ServiceCollector(Collector):
    def __init__(self, broker, source=None) -> None:
        self.broker = broker
        self.source = source

    def collect(self) -> Iterator[Metric]:
        build = GaugeMetricFamily("chronoq_build_info", "The running chronoq: its version and whether its hot "
                                  "path runs compiled or as pure Python (value 1).", labels=["version", "build"])
        build.add_metric([chronoq.__version__, chronoq.build()], 1)
        yield build
        broker = self.broker
        if broker.closed:
            return
        yield from self._disk(broker)
        yield from self._recalls(broker)
        source = self.source
        if source is None:
            return
        yield from self._transport(source)
        lag = getattr(source, "loop_lag", None)  # chronoq.server.looplag.LoopLag (chronoq serve)
        if lag is not None:
            yield from self._loop_lag(lag)
        replication = getattr(source, "replication", None)  # chronoq.replication.shipper.PrimaryNode
        if replication is not None:
            yield from self._replication(replication)
            committer = source.committer
            if committer.replica_wait is not None:  # replication = sync
                yield CounterMetricFamily("chronoq_replication_sync_fallbacks", "Acknowledgements made under "
                                          "replication = sync without a replica's report "
                                          "(replication_sync_fallback = async).", value=committer.sync_fallbacks)
                yield GaugeMetricFamily("chronoq_replication_sync_degraded", "1 while sync acknowledgements "
                                        "fall back to async (the last one had no replica's report), else 0.",
                                        value=int(committer.sync_degraded))
        duty = getattr(source, "duty", None)  # chronoq.server.failover.PrimaryDuty (etcd)
        if duty is not None:
            yield from self._leadership(duty)
        txns = source.txns
        if txns is not None:
            yield GaugeMetricFamily("chronoq_transaction_halves_pending", "Transactional half messages "
                                    "neither committed nor rolled back yet.", value=len(txns.pending))

    @staticmethod
    def _loop_lag(lag) -> Iterator[Metric]:
        family = HistogramMetricFamily("chronoq_event_loop_lag_seconds", "How much later than asked the event "
                                       "loop ran a probe's wake-up (every 0.1 s): tens of ms and up is a stall "
                                       "that delayed every call and due timer meanwhile.")
        family.add_metric([], lag.buckets(), lag.sum_s)
        yield family
        yield GaugeMetricFamily("chronoq_event_loop_lag_max_seconds", "The largest event-loop lag seen since "
                                "the start.", value=lag.max_s)

    @staticmethod
    def _disk(broker) -> Iterator[Metric]:
        disk = broker.disk
        try:
            st = os.statvfs(broker.data_dir)
        except OSError as exc:  # the scrape goes on without the figure
            log.warning("cannot read free space of %s: %s", broker.data_dir, exc)
        else:
            yield GaugeMetricFamily("chronoq_disk_free_bytes", "Free space where the data directory lives "
                                    "(what an unprivileged writer may use).", value=st.f_bavail * st.f_frsize)
        yield GaugeMetricFamily("chronoq_disk_reserve_bytes", "New sends are refused while free space is "
                                "below this (disk_reserve_bytes; 0: no reserve).", value=disk.reserve_bytes)
        yield GaugeMetricFamily("chronoq_disk_reserve_low", "1 while free space is below the reserve and new "
                                "sends are refused (as of the last look), else 0.", value=int(disk.low))

    @staticmethod
    def _replication(node) -> Iterator[Metric]:
        yield GaugeMetricFamily("chronoq_replication_epoch", "This primary's epoch (0 until a promotion).",
                                value=node.epoch)
        lag_bytes = GaugeMetricFamily("chronoq_replication_lag_bytes", "Bytes of the durable commit log a "
                                      "replica lacked at its last pull (what async replication can lose).",
                                      labels=["replica"])
        lag_seconds = GaugeMetricFamily("chronoq_replication_lag_seconds", "Seconds since a replica last held "
                                        "the whole durable commit log (0 while it does).", labels=["replica"])
        for replica, (behind, seconds) in sorted(node.lag_figures().items()):
            lag_bytes.add_metric([replica], behind)
            lag_seconds.add_metric([replica], seconds)
        yield lag_bytes
        yield lag_seconds

    @staticmethod
    def _leadership(duty) -> Iterator[Metric]:
        lease = duty.leadership.deadline  # (this term's: a step-down gives the coordinator a new one)
        yield GaugeMetricFamily("chronoq_cluster_leader", "1 while this primary surely holds its etcd lease and "
                                "acknowledges writes; 0 once fenced (it acknowledges nothing more).",
                                value=int(lease.holds()))
        yield GaugeMetricFamily("chronoq_cluster_epoch", "The epoch this primary won in etcd.", value=duty.epoch)
        yield GaugeMetricFamily("chronoq_cluster_lease_remaining_seconds", "Seconds of leadership left before "
                                "this primary refuses writes unless a keep-alive is answered.",
                                value=lease.remaining_ms() / 1000)
        yield GaugeMetricFamily("chronoq_cluster_in_sync_replicas", "Replicas in the in-sync set as published "
                                "in etcd (not counting this primary).", value=len(duty.tracker.published))

    @staticmethod
    def _recalls(broker) -> Iterator[Metric]:
        counts = broker.recall_outcomes
        for kind, doc in (("recall", "Recall requests for delayed messages, by outcome."),
                          ("reschedule", "Reschedule requests for delayed messages, by outcome.")):
            family = CounterMetricFamily(f"chronoq_timer_{kind}s", doc, labels=["outcome"])
            for (k, outcome), n in sorted(counts.items()):
                if k == kind:
                    family.add_metric([outcome], n)
            yield family

    @staticmethod
    def _transport(source) -> Iterator[Metric]:
        figures = None
        for front_end in source.front_ends:
            get = getattr(front_end, "transport_figures", None)
            if get is not None:
                figures = get()
        if figures is None:
            return
        stats, connections, streams, parked = figures
        if parked is not None:
            yield GaugeMetricFamily("chronoq_parked_polls", "Receives parked as long polls, waiting for a "
                                    "message (max_parked_polls).", value=parked)
        if stats is None:  # grpcio's server (grpc_server = "grpcio") keeps no transport figures here
            return
        yield GaugeMetricFamily("chronoq_grpc_connections", "Open client connections on the gRPC port.",
                                value=connections)
        yield GaugeMetricFamily("chronoq_grpc_streams", "Open HTTP/2 streams (calls under way).", value=streams)
        yield CounterMetricFamily("chronoq_grpc_received_bytes", "Bytes read from gRPC clients.", value=stats.bytes_in)
        yield CounterMetricFamily("chronoq_grpc_sent_bytes", "Bytes written to gRPC clients.", value=stats.bytes_out)
        yield _calls_by_code("chronoq_grpc_calls", "gRPC calls ended, by method and gRPC status (RocketMQ answers "
                             "most errors inside an OK call's response).", "code", stats.calls, grpc_code_name)
        yield _calls_by_code("chronoq_grpc_answers", "Calls of MessagingService, Admin and Replication ended, by "
                             "method and the RocketMQ status code of their (last) answer.", "rocketmq_code",
                             stats.answers, rocketmq_code_name)
        latency = HistogramMetricFamily("chronoq_grpc_call_seconds", "Time from a call's request headers to its "
                                        "status (long polls included).", labels=["service", "method"])
        for path, counts in sorted(stats.latency.items()):
            buckets, seen = [], 0
            for bound, n in zip((*CALL_BOUNDS_S, None), counts):
                seen += n
                buckets.append(("+Inf" if bound is None else repr(float(bound)), seen))
            latency.add_metric(list(split_method(path)), buckets, stats.latency_sum_s[path])
        yield latency
