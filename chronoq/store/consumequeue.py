"""Consume queues: per (topic, queue id), a dense index of that queue's messages in the log.

Files: ``<data>/consumequeue/<topic>/<queue id>/<first logical offset, 20 digits>.cq``. Each file
holds ``entries_per_file`` fixed-size entries; entry *n* lives in file ``n // entries_per_file`` at
byte ``(n % entries_per_file) * ENTRY_SIZE``, so reading logical offset *n* is one seek.

Entry layout (24 bytes, little-endian)::

    off  size  field
      0     8  commit_offset  u64, physical offset of the record in the commit log
      8     4  size           u32, record length in bytes (never 0 for a real entry)
     12     4  tag_hash       u32, CRC-32 of the UTF-8 tag (0 for no tag)
     16     8  time_ms        i64, deliver-at for delayed records, else the stored time

A consume queue is derived data: the dispatcher writes entry *n* at the position the record's own
``queue_offset`` names, so replaying the log over existing files is idempotent, and a lost file is
rebuilt by replaying the log. All-zero entries at the end of a file are unwritten space (a crash
after the file grew) and are ignored.

Holds (in memory only): an entry of a HELD record (a timer copy written ahead of its due time,
``record.FLAG_HELD``) is *held* until the timer releases it at its due time: readers (``get``,
``visible_next``) stop before the first held entry, so offsets stay dense and in log order and
nothing behind a held copy is read before it. The store rebuilds holds on open from the entries'
times (``Store._restore_holds``).
"""

from __future__ import annotations

import os
import struct

from chronoq.core import fsutil
from chronoq.store.fdbudget import FdBudget
from chronoq.store.heldentries import HeldEntries

ENTRY = struct.Struct("<QIIq")
ENTRY_SIZE = 24
assert ENTRY.size == ENTRY_SIZE
CQ_SUFFIX = ".cq"
_ZERO_ENTRY = bytes(ENTRY_SIZE)
DIR_INDEX = -1  # ``take_dirty``'s index for the queue's directory


def create_file(directory: str, path: str) -> int:
    """Create the consume-queue file ``path`` (empty) in ``directory``, the directories too;
    return a read-write descriptor. Where the first file of a queue is made, on whichever thread
    (``ConsumeQueue._fd``, ``chronoq.store.newqueues``): an existing file is opened as it is."""
    os.makedirs(directory, exist_ok=True)
    return os.open(path, os.O_RDWR | os.O_CREAT, 0o644)


