"""Clocks. Everything timed takes a ``Clock`` so tests drive time exactly and never sleep.

``wall_ms`` is epoch milliseconds: stored in records (born, stored, deliver-at), so it must be the
real calendar time. ``monotonic_ns`` only measures intervals inside one process.
"""

from __future__ import annotations

import time
from typing import Protocol


class Clock(Protocol):
    def wall_ms(self) -> int: ...

    def monotonic_ns(self) -> int: ...


class SystemClock:
    """The real clock. The monotonic reading is guarded so it never goes backwards."""

    def __init__(self) -> None:
        self._last_mono = 0

    def wall_ms(self) -> int:
        return time.time_ns() // 1_000_000

    def monotonic_ns(self) -> int:
        now = time.monotonic_ns()
        if now < self._last_mono:  # should not happen; never let callers see time reverse
            now = self._last_mono
        self._last_mono = now
        return now


class FakeClock:
    """A clock that only moves when told to (``advance``/``set``)."""

    def __init__(self, wall_ms: int = 1_700_000_000_000, monotonic_ns: int = 0):
        self._wall_ms = wall_ms
        self._mono_ns = monotonic_ns

    def wall_ms(self) -> int:
        return self._wall_ms

    def monotonic_ns(self) -> int:
        return self._mono_ns

    def advance(self, ms: int) -> None:
        assert ms >= 0, "a fake clock only moves forward"
        self._wall_ms += ms
        self._mono_ns += ms * 1_000_000

    def set(self, wall_ms: int) -> None:
        assert wall_ms >= self._wall_ms, "a fake clock only moves forward"
        self.advance(wall_ms - self._wall_ms)


SYSTEM_CLOCK = SystemClock()
