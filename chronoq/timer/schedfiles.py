"""The schedule log's files: appends, the append journal, syncing, rollback, quarantine.

The format is ``schedlog``'s; this is the I/O around it, used by ``TimerService`` only. It keeps a
small LRU of append descriptors, remembers which files were written since the last checkpoint
(``dirty``) and which are recorded in the append journal (``journaled``), and syncs them all at a
checkpoint: file by file, or with one ``syncfs`` when many far-future buckets were touched (10k
separate fsyncs would stall the broker for seconds).
"""

from __future__ import annotations

import ctypes
import logging
import os
import shutil
from collections import OrderedDict

from chronoq.core import fsutil
from chronoq.timer import schedlog
from chronoq.timer.schedlog import Damage

log = logging.getLogger("chronoq.timer")

QUARANTINE_DIR = "quarantine"
FD_CACHE_MAX = 256
SYNCFS_MIN_FILES = 16


def _load_syncfs():
    """libc ``syncfs(fd)`` (Linux), or None where it is not available."""
    try:
        fn = ctypes.CDLL(None, use_errno=True).syncfs
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


_SYNCFS = _load_syncfs()


class ScheduleFiles:
    def __init__(self, timer_dir: str, width_ms: int):
        self.timer_dir = timer_dir
        self.dir = os.path.join(timer_dir, schedlog.SCHEDULE_DIR)
        os.makedirs(self.dir, exist_ok=True)
        self.width = width_ms
        self.generation = 0  # of the last checkpoint; stamps the journal's records
        self.damage: list[Damage] = []
        self._fds: OrderedDict[int, int] = OrderedDict()
        self._dirty: set[int] = set()  # written since the last checkpoint, not yet synced
        self._journaled: set[int] = set()  # pre-cycle length recorded in the journal
        self._dir_dirty = False
        self._journal_fd = -1
        self._journal_path = os.path.join(timer_dir, schedlog.JOURNAL_FILE)

    def path(self, start: int, suffix: str = schedlog.PENDING_SUFFIX) -> str:
        return os.path.join(self.dir, schedlog.file_name(start, suffix))

    def size(self, start: int) -> int:
        try:
            return os.path.getsize(self.path(start))
        except FileNotFoundError:
            return 0

    # ----------------------------------------------------------------- start-up repair
    def roll_back(self) -> tuple[int, int]:
        """Cut every file written since the last checkpoint back to its journaled length.

        Returns (bytes cut, files journaled). Those files keep their journal records as the
        rollback points until the next checkpoint.
        """
        intents = schedlog.decode_journal(schedlog.read_file(self._journal_path), self.generation)
        cut = 0
        for start, length in intents.items():
            target = self.path(start)
            try:
                size = os.path.getsize(target)
            except FileNotFoundError:
                continue
            if size > length:
                self._truncate(target, length)
                cut += size - length
        self._journaled = set(intents)
        return cut, len(intents)

    def validate(self, start: int) -> None:
        """S0/S1/S3 by scanning a file (only needed when the timer checkpoint is lost)."""
        path = self.path(start)
        data = schedlog.read_file(path)
        try:
            end, damage = schedlog.validate_tail(path, start, data)
        except schedlog.SchedLogError as exc:
            self.quarantine(path, data, exc.reason)
            return
        if damage is not None:
            self.damage.append(damage)
            log.warning("schedule file %s: cutting a torn tail of %d bytes at %d (it is replayed from the "
                        "commit log)", path, damage.end - damage.start, damage.start)
            self._truncate(path, end)

    @staticmethod
    def _truncate(path: str, length: int) -> None:
        with open(path, "r+b") as fh:
            fh.truncate(length)
            fh.flush()
            os.fsync(fh.fileno())

    def quarantine(self, path: str, data: bytes, reason: str) -> None:
        qdir = os.path.join(self.timer_dir, QUARANTINE_DIR)
        os.makedirs(qdir, exist_ok=True)
        target = os.path.join(qdir, os.path.basename(path))
        shutil.move(path, target)
        fsutil.fsync_dir(self.dir)
        self.damage.append(Damage(path, 0, len(data), f"{reason}; moved to {target}", False))
        log.error("schedule file %s is damaged (%s); moved to %s. Messages in it that are no longer in "
                  "the commit log are lost", path, reason, target)

    # ----------------------------------------------------------------- reading
    def entries(self, start: int) -> bytes:
        """A bucket file's entries (without the header); a bad header quarantines the file (S1)."""
        path = self.path(start)
        data = schedlog.read_file(path)
        if len(data) < schedlog.FILE_HEAD_SIZE:
            return b""
        try:
            schedlog.check_header(data, start)
        except schedlog.SchedLogError as exc:
            self.quarantine(path, data, exc.reason)
            return b""
        return data[schedlog.FILE_HEAD_SIZE:]

    # ----------------------------------------------------------------- writing
    def write(self, items: list[tuple[int, bytes]]) -> None:
        """Append ``blob`` to each bucket ``start`` (page cache). The journal records first the
        length of every file not yet written in this checkpoint cycle, and is fsynced."""
        self._journal([start for start, _ in items if start not in self._journaled])
        for start, blob in items:
            path = self.path(start)
            fd = self._fd(start, path)
            _write_all(fd, blob, path, os.fstat(fd).st_size)
            self._dirty.add(start)

    def _journal(self, starts: list[int]) -> None:
        if not starts:
            return
        path = self._journal_path
        try:
            if self._journal_fd < 0:
                self._journal_fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            blob = b"".join(schedlog.encode_intent(self.generation, start, self.size(start)) for start in starts)
            _write_all(self._journal_fd, blob, path, os.fstat(self._journal_fd).st_size)
            os.fsync(self._journal_fd)
        except OSError as exc:
            raise fsutil.storage_error(exc, path) from exc
        self._journaled.update(starts)

    def _fd(self, start: int, path: str) -> int:
        fd = self._fds.get(start)
        if fd is not None:
            self._fds.move_to_end(start)
            return fd
        try:
            fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            if os.fstat(fd).st_size == 0:
                _write_all(fd, schedlog.encode_header(start, self.width), path, 0)
                self._dir_dirty = True
        except OSError as exc:
            raise fsutil.storage_error(exc, path) from exc
        self._fds[start] = fd
        while len(self._fds) > FD_CACHE_MAX:  # a closed dirty file is synced by path at checkpoint
            _old, old_fd = self._fds.popitem(last=False)
            os.close(old_fd)
        return fd

    def remove(self, start: int) -> None:
        """Delete a finished bucket's file (a file created again at this path journals length 0)."""
        fd = self._fds.pop(start, None)
        if fd is not None:
            os.close(fd)
        self._dirty.discard(start)
        self._journaled.discard(start)
        try:
            os.unlink(self.path(start))
        except FileNotFoundError:
            pass
        self._dir_dirty = True

    def remove_done(self, start: int) -> None:
        try:
            os.unlink(self.path(start, schedlog.DONE_SUFFIX))
        except FileNotFoundError:
            pass
        self._dir_dirty = True

    def write_done(self, start: int, entries: bytes) -> None:
        fsutil.atomic_write(self.path(start, schedlog.DONE_SUFFIX), schedlog.encode_header(start, self.width) + entries)

    # ----------------------------------------------------------------- checkpoints
    def sync(self) -> None:
        """Make every write since the last checkpoint durable (files and the directory)."""
        dirty = sorted(self._dirty)
        if len(dirty) >= SYNCFS_MIN_FILES and _SYNCFS is not None:
            fd = os.open(self.dir, os.O_RDONLY | os.O_DIRECTORY)
            try:
                if _SYNCFS(fd) != 0:
                    err = ctypes.get_errno()
                    raise fsutil.storage_error(OSError(err, os.strerror(err)), self.dir)
            finally:
                os.close(fd)
        else:
            for start in dirty:
                self._fsync(start)
        self._dirty.clear()
        if self._dir_dirty:
            fsutil.fsync_dir(self.dir)
            self._dir_dirty = False

    def _fsync(self, start: int) -> None:
        fd = self._fds.get(start)
        if fd is not None:
            os.fsync(fd)
            return
        try:
            fd = os.open(self.path(start), os.O_RDONLY)
        except FileNotFoundError:
            return  # finished and deleted meanwhile
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def new_generation(self, generation: int) -> None:
        """The checkpoint of ``generation`` is durable: older journal records are void."""
        assert generation == self.generation + 1
        self.generation = generation
        self._journaled.clear()
        if self._journal_fd >= 0:
            os.ftruncate(self._journal_fd, 0)

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
        if self._journal_fd >= 0:
            os.close(self._journal_fd)
            self._journal_fd = -1

    def abandon(self) -> None:
        """Close descriptors without syncing anything (tests simulating ``kill -9``)."""
        self.close()


