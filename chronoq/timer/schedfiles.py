"""The schedule log's files: appends, the append journal, syncing, rollback, quarantine.

The format is ``schedlog``'s; this is the I/O around it, used by ``TimerService`` only. It keeps a
small LRU of append descriptors, remembers which files were written since the last checkpoint
(``dirty``) and which are recorded in the append journal (``journaled``), and syncs them all at a
checkpoint: file by file, or with one ``syncfs`` when many far-future buckets were touched (10k
separate fsyncs would stall the broker for seconds).

Two fsyncs order writes that follow them: a bucket file is appended to only once its journal
record is durable (a power loss must find the rollback point of every byte appended), and a
finished bucket's file is deleted only once its ``.done`` file (its cancellations, for late
recalls) is durable. Embedded, both fsyncs run in place. Under the server (``defer``, set by
``TimerService.attach_files_syncer``) they run on the committer's fsync thread
(``sync_side``): ``write`` writes the journal records (page cache) and leaves the buckets whose
record is not durable yet to the caller, who writes them once ``take_synced`` says it is;
``write_done`` writes the ``.done`` file without an fsync and the bucket file is deleted once
``remove_finished`` deletes it. A crash in between: the bucket file was not appended to (its
entries come back from the commit log after the cursor), or was not deleted (its bucket is
finished again after the restart, merging the ``.done`` file's entries).

A finished bucket can be made again before its file is deleted: an entry lands in it (a record
written before the bucket's end and absorbed after its finish, once the committer fsynced it).
Its file then holds the first life's entries without those only buffered at the finish, so it
is never appended to: ``write`` leaves such a bucket to the caller (``awaits_deletion``) until
the file is deleted, and the new life's entries go to a new file, journaled at length 0.

A bucket with no file yet has it made on a worker thread (``chronoq.timer.newfiles``, ``defer``
with a ``made`` report): ``write`` leaves it to the caller until ``take_made`` says it is there,
but a write that must happen now (``here``) creates it inline (either create may win: a link).
"""

from __future__ import annotations

import ctypes
import logging
import os
import shutil
import threading
from collections import OrderedDict

