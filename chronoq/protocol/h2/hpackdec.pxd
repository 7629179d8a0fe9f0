# C types for the compiled build of hpackdec.py (Cython reads this file beside it; the pure build
# ignores it, and both run the same source). ``Decoder`` is a C struct with typed counters, its
# helpers C calls; the block is walked as bytes with C integers (a byte load, no int objects).
import cython

cdef Py_ssize_t _MARK_SHIFT, _MARK_MASK


cdef class Decoder:
    cdef public list table
    cdef public Py_ssize_t size, max_size, settings_max, max_list, largest, taken
    cdef dict _huffman
    cdef Py_ssize_t _generation, _last_generation
    cdef object _last_view
    cdef list _last_marks, _last_fields

    @cython.locals(huffman=bint, length=Py_ssize_t, end=Py_ssize_t, raw=bytes)
    cdef tuple _string(self, bytes data, Py_ssize_t pos)

    cdef tuple _entry(self, Py_ssize_t index)

    @cython.locals(size=Py_ssize_t, table=list)
    cdef _add(self, name, value)

    @cython.locals(table=list)
    cdef _resize(self, Py_ssize_t new_max)

    @cython.locals(block=bytes, table=list, pos=Py_ssize_t, end=Py_ssize_t, max_list=Py_ssize_t,
                   dynamic=Py_ssize_t, ref_cap=Py_ssize_t, size=Py_ssize_t, sized=Py_ssize_t,
                   generation=Py_ssize_t, taken=Py_ssize_t, low=Py_ssize_t, high=Py_ssize_t, guess=Py_ssize_t,
                   mid=Py_ssize_t, last=Py_ssize_t, reusable=bint, b=Py_ssize_t, index=Py_ssize_t,
                   prefix=Py_ssize_t, indexing=bint, start=Py_ssize_t, limit=Py_ssize_t, p=Py_ssize_t,
                   strings=Py_ssize_t, length=Py_ssize_t, new_max=Py_ssize_t, out=list, marks=list,
                   last_marks=list, fields=dict)
    cpdef list decode(self, data)

    @cython.locals(index=Py_ssize_t)
    cdef tuple _literal(self, bytes data, Py_ssize_t pos, Py_ssize_t prefix)


@cython.locals(limit=Py_ssize_t, value=Py_ssize_t, shift=Py_ssize_t, end=Py_ssize_t, b=Py_ssize_t)
cdef tuple _integer(bytes data, Py_ssize_t pos, Py_ssize_t prefix)

@cython.locals(state=Py_ssize_t, byte=cython.uchar, steps=list, parts=list)
cpdef bytes huffman_decode(bytes raw)
