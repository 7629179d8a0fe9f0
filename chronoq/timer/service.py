"""TimerService: delayed delivery for the embedded broker (the shell around the timer's pure core).

Pieces: ``levels`` (level table), ``wheel`` (timing wheel), ``schedlog`` (bucket file format),
``buckets`` (a bucket's in-memory state), ``lanes`` (bounded delivery queues with retry and
blocking), ``copies`` (records the timer writes), ``handle`` (recall handles), ``deliverytime``
(delivery-time validation), ``stats`` (lateness histogram). This module does the files, talks to
the store and owns the one thread of control: every method is called from the broker's thread.

Data flow of a timer message (``deliver_at_ms``)::

    send --> commit log (FLAG_DELAYED record, no consume-queue entry) --fsync, dispatch-->
    store.delayed_dispatched --> absorb (chronoq.timer.absorb; the timer pulls): a MESSAGE entry
    (full record copy) in the bucket of its due minute; if that bucket is in the near window,
    also in the timing wheel
    tick --> wheel.expire --> timer lane --> copy written to the real topic/queue, fsynced,
    dispatched (visible) --> DISPATCHED entry in the bucket; a bucket with nothing left is deleted

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
  record carrying ``__TIMER_MOVED_FROM``), fsync it and apply it before answering.

Linearization of recall/reschedule against delivery: a message is *delivered* at its due instant
on the timer's clock (a monotonic high-water mark of ``clock.wall_ms()``). Everything runs on one
thread, so a recall observes one ``now``: if ``now < due`` and the entry is pending, the tombstone
is durable and applied before any tick at or after ``due`` can run (CANCELLED); if
``now >= due`` the answer is ALREADY_DELIVERED — a due message is durable and will be made
visible by the next tick even across a crash, so that answer never has to be taken back.
"""

from __future__ import annotations

import bisect
import enum
import heapq
import itertools
import logging
import os
from collections import deque
from dataclasses import dataclass
from typing import Callable

from chronoq.core import errors, fsutil
from chronoq.core.jobs import Job
from chronoq.store import record
from chronoq.store.store import Prepared, Store
from chronoq.timer import copies, deliverytime, schedlog
from chronoq.timer import handle as handles
from chronoq.timer.absorb import SendSide
from chronoq.timer.buckets import LOADED, LOADING, UNLOADED, Bucket, count_pending, lookup
from chronoq.timer.lanes import CLAIMED, SKIP, WRITTEN, Delivery, Lane
from chronoq.core.delay_levels import DELAY_TOPIC, DelayLevels
from chronoq.timer.schedfiles import BucketReader, ScheduleFiles
from chronoq.timer.schedlog import CANCELLED, DISPATCHED, MESSAGE, MOVED, Damage
from chronoq.timer.stats import LatenessHistogram
from chronoq.timer.wheel import TimingWheel

log = logging.getLogger("chronoq.timer")

TIMER_DIR = "timer"
CHECKPOINT_FILE = "checkpoint.json"
CHECKPOINT_VERSION = 1
# Bucket-file writes are buffered (the commit log holds the truth until the cursor passes) and
# written a bounded number of files per call, so far-future traffic spread over thousands of
# buckets never stalls the thread for long. Past this many buffered bytes everything is written
# at once (memory bound first).
BUFFER_HARD_MAX = 64 * 1024 * 1024
FLUSH_FILES_PER_TICK = 64
FLUSH_TICK_MIN_BYTES = 256 * 1024
FLUSH_FILES_PER_MAINTENANCE = 512
LEVEL_READ_MAX = 512
CLAIM_PER_TICK = 2000  # timer messages claimed (and their copies written) per tick at most
# A window of ``burst_lead_ms`` holding timers due faster than this (per second) is a burst and is
# written ahead by the burst lead (``_lead``): four times the 5,000/s the lateness target is set at,
# so steady traffic keeps the short lead.
BURST_DUE_PER_S = 20_000
# Bytes of a bucket file read per tick while loading it ahead (a memory copy of a few ms; a
# minute at 5,000 timers/s is ~70 MB, which read at once held due deliveries for 100s of ms).
LOAD_READ_BYTES = 4 * 1024 * 1024
CATCH_UP_RUN = 4096  # delayed records absorbed together at start-up
WHEEL_FILL_PER_TICK = 4000  # loaded messages put into the wheel per tick (a few ms)
STATS_BUCKETS_MAX = 10_080  # a week of one-minute buckets
_DELAY_TOPIC = DELAY_TOPIC.encode()


class RecallOutcome(str, enum.Enum):
    CANCELLED = "cancelled"
    ALREADY_DELIVERED = "already_delivered"
    NOT_FOUND = "not_found"


class RescheduleOutcome(str, enum.Enum):
    RESCHEDULED = "rescheduled"
    ALREADY_DELIVERED = "already_delivered"
    CANCELLED = "cancelled"
    NOT_FOUND = "not_found"


@dataclass(slots=True)
class RecallResult:
    outcome: RecallOutcome
    topic: str
    message_id: str
    deliver_at_ms: int
    detail: str = ""


