"""The POP log's shell: when its records are flushed, when consume offsets go to the broker, and
when the log is compacted into a new generation (the format is ``poplog.py``).

Records wait in the log's buffer at most ``flush_interval_ms`` after the first unflushed one
(``pending_since``); ``PopService.tick`` flushes them when due (``flush_deadline``), a revive or a
dead-letter move at once (``force``). A flush seals the buffer and has it synced: by the runtime's
committer thread when ``request_sync`` is set (``attach_syncer``: the thread fsyncs the commit log,
then this log, and ``synced`` runs back on the loop), else at once on this thread (the embedded
path). At most one such request is out at a time; records sealed meanwhile go with the next. A
failed sync is retried one interval later. Consume offsets that moved (``Inflight.dirty``) are
handed to ``Broker.commit_offset`` (durable at its next checkpoint). Past ``COMPACT_MIN_BYTES``,
and ``COMPACT_RATIO`` times the live CKs' size, the log is rewritten as a snapshot of the live CKs
and the restart skip sets (encoded on the loop, the file made on the committer's thread).
"""

from __future__ import annotations

import logging
from typing import Callable

from chronoq.broker.broker import Broker
from chronoq.pop import poplog
from chronoq.pop.inflight import Inflight

log = logging.getLogger("chronoq.pop")

COMPACT_MIN_BYTES = 16 << 20  # compact the POP log past this size ...
COMPACT_RATIO = 4             # ... when it is this many times the live CKs' size
CK_BYTES_ESTIMATE = 128


def skips(inflight: Inflight) -> list[tuple[str, str, int, set[int]]]:
    """The restart skip sets, carried into every snapshot (finished recovered CKs are not
    in it, but their offsets must still not be read again)."""
    return [(qs.group, qs.topic, qs.queue_id, qs.skip) for qs in inflight.queues.values() if qs.skip]


class PopJournal:
    def __init__(self, broker: Broker, inflight: Inflight, poplog_: poplog.PopLog, pop_dir: str,
                 flush_interval_ms: int) -> None:
        self.broker = broker
        self.inflight = inflight
        self.log = poplog_
        self.pop_dir = pop_dir
        self.flush_interval_ms = flush_interval_ms
        self.pending_since: int | None = None   # first unflushed POP-log record
        self.request_sync: Callable[[], None] | None = None  # None: sync on this thread
        self._syncing = False                    # a request is out, ``synced`` not called yet
        self._retry_at: int | None = None        # after a failed sync

    def after(self, now: int) -> None:
        """After a request: start the flush clock for new records; commit moved offsets."""
        if self.pending_since is None and self.log.pending:
            self.pending_since = now
        if self.inflight.dirty:
            self.commit()

    def flush_deadline(self) -> int | None:
        """When the buffered records must be flushed (or a failed sync retried); None: nothing waits."""
        best = self._retry_at
        if self.log.pending and self.pending_since is not None:
            due = self.pending_since + self.flush_interval_ms
            best = due if best is None else min(best, due)
        return best

    def flush(self, now: int, *, force: bool) -> None:
        logf = self.log
        if logf.pending:
            if self.pending_since is None:
                self.pending_since = now
            if force or now >= self.pending_since + self.flush_interval_ms:
                logf.seal()
                self.pending_since = None
        else:
            self.pending_since = None
        if logf.queued and (force or self._retry_at is None or now >= self._retry_at):
            self._retry_at = None
            self._sync()

    def _sync(self) -> None:
        if self.request_sync is None:
            self.log.sync()
            self.synced()
        elif not self._syncing:
            self._syncing = True
            self.request_sync()

    def sync_current(self) -> None:
        """Sync the current log's sealed records (the syncing thread calls this)."""
        self.log.sync()

    def synced(self) -> None:
        """After a sync (on the loop): mark the CKs durable, commit offsets; retry a failure one
        interval later; ask again for records sealed meanwhile."""
        self._syncing = False
        logf = self.log
        cks, exc = logf.take_synced()
        if cks:
            self.inflight.mark_durable(cks)
        if logf.made and logf.generation > self.inflight.generation:  # a compaction's file is in place
            self.inflight.set_generation(logf.generation)
            log.debug("POP log compacted to generation %d", logf.generation)  # (each topic or group delete compacts)
        if exc is not None:
            log.warning("POP log flush failed (will retry): %s", getattr(exc, "message", exc))
            self._retry_at = self.broker.clock.wall_ms() + self.flush_interval_ms
        elif self.log.queued:
            self._sync()
        if self.inflight.dirty:
            self.commit()

    def close(self, now: int) -> None:
        """Seal and sync what is left on this thread (after a sync in progress), then close."""
        self.request_sync = None
        self.flush(now, force=True)
        self.log.sync()
        self.synced()
        self.commit()
        self.log.close()

    def commit(self) -> None:
        """Hand every moved consume offset to the broker (durable at its next checkpoint)."""
        dirty = self.inflight.dirty
        commit = self.broker.commit_offset
        for qs in dirty:
            offset = qs.consume_offset()
            if offset > qs.committed:
                commit(qs.group, qs.topic, qs.queue_id, offset)
                qs.committed = offset
        dirty.clear()

    def maybe_compact(self, now: int, *, force: bool = False) -> None:
        """Past the size limits (``force``: now, an operator dropped state), start a new
        generation: its snapshot encoded here, its file made by the next sync (the committer's
        thread; ``PopLog.prepare``), which first syncs the old file's last records. New records go
        to the new log at once. CK ids move to the new generation only once its file is in place
        (``synced``): a crash before leaves the old generation newest, and the restart's
        generation, one past it, must not meet ids minted in this process (I4)."""
        logf = self.log
        if (logf.size < COMPACT_MIN_BYTES and not force) or not logf.made:
            return
        live = [ck for ck in self.inflight.cks.values() if ck.logged]
        if logf.size < COMPACT_RATIO * (poplog.HEADER_SIZE + CK_BYTES_ESTIMATE * len(live)) and not force:
            return
        logf.seal()
        new = poplog.PopLog.prepare(self.pop_dir, logf.generation + 1, live, now, skips(self.inflight), prior=logf)
        self.log = self.inflight.sink = new
        self.flush(now, force=True)  # have it made now (it holds the old file's last records)
