"""Refused requests, counted by reason and logged at a bounded rate (docs/security.md, "Refusals").

Every place that turns a client away (credentials, permissions, a limit, an HTTP/2 defence) calls
``Refusals.refuse(reason, peer, detail)``. The count per reason becomes
``chronoq_requests_refused_total{reason}`` when ``/metrics`` is scraped (``chronoq.server.metrics``); the
log gets at most one WARNING line per reason per ``LOG_INTERVAL_NS`` (the first refusal at once,
later ones summed into the next line), so a flood of refusals cannot flood the log too; those in
between go to the DEBUG level only (off by default).

Reasons are a closed set (the constants below): a label value per reason keeps the metric's
cardinality fixed whatever a client sends. Pure bookkeeping: no I/O but the logger; the clock is
injected so tests see exactly which refusals are logged.
"""

from __future__ import annotations

import logging
from typing import Callable

log = logging.getLogger("chronoq.refused")

LOG_INTERVAL_NS = 10_000_000_000  # at most one log line per reason every 10 s

# Reasons (the metric's label values). docs/security.md lists each with what the client sees.
UNAUTHENTICATED = "unauthenticated"          # missing or bad credentials
PERMISSION = "permission"                    # the identity may not do this
INVALID = "invalid_request"                  # a field failed validation
MESSAGE_TOO_LARGE = "message_too_large"      # a gRPC message above max_receive_message_length
DISK_FULL = "disk_reserve"                   # free space below disk_reserve_bytes
CONNECTIONS = "connection_limit"             # max_connections reached
STREAMS = "stream_limit"                     # a connection opened streams past its limit
TELEMETRY_STREAMS = "telemetry_stream_limit"  # Telemetry streams past max_streams(_per_client)
PARKED_POLLS = "parked_poll_limit"           # long-poll receives past max_parked_polls
ANSWER_BUDGET = "answer_budget"              # answers waiting on a peer's window over the budget
REQUEST_BUDGET = "request_budget"            # unfinished request bytes, all connections, over the cap
PREFACE_TIMEOUT = "preface_timeout"          # no HTTP/2 preface and SETTINGS in time
IDLE_TIMEOUT = "idle_timeout"                # a connection with no call for too long
RAPID_RESET = "rapid_reset"                  # client RST_STREAM over its budget
SERVER_RESETS = "server_resets"              # streams the server had to reset over the budget
CONTINUATION_FLOOD = "continuation_flood"    # too many CONTINUATION frames in one header block
HEADER_LIST = "header_list_too_large"        # decoded header list above its cap (HPACK bomb)
CONTROL_FLOOD = "control_flood"              # PING/SETTINGS acks the peer does not read
EMPTY_FRAMES = "empty_frames"                # frames carrying nothing, over the budget
PROTOCOL = "protocol_error"                  # any other HTTP/2 protocol violation
HTTP_BAD_REQUEST = "http_bad_request"        # the HTTP port (metrics, console): a malformed request

REASONS = (UNAUTHENTICATED, PERMISSION, INVALID, MESSAGE_TOO_LARGE, DISK_FULL, CONNECTIONS, STREAMS,
           TELEMETRY_STREAMS, PARKED_POLLS,
           ANSWER_BUDGET, REQUEST_BUDGET, PREFACE_TIMEOUT, IDLE_TIMEOUT, RAPID_RESET, SERVER_RESETS, CONTINUATION_FLOOD,
           HEADER_LIST, CONTROL_FLOOD, EMPTY_FRAMES, PROTOCOL, HTTP_BAD_REQUEST)


class Refusals:
    """Counts and rate-limited log lines of refused requests, one instance per broker."""

    def __init__(self, monotonic_ns: Callable[[], int], logger: logging.Logger = log,
                 interval_ns: int = LOG_INTERVAL_NS) -> None:
        self._now = monotonic_ns
        self._log = logger
        self._interval = interval_ns
        self.counts: dict[str, int] = dict.fromkeys(REASONS, 0)
        self._next_log: dict[str, int] = {}   # reason -> earliest monotonic ns of its next line
        self._quiet: dict[str, int] = {}      # reason -> refusals not logged since its last line

    def refuse(self, reason: str, peer: str, detail: str) -> None:
        """Count one refusal; log it unless this reason was logged less than an interval ago."""
        assert reason in self.counts, f"unknown refusal reason {reason!r}"  # a closed label set
        self.counts[reason] += 1
        now = self._now()
        if now < self._next_log.get(reason, 0):
            self._quiet[reason] = self._quiet.get(reason, 0) + 1
            self._log.debug("refused %s from %s: %s", reason, peer or "unknown peer", detail)
            return
        self._next_log[reason] = now + self._interval
        quiet = self._quiet.pop(reason, 0)
        more = f" (and {quiet} more since the last line)" if quiet else ""
        self._log.warning("refused %s from %s: %s%s", reason, peer or "unknown peer", detail, more)
