# C types for the compiled build of flow.py (Cython reads this file beside it; the pure build
# ignores it, and both run the same source). The counters are C integers in C structs: the
# server's Stream and Connection (chronoq.server.h2streams, h2server) extend these types, so
# their typed code reads and moves them without an object or a lookup. (The windows stay within
# 2^31 - 1 plus one increment: a 64-bit C integer cannot overflow.)
import cython


cdef class StreamWindows:
    cdef public Py_ssize_t send_window, recv_unacked


cdef class ConnectionWindows:
    cdef public Py_ssize_t peer_window, peer_initial_window, recv_unacked
    cdef public Py_ssize_t _our_conn_window, _conn_half, _stream_half

    cpdef bytes opening_update(self)
    cpdef Py_ssize_t room(self, StreamWindows stream) except? -1
    cpdef spend(self, StreamWindows stream, Py_ssize_t n)
    cpdef tuple data_out(self, Py_ssize_t stream_id, StreamWindows stream, data, Py_ssize_t max_frame,
                         Py_ssize_t end_flags=*)
    @cython.locals(delta=Py_ssize_t, stream=StreamWindows)
    cpdef Py_ssize_t peer_settings_window(self, Py_ssize_t value, streams) except? -1
    cpdef connection_update(self, Py_ssize_t increment)
    cpdef bint received(self, Py_ssize_t n) except -1
    cpdef bint stream_received(self, StreamWindows stream, Py_ssize_t n) except -1
    cpdef bytes data_in(self, Py_ssize_t stream_id, StreamWindows stream, Py_ssize_t n)
    @cython.locals(n=Py_ssize_t)
    cpdef bytes grant_connection(self)
    @cython.locals(n=Py_ssize_t)
    cpdef bytes grant_stream(self, Py_ssize_t stream_id, StreamWindows stream)
