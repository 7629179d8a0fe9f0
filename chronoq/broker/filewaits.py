"""What the committer holds back while new queues' first files are made off the loop.

A batch that writes to a queue with no file yet is appended and fsynced at once, but dispatched
only once ``chronoq.store.newqueues`` reports the file made (``Store.dispatch(..., wait_files=True)``
stops before it). Two kinds of caller wait meanwhile, both here, both answered by ``made``:

* acknowledgements of durable records (an fsync's generation; under ``async``, a send's future)
  whose records lie at or above such a batch: they are *parked*, first in, first out, because an
  acknowledgement means "dispatched" and the dispatch goes in log order;
* sends that create topics, waiting to be written until their queues' files are made
  (``Sender.write_batch``'s ``files_ahead``), so that what others write meanwhile is not held
  behind them: by the maker's sequence number, in request order.

Invariants: parked answers leave in the order they were parked, and so never overtake each other
(one parked behind another is answered after it even if its own files are made); none is answered
before the files below its ticket are made, unless refused (the node fenced); on ``close``
everything parked is answered (its records are durable and the store's close dispatches them)
or refused with the failure of that close, and every send still waiting to be written is refused.
"""

from __future__ import annotations

import asyncio
from typing import Callable

from chronoq.core import errors
from chronoq.store.store import Store

# ``answer(synced, exc)``: a parked acknowledgement's; ``synced`` is -1 when ``exc`` is set.
Answer = Callable[[int, BaseException | None], None]


def settle(fut: asyncio.Future, exc: BaseException | None) -> None:
    """Answer ``fut``: done, or failed with ``exc``; unless its caller went away meanwhile (it
    cancelled the future). The committer's generations answer their waiters the same way."""
    if fut.done():  # its caller was cancelled (a client that went away)
        return
    if exc is None:
        fut.set_result(None)
    else:
        fut.set_exception(exc)
        fut.exception()  # retrieved: a waiter that gave up must not log "never retrieved"


class FileWaits:
    """The committer's parking for new queues' files (the module docstring). On the event loop
    only, but for the maker's report, which reaches ``made`` through ``call_soon_threadsafe``.

    ``dispatch()`` is the committer's dispatch of what is durable (under its policy);
    ``refusal()`` is the error every parked answer gets instead while the node is fenced, or None.
    Open between ``start`` and ``stop``: outside, nothing waits (``ahead`` says so) and a late
    report is left to ``close``.
    """

    def __init__(self, store: Store, dispatch: Callable[[], None],
                 refusal: Callable[[], BaseException | None]):
        self.store = store
        self._dispatch = dispatch
        self._refusal = refusal
        self._loop: asyncio.AbstractEventLoop | None = None
        self._open = False
        # (ticket, answer, synced): acknowledgements of durable records waiting, in log order,
        # for the dispatch of a batch below ``ticket``.
        self._parked: list[tuple[int, Answer, int]] = []
        # (the maker's sequence number to reach, the future): sends waiting to be written.
        self._writes: list[tuple[int, asyncio.Future]] = []

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """From now on new queues' first files are made off the loop, ``made`` hearing of them.
        Why: 500 new topics in one batch held the loop 220-440 ms in the dispatch
        (chronoq.store.newqueues)."""
        self._loop = loop
        self._open = True
        self.store.make_files_ahead(lambda: loop.call_soon_threadsafe(self.made))

    def stop(self) -> None:
        """The committer is closing: no new wait, and reports from now on are left to ``close``."""
        self._open = False

    def waits(self, ticket: int) -> bool:
        """Whether an acknowledgement up to ``ticket`` must be parked: a batch below it waits for
        files, or something parked already (it must not be overtaken)."""
        return bool(self._parked) or self.store.files_waited(ticket)

    def park(self, ticket: int, answer: Answer, synced: int) -> None:
        """Hold ``answer(synced, None)`` until the files below ``ticket`` are made (``waits``)."""
        assert self.waits(ticket), "parked with nothing to wait for: nothing would answer it soon"
        self._parked.append((ticket, answer, synced))

    def wait(self, ticket: int) -> asyncio.Future:
        """``park`` for a future: done once the files below ``ticket`` are made and dispatched."""
        fut = self._loop.create_future()
        self.park(ticket, lambda _synced, exc: settle(fut, exc), -1)
        return fut

    def ahead(self, cols) -> asyncio.Future | None:
        """``write_batch``'s hook for a batch that creates topics: the future its write awaits
        while the first files of its new queues are made off the loop, or None (none needed)."""
        seq = self.store.files_ahead(cols)
        if not seq or not self._open:
            return None
        fut = self._loop.create_future()
        self._writes.append((seq, fut))
        return fut

    def made(self) -> None:
        """New queues' first files were made (``chronoq.store.newqueues``): let the sends that
        waited for them be written, dispatch the batches that waited, and answer, in order, what
        waited for that dispatch."""
        if not self._open:  # closing: ``close`` answers everything after the store's flush
            return
        store = self.store
        store.files_made()
        taken = store.new_files.taken
        writes = self._writes
        while writes and writes[0][0] <= taken:
            settle(writes.pop(0)[1], None)
        self._dispatch()
        exc = self._refusal()
        parked = self._parked
        while parked and (exc is not None or not store.files_waited(parked[0][0])):
            _ticket, answer, synced = parked.pop(0)
            answer(synced if exc is None else -1, exc)

    def close(self, exc: BaseException | None) -> None:
        """After the store's flush (which dispatched every durable batch): answer everything
        parked, or refuse it with ``exc`` (the flush failed, or the node is fenced); refuse the
        sends not written yet, as the broker is stopping."""
        self._open = False
        writes, self._writes = self._writes, []
        for _seq, fut in writes:  # (not written: refused)
            settle(fut, errors.ClosedError("the broker is stopping"))
        parked, self._parked = self._parked, []
        for _ticket, answer, synced in parked:  # (durable already; the flush dispatched them)
            answer(synced if exc is None else -1, exc)
        assert not self._parked and not self._writes, "answered while closing: nothing may wait after close"
