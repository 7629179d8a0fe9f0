"""One process per data directory: an exclusive ``flock`` on ``<data_dir>/LOCK``.

Two brokers on one directory each append to "their" active segment and overwrite each other's
checkpoint, topics and offsets: acknowledged messages and committed offsets are lost. So every
opener takes this lock before it reads anything in the directory, and a second opener, in this
process or another, is refused at once with ``errors.DataDirLocked`` (naming the directory and
the holder's PID). ``Store`` takes it when it is not handed one (so nothing that opens the store
can bypass it); ``Broker`` takes it itself and hands it to its ``Store``, so that it covers the
files the broker writes after the store closed (``offsets.json``).

On-disk format of ``LOCK`` (the lock is the ``flock``, never the file's content)::

    <holder PID, decimal ASCII>\\n

written by the holder right after it locked the file, and truncated to empty when it releases it
(a clean close). The content is informational and read best-effort, only to name the holder in
the refusal: it may still show a dead holder's PID (killed, so never truncated; its lock was
dropped by the kernel with its last descriptor, so it blocks nobody) or be empty (a new holder
between its ``flock`` and its write). The file itself is never deleted: a process that opened
the old file could otherwise lock it while another locks a new one, and both would run.

The descriptor is opened with ``O_CLOEXEC`` and closed in a child after ``fork`` (without
unlocking: the child's copy shares the parent's lock, and ``LOCK_UN`` there would drop it for
the parent too), so the lock never outlives the process that took it. ``flock`` locks the
file (inode), not the path: symlinks and relative paths to one directory find the same lock.
Locks taken through two ``open`` calls conflict even within one process, so a second ``Broker``
on a directory an open one holds is refused too.

Read-only tools would not need the lock, but none exists: every ``chronoq`` command but
``serve`` talks to a running broker over gRPC and opens no data directory. (A probe must not
take even a shared lock: for as long as it held it, a starting broker would be refused.)
"""

from __future__ import annotations

import fcntl
import os
import weakref

from chronoq.core import errors

LOCK_FILE = "LOCK"
_PID_MAX_BYTES = 32

# Locks this process holds, for the fork hook (a WeakSet: a lock dropped without release closes
# its descriptor when collected).
_held: "weakref.WeakSet[DirLock]" = weakref.WeakSet()


class DirLock:
    """The exclusive lock on one data directory; ``acquire`` takes it, ``release`` gives it back."""

    def __init__(self, data_dir: str, fd: int):
        self.data_dir = data_dir
        self.path = os.path.join(data_dir, LOCK_FILE)
        self._fd = fd

    @classmethod
    def acquire(cls, data_dir: str) -> "DirLock":
        """Lock ``data_dir`` (which must exist) or raise ``errors.DataDirLocked`` at once."""
        path = os.path.join(data_dir, LOCK_FILE)
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as exc:
            raise errors.StorageError(f"cannot open the lock file {os.path.abspath(path)}: {exc.strerror}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            pid = _read_pid(fd)
            mine = _held_here(fd)
            os.close(fd)
            raise errors.DataDirLocked(os.path.abspath(data_dir), os.path.abspath(path), pid, mine) from None
        except OSError as exc:  # e.g. ENOLCK: a file system without locks; refuse rather than risk two writers
            os.close(fd)
            raise errors.StorageError(f"cannot lock {os.path.abspath(path)}: {exc.strerror}; chronoq needs "
                                      "flock on its data directory to keep a second process out") from None
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, b"%d\n" % os.getpid(), 0)
        except OSError:  # the PID is informational; the lock is what counts
            pass
        lock = cls(data_dir, fd)
        _held.add(lock)
        return lock

    @property
    def held(self) -> bool:
        return self._fd >= 0

    def release(self) -> None:
        """Empty the file and unlock it. Idempotent."""
        fd, self._fd = self._fd, -1
        if fd < 0:
            return
        _held.discard(self)
        try:
            os.ftruncate(fd, 0)
        except OSError:
            pass
        try:
            fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)

    def _forget_in_child(self) -> None:
        fd, self._fd = self._fd, -1
        if fd >= 0:
            try:
                os.close(fd)  # closing a copy: the parent's lock stays
            except OSError:
                pass

    def __del__(self) -> None:
        fd, self._fd = getattr(self, "_fd", -1), -1
        if fd >= 0:
            try:
                os.close(fd)  # the kernel drops the lock with the last descriptor
            except OSError:
                pass

    def __repr__(self) -> str:
        return f"DirLock({self.data_dir!r}, held={self.held})"


def _read_pid(fd: int) -> int | None:
    try:
        text = os.pread(fd, _PID_MAX_BYTES, 0).decode("ascii").strip()
        pid = int(text)
    except (OSError, ValueError):
        return None
    return pid if pid > 0 else None


def _held_here(fd: int) -> bool:
    """Whether a lock this process holds is on the file ``fd`` is open on (PIDs are no proof: a
    holder in another PID namespace, e.g. a container sharing the volume, may have ours)."""
    try:
        st = os.fstat(fd)
        return any((os.fstat(lock._fd).st_dev, os.fstat(lock._fd).st_ino) == (st.st_dev, st.st_ino)
                   for lock in list(_held) if lock.held)
    except OSError:
        return False


def _after_fork_in_child() -> None:
    for lock in list(_held):
        lock._forget_in_child()
    _held.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)
