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

RocketMQ answers most refusals inside an OK call: its response's ``Status`` carries the code
(``BAD_REQUEST``, ``TOO_MANY_REQUESTS``, ...); chronoq's Admin and Replication services answer the
same way. So a call of these (``STATUS_ANSWER_PREFIXES``) is also counted by the RocketMQ code of
its last answer (``answers``): ``answer_code`` peeks at the first bytes of an answer (every
response of theirs has ``Status status = 1``, and encoders write field 1 first) and costs about
0.25 µs per answer message (a table of the enum's varint bytes). The label is bounded: the
broker's own answers carry codes of the ``Code`` enum only, and any other value counts as
``OTHER``.
"""

from __future__ import annotations

from bisect import bisect_left

from chronoq.protocol.rocketmq.status import Code

# Upper bounds of the call-latency buckets, seconds (the last bucket is +Inf). Unary calls take
# tens of µs to a few ms; long polls park up to 60 s (receive.LONG_POLL_MAX_S).
CALL_BOUNDS_S = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
                 2.5, 5.0, 10.0, 30.0, 60.0)
UNKNOWN_METHOD = ""
# The services whose every answer begins with a Status (field 1) holding the code (its field 1):
# RocketMQ's MessagingService, and chronoq's own Admin and Replication (``chronoq.v1.Status``,
# the same layout and the same code values; tests/unit/test_callstats.py checks each response).
STATUS_ANSWER_PREFIXES = ("/apache.rocketmq.v2.MessagingService/", "/chronoq.v1.Admin/", "/chronoq.v1.Replication/")
NO_ANSWER = -1       # a call without a RocketMQ answer (another service, or no answer message)
_STATUS_TAG = 0x0A   # field 1, length-delimited: the response's Status
_CODE_TAG = 0x08     # field 1, varint: the Status's code


def _varint(data: bytes, i: int) -> tuple[int, int]:
    """(value, index after it); (-1, len) when it runs past the end or over 10 bytes."""
    value = shift = 0
    end = min(len(data), i + 10)
    while i < end:
        b = data[i]
        value |= (b & 0x7F) << shift
        i += 1
        if b < 0x80:
            return value, i
        shift += 7
    return -1, len(data)


def _three_byte_varint(n: int) -> bytes:
    return bytes((n & 0x7F | 0x80, n >> 7 & 0x7F | 0x80, n >> 14))


# The protocol's ``Code`` values (all but CODE_UNSPECIFIED lie in 16384..2097151: 3-byte varints) by
# their varint bytes: one dict lookup instead of decoding (``answer_code`` runs once per answer
# message). Other values take the decoding path.
_THREE_BYTE_CODES = {_three_byte_varint(n): n for n in Code.values() if (1 << 14) <= n < (1 << 21)}


def answer_code(data: bytes) -> int:
    """The RocketMQ status code of one serialized answer (``STATUS_ANSWER_PREFIXES``), ``NO_ANSWER``
    when it does not start with a Status (a ReceiveMessage stream's message entries). A Status
    without a code field has code 0 (CODE_UNSPECIFIED), as protobuf reads it."""
    if len(data) < 2 or data[0] != _STATUS_TAG:
        return NO_ANSWER
    if type(data) is bytes and data[1] < 0x80 and len(data) >= 6 and data[2] == _CODE_TAG:  # (every Code value is a 3-byte varint)
        code = _THREE_BYTE_CODES.get(data[3:6])
        if code is not None:
            return code
    length, i = _varint(data, 1)
    if length < 0:
        return NO_ANSWER
    if length == 0 or data[i] != _CODE_TAG:
        return 0
    code, _ = _varint(data, i + 1)
    return code if code >= 0 else NO_ANSWER


class CallStats:
    """Counters of one gRPC server; every field is a plain int or a dict of ints."""

    __slots__ = ("answers", "bytes_in", "bytes_out", "calls", "latency", "latency_sum_s")

    def __init__(self) -> None:
        self.bytes_in = 0   # bytes read from clients (TLS: decrypted), all connections, since start
        self.bytes_out = 0  # bytes written to clients
        self.calls: dict[tuple[str, int], int] = {}       # (method path, grpc status) -> calls ended
        self.latency: dict[str, list[int]] = {}           # method -> calls per bucket (+Inf last)
        self.latency_sum_s: dict[str, float] = {}
        self.answers: dict[tuple[str, int], int] = {}     # (method path, RocketMQ code) -> calls ended

    def call_ended(self, method: str, code: int, seconds: float, answer: int = NO_ANSWER) -> None:
        """One call ended with gRPC status ``code`` after ``seconds`` (from its HEADERS); ``answer``:
        the RocketMQ code of its last answer (``answer_code``), if it had one."""
        key = (method, code)
        calls = self.calls
        calls[key] = calls.get(key, 0) + 1
        if answer != NO_ANSWER:
            key = (method, answer)
            self.answers[key] = self.answers.get(key, 0) + 1
        buckets = self.latency.get(method)
        if buckets is None:
            buckets = self.latency[method] = [0] * (len(CALL_BOUNDS_S) + 1)
            self.latency_sum_s[method] = 0.0
        buckets[bisect_left(CALL_BOUNDS_S, seconds)] += 1  # le: a call of exactly a bound counts in it
        self.latency_sum_s[method] += seconds
