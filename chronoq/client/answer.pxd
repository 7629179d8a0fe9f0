# C types for the compiled build of answer.py (Cython reads this file beside it; the pure build
# ignores it, and both run the same source): the transport (h2channel.pxd cimports it) calls
# ``answer_of`` as a C function once per call, as it called its own method before.
import cython

@cython.locals(size=Py_ssize_t, compressed=Py_ssize_t)
cpdef object answer_of(headers, trailers, data)
