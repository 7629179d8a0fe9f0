"""Rolling pending timer messages forward before commit-log retention deletes their records.

Why: the commit log is the one source of a data directory (docs/storage.md, "The logs and what
is derived from them"); the schedule log is derived from it. A message delayed past the
retention window outlives the segment it was sent in, and must not pin it (invariant 6: disk
follows pending, not history). So before retention deletes a range of the log, every timer
message still pending whose latest copy in the log lies in that range is appended again at the
log's head, as a **roll record**; the log alone then still holds every pending timer, and a
timer rebuilt from it (no ``timer/`` directory) has exactly the same messages, under the same
idents, with the same bytes. RocketMQ's timer re-puts far timers into its commit log the same way.

A roll record (``FLAG_DELAYED | FLAG_SYSTEM`` in ``copies.CONTROL_TOPIC``, like a recall: it never
reaches a consume queue) carries::

    message id     the pending message's
    deliver_at_ms  its due time
    properties     PROP_ROLLED = "<ident>": the commit offset of the delayed record that created
                   the message (its schedule entry's ident and its recall handle's position)
    body           the message's record, byte for byte as its schedule entry holds it

Who reads it: the timer's start-up replay (``chronoq.timer.replay``) absorbs it as the message it
carries, under that ident (into the bucket the inner record names): the same MESSAGE entry
absorbing the original gave, so replaying both, or either twice, changes nothing (entries are
set facts). The live absorb path sees a control record without a recall in it and does nothing:
the running timer has the message already.

Why this is safe (each case a rebuild from the log alone must agree with the live timer):

* Rolled only while pending (no DISPATCHED, CANCELLED or MOVED entry in its bucket's file or
  buffer); every later fact about the message (its delivered copy, a recall, a reschedule) is
  written after the roll record, so retention, which deletes oldest first, never keeps the roll
  record without them. A bucket is read and rolled in steps (``keep_batches``), the loop free
  between them: its file as it was when the read began plus its write buffer then, and from that
  moment every DISPATCHED, CANCELLED or MOVED entry appended to the bucket is noted
  (``TimerService.roll_watch``, ``note_appended``); each chunk of roll records is built and
  written in one step and leaves out the messages noted so far. So a message delivered,
  recalled, moved or replaced between two steps gets no roll record after that fact.
* A message whose recall, reschedule or replacement record is written but not yet absorbed (*in
  flight*, ``chronoq.timer.recall``) is not rolled either: that record lies in the log already,
  before any roll record this pass could write, and ends the message once absorbed. Its copy's
  offset still counts where the pass falls back (a failed write or fsync of the roll records:
  ``chronoq.store.retention``), so its segment stays until the record is durable; a successful
  pass deletes the range only once everything written before its end is durable, that record
  included.
* A message claimed but not yet durably delivered is rolled too: if its copy is lost to a crash,
  the roll record still holds it; if not, the copy's reference retires it wherever it is read.
* Idempotent and crash-safe: roll records are written and fsynced before any segment is deleted
  (``chronoq.store.store.Store.retention``: embedded, the fsync in place; the server writes them
  on the loop, a chunk per slice with the loop free between (``keep_batches``,
  ``chronoq.store.retention``), and awaits the committer's fsync, on its thread, before deleting:
  ``GroupCommitter.retention``); a crash in between leaves the message twice in the
  log (harmless: one set fact) and the next pass rolls its old copy again, so the extra copy
  lives on until a pass's range holds both (or the message is delivered). A message is rolled
  once per pass.
* Each pass rolls only the messages whose copy is in the range being deleted, so a message is
  rolled about once per retention window (``retention_max_age_hours``, or the time the log
  takes to reach ``retention_max_bytes``): a timer due in a year, with 72 h retention, is
  written about 120 times in all; the log holds one copy of every pending timer at most (plus
  one per crash between a roll and the deletion), beside what retention keeps anyway.
"""

from __future__ import annotations

from typing import Iterator

