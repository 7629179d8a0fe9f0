"""The timer's start-up replay: find the bucket files, then replay the commit log after the
cursor (``Replay``, a part of ``TimerService``; the checkpoint that names the cursor is read by
``chronoq.timer.checkpoint``).

Replaying absorbs every delayed record after the cursor again (entries are set facts, so twice is
harmless) and re-marks what was delivered from the copies found there (``__TIMER_REF`` /
``__DELAY_REF``): the dispatch-once rule of ``chronoq.timer.service``. A roll record
(``chronoq.timer.roll``) is absorbed as the message it carries, under that message's ident.

A replica (``following``) keeps the same replay going over the records it is shipped
(``follow``), never ticking, and checkpoints as a primary does: so a promotion replays only the
records after its last checkpoint, and a replica killed at any moment recovers by the same rules
(journal roll-back, replay from the cursor) as a primary.

A mixin, like ``chronoq.timer.absorb``: the replay fills the very buckets, lanes and cursor the
other parts work on, so it runs on the facade's state rather than on a copy handed to it.
"""

from __future__ import annotations

from typing import Callable

from chronoq.core.delay_levels import DELAY_TOPIC
from chronoq.store import record
from chronoq.store.shipping import Tap
from chronoq.timer import copies, roll, schedlog
from chronoq.timer.schedlog import DISPATCHED

CATCH_UP_RUN = 4096  # delayed records absorbed together at start-up


class Replay:
    """Mixed into ``TimerService``: uses its ``store``, ``cursor``, ``sched_dir``, ``level_lanes``,
    ``following``, ``_unabsorbed``, ``_push``, ``_append`` and ``_absorb_run``; sets ``_done``,
    ``caught_up``, ``followed`` and ``replayed``."""

    def _scan_dir(self) -> None:
        pending, done = schedlog.list_dir(self.sched_dir)
        for start in pending:
            self._push(start)
        self._done = sorted(done)

    def _catch_up(self) -> None:
        """Replay the commit log after the cursor: absorb delayed records, re-mark delivered copies."""
        self.caught_up = self._replay_from(self.cursor)

    def follow(self, dispatch: Callable[[Tap], object] | None = None) -> int:
        """A replica's timer (``chronoq.server.replica``): absorb the shipped records by the
        start-up replay's own path (``_Run``), firing nothing (no tick runs on a replica: no claim,
        no copy, nothing written to the commit log). ``dispatch`` is the store's dispatch of the
        newly durable records (``Store.dispatch_shipped``): called with this replay's ``feed`` as
        its tap, so each record is walked and parsed once for the consume queues and the timer.
        When the timer is not where that dispatch starts (none, normally), the store dispatches
        alone and the timer replays from where it stopped, a walk of its own. ``maintenance``
        then checkpoints as on a primary, so a promotion replays only what came after the last
        checkpoint. Returns how many records were absorbed or re-marked."""
        assert self.following and not self._unabsorbed, "follow is a replica's (the store dispatched nothing live)"
        if dispatch is not None and self.store.dispatched == self.replayed:
            run = _Run(self)
            dispatch(run.feed)
            count = run.close(self.store.dispatched)  # (plain records are not fed: where the walk ended)
        else:
            if dispatch is not None:
                dispatch(None)
            if self.store.dispatched <= self.replayed:
                return 0
            count = self._replay_from(self.replayed)
        self.followed += count
        return count

    def _replay_from(self, start: int) -> int:
        """Absorb the delayed records and re-mark the delivered copies from ``start`` to the log's
        end; sets ``replayed`` (where it stopped) and returns how many it handled."""
        run = _Run(self)
        feed = run.feed
        header = None
        for offset, header, raw in self.store.scan(start):
            feed(offset, header, raw)
        return run.close(start if header is None else offset + header.length)

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


class _Run:
    """One replay pass over records fed in commit-log order (``feed``), from the start-up scan
    (``_replay_from``) or a replica's dispatch (``follow``); ``close(end)`` absorbs what is left,
    sets the timer's ``replayed`` to where the walk ended and returns how many records it handled.

    Runs of delayed records go through the bulk path (``_absorb_run``), a run ending at each
    delivered copy so entries keep commit-log order (a restart replays ~10 s of sends)."""

    __slots__ = ("timer", "count", "raws", "records")

    def __init__(self, timer: Replay):
        self.timer = timer
        self.count = 0
        self.raws: list[bytes] = []
        self.records: list[tuple[int, int, int]] = []

    def feed(self, offset: int, header: record.RecordHeader, raw: bytes) -> None:
        if header.flags & record.FLAG_DELAYED:
            rolled = roll.unwrap(raw) if header.topic == copies.CONTROL_TOPIC else None
            if rolled is not None:  # a pending message carried past retention: absorbed as itself
                self._flush()
                self.timer._absorb_record(*rolled)
                self.count += 1
                return
            self.raws.append(raw)
            self.records.append((offset, header.length, 0))
            self.count += 1
            if len(self.records) >= CATCH_UP_RUN:
                self._flush()
        # A delivered copy keeps its message's due time (``copies.delivered_copy``), never 0: a
        # plain record (deliver_at_ms 0) is not searched for the reference markers (and a store's
        # dispatch does not hand it over: ``store.Tap``).
        elif header.deliver_at_ms and (copies.REF_MARKERS[0] in raw or copies.REF_MARKERS[1] in raw) \
                and header.topic != DELAY_TOPIC:
            self._flush()
            self.count += self.timer._apply_ref(offset, raw)

    def _flush(self) -> None:
        if self.records:
            self.timer._absorb_run(b"".join(self.raws), self.records)
            self.raws, self.records = [], []

    def close(self, end: int) -> int:
        self._flush()
        timer = self.timer
        timer.replayed = max(timer.replayed, end)
        for lane in timer.level_lanes:
            lane.scan_offset = lane.offset
        return self.count
