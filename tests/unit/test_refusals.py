"""Refusals: counted per reason, logged at most once per interval per reason (fake clock)."""

import logging

import pytest

from chronoq.core import refusals
from chronoq.core.clock import FakeClock


def _refusals(clock):
    logger = logging.getLogger("chronoq.test.refused")
    return refusals.Refusals(clock.monotonic_ns, logger, interval_ns=1_000_000_000), logger


def test_every_refusal_is_counted_but_the_log_is_rate_limited(caplog):
    clock = FakeClock()
    r, logger = _refusals(clock)
    with caplog.at_level(logging.WARNING, logger=logger.name):
        for _ in range(5):
            r.refuse(refusals.RAPID_RESET, "ipv4:127.0.0.1:5000", "too many resets")
        r.refuse(refusals.STREAMS, "ipv4:127.0.0.1:5001", "stream 9 over the cap")
        clock.advance(999)
        r.refuse(refusals.RAPID_RESET, "ipv4:127.0.0.1:5000", "too many resets")
        clock.advance(1)
        r.refuse(refusals.RAPID_RESET, "ipv4:127.0.0.1:5000", "too many resets")
    assert r.counts[refusals.RAPID_RESET] == 7
    assert r.counts[refusals.STREAMS] == 1
    assert r.counts[refusals.PERMISSION] == 0
    lines = [rec.getMessage() for rec in caplog.records]
    assert lines == [
        "refused rapid_reset from ipv4:127.0.0.1:5000: too many resets",
        "refused stream_limit from ipv4:127.0.0.1:5001: stream 9 over the cap",
        "refused rapid_reset from ipv4:127.0.0.1:5000: too many resets (and 5 more since the last line)",
    ]


def test_an_unknown_reason_is_a_bug():
    r, _ = _refusals(FakeClock())
    with pytest.raises(AssertionError):
        r.refuse("whatever the client said", "", "")
