# C types for the compiled build of hpackenc.py (Cython reads this file beside it; the pure build
# ignores it, and both run the same source): the integers are C integers, and the client's
# transport (chronoq.client.h2channel), which encodes a literal field or two every call, calls
# ``literal`` as a C function.
import cython

cdef tuple _BYTE

@cython.locals(limit=Py_ssize_t, out=bytearray)
cpdef bytes encode_integer(Py_ssize_t value, Py_ssize_t prefix, Py_ssize_t first=*)

@cython.locals(n=bytes, v=bytes)
cpdef bytes literal(name, value)