@dataclass(slots=True)
class RescheduleResult:
    outcome: RescheduleOutcome
    recall_handle: str
    topic: str
    message_id: str
    deliver_at_ms: int
    detail: str = ""


@dataclass
class TimerOptions:
    delay_levels: str
    max_delay_ms: int
    bucket_ms: int
    preload_ms: int
    wheel_slots: int
    wheel_slot_ms: int
    deliver_mode: str
    pending_max: int
    retry_backoff_ms: int
    retry_backoff_max_ms: int
    block_after_failures: int
    load_batch: int
    checkpoint_interval_ms: int
    recall_memory_ms: int
    prewrite_ms: int = 0
    burst_lead_ms: int = 0

    @classmethod
    def from_config(cls, cfg) -> "TimerOptions":
        return cls(cfg.timer_delay_levels, cfg.timer_max_delay_ms, cfg.timer_bucket_ms, cfg.timer_preload_ms,
                   cfg.timer_wheel_slots, cfg.timer_wheel_slot_ms, cfg.timer_deliver_mode, cfg.timer_pending_max,
                   cfg.timer_retry_backoff_ms, cfg.timer_retry_backoff_max_ms, cfg.timer_block_after_failures,
                   cfg.timer_load_batch, cfg.timer_checkpoint_interval_ms, cfg.timer_recall_memory_ms,
                   cfg.timer_prewrite_ms, cfg.timer_burst_lead_ms)


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


