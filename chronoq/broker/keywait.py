"""A keyed call's wait for the timer's key index build (``KeyIndexWait``).

After a start the timer's key index (chronoq.timer.keyed) is built from the schedule log a slice
at a time. A keyed call (cancel by key, a send with a replace key) answered while buckets are
unread searches every one of them on the loop (``Keyed._unread_candidates``): 300,000 keyed
timers pending after a restart, each replacing send held the loop ~120 ms (the first 459 ms)
until the build was done (bench/stalls.py --keyed --replace). So such a call first reads the
build itself, a slice at a time (``keys_slice``, 5 ms), the loop free between slices, until it
is done or KEY_INDEX_WAIT_S passed; past the wait it searches all the same (over fewer buckets by
then): a call is delayed a bounded time, never refused. One task reads for all the calls waiting
at once (a reader each would hold the loop a slice per waiting call per pass).
"""

from __future__ import annotations

import asyncio
import logging

from chronoq.timer.service import TimerService

log = logging.getLogger("chronoq.broker.committer")  # (the committer's, whose callers wait here)

KEY_INDEX_WAIT_S = 1.0  # a keyed call waits at most this long for the key index's build


class KeyIndexWait:
    """The committer's wait for the timer's key index build (the module docstring), on the
    event loop. At most one reader task at a time, shared by every waiting call."""

    def __init__(self, timer: TimerService):
        self.timer = timer
        self._reader: asyncio.Task | None = None  # reads the build while calls wait

    async def built(self) -> None:
        """Return once the key index is built, or KEY_INDEX_WAIT_S after its reading began (a
        start's first keyed call begins the build)."""
        timer = self.timer
        timer.begin_keys()
        if not timer.keys_to_read:
            return
        if self._reader is None or self._reader.done():  # one reader for every waiting call
            self._reader = asyncio.get_running_loop().create_task(self._read(), name="chronoq-key-build")
        await asyncio.shield(self._reader)  # (a caller that goes away leaves the reading to the others)

    async def _read(self) -> None:
        timer = self.timer
        deadline = timer.clock.monotonic_ns() + int(KEY_INDEX_WAIT_S * 1e9)
        try:
            while timer.keys_to_read and timer.clock.monotonic_ns() < deadline:
                timer.keys_slice()
                await asyncio.sleep(0)
        except Exception:  # noqa: BLE001 - the waiting calls search the unread buckets instead
            log.exception("reading the timer's key index build failed")

    def close(self) -> None:
        """Stop reading (the broker is stopping; the runtime's own build task goes on no more)."""
        if self._reader is not None:
            self._reader.cancel()
