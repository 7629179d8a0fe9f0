# C types for the compiled build of receive.py (Cython reads this file beside it; the pure build
# ignores it, and both run the same source).
#
# ``_message_in_c`` is the compiled build's ``_message``: a received message's answer written into
# one bytes object, its size worked out from its parts first (the lengths of the system
# properties, of the message and of the answer go in front without a copy). ``messages_bytes``
# works out the parts (properties, type, digest) in Python either way. Tests hold this writer to
# the Python one and both to the generated classes (tests/unit/test_server_status_convert.py).
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize, PyBytes_GET_SIZE
from libc.stdint cimport int64_t, uint64_t

from chronoq.protocol.rocketmq.fields cimport _put_bytes, _put_varint, _varint_size

cdef bint _COMPILED


cdef inline void _split_ms(int64_t ms, int64_t* seconds, int64_t* nanos) noexcept nogil:
    # Python's divmod(ms, 1000): the remainder is never negative.
    cdef int64_t s = ms // 1000, rest = ms % 1000
    if rest < 0:
        rest += 1000
        s -= 1
    seconds[0] = s
    nanos[0] = rest * 1000000


cdef inline Py_ssize_t _timestamp_size(int64_t ms) noexcept nogil:
    cdef int64_t seconds, nanos
    _split_ms(ms, &seconds, &nanos)
    return ((1 + _varint_size(<uint64_t>seconds)) if seconds else 0) + ((1 + _varint_size(<uint64_t>nanos)) if nanos else 0)


cdef inline unsigned char* _put_timestamp_field(unsigned char* p, bytes k, int64_t ms) noexcept:
    # ``k``, the Timestamp's length, its seconds (key 0x08) and nanos (key 0x10) when not zero.
    cdef int64_t seconds, nanos
    _split_ms(ms, &seconds, &nanos)
    p = _put_bytes(p, k)
    p = _put_varint(p, <uint64_t>_timestamp_size(ms))
    if seconds:
        p[0] = 0x08
        p = _put_varint(p + 1, <uint64_t>seconds)
    if nanos:
        p[0] = 0x10
        p = _put_varint(p + 1, <uint64_t>nanos)
    return p


cdef inline Py_ssize_t _field_size(bytes k, Py_ssize_t n) noexcept:
    return PyBytes_GET_SIZE(k) + _varint_size(<uint64_t>n) + n


cdef inline unsigned char* _put_field(unsigned char* p, bytes k, bytes payload) noexcept:
    p = _put_bytes(p, k)
    p = _put_varint(p, <uint64_t>PyBytes_GET_SIZE(payload))
    return _put_bytes(p, payload)


cdef inline bytes _message_in_c(bytes head, bytes user, bytes tag_keys, bytes mid, bytes digest_field,
                                bytes digest, bytes type_field, int64_t born_ms, int64_t stored_ms,
                                bytes store_host_field, int64_t deliver_at_ms, bytes handle, int64_t queue_id,
                                int64_t queue_offset, int64_t attempt, bytes group_field, bytes dlq_field,
                                bytes body, tuple keys):
    cdef bytes k_message = <bytes>keys[0], k_sp = <bytes>keys[1], k_body = <bytes>keys[2], k_id = <bytes>keys[3]
    cdef bytes encoding = <bytes>keys[4], k_born = <bytes>keys[5], k_stored = <bytes>keys[6]
    cdef bytes k_delivery = <bytes>keys[7], k_handle = <bytes>keys[8], k_queue = <bytes>keys[9]
    cdef bytes k_offset = <bytes>keys[10], k_attempt = <bytes>keys[11]
    cdef Py_ssize_t sp, message, total, body_size = PyBytes_GET_SIZE(body)
    cdef bytes out
    cdef unsigned char* start
    cdef unsigned char* p
    # (a bytes argument may be None in Cython: these writes would read it as bytes)
    if (head is None or user is None or tag_keys is None or mid is None or digest_field is None or digest is None
            or type_field is None or store_host_field is None or handle is None or group_field is None
            or dlq_field is None or body is None):
        raise TypeError("every part of a received message's answer is bytes")
    if attempt < 1:
        attempt = 1
    sp = (PyBytes_GET_SIZE(tag_keys) + PyBytes_GET_SIZE(digest_field) + PyBytes_GET_SIZE(digest)
          + PyBytes_GET_SIZE(encoding) + PyBytes_GET_SIZE(type_field)
          + _field_size(k_born, _timestamp_size(born_ms)) + _field_size(k_stored, _timestamp_size(stored_ms))
          + PyBytes_GET_SIZE(store_host_field) + _field_size(k_handle, PyBytes_GET_SIZE(handle))
          + PyBytes_GET_SIZE(k_offset) + _varint_size(<uint64_t>queue_offset)
          + PyBytes_GET_SIZE(k_attempt) + _varint_size(<uint64_t>attempt)
          + PyBytes_GET_SIZE(group_field) + PyBytes_GET_SIZE(dlq_field))
    if PyBytes_GET_SIZE(mid):
        sp += _field_size(k_id, PyBytes_GET_SIZE(mid))
    if deliver_at_ms:
        sp += _field_size(k_delivery, _timestamp_size(deliver_at_ms))
    if queue_id:
        sp += PyBytes_GET_SIZE(k_queue) + _varint_size(<uint64_t>queue_id)
    message = PyBytes_GET_SIZE(head) + PyBytes_GET_SIZE(user) + _field_size(k_sp, sp) + body_size
    if body_size:
        message += PyBytes_GET_SIZE(k_body) + _varint_size(<uint64_t>body_size)
    total = _field_size(k_message, message)
    out = PyBytes_FromStringAndSize(NULL, total)
    start = <unsigned char*>PyBytes_AS_STRING(out)
    p = _put_bytes(start, k_message)
    p = _put_varint(p, <uint64_t>message)
    p = _put_bytes(p, head)
    p = _put_bytes(p, user)
    p = _put_bytes(p, k_sp)
    p = _put_varint(p, <uint64_t>sp)
    p = _put_bytes(p, tag_keys)
    if PyBytes_GET_SIZE(mid):
        p = _put_field(p, k_id, mid)
    p = _put_bytes(p, digest_field)
    p = _put_bytes(p, digest)
    p = _put_bytes(p, encoding)
    p = _put_bytes(p, type_field)
    p = _put_timestamp_field(p, k_born, born_ms)
    p = _put_timestamp_field(p, k_stored, stored_ms)
    p = _put_bytes(p, store_host_field)
    if deliver_at_ms:
        p = _put_timestamp_field(p, k_delivery, deliver_at_ms)
    p = _put_field(p, k_handle, handle)
    if queue_id:
        p = _put_bytes(p, k_queue)
        p = _put_varint(p, <uint64_t>queue_id)
    p = _put_bytes(p, k_offset)
    p = _put_varint(p, <uint64_t>queue_offset)
    p = _put_bytes(p, k_attempt)
    p = _put_varint(p, <uint64_t>attempt)
    p = _put_bytes(p, group_field)
    p = _put_bytes(p, dlq_field)
    if body_size:
        p = _put_bytes(p, k_body)
        p = _put_varint(p, <uint64_t>body_size)
        p = _put_bytes(p, body)
    assert p - start == total, (p - start, total)  # (the sizes above and the writes agree)
    return out
