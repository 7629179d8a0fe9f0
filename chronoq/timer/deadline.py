"""When the timer next has work: ``next_deadline_ms`` and the wake-ups that make it earlier
(``Deadline``, a part of ``TimerService``).

The runtime sleeps until ``next_deadline_ms()`` and then ticks; anything that makes the deadline
earlier than the one last reported calls the wake-up listeners. The deadline is *now* while
work is under way that a tick does in slices (a bucket loading, loaded messages going into the
wheel) or delayed records wait to be absorbed and no tick has asked for their fsync yet (what
waits for an fsync asked for is the committer's work, not a reason to tick). Otherwise it is
the earliest of these reasons to tick, one method each:

=====================  ========================================================================
``_absorb_retry``      the back-off after a failed fsync for delayed records is over
``_timer_lane_due``    the timer lane: its back-off ends; its oldest delivery can complete; the
                       wheel's earliest message comes within the claim lead (not while full);
                       (``sync`` deliver mode) a claimed copy can be written
``_held_release``      the store's earliest held copy falls due (made visible by the tick);
                       now, while released copies wait to be counted (``_count_released``)
``_level_lanes_due``   each delay level, as the timer lane, with its queue head's due time
``_load_ahead``        the earliest bucket on disk enters the preload window
``_bucket_to_finish``  the oldest loaded bucket, empty, can be finished at its end
=====================  ========================================================================

A mixin, like ``chronoq.timer.absorb``: it reads every part's state.
"""

from __future__ import annotations

from typing import Callable, Iterator

from chronoq.core.delay_levels import DELAY_TOPIC
from chronoq.timer import copies
from chronoq.timer.buckets import LOADED
from chronoq.timer.delivery import LevelLane
from chronoq.timer.lanes import CLAIMED, SKIP, WRITTEN, Lane

# ``_lead_grew`` looks again after this many entries put into the wheel.
LEAD_RECHECK_ADDS = 256


