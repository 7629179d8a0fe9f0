"""The HTTP/2 front end's limits against hostile or broken clients (docs/security.md, "HTTP/2 limits").

``chronoq.server.h2server`` parses frames itself, so it owes the defences that nghttp2, Go's
net/http2, grpc-go and Netty added after each published HTTP/2 attack
(``../shared/HTTP2-HARDENING.md``). The numbers live here, each with why it was chosen, and the
bookkeeping is small pure classes with an injected clock (unit-tested without sockets): the
connection calls into them only on the frames an attack is made of (RST_STREAM, PING, SETTINGS,
empty frames, CONTINUATION) and on answers left waiting for a peer's windows, never per DATA frame
or per call, so a well-behaved client pays an integer compare or two.

What a connection does beyond a limit: GOAWAY with ENHANCE_YOUR_CALM (or the RFC's code) whose debug
data names the limit, then close; a stream past the concurrency cap gets RST_STREAM REFUSED_STREAM.
Each refusal is counted by reason in ``chronoq.core.refusals``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

# ------------------------------------------------------------------ transport caps (issue 20 §2)
# Open connections, broker-wide. The official RocketMQ clients put every call of a process on one
# connection, so this is roughly "client processes". Each connection may hold up to its window of
# request bytes and answers, so the cap is what bounds the total; it also stays under the usual
# 1,024-descriptor soft limit's neighbourhood (raise both together). Beyond it: SETTINGS, GOAWAY
# ENHANCE_YOUR_CALM, close; existing connections are untouched.
MAX_CONNECTIONS = 1000
# Concurrent streams per connection, advertised in SETTINGS_MAX_CONCURRENT_STREAMS. A client
# process multiplexes all its calls on one connection and each long-poll receive holds a stream for
# up to ~30 s: a process with a few push consumers over topics of 8-16 queues keeps some dozens
# open, plus its Telemetry streams and in-flight sends. 250 (Go's net/http2 default) leaves room
# for that while bounding what one connection can pin; gRPC clients queue calls beyond the
# advertised value themselves, so only a client that ignores SETTINGS sees REFUSED_STREAM.
MAX_CONCURRENT_STREAMS = 250
# The client preface and its first SETTINGS frame must arrive this soon after the connection is
# accepted (after the TLS handshake, with TLS). A real client sends both in its first write; a
# connection that sends half the preface used to be held forever.
PREFACE_TIMEOUT_S = 10.0
# A connection with no open stream for this long gets GOAWAY NO_ERROR and is closed (checked once
# per interval: closed between 1x and 2x it). gRPC clients reconnect on their next call without
# the application noticing; the official RocketMQ clients keep a Telemetry stream open, so their
# connections are never idle.
IDLE_TIMEOUT_S = 300.0
# Answer bytes a connection holds for a peer that does not take them: answers waiting for its
# flow-control windows, and what the transport buffers past its high-water mark. A peer that
# announces a window of 0 and keeps calling would make the broker hold every answer (receives
# have their own answer budget, chronoq.server.answers; a replica's pull or a Spark read answers
# up to 64 MiB). An answer is refused with RESOURCE_EXHAUSTED when the connection already holds
# some and this one would take it past the cap; a connection that holds nothing may always take
# one answer, so the cap is at least the largest answer (64 MiB: pulls, ReadMessages).
MAX_UNREAD_ANSWER_BYTES = 64 << 20
# The same bytes, summed over all connections of one server. The cap above alone lets every one
# of h2_max_connections peers make the broker hold 64 MiB (64 GiB at the default 1,000). While any
# connection holds some, an answer that would take the sum past this is refused the same way, a
# connection's first answer too (only while nothing is held anywhere is a lone large answer always
# taken; a peer that reads is asked only then, and its answer leaves at once). The connections keep the sum as their bytes
# start and stop waiting (``UnreadAnswers``), so the check is one compare. 256 MiB, as the receive
# answer budget's total (``answer_budget_total``): four of the largest answers.
MAX_UNREAD_ANSWER_BYTES_TOTAL = 256 << 20
# Request bytes all connections of one server hold for unary calls whose request is not complete
# (or not yet taken by its handler). A connection holds at most BUFFERED_MAX (h2server) plus a
# window, so h2_max_connections peers that start requests and never finish them could make the
# broker hold ~80 MiB each, for as long as they keep the connection (80 GB at the default 1,000).
# Past this sum, the unfinished request holding the most bytes, on the connection holding the
# most, is ended RESOURCE_EXHAUSTED until the sum is back under it (``Server.shed_requests``): the
# peers hoarding bytes lose theirs, a client whose request comes whole in one read never does.
# 256 MiB: 64 requests of the largest size (2 x max_body_bytes + 4 MiB at the default 4 MiB body).
MAX_BUFFERED_REQUEST_BYTES_TOTAL = 256 << 20

# ------------------------------------------------------------------ attacks (issue 20 §3)
# Rapid reset (CVE-2023-44487) and MadeYouReset (CVE-2025-8671): one token bucket per connection
# counts the RST_STREAMs the client sends and those we send (a refused stream, a stream error the
# client provoked). nghttp2 >= 1.57's numbers: a burst of 1,000, refilled at 33 per second. A gRPC
# client cancels a call now and then; a thousand in a burst is an attack.
RESET_BURST = 1000
RESET_RATE = 33.0
# CONTINUATION frames after one HEADERS (CVE-2024-27316 and kin): nghttp2 1.61 allows 8. Counting
# frames catches zero-length ones, which no byte cap ever sees. Our own 1 MiB MAX_FRAME_SIZE means
# a real client never needs more than one.
MAX_CONTINUATIONS = 8
# The decoded header list (HPACK bomb, CVE-2016-6581): name + value + 32 bytes per field (RFC 9113
# §6.5.2), checked while decoding so a 16 kB block of references to one 4 KB table entry cannot
# become 64 MB. 64 KiB as python-hyper's hpack (grpc-java: 8 KiB; a RocketMQ call sends < 2 KiB).
MAX_HEADER_LIST = 64 << 10
# PING and SETTINGS acks queued for a peer that does not read them (CVE-2019-9512, -9515):
# counted while the transport is paused (its buffer over the high-water mark), reset when it
# drains. nghttp2 allows 1,000 queued; at 17 bytes a PING ack that is ~17 KB past the mark.
MAX_UNREAD_ACKS = 1000
# PING and SETTINGS frames the peer sends (each asks for an ack), read or not (CVE-2019-9512,
# -9515): the unread-ack cap above only trips once the socket's buffers are full, and on loopback
# they hold megabytes, so a flood cost a second of CPU first. Clients ping to measure bandwidth
# (grpc core: at most one in flight, 100 ms apart or more) and for keepalive (minutes apart), and
# send SETTINGS once or twice: a burst of 1,000 refilled at 100 per second leaves them room.
CONTROL_BURST = 1000
CONTROL_RATE = 100.0
# Entries in one SETTINGS frame (nghttp2: 32). There are 6 settings; repeats only cost CPU.
MAX_SETTINGS_ENTRIES = 32
# Frames that carry nothing (CVE-2019-9518): DATA without payload or END_STREAM, empty header
# fragments, PRIORITY (ignored here), unsolicited PING acks, unknown frame types. A real gRPC client
# sends almost none; a budget of 1,000 refilled at 100 per second leaves any of them room.
EMPTY_BURST = 1000
EMPTY_RATE = 100.0


@dataclass(frozen=True)
class Limits:
    """One server's limits (``Server(limits=...)``); the defaults above unless configured."""

    max_connections: int = MAX_CONNECTIONS
    max_concurrent_streams: int = MAX_CONCURRENT_STREAMS
    preface_timeout_s: float = PREFACE_TIMEOUT_S
    idle_timeout_s: float = IDLE_TIMEOUT_S
    max_unread_answer_bytes: int = MAX_UNREAD_ANSWER_BYTES
    max_unread_answer_bytes_total: int = MAX_UNREAD_ANSWER_BYTES_TOTAL
    max_buffered_request_bytes_total: int = MAX_BUFFERED_REQUEST_BYTES_TOTAL
    max_header_list: int = MAX_HEADER_LIST
    reset_burst: int = RESET_BURST
    reset_rate: float = RESET_RATE
    max_continuations: int = MAX_CONTINUATIONS
    max_unread_acks: int = MAX_UNREAD_ACKS
    max_settings_entries: int = MAX_SETTINGS_ENTRIES
    control_burst: int = CONTROL_BURST
    control_rate: float = CONTROL_RATE
    empty_burst: int = EMPTY_BURST
    empty_rate: float = EMPTY_RATE

    @classmethod
    def from_config(cls, cfg) -> "Limits":
        """The operator's keys of ``BrokerConfig`` (``h2_*``); the rest stay at their defaults."""
        return cls(max_connections=cfg.h2_max_connections,
                   max_concurrent_streams=cfg.h2_max_concurrent_streams,
                   preface_timeout_s=cfg.h2_preface_timeout_ms / 1000.0,
                   idle_timeout_s=cfg.h2_idle_timeout_ms / 1000.0,
                   max_header_list=cfg.h2_max_header_list_bytes)

    def grpcio_options(self) -> list[tuple[str, int]]:
        """The same limits for grpcio's server (``grpc_server = "grpcio"``), where it has them.
        grpc core bounds rapid resets, CONTINUATION and empty-frame floods and unread acks by
        its own fixed rules; docs/security.md says which limits this mode does not take."""
        return [("grpc.max_concurrent_streams", self.max_concurrent_streams),
                ("grpc.max_allowed_incoming_connections", self.max_connections),
                ("grpc.server_handshake_timeout_ms", int(self.preface_timeout_s * 1000)),
                ("grpc.max_connection_idle_ms", int(self.idle_timeout_s * 1000)),
                ("grpc.max_metadata_size", self.max_header_list),
                ("grpc.absolute_max_metadata_size", self.max_header_list)]


