# C types for the compiled build of dedupe.py (Cython reads this file beside it; the pure build
# ignores it, and both run the same source). The window is a C struct: its columns are typed
# memoryviews of the same anonymous maps ('q' is a C long long, 'i' a C int), so a lookup or an add
# is C loads and stores, not a memoryview item object each (``memory_item``); seqs, slots and
# hashes are 64-bit C integers. ``%`` keeps Python's meaning (cdivision off, Cython's default): a
# negative hash still lands in a cell in [0, 2M). Key hashes must fit 64 bits (Python's ``hash``
# does); a larger one is an OverflowError here where the pure build's memoryview refuses it too.
import cython


cdef class DedupeWindow:
    cdef public long long max_entries, window_ms, _head, _tail
    cdef public object _key_hash
    cdef long long[::1] _hashes, _commits, _stored, _heads
    cdef int[::1] _links

    @cython.locals(m=cython.longlong, horizon=cython.longlong, tail=cython.longlong, seq=cython.longlong,
                   slot=cython.longlong, step=cython.longlong, found=list, hashes=cython.longlong[::1],
                   stored=cython.longlong[::1], commits=cython.longlong[::1], links=cython.int[::1])
    cpdef list candidates(self, long long h, long long now_ms)

    @cython.locals(tail=cython.longlong, m=cython.longlong, cells=cython.longlong, h=cython.longlong,
                   seq=cython.longlong, slot=cython.longlong, step=cython.longlong, heads=cython.longlong[::1],
                   hashes=cython.longlong[::1], links=cython.int[::1])
    cpdef bint any_present(self, hs) except -1

    @cython.locals(n=Py_ssize_t, i=Py_ssize_t, start=Py_ssize_t, m=cython.longlong, cells=cython.longlong,
                   seq=cython.longlong, slot=cython.longlong, h=cython.longlong, c=cython.longlong,
                   newer=cython.longlong, step=cython.longlong, heads=cython.longlong[::1], hashes=cython.longlong[::1],
                   commit_col=cython.longlong[::1], stored=cython.longlong[::1], links=cython.int[::1])
    cpdef add(self, hs, commits, long long now_ms)

    @cython.locals(horizon=cython.longlong, tail=cython.longlong, m=cython.longlong, limit=cython.longlong,
                   done=cython.longlong, stored=cython.longlong[::1])
    cpdef long long expire(self, long long now_ms, long long step) except? -1
