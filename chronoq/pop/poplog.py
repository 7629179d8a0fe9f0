"""The POP log: the durable fallback for in-flight checkpoints (CKs) and their acks.

Why an append-only log and not ``fsutil.write_json`` checkpoints: the in-flight set can hold
many thousands of CKs (60 s invisible times at thousands of messages a second), and a JSON
snapshot rewrites all of them on every flush. The log writes only what changed since the last
flush (a few dozen bytes per CK or ack), with one ``write`` + ``fsync`` per flush, and a
compaction rewrites the live set only when the file has grown well past it. Most CKs never reach
the log: they are acked while still in the in-memory merge buffer (``inflight.py``).

Files: ``<data>/pop/<generation, 20 digits>.poplog``. One file is current. Each open and each
compaction writes a snapshot of the live CKs to ``<next generation>.poplog.tmp``, fsyncs it,
renames it into place, fsyncs the directory and then deletes older generations, so the newest
file is always a complete snapshot followed by appended batches (a compaction's is encoded on
the loop, its file made after the old one's last sync: ``PopLog.prepare``). CK ids embed the generation
(``inflight.py`` I4).

File header (32 bytes, little-endian)::

    off  size  field
      0     8  magic        b"CHRQPOPL"
      8     2  version      1
     10     2  header_size  32
     12     8  generation   u64, equals the number in the file name
     20     8  created_ms   i64, epoch ms
     28     4  crc32        zlib CRC-32 of bytes [0, 28); also the *salt* of every record CRC

Record (8-byte head + payload)::

    off  size  field
      0     4  crc32        zlib CRC-32 of bytes [4, 8 + length), started from the salt
      4     1  magic        0xB7
      5     1  type         1 BATCH, 2 NAME, 3 CK, 4 ACK, 5 DONE, 6 SEEN
      6     2  length       u16, payload bytes

Payloads::

    BATCH (16)  seq u64, start u64        first record of every flush; start = its own file
                                          position (all bytes before it were fsynced)
    NAME  (5+)  name_id u32, UTF-8 name   interns group and topic names (1..512 bytes)
    CK   (52+10n) ck_id u64, group_id u32, topic_id u32 (asked for), popped_id u32 (read from),
                queue_id u16, flags u8 (bit 0 FIFO, bit 1 NAMED: the invisible time is one a
                client named with ChangeInvisibleDuration above 0, and the message is due again
                at its end, with no retry back-off), n u8 (1..32), pop_ms i64, delivered_ms i64,
                deadline_ms i64, settled bitmap u32; then n x (queue_offset u64, attempt u16)
    ACK   (9)   ck_id u64, index u8       entry settled (acked, moved, dead-lettered)
    DONE  (8)   ck_id u64                 CK finished as a whole (revived)
    SEEN (12+8n) group_id u32, popped_id u32, queue_id u16, n u16 (1..4096); then n x offset u64:
                offsets a restart must not read again from the queue (snapshots only; they
                carry the previous generation's knowledge of finished CKs forward)

A record is valid iff its 8-byte head and payload lie inside the file, the magic matches, the
type is known, the length fits the type's rule above and the CRC (salted by this file's header)
matches. Salting means a record copied from another generation never validates.

Recovery decision table (``load``)::

    case                                              action
    no pop/ directory or no .poplog file              empty state, generation 0
    *.tmp files                                       deleted (an interrupted snapshot)
    several generations                               newest wins; older ones deleted
    header invalid (magic, version, size, CRC, name)  CorruptionError (snapshots are renamed
                                                      into place whole, so this is damage)
    first invalid record, and a valid BATCH record    CorruptionError: the damage is in bytes
      starting after it (its start field = its own    that were fsynced before a later flush
      position)                                       began, i.e. mid-file, not a torn write
    first invalid record, no later valid BATCH        torn tail of the last flush: truncate the
                                                      file there, fsync, report the bytes lost
    valid record naming an unknown name id, or an     CorruptionError (CRC-valid nonsense is a
      ACK index past its CK                           bug or deliberate damage)
    ACK/DONE for a CK not in the table                ignored (its CK finished earlier)

What a lost tail costs: its CKs were never marked durable, so the consume offsets never moved
past their messages; those messages are read again from the queue (see ``service.py`` for the
redelivery bound).
"""

from __future__ import annotations

import logging
import os
import struct
import threading
import zlib
from dataclasses import dataclass, field
from typing import Iterable

