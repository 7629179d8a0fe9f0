"""The fsync thread: fsyncs the commit log when rung, reports each fsync through a pipe.

The committer (``chronoq.broker.committer``) owns *when* to fsync and what an fsync answers; this
module owns the thread that waits on the device. It is a shell with no policy: a request names a
file descriptor and an opaque target, the report hands the target back with the fsync's outcome.

Requests and reports are fixed-size records on two pipes, one each way (no shared state, no lock;
the kernel orders them), each three native signed 64-bit integers:

    request  (event loop -> thread)  fd       what to fsync (NOTHING: no fsync, STOP: end the thread)
                                     target   handed back in the report (the committer's log offset)
                                     flags    IN_PYTHON: the round runs in Python; RUN_LOGS (with
                                              IN_PYTHON): the second-tier syncs after the fsync
    report   (thread -> event loop)  target   the request's
                                     errno    0: done; else the fsync's error number
                                     took_ns  the fsync's duration (CLOCK_MONOTONIC); COVERED (-1):
                                              served by the fsync reported just before

A pipe write of up to PIPE_BUF bytes is atomic, so records are read whole or not at all. The loop
watches ``reports`` (``loop.add_reader``) and reads every report waiting (``take``). The committer
has at most a few requests outstanding (``committer.AHEAD``), so neither pipe holds more than that.

The thread reads every request waiting, and one fsync serves a run of plain requests for the same
descriptor (each was rung after its bytes were written, so an fsync begun after the last covers
all): their reports are written together, the first with the fsync's time, the rest COVERED. Two
one-at-a-time producers whose sends arrive in one loop pass had each rung its own fsync, the second
queued behind the first, though both were in the pipe before the first began.

Why a compiled loop: in the compiled build the thread waits, fsyncs and reports without the GIL
(``_serve_in_c`` in fsyncer.pxd). A Python thread needs the GIL after each of its waits, while the
event loop thread holds it for its pass: each fsync cost two GIL hand-overs (futex waits and
wake-ups on both threads, ~12 futex calls per fsync under strace) on top of the fsync.
Measured on this project's 2-vCPU VM, one message per call through ``chronoq.client`` (2 processes,
``sync`` flush, a scratch driver of ``bench/send_receive.py --phase f``'s sends, 2 alternating pairs):
2,496 -> 2,963 and 2,321 -> 2,951 msgs/s, the loop thread 231 -> 199-205 us a message, the other
threads 91 -> 64 us. A round that must run Python (the second-tier logs' syncs, the
``before_fsync`` fault hook) is handed back to the Python loop, which takes the GIL for it; the
pure-Python build (``CHRONOQ_PURE_PYTHON=1``) runs every round there, the same protocol.

Tried and left out: the thread polling its bell for 250 us after each report (poll + sched_yield)
before it blocks. On this VM idle vCPUs halt at once (``haltpoll.guest_halt_poll_ns=0`` in
/proc/cmdline), so the spin kept one awake and every wake-up got cheaper. With two one-at-a-time
producers: 3,238 -> 3,823 and 3,453 -> 3,861 msgs/s, the broker's CPU 223-242 -> 320-323 us a
message. A lone send: p50 0.404 -> 0.370 ms, CPU 257 -> 470 us. That is the kernel's own guest halt
polling redone in user space, paid in CPU under light load, so it is not the default. A machine
that polls before halting has the gain already.
"""

from __future__ import annotations

import logging
import os
import struct
import threading
import time
from typing import Callable

log = logging.getLogger("chronoq.store.fsyncer")

THREAD_NAME = "chronoq-fsync"
NOTHING = -1  # a request's fd: no fsync, only the round (the second-tier logs, a report)
STOP = -2  # a request's fd: the thread ends
IN_PYTHON = 1  # a request's flag: the round runs in Python (second-tier syncs or a fault hook)
RUN_LOGS = 2  # a request's flag: the second-tier syncs run after the fsync (with IN_PYTHON)
RECORD = struct.Struct("=qqq")
BATCH = 64  # requests read at once (fsyncer.pxd's BATCH); their reports fit one atomic pipe write
# A report's took_ns for a request served by the fsync reported just before it (one fsync, a run of
# requests: ``_first_run``): no fsync of its own to count or time.
COVERED = -1
_TAKE_BYTES = RECORD.size * 64
# Compiled, this module is an extension module: its loop runs in C (fsyncer.pxd).
_COMPILED = not __file__.endswith(".py")
# A plain round needs no GIL (compiled): ring at once, the thread starts while the ringer goes on.
# Pure Python, the thread needs the GIL to start its fsync, so ring when about to sleep instead.
RING_AT_ONCE = _COMPILED