class Deadline:
    """Mixed into ``TimerService``: reads its state; owns ``_wakeups``, ``_reported_deadline``
    (which ``BucketLife._to_wheel`` compares new deadlines with) and ``_added_since_deadline``."""

    def next_deadline_ms(self) -> int | None:
        """When ``tick`` next has work (epoch ms; may be <= now), or None when nothing waits
        (see the module docstring for the reasons)."""
        now = self._now()
        queue = self._unabsorbed
        unasked = queue and now >= self._absorb_retry_at_ms and queue[-1][0] + queue[-1][1] > self._asked
        if self._loading or self._wheel_fill or unasked:
            return self._remember(now)
        durable_upto = self._durable_upto()
        cands = [*self._absorb_retry(now), *self._timer_lane_due(now, durable_upto), *self._held_release(now),
                 *self._level_lanes_due(now, durable_upto), *self._load_ahead(), *self._bucket_to_finish()]
        return self._remember(min(cands) if cands else None)

    def _absorb_retry(self, now: int) -> Iterator[int]:
        if self._unabsorbed and now < self._absorb_retry_at_ms:
            yield self._absorb_retry_at_ms

    def _timer_lane_due(self, now: int, durable_upto: int) -> Iterator[int]:
        lane = self.timer_lane
        if lane.pending and lane.retry_at_ms:  # backing off: nothing before the retry
            yield lane.retry_at_ms
            return
        if self._completable(lane, durable_upto) or self._writable(lane, now):
            yield now
        if self._has_room(lane):
            nxt = self.wheel.next_deadline()
            if nxt is not None:
                yield nxt - self._lead(nxt)[1]

    def _held_release(self, now: int) -> Iterator[int]:
        held = self.store.next_held_ms()
        if held is not None:
            yield held
        if self._released:  # released copies still to count (``Deliver._count_released``)
            yield now

    def _level_lanes_due(self, now: int, durable_upto: int) -> Iterator[int]:
        for lane in self.level_lanes:
            if lane.pending and lane.retry_at_ms:
                yield lane.retry_at_ms
                continue
            if self._level_idle(lane):
                continue
            if self._completable(lane, durable_upto) or self._writable(lane, now):
                yield now
            if self._in_flight and self._in_flight.holds_level(lane.level, lane.scan_offset):
                continue  # stopped at a recall in flight: absorbing its record wakes the loop
            if self._has_room(lane):
                head = lane.head_due if lane.head_due is not None else self._peek_level(lane)
                if head is not None:
                    yield head

    def _load_ahead(self) -> Iterator[int]:
        if self._heap:
            yield self._heap[0] - self.opts.preload_ms

    def _bucket_to_finish(self) -> Iterator[int]:
        if self._loaded:
            b = self.buckets[self._loaded[0]]
            if b.state == LOADED and not b.pending and not b.claimed:
                yield b.start + self.width

    @staticmethod
    def _completable(lane: Lane, durable_upto: int) -> bool:
        """The lane's oldest delivery can complete now: skipped, or made durable and visible by
        someone else's fsync (e.g. the send path's group commit)."""
        pending = lane.pending
        if not pending:
            return False
        head = pending[0]
        return head.state == SKIP or (head.state == WRITTEN and head.end <= durable_upto)

    def _writable(self, lane: Lane, now: int) -> bool:
        """``sync`` deliver mode: a claimed copy waits for the last one's fsync, then for a tick.
        (In ``async`` mode a tick writes every copy it claims; one left claimed is backing off.)"""
        if self.opts.deliver_mode != "sync" or now < lane.retry_at_ms or self._written_undurable():
            return False
        return any(d.state == CLAIMED for d in lane.pending)

    @staticmethod
    def _has_room(lane: Lane) -> bool:
        """Whether a lane's next due message is a deadline: not while the lane is full (flow
        control: only completions free room; the caller doing the fsyncs ticks after each)."""
        return len(lane.pending) < lane.pending_max

    def _remember(self, deadline: int | None) -> int | None:
        self._reported_deadline = deadline
        self._added_since_deadline = 0
        return deadline

    def _lead_grew(self) -> bool:
        """Whether entries put into the wheel since the last ``next_deadline_ms`` moved the
        claim of a burst earlier than that deadline (``BucketLife._to_wheel``): a crowd sent a
        few seconds ahead grows its lead as it arrives, while the loop sleeps till the deadline
        reported before. Looked at every LEAD_RECHECK_ADDS entries (a lead from the wheel's
        counts costs ~10 us; steady sends put entries in one at a time), so a crowd's claim
        starts at most 256 / 40,000 s = ~6 ms late by this; crossing the burst threshold with
        fewer entries than that waits for the next tick (the runtime ticks at least every second)."""
        policy = self.lead_policy
        if self._added_since_deadline < LEAD_RECHECK_ADDS or policy.lead_max_ms <= policy.lead_min_ms:
            return False
        self._added_since_deadline = 0
        nxt = self.wheel.next_deadline()
        if nxt is None or not self._has_room(self.timer_lane):
            return False
        claim_at = nxt - self._lead(nxt)[1]
        return self._reported_deadline is None or claim_at < self._reported_deadline

    def _peek_level(self, lane: LevelLane) -> int | None:
        lo, hi = self.store.bounds(DELAY_TOPIC, lane.queue_id)
        scan = max(lane.scan_offset, lo)
        if scan >= hi:
            return None
        entry = self.store.entries(DELAY_TOPIC, lane.queue_id, scan, 1)
        if not entry:
            return None
        phys, size, _t, stored_ms = entry[0]
        raw = self._level_record(phys, size) if phys >= self.store.log.min_offset else None
        lane.head_due = copies.header_fields(raw)[2] if raw is not None else stored_ms
        return lane.head_due

    def add_wakeup_listener(self, fn: Callable[[], None]) -> None:
        """``fn()`` is called when a deadline earlier than the last ``next_deadline_ms`` appears."""
        self._wakeups.append(fn)

    def _wake(self) -> None:
        for fn in self._wakeups:
            fn()

    def on_arrivals(self) -> None:
        """Broker arrival hook (after every dispatch): absorb the delayed records dispatched; a
        level message may have made an idle lane's deadline earlier."""
        self.absorb_dispatched()
        if not self._wakeups:
            return
        for lane in self.level_lanes:
            if lane.head_due is None and not lane.pending and not self._level_idle(lane):
                head = self._peek_level(lane)
                if head is not None and (self._reported_deadline is None or head < self._reported_deadline):
                    self._wake()
                    return
