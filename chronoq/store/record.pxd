# C types for the compiled build of record.py (Cython reads this file beside it; the pure build
# ignores it, and both run the same source). Only the hot walk is typed: ``buf`` as bytes makes
# ``buf[i]`` a bounds-checked C byte load, the locals 64-bit C integers (a u32 shifted in a
# 64-bit type cannot overflow).
import cython

@cython.locals(header=cython.Py_ssize_t, size_max=cython.Py_ssize_t, magic=cython.Py_ssize_t,
               version=cython.Py_ssize_t, total=cython.Py_ssize_t, tlen=cython.Py_ssize_t,
               mlen=cython.Py_ssize_t, text=cython.Py_ssize_t, p=cython.Py_ssize_t, stop=cython.Py_ssize_t)
cpdef Py_ssize_t check_run(bytes buf, Py_ssize_t pos, Py_ssize_t end) except -1

@cython.locals(b0=cython.Py_ssize_t, b1=cython.Py_ssize_t, b2=cython.Py_ssize_t, b3=cython.Py_ssize_t)
cdef Py_ssize_t _u32(bytes buf, Py_ssize_t p) except -1

@cython.locals(b0=cython.Py_ssize_t, b1=cython.Py_ssize_t)
cdef Py_ssize_t _u16(bytes buf, Py_ssize_t p) except -1

@cython.locals(header=cython.Py_ssize_t, total=cython.Py_ssize_t)
cpdef Py_ssize_t span(bytes buf, Py_ssize_t pos, Py_ssize_t end) except -1
