"""The timer's checkpoint and retention floor (``Checkpoints``, a part of ``TimerService``), and
the one module that reads and writes ``timer/checkpoint.json``.

``checkpoint.json`` (JSON, written atomically by ``fsutil.write_json``)::

    {"version": 1,            # CHECKPOINT_VERSION; another version is ignored (full replay)
     "cursor": <int>,         # commit-log offset below which everything is absorbed and durable
     "bucket_ms": <int>,      # the bucket width the schedule files were named with
     "clean": <bool>,         # written by a clean close
     "generation": <int>,     # the schedule journal's generation (chronoq.timer.schedfiles)
     "levels": {"<level>": {"offset": <int>,   # every queue offset below it delivered or skipped
                            "cancelled": {"<queue offset>": [<CANCELLED or MOVED>, <due ms>]}}}}

A checkpoint writes every buffered entry below its cursor (incrementally, a bounded number of
files per ``maintenance``), fsyncs the schedule files and the directory, writes the JSON, then
advances the cursor (the service docstring's "Durability and restart"). The cursor and every
level lane's head are the store's retention guard.

A mixin, like ``chronoq.timer.absorb``: the cursor, the write buffers and the level lanes'
offsets it saves are the live state of the other parts.
"""

from __future__ import annotations

import os

from chronoq.core import errors, fsutil
from chronoq.core.delay_levels import DELAY_TOPIC
from chronoq.core.jobs import Job
from chronoq.timer import schedlog
from chronoq.timer.lanes import WRITTEN

CHECKPOINT_FILE = "checkpoint.json"
CHECKPOINT_VERSION = 1
FLUSH_FILES_PER_MAINTENANCE = 512


def read_document(path: str, notes: list[str]) -> dict | None:
    """The checkpoint at ``path``, or None (none, unreadable or of another version: the caller
    replays the whole commit log; the reason goes to ``notes``)."""
    try:
        cp = fsutil.read_json(path)
    except ValueError as exc:
        notes.append(f"timer checkpoint unreadable ({exc}); replaying the whole commit log")
        return None
    if cp is not None and (not isinstance(cp, dict) or cp.get("version") != CHECKPOINT_VERSION):
        notes.append("timer checkpoint has an unknown version; replaying the whole commit log")
        return None
    return cp


def document(cursor: int, bucket_ms: int, clean: bool, generation: int, level_lanes) -> dict:
    """The checkpoint naming ``cursor`` and each level lane's offset and remembered recalls."""
    levels = {str(lane.level): {"offset": lane.offset,
                                "cancelled": {str(q): [k, d] for q, (k, d) in lane.cancelled.items()}}
              for lane in level_lanes}
    return {"version": CHECKPOINT_VERSION, "cursor": cursor, "bucket_ms": bucket_ms, "clean": clean,
            "generation": generation, "levels": levels}


