"""Delivering due messages: claim them into their lane, write their copies as one group, complete
the durable ones (DISPATCHED entries, level offsets), count them visible, release held copies
(``Deliver``, a part of ``TimerService``, and ``LevelLane``, the lane of one delay level).

One delivery, in order: *claimed* (timer messages from the wheel ``prewrite_ms`` ahead, in a burst
its lead (``chronoq.timer.burstlead``), as held copies; level messages from their queue once due)
-> *written* (``_write_group``: one ``store.write`` for every lane) -> durable (the committer's
fsync for the tick's ticket, handed to ``TimerService.synced``) -> *completed* (``_complete``, in
lane order) -> *visible* (at once, or when ``_release`` passes its hold), counted in the lateness
histogram.

A mixin, like ``chronoq.timer.absorb``: the lanes, the wheel's index and the buckets a claim and
a completion change are the same objects the rest of the timer reads.
"""

from __future__ import annotations

import logging
from bisect import insort
from collections import deque
from operator import attrgetter, itemgetter

from chronoq.core import errors
from chronoq.core.delay_levels import DELAY_TOPIC, DelayLevels
from chronoq.store import record
from chronoq.timer import copies, schedlog
from chronoq.timer.burstlead import Counts
from chronoq.timer.keyed import PARKED_DUE, PARKED_MESSAGE_ID, PARKED_OFFSET, PARKED_TOPIC, parked_copy
from chronoq.timer.lanes import WRITTEN, Delivery, Lane
from chronoq.timer.options import TimerOptions
from chronoq.timer.schedlog import DISPATCHED

log = logging.getLogger("chronoq.timer")

LEVEL_READ_MAX = 512
CLAIM_PER_TICK = 2000  # timer messages claimed (and their copies written) per tick at most
# Released copies counted visible per call (``_count_released``): a burst due at one instant is
# released at once (visibility is the store's, an in-memory step), and counting 84,000 (the key
# index, the lateness histogram, trace events) held the event loop 40-90 ms in that one callback
# (bench/stalls.py --due-burst 100000); the rest is counted by the next calls, each with the time
# its copies became visible, so lateness stays exact.
RELEASE_COUNT_MAX = 5000
_due_ms, _prepared = attrgetter("due_ms"), attrgetter("prepared")  # (a Delivery's)
_topic, _message_id = itemgetter(0), itemgetter(5)  # (its Prepared copy's: topic, message_id)
_parked_due, _parked_topic = itemgetter(PARKED_DUE), itemgetter(PARKED_TOPIC)  # (a parked copy's)
_parked_message_id, _parked_offset = itemgetter(PARKED_MESSAGE_ID), itemgetter(PARKED_OFFSET)


class LevelLane(Lane):
    """The lane of one delay level, reading ``DELAY_TOPIC`` queue level-1 from ``offset``."""

    def __init__(self, level: int, delay_ms: int, opts: TimerOptions):
        super().__init__(f"level-{level}", opts.pending_max, opts.retry_backoff_ms,
                         opts.retry_backoff_max_ms, opts.block_after_failures)
        self.level = level
        self.queue_id = DelayLevels.queue_id(level)
        self.cq_key = (DELAY_TOPIC, self.queue_id)  # its consume queue in store.queues
        self.delay_ms = delay_ms
        self.offset = 0  # every queue offset below this is delivered (durable) or skipped
        self.scan_offset = 0  # next queue offset to claim
        self.head_due: int | None = None  # due time of the entry at scan_offset, when known
        # queue offset -> (CANCELLED or MOVED, due_ms): recalled messages, kept for the recall memory.
        self.cancelled: dict[int, tuple[int, int]] = {}