class TimerService(SendSide):
    def __init__(self, store: Store, options: TimerOptions, clock, data_dir: str,
                 ensure_delay_topic: Callable[[int], None] | None = None):
        self.store = store
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
        self._unabsorbed: deque[tuple[int, int, int]] = store.delayed_dispatched
        self._absorb_retry_at_ms = 0  # after a failed fsync for them (no busy loop on a bad disk)
        self._hwm_ms = 0
        self.cursor = 0
        self._last_checkpoint_ms = 0
        self.histogram = LatenessHistogram()
        # Claiming starts once the earliest timer is this close to due and then takes everything
        # due within ``prewrite_ms``: copies go out in groups of about half the lead (fewer
        # writes, fsyncs and ticks), each at least half the lead before its due time.
        self._claim_ahead_ms = options.prewrite_ms // 2
        # A burst (``BURST_DUE_PER_S``) is claimed from ``burst_lead_ms`` ahead: writing 200k copies
        # takes seconds of CPU, and starting a second early makes them visible a second sooner.
        # Only with holds (prewrite_ms > 0): a copy written early must stay hidden until due.
        self._burst_lead_ms = options.burst_lead_ms if 0 < options.prewrite_ms < options.burst_lead_ms else 0
        self.burst_due_min = max(1, BURST_DUE_PER_S * self._burst_lead_ms // 1000)
        self.burst_claims = 0  # claims made with the burst lead (stats)
        # Completed deliveries (durable) whose copy is still hidden behind a hold in its queue, per
        # queue in offset order: counted visible (lateness, trace) when the store releases them.
        self._awaiting: dict[tuple[str, int], deque[Delivery]] = {}
        self._horizon_cache: dict[int, tuple[int, int]] = {}  # start -> (buffer length, pending)
        self._warm_todo: list[int] | None = None  # buckets warm_horizon_cache has yet to count
        self._horizon_warm = False
        # chronoq.broker.trace hook: called once per tick with the deliveries made visible (or None).
        self.on_visible: Callable[[list[Delivery], int], None] | None = None
        self.damage: list[Damage] = self.files.damage
        self.notes: list[str] = []
        self.lost = 0
        self.caught_up = 0
        self.buckets_finished = 0
        self._wakeups: list[Callable[[], None]] = []
        self._reported_deadline: int | None = None
        self._caller_syncs = False  # the last tick was ``durable=False`` (see ``tick``)
        self.closed = False
        self._read_checkpoint()
        self._scan_dir()
        self._catch_up()
        store.add_retention_guard(self.retention_floor)
        # No checkpoint here: what the replay absorbed is written out incrementally by the first
        # ``maintenance`` calls (the journal's records stay the rollback points until then), so a
        # restart costs the replay, not thousands of file writes.

    # ================================================================= start-up
    def _read_checkpoint(self) -> None:
        path = os.path.join(self.dir, CHECKPOINT_FILE)
        try:
            cp = fsutil.read_json(path)
        except ValueError as exc:
            self.notes.append(f"timer checkpoint unreadable ({exc}); replaying the whole commit log")
            cp = None
        if cp is not None and (not isinstance(cp, dict) or cp.get("version") != CHECKPOINT_VERSION):
            self.notes.append("timer checkpoint has an unknown version; replaying the whole commit log")
            cp = None
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

    def _scan_dir(self) -> None:
        pending, done = schedlog.list_dir(self.sched_dir)
        for start in pending:
            self._push(start)
        self._done = sorted(done)

    def _catch_up(self) -> None:
        """Replay the commit log after the cursor: absorb delayed records, re-mark delivered copies."""
        count = 0
        # Runs of delayed records go through the bulk path (``_absorb_run``), a run ending at
        # each delivered copy so entries keep commit-log order (a restart replays ~10 s of sends).
        raws: list[bytes] = []
        records: list[tuple[int, int, int]] = []
        for offset, header, raw in self.store.scan(self.cursor):
            if header.flags & record.FLAG_DELAYED:
                raws.append(raw)
                records.append((offset, len(raw), 0))
                count += 1
                if len(records) >= CATCH_UP_RUN:
                    self._absorb_run(b"".join(raws), records)
                    raws, records = [], []
            elif (copies.REF_MARKERS[0] in raw or copies.REF_MARKERS[1] in raw) and header.topic != DELAY_TOPIC:
                if records:
                    self._absorb_run(b"".join(raws), records)
                    raws, records = [], []
                count += self._apply_ref(offset, raw)
        if records:
            self._absorb_run(b"".join(raws), records)
        self.caught_up = count
        for lane in self.level_lanes:
            lane.scan_offset = lane.offset

    def _apply_ref(self, offset: int, raw: bytes) -> int:
        props = record.decode_properties(copies.split(raw).properties)
        ref = props.get(copies.PROP_TIMER_REF)
        if ref is not None:
            start, ident = copies.parse_ref(ref)
            due = copies.header_fields(raw)[2]
            self._append(start, schedlog.encode_entry(DISPATCHED, ident, due, offset))
            return 1
        ref = props.get(copies.PROP_DELAY_REF)
        if ref is not None:
            level, qoff = copies.parse_ref(ref)
            if 1 <= level <= len(self.level_lanes):
                lane = self.level_lanes[level - 1]
                lane.offset = max(lane.offset, qoff + 1)
            return 1
        return 0

    # ================================================================= buckets
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
                self._push(start)
        return b

    def _append(self, start: int, entry: bytes) -> None:
        b = self._bucket(start)
        b.append(entry)
        self._buffered += len(entry)
        self._buffered_starts.add(start)
        if b.state == LOADED:
            added, removed, _n = b.parse(1 << 62, self.damage)
            self._to_wheel(b, added)
            for ident, due in removed:
                self.wheel.remove(ident, due)
                self._index.pop(ident, None)
        if self._buffered > BUFFER_HARD_MAX and not self._ckpt_syncing:
            try:
                self._flush_buffers()
            except errors.StorageError as exc:  # kept in memory; the next checkpoint retries
                log.warning("schedule log write failed: %s", exc)

    def _to_wheel(self, b: Bucket, entries) -> None:
        wake = False
        for ident, due in entries:
            self.wheel.add(ident, due)
            self._index[ident] = b
            if self._reported_deadline is None or due < self._reported_deadline:
                wake = True
        if wake:
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

    def _flush_buffers(self) -> None:
        """Write every buffered entry to its bucket file (page cache; fsync is ``checkpoint``'s)."""
        self._flush_starts(sorted(self._buffered_starts))
        assert self._buffered == 0

    def _flush_some(self, limit: int) -> None:
        """Write up to ``limit`` buffered buckets, those a pending checkpoint waits for first."""
        chosen = sorted(self._ckpt_pending)[:limit]
        if len(chosen) < limit:
            chosen += sorted(self._buffered_starts - self._ckpt_pending)[:limit - len(chosen)]
        self._flush_starts(chosen)

    def _flush_starts(self, starts: list[int]) -> None:
        """Write these buckets' buffers to their files (``ScheduleFiles.write`` journals first)."""
        items = [(start, bytes(self.buckets[start].buffer)) for start in starts
                 if start in self.buckets and self.buckets[start].buffer]
        self.files.write(items)
        for start in starts:
            self._ckpt_pending.discard(start)
            self._buffered_starts.discard(start)
            b = self.buckets.get(start)
            if b is None:
                continue
            self._buffered -= len(b.buffer)
            b.buffer = bytearray()
            self._horizon_cache.pop(start, None)  # its file grew (pending_by_horizon)
            if b.state == UNLOADED and start not in self._readers:  # far future: keep nothing in memory
                del self.buckets[start]

    # ================================================================= ticking
    def _now(self, now_ms: int | None = None) -> int:
        now = self.clock.wall_ms() if now_ms is None else now_ms
        if now > self._hwm_ms:
            self._hwm_ms = now
        return self._hwm_ms

    def tick(self, now_ms: int | None = None, *, durable: bool = True) -> int:
        """Do the timer's due work: load ahead, claim due messages, deliver, retire buckets.

        The runtime calls this at ``next_deadline_ms()`` (and when woken); tests call it after
        ``clock.advance``. Bounded per call: ``load_batch`` entries parsed, ``pending_max``
        deliveries claimed per lane. Returns how many deliveries completed.

        ``durable=False`` (the server runtime): never fsync here. Claimed copies are written to
        the page cache only; when ``durability_wanted()`` the caller fsyncs the commit log on a
        worker thread and hands the result to ``synced`` (or ``sync_failed``), which publishes
        and completes them. A copy is still durable before it is visible (sync flush policy) and
        before its DISPATCHED entry exists (dispatch-once), only the wait is off this thread.
        ``deliver_mode = "sync"`` (one fsync per message, for comparison) always fsyncs here.

        Timer messages are claimed and written ``prewrite_ms`` before they are due, as *held*
        copies (``record.FLAG_HELD``): the store hides them until ``store.release_held`` passes
        their due time, which every tick does first. So the fsync is behind them when they fall
        due, and visibility at the due instant is an in-memory step. Returns how many deliveries
        became visible.
        """
        if self.closed:
            raise errors.ClosedError("the timer is closed")
        now = self._now(now_ms)
        # Remembered for ``next_deadline_ms``: with the caller doing the fsyncs, what waits for
        # one is the caller's work (``durability_wanted``), not a reason to tick again.
        self._caller_syncs = not durable
        released = self._release(now)
        if durable and self._unabsorbed and now >= self._absorb_retry_at_ms:
            self._sync_for_absorb(now)
        # Due work first: a tick that also loads a bucket ahead (parsing up to load_batch
        # entries) must not make what is due now wait for that. What the load brought in due
        # (a bucket that fell due while the broker was down) is claimed right after it.
        self._claim_timers(now)
        for lane in self.level_lanes:
            self._claim_level(lane, now)
        self._deliver(now, durable)
        self._load_step(now)
        nxt = self.wheel.next_deadline()
        if nxt is not None and nxt <= now + self._lead(nxt)[1] and self.timer_lane.room(now):
            self._claim_timers(now)
            self._deliver(now, durable)
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
        return done

    def durability_wanted(self, now_ms: int | None = None) -> bool:
        """True when ``tick(durable=False)`` left work waiting for a commit-log fsync: written
        copies not yet durable, or (async flush policy) dispatched delayed records not yet
        fsynced, whose back-off (after a failed fsync) is over."""
        now = self._now(now_ms)
        if self._unabsorbed and now >= self._absorb_retry_at_ms:
            return True
        durable_upto = self._durable_upto()
        return any(lane.pending and lane.needs_durability(durable_upto, now) for lane in self._all_lanes)

    def synced(self, synced_upto: int, now_ms: int | None = None) -> int:
        """The caller fsynced the commit log below ``synced_upto`` (``store.sync()`` on a worker
        thread): publish it, absorb what waited for it, complete deliveries. Returns how many
        deliveries completed."""
        now = self._now(now_ms)
        self.store.dispatch(synced_upto)
        released = self._release(now)
        self._absorb_durable()
        for lane in self._lanes():
            if lane.failures and not any(d.state == CLAIMED for d in lane.pending):
                lane.succeeded()
        return released + self._complete()

    def sync_failed(self, exc: BaseException, now_ms: int | None = None) -> None:
        """The caller's fsync failed: lanes holding written copies back off (and block after
        repeated failures); only the fsync is retried, a written copy is never written again."""
        now = self._now(now_ms)
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

    def _sync_for_absorb(self, now: int) -> None:
        try:
            self.store.sync()
        except errors.StorageError as exc:
            log.warning("fsync for delayed records failed: %s", exc)
            self._absorb_retry_at_ms = now + self.opts.retry_backoff_ms
            return
        self._absorb_durable()

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
        horizon = now + lead
        # The burst path (200k due at once): locals, one call per step.
        index_pop, claim, copy_of, ref_key = self._index.pop, lane.claim, copies.delivered_copy, copies.PROP_TIMER_REF
        held = record.FLAG_HELD
        for ident, due in self.wheel.expire(horizon, room):
            b = index_pop(ident)
            start = b.start
            claim((start, ident), due, copy_of(b.claim(ident), ref_key, f"{start}.{ident}", held if due > now else 0))

    def _lead(self, first_due: int) -> tuple[int, int]:
        """(how far ahead of now copies are claimed, how close the earliest must be to start),
        for a wheel whose earliest deadline is ``first_due``: ``prewrite_ms`` and half of it, or
        in a burst (at least ``burst_due_min`` due within the burst lead of ``first_due``) the
        burst lead for both. Measured from the earliest deadline, not from now, so the tick that
        a deadline of ``first_due - ahead`` brings finds the same answer and claims."""
        burst = self._burst_lead_ms
        if burst and self.wheel.count_due_by(first_due + burst) >= self.burst_due_min:
            return burst, burst
        return self.opts.prewrite_ms, self._claim_ahead_ms

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

    def _deliver(self, now: int, durable: bool = True) -> None:
        """Write claimed copies (one group, one fsync; or one at a time in ``sync`` mode).

        Not ``durable``: write only; the caller fsyncs (see ``tick``)."""
        items = [(lane, d) for lane in self._all_lanes if lane.pending for d in lane.to_write(now)]
        if self.opts.deliver_mode == "sync":
            for item in items:
                if not self._write_group([item], now) or not self._make_durable(now):
                    break
        elif items and self._write_group(items, now) and durable:
            self._make_durable(now)
        if durable and any(lane.pending and lane.needs_durability(self._durable_upto(), now)
                           for lane in self._all_lanes):
            self._make_durable(now)

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

    def _make_durable(self, now: int) -> bool:
        try:
            synced = self.store.sync()
        except errors.StorageError as exc:
            for lane in self._lanes():
                if any(d.state == WRITTEN for d in lane.pending):
                    lane.failed(now, str(exc))
            log.warning("fsync of delivered copies failed: %s", exc)
            return False
        self.store.dispatch(synced)
        for lane in self._lanes():
            if lane.failures and not any(d.state == CLAIMED for d in lane.pending):
                lane.succeeded()
        return True

    def _complete(self) -> int:
        """Finish durable deliveries in lane order: DISPATCHED entries, level offsets; then count
        the visible ones (lateness, trace). Returns how many became visible."""
        upto = self._durable_upto()
        visible_ms = self._now()
        marks: dict[int, tuple[list[bytes], list[int]]] = {}
        encode_entry = schedlog.encode_entry
        completed = self.timer_lane.complete(upto)
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
            self.histogram.record_many(visible_ms, [d.due_ms for d in completed])
            if self.on_visible is not None:
                self.on_visible(completed, visible_ms)
            return len(completed)
        record_lateness = self.histogram.record
        seen: list[Delivery] = []
        for d in completed:
            p = d.prepared
            key = (p.topic, p.queue_id)
            waiting = awaiting.get(key)
            if waiting is None and d.queue_offset < queues[key].visible_next:
                record_lateness(visible_ms - d.due_ms)
                seen.append(d)
            elif waiting is None:
                awaiting[key] = deque((d,))
            else:
                waiting.append(d)
        if seen and self.on_visible is not None:
            self.on_visible(seen, visible_ms)
        return len(seen)

    def release_due(self, now_ms: int | None = None) -> int:
        """Release held copies due by now, as a tick does first; nothing else (readers call it)."""
        if self.closed:
            raise errors.ClosedError("the timer is closed")
        return self._release(self._now(now_ms))

    def _release(self, now: int) -> int:
        """Release held copies due by ``now`` (the store's holds); count the completed ones that
        became visible. Returns that count."""
        self.store.release_held(now)
        if not self._awaiting:
            return 0
        queues = self.store.queues
        seen: list[Delivery] = []
        for key, waiting in list(self._awaiting.items()):
            limit = queues[key].visible_next
            while waiting and waiting[0].queue_offset < limit:
                d = waiting.popleft()
                assert d.due_ms <= now, "a copy became visible before its due time"
                seen.append(d)
            if not waiting:
                del self._awaiting[key]
        if seen:
            self.histogram.record_many(now, [d.due_ms for d in seen])
            if self.on_visible is not None:
                self.on_visible(seen, now)
        return len(seen)

    def _finish_buckets(self, now: int) -> None:
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
        if done:
            self.files.write_done(b.start, done)
            if b.start not in self._done:
                bisect.insort(self._done, b.start)
        self.files.remove(b.start)
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

    # ================================================================= deadlines
    def next_deadline_ms(self) -> int | None:
        """When ``tick`` next has work (epoch ms; may be <= now), or None when nothing waits."""
        now = self._now()
        absorb_now = self._unabsorbed and now >= self._absorb_retry_at_ms
        if self._loading or self._wheel_fill or (absorb_now and not self._caller_syncs):
            return self._remember(now)
        cands: list[int] = [self._absorb_retry_at_ms] if self._unabsorbed and not absorb_now else []
        durable_upto = self._durable_upto()
        lane = self.timer_lane
        if lane.pending and lane.retry_at_ms:
            cands.append(lane.retry_at_ms)
        elif self._lane_waits(lane, now, durable_upto, cands):
            nxt = self.wheel.next_deadline()
            if nxt is not None:
                cands.append(nxt - self._lead(nxt)[1])
        held = self.store.next_held_ms()
        if held is not None:
            cands.append(held)
        for level_lane in self.level_lanes:
            if level_lane.pending and level_lane.retry_at_ms:
                cands.append(level_lane.retry_at_ms)
                continue
            if self._level_idle(level_lane) or not self._lane_waits(level_lane, now, durable_upto, cands):
                continue
            head = level_lane.head_due if level_lane.head_due is not None else self._peek_level(level_lane)
            if head is not None:
                cands.append(head)
        if self._heap:
            cands.append(self._heap[0] - self.opts.preload_ms)
        if self._loaded:
            b = self.buckets[self._loaded[0]]
            if b.state == LOADED and not b.pending and not b.claimed:
                cands.append(b.start + self.width)
        return self._remember(min(cands) if cands else None)

    @staticmethod
    def _lane_waits(lane: Lane, now: int, durable_upto: int, cands: list[int]) -> bool:
        """Whether a lane's next due message is a deadline: not while the lane is full (flow
        control: only completions free room; the caller doing the fsyncs ticks after each).
        A lane whose oldest delivery can complete now (made durable and visible by someone
        else's fsync, e.g. the send path's group commit) wants a tick now."""
        pending = lane.pending
        if pending:
            head = pending[0]
            if head.state == SKIP or (head.state == WRITTEN and head.end <= durable_upto):
                cands.append(now)
        return len(pending) < lane.pending_max

    def _remember(self, deadline: int | None) -> int | None:
        self._reported_deadline = deadline
        return deadline

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

    # ================================================================= recall and reschedule
    def _locate_timer(self, h: handles.RecallHandle) -> tuple[int | None, int, bytes | None]:
        """(state, bucket start, record bytes if pending) of a timer message's entry."""
        ident = h.position
        b = self._index.get(ident)
        if b is not None:
            return MESSAGE, b.start, b.record_of(ident)
        start = schedlog.bucket_start(h.due_ms, self.width)
        b = self.buckets.get(start)
        if b is not None and b.state == LOADING:
            self._finish_loading(b)
        if b is not None and b.state == LOADED:
            return b.state_of(ident), start, b.record_of(ident)
        file_data = schedlog.read_file(self._path(start))
        extra = bytes(b.buffer) if b is not None else b""
        if file_data or extra:
            state, raw = lookup(self._path(start), start, file_data, extra, ident)
            if state is not None:
                return state, start, raw
        done_path = self._path(start, schedlog.DONE_SUFFIX)
        if start in self._done:
            state, _raw = lookup(done_path, start, schedlog.read_file(done_path), b"", ident)
            return state, start, None
        return None, start, None

    def _locate_level(self, h: handles.RecallHandle) -> tuple[int | None, bytes | None]:
        if not 1 <= h.level <= len(self.level_lanes):
            return None, None
        lane = self.level_lanes[h.level - 1]
        hit = lane.cancelled.get(h.position)
        if hit is not None:
            return hit[0], None
        if h.position < lane.offset:
            return DISPATCHED, None
        entry = self.store.entries(DELAY_TOPIC, lane.queue_id, h.position, 1)
        if not entry:
            return None, None
        raw = self._level_record(entry[0][0], entry[0][1])
        return (MESSAGE, raw) if raw is not None else (None, None)

    def _matches(self, raw: bytes | None, h: handles.RecallHandle) -> bool:
        if raw is None:
            return False
        parts = copies.split(raw)
        topic, _qid = copies.real_destination(parts)
        return parts.message_id.decode() == h.message_id and topic == h.topic and parts.deliver_at_ms == h.due_ms

    def _state(self, h: handles.RecallHandle, now: int) -> tuple[str, int, bytes | None, str]:
        """Classify a handle: ('pending' | 'delivered' | 'cancelled' | 'missing', bucket, raw, why)."""
        if h.kind == handles.IMMEDIATE:
            return "delivered", 0, None, "it was due when sent"
        if h.due_ms + self.opts.recall_memory_ms < now:
            return "missing", 0, None, "the handle is older than timer_recall_memory_ms"
        if h.kind == handles.TIMER:
            state, start, raw = self._locate_timer(h)
        else:
            state, raw = self._locate_level(h)
            start = 0
        if state == CANCELLED:
            return "cancelled", start, None, "it was recalled earlier"
        if state == MOVED:
            return "missing", start, None, "it was rescheduled; use the handle the reschedule returned"
        if now >= h.due_ms:
            # Due: delivered, or durable and made visible by the next tick (linearization point).
            return "delivered", start, None, "its delivery time has passed"
        if h.kind == handles.TIMER and (self._claimed(start, h.position) if state == MESSAGE else self._held(h)):
            # Written ahead as a held copy (``prewrite_ms``): it will be visible at its due time,
            # across a crash too, so this answer never has to be taken back.
            return "delivered", start, None, "its copy is already written and becomes visible at its delivery time"
        if state == MESSAGE and self._matches(raw, h):
            return "pending", start, raw, ""
        return "missing", start, None, "no pending message matches the handle"

    def _claimed(self, start: int, ident: int) -> bool:
        b = self.buckets.get(start)
        return b is not None and ident in b.claimed

    def _held(self, h: handles.RecallHandle) -> bool:
        """A held copy of the handle's message is in its queue (completed ahead of its due time;
        loaded buckets forget DISPATCHED entries, and a restart knows holds from the store only)."""
        for raw in self.store.held_records(h.topic, h.due_ms):
            parts = copies.split(raw)
            if parts.message_id.decode() == h.message_id and parts.deliver_at_ms == h.due_ms:
                return True
        return False

    def _write_durably(self, p: Prepared) -> int:
        """Write one timer record, fsync it and apply it (dispatch runs the sink). Returns its offset."""
        written = self.store.write([p])
        self.store.dispatch(self.store.sync())
        self._absorb_durable()
        assert not self._unabsorbed or self._unabsorbed[0][0] > written[0].commit_offset
        return written[0].commit_offset

    def recall(self, text: str) -> RecallResult:
        """Cancel a pending delayed message. Durable before it returns CANCELLED."""
        h = handles.decode(text)
        now = self._now()
        state, start, raw, why = self._state(h, now)
        if state == "pending":
            if h.kind == handles.TIMER:
                p = copies.control(copies.PROP_TIMER_CANCEL, f"{start}.{h.position}", h.message_id.encode(),
                                   h.due_ms, now)
            else:
                p = copies.control(copies.PROP_DELAY_CANCEL, f"{h.level}.{h.position}.{h.due_ms}",
                                   h.message_id.encode(), h.due_ms, now)
            self._write_durably(p)
            return RecallResult(RecallOutcome.CANCELLED, h.topic, h.message_id, h.due_ms, "recalled")
        outcome = {"delivered": RecallOutcome.ALREADY_DELIVERED, "cancelled": RecallOutcome.CANCELLED,
                   "missing": RecallOutcome.NOT_FOUND}[state]
        return RecallResult(outcome, h.topic, h.message_id, h.due_ms, why)

    def reschedule(self, text: str, deliver_at_ms: int) -> RescheduleResult:
        """Move a pending delayed message to ``deliver_at_ms``; returns a new recall handle."""
        h = handles.decode(text)
        now = self._now()
        new_due = deliverytime.check_deliver_at(deliver_at_ms, now, self.opts.max_delay_ms)
        state, start, raw, why = self._state(h, now)
        if state != "pending":
            outcome = {"delivered": RescheduleOutcome.ALREADY_DELIVERED, "cancelled": RescheduleOutcome.CANCELLED,
                       "missing": RescheduleOutcome.NOT_FOUND}[state]
            return RescheduleResult(outcome, "", h.topic, h.message_id, h.due_ms, why)
        assert raw is not None
        if h.kind == handles.TIMER:
            moved = (copies.PROP_TIMER_MOVED_FROM, f"{start}.{h.position}.{h.due_ms}")
        else:
            moved = (copies.PROP_DELAY_MOVED_FROM, f"{h.level}.{h.position}.{h.due_ms}")
        p = copies.rescheduled(raw, new_due, *moved)
        offset = self._write_durably(p)
        new = handles.RecallHandle(handles.TIMER, 0, offset, new_due, h.topic, h.message_id).encode()
        return RescheduleResult(RescheduleOutcome.RESCHEDULED, new, h.topic, h.message_id, new_due, "moved")

    # ================================================================= checkpoints, retention, close
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
        self._flush_buffers()
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
        if not self._ckpt_pending:
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
        doc = self._checkpoint_doc(cursor, clean, generation)
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

    def _checkpoint_doc(self, cursor: int, clean: bool, generation: int) -> dict:
        levels = {str(lane.level): {"offset": lane.offset,
                                    "cancelled": {str(q): [k, d] for q, (k, d) in lane.cancelled.items()}}
                  for lane in self.level_lanes}
        return {"version": CHECKPOINT_VERSION, "cursor": cursor, "bucket_ms": self.width, "clean": clean,
                "generation": generation, "levels": levels}

    def maintenance(self, now_ms: int | None = None) -> None:
        """Periodic work (the broker's ``maintenance``): checkpoint when due, forget old recalls."""
        job = self.maintenance_job(now_ms)
        if job is not None:
            job.run_here()

    def maintenance_job(self, now_ms: int | None = None) -> Job | None:
        """``maintenance`` without blocking: the work that needs no fsync is done here; the
        completion of a due checkpoint (fsyncs, ``checkpoint.json``) is returned as a ``Job``
        to run on a worker thread and finish back here. Call again only after it finished."""
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
        job = self._checkpoint_step(now)
        if job is None and self._ckpt_target is None and self._buffered_starts:
            self._flush_some(FLUSH_FILES_PER_MAINTENANCE)
        return job

    def close(self) -> None:
        if self.closed:
            return
        self.checkpoint(clean=True)
        for reader in self._readers.values():
            reader.close()
        self.files.close()
        self.closed = True

    # ================================================================= stats
    def stats(self, horizon_ms: int = 600_000) -> dict:
        """Plain-dict observability data (see docs/timers.md, "Observing the timer")."""
        now = self._now()
        first = schedlog.bucket_start(now, self.width)
        count = min(max(horizon_ms, 0) // self.width + 1, STATS_BUCKETS_MAX)
        due_by_bucket = [{"start_ms": first + i * self.width, "end_ms": first + (i + 1) * self.width,
                          "pending": self._pending_cached(first + i * self.width)} for i in range(count)]
        overdue = sum(len(self.buckets[s].pending) + len(self.buckets[s].claimed) for s in self._loaded if s < first)
        levels = []
        for lane in self.level_lanes:
            lo, hi = self.store.bounds(DELAY_TOPIC, lane.queue_id)
            backlog = max(0, hi - max(lane.offset, lo))
            head = lane.head_due if lane.head_due is not None or not backlog else self._peek_level(lane)
            levels.append({"level": lane.level, "delay_ms": lane.delay_ms, "offset": lane.offset,
                           "next_offset": hi, "backlog": backlog, "head_due_ms": head, "lane": lane.stats()})
        return {
            "now_ms": now, "cursor": self.cursor, "bucket_ms": self.width, "deliver_mode": self.opts.deliver_mode,
            "lateness": self.histogram.snapshot(),
            "due_by_bucket": due_by_bucket, "overdue_pending": overdue,
            "wheel": {"entries": len(self.wheel), "next_deadline_ms": self.wheel.next_deadline(),
                      "burst_claims": self.burst_claims},
            "buckets": {"loaded": sum(1 for s in self._loaded if self.buckets[s].state == LOADED),
                        "loading": len(self._loading), "waiting_on_disk": len(self._in_heap),
                        "done_files": len(self._done), "finished": self.buckets_finished},
            "timer_lane": self.timer_lane.stats(), "levels": levels,
            "buffered_bytes": self._buffered, "records_replayed_at_start": self.caught_up, "lost": self.lost,
            "damage": [vars(d) for d in self.damage], "notes": list(self.notes),
        }

    def pending_by_horizon(self, horizons_ms: tuple[int, ...]) -> list[int]:
        """Pending delayed messages due within each horizon from now (cumulative; overdue ones
        count in every horizon), timer messages and delay-level messages together. For metrics.

        Unloaded buckets are counted from their files once and cached: a file changes only in
        ``_flush_starts``, which drops its entry, and entries not yet written are keyed by the
        buffer's length, so a scrape re-reads only buckets that changed. Level queues are in due
        order, so each horizon is a binary search over the queue.
        """
        assert list(horizons_ms) == sorted(horizons_ms) and all(h >= 0 for h in horizons_ms)
        now = self._now()
        # by_first[i]: messages whose bucket is first inside horizon i (the last slot: none).
        by_first = [0] * (len(horizons_ms) + 1)
        cache, buckets, count = self._horizon_cache, self.buckets, self._pending_cached
        where = bisect.bisect_left
        live = self._in_heap | buckets.keys()
        for start in live:
            # A bucket's messages are due inside [start, start + width): count them at its start
            # (overdue: start - now < 0, inside every horizon).
            by_first[where(horizons_ms, start - now)] += count(start)
        for gone in cache.keys() - live:  # finished buckets (C-level set difference)
            del cache[gone]
        out = list(itertools.accumulate(by_first[:-1]))
        for lane in self.level_lanes:
            lo, hi = self.store.bounds(DELAY_TOPIC, lane.queue_id)
            first = max(lane.offset, lo)
            for i, horizon in enumerate(horizons_ms):
                out[i] += self._level_due_before(lane, first, hi, now + horizon) - first
        return out

    def warm_horizon_cache(self, budget_ns: int) -> bool:
        """Count the buckets on disk into ``pending_by_horizon``'s cache a few at a time (at most
        ``budget_ns`` per call, on the caller's thread), so the first metrics scrape or console view
        after a start with many pending timers does not read every schedule file at once. Returns
        True once a full pass is done; later changes drop single entries, re-read when asked."""
        if self._horizon_warm:
            return True
        if self._warm_todo is None:
            self._warm_todo = list(self._in_heap | self.buckets.keys())
        todo, deadline = self._warm_todo, self.clock.monotonic_ns() + budget_ns
        while todo:
            start = todo.pop()
            if start in self._in_heap or start in self.buckets:
                self._pending_cached(start)
            if self.clock.monotonic_ns() >= deadline:
                break
        if not todo:
            self._horizon_warm, self._warm_todo = True, None
        return self._horizon_warm

    def _level_due_before(self, lane: LevelLane, lo: int, hi: int, limit_ms: int) -> int:
        """First queue offset in [lo, hi) of ``lane`` due after ``limit_ms`` (hi if none): its
        entries are in arrival order, so in due order (stored time + the level's delay)."""
        while lo < hi:
            mid = (lo + hi) // 2
            entry = self.store.entries(DELAY_TOPIC, lane.queue_id, mid, 1)
            if entry and entry[0][3] + lane.delay_ms > limit_ms:
                hi = mid
            else:
                lo = mid + 1
        return lo

    def _pending_cached(self, start: int) -> int:
        """``_pending_in``, with the count of an unloaded bucket kept until its file is written
        (``_flush_starts`` drops it) or its buffer grows."""
        b = self.buckets.get(start)
        if b is not None and b.state == LOADED:
            return len(b.pending) + len(b.claimed)
        if b is None and start not in self._in_heap:
            return 0
        key = len(b.buffer) if b is not None else 0
        hit = self._horizon_cache.get(start)
        if hit is None or hit[0] != key:
            hit = self._horizon_cache[start] = (key, self._pending_in(start))
        return hit[1]

    def _pending_in(self, start: int) -> int:
        b = self.buckets.get(start)
        if b is not None and b.state == LOADED:
            return len(b.pending) + len(b.claimed)
        path = self._path(start)
        file_data = schedlog.read_file(path) if start in self._in_heap or b is not None else b""
        extra = bytes(b.buffer) if b is not None else b""
        if not file_data and not extra:
            return 0
        return count_pending(path, start, file_data, extra)