from chronoq.core import errors, fsutil

log = logging.getLogger("chronoq.pop")

POP_DIR = "pop"
SUFFIX = ".poplog"
TMP_SUFFIX = ".tmp"
GENERATION_DIGITS = 20
MAGIC = b"CHRQPOPL"
VERSION = 1
HEADER = struct.Struct("<8sHHQqI")
HEADER_SIZE = 32
HEADER_CRC_START = 28
REC_HEAD = struct.Struct("<IBBH")
REC_HEAD_SIZE = 8
REC_MAGIC = 0xB7
T_BATCH, T_NAME, T_CK, T_ACK, T_DONE, T_SEEN = 1, 2, 3, 4, 5, 6
BATCH = struct.Struct("<QQ")
NAME_ID = struct.Struct("<I")
CK_HEAD = struct.Struct("<QIIIHBBqqqI")
CK_ENTRY = struct.Struct("<QH")
ACK = struct.Struct("<QB")
DONE = struct.Struct("<Q")
SEEN_HEAD = struct.Struct("<IIHH")
SEEN_OFFSET = struct.Struct("<Q")
SEEN_OFFSETS_MAX = 4096
CK_ENTRIES_MAX = 32
NAME_BYTES_MAX = 512
FLAG_FIFO = 0x01
FLAG_NAMED = 0x02
assert HEADER.size == HEADER_SIZE and REC_HEAD.size == REC_HEAD_SIZE
assert BATCH.size == 16 and NAME_ID.size == 4 and CK_HEAD.size == 52 and CK_ENTRY.size == 10
assert ACK.size == 9 and DONE.size == 8 and SEEN_HEAD.size == 12 and SEEN_OFFSET.size == 8
assert SEEN_HEAD.size + SEEN_OFFSETS_MAX * SEEN_OFFSET.size < 1 << 16
assert CK_HEAD.size + CK_ENTRIES_MAX * CK_ENTRY.size < 1 << 16
# The bytes a BATCH record has at [4, 8): what the mid-file check searches for.
_BATCH_SIGNATURE = bytes((REC_MAGIC, T_BATCH)) + BATCH.size.to_bytes(2, "little")

_crc32 = zlib.crc32
_pack_head = REC_HEAD.pack
_pack_ck = CK_HEAD.pack
_pack_entry = CK_ENTRY.pack
_pack_ack = ACK.pack
_pack_done = DONE.pack


def file_name(generation: int) -> str:
    return f"{generation:0{GENERATION_DIGITS}d}{SUFFIX}"


def _record(salt: int, rtype: int, payload: bytes) -> bytes:
    n = len(payload)
    assert n < 1 << 16
    tail = bytes((REC_MAGIC, rtype, n & 0xFF, n >> 8))
    return _pack_head(_crc32(payload, _crc32(tail, salt)), REC_MAGIC, rtype, n) + payload


def _header(generation: int, created_ms: int) -> bytes:
    head = HEADER.pack(MAGIC, VERSION, HEADER_SIZE, generation, created_ms, 0)[:HEADER_CRC_START]
    return head + struct.pack("<I", _crc32(head))


# ------------------------------------------------------------------------------------- reading
@dataclass(slots=True)
class CkRecord:
    ck_id: int
    group: str
    topic: str
    popped: str
    queue_id: int
    fifo: bool
    offsets: list[int]
    attempts: list[int]
    pop_ms: int
    delivered_ms: int
    deadline_ms: int
    bits: int
    named: bool = False

    @property
    def full(self) -> int:
        return (1 << len(self.offsets)) - 1


@dataclass
class Recovered:
    generation: int = 0                            # newest generation on disk (0: none)
    cks: dict[int, CkRecord] = field(default_factory=dict)  # live CKs, in log order
    # Offsets of every CK seen in the log, per (group, popped topic, queue): a restart does not
    # read these again from the queue (they are live, or were settled).
    seen: dict[tuple[str, str, int], set[int]] = field(default_factory=dict)
    truncated_bytes: int = 0
    notes: list[str] = field(default_factory=list)


