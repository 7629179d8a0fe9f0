"""Revive: CKs whose invisible time ended give their unsettled entries back. A concurrent group's
entry is copied to its retry topic (``%RETRY%{group}_{topic}``, with its back-off) or, at
``max_attempts``, to ``%DLQ%{group}``; a FIFO group's entries are redelivered in place (same queue
and offset, attempt + 1), and one that reached ``max_attempts`` is dead-lettered.

In three steps, so that the commit log's fsync is the shell's (the runtime hands it to the
committer's thread; the embedded path calls ``Broker.flush``):

``plan``      (the core, from ``PopService.tick`` or ``forward_to_dlq``) builds the copies and a
              ``Revival``; its CKs' handles are stale from then on (``Inflight.reviving``).
``write``     (the shell) writes the copies (page cache); the shell then waits for their fsync.
``complete``  once they are durable: drop/settle/expire the CKs, then make their DONE/ACK records
              durable at once (``PopJournal.flush(force=True)``), so a crash cannot revive them a
              second time (only a crash between the two fsyncs writes a copy twice).
              ``fail`` instead (a storage error): the CKs are postponed by ``REVIVE_RETRY_MS``.

See the crash guarantee in ``service.py``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from chronoq.broker.broker import Broker, OutgoingMessage
from chronoq.core import errors
from chronoq.core.clock import Clock
from chronoq.pop import copies
from chronoq.pop.counters import PopCounters
from chronoq.pop.groups import GroupBook
from chronoq.pop.inflight import Checkpoint, Inflight
from chronoq.pop.journal import PopJournal

log = logging.getLogger("chronoq.pop")

REVIVE_RETRY_MS = 1_000       # a revive that hit a storage error is retried this much later


@dataclass(slots=True, eq=False)
class Revival:
    """CKs to finish once their copies are durable: (ck, entries to settle, FIFO entries to
    redeliver in place); ``tally``: group -> [revived, retried, dead-lettered] (metrics)."""
    plan: list[tuple[Checkpoint, list[int], list[int]]]
    copies: list[OutgoingMessage]
    tally: dict[str, list[int]]
    now: int
    seal_only: bool = False  # a client's FIFO forward: settle the dropped entries, keep the CK


class Reviver:
    def __init__(self, broker: Broker, clock: Clock, groups: GroupBook, inflight: Inflight, counters: PopCounters,
                 journal: PopJournal) -> None:
        self.broker = broker
        self.clock = clock
        self.groups = groups
        self.inflight = inflight
        self.counters = counters
        self.journal = journal
        self.pending: list[Revival] = []  # copies written or to write, not yet reported durable

    def plan(self, due: list[Checkpoint], now: int) -> Revival:
        """The copies for the unsettled entries of ``due``; with copies, the CKs wait (their
        handles stale) for ``complete`` or ``fail``."""
        outgoing: list[OutgoingMessage] = []
        plan: list[tuple[Checkpoint, list[int], list[int]]] = []
        tally: dict[str, list[int]] = {}
        for ck in due:
            gcfg = self.groups.get(ck.group)
            drop, again = [], []
            counts = tally.setdefault(ck.group, [0, 0, 0])
            for i in ck.unsettled():
                attempt = ck.attempts[i]
                if ck.fifo and attempt < gcfg.max_attempts:
                    again.append(i)
                    continue
                m = copies.read_one(self.broker, ck.queue.topic, ck.queue.queue_id, ck.offsets[i])
                if m is None:
                    log.warning("revive: %s/%d@%d is no longer in the store", ck.queue.topic,
                                ck.queue.queue_id, ck.offsets[i])
                elif attempt >= gcfg.max_attempts:
                    outgoing.append(copies.dlq_message(self.broker, self.clock, ck, m))
                    counts[2] += 1
                else:
                    outgoing.append(copies.retry_message(self.broker, ck, m, attempt, gcfg, now))
                    counts[1] += 1
                drop.append(i)
            counts[0] += len(drop) + len(again)
            plan.append((ck, drop, again))
        revival = Revival(plan, outgoing, tally, now)
        if outgoing:
            self.inflight.reviving.update(ck.ck_id for ck in due)
            self.pending.append(revival)
        return revival

    def plan_forward(self, ck: Checkpoint, index: int) -> Revival:
        """A client's FIFO forward of entry ``index``: its dead-letter copy; once durable,
        ``complete`` settles that entry (the CK's other entries stay)."""
        m = copies.read_one(self.broker, ck.queue.topic, ck.queue.queue_id, ck.offsets[index])
        outgoing, tally = [], {}
        if m is not None:
            outgoing.append(copies.dlq_message(self.broker, self.clock, ck, m))
            tally[ck.group] = [0, 0, 1]  # forwarded by the client, not revived
        else:
            log.warning("forward to DLQ: %s/%d@%d is no longer in the store", ck.queue.topic,
                        ck.queue.queue_id, ck.offsets[index])
        revival = Revival([(ck, [index], [])], outgoing, tally, self.clock.wall_ms(), seal_only=True)
        self.inflight.reviving.add(ck.ck_id)
        self.pending.append(revival)
        return revival

    def durable(self, revival: Revival, exc: BaseException | None) -> int:
        """The shell reports the copies durable (``exc``: their fsync failed): ``complete`` or
        ``fail``. Returns how many entries were handed back; 0 for one reported already."""
        if revival not in self.pending:
            return 0
        self.pending.remove(revival)
        if exc is not None:
            self.fail(revival, exc)
            return 0
        return self.complete(revival)

    def write(self, revival: Revival) -> bool:
        """Write the copies (not fsynced). False on a storage error: the revive is postponed."""
        try:
            try:
                self.broker.write(revival.copies, system=True)
            except errors.ClientError:
                # One message the broker now refuses (e.g. a lowered body limit) must not stall
                # the others: write one by one and drop only the refused ones.
                for msg in revival.copies:
                    try:
                        self.broker.write([msg], system=True)
                    except errors.ClientError as exc:
                        log.error("revive: dropping a message to %s the broker refuses: %s", msg.topic, exc.message)
        except errors.ChronoqError as exc:
            self.durable(revival, exc)
            return False
        return True

    def fail(self, revival: Revival, exc: BaseException) -> None:
        """The copies could not be written or fsynced: try the CKs again later (a copy written
        and not fsynced may be written twice: at least once)."""
        log.warning("revive postponed: %s", getattr(exc, "message", exc))
        retry_at = self.clock.wall_ms() + REVIVE_RETRY_MS
        for ck, _drop, _again in revival.plan:
            self.inflight.reviving.discard(ck.ck_id)
            if ck.live and not ck.expired and not revival.seal_only:  # (a forward: the client is told)
                self.inflight.postpone(ck, retry_at)

    def complete(self, revival: Revival) -> int:
        """The copies are durable (or there were none): drop, settle or expire the CKs; returns
        how many entries were revived."""
        for group, (revived, retried, dead_lettered) in revival.tally.items():
            self.counters.revive_outcome(group, revived, retried, dead_lettered)
        inflight = self.inflight
        handled = 0
        sealed = False
        now = revival.now
        for ck, drop, again in revival.plan:
            inflight.reviving.discard(ck.ck_id)
            assert ck.live, "a CK being revived was settled meanwhile"
            handled += len(drop) + len(again)
            if drop:
                sealed = True
                inflight.seal(ck)
            if revival.seal_only:
                for i in drop:
                    inflight.settle(ck, i)
                continue
            if not ck.fifo:
                inflight.finish(ck)
                continue
            for i in drop:
                inflight.settle(ck, i)
            if ck.live:
                inflight.expire(ck)
        if sealed:
            # The copies are durable; make the DONE/ACK records durable too, at once, so a crash
            # cannot revive these CKs a second time (only a crash between the two fsyncs can).
            self.journal.flush(now, force=True)
        return handled
