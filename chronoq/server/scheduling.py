"""The shell of recurring schedules (chronoq.features.schedules.book): the task that runs rounds.

Each round is the book's steps with the waits in between (the crash reasoning is the book's): the
intent is saved, the occurrences are written through the broker's send path, the committer fsyncs
the commit log off the loop (``durable`` with the log's end as ticket, under either flush policy:
the cursor must never move past an occurrence a machine crash could lose), then the completion
is saved. The state file is small (a few KB per hundred schedules) and written twice per round,
on the loop, like a recall's tombstone (rounds come every ``horizon_ms / 2`` at most; admin
changes are rare operator actions). A failure keeps the intent; the next round waits for the log
to be durable and resolves it from the log.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal

from chronoq.features.schedules.book import ScheduleBook

log = logging.getLogger("chronoq.server.scheduling")

# A named fault point for the kill -9 test (tests/integration/test_schedules.py), off unless the
# variable is set: "POINT:N" kills this process (SIGKILL) the N-th time a round reaches POINT,
# one of "intent" (saved, nothing written), "written" (page cache, no fsync), "synced" (fsynced,
# completion not saved): the moments a crash must neither skip nor double an occurrence.
FAULT_ENV = "CHRONOQ_SCHEDULES_CRASH_AT"
_fault_point, _, _fault_count = os.environ.get(FAULT_ENV, "").partition(":")
_fault_left = [int(_fault_count or 1)]


def _fault(point: str) -> None:
    if point == _fault_point:
        _fault_left[0] -= 1
        if _fault_left[0] <= 0:
            os.kill(os.getpid(), signal.SIGKILL)


IDLE_S = 1.0          # look again at least this often (a create or resume also wakes the task)
BACKOFF_MAX_S = 5.0


def open_schedules(broker) -> ScheduleBook:
    return ScheduleBook(broker)


async def run_schedules(book: ScheduleBook, committer, stop: asyncio.Event, wake: asyncio.Event) -> None:
    broker = book.broker
    failures = 0
    while not stop.is_set():
        wake.clear()
        try:
            if book.intent is not None:  # a crash or a failed round: resolve it from the durable log
                await committer.durable(broker.log_written)
                book.resolve_intent()
                book.save()
            rnd = book.begin_round()
            if rnd is not None:
                book.save()
                _fault("intent")
                book.write_round(rnd)
                _fault("written")
                await committer.durable(broker.log_written)
                _fault("synced")
                book.finish_round(rnd)
                book.save()
            failures = 0
            nxt = book.next_round_ms()
            delay = IDLE_S if nxt is None else (nxt - broker.clock.wall_ms()) / 1000
        except Exception as exc:  # noqa: BLE001 - retried; the intent stays until resolved
            failures += 1
            if failures % 20 == 1:
                log.error("schedule round failed (%d in a row; retrying): %s", failures, exc)
            delay = min(BACKOFF_MAX_S, 0.05 * 2 ** min(failures, 8))
        if delay <= 0:
            await asyncio.sleep(0)
            continue
        try:
            await asyncio.wait_for(wake.wait(), min(delay, IDLE_S))
        except asyncio.TimeoutError:
            pass