def _valid_length(rtype: int, n: int) -> bool:
    if rtype == T_CK:
        return n >= CK_HEAD.size + CK_ENTRY.size and (n - CK_HEAD.size) % CK_ENTRY.size == 0 \
            and (n - CK_HEAD.size) // CK_ENTRY.size <= CK_ENTRIES_MAX
    if rtype == T_ACK:
        return n == ACK.size
    if rtype == T_DONE:
        return n == DONE.size
    if rtype == T_BATCH:
        return n == BATCH.size
    if rtype == T_NAME:
        return NAME_ID.size < n <= NAME_ID.size + NAME_BYTES_MAX
    if rtype == T_SEEN:
        body = n - SEEN_HEAD.size
        return body >= SEEN_OFFSET.size and body % SEEN_OFFSET.size == 0 \
            and body // SEEN_OFFSET.size <= SEEN_OFFSETS_MAX
    return False


def _parse_at(buf: bytes, pos: int, salt: int) -> tuple[int, int, int] | None:
    """(type, payload start, record end) of a valid record at ``pos``, else None."""
    if pos + REC_HEAD_SIZE > len(buf):
        return None
    crc, magic, rtype, n = REC_HEAD.unpack_from(buf, pos)
    end = pos + REC_HEAD_SIZE + n
    if magic != REC_MAGIC or end > len(buf) or not _valid_length(rtype, n):
        return None
    if _crc32(memoryview(buf)[pos + 4:end], salt) != crc:
        return None
    return rtype, pos + REC_HEAD_SIZE, end


def _later_batch(buf: bytes, pos: int, salt: int) -> int | None:
    """Position of a valid BATCH record after ``pos`` whose start field names itself."""
    at = buf.find(_BATCH_SIGNATURE, pos + 1)
    while at != -1:
        start = at - 4
        if start > pos:
            parsed = _parse_at(buf, start, salt)
            if parsed is not None and parsed[0] == T_BATCH and BATCH.unpack_from(buf, parsed[1])[1] == start:
                return start
        at = buf.find(_BATCH_SIGNATURE, at + 1)
    return None


def _generations(directory: str) -> list[int]:
    out = []
    for name in os.listdir(directory):
        if name.endswith(TMP_SUFFIX):
            os.unlink(os.path.join(directory, name))
            continue
        stem = name[: -len(SUFFIX)]
        if name.endswith(SUFFIX) and len(stem) == GENERATION_DIGITS and stem.isdigit():
            out.append(int(stem))
    return sorted(out)


def load(directory: str) -> Recovered:
    """Read the newest POP log (see the decision table above). Truncates a torn tail."""
    rec = Recovered()
    if not os.path.isdir(directory):
        return rec
    gens = _generations(directory)
    if not gens:
        return rec
    rec.generation = gens[-1]
    for old in gens[:-1]:
        os.unlink(os.path.join(directory, file_name(old)))
        rec.notes.append(f"removed superseded POP log generation {old}")
    path = os.path.join(directory, file_name(rec.generation))
    with open(path, "rb") as fh:
        buf = fh.read()
    salt = _check_header(path, buf, rec.generation)
    pos = _replay(path, buf, salt, rec)
    if pos < len(buf):
        later = _later_batch(buf, pos, salt)
        if later is not None:
            raise errors.CorruptionError(
                path, pos, f"invalid POP log record before a later flush (at byte {later}); "
                           "this is not a torn tail")
        rec.truncated_bytes = len(buf) - pos
        rec.notes.append(f"POP log {path}: torn tail of {rec.truncated_bytes} bytes at {pos} truncated")
        log.warning("%s", rec.notes[-1])
        fd = os.open(path, os.O_RDWR)
        try:
            os.ftruncate(fd, pos)
            os.fsync(fd)
        finally:
            os.close(fd)
    return rec


def _check_header(path: str, buf: bytes, generation: int) -> int:
    if len(buf) < HEADER_SIZE:
        raise errors.CorruptionError(path, 0, "POP log header is short")
    magic, version, size, gen, _created, crc = HEADER.unpack_from(buf, 0)
    if magic != MAGIC or _crc32(buf[:HEADER_CRC_START]) != crc:
        raise errors.CorruptionError(path, 0, "POP log header has a bad magic or checksum")
    if version != VERSION or size != HEADER_SIZE:
        raise errors.CorruptionError(path, 0, f"POP log version {version} (header {size} bytes) is unknown")
    if gen != generation:
        raise errors.CorruptionError(path, 12, f"POP log header says generation {gen}, the name {generation}")
    return crc