class Deliver:
    """Mixed into ``TimerService``: uses its ``store``, ``opts``, ``wheel``, ``_index``, ``buckets``,
    ``timer_lane``, ``level_lanes``, ``_all_lanes``, ``_awaiting``, ``histogram``, ``on_visible``,
    ``lead_policy``, ``_lead_memo``, ``_in_flight``, ``roll_watch``, ``_now``, ``_durable_upto`` and
    ``_append``; counts ``lost``, ``burst_claims``, ``burst_lead_last_ms``, ``burst_lead_top_ms``."""

    def _claim_timers(self, now: int) -> None:
        lane = self.timer_lane
        # At most CLAIM_PER_TICK a tick (a few tens of ms of copying), however big the lane: with
        # room for more, the next tick writes the next group while this one's fsync runs.
        room = min(lane.room(now), CLAIM_PER_TICK)
        nxt = self.wheel.next_deadline()
        if not room or nxt is None:
            return
        lead, ahead = self._lead(nxt)
        if nxt > now + ahead:
            return
        if lead != self.opts.prewrite_ms:
            self.burst_claims += 1
            self.burst_lead_last_ms = lead
            self.burst_lead_top_ms = max(self.burst_lead_top_ms, lead)
        # No copy is written further ahead of its due time than the longest lead: the store's
        # restart looks back only so far for held records (``burstlead.check_hold_window``).
        assert lead <= self.lead_policy.longest_ms
        horizon = now + lead
        # The burst path (200k due at once): locals, one call per step.
        index_pop, claim, copy_of, ref_key = self._index.pop, lane.claim, copies.delivered_copy, copies.PROP_TIMER_REF
        held = record.FLAG_HELD
        expired = self.wheel.expire(horizon, room)
        if self._in_flight:
            # A recall's record is in flight for these: they leave the wheel but stay pending in
            # their bucket until it is absorbed (``chronoq.timer.recall``), never claimed.
            holds = self._in_flight.holds_timer
            for ident, _due in [e for e in expired if holds(e[0])]:
                index_pop(ident)
            expired = [e for e in expired if not holds(e[0])]
        for ident, due in expired:
            b = index_pop(ident)
            start = b.start
            claim((start, ident), due, copy_of(b.claim(ident), ref_key, f"{start}.{ident}", held if due > now else 0))

    def _lead(self, first_due: int) -> tuple[int, int]:
        """(how far ahead of now copies are claimed, how close the earliest must be to start)
        for the wheel as it is, whose earliest deadline is ``first_due``: ``prewrite_ms`` and half
        of it, or in a burst the lead ``chronoq.timer.burstlead`` computes from the wheel's
        counts by deadline, for both. Measured from the earliest deadline, not from now, so the
        tick that a deadline of ``first_due - ahead`` brings finds the same answer and claims.
        Remembered until the wheel changes (a tick and ``next_deadline_ms`` ask several times)."""
        policy = self.lead_policy
        if not policy.bursts:
            return policy.prewrite_ms, policy.prewrite_ms // 2
        changes = self.wheel.changes
        memo = self._lead_memo
        if memo[0] == changes and memo[1] == first_due and memo[2] is policy:
            return memo[3]
        fine_end, coarse_start, coarse_end = Counts.spans(first_due, policy.lead_min_ms, policy.lead_max_ms)
        wheel = self.wheel
        lead = policy.lead(Counts(first_due, wheel.due_per_block(first_due, fine_end),
                                  wheel.due_per_block(coarse_start, coarse_end, coarse=True)))
        self._lead_memo = (changes, first_due, policy, lead)
        return lead

    def _claim_level(self, lane: LevelLane, now: int) -> None:
        if self._level_idle(lane):
            return
        room = lane.room(now)
        if not room or (lane.head_due is not None and lane.head_due > now):
            return
        lo, hi = self.store.bounds(DELAY_TOPIC, lane.queue_id)
        if lane.scan_offset < lo and not lane.pending:
            lane.offset = lane.scan_offset = lo
        scan = lane.scan_offset
        if scan >= hi:
            lane.head_due = None
            return
        entries = self.store.entries(DELAY_TOPIC, lane.queue_id, scan, min(room, hi - scan, LEVEL_READ_MAX))
        lane.head_due = None
        taken = 0
        for phys, size, _tag_hash, stored_ms in entries:
            qoff = scan + taken
            if stored_ms + lane.delay_ms > now and qoff not in lane.cancelled:
                lane.head_due = stored_ms + lane.delay_ms  # an estimate >= the record's due time
                break
            raw = self._level_record(phys, size)
            if raw is None:
                lane.claim(qoff, 0, None)
                taken += 1
                continue
            due = copies.header_fields(raw)[2]
            if due > now:
                lane.head_due = due
                break
            if self._in_flight and self._in_flight.holds_level(lane.level, qoff):
                # A recall's record for it is in flight: the lane waits here until it is absorbed
                # (``chronoq.timer.recall``); completions stay in order behind it.
                lane.head_due = None
                break
            if qoff in lane.cancelled:
                lane.claim(qoff, due, None)
            else:
                lane.claim(qoff, due, copies.delivered_copy(raw, copies.PROP_DELAY_REF, f"{lane.level}.{qoff}"))
            taken += 1
        lane.scan_offset = scan + taken

    def _level_record(self, phys: int, size: int) -> bytes | None:
        """The record behind a delay-queue entry, or None when it is gone (skipped, counted)."""
        if size == 0 or phys < self.store.log.min_offset:
            self.lost += 1
            log.error("delay-level record at %d is gone (retention or quarantine); skipping it", phys)
            return None
        try:
            return self.store.log.read_record(phys, size)
        except errors.CorruptionError as exc:
            self.lost += 1
            log.error("delay-level record unreadable, skipping it: %s", exc)
            return None

    def _lanes(self) -> list[Lane]:
        return self._all_lanes

    def _level_idle(self, lane: LevelLane) -> bool:
        """Nothing to do for this level now or later: it holds nothing, knows no head, and its
        queue has no entry past its scan. (Ticks run hundreds of times a second at steady
        rates; most levels are idle, and this keeps them out of every tick's cost.)"""
        if lane.pending or lane.head_due is not None:
            return False
        cq = self.store.queues.get(lane.cq_key)
        return cq is None or cq.next_offset <= lane.scan_offset

    def _deliver(self, now: int) -> None:
        """Write claimed copies as one group (page cache; the tick's ticket asks for their fsync).
        In ``sync`` mode one copy, and only once the last one written is durable."""
        items = [(lane, d) for lane in self._all_lanes if lane.pending for d in lane.to_write(now)]
        if items and self.opts.deliver_mode == "sync":
            if self._written_undurable():
                return
            items = items[:1]
        if items:
            self._write_group(items, now)

    def _written_undurable(self) -> bool:
        upto = self._durable_upto()
        return any(d.state == WRITTEN and d.end > upto for lane in self._all_lanes for d in lane.pending)

    def _write_group(self, items: list[tuple[Lane, Delivery]], now: int) -> bool:
        before = self.store.log.written
        try:
            written = self.store.write([d.prepared for _, d in items])
        except errors.StorageError as exc:
            # A batch that spans a segment roll can fail after its first part was appended: those
            # copies exist (and will be dispatched) so they must not be written again.
            appended = [(off, hdr.length, hdr.queue_offset) for off, hdr, _raw in self.store.scan(before)] \
                if self.store.log.written > before else []
            for (lane, d), (off, length, qoff) in zip(items, appended):
                lane.written(d, off, off + length, qoff)
            for lane in {id(lane): lane for lane, _ in items[len(appended):]}.values():
                delay = lane.failed(now, str(exc))
                log.warning("timer lane %s: delivery failed (%s); retry in %d ms%s", lane.name, exc, delay,
                            " (lane blocked)" if lane.blocked else "")
            return False
        for (lane, d), w in zip(items, written):
            lane.written(d, w.commit_offset, w.commit_offset + w.size, w.queue_offset)
        return True

    def _complete(self) -> int:
        """Finish durable deliveries in lane order: DISPATCHED entries, level offsets; then count
        the visible ones (lateness, trace). Returns how many became visible."""
        upto = self._durable_upto()
        visible_ms = self._now()
        marks: dict[int, tuple[list[bytes], list[int]]] = {}
        encode_entry = schedlog.encode_entry
        completed = self.timer_lane.complete(upto)
        if self.keys is not None and completed:
            self.unindex_delivered(completed, visible_ms)  # (chronoq.timer.keyed)
        for d in completed:
            start, ident = d.ref
            marked = marks.get(start)
            if marked is None:
                marked = marks[start] = ([], [])
            marked[0].append(encode_entry(DISPATCHED, ident, d.due_ms, d.commit_offset))
            marked[1].append(ident)
        for start, (entries, idents) in marks.items():
            b = self.buckets.get(start)
            blob = b"".join(entries)
            if b is not None and b.append_dispatched(blob, idents):
                self._buffered += len(blob)
                self._buffered_starts.add(start)
                if self.roll_watch and start in self.roll_watch:  # (``_append`` notes the others)
                    self.roll_watch[start].update(idents)
            else:
                for entry in entries:
                    self._append(start, entry)
        for lane in self.level_lanes:
            if not lane.pending:
                continue
            for d in lane.complete(upto):
                lane.offset = d.ref + 1
                if d.prepared is not None:
                    completed.append(d)
        return self._count_visible(completed, visible_ms) if completed else 0

    def _count_visible(self, completed: list[Delivery], visible_ms: int) -> int:
        """Record lateness (and tell the trace) for completed copies readers can see now; park the
        ones behind a hold in ``_awaiting`` until ``_release``."""
        queues, awaiting = self.store.queues, self._awaiting
        if not awaiting and not self.store.holding:  # nothing is hidden: all are visible (a burst)
            self._counted(completed, visible_ms)
            return len(completed)
        seen: list[Delivery] = []
        for d in completed:
            p = d.prepared
            key = (p.topic, p.queue_id)
            waiting = awaiting.get(key)
            if waiting is None and d.queue_offset < queues[key].visible_next:
                seen.append(d)
                continue
            parked = parked_copy(d)  # (until its release, up to a burst's lead: slimmed, untracked)
            if waiting is None:
                awaiting[key] = deque((parked,))
            elif waiting[-1][PARKED_OFFSET] < d.queue_offset:
                waiting.append(parked)
            else:
                # ``_release`` reads each queue's parked copies in queue-offset order (the last one
                # the highest), and completions are not always in it: ``_complete`` lists the
                # level lanes' after the timer lane's, so one fsync that completes the write groups
                # of several ticks brings a level copy after a later group's held timer copy.
                insort(waiting, parked, key=_parked_offset)
        if seen:
            self._counted(seen, visible_ms)
        return len(seen)

    def _counted(self, deliveries: list[Delivery], visible_ms: int) -> None:
        """Copies visible from ``visible_ms`` on: the lateness histogram, the trace."""
        dues = list(map(_due_ms, deliveries))
        self.histogram.record_many(visible_ms, dues)
        if self.on_visible is not None:
            prepared = list(map(_prepared, deliveries))
            self.on_visible(list(map(_topic, prepared)), list(map(_message_id, prepared)), dues, visible_ms)

    def _release(self, now: int) -> int:
        """Release held copies due by ``now`` (the store's holds); the completed ones that became
        visible join ``_released``, and up to RELEASE_COUNT_MAX of those are counted. Returns
        how many were counted."""
        self.store.release_held(now)
        if self._awaiting:
            queues = self.store.queues
            seen: list[tuple] = []
            for key, waiting in list(self._awaiting.items()):
                limit = queues[key].visible_next
                if waiting[-1][PARKED_OFFSET] < limit:  # all visible now (a burst's): taken at once
                    assert max(map(_parked_due, waiting)) <= now, "a copy became visible before its due time"
                    seen += waiting
                    del self._awaiting[key]
                    continue
                while waiting[0][PARKED_OFFSET] < limit:
                    c = waiting.popleft()
                    assert c[PARKED_DUE] <= now, "a copy became visible before its due time"
                    seen.append(c)
            if seen:
                self._released.append((seen, now))
        return self._count_released(RELEASE_COUNT_MAX) if self._released else 0

    def _count_released(self, limit: int | None) -> int:
        """Count up to ``limit`` (None: all) released copies visible, oldest first, each at the
        time it became visible: the key index forgets them (``chronoq.timer.keyed``: meanwhile it
        answers them as delivered, being due), the lateness histogram, the trace. Returns how many."""
        released, counted = self._released, 0
        while released and (limit is None or counted < limit):
            run, visible_ms = released[0]
            if limit is not None and len(run) > limit - counted:
                take = limit - counted
                run, released[0] = run[:take], (run[take:], visible_ms)
            else:
                released.popleft()
            if self.keys is not None:
                self.unindex_released(run, visible_ms)
            dues = list(map(_parked_due, run))
            self.histogram.record_many(visible_ms, dues)
            if self.on_visible is not None:
                self.on_visible(list(map(_parked_topic, run)), list(map(_parked_message_id, run)), dues, visible_ms)
            counted += len(run)
        return counted
