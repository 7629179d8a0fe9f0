"""Validation of requested delivery times. Pure: ``now_ms`` is passed in.

Rules: a delivery time is an integer of epoch milliseconds; one at or before now delivers at once;
one more than ``max_delay_ms`` ahead is refused with ``InvalidDeliveryTime`` naming the limit and
its setting (``timer_max_delay_ms``). So is one that cannot be meant as epoch milliseconds: negative,
or before 2000 and more than ``max_delay_ms`` ago (``past_floor``): epoch *seconds* (time.time() +
60 read as ms is January 1970) or a delay given where a time is expected, which would otherwise
deliver at once without a word. 0 is no time at all (delivered at once), as the Spark writer's
rows and the stage have it. Real times from years ago (a replay of old data) stay accepted.

``from_client_timestamp`` is for the gRPC shell. The official Python client fills the protobuf
``delivery_timestamp`` from a number of epoch *seconds*; a user who passes milliseconds there
(the unit most other APIs use) sends a date tens of thousands of years ahead. That is refused with
a message saying so and suggesting seconds, instead of the generic "too far ahead".
"""

from __future__ import annotations

from chronoq.core import errors

MS_PER_DAY = 86_400_000
MS_PER_YEAR = 365 * MS_PER_DAY
EPOCH_YEAR = 1970


def describe_span(span_ms: int) -> str:
    if span_ms >= 10 * MS_PER_YEAR:
        return f"about {span_ms / MS_PER_YEAR:,.0f} years"
    if span_ms >= 2 * MS_PER_YEAR:  # (one decimal: 800 days is not "about 2 years" beside a 2-year limit)
        return f"about {span_ms / MS_PER_YEAR:.1f} years"
    if span_ms >= 2 * MS_PER_DAY:
        return f"{span_ms / MS_PER_DAY:,.0f} days"
    return f"{span_ms / 1000:,.0f} s"


YEAR_2000_MS = 946_684_800_000


def past_floor(now_ms: int, max_delay_ms: int) -> int:
    """Delivery times from 1 ms up to before this are refused (``check_deliver_at``)."""
    return min(now_ms - max_delay_ms, YEAR_2000_MS)


def check_deliver_at(deliver_at_ms: object, now_ms: int, max_delay_ms: int) -> int:
    """Return the delivery time (ms) to use; at or before ``now_ms`` means deliver at once."""
    if isinstance(deliver_at_ms, bool) or not isinstance(deliver_at_ms, int):
        raise errors.InvalidDeliveryTime(
            f"deliver_at_ms must be an integer of epoch milliseconds, not {deliver_at_ms!r}")
    if deliver_at_ms < 0 or 0 < deliver_at_ms < past_floor(now_ms, max_delay_ms):
        raise errors.InvalidDeliveryTime(_implausible(deliver_at_ms, now_ms, max_delay_ms))
    ahead_ms = deliver_at_ms - now_ms
    if ahead_ms > max_delay_ms:
        raise errors.InvalidDeliveryTime(
            f"delivery time {deliver_at_ms} is {describe_span(ahead_ms)} ahead; the maximum delay is "
            f"{describe_span(max_delay_ms)} ({max_delay_ms} ms, setting timer_max_delay_ms)")
    return deliver_at_ms


def _implausible(deliver_at_ms: int, now_ms: int, max_delay_ms: int) -> str:
    where = "before 1970" if deliver_at_ms < 0 else f"in {EPOCH_YEAR + deliver_at_ms // MS_PER_YEAR}"
    text = (f"delivery time {deliver_at_ms} is {where}: a delivery time is an absolute time in epoch "
            f"milliseconds (now is {now_ms})")
    if 0 < deliver_at_ms * 1000 - now_ms <= max_delay_ms:
        return text + f"; it looks like epoch seconds ({deliver_at_ms * 1000} in milliseconds)"
    if 0 < deliver_at_ms <= max_delay_ms:
        return text + f"; for a delay, give now + the delay ({now_ms + deliver_at_ms} for {deliver_at_ms} ms)"
    return text


def from_client_timestamp(seconds: int, nanos: int, now_ms: int, max_delay_ms: int) -> int:
    """Delivery time in ms from a protobuf Timestamp, catching milliseconds passed as seconds."""
    if not isinstance(seconds, int) or not isinstance(nanos, int) or not 0 <= nanos < 1_000_000_000:
        raise errors.InvalidDeliveryTime("delivery_timestamp is not a valid timestamp")
    deliver_at_ms = seconds * 1000 + nanos // 1_000_000
    if deliver_at_ms - now_ms > max_delay_ms and looks_like_milliseconds(seconds, now_ms, max_delay_ms):
        year = EPOCH_YEAR + deliver_at_ms // MS_PER_YEAR
        raise errors.InvalidDeliveryTime(
            f"delivery_timestamp {seconds} s is in the year ~{year:,}: it looks like epoch "
            f"milliseconds were passed where epoch seconds are expected (the Python client's "
            f"delivery_timestamp is in seconds, e.g. time.time() + 60). Pass {seconds // 1000} "
            f"instead of {seconds}.")
    return check_deliver_at(deliver_at_ms, now_ms, max_delay_ms)


def looks_like_milliseconds(seconds: int, now_ms: int, max_delay_ms: int) -> bool:
    """True when ``seconds`` read as milliseconds is a plausible delivery time (past day .. max)."""
    as_ms = seconds
    return now_ms - MS_PER_DAY <= as_ms <= now_ms + max_delay_ms
