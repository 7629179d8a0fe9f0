"""The life of a schedule bucket: created by an entry, buffered, written to its file, loaded
ahead into the wheel, finished and deleted (``BucketLife``, a part of ``TimerService``).

A bucket's states (``chronoq.timer.buckets``): UNLOADED (a file on disk and maybe a write buffer;
far-future ones keep nothing in memory once written), LOADING (its file read a few MB per tick,
then parsed ``load_batch`` entries per tick), LOADED (its pending messages in the timing wheel,
``WHEEL_FILL_PER_TICK`` per tick). A loaded bucket with nothing left is finished: its
cancellations go to a ``.done`` file (for recalls within the recall memory), its file is deleted.

A mixin, like ``chronoq.timer.absorb``: buckets, the wheel and its index, the write buffers and
the checkpoint's pending set are one piece of state that delivery, recall, checkpoints and
metrics all read and change; splitting that state between objects is the next step, not this one.
"""

from __future__ import annotations

import bisect
import heapq
import logging
import os
from typing import Callable

from chronoq.core import errors
from chronoq.timer import roll, schedlog
from chronoq.timer.buckets import LOADED, UNLOADED, Bucket, WriteBuffer
from chronoq.timer.bucketreader import BucketReader
from chronoq.timer.schedlog import CANCELLED, MOVED

log = logging.getLogger("chronoq.timer")

# Bucket-file writes are buffered (the commit log holds the truth until the cursor passes) and
# written a bounded number of files per call, so far-future traffic spread over thousands of
# buckets never stalls the thread for long. Past this many buffered bytes everything is written
# at once (memory bound first).
BUFFER_HARD_MAX = 64 * 1024 * 1024
# Bytes of a bucket file read per tick while loading it ahead (a memory copy of a few ms; a
# minute at 5,000 timers/s is ~70 MB, which read at once held due deliveries for 100s of ms).
LOAD_READ_BYTES = 4 * 1024 * 1024
WHEEL_FILL_PER_TICK = 4000  # loaded messages put into the wheel per tick (a few ms)


