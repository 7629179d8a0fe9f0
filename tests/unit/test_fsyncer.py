"""The fsync thread (chronoq/store/fsyncer.py): its request/report protocol, errors, the second-tier
logs' round and the fault hook. Run on the compiled build (its plain rounds in C) and again on the
pure-Python one (tests/unit/test_compiled.py, CODEC_TESTS)."""

from __future__ import annotations

import errno
import os
import select
import threading

import pytest

import chronoq
from chronoq.store import fsyncer
from chronoq.store.fsyncer import NOTHING, THREAD_NAME, Fsyncer


def _report(f: Fsyncer, timeout_s: float = 10.0) -> tuple[int, int, int]:
    ready, _, _ = select.select([f.reports], [], [], timeout_s)
    assert ready, "no report"
    reports = f.take()
    assert len(reports) == 1, reports
    return reports[0]


@pytest.fixture
def fsync_thread():
    made: list[Fsyncer] = []

    def make(logs_sync=lambda: None) -> Fsyncer:
        f = Fsyncer(logs_sync)
        f.start()
        made.append(f)
        return f

    yield make
    for f in made:
        f.close()


def test_a_ring_fsyncs_and_reports_its_target(tmp_path, fsync_thread):
    f = fsync_thread()
    fd = os.open(tmp_path / "log", os.O_RDWR | os.O_CREAT)
    try:
        for target in (100, 250, 1 << 40):  # one outstanding at a time, as the committer rings
            os.write(fd, b"x" * 100)
            got, err, took_ns = _report_after(f, fd, target)
            assert (got, err) == (target, 0) and took_ns >= 0
        assert f.take() == []  # nothing more waits
    finally:
        os.close(fd)


def _report_after(f: Fsyncer, fd: int, target: int, logs: bool = False) -> tuple[int, int, int]:
    f.ring(fd, target, logs)
    return _report(f)


def test_nothing_to_fsync_is_still_a_round(fsync_thread):
    f = fsync_thread()
    assert _report_after(f, NOTHING, 7)[:2] == (7, 0)


def test_a_failed_fsync_reports_its_errno(fsync_thread):
    f = fsync_thread()
    r, w = os.pipe()
    try:  # fsync of a pipe: EINVAL, from the kernel (the compiled build's C call or os.fsync)
        assert _report_after(f, r, 9)[:2] == (9, errno.EINVAL)
        closed = os.dup(r)
        os.close(closed)
        assert _report_after(f, closed, 10)[:2] == (10, errno.EBADF)
    finally:
        os.close(r)
        os.close(w)
    assert _report_after(f, NOTHING, 11)[:2] == (11, 0)  # and it carries on


def test_the_second_tier_logs_run_on_the_thread_after_the_fsync_and_before_the_report(tmp_path, fsync_thread):
    ran: list[str] = []
    f = fsync_thread(lambda: ran.append(threading.current_thread().name))
    fd = os.open(tmp_path / "log", os.O_RDWR | os.O_CREAT)
    try:
        assert _report_after(f, fd, 1)[:2] == (1, 0)
        assert ran == []  # not asked: a plain round
        assert _report_after(f, fd, 2, logs=True)[:2] == (2, 0)
        assert ran == [THREAD_NAME]  # ran before its report was written
        assert _report_after(f, NOTHING, 3, logs=True)[:2] == (3, 0)
        assert ran == [THREAD_NAME] * 2
    finally:
        os.close(fd)


def test_the_fault_hook_holds_the_round_and_its_error_is_reported(tmp_path, fsync_thread):
    f = fsync_thread()
    gate, seen = threading.Event(), []

    def hook(fd):
        seen.append((threading.current_thread().name, fd))
        assert gate.wait(10)
        if len(seen) == 2:
            raise OSError(errno.EIO, "injected")

    f.before_fsync = hook
    fd = os.open(tmp_path / "log", os.O_RDWR | os.O_CREAT)
    try:
        f.ring(fd, 5)
        ready, _, _ = select.select([f.reports], [], [], 0.2)
        assert not ready and seen == [(THREAD_NAME, fd)]  # held at the gate: no report yet
        gate.set()
        assert _report(f)[:2] == (5, 0)
        assert _report_after(f, fd, 6)[:2] == (6, errno.EIO)
        f.before_fsync = None
        assert _report_after(f, fd, 7)[:2] == (7, 0)
        assert len(seen) == 2
    finally:
        os.close(fd)


def test_close_ends_the_thread_and_a_second_close_is_harmless(fsync_thread):
    f = fsync_thread()
    assert _report_after(f, NOTHING, 1)[:2] == (1, 0)
    f.close()
    assert not f._thread.is_alive()
    f.close()
    with pytest.raises(AssertionError):
        f.ring(NOTHING, 2)


def test_the_build_runs_the_loop_it_says():
    """Compiled, the module is an extension module and serves plain rounds in C (fsyncer.pxd);
    the pure build loads its source and serves every round in Python."""
    pure = os.environ.get(chronoq.PURE_PYTHON_ENV, "") not in ("", "0")
    assert fsyncer._COMPILED is (not pure)
    assert fsyncer.__file__.endswith(".py") is pure


def _reports(f: Fsyncer, count: int, timeout_s: float = 10.0) -> list[tuple[int, int, int]]:
    got: list[tuple[int, int, int]] = []
    while len(got) < count:
        ready, _, _ = select.select([f.reports], [], [], timeout_s)
        assert ready, f"{len(got)} of {count} reports"
        got += f.take()
    assert len(got) == count, got
    return got


def test_requests_waiting_together_share_one_fsync_per_descriptor(tmp_path):
    """Rung before the thread reads: a run of plain requests for one descriptor is one fsync (its
    report timed, the others COVERED); a request for another descriptor, one that runs Python (the
    second-tier logs) and a failing descriptor each start a run of their own; order is kept."""
    logs: list[str] = []
    f = Fsyncer(lambda: logs.append("logs"))
    fd = os.open(tmp_path / "log", os.O_RDWR | os.O_CREAT)
    other = os.open(tmp_path / "other", os.O_RDWR | os.O_CREAT)
    r, w = os.pipe()
    try:
        os.write(fd, b"x" * 100)
        for target, desc, with_logs in ((1, fd, False), (2, fd, False), (3, fd, False), (4, other, False),
                                        (5, other, True), (6, fd, False), (7, r, False), (8, r, False),
                                        (9, NOTHING, False), (10, NOTHING, False)):
            f.ring(desc, target, with_logs)
        f.start()
        got = _reports(f, 10)
        assert [t for t, _, _ in got] == list(range(1, 11))
        timed = [t for t, _, took in got if took != fsyncer.COVERED]
        assert timed == [1, 4, 5, 6, 7, 9], got  # one fsync a run
        assert all(took >= 0 for t, _, took in got if t in timed)
        assert [t for t, err, _ in got if err] == [7, 8] and got[7][1] == errno.EINVAL  # a pipe: both fail
        assert logs == ["logs"]
    finally:
        f.close()
        for d in (fd, other, r, w):
            os.close(d)


def test_a_covered_report_is_not_timed_again(tmp_path):
    """The commit log's fsync histogram counts fsyncs, not reports: COVERED ones only move the
    durable offset."""
    from chronoq.store.commitlog import CommitLog

    log_ = CommitLog(str(tmp_path / "commitlog"), 1 << 20)
    try:
        assert log_.fsynced(10, 5_000) == 10
        assert log_.fsynced(20, fsyncer.COVERED) == 20
        assert (log_.sync_times.count, log_.sync_times.sum_ns) == (1, 5_000)
    finally:
        log_.close()
