# C types for the compiled build of schedlog.py (Cython reads this file beside it; the pure build
# ignores it, and both run the same source).
#
# ``_encode_messages_in_c`` is the compiled build's ``encode_messages`` for a blob of bytes (the
# timer's absorb of a delayed send): each MESSAGE entry is laid out in one new bytes object, the
# record copied in once and the entry's CRC computed there (record.pxd's ``chronoq_crc32c``, the
# CPU's crc32 instruction, else google_crc32c on the entry's bytes). The Python loop in
# schedlog.py is the pure build's (and runs for a blob that is not bytes); tests hold this one to
# ``encode_entry`` (tests/unit/test_timer_schedlog.py).
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize, PyBytes_GET_SIZE
from libc.stdint cimport int64_t, uint32_t, uint64_t
from libc.string cimport memcpy

from chronoq.store.record cimport chronoq_crc32c, chronoq_crc32c_in_cpu
from chronoq.store.recordlayout cimport AT_DELIVER, AT_STORED, HEAD, _le, _put

cdef enum:
    _ENTRY_HEAD = 36  # schedlog.ENTRY_HEAD_SIZE
    _ENTRY_CRC_FROM = 8  # schedlog.CRC_START
    _ENTRY_MAGIC = 0xE7
    _MESSAGE = 1


cdef inline dict _encode_messages_in_c(bytes blob, records, int64_t width_ms, bint crc_in_cpu, object crc):
    """``encode_messages``' loop (``crc``: google_crc32c.value, handed in: a .pxd's inline function
    sees no names of the module's Python scope)."""
    cdef const unsigned char* b = <const unsigned char*>PyBytes_AS_STRING(blob)
    cdef Py_ssize_t n = PyBytes_GET_SIZE(blob), pos = 0, size
    cdef int64_t ident, stored, due, t, start, m
    cdef unsigned char* e
    cdef uint32_t c
    cdef bytes entry
    cdef dict out = {}
    assert width_ms > 0
    for r in records:
        ident, size = r[0], r[1]
        # The record's own length field is what the walk trusts elsewhere; here the caller's size.
        assert HEAD <= size and pos + size <= n, "records run past the blob"
        stored, due = <int64_t>_le(b + pos + AT_STORED, 8), <int64_t>_le(b + pos + AT_DELIVER, 8)
        t = due if due > stored else stored
        m = t % width_ms
        if m < 0:  # (Python's floor modulo: a bucket starts at or before its times)
            m += width_ms
        start = t - m
        entry = PyBytes_FromStringAndSize(NULL, _ENTRY_HEAD + size)
        e = <unsigned char*>PyBytes_AS_STRING(entry)
        _put(e, <uint64_t>(_ENTRY_HEAD + size), 4)
        e[8], e[9], e[10], e[11] = _ENTRY_MAGIC, _MESSAGE, 0, 0
        _put(e + 12, <uint64_t>ident, 8)
        _put(e + 20, <uint64_t>due, 8)
        _put(e + 28, 0, 8)
        memcpy(e + _ENTRY_HEAD, b + pos, size)
        if crc_in_cpu:
            c = chronoq_crc32c(e + _ENTRY_CRC_FROM, <size_t>(_ENTRY_HEAD - _ENTRY_CRC_FROM + size))
        else:
            c = crc(PyBytes_FromStringAndSize(<char*>e + _ENTRY_CRC_FROM, _ENTRY_HEAD - _ENTRY_CRC_FROM + size))
        _put(e + 4, c, 4)
        pos += size
        group = out.get(start)
        if group is None:
            out[start] = [entry]
        else:
            group.append(entry)
    return {start_ms: b"".join(entries) for start_ms, entries in out.items()}
