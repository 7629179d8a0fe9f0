# C types for the compiled build of h2calls.py (Cython reads this file beside it; the pure build
# ignores it, and both run the same source). How a call starts, answers and ends is C calls on
# typed streams; the handler's Context and the waiting call are C structs. (The call's coroutine,
# ``_run``, stays a Python-typed coroutine: what it does per call is in the typed methods.)
import cython

from chronoq.server.h2streams cimport Stream


cdef class CallDetails:
    cdef public object method, invocation_metadata


cdef class Context:
    cdef public Stream _stream
    cdef public object _metadata, _deadline, _loop, code, details, trailing_metadata


cdef class Calls:
    cdef public set _calls

    @cython.locals(deadline=object, context=Context)
    cpdef _start_call(self, Stream stream, list fields, bint end_stream)
    cpdef _launch(self, Stream stream, path, Context context)
    cpdef _go_on_in_a_task(self, Stream stream, coro, waiting_on)
    cpdef _unary_ready(self, Stream stream)
    @cython.locals(messages=list)
    cpdef _unary_request(self, Stream stream)
    cpdef bint _answer(self, Stream stream, result) except -1


cdef class _Waiting:
    cdef Calls _server
    cdef Stream _stream
    cdef object _loop, _coro, _fut, _callbacks, _finished
    cdef bint _must_cancel
    cdef Py_ssize_t _state

    cpdef _end(self, Py_ssize_t state)


cdef class _Resumed:
    cdef object _coro, _first
    cdef bint _started
