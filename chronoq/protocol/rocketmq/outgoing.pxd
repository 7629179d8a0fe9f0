# C types for the compiled build of outgoing.py (Cython reads this file beside it; the pure build
# ignores it, and both run the same source). The encoder is a C struct, its state read without a
# lookup, and the field helpers it calls per message (fields.pxd) are C calls: a lone send, what
# most applications do, runs this once per call.
import cython

from chronoq.protocol.rocketmq.fields cimport field, string_field, timestamp


cdef class SendRequestEncoder:
    cdef public str namespace
    cdef public bytes _host, _born
    cdef public object _born_ms
    cdef public dict _topic_fields, _by_type, _shapes

    cpdef bytes _topic_field(self, topic)
    @cython.locals(common=bytes)
    cpdef bytes _common(self, born_ms, mtype)
    @cython.locals(pieces=list, topic_fields=dict, shapes=dict, mid=bytes, tail=bytes, head=bytes, sp_head=bytes,
                   common=bytes, prefix=bytes, body_head=bytes, shape=tuple)
    cpdef bytes encode(self, messages, born_ms, fresh_ids)


@cython.locals(pos=Py_ssize_t, end=Py_ssize_t, key=Py_ssize_t, stop=Py_ssize_t, entries=list)
cpdef tuple send_results(bytes raw)
@cython.locals(key=Py_ssize_t, stop=Py_ssize_t, code=Py_ssize_t, offset=Py_ssize_t)
cdef tuple _entry(bytes raw, Py_ssize_t pos, Py_ssize_t end)
@cython.locals(key=Py_ssize_t, stop=Py_ssize_t, code=Py_ssize_t)
cdef tuple _status(bytes raw, Py_ssize_t pos, Py_ssize_t end)
@cython.locals(size=Py_ssize_t)
cdef (Py_ssize_t, Py_ssize_t) _span(bytes raw, Py_ssize_t pos, Py_ssize_t end) except *
@cython.locals(value=Py_ssize_t, shift=Py_ssize_t, b=Py_ssize_t)
cdef (Py_ssize_t, Py_ssize_t) _small(bytes raw, Py_ssize_t pos, Py_ssize_t end) except *
@cython.locals(value=Py_ssize_t, shift=Py_ssize_t, b=Py_ssize_t)
cdef (Py_ssize_t, Py_ssize_t) _int64(bytes raw, Py_ssize_t pos, Py_ssize_t end) except *
@cython.locals(wire=Py_ssize_t, size=Py_ssize_t)
cdef Py_ssize_t _skip(bytes raw, Py_ssize_t key, Py_ssize_t pos, Py_ssize_t end) except -1
