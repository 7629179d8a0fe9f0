"""One worker thread that takes jobs in the order they were submitted, a batch at a time
(``BatchWorker``): the thread behind the new consume-queue files (``chronoq.store.newqueues``)
and the new schedule-bucket files (``chronoq.timer.newfiles``), which both make files off the
event loop and tell the loop after each batch.

What it owns: the queue of jobs, its bound, the thread (started on the first submit, a daemon so
a broker that never closes it still exits) and stopping it. What its owner keeps: what a job is,
what a batch's work records, and its own lock for that record (the worker's lock guards the
queue only; ``work`` runs without it, so an owner may take its own lock there).

``work(batch)`` runs on the thread for each batch (at most ``batch_max`` jobs, in submit order)
and returns whether the loop should hear of it; then ``report()`` is called (the runtime passes a
``call_soon_threadsafe``). A report that fails (the loop is closing) is logged and dropped:
nothing waits for it then.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from typing import Callable

log = logging.getLogger("chronoq.core")


class BatchWorker:
    """``submit`` and ``close`` are the owner's (any thread); ``work`` and
    ``report`` are called on the worker's thread."""

    def __init__(self, name: str, work: Callable[[list], bool], report: Callable[[], None], *,
                 batch_max: int, queue_max: int | None = None):
        assert batch_max > 0 and (queue_max is None or queue_max > 0)
        self.name = name
        self._work = work
        self._report = report
        self._batch_max = batch_max
        self._queue_max = queue_max  # None: the owner bounds what it submits
        self._cond = threading.Condition()
        self._queue: deque = deque()
        self._stop = False
        self._thread: threading.Thread | None = None

    def submit(self, jobs: list) -> int:
        """Queue ``jobs`` (in order); returns how many of them were taken, the first ones: all,
        or fewer when the queue reaches ``queue_max``, none once closed. The rest are the
        owner's to do another way."""
        with self._cond:
            if self._stop:
                return 0
            taken = len(jobs) if self._queue_max is None else max(0, min(len(jobs), self._queue_max - len(self._queue)))
            if taken:
                self._queue.extend(jobs[:taken] if taken < len(jobs) else jobs)
                if self._thread is None:
                    self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
                    self._thread.start()
                self._cond.notify()
            return taken

    def close(self) -> None:
        """Stop the thread and wait for it: the batch it is working on is finished (and reported)
        first; jobs still queued are dropped, the owner's to do another way. Submits then take
        nothing."""
        with self._cond:
            self._stop = True
            self._queue.clear()
            self._cond.notify()
            thread = self._thread
        if thread is not None:
            thread.join()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._stop:
                    self._cond.wait()
                if self._stop:
                    return
                queue = self._queue
                batch = [queue.popleft() for _ in range(min(self._batch_max, len(queue)))]
            if self._work(batch):
                try:
                    self._report()
                except Exception as exc:  # noqa: BLE001 - (the loop is closing): nothing waits for this report
                    log.debug("%s: reporting a batch failed: %s", self.name, exc)
