"""The first files of new consume queues, made on a worker thread of their own (``QueueFileMaker``).

Why: a send batch addressed to many topics that do not exist yet (the client sends up to 1,024
messages a call, and topics are auto-created) gives each a consume queue with no directory and
no file. Made in the dispatch on the event loop (``ConsumeQueue._fd``: two ``mkdir`` and an
``O_CREAT``, ~0.5-1 ms together while the file system is busy), 500 new queues held the loop
220-440 ms after the batch's fsync (bench/stalls.py --new-topics, docs/storage.md "Write path"),
and every other client's sends, receives and timers waited.

How: ``Store.write_columns`` asks for the first file of each queue of the batch that has none
(``ConsumeQueue.has_files``) as soon as the batch is appended, so the files are made while the
commit log is fsynced; the batch waits in the store's pending list, and the committer's dispatch
(``Store.dispatch(..., wait_files=True)``) stops before the first batch whose files are not
reported yet. The report (``made``, on the worker after each batch of files; the runtime passes
a ``call_soon_threadsafe``) has the committer take them (``Store.files_made``, ``QueueFileMaker.take``), dispatch, and
answer the calls that waited (``FileWaits.made``, chronoq.broker.filewaits). The files are made by the one
function the loop's own create uses (``consumequeue.create_file``): an existing file is opened as
it is, so a file made on both sides (a dispatch that does not wait: ``flush``, the embedded
paths) is the same file.

Only a queue's *first* file is made here: a new queue's entries start at its first file, so an
empty first file is an empty queue to recovery (``ConsumeQueue._load``). A later file made ahead
of the entries that fill the one before it would move the queue's end past them after a crash.

Crashes (``kill -9`` or power loss): a file made for a batch whose records never became durable
is an empty queue of a topic that ``topics.json`` names already (``TopicRegistry.create_planned``
saves it before the batch is written; a system topic's owner asks for its queues before it writes),
so recovery opens it as an empty queue: nothing to repair, nothing lost. Nothing is fsynced here:
the directory naming a made file is fsynced by the next checkpoint (``ConsumeQueue.first_file_made``
marks it), as after the loop's own create, and no checkpoint counts a queue's entries before they
are dispatched, which waits for the file. Errors are logged, never raised, and reported as done:
the dispatch then creates the file itself (``ConsumeQueue._fd``) and reports its failure as before
(a full disk: retried by the committer).

Bounds: a request is the new queues of one appended batch, and a queue is asked for once while it
has no file, so what waits here is at most the store's queues without a file (``max_topics`` times
the queues of each).
"""

from __future__ import annotations

import logging
import os
import threading
from collections import deque
from typing import Callable

from chronoq.core.batchworker import BatchWorker
from chronoq.store.consumequeue import create_file

log = logging.getLogger("chronoq.store")

BATCH_MAX = 256  # files made per report to the loop