class ConsumeQueue:
    def __init__(self, directory: str, topic: str, queue_id: int, entries_per_file: int,
                 budget: FdBudget | None = None):
        assert entries_per_file > 0
        self.topic = topic
        self.queue_id = queue_id
        self.directory = directory
        self.per_file = entries_per_file
        self.file_bytes = entries_per_file * ENTRY_SIZE
        self._fds: dict[int, int] = {}  # file index -> fd (the store's ``budget`` may close any)
        self._budget = budget
        # A file was made since the directory's last fsync. Derived data: until a checkpoint names
        # its entries (after syncing the directory: ``take_dirty``) a lost file is rebuilt from the log.
        self._dir_unsynced = False
        self._dirty: set[int] = set()
        self.min_offset = 0
        self.next_offset = 0  # one past the last valid entry
        # (queue offset, due ms) of held entries, offsets ascending; readers stop at the first.
        self.held = HeldEntries()
        self.has_files = False  # a file of it is on disk (``_load`` found one, or one was made since)
        self._load()

    def _path(self, index: int) -> str:
        return os.path.join(self.directory, f"{index * self.per_file:020d}{CQ_SUFFIX}")

    def _load(self) -> None:
        if not os.path.isdir(self.directory):
            return
        indexes = sorted(
            int(n[: -len(CQ_SUFFIX)]) // self.per_file for n in os.listdir(self.directory) if n.endswith(CQ_SUFFIX)
        )
        if not indexes:
            return
        self.has_files = True
        last = indexes[-1]
        size = os.path.getsize(self._path(last))
        count = min(size // ENTRY_SIZE, self.per_file)
        # Trailing zero entries are space the file system allocated but we never wrote.
        if count:
            fd = self._fd(last)
            data = os.pread(fd, count * ENTRY_SIZE, 0)
            while count and data[(count - 1) * ENTRY_SIZE:count * ENTRY_SIZE] == _ZERO_ENTRY:
                count -= 1
        self.next_offset = last * self.per_file + count
        self.min_offset = indexes[0] * self.per_file
        first_fd = self._fd(indexes[0])
        # Skip leading zero entries of the first file (a queue that began after retention).
        head = os.pread(first_fd, min(os.path.getsize(self._path(indexes[0])), self.file_bytes), 0)
        i = 0
        while i * ENTRY_SIZE < len(head) and head[i * ENTRY_SIZE:(i + 1) * ENTRY_SIZE] == _ZERO_ENTRY:
            i += 1
        self.min_offset = min(indexes[0] * self.per_file + i, self.next_offset)

    def _fd(self, index: int) -> int:
        fd = self._fds.get(index)
        if fd is None:
            path = self._path(index)
            try:  # (one syscall when it exists: the budget reopens files it closed, or it was made ahead)
                fd = os.open(path, os.O_RDWR)
            except FileNotFoundError:
                fd = create_file(self.directory, path)
                # its directory entry is fsynced with the file, by the next checkpoint
                self._dir_unsynced = True
            self.has_files = True
            self._fds[index] = fd
            if self._budget is not None:
                self._budget.opened(self, index)
        return fd

    def path_for(self, offset: int) -> str:
        """The path of the file that holds entry ``offset``."""
        return self._path(offset // self.per_file)

    def first_file_made(self) -> None:
        """Its first file was made by another thread (``chronoq.store.newqueues``): the next
        checkpoint fsyncs the directory that names it, as after a create here."""
        self.has_files = True
        self._dir_unsynced = True

    def _evict(self, index: int) -> None:
        """The budget closes file ``index`` (still dirty, if it was: ``sync`` opens it again)."""
        fd = self._fds.pop(index, None)
        if fd is not None:
            os.close(fd)

    def put(self, first_offset: int, entries: bytes) -> None:
        """Write consecutive entries starting at logical ``first_offset`` (positional, idempotent)."""
        assert len(entries) % ENTRY_SIZE == 0 and entries
        n = len(entries) // ENTRY_SIZE
        done = 0
        while done < n:
            logical = first_offset + done
            index, slot = divmod(logical, self.per_file)
            take = min(n - done, self.per_file - slot)
            chunk = memoryview(entries)[done * ENTRY_SIZE:(done + take) * ENTRY_SIZE]
            pos = slot * ENTRY_SIZE
            try:
                fd = self._fd(index)
                self._dirty.add(index)
                while chunk:  # a short write (a full disk) must not pass for a whole one
                    written = os.pwrite(fd, chunk, pos)
                    chunk, pos = chunk[written:], pos + written
            except OSError as exc:  # nothing counts as written: the caller retries the whole put
                raise fsutil.storage_error(exc, self._path(index)) from exc
            done += take
        if self.next_offset == self.min_offset:  # the queue was empty: it starts here
            self.min_offset = first_offset
        elif first_offset < self.min_offset:  # a rebuild restored entries before the start
            self.min_offset = first_offset
        self.next_offset = max(self.next_offset, first_offset + n)

    @property
    def visible_next(self) -> int:
        """One past the last entry readers may see: the first held entry, or ``next_offset``."""
        held = self.held
        if held and held.first_offset() < self.next_offset:
            return held.first_offset()
        return self.next_offset

    def hold(self, offset: int, due_ms: int) -> None:
        """Hide the entry at ``offset`` (and every later one) from readers until ``release``."""
        if self.held and self.held.last_offset() >= offset:  # already held (a replay): offsets only grow
            return
        self.held.append(offset, due_ms)

    def release(self, now_ms: int) -> bool:
        """Release held entries due at or before ``now_ms``, from the first on (a later-due hold
        keeps what follows it hidden). Returns whether any was released."""
        return self.held.release(now_ms)

    def get(self, offset: int, max_entries: int) -> bytes:
        """Visible entries from logical ``offset`` (at most ``max_entries``, never crossing a file)."""
        end = self.visible_next
        if offset < self.min_offset or offset >= end or max_entries <= 0:
            return b""
        return self.read_including_held(offset, min(max_entries, end - offset))

    def read_including_held(self, offset: int, count: int) -> bytes:
        """Entries from ``offset`` up to ``next_offset``, held or not (recovery, the store's own
        bookkeeping); at most ``count``, never crossing a file."""
        index, slot = divmod(offset, self.per_file)
        take = min(count, self.next_offset - offset, self.per_file - slot)
        return os.pread(self._fd(index), take * ENTRY_SIZE, slot * ENTRY_SIZE)

    def truncate(self, next_offset: int) -> None:
        """Drop entries at and beyond ``next_offset`` (they point past the recovered log)."""
        if next_offset >= self.next_offset:
            return
        index, slot = divmod(next_offset, self.per_file)
        for i in sorted(self._known_indexes()):
            if i > index:
                self._remove_file(i)
        if os.path.exists(self._path(index)):
            fd = self._fd(index)
            os.ftruncate(fd, slot * ENTRY_SIZE)
            os.fsync(fd)
        self.next_offset = next_offset
        self.min_offset = min(self.min_offset, next_offset)
        self.held.drop_from(next_offset)

    def _end_at(self, offset: int) -> int:
        raw = self.read_including_held(offset, 1)
        phys, size, _, _ = ENTRY.unpack(raw)
        return phys + size

    def truncate_past(self, log_end: int) -> None:
        """Drop trailing entries whose record ends beyond ``log_end`` (recovery row R9)."""
        lo, hi = self.min_offset, self.next_offset
        if lo == hi or self._end_at(hi - 1) <= log_end:
            return
        while lo < hi:  # entries are in log order: binary-search the first one past the end
            mid = (lo + hi) // 2
            if self._end_at(mid) > log_end:
                hi = mid
            else:
                lo = mid + 1
        self.truncate(lo)

    def is_whole(self) -> bool:
        """False when a file between the first and the last is missing or short (row R8).

        Entries are written densely, so every file but the last is full once a later one exists;
        anything else means files were lost or cut, and the queue has to be rebuilt.
        """
        indexes = sorted(self._known_indexes())
        if not indexes:
            return True
        if indexes != list(range(indexes[0], indexes[-1] + 1)):
            return False
        return all(os.path.getsize(self._path(i)) >= self.file_bytes for i in indexes[:-1])

    def _known_indexes(self) -> list[int]:
        if not os.path.isdir(self.directory):
            return []
        return [int(n[: -len(CQ_SUFFIX)]) // self.per_file for n in os.listdir(self.directory) if n.endswith(CQ_SUFFIX)]

    def _remove_file(self, index: int) -> None:
        fd = self._fds.pop(index, None)
        if fd is not None:
            os.close(fd)
            if self._budget is not None:
                self._budget.closed(self, index)
        self._dirty.discard(index)
        try:
            os.unlink(self._path(index))
        except FileNotFoundError:
            pass

    def delete_below(self, commit_offset: int) -> int:
        """Delete whole files whose every entry points below ``commit_offset``; return count."""
        if (self.min_offset // self.per_file + 1) * self.per_file >= self.next_offset:
            return 0  # one file holds every entry: it is the last, never deleted (no listdir for it)
        removed = 0
        for index in sorted(self._known_indexes()):
            file_end = (index + 1) * self.per_file
            # Never delete the file holding the last entry (even when it is full): reopening
            # derives next_offset from the last file, so deleting it would reuse queue offsets.
            if file_end >= self.next_offset:
                break
            last = os.pread(self._fd(index), ENTRY_SIZE, self.file_bytes - ENTRY_SIZE)
            if len(last) < ENTRY_SIZE:
                break
            phys, size, _, _ = ENTRY.unpack(last)
            if phys + size > commit_offset:
                break
            self._remove_file(index)
            self.min_offset = file_end
            removed += 1
        return removed

    def sync(self) -> None:
        for index in list(self._dirty):
            fd = self._fds.get(index)
            if fd is not None:
                os.fsync(fd)
            else:  # closed by the budget since it was written
                fsutil.fsync_path(self._path(index))
        self._dirty.clear()
        if self._dir_unsynced:
            fsutil.fsync_dir(self.directory)
            self._dir_unsynced = False

    def take_dirty(self) -> list[tuple[int, str]]:
        """(index, path) of the files written since the last sync, then ``(DIR_INDEX, the
        directory)`` when a file was made since its last fsync; they count as clean from now on
        (the caller syncs them by path, from any thread, in this order, or gives them back with
        ``mark_dirty`` when that failed)."""
        taken = [(index, self._path(index)) for index in sorted(self._dirty)]
        self._dirty.clear()
        if self._dir_unsynced:
            taken.append((DIR_INDEX, self.directory))
            self._dir_unsynced = False
        return taken

    def mark_dirty(self, indexes) -> None:
        for index in indexes:
            if index == DIR_INDEX:
                self._dir_unsynced = True
            else:
                self._dirty.add(index)

    def close(self) -> None:
        for index, fd in self._fds.items():
            os.close(fd)
            if self._budget is not None:
                self._budget.closed(self, index)
        self._fds.clear()
