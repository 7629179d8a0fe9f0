"""TimerService: delayed delivery for the embedded broker (the shell around the timer's pure core).

Pieces: ``core.delay_levels`` (level table), ``wheel`` (timing wheel), ``schedlog`` (bucket file
format), ``buckets`` (a bucket's in-memory state), ``lanes`` (bounded delivery queues with retry
and blocking), ``copies`` (records the timer writes), ``handle`` (recall handles),
``deliverytime`` (delivery-time validation), ``stats`` (lateness histogram), ``burstlead``
(how far ahead copies are claimed), ``options`` (``TimerOptions``). The shell's jobs, one module each, all parts of ``TimerService`` (every
method is called from the broker's one thread):

=================  ==============================================================================
``absorb``         send side: what a delayed send writes; absorbing dispatched delayed records
``replay``         start-up: the bucket files, the commit log after the cursor
``bucketlife``     buckets: create, buffer, write, load ahead into the wheel, finish
``delivery``       claim, write a group, complete, count visible, release held copies
``deadline``       ``next_deadline_ms`` and the wake-ups
``recall``         recall and reschedule
``keyed``          replace by key and cancel by key (the key index: ``keys``)
``checkpoint``     ``checkpoint.json``, the retention floor, ``maintenance``
``horizon``        ``stats``, ``pending_by_horizon`` and its cache
``pending``        ``pending``: a page of the pending messages (topic, key, due window, cursor)
``service``        this facade: the state, ``tick`` and its effects, ``synced``, ``close``
=================  ==============================================================================

They are mixins for now (as ``absorb`` was first): they share one state (buckets, wheel and
index, lanes, buffers, cursor) that tests, the digest and the metrics read through this facade;
giving each job its own object means deciding who owns which piece of that state, a change of
its own that this split (behaviour-preserving) prepares.

Data flow of a timer message (``deliver_at_ms``)::

    send --> commit log (FLAG_DELAYED record, no consume-queue entry) --fsync, dispatch-->
    store.delayed_dispatched --> absorb (chronoq.timer.absorb; the timer pulls): a MESSAGE entry
    (full record copy) in the bucket of its due minute; if that bucket is in the near window,
    also in the timing wheel
    tick --> wheel.expire --> timer lane --> copy written to the real topic/queue (page cache);
    the tick returns its ticket --> the committer fsyncs and dispatches it (visible) --> ``synced``
    --> DISPATCHED entry in the bucket; a bucket with nothing left is deleted

Delay levels: the record goes to ``DELAY_TOPIC`` queue level-1 (a normal record); each level's
lane reads its queue from the level's offset while the head is due.

Durability and restart (invariants 4 and 5):

* The **cursor** is a commit-log offset below which every record has been absorbed into fsynced
  bucket files (and every delivered copy's DISPATCHED entry is fsynced, and every level offset
  covers the level copies). It is advanced only by ``checkpoint`` (``timer/checkpoint.json``):
  buffers written, every dirty bucket file fsynced, the directory fsynced, then the JSON.
  It is the store retention guard (with each level lane's head), so records the timer still
  needs are never deleted; once absorbed, a far-future message no longer pins the commit log.
* On start, ``store.scan(cursor)`` replays the tail: delayed records are absorbed again and
  delivered copies found there (``__TIMER_REF`` / ``__DELAY_REF``) re-mark what was delivered.
  Entries are set facts (see ``schedlog``), so replaying twice is harmless. **Dispatch-once**:
  a copy is written, fsynced and dispatched before its DISPATCHED entry exists; a crash after the
  copy is durable leaves the copy in the commit log after the cursor, where the replay finds it.
  So a restart never delivers a message twice (QMQ's per-bucket dispatch record, rebuilt from
  the copies' references after the cursor).
* Recall and reschedule write one record to the commit log (a control record, or the new delayed
  record carrying ``__TIMER_MOVED_FROM``); the caller answers once the committer has made it
  durable and dispatched it, which applies it here (``chronoq.timer.recall``).

Linearization of recall/reschedule against delivery: a message is *delivered* at its due instant
on the timer's clock (a monotonic high-water mark of ``clock.wall_ms()``). Everything runs on one
thread, so a recall observes one ``now``: if ``now < due`` and the entry is pending, the tombstone
is written and its target in flight (never claimed) before any tick at or after ``due`` can run, and
CANCELLED is answered once the tombstone is durable; if
``now >= due`` the answer is ALREADY_DELIVERED — a due message is durable and will be made
visible by the next tick even across a crash, so that answer never has to be taken back.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections import deque
from typing import Callable, NamedTuple

from chronoq.core import errors
from chronoq.core.delay_levels import DelayLevels
from chronoq.store.store import Store
from chronoq.timer.absorb import SendSide
from chronoq.timer.bucketlife import BucketLife
from chronoq.timer.buckets import Bucket
from chronoq.timer.checkpoint import Checkpoints
from chronoq.timer.deadline import Deadline
from chronoq.timer.burstlead import LeadPolicy, check_hold_window
from chronoq.timer.delivery import Deliver, LevelLane
from chronoq.timer.horizon import Horizon
from chronoq.timer.keyed import Keyed
from chronoq.timer.lanes import CLAIMED, WRITTEN, Lane
from chronoq.timer.options import TimerOptions
from chronoq.timer.pending import PendingList
from chronoq.timer.recall import (Answer, InFlight, Recall, RecallOutcome, RecallResult,  # noqa: F401 (the API)
                                  RescheduleOutcome, RescheduleResult)
from chronoq.timer.replay import Replay
from chronoq.timer.bucketreader import BucketReader
from chronoq.timer.schedfiles import ScheduleFiles
from chronoq.timer.schedlog import Damage
from chronoq.timer.stats import LatenessHistogram
from chronoq.timer.wheel import TimingWheel

log = logging.getLogger("chronoq.timer")

__all__ = ["TimerService", "TimerOptions", "LevelLane", "Answer", "RecallOutcome", "RecallResult",
           "RescheduleOutcome", "RescheduleResult"]

TIMER_DIR = "timer"


class Tick(NamedTuple):
    """What a tick did and wants (its effects): the deliveries it made visible; the commit-log
    position it needs durable and dispatched, then reported to ``synced`` (or ``sync_failed``),
    0 for none (its copies and the delayed records waiting to be absorbed: the tick writes copies
    to the page cache through the store and never fsyncs); and when to tick next (epoch ms, may
    be <= now; None: nothing waits)."""
    visible: int
    ticket: int
    deadline_ms: int | None

# A tick writes small bucket buffers only past this many buffered bytes, this many files at most.
FLUSH_FILES_PER_TICK = 64
FLUSH_TICK_MIN_BYTES = 256 * 1024


class TimerService(Replay, BucketLife, Deliver, Deadline, Recall, Checkpoints, Horizon, PendingList, SendSide,
                   Keyed):
    # The broker group named by the recall handles this timer mints (chronoq.timer.handle): set
    # by a broker in a cluster (docs/cluster.md); "" outside one (version 1 handles).
    handle_group = ""

    def __init__(self, store: Store, options: TimerOptions, clock, data_dir: str,
                 ensure_delay_topic: Callable[[int], None] | None = None, following: bool = False):
        self.store = store
        # A replica's timer (``following``): it absorbs shipped records (``follow``) and
        # checkpoints, and is never ticked: nothing fires, nothing is written to the commit log.
        self.following = following
        self.replayed = 0  # the commit-log offset the replay (start-up, then ``follow``) reached
        self.followed = 0  # records ``follow`` handled
        self.opts = options
        self.clock = clock
        self.levels = DelayLevels.parse(options.delay_levels)
        self.width = options.bucket_ms
        self.dir = os.path.join(data_dir, TIMER_DIR)
        self.files = ScheduleFiles(self.dir, self.width)
        self.sched_dir = self.files.dir
        self._ensure_delay_topic = ensure_delay_topic
        self._delay_topic_ready = False
        self.wheel = TimingWheel(options.wheel_slot_ms, options.wheel_slots)
        self.buckets: dict[int, Bucket] = {}
        self._heap: list[int] = []  # starts of buckets waiting on disk (UNLOADED)
        self._in_heap: set[int] = set()
        self._loading: deque[Bucket] = deque()
        self._readers: dict[int, BucketReader] = {}  # buckets of _loading whose file is being read
        # Loaded buckets whose pending messages are still being put into the wheel: (bucket,
        # [(ident, due)], next index). See ``_fill_wheel``.
        self._wheel_fill: deque[tuple[Bucket, list[tuple[int, int]], int]] = deque()
        self._loaded: list[int] = []  # starts of LOADING/LOADED buckets, sorted
        self._loaded_horizon = -1  # every bucket starting at or below this is LOADING/LOADED
        self._index: dict[int, Bucket] = {}  # ident -> bucket, for entries in the wheel
        self._done: list[int] = []  # starts of .done files, sorted
        self.timer_lane = Lane("timer", options.pending_max, options.retry_backoff_ms,
                               options.retry_backoff_max_ms, options.block_after_failures)
        self.level_lanes = [LevelLane(i + 1, d, options) for i, d in enumerate(self.levels.delays_ms)]
        self._all_lanes: list[Lane] = [self.timer_lane, *self.level_lanes]
        self._buffered_starts: set[int] = set()  # buckets with a non-empty write buffer
        # An incremental checkpoint in progress: the cursor it will claim, and the buckets whose
        # buffers (holding entries below that cursor) must still be written first.
        self._ckpt_target: int | None = None
        self._ckpt_pending: set[int] = set()
        self._ckpt_syncing = False  # a checkpoint job's run() may be syncing the schedule files
        self._buffered = 0
        # Delayed records dispatched by the store, not yet absorbed (chronoq.timer.absorb).
        self._unabsorbed: deque[tuple[int, int, list, bytes]] = store.delayed_dispatched
        self._absorb_retry_at_ms = 0  # after a failed fsync for them (no busy loop on a bad disk)
        self._hwm_ms = 0
        self.cursor = 0
        self._last_checkpoint_ms = 0
        self.histogram = LatenessHistogram()
        # How far ahead copies are claimed (``chronoq.timer.burstlead``): ``prewrite_ms``, claims
        # starting half of it ahead (copies go out in groups of about half the lead: fewer writes,
        # fsyncs and ticks, each at least half the lead before its due time); in a burst from
        # ``burst_lead_ms`` up to ``burst_lead_max_ms``, growing with how many are due (200k
        # copies take seconds of CPU: started that much earlier, they are visible on time).
        self.lead_policy = LeadPolicy.of(options.prewrite_ms, options.burst_lead_ms, options.burst_lead_max_ms)
        # A copy is written at most ``longest_ms`` before its due time: the store's restart must
        # find it held (it looks back ``hold_window_ms`` by entry time).
        check_hold_window(self.lead_policy.longest_ms, store.options.hold_window_ms)
        self._lead_memo: tuple = (-1, 0, None, (0, 0))  # (wheel.changes, first due, policy, lead): ``_lead``
        self.burst_claims = 0  # claims made with the burst lead (stats)
        self.burst_lead_last_ms = 0  # the lead of the latest burst claim, and the longest one (stats)
        self.burst_lead_top_ms = 0
        self._added_since_deadline = 0  # entries put into the wheel since ``next_deadline_ms`` (``_to_wheel``)
        # Completed deliveries (durable) whose copy is still hidden behind a hold in its queue, per
        # queue in offset order, parked (``keyed.parked_copy``: plain tuples): counted visible
        # (lateness, trace) when the store releases them.
        self._awaiting: dict[tuple[str, int], deque[tuple]] = {}
        # Released copies (visible, parked) not yet counted, each run with the time it became
        # visible: counted RELEASE_COUNT_MAX a call (``Deliver._count_released``).
        self._released: deque[tuple[list[tuple], int]] = deque()
        self._horizon_cache: dict[int, tuple[int, int]] = {}  # start -> (pending, highest ident seen)
        self._warm_todo: list[int] | None = None  # buckets warm_horizon_cache has yet to count
        self._horizon_warm = False
        # chronoq.broker.trace hook: the copies made visible at a time, as columns (topics, message
        # ids, due times, the time), or None.
        self.on_visible: Callable[[list[str], list[bytes], list[int], int], None] | None = None
        self.damage: list[Damage] = self.files.damage
        self.notes: list[str] = []
        self.lost = 0
        self.caught_up = 0
        self.buckets_finished = 0
        self._wakeups: list[Callable[[], None]] = []
        self._reported_deadline: int | None = None
        # Recall/reschedule records written and not yet absorbed, by target (chronoq.timer.recall).
        self._in_flight = InFlight()
        # Buckets retention's roll is reading in steps: start -> idents delivered, cancelled or
        # moved since its read began (``chronoq.timer.roll``; ``_append`` and ``_complete`` note them).
        self.roll_watch: dict[int, set[int]] = {}
        # The highest ticket a tick returned that is not yet reported (``synced``/``sync_failed``):
        # what waits for it is the committer's work, not a reason to tick again.
        self._asked = 0
        self.closed = False
        self._read_checkpoint()
        self._scan_dir()
        self._catch_up()
        store.add_retention_guard(self.retention_floor)
        # No checkpoint here: what the replay absorbed is written out incrementally by the first
        # ``maintenance`` calls (the journal's records stay the rollback points until then), so a
        # restart costs the replay, not thousands of file writes.

    @property
    def burst_due_min(self) -> int:
        """Timers due within ``burst_lead_ms`` of the earliest that make a burst (tests scale it down)."""
        return self.lead_policy.due_min

    @burst_due_min.setter
    def burst_due_min(self, n: int) -> None:
        self.lead_policy = dataclasses.replace(self.lead_policy, due_min=n)

    # ================================================================= ticking and its effects
    def _now(self, now_ms: int | None = None) -> int:
        now = self.clock.wall_ms() if now_ms is None else now_ms
        if now > self._hwm_ms:
            self._hwm_ms = now
        return self._hwm_ms

    def tick(self, now_ms: int | None = None) -> Tick:
        """Do the timer's due work: load ahead, claim due messages, write their copies, retire
        buckets; return its effects (``Tick``).

        The shell calls this at the returned deadline (and when woken); tests call it after
        ``clock.advance``. Bounded per call: ``load_batch`` entries parsed, ``pending_max``
        deliveries claimed per lane. Never fsyncs: claimed copies are written to the page cache
        and the tick's ticket asks the shell's committer to make them durable (the server's
        fsync thread; embedded, ``Broker.timer_tick`` on the caller's thread), which reports to
        ``synced`` (or ``sync_failed``), publishing and completing them. A copy is still durable
        before it is visible (sync flush policy) and before its DISPATCHED entry exists
        (dispatch-once). ``deliver_mode = "sync"`` (one fsync per message, for comparison)
        writes one copy per ticket.

        Timer messages are claimed and written ``prewrite_ms`` before they are due, as *held*
        copies (``record.FLAG_HELD``): the store hides them until ``store.release_held`` passes
        their due time, which every tick does first. So the fsync is behind them when they fall
        due, and visibility at the due instant is an in-memory step.
        """
        if self.closed:
            raise errors.ClosedError("the timer is closed")
        assert not self.following, "a replica's timer never ticks"
        now = self._now(now_ms)
        released = self._release(now)
        # Due work first: a tick that also loads a bucket ahead (parsing up to load_batch
        # entries) must not make what is due now wait for that. What the load brought in due
        # (a bucket that fell due while the broker was down) is claimed right after it.
        self._claim_timers(now)
        for lane in self.level_lanes:
            self._claim_level(lane, now)
        self._deliver(now)
        self._load_step(now)
        nxt = self.wheel.next_deadline()
        if nxt is not None and nxt <= now + self._lead(nxt)[1] and self.timer_lane.room(now):
            self._claim_timers(now)
            self._deliver(now)
        done = released + self._complete()
        if not self._ckpt_syncing:  # bucket files stay untouched while a checkpoint syncs them
            self._finish_buckets(now)
            # Small buffers (a few DISPATCHED entries per tick at steady rates) wait for
            # ``maintenance``: one write per bucket every few hundred ms, not one per tick.
            if self._buffered_starts and self._buffered >= FLUSH_TICK_MIN_BYTES:
                try:
                    self._flush_some(FLUSH_FILES_PER_TICK)
                except errors.StorageError as exc:  # kept in memory; retried by the next call
                    log.warning("schedule log write failed: %s", exc)
        ticket = self._wanted(now)
        if ticket:
            self._asked = max(self._asked, ticket)
        return Tick(done, ticket, self.next_deadline_ms())

    def _wanted(self, now: int) -> int:
        """The commit-log position the timer needs durable now, or 0: written copies not yet
        durable, and (async flush policy) dispatched delayed records not yet fsynced, each not
        while its back-off (after a failed fsync) runs."""
        wanted = 0
        queue = self._unabsorbed
        if queue and now >= self._absorb_retry_at_ms:
            wanted = queue[-1][0] + queue[-1][1]
        durable_upto = self._durable_upto()
        for lane in self._all_lanes:
            if lane.pending and lane.needs_durability(durable_upto, now):
                wanted = max(wanted, max(d.end for d in lane.pending))
        return wanted

    def durability_wanted(self, now_ms: int | None = None) -> bool:
        """Whether the timer needs an fsync now (``_wanted``), asked for or not."""
        return self._wanted(self._now(now_ms)) > 0

    def synced(self, synced_upto: int, now_ms: int | None = None) -> int:
        """The committer made the commit log durable below ``synced_upto`` and dispatched it:
        absorb what waited for it, complete deliveries. Returns how many became visible."""
        now = self._now(now_ms)
        if synced_upto >= self._asked:
            self._asked = 0
        released = self._release(now)
        self._absorb_durable()
        for lane in self._lanes():
            if lane.failures and not any(d.state == CLAIMED for d in lane.pending):
                lane.succeeded()
        return released + self._complete()

    def sync_failed(self, exc: BaseException, now_ms: int | None = None) -> None:
        """The committer's fsync failed: lanes holding written copies back off (and block after
        repeated failures); only the fsync is retried, a written copy is never written again."""
        now = self._now(now_ms)
        self._asked = 0
        for lane in self._lanes():
            if any(d.state == WRITTEN for d in lane.pending):
                lane.failed(now, str(exc))
        if self._unabsorbed:
            self._absorb_retry_at_ms = now + self.opts.retry_backoff_ms
        log.warning("fsync of delivered copies failed: %s", exc)

    def _durable_upto(self) -> int:
        """Commit-log offset below which written copies are durable and visible. Under the async
        flush policy a send dispatches unsynced records, copies included: those are visible but
        not complete (no DISPATCHED entry) until they are also fsynced."""
        return min(self.store.dispatched, self.store.log.synced)

    # ================================================================= close
    def count_released(self) -> int:
        """Count every released copy not counted yet (``Deliver._count_released``): the broker
        does this at a close before it writes its last trace events."""
        return self._count_released(None)

    def close(self) -> None:
        if self.closed:
            return
        self._count_released(None)  # (what a burst released and was not counted yet)
        self.checkpoint(clean=True)
        for reader in self._readers.values():
            reader.close()
        self.files.close()
        self.closed = True
