# C types for the compiled build of hpackdec.py (Cython reads this file beside it; the pure build
# ignores it, and both run the same source). ``Decoder`` is a C struct with typed counters, its
# helpers C calls; the block is walked as bytes with C integers (a byte load, no int objects).
import cython
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_GET_SIZE
from libc.string cimport memcmp

cdef Py_ssize_t _MARK_SHIFT, _MARK_MASK
cdef bint _COMPILED


cdef class Decoder:
    cdef public list table
    cdef public Py_ssize_t size, max_size, settings_max, max_list, largest, taken
    cdef dict _huffman
    cdef Py_ssize_t _generation, _last_generation, _prior_generation, _last_taken, _prior_taken
    cdef bytes _last_block, _prior_block
    cdef list _last_marks, _last_fields, _prior_marks, _prior_fields

    @cython.locals(huffman=bint, length=Py_ssize_t, end=Py_ssize_t, raw=bytes)
    cdef tuple _string(self, bytes data, Py_ssize_t pos)

    cdef tuple _entry(self, Py_ssize_t index)

    @cython.locals(size=Py_ssize_t, table=list)
    cdef _add(self, name, value)

    @cython.locals(table=list)
    cdef _resize(self, Py_ssize_t new_max)

    @cython.locals(block=bytes, table=list, pos=Py_ssize_t, end=Py_ssize_t, max_list=Py_ssize_t,
                   dynamic=Py_ssize_t, ref_cap=Py_ssize_t, size=Py_ssize_t, sized=Py_ssize_t,
                   generation=Py_ssize_t, taken=Py_ssize_t, last=Py_ssize_t, reusable=bint, b=Py_ssize_t, index=Py_ssize_t,
                   prefix=Py_ssize_t, indexing=bint, start=Py_ssize_t, limit=Py_ssize_t, p=Py_ssize_t,
                   strings=Py_ssize_t, length=Py_ssize_t, new_max=Py_ssize_t, out=list, marks=list,
                   last_marks=list, last_fields=list, fields=dict, prior=Py_ssize_t)
    cpdef list decode(self, data)

    @cython.locals(index=Py_ssize_t)
    cdef tuple _literal(self, bytes data, Py_ssize_t pos, Py_ssize_t prefix)


@cython.locals(low=Py_ssize_t, high=Py_ssize_t, mid=Py_ssize_t)
cdef Py_ssize_t _common_run(bytes block, bytes earlier, list marks, Py_ssize_t guess) except -1


cdef inline bint _same_start(const char *block, Py_ssize_t size, const char *earlier, Py_ssize_t n) noexcept:
    return n <= size and memcmp(block, earlier, n) == 0


# decode's ``_common_run`` with the bytes compared in place (no slice per probe).
cdef inline Py_ssize_t _common_run_in_c(bytes block, bytes earlier, list marks, Py_ssize_t guess) except -1:
    cdef const char *b = PyBytes_AS_STRING(block)
    cdef const char *e = PyBytes_AS_STRING(earlier)
    cdef Py_ssize_t size = PyBytes_GET_SIZE(block), low = 0, high = len(marks), mid
    if 0 < guess < high and _same_start(b, size, e, <Py_ssize_t>marks[guess - 1] >> _MARK_SHIFT):
        low = guess
        if not _same_start(b, size, e, <Py_ssize_t>marks[guess] >> _MARK_SHIFT):
            high = guess
    while low < high:
        mid = (low + high + 1) >> 1
        if _same_start(b, size, e, <Py_ssize_t>marks[mid - 1] >> _MARK_SHIFT):
            low = mid
        else:
            high = mid - 1
    return low

@cython.locals(limit=Py_ssize_t, value=Py_ssize_t, shift=Py_ssize_t, end=Py_ssize_t, b=Py_ssize_t)
cdef tuple _integer(bytes data, Py_ssize_t pos, Py_ssize_t prefix)

@cython.locals(state=Py_ssize_t, byte=cython.uchar, steps=list, parts=list)
cpdef bytes huffman_decode(bytes raw)
