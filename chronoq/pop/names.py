"""POP naming and request rules: retry/DLQ topic names, broker-reserved properties, limits, filters.

Pure: no I/O, no clock. The gRPC shell imports the property names from here to fill
``dead_letter_queue{topic, message_id}`` and to hide them from ``user_properties``.

Retry and dead-letter messages are ordinary messages in system topics. Their broker-reserved
properties (keys start with ``__``, ``model.SYSTEM_PROPERTY_PREFIX``)::

    %RETRY%{group}_{topic}     __ORIGIN_TOPIC       topic the consumer asked for (acks name it)
                               __ORIGIN_MSG_ID      message id as the consumer saw it
                               __RECONSUME_TIMES    deliveries so far (the next is this + 1)
                               __NOT_BEFORE_MS      epoch ms before which it is not handed out
                                                    (absent: at once)
    %DLQ%{group}               __DLQ_ORIGIN_TOPIC   topic the message was consumed from
                               __DLQ_ORIGIN_MSG_ID  its id there

A receive hands out a retried or dead-lettered message under its origin topic and id, with these
properties removed (``copies.view``); ``queue_id``/``queue_offset`` say where it was read.

Back-off: the broker's delay-level table (``BrokerConfig.timer_delay_levels``, default
``1s 5s 10s 30s 1m 2m 3m 4m 5m 6m 7m 8m 9m 10m 20m 30m 1h 2h``); ``PopService`` passes it in and
the functions here take it as an argument (``delays_ms``). A message whose delivery ``attempt``
*n* failed waits back-off level ``min(n, len(table))`` (``backoff_level``): the first retry
waits level 1, the *k*-th level *k*, and every retry past the table's end its last level. The
wait is measured from the failed delivery (``not_before_ms``).

A retry message carries ``__NOT_BEFORE_MS`` (absolute epoch ms) and a receive neither hands it
out nor moves past it before that time (not through the timer: a retry needs no schedule-log
copy, and waiting at the head of a per-level queue is what a delay level does anyway). The
retry topic has one queue for "due at once" (queue 0) and one per back-off level (queue k holds
level k; ``retry_queues``), so within a queue arrival order is (nearly) due order and waiting at
the head costs little; see ``retry_queue``.

Changing the table (a restart with another ``timer_delay_levels``) loses nothing and delivers
nothing early: a copy already waiting keeps its absolute ``__NOT_BEFORE_MS``, and receives read
every queue of the retry topic, however many there are. A longer table grows the topic (queue
counts only grow); a shorter one leaves the upper queues to drain. Until the old copies drain, a
queue may hold two levels' delays, so a new copy can wait behind an older, later-due head.
"""

from __future__ import annotations

import hashlib

from chronoq.core import errors, model, validate

RETRY_PREFIX = "%RETRY%"
DLQ_PREFIX = "%DLQ%"

PROP_ORIGIN_TOPIC = "__ORIGIN_TOPIC"
PROP_ORIGIN_MESSAGE_ID = "__ORIGIN_MSG_ID"
PROP_RECONSUME_TIMES = "__RECONSUME_TIMES"
PROP_NOT_BEFORE_MS = "__NOT_BEFORE_MS"
PROP_DLQ_ORIGIN_TOPIC = "__DLQ_ORIGIN_TOPIC"
PROP_DLQ_ORIGIN_MESSAGE_ID = "__DLQ_ORIGIN_MSG_ID"
RETRY_PROPS = (PROP_ORIGIN_TOPIC, PROP_ORIGIN_MESSAGE_ID, PROP_RECONSUME_TIMES, PROP_NOT_BEFORE_MS)
DLQ_PROPS = (PROP_DLQ_ORIGIN_TOPIC, PROP_DLQ_ORIGIN_MESSAGE_ID)

# The proxy's default: 16 retries after the first delivery (back-off: the broker's delay levels).
DEFAULT_MAX_ATTEMPTS = 17
MAX_ATTEMPTS_LIMIT = 1000
DLQ_QUEUES = 1

MAX_MESSAGES_MAX = 32
ACK_ENTRIES_MAX = 1024  # handles in one AckMessage: each is decoded and settled on the loop (~3-4 us)
INVISIBLE_MS_MAX = 12 * 3600 * 1000
# The proxy asks for 10 s on receive; the Python client's tests use less, so 1 s is accepted.
RECEIVE_INVISIBLE_MS_MIN = 1_000
CHANGE_INVISIBLE_MS_MIN = 0
ATTEMPT_ID_CHARS_MAX = 256
FILTER_CHARS_MAX = 4096
_FILTER_CACHE_MAX = 1024
_filter_cache: dict[str, frozenset[str] | None] = {}


def retry_topic(group: str, topic: str) -> str:
    """``%RETRY%{group}_{topic}``; a hashed name when that exceeds the topic-name limit.

    ``a_b``+``c`` and ``a``+``b_c`` share a name (as in RocketMQ); receives tell them apart by
    ``__ORIGIN_TOPIC``.
    """
    name = f"{RETRY_PREFIX}{group}_{topic}"
    if len(name) <= model.TOPIC_NAME_MAX:
        return name
    digest = hashlib.sha1(f"{group}\n{topic}".encode()).hexdigest()
    return f"{RETRY_PREFIX}{digest}"


