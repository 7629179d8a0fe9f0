"""Bucket files made ahead, on a worker thread of their own (``FileMaker``, used by ``ScheduleFiles``).

Why: under the server a bulk load files delayed messages into hundreds of buckets that have no
file yet, and creating a file (``O_CREAT`` plus its header) cost the event loop ~0.9 ms each
while the file system was busy with writebacks: 512 new buckets held the loop ~450 ms. The loop
now asks for a bucket's file as soon as it journals the bucket at length 0 (``ScheduleFiles.write``,
``defer`` mode only), keeps that bucket's buffer meanwhile (like a bucket whose journal record is
not durable yet) and writes it once told the file is there (``made``, then
``BucketLife.files_made``). Not the committer's fsync thread: ``sync_side`` runs there before
the fsync is reported, so sends would wait behind the creates.

How a file is made, atomically: its header (``schedlog.encode_header``) is written to
``<name>.sch`` + ``MAKING_SUFFIX`` in the schedule directory (a name ``schedlog.parse_file_name``
ignores), that name is hard-linked to the bucket's name and unlinked. The bucket's name so
appears with its whole header or not at all; ``EEXIST`` means the loop made it first (its inline
create, still the fallback for a write that must happen now, or after this thread failed), and
its file is used as it is. After each batch the directory is fsynced, then the batch is
reported. Errors here are logged, never raised: the loop's own create in ``ScheduleFiles._fd``
remains, and reports its failures as before. Leftover temporary files (a crash mid-make) are
deleted at start (``remove_leftovers``, from ``ScheduleFiles.__init__``).

A start the loop deletes meanwhile (a finished bucket, ``ScheduleFiles.remove``) is ``forget``-ed
first: the link is made under the same lock, so it either lands before the loop's unlink (which
removes it) or not at all.

Crashes (``kill -9`` or power loss), by what is durable:

* The bucket's journal record (length 0) is not durable: nothing was appended to the file (the
  loop writes only after that fsync). A made file holds its header only, a valid empty bucket
  (start-up finds it, loads nothing from it and finishes it in its time). After a power loss
  before the next checkpoint's fsync of it, it may be 0 bytes (S0: an empty bucket too) or, on a
  file system that does not write data before the metadata naming it, hold a bad header. The
  first write to it cuts it to 0 bytes and writes the header again (``ScheduleFiles._fd``: the
  entries replayed into it are kept); a load that reads it before any write finds the bad
  header first (S1: moved aside and reported, though it held no entries).
* The record is durable: start-up ``roll_back`` cuts the file to 0 bytes, the state of today's
  crash right after the loop's own create (S0: a 0-byte file is an empty bucket, and the next
  write puts the header first). A header-only file journaled later (a checkpoint came between
  the make and the first write) is journaled at length 0 too (``ScheduleFiles._journal``), so
  the same cut applies.
* Entries appended to a made file are synced like any other by the checkpoint, which also
  fsyncs every file made since the last one and the directory (``take_unsynced``): its cursor
  never passes entries whose file name or header could still vanish.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Callable

from chronoq.core import fsutil
from chronoq.core.batchworker import BatchWorker
from chronoq.timer import schedlog

log = logging.getLogger("chronoq.timer")

MAKING_SUFFIX = ".new"  # after the bucket's own name: "<16 digits>.sch.new"
BATCH_MAX = 128  # files made per directory fsync (and per report to the loop)
QUEUE_MAX = 1 << 16  # starts waiting to be made; past it, the loop creates inline (the fallback)


def making_name(start: int) -> str:
    return schedlog.file_name(start) + MAKING_SUFFIX


def remove_leftovers(directory: str) -> int:
    """Delete temporary files a crash left mid-make (at start, before any maker runs). Returns
    how many."""
    removed = 0
    for name in os.listdir(directory):
        if name.endswith(schedlog.PENDING_SUFFIX + MAKING_SUFFIX):
            try:
                os.unlink(os.path.join(directory, name))
                removed += 1
            except FileNotFoundError:
                pass
    return removed


class FileMaker:
    """One thread making bucket files ahead (the module docstring). ``request``, ``forget``,
    ``take`` and ``close`` are the loop's; ``made()`` is called on the worker after each batch
    (it must be thread-safe: the runtime passes a ``call_soon_threadsafe``)."""

    def __init__(self, directory: str, width_ms: int, made: Callable[[], None]):
        self.dir = directory
        self.width = width_ms
        # Jobs: bucket starts. A batch is reported once its made files' directory is fsynced.
        self._worker = BatchWorker("chronoq-timer-newfiles", self._make_batch, made,
                                   batch_max=BATCH_MAX, queue_max=QUEUE_MAX)
        self._lock = threading.Lock()  # the sets and lists below: the worker and the loop share them
        self._wanted: set[int] = set()  # requested and not forgotten; made or not yet
        self._made: list[int] = []  # made (or found made), not yet taken by the loop
        self._unsynced: list[str] = []  # paths made since the last ``take_unsynced``
        self.files_made = 0  # (stats and tests)
        self.failures = 0

    # ----------------------------------------------------------------- the loop's side
    def request(self, starts: list[int]) -> list[int]:
        """Ask for these starts' files; returns those accepted (the rest: the queue is full or
        the maker is closed, the loop creates them itself)."""
        with self._lock:  # (held while submitting: the worker checks ``_wanted`` for a start only after this)
            fresh = [s for s in starts if s not in self._wanted]
            accepted = fresh[:self._worker.submit(fresh)] if fresh else []
            self._wanted.update(accepted)
        return accepted

    def forget(self, start: int) -> None:
        """The loop is about to delete ``start``'s file: never link it after this returns."""
        with self._lock:
            self._wanted.discard(start)

    def take(self) -> list[int]:
        """Starts whose files were made (or found made) since the last call."""
        with self._lock:
            made, self._made = self._made, []
        return made

    def take_unsynced(self) -> list[str]:
        """Paths made since the last call, for the checkpoint's sync (any thread)."""
        with self._lock:
            paths, self._unsynced = self._unsynced, []
        return paths

    def close(self) -> None:
        """Stop the thread and wait for it (the batch it is making is finished first)."""
        self._worker.close()

    # ----------------------------------------------------------------- the worker
    def _make_batch(self, batch: list[int]) -> bool:
        """On the worker: make a batch's files and fsync their directory; True (report it) when
        any is there now."""
        made = [start for start in batch if self._make(start)]
        if not made:
            return False
        try:
            fsutil.fsync_dir(self.dir)
        except Exception as exc:  # the checkpoint's sync fsyncs the directory again
            log.warning("fsync of %s after making bucket files failed: %s", self.dir, exc)
        with self._lock:
            self._made.extend(made)
            self.files_made += len(made)
        return True

    def _make(self, start: int) -> bool:
        """Make one file; True if it is there now (made here or by the loop)."""
        final = os.path.join(self.dir, schedlog.file_name(start))
        tmp = os.path.join(self.dir, making_name(start))
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                head = schedlog.encode_header(start, self.width)
                if os.write(fd, head) != len(head):  # (never short for 24 bytes on a regular file)
                    raise OSError(f"short write of a bucket file header to {tmp}")
            finally:
                os.close(fd)
            linked = False
            with self._lock:
                if start in self._wanted:
                    try:
                        os.link(tmp, final)
                        linked = True
                    except FileExistsError:
                        linked = False
                    self._wanted.discard(start)
                    wanted = True
                else:
                    wanted = False
            os.unlink(tmp)
        except Exception as exc:  # the loop's inline create is the fallback
            self.failures += 1
            log.warning("making schedule bucket file %s ahead failed (the timer creates it itself): %s", final, exc)
            with self._lock:
                self._wanted.discard(start)
            try:
                os.unlink(tmp)
            except OSError:
                pass
            # Reported all the same: the loop stops waiting and its own create takes over.
            return True
        if linked:
            with self._lock:
                self._unsynced.append(final)
        return wanted