class Checkpoints:
    """Mixed into ``TimerService``: uses its ``store``, ``opts``, ``dir``, ``files``, ``sched_dir``,
    ``width``, ``level_lanes``, ``_unabsorbed``, ``_done``, ``_buffered_starts``, ``notes``,
    ``_now``, ``_lanes``, ``_absorb_durable`` and the bucket writers (``_flush_buffers``,
    ``_flush_starts``, ``_flush_some``); owns ``cursor`` and the ``_ckpt_*`` fields."""

    # ================================================================= start-up: read the checkpoint
    def _read_checkpoint(self) -> None:
        cp = read_document(os.path.join(self.dir, CHECKPOINT_FILE), self.notes)
        pending, _done = schedlog.list_dir(self.sched_dir)
        if cp is not None and cp.get("bucket_ms") != self.width and pending:
            raise errors.ClientError(
                f"timer_bucket_ms is {self.width} but the schedule log in {self.sched_dir} was written with "
                f"{cp.get('bucket_ms')}; set it back (pending timers are filed by the old width)")
        log_min = self.store.log.min_offset
        if cp is None:
            self.cursor = log_min
            if pending:
                self.notes.append("no timer checkpoint: schedule files are re-checked against the whole log")
        else:
            self.cursor = int(cp["cursor"])
            self.files.generation = int(cp.get("generation", 0))
            for lane in self.level_lanes:
                state = cp.get("levels", {}).get(str(lane.level), {})
                lane.offset = lane.scan_offset = int(state.get("offset", 0))
                lane.cancelled = {int(q): (int(k), int(d)) for q, (k, d) in state.get("cancelled", {}).items()}
        if self.cursor < log_min:
            self.notes.append(f"commit log before {log_min} was deleted before the timer absorbed it "
                              f"(cursor {self.cursor}); delayed messages there are lost")
            self.cursor = log_min
        if self.cursor > self.store.log.written:
            self.notes.append(f"timer cursor {self.cursor} is past the recovered log end {self.store.log.written}")
            self.cursor = self.store.log.written
        if cp is not None:
            cut, journaled = self.files.roll_back()
            if cut:
                self.notes.append(f"rolled back {cut} bytes appended to {journaled} schedule files after the "
                                  f"last timer checkpoint (replayed from the commit log)")
        else:
            for start in pending:
                self.files.validate(start)

    # ================================================================= checkpoints, retention
    def retention_floor(self) -> int:
        """Lowest commit offset the timer still needs: its cursor and every level lane's head."""
        floor = self.cursor
        for lane in self.level_lanes:
            lo, hi = self.store.bounds(DELAY_TOPIC, lane.queue_id)
            off = max(lane.offset, lo)
            if off < hi:
                entry = self.store.entries(DELAY_TOPIC, lane.queue_id, off, 1)
                if entry:
                    floor = min(floor, entry[0][0])
        return floor

    def _covered(self) -> int:
        """The cursor a checkpoint may claim once every buffered entry is durable."""
        cursor = min(self.store.dispatched, self.store.log.synced)
        if self.following:  # a replica's: what ``follow`` has absorbed (the store dispatches on its own)
            cursor = min(cursor, self.replayed)
        if self._unabsorbed:
            cursor = min(cursor, self._unabsorbed[0][0])
        for lane in self._lanes():  # copies written but not yet completed are not covered yet
            for d in lane.pending:
                if d.state == WRITTEN:
                    cursor = min(cursor, d.commit_offset)
        return cursor

    def checkpoint(self, clean: bool = False) -> None:
        """Make every absorbed entry durable, then advance the cursor (see the module docstring)."""
        assert not self._ckpt_syncing, "a checkpoint job is still running"
        self._absorb_durable()
        target = self._covered()
        if self.files.finishing:  # finished buckets' files go first (``ScheduleFiles.finishing``;
            self.files.sync_side()  # a bucket made again meanwhile is written to a new file)
            _ready, exc = self.files.take_synced()
            if exc is not None:
                raise exc
            self.files.remove_finished()
            if self.files.finishing:  # (an unlink failed, logged): retried by the next checkpoint
                raise errors.StorageError(f"a finished schedule bucket's file in {self.sched_dir} could not be deleted")
        self._flush_buffers(here=True)  # (the journal's fsync in place: this call blocks anyway)
        self._checkpoint_job(target, clean).run_here()

    def _checkpoint_step(self, now: int) -> Job | None:
        """An incremental checkpoint: snapshot the cursor and the buckets holding entries below
        it, write those a bounded number per call, then complete (the returned job). Entries
        appended meanwhile may be written along; that is harmless, the cursor only claims what
        the snapshot covered."""
        if self._ckpt_target is None:
            if now - self._last_checkpoint_ms < self.opts.checkpoint_interval_ms:
                return None
            self._absorb_durable()
            self._ckpt_target = self._covered()
            self._ckpt_pending = set(self._buffered_starts)
        if self._ckpt_pending:
            self._flush_starts(sorted(self._ckpt_pending)[:FLUSH_FILES_PER_MAINTENANCE])
        # Not while a finished bucket's file awaits deletion (``ScheduleFiles.finishing``): it
        # lacks the entries buffered at its finish (DISPATCHED, CANCELLED), and a kill -9 after
        # this checkpoint would load it again with a cursor past the records that made them
        # (delivered twice, a replaced message delivered). No bucket finishes while the job runs.
        if not self._ckpt_pending and not self.files.finishing:
            return self._checkpoint_job(self._ckpt_target, False)
        return None

    def _checkpoint_job(self, target: int, clean: bool) -> Job:
        """Complete a checkpoint: fsync the schedule files and write ``checkpoint.json`` (``run``,
        any thread), then reset the journal and advance the cursor (``finish``).

        From here until ``finish`` no bucket file is written, created or deleted
        (``_ckpt_syncing``; buffers keep filling in memory): the sync must cover every write of
        this cycle, and a file written after the checkpoint must get a journal record of the
        new generation. The cursor moves only once the file naming it is durable.
        """
        self._ckpt_syncing = True
        cursor = max(self.cursor, target)
        generation = self.files.generation + 1
        doc = document(cursor, self.width, clean, generation, self.level_lanes)
        path = os.path.join(self.dir, CHECKPOINT_FILE)

        def run() -> None:
            self.files.sync()
            fsutil.write_json(path, doc)

        def finish(exc: BaseException | None) -> None:
            self._ckpt_syncing = False
            if exc is not None:  # target and buckets stay: the next maintenance completes it
                return
            self.cursor = cursor
            self.files.new_generation(generation)
            self._ckpt_target = None
            self._ckpt_pending.clear()
            self._last_checkpoint_ms = self._now()

        return Job("timer checkpoint", run, finish)

    def maintenance(self, now_ms: int | None = None) -> None:
        """Periodic work (the broker's ``maintenance``): checkpoint when due, forget old recalls."""
        job = self.maintenance_job(now_ms)
        if job is not None:
            job.run_here()

    def maintenance_job(self, now_ms: int | None = None, build_keys: bool = True) -> Job | None:
        """``maintenance`` without blocking: the work that needs no fsync is done here; the
        completion of a due checkpoint (fsyncs, ``checkpoint.json``) is returned as a ``Job``
        to run on a worker thread and finish back here. Call again only after it finished.
        ``build_keys``: a step of the key index's build too (the server runs the build in
        slices of its own instead)."""
        assert not self._ckpt_syncing, "the previous checkpoint job has not finished"
        now = self._now(now_ms)
        self._absorb_durable()
        memory = self.opts.recall_memory_ms
        while self._done and self._done[0] + self.width + memory < now:
            self.files.remove_done(self._done.pop(0))
        for lane in self.level_lanes:
            stale = [q for q, (_k, due) in lane.cancelled.items() if q < lane.offset and due + memory < now]
            for q in stale:
                del lane.cancelled[q]
        if build_keys and self._keys_todo:  # the key index's build, begun by a first keyed call (chronoq.timer.keyed)
            self.keys_step()
        job = self._checkpoint_step(now)
        if job is None and self._ckpt_target is None and self._buffered_starts:
            self._flush_some(FLUSH_FILES_PER_MAINTENANCE)
        return job