from chronoq.core import errors, fsutil
from chronoq.timer import newfiles, schedlog
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
        newfiles.remove_leftovers(self.dir)
        self.width = width_ms
        self.generation = 0  # of the last checkpoint; stamps the journal's records
        self.damage: list[Damage] = []
        self._fds: OrderedDict[int, int] = OrderedDict()
        self._dirty: set[int] = set()  # written since the last checkpoint, not yet synced
        self._journaled: set[int] = set()  # pre-cycle length recorded in the journal
        self._dir_dirty = False
        self._journal_fd = -1
        self._journal_path = os.path.join(timer_dir, schedlog.JOURNAL_FILE)
        # Deferred fsyncs (module docstring). On the loop: ``_intents`` start -> the journal's end
        # after its record (not known durable yet), ``_done_waiting`` start -> the number of its
        # latest ``.done`` write (not known durable yet), ``_removable`` bucket files whose
        # ``.done`` is durable. Shared with ``sync_side``'s thread, under ``_lock``: the journal's
        # end and generation, ``.done`` paths to fsync, what the last ``sync_side`` made durable.
        self.defer = False
        self._lock = threading.Lock()
        self._intents: dict[int, int] = {}
        self._journal_end = 0
        self._done_seq = 0
        self._done_waiting: dict[int, int] = {}
        self._done_paths: list[str] = []
        self._removable: list[int] = []
        self._journal_synced = (0, 0)  # (generation, journal end) durable
        self._done_synced = 0
        self._side_error: BaseException | None = None
        # Files made ahead (``attach_maker``): starts whose file is being made (buffers wait).
        self._maker: newfiles.FileMaker | None = None
        self._making: set[int] = set()
        self._made_unsynced: list[str] = []  # made ahead, not yet fsynced by ``sync`` (under ``_lock``)

    def path(self, start: int, suffix: str = schedlog.PENDING_SUFFIX) -> str:
        return os.path.join(self.dir, schedlog.file_name(start, suffix))

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
            self.quarantine(start, data, exc.reason)
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

    def quarantine(self, start: int, data: bytes, reason: str) -> None:
        path = self.path(start)
        qdir = os.path.join(self.timer_dir, QUARANTINE_DIR)
        os.makedirs(qdir, exist_ok=True)
        target = os.path.join(qdir, os.path.basename(path))
        # A write descriptor kept open for this file would follow it into the quarantine (a rename
        # keeps the inode): entries appended later would land there. Closed, the next write
        # creates the file again, headed.
        fd = self._fds.pop(start, None)
        if fd is not None:
            os.close(fd)
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
            self.quarantine(start, data, exc.reason)
            return b""
        return data[schedlog.FILE_HEAD_SIZE:]

    # ----------------------------------------------------------------- writing
    def write(self, items: list[tuple[int, list[bytes]]], *, here: bool = False) -> list[int]:
        """Append ``chunks`` (in order) to each bucket ``start`` (page cache). The journal records first the
        length of every file not yet written in this checkpoint cycle, and is fsynced before
        the file is appended to: here (embedded, or ``here``), or by ``sync_side`` (``defer``).
        Returns the starts not written: their record is not durable yet (``take_synced``), or
        their file awaits deletion (``awaits_deletion``: written once ``remove_finished`` deleted
        it)."""
        held = [start for start, _ in items if self.awaits_deletion(start)]
        if held:
            items = [(start, chunks) for start, chunks in items if start not in held]
        missing = self._journal([start for start, _ in items
                                 if start not in self._journaled and start not in self._intents])
        inline = here or not self.defer
        if missing and not inline and self._maker is not None:
            self._making.update(self._maker.request([s for s in missing if s not in self._making]))
        if self._intents and inline:
            try:
                os.fsync(self._journal_fd)
            except OSError as exc:
                raise fsutil.storage_error(exc, self._journal_path) from exc
            self._journaled.update(self._intents)
            self._intents.clear()
        waiting = held
        for start, chunks in items:
            if start not in self._journaled or (start in self._making and not inline):
                waiting.append(start)
                continue
            path = self.path(start)
            fd = self._fd(start, path)
            self._making.discard(start)  # (made inline: a later report of the maker is ignored)
            _write_chunks(fd, chunks, path, os.fstat(fd).st_size)
            self._dirty.add(start)
        return waiting

    def _journal(self, starts: list[int]) -> list[int]:
        """Write the journal records of ``starts`` (page cache; ``write`` has them fsynced).
        Returns those with no file yet. A header-only file is journaled at length 0: a crash cuts
        it to 0 bytes (an empty bucket), never keeping a header a power loss may have garbled (a
        file made ahead after a checkpoint's sync)."""
        if not starts:
            return []
        path = self._journal_path
        missing = []
        try:
            if self._journal_fd < 0:
                self._journal_fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            records = []
            for start in starts:
                try:
                    size = os.stat(self.path(start)).st_size
                except FileNotFoundError:
                    size = 0
                    missing.append(start)
                length = size if size > schedlog.FILE_HEAD_SIZE else 0
                records.append(schedlog.encode_intent(self.generation, start, length))
            blob = b"".join(records)
            _write_all(self._journal_fd, blob, path, os.fstat(self._journal_fd).st_size)
        except OSError as exc:
            raise fsutil.storage_error(exc, path) from exc
        with self._lock:
            self._journal_end += len(blob)
            end = self._journal_end
        for start in starts:
            self._intents[start] = end
        return missing

    @property
    def finishing(self) -> bool:
        """Finished buckets' files not deleted yet: their ``.done`` is not known durable, or
        ``remove_finished`` has not deleted them. Such a file lacks the entries that were only
        buffered at the finish (``TimerService._finish``), so no timer checkpoint may complete
        while one is there: a restart past its cursor would load it as a live bucket."""
        return bool(self._done_waiting or self._removable)

    def awaits_deletion(self, start: int) -> bool:
        """A finished bucket's file not deleted yet (``finishing``): what it holds is retired,
        and a bucket made again at ``start`` meanwhile keeps its entries in memory until then."""
        return start in self._done_waiting or start in self._removable

    @property
    def side_waiting(self) -> bool:
        """Journal records or ``.done`` files written and not yet known durable."""
        return bool(self._intents or self._done_waiting)

    def sync_side(self) -> None:
        """fsync the journal and the ``.done`` files written so far, then the directory (any
        thread: the committer's fsync thread runs it after a commit-log fsync that asked for it). Never raises: what
        it made durable, or its error, waits for ``take_synced``."""
        with self._lock:
            generation, end, fd, seq = self.generation, self._journal_end, self._journal_fd, self._done_seq
            paths, self._done_paths = self._done_paths, []
            if not paths and (end == 0 or self._journal_synced == (generation, end)):
                return
        try:
            if end > 0 and self._journal_synced != (generation, end):
                os.fsync(fd)
            for path in paths:
                fsutil.fsync_path(path)
            if paths:
                fsutil.fsync_dir(self.dir)
        except (OSError, errors.StorageError) as exc:
            with self._lock:
                self._done_paths[:0] = paths
                self._side_error = exc
            return
        with self._lock:
            if generation == self.generation:  # else a checkpoint voided those records meanwhile
                self._journal_synced = (generation, end)
            self._done_synced = max(self._done_synced, seq)

    def take_synced(self) -> tuple[list[int], BaseException | None]:
        """(on the loop, after ``sync_side``) The starts whose journal record is now durable: their
        buffers may be written. Buckets whose ``.done`` is durable go to ``remove_finished``."""
        with self._lock:
            (generation, end), seq = self._journal_synced, self._done_synced
            exc, self._side_error = self._side_error, None
        ready = []
        if generation == self.generation:
            ready = [start for start, at in self._intents.items() if at <= end]
            for start in ready:
                del self._intents[start]
            self._journaled.update(ready)
            ready = [start for start in ready if start not in self._making]  # (``take_made`` hands them over)
        for start, n in list(self._done_waiting.items()):
            if n <= seq:
                del self._done_waiting[start]
                self._removable.append(start)
        return ready, exc

    # ----------------------------------------------------------------- files made ahead
    def attach_maker(self, made) -> None:
        """Make new bucket files ahead on a worker thread (``chronoq.timer.newfiles``), ``made()``
        called from it after each batch (thread-safe; then ``take_made`` on this thread). None:
        stop and join that thread; new files are created inline again."""
        self._stop_maker()
        if made is not None:
            self._maker = newfiles.FileMaker(self.dir, self.width, made)

    def _stop_maker(self) -> None:
        maker, self._maker = self._maker, None
        self._making.clear()
        if maker is not None:
            maker.close()
            with self._lock:  # what it made is still fsynced by the next ``sync``
                self._made_unsynced += maker.take_unsynced()

    @property
    def making(self) -> set[int]:
        """Starts whose file is being made ahead (their buffers wait)."""
        return self._making

    def take_made(self) -> list[int]:
        """(on the loop, after ``made()``) The starts whose file is made and whose journal record
        is durable: their buffers may be written. Those whose record is not durable yet come
        back through ``take_synced``."""
        if self._maker is None:
            return []
        made = [start for start in self._maker.take() if start in self._making]
        self._making.difference_update(made)
        return [start for start in made if start in self._journaled]

    def remove_finished(self) -> None:
        """Delete the files of finished buckets whose ``.done`` file is durable; one that fails
        stays for the next call (a bucket made again meanwhile still must not write to it)."""
        removable, self._removable = self._removable, []
        for start in removable:
            try:
                self.remove(start)
            except OSError as exc:
                log.warning("deleting finished schedule bucket %d failed: %s", start, exc)
                self._removable.append(start)

    def _fd(self, start: int, path: str) -> int:
        fd = self._fds.get(start)
        if fd is not None:
            self._fds.move_to_end(start)
            return fd
        assert start in self._journaled, "a bucket file is written only once its journal record is durable"
        try:
            # (read-write: a header-only file's header is checked through the same descriptor)
            fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
            size = os.fstat(fd).st_size
            if size <= schedlog.FILE_HEAD_SIZE and (size < schedlog.FILE_HEAD_SIZE or not _headed(fd, start)):
                if size:
                    self._cut_torn_header(fd, path, size)
                _write_all(fd, schedlog.encode_header(start, self.width), path, 0)
                self._dir_dirty = True
            elif start in self._making:  # made ahead: its directory fsync may not have run yet
                self._dir_dirty = True
        except OSError as exc:
            raise fsutil.storage_error(exc, path) from exc
        self._fds[start] = fd
        while len(self._fds) > FD_CACHE_MAX:  # a closed dirty file is synced by path at checkpoint
            _old, old_fd = self._fds.popitem(last=False)
            os.close(old_fd)
        return fd

    def _cut_torn_header(self, fd: int, path: str, size: int) -> None:
        """S0 met by a write: a file holding no valid header and no entry (a power loss tore its
        creation, and its journal record was not durable either, so start-up's roll-back left it)
        is cut to 0 bytes before the header and entries are written, else they would follow the
        torn bytes and the bucket's load would quarantine them. Nothing is lost: it held no entry.
        Nothing breaks the rollback point: a file of at most a header is journaled at length 0
        (``_journal``), so a crash from here on cuts it to 0 bytes again."""
        assert 0 < size <= schedlog.FILE_HEAD_SIZE
        os.ftruncate(fd, 0)
        self.damage.append(Damage(path, 0, size, "torn file header; cut and written again", True))
        log.warning("schedule file %s: cutting a torn header of %d bytes before writing to it (it held no "
                    "entry)", path, size)

    def remove(self, start: int) -> None:
        """Delete a finished bucket's file (a file created again at this path journals length 0)."""
        if self._maker is not None:  # before the unlink: a file made ahead never lands after it
            self._maker.forget(start)
        self._making.discard(start)
        fd = self._fds.pop(start, None)
        if fd is not None:
            os.close(fd)
        self._dirty.discard(start)
        self._journaled.discard(start)
        self._intents.pop(start, None)
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

    def write_done(self, start: int, entries: bytes) -> bool:
        """Write a finished bucket's ``.done`` file. True: durable now, the bucket file may go;
        False (``defer``): written, fsynced by ``sync_side``, the file goes after that
        (``remove_finished``; a temp file renamed into place, so a crash leaves the old or the
        new one, or, after a power loss before the fsync, a torn one: read as empty, and the
        bucket file, still there, holds its entries)."""
        path = self.path(start, schedlog.DONE_SUFFIX)
        data = schedlog.encode_header(start, self.width) + entries
        if not self.defer:
            fsutil.atomic_write(path, data)
            return True
        tmp = f"{path}.tmp"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                _write_all(fd, data, tmp, 0)
            finally:
                os.close(fd)
            os.replace(tmp, path)
        except OSError as exc:
            raise fsutil.storage_error(exc, path) from exc
        if start in self._removable:  # finished again before its file went: wait for this .done
            self._removable.remove(start)
        with self._lock:
            self._done_seq += 1
            self._done_waiting[start] = self._done_seq
            self._done_paths.append(path)
        return False

    # ----------------------------------------------------------------- checkpoints
    def sync(self) -> None:
        """Make every write since the last checkpoint durable (files and the directory), and
        every file made ahead since then (``chronoq.timer.newfiles``)."""
        dirty = sorted(self._dirty)
        maker = self._maker
        with self._lock:  # (kept until a sync succeeds)
            if maker is not None:
                self._made_unsynced += maker.take_unsynced()
            made = list(self._made_unsynced)
        if made:
            self._dir_dirty = True
        if len(dirty) + len(made) >= SYNCFS_MIN_FILES and _SYNCFS is not None:
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
            for path in made:
                fsutil.fsync_path(path)
        self._dirty.clear()
        with self._lock:
            del self._made_unsynced[:len(made)]
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
        if self._journal_fd >= 0:  # before the new generation is visible to ``sync_side``
            os.ftruncate(self._journal_fd, 0)
        with self._lock:
            self.generation = generation
            self._journal_end = 0
        self._journaled.clear()
        self._intents.clear()

    def close(self) -> None:
        self._stop_maker()
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
        if self._journal_fd >= 0:
            os.close(self._journal_fd)
            self._journal_fd = -1

    def abandon(self) -> None:
        """Close descriptors without syncing anything (tests simulating ``kill -9``)."""
        self.close()


