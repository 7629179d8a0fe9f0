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
  record without them.
* A message claimed but not yet durably delivered is rolled too: if its copy is lost to a crash,
  the roll record still holds it; if not, the copy's reference retires it wherever it is read.
* Idempotent and crash-safe: roll records are written and fsynced before any segment is deleted
  (``chronoq.store.store.Store.retention``: embedded, the fsync in place; the server writes them
  on the loop, a bucket's batch per slice with the loop free between (``keep_batches``,
  ``chronoq.store.retention``), and awaits the committer's fsync, on its thread, before deleting:
  ``GroupCommitter.retention``); a crash in between leaves the message twice in the
  log (harmless: one set fact) and the next pass rolls its old copy again, so the extra copy
  lives on until the message is delivered. A message is rolled once per pass.
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
from chronoq.timer.digest import bucket_pending

PROP_ROLLED = "__TIMER_ROLLED"
_ROLLED_MARKER = PROP_ROLLED.encode()
_CONTROL_TOPIC = copies.CONTROL_TOPIC.encode()
_ROLL_FLAGS = record.FLAG_DELAYED | record.FLAG_SYSTEM
# Retention's scan pauses (an empty batch: the caller may stop its slice there) every this many
# records: ~1-2 ms of parsing and checking the timer's records, a fraction of that stepping over others.
SCAN_PAUSE_RECORDS = 1024


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


def keep_batches(timer, lo: int, hi: int, now_ms: int) -> Iterator[list[tuple[int, Prepared]]]:
    """Roll records for the timer messages still pending whose copy lies in ``[lo, hi)`` of the
    log, each with the offset of that copy: what ``Store.retention`` appends before it deletes
    the range (the store's retention keeper), in batches (``chronoq.store.retention``).

    First the range is scanned for the timer's records, yielding an empty batch (a pause point)
    every SCAN_PAUSE_RECORDS records found or stepped over; then one batch per bucket: its
    pending messages are read and their roll records yielded together, to be written in the same
    step (so whatever happens to a message after it was found pending, its delivered copy or its
    recall, lies after its roll record in the log). Ensures: a bucket's batch is never split."""
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
        idents = found.pop(start)
        pending = bucket_pending(timer, start)  # one read of the bucket for all its idents
        batch = []
        for ident, offset in sorted(idents.items()):
            entry = pending.get(ident)
            if entry is not None:
                due, raw = entry
                batch.append((offset, roll_record(ident, due, raw, now_ms)))
        yield batch
