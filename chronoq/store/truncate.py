"""Cutting the commit log back to an offset, crash-safe: a node that rejoins after a failover
(``chronoq.replication.follower``) drops what it wrote past the divergence point.

Everything here runs with the data directory locked and the store closed (``plan`` then
``run``), or while a store opens (``finish``, from ``Store._open``, before the log is read).

On disk, in the data directory:

* ``truncate.json`` (``MARKER``), the intent, written atomically (``fsutil.write_json``: a
  CRC-checked JSON document) before any byte changes, deleted (and the directory fsynced) after
  the last: ``{"version": 1, "offset": S, "log_end": E, "remove": [paths relative to the data
  directory], "aside": "truncated/<S>-<E>.log", "note": "..."}``. Its presence means "the log
  may still hold bytes past S, and the paths in ``remove`` may still exist: do it all again".
* ``truncated/<S, 20 digits>-<E, 20 digits>.log`` (``ASIDE_DIR``): the cut bytes ``[S, E)``
  exactly as they were in the log (whole records, their own CRCs), written atomically before the
  cut, for an operator to inspect (``chronoq`` never reads it back). Not a source, not derived.

``run`` steps, each idempotent, so ``finish`` after a crash anywhere simply runs them again:

1. ``aside``: copy ``[S, E)`` aside unless the file is there (it is written whole or not at all,
   and step 3 comes after it: with the file absent, no byte past S was cut yet);
2. ``remove``: delete every path in ``remove`` (the caller names the derived state that may
   refer to cut bytes and the copies it will receive again; see the caller), fsync their directories;
3. ``cut``: delete the segments whose base is at or past S, truncate the one holding S to
   ``S - base`` (its preallocated zeros with it), fsync it and the directory;
4. ``clear``: delete the marker, fsync the directory.

Ensures after ``run`` or ``finish``: the log ends at or before S (before when it already did: a
torn tail cut by recovery), no path of ``remove`` exists, no marker.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from typing import Callable

from chronoq.core import errors, fsutil
from chronoq.store import record
from chronoq.store.commitlog import SEGMENT_NAME_DIGITS, SEGMENT_SUFFIX

MARKER = "truncate.json"
ASIDE_DIR = "truncated"
VERSION = 1
COMMITLOG_DIR = "commitlog"
_READ_STEP = 4 << 20
# Test hook (tests/crash/test_rejoin_crash.py): called with each step's name as it completes.
fault: Callable[[str], None] | None = None


@dataclass(frozen=True)
class Plan:
    offset: int
    log_end: int
    remove: tuple[str, ...]
    note: str = ""

    @property
    def aside(self) -> str:
        return os.path.join(ASIDE_DIR, f"{self.offset:0{SEGMENT_NAME_DIGITS}d}-{self.log_end:0{SEGMENT_NAME_DIGITS}d}"
                                       f"{SEGMENT_SUFFIX}")


@dataclass(frozen=True)
class CutSummary:
    """What lies in ``[offset, end)`` of a log: for the operator's message (never cut silently)."""
    records: int
    bytes: int
    topics: dict[str, int]  # records per topic


def describe(log, offset: int, end: int) -> CutSummary:
    """Count the records of ``log`` (a ``CommitLog``) in ``[offset, end)`` (``offset`` a record
    boundary), per topic, reading ``_READ_STEP`` bytes at a time."""
    records, topics = 0, {}
    for seg in list(log.segments):
        pos, hi = max(offset, seg.base), min(end, seg.end)
        while pos + record.HEADER_SIZE <= hi:
            data = log.read(pos, min(_READ_STEP, hi - pos))
            at = 0
            while at + record.HEADER_SIZE <= len(data):
                length = int.from_bytes(data[at:at + 4], "little")
                if length < record.HEADER_SIZE:
                    return CutSummary(records, max(0, end - offset), topics)  # (zeros: preallocated)
                if at + length > len(data):
                    break
                topic = _topic(data, at)
                topics[topic] = topics.get(topic, 0) + 1
                records += 1
                at += length
            if at == 0:  # one record longer than a step
                length = int.from_bytes(data[:4], "little")
                topic = _topic(log.read(pos, min(length, record.HEADER_SIZE + 255)), 0)  # (a topic: < 256 bytes)
                topics[topic] = topics.get(topic, 0) + 1
                records += 1
                at = length
            pos += at
    return CutSummary(records, max(0, end - offset), topics)


