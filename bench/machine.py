"""What the machine was doing while a benchmark ran (/proc/stat) and how fast it ran Python.

The development VM is shared: its single-thread speed moved by 15% within a day and the host took
2-16% of its time (steal), so a figure means little without these beside it.
"""

from __future__ import annotations

import time


class MachineLoad:
    """All CPUs between construction and a reading: busy (this benchmark's processes included)
    and stolen by the hypervisor."""

    def __init__(self) -> None:
        self.begin = self._read()

    @staticmethod
    def _read() -> list[int]:
        with open("/proc/stat") as fh:
            return [int(x) for x in fh.readline().split()[1:]]

    def _delta(self) -> tuple[list[int], int]:
        now = self._read()
        d = [b - a for a, b in zip(self.begin, now)]
        return d, sum(d[:8])  # user nice system idle iowait irq softirq steal (guest is inside user)

    def busy_pct(self) -> float:
        d, total = self._delta()
        return round(100 * (1 - (d[3] + d[4]) / total), 1) if total else 0.0

    def steal_pct(self) -> float:
        d, total = self._delta()
        return round(100 * d[7] / total, 1) if total and len(d) > 7 else 0.0


def python_speed() -> float:
    """Millions of iterations per second of a plain CPython loop, now, in this process (10.5-16.3
    on the development VM within one hour of 2026-11-22: compare runs only at similar speeds)."""
    n, total = 2_000_000, 0
    t0 = time.perf_counter()
    for i in range(n):
        total += i
    return round(n / (time.perf_counter() - t0) / 1e6, 2)
