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

from chronoq.features.schedules.book import ScheduleBook

log = logging.getLogger("chronoq.server.scheduling")

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
                book.write_round(rnd)
                await committer.durable(broker.log_written)
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