def _topic(data: bytes, pos: int) -> str:
    tlen = record.HEADER.unpack_from(data, pos)[10]  # (the topic follows the header)
    start = pos + record.HEADER_SIZE
    return bytes(data[start:start + tlen]).decode("utf-8", "replace")


def plan(data_dir: str, p: Plan) -> None:
    """Write the intent (the marker), durable before anything changes."""
    assert 0 <= p.offset <= p.log_end, p
    assert all(not os.path.isabs(r) and ".." not in r.split(os.sep) for r in p.remove), p.remove
    fsutil.write_json(os.path.join(data_dir, MARKER), {
        "version": VERSION, "offset": p.offset, "log_end": p.log_end, "remove": list(p.remove), "note": p.note})
    _step("marker")


def pending(data_dir: str) -> Plan | None:
    """The intent a crash left (None: none). A damaged marker is refused: never guess what to cut."""
    path = os.path.join(data_dir, MARKER)
    try:
        doc = fsutil.read_json(path)
    except ValueError as exc:
        raise errors.CorruptionError(path, 0, f"unreadable truncation marker: {exc}") from None
    if doc is None:
        return None
    if doc.get("version") != VERSION:
        raise errors.CorruptionError(path, 0, f"truncation marker version {doc.get('version')!r}")
    return Plan(int(doc["offset"]), int(doc["log_end"]), tuple(doc["remove"]), str(doc.get("note", "")))


def finish(data_dir: str) -> Plan | None:
    """Complete a truncation a crash interrupted (called before the log opens). Returns its plan."""
    p = pending(data_dir)
    if p is not None:
        run(data_dir, p)
    return p


def run(data_dir: str, p: Plan) -> None:
    """Steps 1-4 of the module docstring. The marker must be written (``plan``)."""
    assert os.path.exists(os.path.join(data_dir, MARKER)), "plan() first"
    _aside(data_dir, p)
    _step("aside")
    for rel in p.remove:
        path = os.path.join(data_dir, rel)
        if os.path.isdir(path):
            shutil.rmtree(path)
        elif os.path.lexists(path):
            os.unlink(path)
        else:
            continue
        fsutil.fsync_dir(os.path.dirname(path))
        _step(f"remove {rel}")
    _step("remove")
    _cut(os.path.join(data_dir, COMMITLOG_DIR), p.offset)
    _step("cut")
    os.unlink(os.path.join(data_dir, MARKER))
    fsutil.fsync_dir(data_dir)
    _step("clear")


def _step(name: str) -> None:
    if fault is not None:
        fault(name)


def _segments(directory: str) -> list[tuple[int, str]]:
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    out = []
    for name in names:
        stem = name[:-len(SEGMENT_SUFFIX)]
        if name.endswith(SEGMENT_SUFFIX) and len(stem) == SEGMENT_NAME_DIGITS and stem.isdigit():
            out.append((int(stem), os.path.join(directory, name)))
    return sorted(out)


def _aside(data_dir: str, p: Plan) -> None:
    target = os.path.join(data_dir, p.aside)
    if os.path.exists(target) or p.offset == p.log_end:
        return
    os.makedirs(os.path.dirname(target), exist_ok=True)
    tmp = f"{target}.tmp"
    with open(tmp, "wb") as out:
        for base, path in _segments(os.path.join(data_dir, COMMITLOG_DIR)):
            with open(path, "rb") as fh:
                lo, hi = max(p.offset, base), min(p.log_end, base + os.fstat(fh.fileno()).st_size)
                fh.seek(max(0, lo - base))
                while lo < hi:
                    chunk = fh.read(min(_READ_STEP, hi - lo))
                    if not chunk:
                        raise errors.StorageError(f"short read of {path} at {lo - base}")
                    out.write(chunk)
                    lo += len(chunk)
        out.flush()
        os.fsync(out.fileno())
    os.replace(tmp, target)
    fsutil.fsync_dir(os.path.dirname(target))


def _cut(directory: str, offset: int) -> None:
    changed = False
    for base, path in reversed(_segments(directory)):
        if base >= offset:
            os.unlink(path)
            changed = True
            continue
        fd = os.open(path, os.O_RDWR)
        try:
            if os.fstat(fd).st_size > offset - base:
                os.ftruncate(fd, offset - base)
                os.fsync(fd)
        finally:
            os.close(fd)
        break
    if changed:
        fsutil.fsync_dir(directory)
    assert all(base < offset for base, _p in _segments(directory)), offset
