# C types for the compiled build of h2server.py (Cython reads this file beside it; the pure build
# ignores it, and both run the same source). Connection is a C struct extending Answers
# (h2streams.pxd): its state is C values, its frame handlers C calls, the streams it hands
# around typed (a cdef class cannot extend asyncio.Protocol: the transport calls its methods by
# name, which is all a protocol is).
import cython

from chronoq.protocol.h2.frames cimport read_frames
from chronoq.protocol.h2.hpackdec cimport Decoder
from chronoq.server.h2streams cimport Answers, Stream


cdef class Connection(Answers):
    cdef public str peer
    cdef public object buf, resets, empties, controls, _timer, _idle
    cdef public bint preface_seen, settings_seen, goaway_sent
    cdef public Decoder decoder
    cdef public Py_ssize_t lingering, last_stream, buffered
    cdef public Py_ssize_t _header_stream, _header_flags, _header_size, _continuations
    cdef public list _header_parts, _starting

    cpdef refuse(self, reason, detail)
    @cython.locals(end=Py_ssize_t, too_long=Py_ssize_t)
    cpdef _read(self, data)
    @cython.locals(starting=list, stream=Stream)
    cpdef _launch_calls(self)
    cpdef bint _frame(self, Py_ssize_t kind, Py_ssize_t flags, Py_ssize_t sid, payload) except -1
    cpdef _conn_error(self, exc)
    cpdef _empty(self, what)
    cpdef _control(self, what)
    cpdef _unread_ack(self)
    cpdef _server_reset(self, Py_ssize_t sid, Py_ssize_t code)
    @cython.locals(grown=bint)
    cpdef _settings(self, Py_ssize_t flags, Py_ssize_t sid, payload)
    @cython.locals(increment=Py_ssize_t, stream=Stream, code=Py_ssize_t)
    cpdef _window_update(self, Py_ssize_t sid, payload)
    cpdef _headers(self, Py_ssize_t flags, Py_ssize_t sid, payload)
    cpdef _header_part(self, part, Py_ssize_t flags)
    @cython.locals(fields=list, stream=Stream)
    cpdef _header_block(self, Py_ssize_t sid, Py_ssize_t first_flags, block)
    @cython.locals(due=bint)
    cpdef _data(self, Py_ssize_t flags, Py_ssize_t sid, payload)
    @cython.locals(length=Py_ssize_t, stream=Stream, held=Py_ssize_t, limit=Py_ssize_t, announced=Py_ssize_t)
    cpdef _stream_data(self, Py_ssize_t flags, Py_ssize_t sid, payload)
    cpdef _credit_connection(self)
    cpdef release(self, Stream stream)
    cpdef credit(self, Stream stream)
    cpdef _half_close(self, Stream stream)
    cpdef _fail_call(self, Stream stream, Py_ssize_t code, details)
    cpdef _reset(self, Stream stream, Py_ssize_t code)
    cpdef _cancel(self, Stream stream)
    cpdef _fail(self, Py_ssize_t code, reason)
