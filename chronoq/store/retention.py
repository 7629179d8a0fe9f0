"""Retention's roll-forward in bounded steps: what the keepers still need from a range of the log
about to be deleted is written at the head a batch at a time, the caller free between steps.

Why steps: the keepers' work grows with the range (``chronoq.timer.roll`` scans it for the
timer's records and reads each bucket holding one), and in the server it runs on the event loop
with every call and every timer release. At once, 100,000 pending timers in 1 MiB segments held
the loop 1.2-1.8 s per retention pass (bench/stalls.py --retention); a 1 GiB segment holds far more.

A keeper (``Store.add_retention_keeper``) is ``keeper(lo, hi)`` returning an iterator of
*batches*: lists of ``(offset, record)``, each record to append before ``[lo, hi)`` goes, with the
offset of the record it keeps; a record None keeps its offset's segment should the pass fall
back (below) and writes nothing. An empty batch is a pause point (a slice of a long scan). Each
batch is written whole in the step that produced it (``Store.write``, page cache): a keeper
decides what to keep and its batch is appended with nothing in between, so anything that
happens to those messages afterwards (a delivery, a recall) is written after their keep records
(``chronoq.timer.roll``: why that order matters, and how a keeper whose work spans steps keeps it).

``RetentionRoll.step(deadline_ns)`` pulls and writes batches until the keepers are done (it
returns the ``RetentionPlan``) or the clock passed ``deadline_ns`` (None: call again). Pure of
the loop: the clock is the store's (``monotonic_ns``), injected in tests.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator

from chronoq.core import errors

log = logging.getLogger("chronoq.store")

Keeper = Callable[[int, int], Iterable[list]]


@dataclass(frozen=True)
class RetentionPlan:
    """What ``Store.retention_plan`` decided: delete the log below ``cut`` once it is durable to
    ``ticket`` (the log's end once the keepers were done; 0: they wanted nothing kept), else below
    ``fallback``."""
    cut: int
    ticket: int
    fallback: int
    kept: int


class RetentionRoll:
    """The keepers' batches for ``[lo, cut)`` of ``store``'s log, written a step at a time.

    Ensures: once ``step`` returned a plan, every record a keeper yielded was written (then the
    plan's ticket is the log's written end) or one failed to be (then the plan's cut and fallback
    are the start of the segment holding the lowest offset any keeper wanted kept: nothing it
    needs goes, whatever did not get written)."""

    def __init__(self, store, lo: int, cut: int, keepers: list[Keeper]) -> None:
        self.store = store
        self.lo, self.cut = lo, cut
        self._batches: Iterator[list] = (batch for keeper in keepers for batch in keeper(lo, cut))
        self.kept = 0
        self.lowest: int | None = None  # lowest offset kept so far
        self.plan: RetentionPlan | None = None if keepers and cut > lo else RetentionPlan(cut, 0, cut, 0)

    def step(self, deadline_ns: int | None = None) -> RetentionPlan | None:
        """Write batches until done (the plan) or past ``deadline_ns`` (None: not done yet; at
        least one batch is taken per call). ``deadline_ns`` None: to the end."""
        if self.plan is not None:
            return self.plan
        clock = self.store.clock
        for batch in self._batches:
            if batch:
                lowest = min(offset for offset, _p in batch)
                self.lowest = lowest if self.lowest is None else min(self.lowest, lowest)
                records = [p for _offset, p in batch if p is not None]
                if records:
                    try:
                        self.store.write(records)
                    except errors.StorageError as exc:
                        return self._failed(exc)
                    self.kept += len(records)
            if deadline_ns is not None and clock.monotonic_ns() >= deadline_ns:
                return None
        return self._done()

    def close(self) -> None:
        """Give up the steps not taken (a pass cancelled midway): the keepers' iterators are
        closed, so what they hold (a bucket's read and its watch, ``chronoq.timer.roll``) is let go
        now. What was written stays (idempotent records); nothing is deleted."""
        if self.plan is None:
            self._batches.close()

    def _done(self) -> RetentionPlan:
        if self.lowest is None:  # nothing wanted kept
            self.plan = RetentionPlan(self.cut, 0, self.cut, 0)
            return self.plan
        floor = self.store.log.segment_for(self.lowest).base
        if self.kept:
            log.info("retention rolled %d records forward before deleting the log below %d", self.kept, self.cut)
        # Durable to the log's end before the range goes: the records written here, and those a
        # keeper counted on without writing anything (a timer's recall record in flight: ``None``).
        self.plan = RetentionPlan(self.cut, self.store.log.written, floor, self.kept)
        return self.plan

    def _failed(self, exc: errors.StorageError) -> RetentionPlan:
        # What the keepers would still have kept counts for the fallback too: read it (no writes).
        for batch in self._batches:
            for offset, _p in batch:
                self.lowest = offset if self.lowest is None else min(self.lowest, offset)
        floor = self.store.log.segment_for(self.lowest).base
        log.warning("retention keeps the log from %d: writing the records it still needs failed (%s)", floor, exc)
        self.plan = RetentionPlan(floor, 0, floor, 0)
        return self.plan