def dlq_topic(group: str) -> str:
    name = f"{DLQ_PREFIX}{group}"
    assert len(name) <= model.TOPIC_NAME_MAX  # group names are at most 120 characters
    return name


def retry_queues(delays_ms: tuple[int, ...]) -> int:
    """Queues a retry topic needs for the back-off table ``delays_ms``: queue 0 (due at once)
    and queue k for level k."""
    assert delays_ms
    return 1 + len(delays_ms)


def backoff_level(attempt: int, delays_ms: tuple[int, ...]) -> int:
    """The back-off level (1-based) of a message whose delivery ``attempt`` failed: level
    ``attempt``, clamped to the table's last level."""
    assert attempt >= 1 and delays_ms
    return min(attempt, len(delays_ms))


def retry_queue(attempt: int, not_before_ms: int, now_ms: int, queues: int, delays_ms: tuple[int, ...]) -> int:
    """The retry-topic queue for a message whose delivery ``attempt`` failed.

    Ensures: 0 when due now; otherwise its back-off level's own queue, clamped to the topic's
    ``queues`` (fewer than ``retry_queues(delays_ms)`` only when ``max_queues`` caps the topic).
    """
    assert queues >= 1
    level = backoff_level(attempt, delays_ms)
    if not_before_ms <= now_ms:
        return 0
    return min(level, queues - 1)


def not_before_ms(attempt: int, delivered_ms: int, now_ms: int, delays_ms: tuple[int, ...]) -> int:
    """When a message whose delivery ``attempt`` failed may be delivered again: its back-off
    level's delay (``backoff_level``) after the failed delivery.

    The back-off is measured from the failed delivery, not from the revive: a consumer that
    already waited (invisible time, or a nack with the client's own back-off) is not made to
    wait twice. Ensures: result >= now_ms.
    """
    delay = delays_ms[backoff_level(attempt, delays_ms) - 1]
    return max(now_ms, delivered_ms + delay)


def check_retry_delays(delays_ms: object) -> tuple[int, ...]:
    """A back-off table: a non-empty sequence of positive whole milliseconds, as a tuple."""
    table = tuple(delays_ms) if isinstance(delays_ms, (tuple, list)) else ()
    if not table or any(type(d) is not int or d <= 0 for d in table):
        raise errors.ClientError(f"retry delays must be a non-empty list of positive milliseconds, not {delays_ms!r}")
    return table


def parse_tag_filter(expression: object) -> frozenset[str] | None:
    """``"*"`` (or empty) -> None (everything); ``"A || B"`` -> {"A", "B"}. Else InvalidFilter."""
    if type(expression) is str:
        hit = _filter_cache.get(expression, False)
        if hit is not False:
            return hit  # type: ignore[return-value]
    if not isinstance(expression, str):
        raise errors.InvalidFilter(f"tag filter must be a string, not {type(expression).__name__}")
    if len(expression) > FILTER_CHARS_MAX:
        raise errors.InvalidFilter(f"tag filter is longer than {FILTER_CHARS_MAX} characters")
    text = expression.strip()
    result: frozenset[str] | None
    if text in ("", "*"):
        result = None
    else:
        tags = []
        # Empty pieces are skipped, as RocketMQ's own parser does ("A || " is {"A"}); an
        # expression of nothing but separators names no tag and is refused.
        for part in text.split("||"):
            tag = part.strip()
            if tag == "*":
                tags = None
                break
            if not tag:
                continue
            try:
                validate.tag(tag)
            except errors.InvalidTag as exc:
                raise errors.InvalidFilter(
                    f"tag filter {expression!r} is not '*' or 'TagA || TagB': {exc.message}") from None
            tags.append(tag)
        if tags == []:
            raise errors.InvalidFilter(f"tag filter {expression!r} is not '*' or 'TagA || TagB': it names no tag")
        result = None if tags is None else frozenset(tags)
    if len(_filter_cache) >= _FILTER_CACHE_MAX:
        _filter_cache.clear()
    _filter_cache[expression] = result
    return result


def check_max_messages(max_messages: object) -> int:
    if type(max_messages) is not int or not 1 <= max_messages <= MAX_MESSAGES_MAX:
        raise errors.ClientError(f"max_messages must be an integer from 1 to {MAX_MESSAGES_MAX}, "
                                 f"not {max_messages!r}")
    return max_messages


def check_receive_invisible(invisible_ms: object) -> int:
    return _check_invisible(invisible_ms, RECEIVE_INVISIBLE_MS_MIN, "receive")


def check_change_invisible(invisible_ms: object) -> int:
    return _check_invisible(invisible_ms, CHANGE_INVISIBLE_MS_MIN, "change-invisible-time")


def _check_invisible(invisible_ms: object, low: int, what: str) -> int:
    if type(invisible_ms) is not int or not low <= invisible_ms <= INVISIBLE_MS_MAX:
        raise errors.InvalidInvisibleTime(
            f"invisible time for {what} must be {low} ms to 12 h ({INVISIBLE_MS_MAX} ms), not {invisible_ms!r}")
    return invisible_ms


def check_attempt_id(attempt_id: object) -> str | None:
    if attempt_id is None or attempt_id == "":
        return None
    if not isinstance(attempt_id, str) or len(attempt_id) > ATTEMPT_ID_CHARS_MAX:
        raise errors.ClientError(f"attempt_id must be a string of at most {ATTEMPT_ID_CHARS_MAX} characters")
    return attempt_id
