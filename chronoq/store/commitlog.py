"""The commit log: append-only segment files holding every record (see ``record.py``).

Files: ``<data>/commitlog/<base offset, 20 digits>.log``. A segment holds the records whose physical
offsets start at its base; offsets are global (base + position), so a record's offset never changes.
A record never spans two segments, nor does an append (one larger than ``segment_bytes`` makes
a segment of its own, as large). A segment is *sealed* once a later one exists; only the newest
(the *active* segment) is ever appended to or truncated.

Durability: ``append`` writes to the page cache only; ``sync`` fsyncs the active segment and returns
the offset that is now durable. A roll fsyncs the old segment, creates the new one and fsyncs the
directory before anything is written to it, so a sealed segment is always complete on disk.

Lost ranges (``lost.json``): byte ranges an operator quarantined after corruption. Readers and the
recovery scan skip them; the damaged bytes are copied to ``quarantine/`` first.
"""

from __future__ import annotations

import bisect
import errno
import mmap
import os
import re
import threading
from dataclasses import dataclass

from chronoq.core import errors, fsutil
from chronoq.store import record

SEGMENT_SUFFIX = ".log"
SEGMENT_NAME_DIGITS = 20
LOST_FILE = "lost.json"
PREALLOCATE_BYTES = 32 * 1024 * 1024
# Upper bounds (ns, inclusive) of the fsync latency histogram (chronoq.server.metrics); one more bucket
# holds everything above. 100 µs (NVMe) to 10 s (a struggling disk).
FSYNC_BOUNDS_NS = tuple(int(ms * 1_000_000) for ms in (
    0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 50, 100, 250, 500, 1_000, 2_500, 5_000, 10_000))


class SyncTimes:
    """Latency of each commit-log fsync: counts per bucket of ``FSYNC_BOUNDS_NS``. Updated under
    the log's sync lock (fsyncs run on a worker thread), read by a metrics scrape."""

    __slots__ = ("counts", "count", "sum_ns")

    def __init__(self) -> None:
        self.counts = [0] * (len(FSYNC_BOUNDS_NS) + 1)
        self.count = 0
        self.sum_ns = 0

    def record(self, elapsed_ns: int) -> None:
        elapsed_ns = max(0, elapsed_ns)
        self.counts[bisect.bisect_left(FSYNC_BOUNDS_NS, elapsed_ns)] += 1
        self.count += 1
        self.sum_ns += elapsed_ns


def segment_name(base: int) -> str:
    return f"{base:0{SEGMENT_NAME_DIGITS}d}{SEGMENT_SUFFIX}"


@dataclass(slots=True)
class Segment:
    base: int
    path: str
    size: int  # bytes of valid data (the file length after recovery)

    @property
    def end(self) -> int:
        return self.base + self.size


@dataclass(slots=True, frozen=True)
class LostRange:
    start: int
    end: int
    path: str
    reason: str


