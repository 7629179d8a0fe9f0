"""What the gRPC transport counts for ``/metrics``: calls by method and status, their latency, bytes.

chronoq's HTTP/2 server (``h2server``, ``h2streams``, ``h2calls``) keeps one ``CallStats`` per
server and adds to it in plain ints: the bytes of each read and each write (one add per socket
operation, not per frame), and per call, when its trailers are decided, one dict update for
(method, status) and one histogram bucket (a ``bisect`` over ``CALL_BOUNDS_S``). Nothing else
runs per call; ``chronoq.server.service_metrics`` turns these into metric families when
``/metrics`` is scraped. Open connections and streams are not counted at all: the scrape looks at
the server's connection set.

The method is the handler's full path (``/apache.rocketmq.v2.MessagingService/SendMessage``),
set only once a handler was found for it (``h2calls``), so the label values are the broker's own
methods, never what a client typed; a call with no handler counts under ``UNKNOWN_METHOD``.
"""

from __future__ import annotations

from bisect import bisect_left

# Upper bounds of the call-latency buckets, seconds (the last bucket is +Inf). Unary calls take
# tens of µs to a few ms; long polls park up to 60 s (receive.LONG_POLL_MAX_S).
CALL_BOUNDS_S = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
                 2.5, 5.0, 10.0, 30.0, 60.0)
UNKNOWN_METHOD = ""


class CallStats:
    """Counters of one gRPC server; every field is a plain int or a dict of ints."""

    __slots__ = ("bytes_in", "bytes_out", "calls", "latency", "latency_sum_s")

    def __init__(self) -> None:
        self.bytes_in = 0   # bytes read from clients (TLS: decrypted), all connections, since start
        self.bytes_out = 0  # bytes written to clients
        self.calls: dict[tuple[str, int], int] = {}       # (method path, grpc status) -> calls ended
        self.latency: dict[str, list[int]] = {}           # method -> calls per bucket (+Inf last)
        self.latency_sum_s: dict[str, float] = {}

    def call_ended(self, method: str, code: int, seconds: float) -> None:
        """One call ended with gRPC status ``code`` after ``seconds`` (from its HEADERS)."""
        key = (method, code)
        calls = self.calls
        calls[key] = calls.get(key, 0) + 1
        buckets = self.latency.get(method)
        if buckets is None:
            buckets = self.latency[method] = [0] * (len(CALL_BOUNDS_S) + 1)
            self.latency_sum_s[method] = 0.0
        buckets[bisect_left(CALL_BOUNDS_S, seconds)] += 1  # le: a call of exactly a bound counts in it
        self.latency_sum_s[method] += seconds