class QueueFileMaker:
    """One thread making the first files of new consume queues (the module docstring), and the
    store's bookkeeping of the batches that wait for them. Every method but the worker's is the
    store's, on the thread that writes and dispatches (the event loop); ``made()`` is called on
    the worker after each batch of files (it must be thread-safe)."""

    def __init__(self, made: Callable[[], None]):
        # Jobs (seq, owner, directory, path); every batch is reported, failures too (``_make_batch``).
        self._worker = BatchWorker("chronoq-cq-newfiles", self._make_batch, made, batch_max=BATCH_MAX)
        self._lock = threading.Lock()  # _made, _done and the counters: the worker writes them
        self._made: list = []  # owners whose file is made, not yet taken by the loop
        self._asked = 0  # the last request's sequence number
        self._done = 0  # every request up to this one is made (or failed), counted on the worker
        # The loop's side: queues with no file not asked for yet, by key; (end offset, seq) of the
        # appended batches that wait for files, in log order; the seq reported done to the loop.
        self._unfiled: dict[tuple[str, int], object] = {}
        self._waiting: deque[tuple[int, int]] = deque()
        self._taken = 0
        self.files_made = 0  # (stats and tests)
        self.failures = 0
        # A hook for tests: ``before_make(path)`` on the worker before each file; it may block (a
        # gate) or raise OSError (a failed make).
        self.before_make: Callable[[str], None] | None = None

    # ----------------------------------------------------------------- the store's side
    def add_queue(self, key: tuple[str, int], cq) -> None:
        """``cq`` (a ``ConsumeQueue``) has no file: the first batch written to it asks for one."""
        self._unfiled[key] = cq

    def ask(self, batch: dict, end: int) -> None:
        """A batch appended up to ``end`` (``{queue key: (first offset, entries)}``): ask for the
        first file of each of its queues that has none; the batch then waits (``limit``) until
        they are reported. Cheap when no queue lacks a file (the send path calls it per batch)."""
        unfiled = self._unfiled
        if not unfiled:
            return
        files = []
        for key, (first, _entries) in batch.items():
            cq = unfiled.pop(key, None)
            if cq is not None and not cq.has_files:
                files.append((cq, cq.directory, cq.path_for(first)))
        if files:
            seq = self._request(files)
            if seq:
                assert not self._waiting or self._waiting[-1] < (end, seq), "batches wait in log order"
                self._waiting.append((end, seq))

    def ask_ahead(self, queues: list[tuple[tuple[str, int], object]]) -> int:
        """Before a batch is written (``Store.files_ahead``): ask for the first file of each of
        these ``(key, ConsumeQueue)`` that has none and was not asked for yet. Returns the
        sequence number ``taken`` reaches once they are made (0: none asked)."""
        unfiled = self._unfiled
        files = [(cq, cq.directory, cq.path_for(cq.next_offset)) for key, cq in queues
                 if unfiled.pop(key, None) is not None and not cq.has_files]
        return self._request(files) if files else 0

    @property
    def taken(self) -> int:
        """Every request up to this sequence number is made and taken (``take``)."""
        return self._taken

    def limit(self) -> int | None:
        """The highest log offset a dispatch that waits for files may reach now (None: any)."""
        waiting = self._waiting
        while waiting and waiting[0][1] <= self._taken:
            waiting.popleft()
        return waiting[0][0] - 1 if waiting else None

    def waits_below(self, ticket: int) -> bool:
        """A batch ending at or below ``ticket`` waits for its files."""
        cap = self.limit()
        return cap is not None and cap < ticket

    def dispatched(self, upto: int) -> None:
        """Batches up to ``upto`` are dispatched (a dispatch that does not wait: their files made
        by it, ``ConsumeQueue._fd``): they wait no more."""
        waiting = self._waiting
        while waiting and waiting[0][0] <= upto:
            waiting.popleft()

    def take(self) -> int:
        """On the loop, after a report: mark the queues whose file was made (their directory is
        fsynced by the next checkpoint) and let the batches waiting for them go. Returns how
        many were made."""
        with self._lock:
            made, self._made = self._made, []
            self._taken = self._done
        for cq in made:
            cq.first_file_made()
        return len(made)

    def busy(self) -> bool:
        """A requested file may still be made or not taken yet (a queue is dropped only once this
        is False: a file made after the drop would bring its topic back)."""
        return self._taken < self._asked

    def close(self) -> None:
        """Stop the thread and wait for it (the batch of files it is making is finished first);
        what was not made is the dispatch's to create. Nothing waits after this."""
        self._worker.close()
        self.take()
        self._taken = self._done = self._asked
        self._waiting.clear()
        self._unfiled.clear()

    def _request(self, files: list[tuple[object, str, str]]) -> int:
        """Queue ``(owner, directory, path)`` files for the worker; returns the sequence number
        reported once they are all made (0: the maker is closed, nothing to wait for)."""
        first = self._asked + 1
        jobs = [(first + i, owner, directory, path) for i, (owner, directory, path) in enumerate(files)]
        if self._worker.submit(jobs) < len(jobs):  # (no queue_max: all, or none once closed)
            return 0
        self._asked = jobs[-1][0]
        return self._asked

    # ----------------------------------------------------------------- the worker
    def _make_batch(self, batch: list[tuple[int, object, str, str]]) -> bool:
        """On the worker: make a batch's files; failed ones are reported done all the same (the
        dispatch's own create is the fallback)."""
        made = []
        for _seq, owner, directory, path in batch:
            try:
                if self.before_make is not None:
                    self.before_make(path)
                os.close(create_file(directory, path))
                made.append(owner)
            except OSError as exc:  # the dispatch's own create is the fallback
                self.failures += 1
                log.warning("making consume-queue file %s ahead failed (the dispatch creates it): %s", path, exc)
        with self._lock:
            self._made.extend(made)
            self._done = batch[-1][0]
            self.files_made += len(made)
        return True
