# The compiled build's loop of fsyncer.py (Cython reads this file beside it; the pure build ignores
# it and runs every round in Python, the same protocol). ``_serve_in_c`` reads requests, fsyncs and
# writes reports without the GIL; it returns the first request that needs Python (STOP, or the
# IN_PYTHON flag) as a tuple with the requests read after it (bytes, handed back at the next call),
# the GIL taken again only then.
from libc.errno cimport errno, EINTR
from libc.stdint cimport int64_t
from libc.string cimport memcpy
from posix.time cimport clock_gettime, timespec, CLOCK_MONOTONIC
from posix.unistd cimport read, write, fsync

# Requests read at once (the committer has at most a few outstanding); their reports, written in one
# go, stay far under PIPE_BUF (64 x 24 bytes), so the loop reads them whole.
DEF BATCH = 64


cdef inline int64_t _now_ns() noexcept nogil:
    cdef timespec ts
    clock_gettime(CLOCK_MONOTONIC, &ts)
    return <int64_t>ts.tv_sec * 1000000000 + ts.tv_nsec


cdef inline bint _plain(int64_t* rec) noexcept nogil:
    return rec[0] != -2 and not (rec[2] & 1)  # neither STOP nor IN_PYTHON


cdef inline int _serve_loop(int bell, int reports, int64_t* buf, Py_ssize_t* have, Py_ssize_t* at) noexcept nogil:
    """0: ``buf[at]`` is a request for Python; else the errno of a failed pipe read or write.
    ``buf`` holds ``have`` records read, ``at`` the first not served."""
    cdef int64_t rep[BATCH * 3]
    cdef Py_ssize_t n, i, j, k, left
    cdef int64_t began, took, err
    cdef char* out
    while True:
        if at[0] >= have[0]:
            n = read(bell, buf, BATCH * 24)
            if n < 0 and errno == EINTR:
                continue
            if n <= 0 or n % 24:
                return errno if n < 0 else 5  # (EIO: a short record, which a pipe never gives)
            have[0] = n // 24
            at[0] = 0
        i = at[0]
        if not _plain(buf + i * 3):
            return 0
        # A run of plain requests for one descriptor: one fsync covers them all (each was rung
        # after its bytes were written); the first report carries its time, the others -1.
        j = i + 1
        while j < have[0] and _plain(buf + j * 3) and buf[j * 3] == buf[i * 3]:
            j += 1
        began = _now_ns()
        err = 0
        if buf[i * 3] >= 0 and fsync(<int>buf[i * 3]) != 0:
            err = errno if errno else 5
        took = _now_ns() - began
        for k in range(i, j):
            rep[(k - i) * 3] = buf[k * 3 + 1]
            rep[(k - i) * 3 + 1] = err
            rep[(k - i) * 3 + 2] = took if k == i else -1
        out = <char*>rep
        left = (j - i) * 24
        while left:
            n = write(reports, out, left)
            if n < 0 and errno == EINTR:
                continue
            if n != left:
                return errno if n < 0 else 5
            left = 0
        at[0] = j


cdef inline tuple _serve_in_c(int bell, int reports, bytes pending):
    cdef int64_t buf[BATCH * 3]
    cdef Py_ssize_t have = len(pending) // 24, at = 0
    cdef int failed
    assert len(pending) % 24 == 0 and have <= BATCH
    if have:
        memcpy(buf, <const char*>pending, have * 24)
    with nogil:
        failed = _serve_loop(bell, reports, buf, &have, &at)
    if failed:
        raise OSError(failed, "the fsync thread's pipe failed")
    rest = (<char*>buf)[(at + 1) * 24:have * 24]
    return (buf[at * 3], buf[at * 3 + 1], buf[at * 3 + 2], rest)
