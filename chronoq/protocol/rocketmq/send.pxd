# C types for the compiled build of send.py (Cython reads this file beside it; the pure build
# ignores it, and both run the same source).
#
# ``_send_response_in_c`` is the compiled build's ``send_response`` loop: every entry is written
# into one C buffer (its length worked out from its parts first, so its length varint goes in
# front without a copy), and the answer made from it once. A failed entry's status is still made
# by fields.py (rare). The Python loop in send.py is the pure build's; tests hold this one to it
# and to the generated classes (tests/unit/test_send_one_path.py, test_protocol_layer.py).
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize, PyBytes_GET_SIZE
from cpython.mem cimport PyMem_Free, PyMem_Malloc, PyMem_Realloc
from cpython.unicode cimport PyUnicode_AsUTF8AndSize
from libc.stdint cimport int64_t, uint64_t
from libc.string cimport memcpy

from chronoq.protocol.rocketmq.fields cimport _put_bytes, _put_varint, _varint_size


cdef inline unsigned char* _put_text_field(unsigned char* p, bytes k, const char* s, Py_ssize_t n) noexcept:
    p = _put_bytes(p, k)
    p = _put_varint(p, <uint64_t>n)
    memcpy(p, s, n)
    return p + n


cdef inline bytes _send_response_in_c(bytes top, message_ids, offsets, recall_handles, transaction_ids, failures,
                                      bytes ok, bytes k_entries, bytes k_id, bytes k_txid, bytes k_offset,
                                      bytes k_recall, object failed_status):
    """``send_response``'s loop (``top``: the top status field; ``ok``: an accepted entry's status
    field; ``failed_status(failure)``: a failed one's, by fields.py; the keys fields.py's)."""
    cdef Py_ssize_t n = len(message_ids), i, size, used, capacity, ml, tl, rl, entry
    cdef const char* mid
    cdef const char* txid
    cdef const char* recall
    cdef bytes status
    cdef int64_t offset
    cdef unsigned char* buf
    cdef unsigned char* p
    cdef unsigned char* grown
    assert len(offsets) == n
    capacity = PyBytes_GET_SIZE(top) + 256 * n + 64
    buf = <unsigned char*>PyMem_Malloc(capacity)
    if buf == NULL:
        raise MemoryError()
    try:
        p = _put_bytes(buf, top)
        for i in range(n):
            mid = PyUnicode_AsUTF8AndSize(message_ids[i], &ml)
            offset = offsets[i]
            tl = rl = 0
            if transaction_ids is not None:
                txid = PyUnicode_AsUTF8AndSize(transaction_ids[i], &tl)
            if recall_handles is not None:
                recall = PyUnicode_AsUTF8AndSize(recall_handles[i], &rl)
            failure = failures[i] if failures is not None else None
            status = ok if failure is None else failed_status(failure)
            entry = PyBytes_GET_SIZE(status)
            if ml:
                entry += PyBytes_GET_SIZE(k_id) + _varint_size(<uint64_t>ml) + ml
            if tl:
                entry += PyBytes_GET_SIZE(k_txid) + _varint_size(<uint64_t>tl) + tl
            if offset:
                entry += PyBytes_GET_SIZE(k_offset) + _varint_size(<uint64_t>offset)
            if rl:
                entry += PyBytes_GET_SIZE(k_recall) + _varint_size(<uint64_t>rl) + rl
            used = p - buf
            size = used + PyBytes_GET_SIZE(k_entries) + 10 + entry
            if size > capacity:
                capacity = 2 * size
                grown = <unsigned char*>PyMem_Realloc(buf, capacity)
                if grown == NULL:
                    raise MemoryError()
                buf = grown
                p = buf + used
            p = _put_bytes(p, k_entries)
            p = _put_varint(p, <uint64_t>entry)
            p = _put_bytes(p, status)
            if ml:
                p = _put_text_field(p, k_id, mid, ml)
            if tl:
                p = _put_text_field(p, k_txid, txid, tl)
            if offset:
                p = _put_bytes(p, k_offset)
                p = _put_varint(p, <uint64_t>offset)  # (-1, a delayed message's: 10 bytes, two's complement)
            if rl:
                p = _put_text_field(p, k_recall, recall, rl)
        return PyBytes_FromStringAndSize(<char*>buf, p - buf)
    finally:
        PyMem_Free(buf)