# Buffers one ``writev`` takes at most (POSIX IOV_MAX; Linux's is 1024).
_IOV_MAX = min(os.sysconf("SC_IOV_MAX"), 1024) if hasattr(os, "sysconf") else 16


def _write_chunks(fd: int, chunks: list[bytes], path: str, size_before: int) -> None:
    """``_write_all`` of the chunks one after the other, gathered by ``writev`` (no copy of them
    into one buffer first). A short write (rare on a regular file) goes on from where it stopped."""
    try:
        for first in range(0, len(chunks), _IOV_MAX):
            group = chunks[first:first + _IOV_MAX]
            done = os.writev(fd, group)
            if done < sum(map(len, group)):
                view = memoryview(b"".join(group))[done:]
                while view:
                    view = view[os.write(fd, view):]
    except OSError as exc:
        try:  # never leave half an entry behind: cut back to where this write began
            os.ftruncate(fd, size_before)
        except OSError:
            pass
        raise fsutil.storage_error(exc, path) from exc


def _headed(fd: int, start: int) -> bool:
    """The file starts with ``start``'s valid header (a power loss may leave zeros or garbage in
    a header-only file whose data never reached the disk)."""
    try:
        schedlog.check_header(os.pread(fd, schedlog.FILE_HEAD_SIZE, 0), start)
    except schedlog.SchedLogError:
        return False
    return True


def _write_all(fd: int, blob: bytes, path: str, size_before: int) -> None:
    _write_chunks(fd, [blob], path, size_before)
