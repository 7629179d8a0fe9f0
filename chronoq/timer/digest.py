"""A canonical, comparable view of the timer's derived state: the set of pending delayed messages.

The schedule log, the wheel and the level lanes' offsets are derived from the commit log
(docs/storage.md, "The logs and what is derived from them"): a timer rebuilt from the log alone
must have exactly the same messages waiting, for the same due times. Their representation may
differ (which bucket is loaded, whether an entry is still in a write buffer, a level lane's
offset before or after a recalled message, a finished bucket re-created by the replay and not yet
retired), so this compares what a consumer will see, not the files.

Read-only: it reads schedule files, the buckets' unwritten buffers and the level queues, and
changes nothing (no quarantine, no loading), so it can run on a live timer between ticks.
"""

from __future__ import annotations

import zlib
from typing import NamedTuple

from chronoq.store import record
from chronoq.timer import copies, schedlog
from chronoq.core.delay_levels import DELAY_TOPIC
from chronoq.timer.schedlog import ENTRY_HEAD_SIZE, MESSAGE

_LEVEL_READ = 512  # delay-queue entries read per call


class PendingTimer(NamedTuple):
    due_ms: int
    lane: str           # "timer", or "level-<n>" for a delay-level message
    position: int       # timer: the delayed record's commit offset; level: its queue offset
    topic: str          # where it will be delivered
    queue_id: int
    message_id: str
    record_crc: int     # CRC-32 of the whole pending record (body, properties, times)


def pending_timers(timer) -> list[PendingTimer]:
    """Every message the timer will still deliver, sorted by (due, lane, position).

    A message claimed for delivery whose copy is not durable yet counts as pending (a crash
    there delivers it after the restart); a held copy already written counts as delivered (it
    is in its consume queue, which ``chronoq.store.digest`` covers).
    """
    out = [_pending(raw, due, "timer", ident) for ident, (due, raw) in sorted(_timer_entries(timer).items())]
    store = timer.store
    for lane in timer.level_lanes:
        lo, hi = store.bounds(DELAY_TOPIC, lane.queue_id)
        qoff = max(lane.offset, lo)
        while qoff < hi:
            entries = store.entries(DELAY_TOPIC, lane.queue_id, qoff, min(_LEVEL_READ, hi - qoff))
            assert entries, f"delay level {lane.level}: no entry at {qoff} below {hi}"
            for i, (phys, size, _tag, _time) in enumerate(entries, qoff):
                # A hole or a record retention took: the timer skips it as lost (``_level_record``).
                if i not in lane.cancelled and size and phys >= store.log.min_offset:
                    raw = store.log.read_record(phys, size)
                    out.append(_pending(raw, copies.header_fields(raw)[2], f"level-{lane.level}", i))
            qoff += len(entries)
    out.sort()
    return out


def _timer_entries(timer) -> dict[int, tuple[int, bytes]]:
    """ident -> (due, record) of pending timer messages: every bucket's file plus its buffer."""
    pending, _done = schedlog.list_dir(timer.sched_dir)
    out: dict[int, tuple[int, bytes]] = {}
    for start in sorted(set(pending) | set(timer.buckets)):
        for ident, entry in bucket_pending(timer, start).items():
            assert ident not in out, f"timer message {ident} is pending in two buckets"
            out[ident] = entry
    return out


def bucket_pending(timer, start: int) -> dict[int, tuple[int, bytes]]:
    """ident -> (due, record) of the messages pending in bucket ``start`` (its file plus its write
    buffer; none when it has neither). A message claimed but not yet durably delivered counts."""
    path = timer.files.path(start)
    # (a finished bucket's file awaiting deletion holds nothing pending, ``ScheduleFiles.write``)
    file_data = b"" if timer.files.awaits_deletion(start) else schedlog.read_file(path)
    b = timer.buckets.get(start)
    buffered = bytes(b.buffer) if b is not None else b""
    states: list[tuple[int, int]] = []
    messages: dict[int, tuple[int, bytes]] = {}
    for data, entries in ((file_data, schedlog.scan(path, start, file_data) if file_data else ()),
                          (buffered, _plain(buffered))):
        for pos, total, kind, ident, due, _aux in entries:
            states.append((kind, ident))
            if kind == MESSAGE:
                messages.setdefault(ident, (due, bytes(data[pos + ENTRY_HEAD_SIZE:pos + total])))
    return {ident: messages[ident] for ident, kind in schedlog.summarize(states).items() if kind == MESSAGE}


def _plain(data: bytes):
    """``schedlog.scan`` for a write buffer (no file header; entries were built in memory)."""
    pos = 0
    while pos < len(data):
        total, kind, ident, due, aux = schedlog.entry_fields(data, pos)
        yield pos, total, kind, ident, due, aux
        pos += total


def _pending(raw: bytes, due: int, lane: str, position: int) -> PendingTimer:
    parts = copies.split(raw)
    topic, queue_id = copies.real_destination(parts)
    assert record.MAGIC == raw[4], "a pending entry holds a whole commit-log record"
    return PendingTimer(due, lane, position, topic, queue_id, parts.message_id.decode(), zlib.crc32(raw))
