"""Free-space guard: refuse *new* messages while the data directory's file system is nearly full.

Why a reserve and not just ENOSPC: a full disk refuses every write, including the small ones
that keep the broker consistent and draining — POP checkpoints and acks, retry and dead-letter
copies, timer deliveries, EndTransaction, checkpoints. So new sends are refused while free space
is below ``disk_reserve_bytes``; everything else may still use the reserve, and consumers can
drain the backlog. When space returns (retention, an operator) sends resume by themselves at
the next look.

Cost: ``os.statvfs`` is one syscall; it runs at most every ``check_interval_ms`` (monotonic
clock, injected), so the send path pays a clock read and a compare. ``f_bavail`` is used (the
blocks an unprivileged writer may take), which is what is left before ENOSPC for most setups.

The reserve is a soft limit. A write that still meets ENOSPC (another process filled the disk
between looks, or the reserve is 0) fails cleanly where it happens: the commit log preallocates
before writing, so a refused batch leaves the log as it was (``commitlog.py``).
"""

from __future__ import annotations

import logging
import os
from typing import Callable

from chronoq.core import errors

log = logging.getLogger("chronoq.store")


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB"


class DiskSpace:
    def __init__(self, path: str, reserve_bytes: int, check_interval_ms: int, clock,
                 statvfs: Callable[[str], os.statvfs_result] = os.statvfs):
        assert reserve_bytes >= 0 and check_interval_ms > 0
        self.path = path
        self.reserve_bytes = reserve_bytes
        self.interval_ns = check_interval_ms * 1_000_000
        self.clock = clock
        self._statvfs = statvfs  # a test hook: tests pass a fake file system
        self._next_ns = 0
        self.free_bytes: int | None = None  # as of the last look
        self.low = False

    def check(self) -> None:
        """Raise ``errors.DiskFull`` while free space is below the reserve (looked up at most every interval)."""
        if not self.reserve_bytes:
            return
        now = self.clock.monotonic_ns()
        if now >= self._next_ns:
            self._look(now)
        if self.low:
            raise errors.DiskFull(
                f"disk nearly full: {_mib(self.free_bytes or 0)} free where {self.path} lives, below the "
                f"reserve of {_mib(self.reserve_bytes)} (disk_reserve_bytes); new messages are refused until "
                "space is freed, while receives and acks go on")

    def recheck_soon(self) -> None:
        """Look again at the next ``check`` (after a write met ENOSPC)."""
        self._next_ns = 0

    def _look(self, now_ns: int) -> None:
        self._next_ns = now_ns + self.interval_ns
        try:
            st = self._statvfs(self.path)
        except OSError as exc:  # cannot tell: do not block sends on a failing statvfs
            log.warning("cannot read free space of %s: %s", self.path, exc)
            return
        free = st.f_bavail * st.f_frsize
        low = free < self.reserve_bytes
        if low != self.low:
            if low:
                log.warning("free space %s below the reserve %s: refusing new messages", _mib(free),
                            _mib(self.reserve_bytes))
            else:
                log.warning("free space %s is above the reserve again: accepting new messages", _mib(free))
        self.free_bytes = free
        self.low = low