def _replay(path: str, buf: bytes, salt: int, rec: Recovered) -> int:
    """Apply valid records from the header on; return where the first invalid one starts."""
    names: dict[int, str] = {}
    cks = rec.cks
    pos = HEADER_SIZE
    while pos < len(buf):
        parsed = _parse_at(buf, pos, salt)
        if parsed is None:
            break
        rtype, p, end = parsed
        if rtype == T_CK:
            ck = _decode_ck(path, pos, buf, p, end, names)
            cks[ck.ck_id] = ck
            rec.seen.setdefault((ck.group, ck.popped, ck.queue_id), set()).update(ck.offsets)
            if ck.bits == ck.full:
                del cks[ck.ck_id]
        elif rtype == T_ACK:
            ck_id, index = ACK.unpack_from(buf, p)
            ck = cks.get(ck_id)
            if ck is not None:
                if index >= len(ck.offsets):
                    raise errors.CorruptionError(path, pos, f"ACK index {index} past its CK")
                ck.bits |= 1 << index
                if ck.bits == ck.full:
                    del cks[ck_id]
        elif rtype == T_DONE:
            cks.pop(DONE.unpack_from(buf, p)[0], None)
        elif rtype == T_SEEN:
            gid, pid, qid, count = SEEN_HEAD.unpack_from(buf, p)
            if count * SEEN_OFFSET.size != end - p - SEEN_HEAD.size or gid not in names or pid not in names:
                raise errors.CorruptionError(path, pos, "SEEN record does not match its length or names")
            offsets = rec.seen.setdefault((names[gid], names[pid], qid), set())
            offsets.update(o for (o,) in SEEN_OFFSET.iter_unpack(buf[p + SEEN_HEAD.size:end]))
        elif rtype == T_NAME:
            name_id = NAME_ID.unpack_from(buf, p)[0]
            try:
                names[name_id] = bytes(buf[p + NAME_ID.size:end]).decode()
            except UnicodeDecodeError:
                raise errors.CorruptionError(path, pos, "POP log name is not UTF-8") from None
        pos = end
    return pos


def _decode_ck(path: str, pos: int, buf: bytes, p: int, end: int, names: dict[int, str]) -> CkRecord:
    (ck_id, gid, tid, pid, qid, flags, n, pop_ms, delivered_ms, deadline_ms, bits) = CK_HEAD.unpack_from(buf, p)
    if n * CK_ENTRY.size != end - p - CK_HEAD.size or not 1 <= n <= CK_ENTRIES_MAX:
        raise errors.CorruptionError(path, pos, f"CK entry count {n} does not match its length")
    try:
        group, topic, popped = names[gid], names[tid], names[pid]
    except KeyError:
        raise errors.CorruptionError(path, pos, "CK names an unknown name id") from None
    offsets, attempts = [], []
    for offset, attempt in CK_ENTRY.iter_unpack(buf[p + CK_HEAD.size:end]):
        offsets.append(offset)
        attempts.append(max(1, attempt))
    return CkRecord(ck_id, group, topic, popped, qid, bool(flags & FLAG_FIFO), offsets, attempts,
                    pop_ms, delivered_ms, deadline_ms, bits & ((1 << n) - 1), bool(flags & FLAG_NAMED))