from chronoq.store import record
from chronoq.store.store import Prepared
from chronoq.timer import copies, schedlog
from chronoq.timer.bucketreader import BucketReader
from chronoq.timer.schedlog import ENTRY_HEAD_SIZE, MESSAGE

PROP_ROLLED = "__TIMER_ROLLED"
_ROLLED_MARKER = PROP_ROLLED.encode()
_CONTROL_TOPIC = copies.CONTROL_TOPIC.encode()
_ROLL_FLAGS = record.FLAG_DELAYED | record.FLAG_SYSTEM
# Retention's scan pauses (an empty batch: the caller may stop its slice there) every this many
# records: ~1-2 ms of parsing and checking the timer's records (1,024 took 2.3 ms here, up to
# 6), a fraction of that stepping over others.
SCAN_PAUSE_RECORDS = 512
# A bucket's read and roll, a bounded piece between two pause points (``keep_batches``), each
# ~0.5-1 ms here: its file read this many bytes at a time (0.55 ms), its entries parsed and CRC
# checked this many at a time (1.1 us each), its roll records built this many at a time (2 us
# each; written in the same step). At once, one bucket of 100,000 pending timers (34 MB of file)
# held the loop 600 ms in one step.
READ_BYTES = 1 << 20
PARSE_ENTRIES = 1024
ROLL_CHUNK = 256


def roll_record(ident: int, due_ms: int, raw: bytes, now_ms: int) -> Prepared:
    """The roll record carrying the pending message ``raw`` (ident ``ident``, due ``due_ms``)."""
    message_id = copies.header_fields(raw)[4]
    return Prepared(copies.CONTROL_TOPIC, 0, _ROLL_FLAGS, now_ms, due_ms, message_id, b"", b"",
                    record.encode_properties({PROP_ROLLED: str(ident)}), bytes(raw))


def unwrap(raw) -> tuple[int, bytes] | None:
    """(ident, the message's record) of a roll record; None for any other record."""
    if _ROLLED_MARKER not in raw:
        return None
    parts = copies.split(raw)
    if parts.topic != _CONTROL_TOPIC:
        return None
    value = record.decode_properties(parts.properties).get(PROP_ROLLED)
    if value is None:
        return None
    inner = parts.body
    record.check(inner, 0, len(inner))  # it was a valid record when rolled; a bug if not
    return int(value), inner


def keep_batches(timer, lo: int, hi: int, now_ms: int) -> Iterator[list[tuple[int, Prepared | None]]]:
    """Roll records for the timer messages still pending whose copy lies in ``[lo, hi)`` of the
    log, each with the offset of that copy: what ``Store.retention`` appends before it deletes
    the range (the store's retention keeper), in batches (``chronoq.store.retention``).

    First the range is scanned for the timer's records, yielding an empty batch (a pause point)
    every SCAN_PAUSE_RECORDS records found or stepped over; then each bucket holding one is read
    and rolled in bounded pieces (``_bucket_batches``). An item ``(offset, None)`` is a copy to
    keep with nothing to write: a message in flight (the module docstring)."""
    found: dict[int, dict[int, int]] = {}  # bucket start -> {ident: offset of its copy in range}
    seen = 0
    for offset, raw in timer.store.scan_flagged(lo, hi, record.FLAG_DELAYED, SCAN_PAUSE_RECORDS):
        seen += 1
        if seen % SCAN_PAUSE_RECORDS == 0:
            yield []
        if raw is None:  # a pause point in a long run of other records
            continue
        if copies.header_fields(raw)[3] == _CONTROL_TOPIC:  # a recall (nothing to keep) or a roll record
            rolled = unwrap(raw)
            if rolled is None:
                continue
            ident, inner = rolled
        else:
            ident, inner = offset, raw
        start = schedlog.bucket_of_record(copies.stored_ms(inner), copies.header_fields(inner)[2], timer.width)
        found.setdefault(start, {})[ident] = offset
    for start in sorted(found):
        yield from _bucket_batches(timer, start, found.pop(start), now_ms)


