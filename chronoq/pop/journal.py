"""The POP log's shell: when its records are flushed, when consume offsets go to the broker, and
when the log is compacted into a new generation (the format is ``poplog.py``).

Records wait in the log's buffer at most ``flush_interval_ms`` after the first unflushed one
(``pending_since``); ``PopService.tick`` flushes them when due (``flush_deadline``), a revive or a
dead-letter move at once (``force``). A failed flush is retried one interval later. Consume
offsets that moved (``Inflight.dirty``) are handed to ``Broker.commit_offset`` (durable at its
next checkpoint). Past ``COMPACT_MIN_BYTES``, and ``COMPACT_RATIO`` times the live CKs' size,
the log is rewritten as a snapshot of the live CKs and the restart skip sets.
"""

from __future__ import annotations

import logging

from chronoq.broker.broker import Broker
from chronoq.core import errors
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

    def after(self, now: int) -> None:
        """After a request: start the flush clock for new records; commit moved offsets."""
        if self.pending_since is None and self.log.pending:
            self.pending_since = now
        if self.inflight.dirty:
            self.commit()

    def flush_deadline(self) -> int | None:
        """When the buffered records must be flushed; None when nothing waits."""
        if self.log.pending and self.pending_since is not None:
            return self.pending_since + self.flush_interval_ms
        return None

    def flush(self, now: int, *, force: bool) -> None:
        logf = self.log
        if not logf.pending:
            self.pending_since = None
            return
        if self.pending_since is None:
            self.pending_since = now
        if not force and now < self.pending_since + self.flush_interval_ms:
            return
        try:
            cks = logf.flush()
        except errors.StorageError as exc:
            log.warning("POP log flush failed (will retry): %s", exc.message)
            self.pending_since = now  # back off one interval
            return
        self.pending_since = None
        self.inflight.mark_durable(cks)

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

    def maybe_compact(self, now: int) -> None:
        logf = self.log
        if logf.size < COMPACT_MIN_BYTES:
            return
        live = [ck for ck in self.inflight.cks.values() if ck.logged]
        if logf.size < COMPACT_RATIO * (poplog.HEADER_SIZE + CK_BYTES_ESTIMATE * len(live)):
            return
        self.flush(now, force=True)
        if logf.pending:
            return
        new = poplog.PopLog.create(self.pop_dir, logf.generation + 1, live, now, skips(self.inflight))
        logf.close()
        self.log = self.inflight.sink = new
        self.inflight.set_generation(new.generation)
        log.info("POP log compacted to generation %d (%d checkpoints)", new.generation, len(live))
