"""Progress of the broker's long start-up work: verifying the commit log and rebuilding the consume
queues from it (``chronoq.store.store.Store``'s ``progress`` callback).

The store calls ``StartupProgress(phase, done, total)`` once per segment and at the end of each
phase (bytes of that phase), never per record, so reporting costs nothing measurable. Each call:

- logs ``recovery: <phase> <pct>% (<done> of <total> bytes, <rate> MiB/s)`` at INFO, at most
  once every ``log_every_s`` per phase, and always when a phase ends (a 3-second recovery logs
  a few lines; a 10-minute one, one every 2 s);
- moves a rich progress bar when stderr is a terminal (``chronoq serve`` run by hand). While the
  bar is drawn, log lines that go to the terminal are routed through it so they print above the
  bar instead of tearing it.

The clock is injected (``monotonic_ns``) so the rate limit is testable without sleeping.
"""

from __future__ import annotations

import logging
import sys
from typing import Callable

log = logging.getLogger("chronoq.recovery")

LOG_EVERY_S = 2.0
PHASE_WORDS = {"verify": "verifying the commit log", "replay": "rebuilding consume queues"}


class StartupProgress:
    def __init__(self, monotonic_ns: Callable[[], int], *, log_every_s: float = LOG_EVERY_S,
                 bar: bool | None = None):
        assert log_every_s > 0
        self._now_ns = monotonic_ns
        self._log_every_ns = int(log_every_s * 1e9)
        self._bar_wanted = sys.stderr.isatty() if bar is None else bar
        self._phase: str | None = None
        self._phase_started_ns = monotonic_ns()
        self._last_log_ns = 0
        self._last_step_ns = self._phase_started_ns  # end of the previous phase: this one's start
        self._progress = None   # rich.progress.Progress while a bar is drawn
        self._task = None
        self._swapped: list[tuple[logging.StreamHandler, object]] = []
        self.logged: list[str] = []  # the lines logged (for tests and the summary)

    def __call__(self, phase: str, done: int, total: int) -> None:
        assert 0 <= done <= total, (phase, done, total)
        now = self._now_ns()
        if phase != self._phase:
            self._phase = phase
            self._phase_started_ns = self._last_step_ns
            self._last_log_ns = self._phase_started_ns
            self._new_bar(phase, total)
        self._last_step_ns = now
        finished = done == total
        if finished or now - self._last_log_ns >= self._log_every_ns:
            self._last_log_ns = now
            elapsed_s = max(now - self._phase_started_ns, 1) / 1e9
            pct = done * 100 // total if total else 100
            line = (f"recovery: {phase} {pct}% ({done:,} of {total:,} bytes, "
                    f"{done / elapsed_s / (1 << 20):,.1f} MiB/s)")
            self.logged.append(line)
            log.info("%s", line)
        if self._progress is not None:
            self._progress.update(self._task, completed=done, total=total, refresh=True)  # once per segment

    def _new_bar(self, phase: str, total: int) -> None:
        if not self._bar_wanted:
            return
        if self._progress is None:
            from rich.console import Console
            from rich.progress import (BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn,
                                       TransferSpeedColumn)

            # file=: the real stderr object, not rich's proxy that replaces sys.stderr meanwhile.
            self._progress = Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(),
                                      TransferSpeedColumn(), TimeRemainingColumn(),
                                      console=Console(file=sys.stderr), redirect_stderr=True, redirect_stdout=False)
            self._progress.start()
            self._route_logs_through_bar()
        self._task = self._progress.add_task(PHASE_WORDS.get(phase, phase), total=total)

    def _route_logs_through_bar(self) -> None:
        """Handlers writing to the terminal's stderr write to rich's proxy while the bar is live."""
        real, proxy = sys.__stderr__, sys.stderr
        if proxy is real:
            return  # rich did not redirect (not a terminal after all)
        for handler in logging.getLogger().handlers:
            if isinstance(handler, logging.StreamHandler) and handler.stream in (real, self._progress.console.file):
                self._swapped.append((handler, handler.setStream(proxy)))

    def close(self) -> None:
        """Stop drawing (the last state of each bar stays on screen). Idempotent."""
        for handler, stream in self._swapped:
            handler.setStream(stream)
        self._swapped.clear()
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