def _write_all(fd: int, blob: bytes, path: str, size_before: int) -> None:
    view = memoryview(blob)
    try:
        while view:
            view = view[os.write(fd, view):]
    except OSError as exc:
        try:  # never leave half an entry behind: cut back to where this write began
            os.ftruncate(fd, size_before)
        except OSError:
            pass
        raise fsutil.storage_error(exc, path) from exc


class BucketReader:
    """Reads one bucket file's entries a bounded number of bytes per ``step``, into one buffer.

    Loading a bucket ahead must not stall the broker's thread: a minute at 5,000 timers/s is a
    ~70 MB file, and reading it whole (plus copies) held every due delivery for hundreds of ms.
    The file may grow while it is read (buffered entries flushed to it); ``finish`` reads up to
    the end as it is then, so ``finish`` and ``Bucket.begin_load`` (which appends the entries
    still buffered) must run in one step, with no flush in between.
    """

    def __init__(self, files: ScheduleFiles, start: int):
        self.files = files
        self.start = start
        self.path = files.path(start)
        self.fd = -1
        self.data = bytearray()
        self.pos = 0  # bytes of entries read into ``data``
        self.size = 0  # bytes of entries the file held when opened
        try:
            self.fd = os.open(self.path, os.O_RDONLY)
            size = os.fstat(self.fd).st_size
            head = os.pread(self.fd, schedlog.FILE_HEAD_SIZE, 0) if size >= schedlog.FILE_HEAD_SIZE else b""
        except FileNotFoundError:
            self.close()
            return
        except OSError as exc:
            self.close()
            raise fsutil.storage_error(exc, self.path) from exc
        if not head:  # shorter than a header: no entries (as ``ScheduleFiles.entries``)
            self.close()
            return
        try:
            schedlog.check_header(head, start)
        except schedlog.SchedLogError:  # the one-shot path quarantines the file and reports it
            self.close()
            self.data = bytearray(files.entries(start))
            self.pos = self.size = len(self.data)
            return
        # Grown chunk by chunk, not allocated at once: touching ~70 MB of fresh pages in one
        # step is itself a stall of hundreds of ms on a busy host.
        self.size = size - schedlog.FILE_HEAD_SIZE

    def step(self, max_bytes: int) -> bool:
        """Read up to ``max_bytes`` more; True once everything present at the start is read."""
        if self.fd < 0:
            return True
        n = min(max_bytes, self.size - self.pos)
        if n > 0:
            try:
                chunk = os.pread(self.fd, n, schedlog.FILE_HEAD_SIZE + self.pos)
            except OSError as exc:
                raise fsutil.storage_error(exc, self.path) from exc
            self.data += chunk
            self.pos += len(chunk)
            if len(chunk) < n:  # shorter than it was: never expected (only this process writes it)
                self.size = self.pos
        return self.pos >= self.size

    def finish(self) -> bytearray:
        """Everything read, including what was appended to the file meanwhile. Closes the file."""
        while not self.step(1 << 24):
            pass
        if self.fd >= 0:  # a failure leaves the reader as it was: a later ``finish`` retries
            rest: list[bytes] = []
            try:
                end = os.fstat(self.fd).st_size
                offset = schedlog.FILE_HEAD_SIZE + self.pos
                while offset < end:
                    chunk = os.pread(self.fd, end - offset, offset)
                    if not chunk:
                        break
                    rest.append(chunk)
                    offset += len(chunk)
            except OSError as exc:
                raise fsutil.storage_error(exc, self.path) from exc
            for chunk in rest:
                self.data += chunk
            self.pos = len(self.data)
            self.close()
        assert self.pos == len(self.data)
        return self.data

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
