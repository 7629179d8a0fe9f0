# C types for the compiled build of h2channel.py (Cython reads this file beside it; the pure
# build ignores it, and both run the same source). A call (_Call) and its connection (_Connection)
# are C structs extending flow.pxd's window types: the counters, ids and flags of a call's way out
# and of its answer's way in are C values, and the frame handlers C calls from ``data_received``
# and ``send`` (a cdef class cannot extend asyncio.Protocol: the transport calls its methods by
# name, which is all a protocol is). ``Channel`` stays a Python class: its coroutines are per call
# but do little.
import cython

from chronoq.client.answer cimport answer_of
from chronoq.protocol.h2.flow cimport ConnectionWindows, StreamWindows
from chronoq.protocol.h2.hpackenc cimport literal


cdef class _Call(StreamWindows):
    cdef public Py_ssize_t id
    cdef public object future, headers, trailers, data, pending
    cdef public double deadline


cdef class _Connection(ConnectionWindows):
    cdef public str authority, scheme, error
    cdef public object transport, loop, headers, decoder, goaway_last, _timer, _room
    cdef public bytearray buf
    cdef public dict calls, _blocks
    cdef public Py_ssize_t next_id, peer_max_frame, peer_max_streams, _header_call, _header_flags
    cdef public double _timer_at
    cdef public bint closed
    cdef public list _header_parts

    @cython.locals(buf=bytearray, end=Py_ssize_t)
    cpdef data_received(self, data)
    @cython.locals(call=_Call, code=Py_ssize_t, increment=Py_ssize_t)
    cpdef bint _frame(self, Py_ssize_t kind, Py_ssize_t flags, Py_ssize_t sid, payload) except -1
    @cython.locals(fields=list, call=_Call)
    cpdef _end_headers(self, Py_ssize_t sid, Py_ssize_t flags, block)
    @cython.locals(call=_Call, update=bytes)
    cpdef _data(self, Py_ssize_t flags, Py_ssize_t sid, payload)
    cpdef _finish(self, _Call call, outcome)
    cpdef _freed(self)
    @cython.locals(cached=tuple, state=tuple, fields=list, out=list, clean=bint)
    cpdef bytes _header_block(self, path, timeout, fixed, metadata)
    @cython.locals(stable=frozenset)
    cpdef _fields(self, metadata, list out)
    @cython.locals(call=_Call, sid=Py_ssize_t, n=Py_ssize_t, size=Py_ssize_t, block=bytes, head=bytes)
    cpdef _Call send(self, path, fixed, metadata, timeout, message)
    cpdef _arm(self, double when)
    @cython.locals(taken=Py_ssize_t)
    cpdef bytes _take(self, _Call call)
    cpdef _send_pending(self)
    cpdef _give_up(self, _Call call)
