# C types for the compiled build of frames.py (Cython reads this file beside it; the pure build
# ignores it, and both run the same source): the frame walk's offsets and fields are C integers,
# and the server's modules (h2streams, h2server) call these as C functions.
import cython
from cpython.bytearray cimport PyByteArray_AS_STRING
from cpython.bytes cimport PyBytes_FromStringAndSize


cdef inline bytes _payload(buf, Py_ssize_t start, Py_ssize_t n):
    """``buf[start:start + n]`` as bytes, one copy (``read_frames`` checked the bounds): a
    bytearray's (a read held over: a connection's buffer) straight from its memory."""
    if type(buf) is bytearray:
        return PyBytes_FromStringAndSize(PyByteArray_AS_STRING(buf) + start, n)
    return bytes(buf[start:start + n])


cpdef bytes frame(Py_ssize_t kind, Py_ssize_t flags, Py_ssize_t stream_id, payload=*)
cpdef bytes frame_head(Py_ssize_t kind, Py_ssize_t flags, Py_ssize_t stream_id, Py_ssize_t length)
cpdef bytes headers_frame(Py_ssize_t stream_id, bytes block, bint end_stream)

@cython.locals(pos=Py_ssize_t, n=Py_ssize_t, hi=Py_ssize_t, lo=Py_ssize_t, kind=Py_ssize_t, flags=Py_ssize_t,
               stream_id=Py_ssize_t, length=Py_ssize_t)
cpdef tuple read_frames(buf, Py_ssize_t max_length, handle)