class TokenBucket:
    """``burst`` tokens, refilled at ``rate`` per second of ``clock`` (seconds). ``take`` spends one
    and says False when none is left: the caller then refuses. Reads the clock only when asked."""

    __slots__ = ("tokens", "burst", "rate", "stamp", "clock")

    def __init__(self, burst: int, rate: float, clock: Callable[[], float]) -> None:
        self.tokens = float(burst)
        self.burst = float(burst)
        self.rate = rate
        self.clock = clock
        self.stamp = clock()

    def take(self) -> bool:
        now = self.clock()
        tokens = self.tokens + (now - self.stamp) * self.rate
        self.stamp = now
        if tokens > self.burst:
            tokens = self.burst
        if tokens < 1.0:
            self.tokens = tokens
            return False
        self.tokens = tokens - 1.0
        return True


class IdleWatch:
    """Says when a connection has had no open stream for a whole check interval, without any
    work per call: the connection's stream ids only grow, so "no stream now, none at the last check,
    and no new id since" means idle since the last check. ``check`` runs once per interval."""

    __slots__ = ("last_id", "busy")

    def __init__(self) -> None:
        self.last_id = 0     # stream ids start at 1: a connection that never opens one is idle
        self.busy = False

    def check(self, open_streams: int, last_stream_id: int) -> bool:
        """True when the connection should be closed as idle."""
        idle = not open_streams and not self.busy and last_stream_id == self.last_id
        self.last_id = last_stream_id
        self.busy = bool(open_streams)
        return idle


class UnreadAnswers:
    """The answer bytes all connections of one server hold for peers that have not taken them
    (``MAX_UNREAD_ANSWER_BYTES_TOTAL``). Kept as it changes, not summed when asked: each connection
    adds the bytes that start waiting on its peer and takes off those that leave or are dropped
    (``chronoq.server.h2streams.Answers``), so ``held`` is always at hand and a check is one compare.
    Ensures: ``held >= 0``; back to 0 once no connection holds anything (they all closed)."""

    __slots__ = ("held", "cap")

    def __init__(self, cap: int) -> None:
        assert cap > 0
        self.held = 0
        self.cap = cap

    def add(self, nbytes: int) -> None:
        """``nbytes`` more held (fewer when negative)."""
        held = self.held + nbytes
        # Below 0, a connection took off bytes it never added: the cap would be loose by that much for good.
        assert held >= 0, f"unread answer bytes below 0: {self.held} {nbytes:+d}"
        self.held = held

    def room(self, nbytes: int) -> bool:
        """Whether ``nbytes`` more stay within the cap."""
        return self.held + nbytes <= self.cap
