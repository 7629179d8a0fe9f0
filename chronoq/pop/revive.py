"""Revive: CKs whose invisible time ended give their unsettled entries back. A concurrent group's
entry is copied to its retry topic (``%RETRY%{group}_{topic}``, with its back-off) or, at
``max_attempts``, to ``%DLQ%{group}``; the copies are fsynced before the CK is dropped, then the
CK's DONE/ACK records are made durable at once (``PopJournal.flush(force=True)``). A FIFO
group's entries are redelivered in place (same queue and offset, attempt + 1). A storage error
postpones the whole batch by ``REVIVE_RETRY_MS``. See the crash guarantee in ``service.py``.
"""

from __future__ import annotations

import logging

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


class Reviver:
    def __init__(self, broker: Broker, clock: Clock, groups: GroupBook, inflight: Inflight, counters: PopCounters,
                 journal: PopJournal) -> None:
        self.broker = broker
        self.clock = clock
        self.groups = groups
        self.inflight = inflight
        self.counters = counters
        self.journal = journal

    def revive(self, due: list[Checkpoint], now: int) -> int:
        """Retry or dead-letter the unsettled entries of ``due`` (fsynced), then drop the CKs."""
        outgoing: list[OutgoingMessage] = []
        plan: list[tuple[Checkpoint, list[int], list[int]]] = []  # (ck, settle now, FIFO again)
        tally: dict[str, list[int]] = {}  # group -> [revived, retried, dead-lettered] (chronoq.server.metrics)
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
        if outgoing and not self.write_durably(outgoing):
            for ck in due:
                self.inflight.postpone(ck, now + REVIVE_RETRY_MS)
            return 0
        for group, (revived, retried, dead_lettered) in tally.items():
            self.counters.revive_outcome(group, revived, retried, dead_lettered)
        inflight = self.inflight
        handled = 0
        sealed = False
        for ck, drop, again in plan:
            handled += len(drop) + len(again)
            if drop:
                sealed = True
                inflight.seal(ck)
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

    def write_durably(self, outgoing: list[OutgoingMessage]) -> bool:
        """Write retry/DLQ copies and fsync. False on a storage error (retry later)."""
        try:
            try:
                self.broker.write(outgoing, system=True)
            except errors.ClientError:
                # One message the broker now refuses (e.g. a lowered body limit) must not stall
                # the others: write one by one and drop only the refused ones.
                for msg in outgoing:
                    try:
                        self.broker.write([msg], system=True)
                    except errors.ClientError as exc:
                        log.error("revive: dropping a message to %s the broker refuses: %s", msg.topic, exc.message)
            self.broker.flush()
        except errors.ChronoqError as exc:
            log.warning("revive postponed: %s", exc.message)
            return False
        return True
