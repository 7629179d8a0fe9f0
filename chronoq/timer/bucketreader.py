"""Reading one bucket file in bounded steps while the timer goes on (``BucketReader``).

Used by the timer's load-ahead (``chronoq.timer.bucketlife``) and retention's roll
(``chronoq.timer.roll``). The file's format is ``schedlog``'s; the file itself is
``ScheduleFiles``' (``chronoq.timer.schedfiles``), which may append to it while it is read.
"""

from __future__ import annotations

import os

from chronoq.core import fsutil
from chronoq.timer import schedlog
from chronoq.timer.schedfiles import ScheduleFiles


class BucketReader:
    """Reads one bucket file's entries a bounded number of bytes per ``step``, into one buffer.

    Loading a bucket ahead must not stall the broker's thread: a minute at 5,000 timers/s is a
    ~70 MB file, and reading it whole (plus copies) held every due delivery for hundreds of ms.
    The file may grow while it is read (buffered entries flushed to it), from 0 bytes too (a file
    the start-up roll-back cut), or from a torn header (the first write cuts it to 0 bytes and
    writes the header, ``ScheduleFiles._fd``); ``finish`` reads up to the end as it is then, so ``finish`` and
    ``Bucket.begin_load`` (which appends the entries still buffered) must run in one step, with no
    flush in between.

    ``strict``: a bad file header raises ``SchedLogError`` instead of quarantining the file
    (retention's roll, ``chronoq.timer.roll``: a bucket it cannot read stops its pass, so the
    commit log keeps what the file may have held).
    """

    def __init__(self, files: ScheduleFiles, start: int, strict: bool = False):
        self.files = files
        self.start = start
        self.path = files.path(start)
        self.fd = -1
        self.data = bytearray()
        self.pos = 0  # bytes of entries read into ``data``
        self.size = 0  # bytes of entries the file held when opened
        self.strict = strict
        self.headed = False  # the file held a header (once it does, ``size`` counts past it)
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
        self.headed = bool(head)
        if not head:
            # Shorter than a header: no entries yet (as ``ScheduleFiles.entries``), but a flush may
            # still write the header and entries to it (a 0-byte file is what a roll-back leaves; a
            # torn one is cut to 0 bytes by that flush first):
            # the file stays open and ``finish`` reads what it holds by then.
            return
        if not self._check(head):
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

    def _check(self, head: bytes) -> bool:
        """The header is the bucket's; else the file is closed and, unless ``strict`` (which
        raises), quarantined and reported by the one-shot path (its entries, if any, taken)."""
        try:
            schedlog.check_header(head, self.start)
        except schedlog.SchedLogError:
            self.close()
            if self.strict:
                raise
            self.data = bytearray(self.files.entries(self.start))
            self.pos = self.size = len(self.data)
            return False
        return True

    def finish(self) -> bytearray:
        """Everything read, including what was appended to the file meanwhile. Closes the file."""
        while not self.step(1 << 24):
            pass
        if self.fd >= 0 and not self.headed:  # (opened shorter than a header: written since?)
            try:
                head = os.pread(self.fd, schedlog.FILE_HEAD_SIZE, 0)
            except OSError as exc:
                raise fsutil.storage_error(exc, self.path) from exc
            if len(head) < schedlog.FILE_HEAD_SIZE:
                self.close()
            elif self._check(head):
                self.headed = True
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