def _bucket_batches(timer, start: int, wanted: dict[int, int], now_ms: int):
    """``keep_batches`` for bucket ``start`` and the idents ``wanted`` (-> their copy's offset):
    its file as it is now (read READ_BYTES a step, through a descriptor: a later deletion of the
    path changes nothing read) and its write buffer now, parsed PARSE_ENTRIES a step, then the
    roll records of the wanted messages pending there, ROLL_CHUNK a step, less those noted in
    ``timer.roll_watch`` meanwhile (delivered, cancelled or moved since the read began) and those
    in flight. What ``chronoq.timer.digest.bucket_pending`` finds pending, read in pieces."""
    assert start not in timer.roll_watch, "one roll of a bucket at a time"
    noted = timer.roll_watch[start] = set()  # before the read: nothing appended from now on is missed
    reader = None
    try:
        b = timer.buckets.get(start)
        buffered = bytes(b.buffer) if b is not None else b""
        # (a finished bucket's file awaiting deletion holds nothing pending, ``ScheduleFiles.write``)
        if not timer.files.awaits_deletion(start):
            reader = BucketReader(timer.files, start, strict=True)  # (a bad header stops the pass)
            while not reader.step(READ_BYTES):
                yield []
            reader.close()
        data = reader.data if reader is not None else b""
        reader = None  # (its buffer goes with ``data`` below)
        states: dict[int, int] = {}
        messages: dict[int, tuple[int, bytes]] = {}
        for part, trusted in ((data, False), (buffered, True)):
            for n, (pos, total, kind, ident, due) in enumerate(_entries(part, trusted), 1):
                if n % PARSE_ENTRIES == 0:
                    yield []
                if ident not in wanted:
                    continue
                if kind == MESSAGE:
                    states.setdefault(ident, MESSAGE)
                    if ident not in messages:
                        messages[ident] = (due, bytes(part[pos + ENTRY_HEAD_SIZE:pos + total]))
                else:
                    states[ident] = kind
        part = data = buffered = b""  # (read: only the wanted messages' records are kept)
        keep = sorted(ident for ident, kind in states.items() if kind == MESSAGE)
        holds = timer._in_flight.holds_timer
        for first in range(0, len(keep), ROLL_CHUNK):
            batch: list[tuple[int, Prepared | None]] = []
            for ident in keep[first:first + ROLL_CHUNK]:
                if ident in noted:  # delivered, cancelled or moved since the read began
                    continue
                if holds(ident):  # its ending record is written, not yet absorbed
                    batch.append((wanted[ident], None))
                    continue
                due, raw = messages.pop(ident)
                batch.append((wanted[ident], roll_record(ident, due, raw, now_ms)))
            yield batch
    finally:
        del timer.roll_watch[start]
        if reader is not None:
            reader.close()


def _entries(data, trusted: bool):
    """``(pos, total, kind, ident, due)`` of the entries in ``data`` (a bucket file's entries
    without its header, or a write buffer: ``trusted``, built in memory), as ``schedlog.scan``
    and ``chronoq.timer.digest.bucket_pending`` read them: a damaged entry is skipped to the next
    valid one (the load of the bucket reports it)."""
    pos, end = 0, len(data)
    while pos < end:
        if trusted:
            total = schedlog.entry_fields(data, pos)[0]
        else:
            try:
                total = schedlog.check_entry(data, pos, end)
            except schedlog.SchedLogError:
                nxt = schedlog.find_next_valid(data, pos + 1, end)
                if nxt is None:
                    return
                pos = nxt
                continue
        _t, kind, ident, due, _aux = schedlog.entry_fields(data, pos)
        yield pos, total, kind, ident, due
        pos += total


def note_appended(noted: set[int], entries: bytes) -> None:
    """Add to ``noted`` the idents of the DISPATCHED, CANCELLED and MOVED entries in ``entries``
    (one or more, just appended to a bucket being rolled: ``_bucket_batches``)."""
    pos, end = 0, len(entries)
    while pos < end:
        total, kind, ident, _due, _aux = schedlog.entry_fields(entries, pos)
        if kind != MESSAGE:
            noted.add(ident)
        pos += total