class CommitLog:
    def __init__(self, directory: str, segment_bytes: int, monotonic_ns=None):
        assert segment_bytes >= 4096, "segments smaller than 4 KiB make no sense"
        if monotonic_ns is None:
            from chronoq.core.clock import SYSTEM_CLOCK

            monotonic_ns = SYSTEM_CLOCK.monotonic_ns
        self._monotonic_ns = monotonic_ns  # times fsyncs (``sync_times``)
        self.sync_times = SyncTimes()
        self.directory = directory
        self.segment_bytes = segment_bytes
        os.makedirs(directory, exist_ok=True)
        self.segments: list[Segment] = []
        self._bases: list[int] = []
        self._fds: dict[int, int] = {}
        self._active_fd = -1
        self._allocated = 0  # bytes reserved on disk for the active segment
        self._can_preallocate = True
        self.lost: list[LostRange] = []
        # Offsets: everything below ``synced`` is fsynced; ``written`` is the end of the page cache.
        self.written = 0
        self.synced = 0
        self._sync_lock = threading.Lock()
        self._load_segment_list()

    # ----------------------------------------------------------------- opening
    def _load_segment_list(self) -> None:
        names = sorted(n for n in os.listdir(self.directory) if n.endswith(SEGMENT_SUFFIX))
        for name in names:
            stem = name[: -len(SEGMENT_SUFFIX)]
            if len(stem) != SEGMENT_NAME_DIGITS or not stem.isdigit():
                raise errors.CorruptionError(os.path.join(self.directory, name), 0, "unexpected file name in commitlog/")
            path = os.path.join(self.directory, name)
            self.segments.append(Segment(int(stem), path, os.path.getsize(path)))
        for prev, nxt in zip(self.segments, self.segments[1:]):
            if prev.end > nxt.base:
                raise errors.CorruptionError(prev.path, nxt.base - prev.base, f"segment overlaps {nxt.path}")
        self._bases = [s.base for s in self.segments]
        raw = fsutil.read_json(os.path.join(self.directory, LOST_FILE)) or []
        self.lost = [LostRange(**item) for item in raw]  # type: ignore[arg-type]

    def start_writing(self) -> None:
        """Open the active segment for appends (after recovery has settled its length)."""
        if not self.segments:
            self._create_segment(0)
        active = self.segments[-1]
        self._active_fd = self._fd(active.base)
        self._allocated = os.fstat(self._active_fd).st_size
        self.written = self.synced = active.end

    @property
    def min_offset(self) -> int:
        return self.segments[0].base if self.segments else 0

    @property
    def active(self) -> Segment:
        return self.segments[-1]

    def _fd(self, base: int) -> int:
        fd = self._fds.get(base)
        if fd is None:
            seg = self.segments[self._index(base)]
            fd = os.open(seg.path, os.O_RDWR)
            self._fds[base] = fd
        return fd

    def _index(self, offset: int) -> int:
        i = bisect.bisect_right(self._bases, offset) - 1
        if i < 0:
            raise errors.NotFound(f"commit-log offset {offset} is before the oldest segment ({self.min_offset})")
        return i

    def segment_for(self, offset: int) -> Segment:
        return self.segments[self._index(offset)]

    def _create_segment(self, base: int) -> None:
        """Make the empty segment file at ``base``; it joins ``segments`` only once its directory
        entry is durable, so a failure part way leaves the log as it was."""
        path = os.path.join(self.directory, segment_name(base))
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            # Left by a roll that failed after making it (below): still empty, so it is taken.
            if os.path.getsize(path) != 0:
                raise
            fd = os.open(path, os.O_RDWR)
        try:
            fsutil.fsync_dir(self.directory)
        except BaseException:
            os.close(fd)
            raise
        self._fds[base] = fd
        self.segments.append(Segment(base, path, 0))
        self._bases.append(base)

    # ----------------------------------------------------------------- writing
    def left(self) -> int:
        """Bytes the active segment takes before the next append rolls (``segment_bytes`` is a
        target: a single append larger than that makes a segment of its own, as large)."""
        return max(0, self.segment_bytes - self.segments[-1].size)

    def append(self, blob: bytes, segment_base: int | None = None) -> int:
        """Write ``blob`` (whole records, one append) at the end of the log; return its start offset.

        ``segment_base``: bytes a replica copies from its primary (``chronoq.replication``) go
        into the segment they belong to there, so segments roll where the primary's did (at that
        base, which is the active segment's end), never by size; an empty log starts at that base
        (a primary whose oldest segments retention deleted)."""
        assert self._active_fd >= 0, "start_writing() first"
        active = self.segments[-1]
        if segment_base is not None and segment_base != active.base:
            if active.size == 0 and len(self.segments) == 1 and segment_base > active.base:
                self._restart_empty_at(segment_base)
            elif segment_base == active.end:
                self._roll()
            else:
                raise errors.ClientError(f"bytes of segment {segment_base} cannot follow the active segment "
                                         f"{active.base}..{active.end}")
            active = self.segments[-1]
        elif segment_base is None and active.size and active.size + len(blob) > self.segment_bytes:
            self._roll()
            active = self.segments[-1]
        pos = active.size
        if pos + len(blob) > self._allocated:
            self._preallocate(active, pos + len(blob))
        try:
            n = os.pwrite(self._active_fd, blob, pos)
            pos += n
            if n < len(blob):  # a short write (rare): the rest, until all of it is written
                view = memoryview(blob)[n:]
                while view:
                    n = os.pwrite(self._active_fd, view, pos)
                    view = view[n:]
                    pos += n
        except OSError as exc:
            # Cut off whatever part of the batch reached the file so the log stays whole.
            self._truncate_quiet(active.size)
            raise fsutil.storage_error(exc, active.path) from exc
        start = active.end
        active.size = pos
        self.written = active.end
        return start

    def _preallocate(self, active: Segment, needed: int) -> None:
        """Reserve file space ahead of the writes.

        Appending into already-allocated blocks is ~10x cheaper on ext4 than growing the file
        with every write (measured 0.35 vs 3.4 GB/s here), and a full disk is refused here, before
        any byte of the batch is written. The zero tail this leaves is cut at seal and at close,
        and recovery treats an all-zero tail as free space, not as lost data.
        """
        target = min(max(needed, self._allocated + PREALLOCATE_BYTES), max(needed, self.segment_bytes))
        if self._can_preallocate:
            try:
                os.posix_fallocate(self._active_fd, self._allocated, target - self._allocated)
            except OSError as exc:
                if exc.errno in (errno.EOPNOTSUPP, errno.EINVAL):
                    self._can_preallocate = False
                else:
                    raise fsutil.storage_error(exc, active.path) from exc
        self._allocated = target if self._can_preallocate else 0

    def _truncate_quiet(self, size: int) -> None:
        try:
            os.ftruncate(self._active_fd, size)
            self._allocated = size
        except OSError:
            pass

    def _seal_active(self) -> None:
        """Cut the preallocated zero tail of the active segment and fsync it."""
        seg = self.segments[-1]
        if self._allocated > seg.size:
            os.ftruncate(self._active_fd, seg.size)
        os.fsync(self._active_fd)
        self._allocated = seg.size
        self.synced = max(self.synced, seg.end)

    def _roll(self) -> None:
        # Either every step is done or the active segment stays the old one (sealed or not, a
        # later roll redoes the rest): the batch that needed the roll is refused, nothing else.
        old = self.segments[-1]
        try:
            self._seal_active()
            self._create_segment(old.end)
        except OSError as exc:
            raise fsutil.storage_error(exc, self.directory) from exc
        self._active_fd = self._fds[old.end]
        self._allocated = 0
        assert self.segments[-1].base == old.end and self.segments[-1].size == 0

    def _restart_empty_at(self, base: int) -> None:
        """Replace the empty only segment by an empty one at ``base`` (a replica whose primary's
        log no longer starts at 0): the new file is durable before the old one goes."""
        old = self.segments[-1]
        assert old.size == 0 and len(self.segments) == 1 and base > old.base
        try:
            self._create_segment(base)
            self.segments.pop(0)
            self._bases.pop(0)
            os.close(self._fds.pop(old.base))
            os.unlink(old.path)
            fsutil.fsync_dir(self.directory)
        except OSError as exc:
            raise fsutil.storage_error(exc, self.directory) from exc
        self._active_fd = self._fds[base]
        self._allocated = 0
        self.written = self.synced = base

    def sync(self) -> int:
        """fsync what has been written; return the offset now durable. Safe from another thread."""
        with self._sync_lock:
            fd, target = self.fsync_ask()
            if fd < 0:
                return self.synced
            began_ns = self._monotonic_ns()
            try:
                os.fsync(fd)
            except OSError as exc:
                raise fsutil.storage_error(exc, self.directory) from exc
            return self.fsynced(target, self._monotonic_ns() - began_ns)

    def fsync_ask(self) -> tuple[int, int]:
        """``sync`` on another thread, asked from the writers' thread: (the descriptor to fsync,
        or -1 when everything written is durable already; the written end it will cover). Its
        outcome comes back through ``fsynced`` (``chronoq.store.fsyncer``)."""
        target = self.written
        return (self._active_fd if target > self.synced else -1), target

    def fsynced(self, target: int, took_ns: int) -> int:
        """An fsync asked with ``fsync_ask`` is done: everything below ``target`` is durable.
        Returns the offset now durable."""
        if target > self.synced:  # (else nothing was fsynced: -1 was asked)
            if took_ns >= 0:  # (< 0: covered by the fsync reported before it, timed there)
                self.sync_times.record(took_ns)
            self.synced = target
        return self.synced

    def fsync_failed(self, err: int) -> errors.StorageError:
        """What an fsync asked with ``fsync_ask`` that failed with ``err`` (an errno) raises."""
        return fsutil.storage_error(OSError(err, os.strerror(err)), self.directory)

    def truncate_active(self, size: int) -> None:
        """Cut the active segment to ``size`` bytes (torn-tail repair during recovery)."""
        seg = self.segments[-1]
        assert 0 <= size <= os.path.getsize(seg.path)
        fd = self._fd(seg.base)
        os.ftruncate(fd, size)
        os.fsync(fd)
        seg.size = size

    # ----------------------------------------------------------------- reading
    def read(self, offset: int, size: int) -> bytes:
        seg = self.segment_for(offset)
        pos = offset - seg.base
        if pos + size > seg.size:
            raise errors.NotFound(f"commit-log range {offset}+{size} is past the end of {seg.path}")
        data = os.pread(self._fd(seg.base), size, pos)
        if len(data) != size:
            raise errors.StorageError(f"short read at {offset} in {seg.path}")
        return data

    def read_record(self, offset: int, size: int) -> bytes:
        """Read and validate one record; corruption names the file and offset."""
        data = self.read(offset, size)
        try:
            length = record.check(data, 0, len(data))
        except record.RecordError as exc:
            seg = self.segment_for(offset)
            raise errors.CorruptionError(seg.path, offset - seg.base, exc.reason) from None
        if length != size:
            seg = self.segment_for(offset)
            raise errors.CorruptionError(seg.path, offset - seg.base, "record length disagrees with its index entry")
        return data

    def is_lost(self, offset: int) -> bool:
        return any(r.start <= offset < r.end for r in self.lost)

    def map_segment(self, seg: Segment) -> mmap.mmap | bytes:
        """The segment read-only in memory (search it with ``find_in``, not its ``find``)."""
        if seg.size == 0:
            return b""
        return mmap.mmap(self._fd(seg.base), seg.size, access=mmap.ACCESS_READ)

    # ----------------------------------------------------------------- lost ranges
    def quarantine(self, seg: Segment, start_pos: int, end_pos: int, reason: str) -> LostRange:
        qdir = os.path.join(os.path.dirname(self.directory), "quarantine")
        os.makedirs(qdir, exist_ok=True)
        data = os.pread(self._fd(seg.base), end_pos - start_pos, start_pos)
        dump = os.path.join(qdir, f"{segment_name(seg.base)}.{start_pos}-{end_pos}.bin")
        fsutil.atomic_write(dump, data)
        lost = LostRange(seg.base + start_pos, seg.base + end_pos, seg.path, reason)
        self.lost.append(lost)
        fsutil.write_json(
            os.path.join(self.directory, LOST_FILE),
            [{"start": r.start, "end": r.end, "path": r.path, "reason": r.reason} for r in self.lost],
        )
        return lost

    # ----------------------------------------------------------------- retention
    def delete_before(self, offset: int) -> list[Segment]:
        """Delete sealed segments that end at or before ``offset``. Never the active one."""
        deleted = []
        while len(self.segments) > 1 and self.segments[0].end <= offset:
            seg = self.segments.pop(0)
            self._bases.pop(0)
            fd = self._fds.pop(seg.base, None)
            if fd is not None:
                os.close(fd)
            os.unlink(seg.path)
            deleted.append(seg)
        if deleted:
            fsutil.fsync_dir(self.directory)
        return deleted

    def close(self) -> None:
        if self._active_fd >= 0:
            self._seal_active()
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
        self._active_fd = -1


def find_in(buf, needle: bytes, start: int, end: int | None = None) -> int:
    """``buf.find(needle, start, end)`` for a ``map_segment`` mapping (or bytes), by ``re``:
    CPython 3.11.2's mmap.find (Debian 12's python3) reads past the mapping's end when the search
    runs to it, and a full segment's mapping ends on a page boundary: recovery died of SIGSEGV
    there (tests/unit/test_torn_append.py under 3.11.2; 3.11.7 is fixed)."""
    found = re.compile(re.escape(needle)).search(buf, start, len(buf) if end is None else end)
    return -1 if found is None else found.start()