# ------------------------------------------------------------------------------------- writing
class PopLog:
    """The current generation's file: buffers records in memory; ``seal`` closes the buffer into a
    chunk (on the event loop), ``sync`` writes every sealed chunk as one batch and fsyncs it (on
    any thread: the runtime runs it on the committer's fsync thread, right after the commit
    log's fsync), ``take_synced`` hands the CKs made durable back (on the loop). ``flush`` is the
    three at once, on the caller's thread.

    Ensures: one BATCH per fsync, so everything before a BATCH record was fsynced before its
    bytes were written (the recovery table relies on it); on a write error the file is cut back
    to its last synced size and the chunks wait for the next ``sync``.
    """

    def __init__(self, directory: str, generation: int, fd: int, salt: int, size: int,
                 names: dict[str, int]):
        self.directory = directory
        self.generation = generation
        self.path = os.path.join(directory, file_name(generation))
        self._fd = fd
        self._salt = salt
        self.size = size                     # bytes flushed (fsynced)
        self._names = names                  # interned in this file
        self._pending = bytearray()
        self._pending_cks: list = []
        self._batch_seq = 1
        self.flushes = 0
        # Shared with the syncing thread: ``_chunks`` sealed and not yet synced, ``_synced`` CKs
        # made durable and not yet taken, ``_error`` the last failed sync's (all under ``_lock``);
        # ``_io`` serializes the file's writes, fsyncs and close.
        self._lock = threading.Lock()
        self._io = threading.Lock()
        self._chunks: list[tuple[bytes, list]] = []
        self._synced: list = []
        self._error: BaseException | None = None
        # Until the file exists (``prepare``): its bytes, and the generation it replaces (under ``_io``).
        self._snapshot: bytes | None = None
        self._prior: PopLog | None = None

    @classmethod
    def create(cls, directory: str, generation: int, cks: Iterable, created_ms: int,
               seen: Iterable[tuple[str, str, int, Iterable[int]]] = ()) -> "PopLog":
        """Write a snapshot of ``cks`` (and the ``seen`` offsets, as (group, popped topic,
        queue id, offsets)) as generation ``generation`` and make it current, on this thread.

        Older generations are deleted once the new file is in place (see the module docstring).
        """
        writer = cls.prepare(directory, generation, cks, created_ms, seen)
        with writer._io:
            writer._make_file()
        return writer

    @classmethod
    def prepare(cls, directory: str, generation: int, cks: Iterable, created_ms: int,
                seen: Iterable[tuple[str, str, int, Iterable[int]]] = (),
                prior: "PopLog | None" = None) -> "PopLog":
        """``create`` without I/O (a compaction, on the loop): the file is made by the first ``sync``
        (the committer's thread) once ``prior`` (the generation it replaces, sealed) synced its last
        chunks; records added meanwhile wait for it, and ``take_synced`` hands back ``prior``'s."""
        header = _header(generation, created_ms)
        salt = struct.unpack_from("<I", header, HEADER_CRC_START)[0]
        writer = cls(directory, generation, -1, salt, 0, {})
        writer._pending += _record(salt, T_BATCH, BATCH.pack(0, HEADER_SIZE))
        for group, popped, queue_id, offsets in seen:
            writer._add_seen(group, popped, queue_id, sorted(offsets))
        for ck in cks:
            writer.add_ck(ck)
        writer._snapshot = header + bytes(writer._pending)
        writer._pending = bytearray()
        writer._pending_cks = []
        writer._prior = prior
        return writer

    @property
    def made(self) -> bool:
        """The file is in place (its snapshot durable, older generations deleted)."""
        return self._snapshot is None

    def _make_file(self) -> None:
        """Temp file, fsync, rename, fsync the directory, delete older generations (under ``_io``)."""
        data = self._snapshot
        assert data is not None
        directory = self.directory
        os.makedirs(directory, exist_ok=True)
        tmp = self.path + TMP_SUFFIX
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view):]
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, self.path)
            fsutil.fsync_dir(directory)
        except OSError as exc:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise fsutil.storage_error(exc, self.path) from exc
        for old in _generations(directory):
            if old < self.generation:
                os.unlink(os.path.join(directory, file_name(old)))
        self._fd = os.open(self.path, os.O_WRONLY)
        self.size = len(data)
        self._snapshot = None

    # ----------------------------------------------------------------- the Sink interface
    def _name(self, name: str) -> int:
        name_id = self._names.get(name)
        if name_id is None:
            raw = name.encode()
            assert 0 < len(raw) <= NAME_BYTES_MAX
            name_id = self._names[name] = len(self._names) + 1
            self._pending += _record(self._salt, T_NAME, NAME_ID.pack(name_id) + raw)
        return name_id

    def add_ck(self, ck) -> None:
        n = len(ck.offsets)
        qs = ck.queue
        gid, tid, pid = self._name(ck.group), self._name(ck.topic), self._name(qs.topic)
        flags = (FLAG_FIFO if ck.fifo else 0) | (FLAG_NAMED if ck.named else 0)
        parts = [_pack_ck(ck.ck_id, gid, tid, pid, qs.queue_id, flags, n,
                          ck.pop_ms, ck.delivered_ms, ck.deadline_ms, ck.bits)]
        for offset, attempt in zip(ck.offsets, ck.attempts):
            parts.append(_pack_entry(offset, min(attempt, 0xFFFF)))
        self._pending += _record(self._salt, T_CK, b"".join(parts))
        self._pending_cks.append(ck)

    def _add_seen(self, group: str, popped: str, queue_id: int, offsets: list[int]) -> None:
        gid, pid = self._name(group), self._name(popped)
        for i in range(0, len(offsets), SEEN_OFFSETS_MAX):
            chunk = offsets[i:i + SEEN_OFFSETS_MAX]
            payload = SEEN_HEAD.pack(gid, pid, queue_id, len(chunk)) + b"".join(SEEN_OFFSET.pack(o) for o in chunk)
            self._pending += _record(self._salt, T_SEEN, payload)

    def add_ack(self, ck_id: int, index: int) -> None:
        self._pending += _record(self._salt, T_ACK, _pack_ack(ck_id, index))

    def add_done(self, ck_id: int) -> None:
        self._pending += _record(self._salt, T_DONE, _pack_done(ck_id))

    # ----------------------------------------------------------------- I/O
    @property
    def pending(self) -> bool:
        """Records buffered and not sealed yet."""
        return bool(self._pending)

    @property
    def queued(self) -> bool:
        """Chunks sealed and not yet synced (or whose sync failed), or the file still to make."""
        return bool(self._chunks) or self._snapshot is not None

    def seal(self) -> None:
        """Close the buffer into a chunk for the next ``sync`` (no I/O)."""
        if not self._pending:
            return
        chunk = (bytes(self._pending), self._pending_cks)
        self._pending = bytearray()
        self._pending_cks = []
        with self._lock:
            self._chunks.append(chunk)

    def sync(self) -> None:
        """Write the sealed chunks as one batch and fsync (any thread). Never raises: the CKs made
        durable, or the error, wait for ``take_synced``. A prepared log makes its file first
        (``_make_current``; a failure is retried by the next ``sync``)."""
        with self._io:
            if self._snapshot is not None and not self._make_current():
                return
            with self._lock:
                chunks, self._chunks = self._chunks, []
            if not chunks or self._fd < 0:  # nothing to do, or closed (``close`` synced what it had)
                return
            start = self.size
            data = b"".join([_record(self._salt, T_BATCH, BATCH.pack(self._batch_seq, start)),
                             *(raw for raw, _ in chunks)])
            try:
                view = memoryview(data)
                pos = start
                while view:
                    n = os.pwrite(self._fd, view, pos)
                    view = view[n:]
                    pos += n
                os.fsync(self._fd)
            except OSError as exc:
                try:
                    os.ftruncate(self._fd, start)
                except OSError:
                    pass
                with self._lock:
                    self._chunks[:0] = chunks  # in order, before any sealed meanwhile
                    self._error = fsutil.storage_error(exc, self.path)
                return
            self.size = start + len(data)
            self._batch_seq += 1
            self.flushes += 1
            with self._lock:
                for _, cks in chunks:
                    self._synced.extend(cks)

    def _make_current(self) -> bool:
        """(under ``_io``) ``prior``'s last chunks synced, then this file made: True once in place.
        A crash before: the old generation is the newest on disk, with every record synced."""
        prior = self._prior
        if prior is not None:
            prior.sync()
            cks, exc = prior.take_synced()
            with self._lock:
                self._synced.extend(cks)
                if exc is not None:
                    self._error = exc
            if exc is not None or prior.queued:
                return False
        try:
            self._make_file()
        except errors.StorageError as exc:
            with self._lock:
                self._error = exc
            return False
        if prior is not None:
            prior.close()
            self._prior = None
        return True

    def take_synced(self) -> tuple[list, BaseException | None]:
        """(the CKs made durable since the last call, the last sync's error or None)."""
        with self._lock:
            cks, self._synced = self._synced, []
            exc, self._error = self._error, None
        return cks, exc

    def flush(self) -> list:
        """``seal``, ``sync`` and ``take_synced`` on this thread: the CKs now durable; raises the
        sync's StorageError (the records wait for the next attempt)."""
        self.seal()
        self.sync()
        cks, exc = self.take_synced()
        if exc is not None:
            raise exc
        return cks

    def close(self) -> None:
        with self._io:  # after a sync in progress on another thread
            if self._prior is not None:  # never made (its sync failed): the old file stays current
                self._prior.close()
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1

    def abandon(self) -> None:
        """Drop unflushed records and close (what a killed process leaves behind; for tests)."""
        self._pending = bytearray()
        self._pending_cks = []
        with self._lock:
            self._chunks = []
        if self._prior is not None:
            self._prior.abandon()
        self.close()
