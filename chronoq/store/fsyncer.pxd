# The compiled build's loop of fsyncer.py (Cython reads this file beside it; the pure build ignores
# it and runs every round in Python, the same protocol). ``_serve_in_c`` reads requests, fsyncs and
# writes reports without the GIL; it returns the first request that needs Python (STOP, or the
# IN_PYTHON flag) as a tuple, the GIL taken again only then.
from libc.errno cimport errno, EINTR
from libc.stdint cimport int64_t
from posix.time cimport clock_gettime, timespec, CLOCK_MONOTONIC
from posix.unistd cimport read, write, fsync


cdef inline int64_t _now_ns() noexcept nogil:
    cdef timespec ts
    clock_gettime(CLOCK_MONOTONIC, &ts)
    return <int64_t>ts.tv_sec * 1000000000 + ts.tv_nsec


cdef inline int _serve_loop(int bell, int reports, int64_t* req) noexcept nogil:
    """0: ``req`` holds a request for Python; else the errno of a failed pipe read or write."""
    cdef int64_t rep[3]
    cdef Py_ssize_t n
    cdef int64_t began
    while True:
        n = read(bell, req, 24)
        if n < 0 and errno == EINTR:
            continue
        if n != 24:
            return errno if n < 0 else 5  # (EIO: a short record, which a pipe never gives)
        if req[0] == -2 or (req[2] & 1):  # STOP, IN_PYTHON
            return 0
        began = _now_ns()
        rep[0] = req[1]
        rep[1] = 0
        if req[0] >= 0 and fsync(<int>req[0]) != 0:
            rep[1] = errno if errno else 5
        rep[2] = _now_ns() - began
        while True:
            n = write(reports, rep, 24)
            if n < 0 and errno == EINTR:
                continue
            if n != 24:
                return errno if n < 0 else 5
            break


cdef inline tuple _serve_in_c(int bell, int reports):
    cdef int64_t req[3]
    cdef int failed
    with nogil:
        failed = _serve_loop(bell, reports, req)
    if failed:
        raise OSError(failed, "the fsync thread's pipe failed")
    return (req[0], req[1], req[2])
