# C types for the compiled build of fields.py (Cython reads this file beside it; the pure build
# ignores it, and both run the same source): the helpers a message's encoding calls several times
# (chronoq.protocol.rocketmq.outgoing, per message) are C functions to modules that cimport them.
import cython
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_GET_SIZE
from libc.stdint cimport uint64_t
from libc.string cimport memcpy

cpdef bytes varint(n)
cpdef bytes field(bytes k, payload)
cpdef bytes string_field(bytes k, text)
@cython.locals(rest=Py_ssize_t, head=bytes)
cpdef bytes timestamp(ms)


# C writers of the hand encoders' buffers (send.pxd, receive.pxd): a varint's size, a varint, bytes.
cdef inline Py_ssize_t _varint_size(uint64_t v) noexcept nogil:
    cdef Py_ssize_t n = 1
    while v >= 0x80:
        v >>= 7
        n += 1
    return n


cdef inline unsigned char* _put_varint(unsigned char* p, uint64_t v) noexcept nogil:
    while v >= 0x80:
        p[0] = <unsigned char>((v & 0x7F) | 0x80)
        v >>= 7
        p += 1
    p[0] = <unsigned char>v
    return p + 1


cdef inline unsigned char* _put_bytes(unsigned char* p, bytes b) noexcept:
    memcpy(p, PyBytes_AS_STRING(b), PyBytes_GET_SIZE(b))
    return p + PyBytes_GET_SIZE(b)
