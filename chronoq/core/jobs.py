"""Blocking work split off the broker's thread: a ``Job`` is a ``run`` and a ``finish``.

The broker is single-threaded, and its asyncio shell must not stall on an fsync (a store
checkpoint fsyncs every dirty consume-queue file; a timer checkpoint fsyncs the schedule files).
So such work is cut in three steps:

1. *begin*, on the broker's thread: snapshot what the step will claim (offsets, sizes, the JSON to
   write) and, where needed, stop whatever could disturb it; this builds the ``Job``;
2. ``run``: the fsyncs and file writes; it touches only what the snapshot captured, so it may
   run on a worker thread (``loop.run_in_executor``) while the broker goes on serving;
3. ``finish(exc)``, back on the broker's thread: publish the result (``exc is None``) or undo the
   snapshot's side effects so the step is retried later.

``finish`` is called exactly once per job that was begun, also when ``run`` failed, and it must
not raise. The embedded broker runs both at once with ``run_here``.
"""

from __future__ import annotations

from typing import Callable


class Job:
    __slots__ = ("name", "_run", "_finish", "finished")

    def __init__(self, name: str, run: Callable[[], None],
                 finish: Callable[[BaseException | None], None] | None = None):
        self.name = name
        self._run = run
        self._finish = finish
        self.finished = False

    def run(self) -> None:
        """The blocking part (any thread)."""
        self._run()

    def finish(self, exc: BaseException | None) -> None:
        """Back on the broker's thread, with what ``run`` raised (None: it succeeded)."""
        assert not self.finished, f"job {self.name} finished twice"
        self.finished = True
        if self._finish is not None:
            self._finish(exc)

    def run_here(self) -> None:
        """Run and finish on this thread; ``run``'s exception is re-raised after ``finish``."""
        try:
            self._run()
        except BaseException as exc:
            self.finish(exc)
            raise
        self.finish(None)


def run_all_here(jobs: list[Job]) -> None:
    """Run and finish every job (each is finished even when an earlier one failed); then raise
    the first failure, if any."""
    first: BaseException | None = None
    for job in jobs:
        try:
            job.run_here()
        except Exception as exc:  # noqa: BLE001 - re-raised below, after the other jobs ran
            first = first or exc
    if first is not None:
        raise first
