# C types for the compiled build of h2streams.py (Cython reads this file beside it; the pure
# build ignores it, and both run the same source). A call's Stream and the connection's output
# side (Answers, the base of h2server.Connection) are C structs: their flags and counters are C
# values and their methods C calls from the typed code of this module and h2server, h2calls.
import cython

from chronoq.protocol.h2.flow cimport ConnectionWindows, StreamWindows
from chronoq.protocol.h2.frames cimport frame, frame_head, headers_frame
from chronoq.server.callstats cimport CallStats, answer_code


cdef class Answers(ConnectionWindows)


cdef class Stream(StreamWindows):
    cdef public Answers conn
    cdef public Py_ssize_t id, counted
    cdef public object answer
    cdef public bytearray buf
    cdef public object queue, window_open, task, deserializer, serializer, encoding, ready, reset_due
    cdef public bint half_closed, cancelled, ended, headers_sent
    cdef public list blocked
    cdef public str method
    cdef public double started

    @cython.locals(limit=Py_ssize_t)
    cpdef list messages(self)
    cpdef bytes _head(self)
    @cython.locals(conn=Answers, parts=bint, n=Py_ssize_t)
    cpdef bint put_message(self, data) except -1
    cpdef finish(self, Py_ssize_t code, details, metadata=*)
    @cython.locals(stats=CallStats)
    cpdef count_end(self, Py_ssize_t code)


cdef class Answers(ConnectionWindows):
    cdef public object server, transport, loop, limits, _resumed
    cdef public list _out
    cdef public dict streams, waiting, peer_closed
    cdef public Py_ssize_t _out_bytes, held_answers, held_out, unread_acks, peer_max_frame
    cdef public bint _reading, closed, paused

    @cython.locals(out=list)
    cpdef _write(self, data)
    @cython.locals(out=list)
    cpdef _flush_out(self)
    @cython.locals(out=list, n=Py_ssize_t)
    cpdef _write_parts(self, bytes first, tuple rest)
    @cython.locals(held=Py_ssize_t, cap=Py_ssize_t)
    cpdef room_for_answer(self, Py_ssize_t nbytes)
    @cython.locals(held=Py_ssize_t)
    cpdef _hold(self, Py_ssize_t nbytes)
    cpdef _forget(self, Stream stream)
    cpdef _see_out(self, Py_ssize_t size)
    @cython.locals(n=Py_ssize_t)
    cpdef send_data(self, Stream stream, bytes head, message)
    cpdef send_trailers(self, Stream stream, bytes head, bytes block)
    @cython.locals(ids=dict)
    cpdef peer_ended(self, Py_ssize_t sid)
    @cython.locals(stream=Stream)
    cpdef Stream answering(self, Py_ssize_t sid)
    cpdef reset_after_answer(self, Stream stream, Py_ssize_t code)
    @cython.locals(max_frame=Py_ssize_t, blocked=list, left=Py_ssize_t, taken=Py_ssize_t)
    cpdef _flush_stream(self, Stream stream)
    @cython.locals(waiting=dict, stream=Stream)
    cpdef _unblock_all(self)
