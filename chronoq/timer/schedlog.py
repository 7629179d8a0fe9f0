"""Schedule log: one file per due-time bucket holding full copies of pending timer messages.

Why full copies (not references into the commit log): a message delayed for a year must not keep
a year of commit log alive (invariant 6). The timer absorbs every delayed record into its bucket
file, and once its cursor has passed a record (the bucket files fsynced, the cursor checkpointed)
commit-log retention may delete it (rolling it forward first if it is still pending:
``chronoq.timer.roll``). The bucket file is then the copy the timer reads, so every entry carries
its own CRC and the message record keeps the commit log's CRC inside it. Cost: each timer message
is written twice (commit log + bucket), the price QMQ also pays for its schedule log.

Files (names are constants below)::

    <data>/timer/schedule/<bucket start ms, 16 digits>.sch    a bucket with work left
    <data>/timer/schedule/<bucket start ms, 16 digits>.done   a finished bucket's cancellations

A bucket covers due times ``[start, start + width)``, ``start = due - due % width``. A record
that was already due when it was stored (a reschedule into the past) goes to the bucket of its
store time instead. Either way the bucket is a function of the record alone, so replaying the
record after a crash files it where recall records expect it; a bucket that was already
finished and deleted is simply created again. A ``.done`` file keeps only the CANCELLED/MOVED
entries of a finished bucket, so a late recall still gets a definite answer; it is deleted
after the recall memory.

File header (24 bytes, little-endian)::

    off size field
      0    4 magic       b"CQSL"
      4    2 version     1
      6    2 reserved    0
      8    8 start_ms    i64, bucket start (must equal the file name)
     16    4 width_ms    u32, bucket width when the file was created
     20    4 crc32c      CRC-32C of bytes [0, 20)

Entries follow back to back (``ENTRY_HEAD_SIZE`` = 36)::

    off size field
      0    4 total_len   u32, whole entry, 36 + payload
      4    4 crc32c      CRC-32C of bytes [8, total_len)
      8    1 magic       0xE7
      9    1 kind        1 MESSAGE, 2 DISPATCHED, 3 CANCELLED, 4 MOVED
     10    2 reserved    0
     12    8 ident       i64, commit offset of the delayed record that created the message
     20    8 due_ms      i64, when the message is due
     28    8 aux         i64: MESSAGE 0; DISPATCHED commit offset of the delivered copy;
                          CANCELLED commit offset of the recall record; MOVED ident of the
                          message's new entry (the reschedule record's commit offset)
     36      payload     MESSAGE: the whole commit-log record (``chronoq.store.record``);
                          other kinds: empty

An entry is valid iff: at least 36 bytes are present, ``36 <= total_len <= ENTRY_SIZE_MAX``, the
magic and kind are known, reserved is 0, the payload is non-empty exactly for MESSAGE (and then
its first four bytes, the record length, equal the payload length), and the CRC matches.

The state of a message is a *set* fact, independent of entry order: pending iff a MESSAGE entry
with its ident exists and no DISPATCHED/CANCELLED/MOVED entry names it. So re-absorbing records
after a crash (their entries appear twice) or a tombstone written before the message entry
reached the file changes nothing.

Reading a file (``validate`` + ``scan``), as a decision table:

| #  | case                                   | detected by                                  | action                                        |
|----|----------------------------------------|----------------------------------------------|-----------------------------------------------|
| S0 | empty file, or shorter than the header | size < 24                                    | torn creation: truncate to 0, header rewritten (*) |
| S1 | file header bad or names another start | magic/version/CRC/start check                | quarantine the file (moved aside), report     |
| S2 | valid entry                            | every rule above holds                       | use it                                        |
| S3 | torn tail                              | a bad/short entry with no valid entry after  | truncate there, fsync, report the bytes       |
| S4 | damage in the middle                   | a bad entry with a valid entry after it      | copy the file to quarantine, skip to the next valid entry, report the lost range |

(*) By ``ScheduleFiles.validate`` when the timer checkpoint is lost, by start-up's roll-back when
the file is journaled, else by the first write to the file (``ScheduleFiles._fd``), which also
treats a header-only file whose header is invalid this way: it holds no entry either.

Entries lost in S3 were written after the last timer checkpoint (its cursor is only advanced once
every bucket file is fsynced), so the catch-up scan of the commit log from that cursor writes
them again: a torn tail loses nothing. S1/S4 damage can lose messages; it is reported in the
timer stats and the log, never skipped silently.

Append journal ``<data>/timer/appends.journal``. Before the first write to a bucket file after a
checkpoint, that file's length is appended here and the journal is fsynced (one fsync for every
file a flush touches). After a crash each journaled file is cut back to its recorded length:
everything appended since the checkpoint is re-derived from the commit log after the cursor, so
no bucket file ever has to be read to find a torn tail (S3 is applied by length, not by
scanning; ``validate_tail`` is only needed when the timer checkpoint itself is lost). Records,
28 bytes, little-endian::

    off size field
      0    8 generation  u64, the checkpoint generation the cycle started from
      8    8 start_ms    i64, the bucket
     16    8 length      u64, the file's length before this cycle's first write (0: new or header-only)
     24    4 crc32c      CRC-32C of bytes [0, 24)

A record is applied iff its CRC matches and its generation equals the checkpoint's; when a start
appears twice (the file was deleted and created again in one cycle) the last record wins. A torn
last record is ignored: its bucket write had not started (the journal is fsynced first).
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass, field

import google_crc32c

from chronoq.store import record

SCHEDULE_DIR = "schedule"
PENDING_SUFFIX = ".sch"
DONE_SUFFIX = ".done"
NAME_DIGITS = 16

FILE_MAGIC = b"CQSL"
FILE_VERSION = 1
FILE_HEAD = struct.Struct("<4sHHqI")
FILE_HEAD_CRC = struct.Struct("<I")
FILE_HEAD_SIZE = 24
assert FILE_HEAD.size + FILE_HEAD_CRC.size == FILE_HEAD_SIZE

ENTRY_MAGIC = 0xE7
ENTRY_HEAD = struct.Struct("<IIBBHqqq")
ENTRY_HEAD_SIZE = 36
assert ENTRY_HEAD.size == ENTRY_HEAD_SIZE
_AFTER_CRC = struct.Struct("<BBHqqq")
CRC_START = 8
assert _AFTER_CRC.size + CRC_START == ENTRY_HEAD_SIZE
ENTRY_SIZE_MAX = ENTRY_HEAD_SIZE + record.RECORD_SIZE_MAX

MESSAGE = 1
DISPATCHED = 2
CANCELLED = 3
MOVED = 4
KIND_NAMES = {MESSAGE: "message", DISPATCHED: "dispatched", CANCELLED: "cancelled", MOVED: "moved"}
RESOLVED_KINDS = (DISPATCHED, CANCELLED, MOVED)

_crc = google_crc32c.value
_extend = google_crc32c.extend
_unpack_entry = ENTRY_HEAD.unpack_from
_pack_after = _AFTER_CRC.pack
_pack_len_crc = struct.Struct("<II").pack
# The compiled build encodes a blob's MESSAGE entries in C (schedlog.pxd's ``_encode_messages_in_c``);
# this source's loop is the pure build's.
_COMPILED = not __file__.endswith(".py")
_CRC_IN_CPU = _COMPILED and bool(chronoq_crc32c_in_cpu())  # noqa: F821 - cimported in schedlog.pxd


class SchedLogError(ValueError):
    def __init__(self, reason: str, torn: bool = False):
        super().__init__(reason)
        self.reason = reason
        self.torn = torn


JOURNAL_FILE = "appends.journal"
JOURNAL_RECORD = struct.Struct("<QqQ")
JOURNAL_RECORD_SIZE = 28
assert JOURNAL_RECORD.size + 4 == JOURNAL_RECORD_SIZE


def encode_intent(generation: int, start_ms: int, length: int) -> bytes:
    head = JOURNAL_RECORD.pack(generation, start_ms, length)
    return head + struct.pack("<I", _crc(head))


def decode_journal(data: bytes, generation: int) -> dict[int, int]:
    """{bucket start: length to cut back to} from the journal records of ``generation``."""
    out: dict[int, int] = {}
    for pos in range(0, len(data) - JOURNAL_RECORD_SIZE + 1, JOURNAL_RECORD_SIZE):
        head = data[pos:pos + JOURNAL_RECORD.size]
        (crc,) = struct.unpack_from("<I", data, pos + JOURNAL_RECORD.size)
        if _crc(head) != crc:
            break  # a torn last record: its write never started
        gen, start, length = JOURNAL_RECORD.unpack(head)
        if gen == generation:
            out[start] = length
    return out


# ----------------------------------------------------------------- bucket math
def bucket_start(due_ms: int, width_ms: int) -> int:
    """Start of the bucket holding ``due_ms`` (floor, also for times before the epoch)."""
    assert width_ms > 0
    return due_ms - due_ms % width_ms


def file_name(start_ms: int, suffix: str = PENDING_SUFFIX) -> str:
    assert start_ms >= 0, "bucket starts are epoch milliseconds"
    return f"{start_ms:0{NAME_DIGITS}d}{suffix}"


def parse_file_name(name: str) -> tuple[int, str] | None:
    """(start, suffix) for a schedule file name, None for anything else (temp files, ...)."""
    for suffix in (PENDING_SUFFIX, DONE_SUFFIX):
        if name.endswith(suffix):
            stem = name[: -len(suffix)]
            if len(stem) == NAME_DIGITS and stem.isdigit():
                return int(stem), suffix
    return None


# ----------------------------------------------------------------- codec
def encode_header(start_ms: int, width_ms: int) -> bytes:
    head = FILE_HEAD.pack(FILE_MAGIC, FILE_VERSION, 0, start_ms, width_ms)
    return head + FILE_HEAD_CRC.pack(_crc(head))


def check_header(buf, expected_start: int) -> int:
    """Validate a file header; return its width. Raises SchedLogError (torn if too short)."""
    if len(buf) < FILE_HEAD_SIZE:
        raise SchedLogError(f"file header needs {FILE_HEAD_SIZE} bytes, {len(buf)} present", torn=True)
    magic, version, reserved, start, width = FILE_HEAD.unpack_from(buf, 0)
    (crc,) = FILE_HEAD_CRC.unpack_from(buf, FILE_HEAD.size)
    if magic != FILE_MAGIC or version != FILE_VERSION or reserved != 0:
        raise SchedLogError(f"bad file magic/version {magic!r}/{version}")
    if _crc(bytes(buf[:FILE_HEAD.size])) != crc:
        raise SchedLogError("file header CRC mismatch")
    if start != expected_start:
        raise SchedLogError(f"file header says bucket {start}, the file name says {expected_start}")
    return width


def encode_entry(kind: int, ident: int, due_ms: int, aux: int = 0, payload: bytes = b"") -> bytes:
    """One entry. ``payload`` (MESSAGE only) is a whole commit-log record."""
    assert (kind == MESSAGE) == bool(payload), "only MESSAGE entries carry a payload"
    after = _pack_after(ENTRY_MAGIC, kind, 0, ident, due_ms, aux)
    total = ENTRY_HEAD_SIZE + len(payload)
    assert total <= ENTRY_SIZE_MAX
    return _pack_len_crc(total, _extend(_crc(after), payload) if payload else _crc(after)) + after + payload


# Stored and due time of a commit-log record (``chronoq.store.record``: adjacent i64 fields after
# total, magic, version, crc, flags, queue id, queue offset, born), unpacked together for the
# absorb hot path.
_RECORD_TIMES = struct.Struct("<qq")
_RECORD_TIMES_AT = 30
assert record.HEADER.format.startswith("<IBBIHHQqqq") and struct.calcsize("<IBBIHHQq") == _RECORD_TIMES_AT


def bucket_of_record(stored_ms: int, due_ms: int, width_ms: int) -> int:
    """The bucket a delayed record is filed in: its due time's, or for a record already due when
    stored (a reschedule into the past) its store time's. A function of the record alone, so a
    replay files it where recall records expect it."""
    t = due_ms if due_ms > stored_ms else stored_ms
    return t - t % width_ms


def encode_messages(blob: bytes, records, width_ms: int) -> dict[int, bytes]:
    """MESSAGE entries for commit-log records held back to back in ``blob``, grouped by bucket.

    ``records`` holds one ``(ident, length, ...)`` per record, in blob order from position 0.
    Returns ``{bucket start: entries}``, each bucket's entries concatenated in record order, so
    the caller appends each bucket with one call (the hot path of a bulk delayed publish: no
    per-entry bucket lookup or buffer append, and a record's bytes copied twice: its slice and
    the join). Each entry is exactly ``encode_entry(MESSAGE, ident, due_ms, 0, record)``, in the
    bucket ``bucket_of_record`` names.
    """
    if _COMPILED and type(blob) is bytes:  # schedlog.pxd's C loop (a copy of the record, the CRC in place)
        return _encode_messages_in_c(blob, records, width_ms, _CRC_IN_CPU, _crc)  # noqa: F821
    out: dict[int, list] = {}
    times, pack_after, pack_len_crc, crc, extend = _RECORD_TIMES.unpack_from, _pack_after, _pack_len_crc, _crc, _extend
    get = out.get
    pos = 0
    for r in records:
        ident, size = r[0], r[1]
        stored_ms, due_ms = times(blob, pos + _RECORD_TIMES_AT)
        t = due_ms if due_ms > stored_ms else stored_ms
        start = t - t % width_ms
        after = pack_after(ENTRY_MAGIC, MESSAGE, 0, ident, due_ms, 0)
        raw = blob[pos:pos + size]  # (the CRC wants bytes; a memoryview would not do)
        pos += size
        group = get(start)
        if group is None:
            group = out[start] = []
        group += (pack_len_crc(ENTRY_HEAD_SIZE + size, extend(crc(after), raw)), after, raw)
    assert pos <= len(blob), "records run past the blob"
    return {start: b"".join(pieces) for start, pieces in out.items()}


def check_entry(buf, pos: int, end: int) -> int:
    """Validate the entry at ``buf[pos:end]``; return its length. Raises SchedLogError."""
    if end - pos < ENTRY_HEAD_SIZE:
        raise SchedLogError(f"entry header needs {ENTRY_HEAD_SIZE} bytes, {end - pos} left", torn=True)
    total, crc, magic, kind, reserved, _ident, _due, _aux = _unpack_entry(buf, pos)
    if magic != ENTRY_MAGIC or reserved != 0 or kind not in KIND_NAMES:
        if total == 0 and magic == 0:
            raise SchedLogError("zero bytes", torn=True)
        raise SchedLogError(f"bad entry magic/kind {magic:#x}/{kind}")
    if not ENTRY_HEAD_SIZE <= total <= ENTRY_SIZE_MAX:
        raise SchedLogError(f"entry length {total} out of range")
    if (kind == MESSAGE) != (total > ENTRY_HEAD_SIZE):
        raise SchedLogError(f"a {KIND_NAMES[kind]} entry of {total} bytes")
    if pos + total > end:
        raise SchedLogError(f"entry of {total} bytes runs past the end ({end - pos} left)", torn=True)
    if kind == MESSAGE:
        (rec_len,) = struct.unpack_from("<I", buf, pos + ENTRY_HEAD_SIZE)
        if rec_len != total - ENTRY_HEAD_SIZE:
            raise SchedLogError("message record length disagrees with the entry length")
    if _crc(bytes(buf[pos + CRC_START:pos + total])) != crc:
        raise SchedLogError("entry CRC mismatch")
    return total


def entry_fields(buf, pos: int) -> tuple[int, int, int, int, int]:
    """(total_len, kind, ident, due_ms, aux) of an entry already validated."""
    total, _crc_value, _magic, kind, _r, ident, due_ms, aux = _unpack_entry(buf, pos)
    return total, kind, ident, due_ms, aux


def find_next_valid(buf, start: int, end: int) -> int | None:
    """Position of the first valid entry at or after ``start``, or None."""
    needle = bytes([ENTRY_MAGIC])
    pos = start
    while True:
        hit = buf.find(needle, pos + CRC_START, end)
        if hit < 0:
            return None
        candidate = hit - CRC_START
        try:
            check_entry(buf, candidate, end)
            return candidate
        except SchedLogError:
            pos = candidate + 1


# ----------------------------------------------------------------- reading files
@dataclass
class Damage:
    path: str
    start: int  # byte positions in the file
    end: int
    reason: str
    truncated: bool  # True: a torn tail cut off (S0/S3); False: lost data (S1/S4)


@dataclass
class FileScan:
    """The entries of one bucket file (positions relative to the file) and what was wrong."""

    width_ms: int = 0
    entries_end: int = FILE_HEAD_SIZE
    damage: list[Damage] = field(default_factory=list)


def validate_tail(path: str, start_ms: int, data: bytes) -> tuple[int, Damage | None]:
    """Where appends may continue (S0/S3 applied by the caller) and what was cut.

    Walks entry headers only (length, magic, kind), then CRC-checks the last entry, so it is cheap
    enough to run on a file before the first append after an unclean stop. Returns the valid end
    and a Damage for the torn part; raises SchedLogError for S1 (the caller quarantines).
    """
    if len(data) < FILE_HEAD_SIZE:
        return 0, (Damage(path, 0, len(data), "torn file header", True) if data else None)
    check_header(data, start_ms)
    end = len(data)
    pos = FILE_HEAD_SIZE
    last = None
    while pos < end:
        if end - pos < ENTRY_HEAD_SIZE:
            break
        total, _crc_value, magic, kind, reserved, _i, _d, _a = _unpack_entry(data, pos)
        if (magic != ENTRY_MAGIC or reserved or kind not in KIND_NAMES
                or not ENTRY_HEAD_SIZE <= total <= ENTRY_SIZE_MAX or pos + total > end):
            break
        last = pos
        pos += total
    if last is not None:
        try:
            check_entry(data, last, end)
        except SchedLogError:
            pos = last  # the last complete-looking entry is damaged: treat it as the tail
    if pos >= end:
        return end, None
    if find_next_valid(data, pos + 1, end) is not None:
        return end, None  # S4, not a tail: ``scan`` reports it when the file is read
    return pos, Damage(path, pos, end, "torn tail", True)


def scan(path: str, start_ms: int, data, damage: list[Damage] | None = None):
    """Yield ``(pos, total_len, kind, ident, due_ms, aux)`` for every valid entry (S2/S4).

    ``data`` is the whole file. S4 damage is appended to ``damage`` and skipped.
    """
    end = len(data)
    if end == 0:
        return
    check_header(data, start_ms)
    pos = FILE_HEAD_SIZE
    while pos < end:
        try:
            total = check_entry(data, pos, end)
        except SchedLogError as exc:
            nxt = find_next_valid(data, pos + 1, end)
            stop = end if nxt is None else nxt
            if damage is not None:
                damage.append(Damage(path, pos, stop, exc.reason, False))
            if nxt is None:
                return
            pos = nxt
            continue
        _t, kind, ident, due_ms, aux = entry_fields(data, pos)
        yield pos, total, kind, ident, due_ms, aux
        pos += total


def read_file(path: str) -> bytes:
    try:
        with open(path, "rb") as fh:
            return fh.read()
    except FileNotFoundError:
        return b""


def summarize(entries) -> dict[int, int]:
    """ident -> state kind (MESSAGE = pending) from ``(kind, ident)`` pairs, order-independent."""
    state: dict[int, int] = {}
    for kind, ident in entries:
        if kind == MESSAGE:
            state.setdefault(ident, MESSAGE)
        else:
            state[ident] = kind
    return state


def list_dir(directory: str) -> tuple[list[int], list[int]]:
    """(pending bucket starts, done bucket starts) found in ``directory``."""
    pending, done = [], []
    if not os.path.isdir(directory):
        return pending, done
    for name in os.listdir(directory):
        parsed = parse_file_name(name)
        if parsed is None:
            continue
        (pending if parsed[1] == PENDING_SUFFIX else done).append(parsed[0])
    return pending, done
