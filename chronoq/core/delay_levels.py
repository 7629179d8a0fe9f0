"""Delay levels: RocketMQ's table of fixed delays, parsed from configuration. Pure: no I/O.

A level table is a whitespace-separated list of durations, each an integer followed by a unit
(``ms``, ``s``, ``m``, ``h``, ``d``)::

    "1s 5s 10s 30s 1m 2m 3m 4m 5m 6m 7m 8m 9m 10m 20m 30m 1h 2h"   (the default, as RocketMQ)

Level *k* (1-based) delays a message by the *k*-th duration. A message sent with level *k* is
written to the system topic ``DELAY_TOPIC``, queue *k − 1*, with its real topic and queue in
reserved properties. All messages of one level wait the same time, so within a queue arrival
order is due order and the level's lane only ever looks at the queue's head. Level 0 means "no
delay" (RocketMQ's convention).

In core because the config loader checks ``timer_delay_levels`` at load (``core.config``), and
both the timer's levels and POP's retry back-off use the table.
"""

from __future__ import annotations

import re

from chronoq.core import errors

DELAY_TOPIC = "CHRONOQ_DELAY"
# The user property a client sends a message's delay level in (a whole number; 0: no delay).
DELAY_LEVEL_PROPERTY = "CHRONOQ_DELAY_LEVEL"
DEFAULT_LEVELS = "1s 5s 10s 30s 1m 2m 3m 4m 5m 6m 7m 8m 9m 10m 20m 30m 1h 2h"
LEVELS_MAX = 64
UNIT_MS = {"ms": 1, "s": 1_000, "m": 60_000, "h": 3_600_000, "d": 86_400_000}
_TOKEN = re.compile(r"(\d+)([a-z]+)")
# A level longer than this is surely a typo ("100d"); timer messages serve longer delays.
LEVEL_MS_MAX = 30 * 86_400_000


def parse_duration(text: str, *, what: str = "duration") -> int:
    """``"30s"`` -> 30000. Raises ``ClientError`` naming the bad token and the allowed units."""
    token = text.strip().lower()
    match = _TOKEN.fullmatch(token)
    if match is None:
        raise errors.ClientError(
            f"{what} {text!r} is not a whole number followed by a unit (ms, s, m, h or d), e.g. '30s'")
    number, unit = match.groups()
    if unit not in UNIT_MS:
        raise errors.ClientError(f"{what} {text!r} has unknown unit {unit!r}; use ms, s, m, h or d")
    value_ms = int(number) * UNIT_MS[unit]
    if value_ms <= 0:
        raise errors.ClientError(f"{what} {text!r} must be longer than zero")
    return value_ms


def format_duration(value_ms: int) -> str:
    """The shortest exact spelling: 60000 -> '1m', 1500 -> '1500ms'."""
    for unit in ("d", "h", "m", "s"):
        if value_ms % UNIT_MS[unit] == 0:
            return f"{value_ms // UNIT_MS[unit]}{unit}"
    return f"{value_ms}ms"


class DelayLevels:
    """An immutable, validated level table."""

    __slots__ = ("delays_ms", "text")

    def __init__(self, delays_ms: tuple[int, ...], text: str):
        assert delays_ms and all(d > 0 for d in delays_ms)
        self.delays_ms = delays_ms
        self.text = text

    @classmethod
    def parse(cls, text: str) -> "DelayLevels":
        """Parse a table such as ``DEFAULT_LEVELS``; errors say which position is wrong."""
        if not isinstance(text, str) or not text.strip():
            raise errors.ClientError("timer_delay_levels is empty; give durations such as '1s 5s 10s 30s 1m'")
        tokens = text.split()
        if len(tokens) > LEVELS_MAX:
            raise errors.ClientError(f"timer_delay_levels has {len(tokens)} levels; at most {LEVELS_MAX} allowed")
        delays = []
        for i, token in enumerate(tokens, start=1):
            value_ms = parse_duration(token, what=f"timer_delay_levels level {i}")
            if value_ms > LEVEL_MS_MAX:
                raise errors.ClientError(
                    f"timer_delay_levels level {i} ({token}) is longer than 30 days; "
                    f"send a timer message (deliver_at_ms) for long delays")
            delays.append(value_ms)
        return cls(tuple(delays), " ".join(tokens))

    def __len__(self) -> int:
        return len(self.delays_ms)

    def delay_ms(self, level: int) -> int:
        """Delay of ``level`` (1-based); ``InvalidDeliveryTime`` when there is no such level."""
        self.check(level)
        return self.delays_ms[level - 1]

    def check(self, level: object) -> int:
        if isinstance(level, bool) or not isinstance(level, int) or not 1 <= level <= len(self.delays_ms):
            raise errors.InvalidDeliveryTime(
                f"delay level {level!r} does not exist: levels are 1..{len(self.delays_ms)} "
                f"({self.text}); for other delays give a delivery time (deliver_at_ms; the official clients' "
                "delivery_timestamp)")
        return level

    @staticmethod
    def queue_id(level: int) -> int:
        """Queue of ``DELAY_TOPIC`` that holds level ``level``."""
        assert level >= 1
        return level - 1

    @staticmethod
    def level_of_queue(queue_id: int) -> int:
        assert queue_id >= 0
        return queue_id + 1

    def describe(self) -> list[dict]:
        return [{"level": i + 1, "delay_ms": d, "delay": format_duration(d)} for i, d in enumerate(self.delays_ms)]