class BucketLife:
    """Mixed into ``TimerService``: uses its ``files``, ``opts``, ``width``, ``wheel``, ``damage``,
    ``buckets`` and the bucket bookkeeping it sets up (``_heap``, ``_in_heap``, ``_loading``,
    ``_readers``, ``_wheel_fill``, ``_loaded``, ``_loaded_horizon``, ``_index``, ``_done``,
    ``_buffered``, ``_buffered_starts``, ``roll_watch``), the checkpoint's ``_ckpt_pending``/``_ckpt_syncing``,
    the metrics' ``_horizon_cache``, and ``_wake``."""

    # Deferred schedule-file fsyncs (``attach_files_syncer``): the request, whether one is out,
    # and when to ask again after a failed one. Class defaults: set per service once attached.
    _files_request: Callable[[], None] | None = None
    _files_asked = False
    _files_retry_ms = 0

    def _path(self, start: int, suffix: str = schedlog.PENDING_SUFFIX) -> str:
        return self.files.path(start, suffix)

    def _push(self, start: int) -> None:
        if start not in self._in_heap:
            self._in_heap.add(start)
            heapq.heappush(self._heap, start)

    def _bucket(self, start: int) -> Bucket:
        b = self.buckets.get(start)
        if b is None:
            b = self.buckets[start] = Bucket(start, self._path(start))
            if start <= self._loaded_horizon:
                # Inside the loaded window every bucket with a file is LOADING/LOADED already (and
                # finished ones were deleted), so this one is new: nothing to read.
                b.load_empty()
                bisect.insort(self._loaded, start)
            else:
                if start not in self._in_heap:
                    # No file with anything pending (``_scan_dir`` pushed every one at start): its
                    # count starts at nothing and follows its entries (``Horizon.count_appended``).
                    self._horizon_cache[start] = (0, -1)
                self._push(start)
        return b

    def _append(self, start: int, entry: bytes, pending_target: int | None = None) -> None:
        """Append ``entry`` (one or more entries) to bucket ``start``. ``pending_target``: the
        ident of a tombstone among them whose target the caller proved pending in this bucket
        (``SendSide._file_tombstone``), so its kept count may follow (``Horizon.count_appended``)."""
        b = self._bucket(start)
        b.append(entry)
        if self.roll_watch:  # retention's roll is reading buckets in steps (``chronoq.timer.roll``)
            noted = self.roll_watch.get(start)
            if noted is not None:
                roll.note_appended(noted, entry)
        if self._horizon_cache:
            self.count_appended(start, entry, pending_target)
        try:
            self._after_append(b, entry)
        except BaseException:
            # The caller retries the whole record (``_absorb_durable``), appending these entries
            # again with the same proof: a kept count would follow them twice.
            self._horizon_cache.pop(start, None)
            raise

    def _after_append(self, b: Bucket, entry: bytes) -> None:
        self._buffered += len(entry)
        self._buffered_starts.add(b.start)
        if b.state == LOADED:
            added, removed, _n = b.parse(1 << 62, self.damage)
            self._to_wheel(b, added)
            for ident, due in removed:
                self.wheel.remove(ident, due)
                self._index.pop(ident, None)
        if self._buffered > BUFFER_HARD_MAX and not self._ckpt_syncing and not self._files_asked:
            try:
                self._flush_buffers()
            except errors.StorageError as exc:  # kept in memory; the next checkpoint retries
                log.warning("schedule log write failed: %s", exc)

    def _to_wheel(self, b: Bucket, entries) -> None:
        wake = False
        n = 0
        for ident, due in entries:
            self.wheel.add(ident, due)
            self._index[ident] = b
            n += 1
            if self._reported_deadline is None or due < self._reported_deadline:
                wake = True
        self._added_since_deadline += n
        if wake or self._lead_grew():
            self._wake()

    def _load_step(self, now: int) -> None:
        """Bring buckets into the near window ahead of time, parsing at most ``load_batch`` entries."""
        horizon = schedlog.bucket_start(now + self.opts.preload_ms, self.width)
        if horizon > self._loaded_horizon:
            while self._heap and self._heap[0] <= horizon:
                start = self._heap[0]
                try:
                    self._begin_load(start)
                except (OSError, errors.StorageError) as exc:  # stays on the heap; next tick retries
                    log.error("loading schedule bucket %d failed: %s", start, exc)
                    return
                heapq.heappop(self._heap)
                self._in_heap.discard(start)
            self._loaded_horizon = horizon
        budget = self.opts.load_batch
        while self._loading and budget > 0:
            b = self._loading[0]
            reader = self._readers.get(b.start)
            if reader is not None:  # its file is still being read, LOAD_READ_BYTES per tick
                if not reader.step(LOAD_READ_BYTES):
                    return
                data = reader.finish()  # then begin_load at once: no flush between (BucketReader)
                del self._readers[b.start]
                b.begin_load(data)
            _added, _removed, n = b.parse(budget, self.damage)
            budget -= max(n, 1)
            if b.parsed:
                self._loading.popleft()
                self._wheel_fill.append((b, b.finish_load(), 0))
        self._fill_wheel(WHEEL_FILL_PER_TICK)

    def _fill_wheel(self, budget: int) -> None:
        """Put loaded buckets' pending messages into the wheel, ``budget`` per tick (a loaded
        minute can hold 300,000). The bucket is LOADED meanwhile: a message recalled or claimed
        before its turn has left ``pending`` and is skipped here."""
        while self._wheel_fill and budget > 0:
            b, entries, pos = self._wheel_fill[0]
            end = min(len(entries), pos + budget)
            pending = b.pending
            self._to_wheel(b, [e for e in entries[pos:end] if e[0] in pending])
            budget -= end - pos
            if end >= len(entries):
                self._wheel_fill.popleft()
            else:
                self._wheel_fill[0] = (b, entries, end)

    def _finish_loading(self, b: Bucket) -> None:
        """Parse the rest of a LOADING bucket now (a recall needs its exact state)."""
        reader = self._readers.get(b.start)
        if reader is not None:
            data = reader.finish()
            del self._readers[b.start]
            b.begin_load(data)
        b.parse(1 << 62, self.damage)
        self._loading.remove(b)
        self._to_wheel(b, b.finish_load())

    def _begin_load(self, start: int) -> None:
        b = self.buckets.get(start)
        if b is None:
            if not os.path.exists(self._path(start)):
                return  # finished and deleted meanwhile
            b = self.buckets[start] = Bucket(start, self._path(start))
        elif b.state != UNLOADED or start in self._readers:
            return
        if os.path.exists(self._path(start)):
            # The file is read over the next ticks (``_load_step``); until then the bucket stays
            # UNLOADED (its new entries only buffered; a recall looks in its file and buffer).
            self._readers[start] = BucketReader(self.files, start)
        else:  # only buffered entries so far
            b.begin_load(b"")
        bisect.insort(self._loaded, start)
        self._loading.append(b)

    def _flush_buffers(self, here: bool = False) -> None:
        """Write every buffered entry to its bucket file (page cache; fsync is ``checkpoint``'s).
        ``here``: the journal's fsync on this thread too, so every buffer is written."""
        self._flush_starts(sorted(self._buffered_starts), here)
        assert self._buffered == 0 or not here

    def _flush_some(self, limit: int) -> None:
        """Write up to ``limit`` buffered buckets, those a pending checkpoint waits for first."""
        chosen = sorted(self._ckpt_pending)[:limit]
        if len(chosen) < limit:
            chosen += sorted(self._buffered_starts - self._ckpt_pending)[:limit - len(chosen)]
        self._flush_starts(chosen)

    def _flush_starts(self, starts: list[int], here: bool = False) -> None:
        """Write these buckets' buffers to their files (``ScheduleFiles.write`` journals first).
        Those whose journal record is not durable yet keep their buffers: the committer's thread
        fsyncs it and ``files_synced`` writes them."""
        items = [(start, self.buckets[start].buffer.chunks) for start in starts
                 if start in self.buckets and self.buckets[start].buffer]
        waiting = self.files.write(items, here=here)
        if waiting:
            self._ask_files_sync()
            held = set(waiting)
            starts = [start for start in starts if start not in held]
        for start in starts:
            self._ckpt_pending.discard(start)
            self._buffered_starts.discard(start)
            b = self.buckets.get(start)
            if b is None:
                continue
            self._buffered -= len(b.buffer)
            b.buffer = WriteBuffer()
            if b.state == UNLOADED and start not in self._readers:  # far future: keep nothing in memory
                del self.buckets[start]

    # ----------------------------------------------------------------- deferred fsyncs
    def attach_files_syncer(self, request: Callable[[], None] | None,
                            made: Callable[[], None] | None = None) -> None:
        """Have the schedule files' journal and ``.done`` fsyncs done elsewhere: ``request()``
        asks for ``self.files.sync_side`` to run (any thread: the committer's fsync thread, after a
        commit-log fsync) and ``files_synced`` to follow on this thread. None: fsync in place.

        ``made``: new bucket files are also made ahead on a worker thread of their own
        (``chronoq.timer.newfiles``), which calls ``made()`` after each batch; it must have
        ``files_made`` run on this thread (the server: ``call_soon_threadsafe``). Without it (or
        with ``request`` None, which stops that thread) this thread creates them."""
        self._files_request = request
        self.files.defer = request is not None
        self.files.attach_maker(made if request is not None else None)

    def _ask_files_sync(self) -> None:
        if self._files_request is not None and not self._files_asked:
            self._files_asked = True
            self._files_request()

    def files_synced(self) -> None:
        """After ``files.sync_side`` (on this thread): write the buffers whose journal record is
        durable now (bucket files whose ``.done`` is durable go at the next tick)."""
        self._files_asked = False
        ready, exc = self.files.take_synced()
        if exc is not None:
            log.warning("schedule journal or .done fsync failed (retried): %s", exc)
            self._files_retry_ms = self._now() + self.opts.retry_backoff_ms
        if ready and not self._ckpt_syncing and not self.closed:
            try:
                self._flush_starts(ready)
            except errors.StorageError as exc:  # kept in memory; a later flush retries
                log.warning("schedule log write failed: %s", exc)
        if exc is None and self.files.side_waiting:  # written after that sync began: ask again
            self._ask_files_sync()

    def files_made(self) -> None:
        """After the maker reported (on this thread): write the buffers of buckets whose file is
        made now and whose journal record is durable (the others follow ``files_synced``)."""
        if self.closed:
            return
        ready = self.files.take_made()
        if ready and not self._ckpt_syncing:  # (else they stay buffered: the next flushes write them)
            try:
                self._flush_starts(ready)
            except errors.StorageError as exc:  # kept in memory; a later flush retries
                log.warning("schedule log write failed: %s", exc)

    def _finish_buckets(self, now: int) -> None:
        # The files of finished buckets whose .done is durable now (a bucket made again meanwhile
        # kept its new entries in memory, ``ScheduleFiles.write``: they go to a new file).
        self.files.remove_finished()
        if self.files.side_waiting and now >= self._files_retry_ms:
            self._ask_files_sync()
        while self._loaded:
            b = self.buckets[self._loaded[0]]
            if not b.finishable(now, self.width):
                return
            try:
                self._finish(b)
            except (OSError, errors.StorageError) as exc:  # kept; a later tick tries again
                log.warning("deleting finished schedule bucket %d failed: %s", b.start, exc)
                return

    def _finish(self, b: Bucket) -> None:
        """Delete a bucket whose messages are all delivered or retired (keep its cancellations)."""
        done = b.done_entries()
        if b.start in self._done:
            # Finished before: a replay after a crash re-created the bucket from the records after
            # the cursor only, so keep what the earlier .done recorded (recalls before the cursor).
            done = self._done_entries_on_disk(b.start) + done
        durable = True
        if done:
            durable = self.files.write_done(b.start, done)
            if b.start not in self._done:
                bisect.insort(self._done, b.start)
        if durable:
            self.files.remove(b.start)
        else:  # deleted once its .done is durable (``_finish_buckets``)
            self._ask_files_sync()
        self._buffered -= len(b.buffer)
        self._buffered_starts.discard(b.start)
        self._ckpt_pending.discard(b.start)  # its entries are no longer needed
        self._horizon_cache.pop(b.start, None)
        del self.buckets[b.start]
        self._loaded.remove(b.start)
        self.buckets_finished += 1

    def _done_entries_on_disk(self, start: int) -> bytes:
        path = self._path(start, schedlog.DONE_SUFFIX)
        data = schedlog.read_file(path)
        if not data:
            return b""
        try:
            return b"".join(data[pos:pos + total] for pos, total, kind, _i, _d, _a in schedlog.scan(path, start, data)
                            if kind in (CANCELLED, MOVED))
        except schedlog.SchedLogError:  # a damaged .done: what it held cannot be trusted anyway
            return b""
