"""Held records: timer copies written ahead of their due time (``record.FLAG_HELD``), the
``Holds`` half of ``chronoq.store.store.Store``.

A held copy is stamped with its due time and held in its consume queue (``ConsumeQueue.hold``)
until ``release_held`` passes that time: written early so that delivery at the due time is a
release, not a write. Holds live in memory (``Store._held``: the queues holding any) and are
rebuilt on open from the queue tails (``_restore_holds``).
"""

from __future__ import annotations

from chronoq.core import errors
from chronoq.store import record
from chronoq.store.consumequeue import ENTRY, ENTRY_SIZE


class Holds:
    """Mixed into ``Store``: uses its ``_held``, ``queues``, ``_queue``, ``log``, ``clock``,
    ``options`` and ``released``."""

    def _hold_written(self, meta: list, i: int, j: int, now: int) -> None:
        for key, qoff, _size, _tag_hash, time_ms in meta[i:j]:
            if key is not None and time_ms > now:  # only held copies are stamped ahead of now
                cq = self._queue(*key)
                cq.hold(qoff, time_ms)
                self._held[key] = cq

    def release_held(self, now_ms: int) -> bool:
        """Release held entries due by ``now_ms``; True when something became visible."""
        if not self._held:
            return False
        released = False
        for key, cq in list(self._held.items()):
            if cq.release(now_ms):
                released = True
            if not cq.held:
                del self._held[key]
        if released:
            self.released += 1
        return released

    def held_records(self, topic: str, due_ms: int):
        """Records of ``topic`` held (dispatched, not yet released) with due time ``due_ms``."""
        for (t, _q), cq in self._held.items():
            if t != topic:
                continue
            for qoff, due in cq.held:
                if due == due_ms and qoff < cq.next_offset:
                    phys, size, _tag, _time = ENTRY.unpack(cq.read_including_held(qoff, 1))
                    yield self.log.read_record(phys, size)

    @property
    def holding(self) -> bool:
        """Whether any consume queue holds entries (``release_held`` has work ahead)."""
        return bool(self._held)

    def next_held_ms(self) -> int | None:
        """The earliest due time of a held entry (when ``release_held`` next has work)."""
        return min((cq.held.first_due() for cq in self._held.values()), default=None)

    def _restore_holds(self) -> None:
        """Hold again the HELD records of each queue's tail that are not due yet (after a restart).

        A held record is written at most ``hold_window_ms`` before its due time, and every entry
        after it in its queue was written later, so walking back from a tail while entry times
        are within the window finds every held entry still due in the future.
        """
        now = self.clock.wall_ms()
        floor = now - self.options.hold_window_ms
        for key, cq in self.queues.items():
            found: list[tuple[int, int]] = []
            off = cq.next_offset
            while off > cq.min_offset:
                # Within one consume-queue file (a read never crosses one).
                n = min(256, off - cq.min_offset, (off - 1) % cq.per_file + 1)
                raw = cq.read_including_held(off - n, n)
                assert len(raw) == n * ENTRY_SIZE
                entries = list(ENTRY.iter_unpack(raw))
                stop = False
                for k in range(len(entries) - 1, -1, -1):
                    phys, size, _tag, time_ms = entries[k]
                    if time_ms <= floor:
                        stop = True
                        break
                    if time_ms > now and size and phys >= self.log.min_offset:
                        try:
                            flags = record.RecordHeader(self.log.read_record(phys, size), 0).flags
                        except errors.CorruptionError:
                            continue
                        if flags & record.FLAG_HELD:
                            found.append((off - n + k, time_ms))
                if stop:
                    break
                off -= n
            for qoff, due in reversed(found):
                cq.hold(qoff, due)
            if cq.held:
                self._held[key] = cq
