# C types for the compiled build of handle.py (Cython reads this file beside it; the pure build
# ignores it, and both run the same source).
#
# ``_encode_many_in_c`` is the compiled build's ``encode_many`` (the delayed send path mints one
# handle a delayed message): each handle's bytes are laid out in a C buffer, its CRC-32C computed
# there (by the CPU's crc32 instruction: record.pxd's ``chronoq_crc32c``, else google_crc32c on a
# copy) and its unpadded URL-safe base64 written into a second buffer, which becomes the str. The
# Python loop in handle.py, built on struct, binascii and google_crc32c, is the pure build's, and
# the reference tests/unit/test_batched_encoders.py holds this one to (``encode``, which stays
# on the libraries in both builds).
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize, PyBytes_GET_SIZE
from cpython.unicode cimport PyUnicode_AsUTF8AndSize, PyUnicode_DecodeASCII
from libc.stdint cimport int64_t, uint32_t, uint64_t
from libc.string cimport memcpy

from chronoq.store.record cimport chronoq_crc32c, chronoq_crc32c_in_cpu
from chronoq.store.recordlayout cimport _put

cdef extern from *:
    """
    /* Unpadded URL-safe base64 (RFC 4648, section 5) of the n bytes at src, written at dst;
       returns how many characters it wrote (4 per 3 bytes, 2 or 3 for a last 1 or 2). */
    static Py_ssize_t chronoq_b64url(const unsigned char *src, Py_ssize_t n, char *dst) {
        static const char digits[] =
            "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_";
        char *d = dst;
        uint32_t v;
        for (; n >= 3; src += 3, n -= 3) {
            v = ((uint32_t)src[0] << 16) | ((uint32_t)src[1] << 8) | src[2];
            *d++ = digits[v >> 18]; *d++ = digits[(v >> 12) & 63];
            *d++ = digits[(v >> 6) & 63]; *d++ = digits[v & 63];
        }
        if (n == 1) {
            v = (uint32_t)src[0] << 16;
            *d++ = digits[v >> 18]; *d++ = digits[(v >> 12) & 63];
        } else if (n == 2) {
            v = ((uint32_t)src[0] << 16) | ((uint32_t)src[1] << 8);
            *d++ = digits[v >> 18]; *d++ = digits[(v >> 12) & 63]; *d++ = digits[(v >> 6) & 63];
        }
        return d - dst;
    }
    """
    Py_ssize_t chronoq_b64url(const unsigned char* src, Py_ssize_t n, char* dst) noexcept nogil

# A handle's bytes: kind, level, position (8), due (8), then three fields of at most 255 bytes
# each behind a length byte, then the CRC (4); its text: the version character and the base64.
cdef enum:
    _BODY_MAX = 790  # 18 + 3 * 256 + 4
    _TEXT_MAX = 1057  # 1 + 4 * ceil(_BODY_MAX / 3)


cdef inline Py_ssize_t _field(unsigned char* p, const char* s, Py_ssize_t n) except -1:
    """A length byte and ``n`` bytes at ``p`` (handle.py asserts the same bound)."""
    assert 0 <= n < 256, n
    p[0] = <unsigned char>n
    memcpy(p + 1, s, n)
    return 1 + n


cdef inline list _encode_many_in_c(int kind, positions, dues, topics, message_ids, str version,
                                   bytes tail, bint crc_in_cpu, object crc):
    """``encode_many``'s loop (``version`` and ``tail``: ``_group_field``'s answer; ``crc``:
    google_crc32c.value, handed in: a .pxd's inline function sees no names of the module's
    Python scope)."""
    cdef unsigned char body[_BODY_MAX]
    cdef char text[_TEXT_MAX]
    cdef Py_ssize_t at, n
    cdef const char* s
    cdef uint32_t c
    cdef int64_t position, due_ms
    cdef const char* tail_bytes = PyBytes_AS_STRING(tail)
    cdef Py_ssize_t tail_len = PyBytes_GET_SIZE(tail)
    assert len(version) == 1 and version.isascii()
    text[0] = <char>ord(version)
    out = []
    for position_obj, due_obj, topic, mid in zip(positions, dues, topics, message_ids):
        position, due_ms = position_obj, due_obj
        body[0], body[1] = <unsigned char>kind, 0
        _put(body + 2, <uint64_t>position, 8)
        _put(body + 10, <uint64_t>due_ms, 8)
        s = PyUnicode_AsUTF8AndSize(topic, &n)
        at = 18 + _field(body + 18, s, n)
        if type(mid) is bytes:
            at += _field(body + at, PyBytes_AS_STRING(mid), PyBytes_GET_SIZE(mid))
        else:
            s = PyUnicode_AsUTF8AndSize(mid, &n)
            at += _field(body + at, s, n)
        memcpy(body + at, tail_bytes, tail_len)
        at += tail_len
        if crc_in_cpu:
            c = chronoq_crc32c(body, <size_t>at)
        else:
            c = crc(PyBytes_FromStringAndSize(<char*>body, at))
        _put(body + at, c, 4)
        out.append(PyUnicode_DecodeASCII(text, 1 + chronoq_b64url(body, at + 4, text + 1), NULL))
    return out