class Fsyncer:
    """One thread that fsyncs what it is asked to. ``logs_sync`` runs on it after an fsync rung
    with ``logs=True`` (the second-tier logs, ``GroupCommitter.add_log``); it must not raise."""

    def __init__(self, logs_sync: Callable[[], None]):
        self._logs_sync = logs_sync
        self._bell_r, self._bell_w = os.pipe2(os.O_CLOEXEC)
        self._reports_r, self._reports_w = os.pipe2(os.O_CLOEXEC)
        os.set_blocking(self._reports_r, False)  # the loop reads what is there, never waits
        # A fault hook for tests: ``before_fsync(fd)`` on the thread before each fsync; it may
        # block (a gate) or raise OSError (a failed fsync). Set, every round runs in Python.
        self.before_fsync: Callable[[int], None] | None = None
        self._thread = threading.Thread(target=self._run, name=THREAD_NAME, daemon=True)
        self._closed = False

    @property
    def reports(self) -> int:
        """The descriptor to watch: readable when a report waits (``take``)."""
        return self._reports_r

    def start(self) -> None:
        self._thread.start()

    def ring(self, fd: int, target: int, logs: bool = False) -> None:
        """Ask for an fsync of ``fd`` (NOTHING: none) reported with ``target``; ``logs``: run the
        second-tier syncs after it, on the thread."""
        assert not self._closed and fd >= NOTHING
        flags = (IN_PYTHON | RUN_LOGS) if logs else (IN_PYTHON if self.before_fsync is not None else 0)
        os.write(self._bell_w, RECORD.pack(fd, target, flags))

    def take(self) -> list[tuple[int, int, int]]:
        """Every report waiting: (target, errno, took_ns), in order."""
        try:
            data = os.read(self._reports_r, _TAKE_BYTES)
        except BlockingIOError:  # woken for nothing (another reader took it)
            return []
        assert len(data) % RECORD.size == 0, "a report record was split"
        return [RECORD.unpack_from(data, i) for i in range(0, len(data), RECORD.size)]

    def close(self) -> None:
        """End the thread once it has answered what it was asked (its reports stay readable
        until the descriptors close here)."""
        if self._closed:
            return
        self._closed = True
        os.write(self._bell_w, RECORD.pack(STOP, 0, 0))
        if self._thread.is_alive():
            self._thread.join()
        for fd in (self._bell_r, self._bell_w, self._reports_r, self._reports_w):
            os.close(fd)

    # ------------------------------------------------------------------ on the thread
    def _run(self) -> None:
        try:
            self._serve()
        except Exception:  # noqa: BLE001 - a broken pipe of its own: nothing more can be answered
            log.exception("the fsync thread stopped")

    def _serve(self) -> None:
        bell, reports = self._bell_r, self._reports_w
        rest = b""  # requests read, not served yet (compiled: handed back to the C loop)
        while True:
            if _COMPILED:
                # Rounds without Python are served in C, without the GIL, until one needs it.
                fd, target, flags, rest = _serve_in_c(bell, reports, rest)  # noqa: F821 - in fsyncer.pxd
                run = [(fd, target, flags)]
            else:
                if not rest:
                    rest = _read_requests(bell)
                run, rest = _first_run(rest)
            fd, _, flags = run[0]
            if fd == STOP:
                return
            err, took_ns = self._fsync(fd)
            if flags & RUN_LOGS:
                self._logs_sync()
            _write_record(reports, b"".join(RECORD.pack(target, err, took_ns if i == 0 else COVERED)
                                            for i, (_, target, _) in enumerate(run)))
    def _fsync(self, fd: int) -> tuple[int, int]:
        began = time.monotonic_ns()
        try:
            if self.before_fsync is not None:
                self.before_fsync(fd)
            if fd != NOTHING:
                os.fsync(fd)
        except OSError as exc:
            return exc.errno or 5, time.monotonic_ns() - began  # (5: EIO, for an error without a number)
        return 0, time.monotonic_ns() - began


def _read_requests(bell: int) -> bytes:
    """Every request waiting (at least one: blocks until one comes)."""
    data = os.read(bell, RECORD.size * BATCH)
    assert data and len(data) % RECORD.size == 0, "a request record was split"
    return data


def _first_run(data: bytes) -> tuple[list[tuple[int, int, int]], bytes]:
    """The requests at the head of ``data`` that one fsync serves, and the rest: a run of plain
    requests for one descriptor (each rung after its bytes were written, so an fsync begun after
    the last covers all), or one request that is not plain. The C loop (fsyncer.pxd) groups alike."""
    first = RECORD.unpack_from(data, 0)
    run, at = [first], RECORD.size
    if first[0] != STOP and not first[2] & IN_PYTHON:
        while at < len(data):
            nxt = RECORD.unpack_from(data, at)
            if nxt[0] != first[0] or nxt[2] & IN_PYTHON:
                break
            run.append(nxt)
            at += RECORD.size
    return run, data[at:]


def _write_record(fd: int, data: bytes) -> None:
    written = os.write(fd, data)
    assert written == len(data), "a report record was split"  # (<= BATCH records: under PIPE_BUF)
