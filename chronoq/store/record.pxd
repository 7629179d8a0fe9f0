# C types for the compiled build of record.py (Cython reads this file beside it; the pure build
# ignores it, and both run the same source). Only the hot walk is typed: ``buf`` as bytes makes
# ``buf[i]`` a bounds-checked C byte load, the locals 64-bit C integers (a u32 shifted in a
# 64-bit type cannot overflow).
#
# ``_check_run_in_c`` is the compiled build's ``check_run`` (the Python loop in record.py is the
# pure build's, and the reference tests/unit/test_record.py holds this one to): it reads each
# record's header as C integers from a pointer into the bytes, computes the CRC-32C over the
# bytes in place (no slice copied, no Python call a record) and scans the text fields for a
# non-ASCII byte 8 at a time (text beyond ASCII is then checked for UTF-8 in C). The CRC is the CPU's own instruction (SSE4.2's crc32, x86-64),
# chosen when the module loads; without it (another CPU or compiler) the walk calls
# google_crc32c on a slice, as the Python loop does.
import cython
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize, PyBytes_GET_SIZE
from libc.stdint cimport int64_t, uint32_t, uint64_t
from libc.string cimport memcpy

# Field offsets and rules (record.py's layout table and constants), shared with routing.pxd.
from chronoq.store.recordlayout cimport (AT_BLEN, AT_BORN, AT_CRC, AT_DELIVER, AT_FLAGS, AT_KLEN, AT_MLEN, AT_PLEN,
                                         AT_QID, AT_QOFF, AT_STORED, AT_TAGLEN, AT_TLEN, CRC_FROM, HEAD, MAGIC_BYTE,
                                         SIZE_MAX, VERSION_BYTE, _le, _put)

cdef extern from *:
    """
    #include <stdint.h>
    #include <string.h>
    /* CRC-32C (Castagnoli; reflected, initial and final value all ones: google_crc32c's) by the
       SSE4.2 crc32 instruction, 8 bytes a step. The module is compiled for baseline x86-64, so
       the function alone is compiled for SSE4.2 and is called only when the CPU says it has it. */
    #if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
    #include <nmmintrin.h>
    /* chronoq_crc32c_extend(crc, p, n): the CRC of what ``crc`` was the CRC of, followed by the n
       bytes at p (google_crc32c.extend); chronoq_crc32c(p, n) = chronoq_crc32c_extend(0, p, n). */
    __attribute__((target("sse4.2")))
    static uint32_t chronoq_crc32c_extend(uint32_t prior, const unsigned char *p, size_t n) {
        uint64_t crc = ~prior, word;
        uint32_t c;
        for (; n >= 8; p += 8, n -= 8) {
            memcpy(&word, p, 8);  /* (an unaligned load; x86 is little-endian, as the CRC reads) */
            crc = _mm_crc32_u64(crc, word);
        }
        c = (uint32_t)crc;
        for (; n; p++, n--)
            c = _mm_crc32_u8(c, *p);
        return ~c;
    }
    static uint32_t chronoq_crc32c(const unsigned char *p, size_t n) { return chronoq_crc32c_extend(0, p, n); }
    static int chronoq_crc32c_in_cpu(void) {
        __builtin_cpu_init();
        return __builtin_cpu_supports("sse4.2") ? 1 : 0;
    }
    #else
    static uint32_t chronoq_crc32c_extend(uint32_t prior, const unsigned char *p, size_t n) { (void)p; (void)n; return prior; }
    static uint32_t chronoq_crc32c(const unsigned char *p, size_t n) { (void)p; (void)n; return 0; }
    static int chronoq_crc32c_in_cpu(void) { return 0; }
    #endif

    /* Whether the n bytes at p are well-formed UTF-8 (Unicode's table 3-7: no overlong form, no
       surrogate, nothing past U+10FFFF), which is what Python's strict decoder accepts. */
    static int chronoq_utf8(const unsigned char *p, size_t n) {
        const unsigned char *e = p + n;
        unsigned char c, lo, hi;
        while (p < e) {
            c = *p;
            if (c < 0x80) { p++; continue; }
            lo = 0x80; hi = 0xBF;  /* the second byte's range (narrower after E0, ED, F0, F4) */
            if (c >= 0xC2 && c <= 0xDF) {
                if (e - p < 2 || p[1] < lo || p[1] > hi) return 0;
                p += 2;
            } else if (c >= 0xE0 && c <= 0xEF) {
                if (c == 0xE0) lo = 0xA0; else if (c == 0xED) hi = 0x9F;
                if (e - p < 3 || p[1] < lo || p[1] > hi || (p[2] & 0xC0) != 0x80) return 0;
                p += 3;
            } else if (c >= 0xF0 && c <= 0xF4) {
                if (c == 0xF0) lo = 0x90; else if (c == 0xF4) hi = 0x8F;
                if (e - p < 4 || p[1] < lo || p[1] > hi || (p[2] & 0xC0) != 0x80 || (p[3] & 0xC0) != 0x80) return 0;
                p += 4;
            } else {
                return 0;
            }
        }
        return 1;
    }
    """
    uint32_t chronoq_crc32c(const unsigned char* p, size_t n) noexcept nogil
    uint32_t chronoq_crc32c_extend(uint32_t prior, const unsigned char* p, size_t n) noexcept nogil
    int chronoq_crc32c_in_cpu() noexcept nogil
    int chronoq_utf8(const unsigned char* p, size_t n) noexcept nogil

cdef inline bint _ascii(const unsigned char* p, Py_ssize_t n) noexcept nogil:
    """Whether the ``n`` bytes at ``p`` are all below 0x80: 8 a step (any high bit of a word)."""
    cdef uint64_t word
    while n >= 8:
        memcpy(&word, p, 8)
        if word & 0x8080808080808080ULL:
            return False
        p += 8
        n -= 8
    while n > 0:
        if p[0] & 0x80:
            return False
        p += 1
        n -= 1
    return True


cdef inline bint _utf8_fields(const unsigned char* r) noexcept nogil:
    """Whether the five text fields of the record at ``r`` (lengths checked) are each UTF-8 (field
    by field, as ``check``: a character may not straddle two fields)."""
    cdef const unsigned char* t = r + HEAD
    cdef size_t lengths[5]
    cdef int i
    lengths[0], lengths[1] = r[AT_TLEN], r[AT_MLEN]
    lengths[2], lengths[3], lengths[4] = _le(r + AT_TAGLEN, 2), _le(r + AT_KLEN, 2), _le(r + AT_PLEN, 4)
    for i in range(5):
        if not chronoq_utf8(t, lengths[i]):
            return False
        t += lengths[i]
    return True


cdef inline Py_ssize_t _check_run_in_c(bytes chunk, Py_ssize_t pos, Py_ssize_t end, bint crc_in_cpu,
                                       object crc) except -1:
    """``check_run``'s walk. ``crc_in_cpu``: the CRC by ``chronoq_crc32c`` (record._CRC_IN_CPU),
    else by ``crc`` (google_crc32c.value, handed in: a .pxd's inline function sees no names of the
    module's Python scope) on a slice. Every field is read within ``chunk[pos:end]``: a record is
    read past its header only once its length is known to fit."""
    cdef const unsigned char* buf = <const unsigned char*>PyBytes_AS_STRING(chunk)
    cdef const unsigned char* r
    cdef Py_ssize_t total, text
    assert 0 <= pos and end <= PyBytes_GET_SIZE(chunk), (pos, end, len(chunk))
    while end - pos >= HEAD:
        r = buf + pos
        total = <Py_ssize_t>_le(r, 4)
        if r[4] != MAGIC_BYTE or r[5] != VERSION_BYTE or total < HEAD or total > SIZE_MAX or total > end - pos:
            return pos
        text = <Py_ssize_t>(r[AT_TLEN] + r[AT_MLEN] + _le(r + AT_TAGLEN, 2) + _le(r + AT_KLEN, 2) + _le(r + AT_PLEN, 4))
        if not r[AT_TLEN] or not r[AT_MLEN] or HEAD + text + <Py_ssize_t>_le(r + AT_BLEN, 4) != total:
            return pos
        if crc_in_cpu:
            if chronoq_crc32c(r + CRC_FROM, <size_t>(total - CRC_FROM)) != <uint32_t>_le(r + AT_CRC, 4):
                return pos
        elif crc(chunk[pos + CRC_FROM:pos + total]) != _le(r + AT_CRC, 4):
            return pos
        if not _ascii(r + HEAD, text) and not _utf8_fields(r):
            return pos
        pos += total
    return pos


@cython.locals(header=cython.Py_ssize_t, size_max=cython.Py_ssize_t, magic=cython.Py_ssize_t,
               version=cython.Py_ssize_t, total=cython.Py_ssize_t, tlen=cython.Py_ssize_t,
               mlen=cython.Py_ssize_t, taglen=cython.Py_ssize_t, klen=cython.Py_ssize_t, plen=cython.Py_ssize_t,
               text=cython.Py_ssize_t, p=cython.Py_ssize_t, stop=cython.Py_ssize_t)
cpdef Py_ssize_t check_run(bytes buf, Py_ssize_t pos, Py_ssize_t end) except -1

@cython.locals(b0=cython.Py_ssize_t, b1=cython.Py_ssize_t, b2=cython.Py_ssize_t, b3=cython.Py_ssize_t)
cdef Py_ssize_t _u32(bytes buf, Py_ssize_t p) except -1

@cython.locals(b0=cython.Py_ssize_t, b1=cython.Py_ssize_t)
cdef Py_ssize_t _u16(bytes buf, Py_ssize_t p) except -1

@cython.locals(header=cython.Py_ssize_t, total=cython.Py_ssize_t)
cpdef Py_ssize_t span(bytes buf, Py_ssize_t pos, Py_ssize_t end) except -1


cdef inline bytes _as_bytes(object field):
    return field if type(field) is bytes else bytes(field)


cdef inline list _encode_batch_in_c(list out, flags, queue_ids, queue_offsets, borns, stamps, dues, topics, msgids,
                                    tags, keys, props, bodies, bint crc_in_cpu, object crc, object extend):
    """``encode_batch``'s loop, with its pieces (a record's 10-byte prefix, the rest of its header
    with its text fields, its body, not copied: ``StoreWriter.write_columns`` takes the middle ones
    apart for the timer), each header laid out in C and the CRC computed over it and the body in
    place (``crc_in_cpu``: by ``chronoq_crc32c``, else by ``crc`` and ``extend``, google_crc32c's,
    on the header). The integers are converted to C types where ``struct`` would pack them
    (OverflowError where it raises struct.error); text fields and bodies that are other buffers
    than bytes are copied to bytes first; a field longer than its length field holds is a
    ValueError, as a record over RECORD_SIZE_MAX is."""
    cdef list sizes = []
    cdef bytes head, prefix
    cdef unsigned char* h
    cdef unsigned char* p
    cdef Py_ssize_t tl, ml, gl, kl, pl, bl, at, size
    cdef unsigned short flag, qid
    cdef uint64_t qoff
    cdef int64_t born, stamp, due
    cdef uint32_t c
    for f, queue_id, queue_offset, born_ms, stamp_ms, deliver_at_ms, topic, msgid, tag, k, pr, body in zip(
            flags, queue_ids, queue_offsets, borns, stamps, dues, topics, msgids, tags, keys, props, bodies):
        flag, qid, qoff, born, stamp, due = f, queue_id, queue_offset, born_ms, stamp_ms, deliver_at_ms
        topic, msgid, tag, k, pr, body = (_as_bytes(topic), _as_bytes(msgid), _as_bytes(tag), _as_bytes(k),
                                          _as_bytes(pr), _as_bytes(body))
        tl, ml, gl = PyBytes_GET_SIZE(topic), PyBytes_GET_SIZE(msgid), PyBytes_GET_SIZE(tag)
        kl, pl, bl = PyBytes_GET_SIZE(k), PyBytes_GET_SIZE(pr), PyBytes_GET_SIZE(body)
        if tl > 0xFF or ml > 0xFF or gl > 0xFFFF or kl > 0xFFFF or pl > 0xFFFFFFFF or bl > 0xFFFFFFFF:
            raise ValueError(f"a record field is longer than its length field holds ({tl}, {ml}, {gl}, {kl}, {pl}, {bl})")
        at = HEAD + tl + ml + gl + kl + pl
        size = at + bl
        if size > SIZE_MAX:
            raise ValueError(f"record of {size} bytes exceeds {SIZE_MAX}")
        # The head: the record from CRC_FROM (the flags) to the end of its text fields.
        head = PyBytes_FromStringAndSize(NULL, at - CRC_FROM)
        h = <unsigned char*>PyBytes_AS_STRING(head) - CRC_FROM  # (h + AT_x: field x, as in a record)
        _put(h + AT_FLAGS, flag, 2)
        _put(h + AT_QID, qid, 2)
        _put(h + AT_QOFF, qoff, 8)
        _put(h + AT_BORN, <uint64_t>born, 8)
        _put(h + AT_STORED, <uint64_t>stamp, 8)
        _put(h + AT_DELIVER, <uint64_t>due, 8)
        h[AT_TLEN], h[AT_MLEN] = <unsigned char>tl, <unsigned char>ml
        _put(h + AT_TAGLEN, <uint64_t>gl, 2)
        _put(h + AT_KLEN, <uint64_t>kl, 2)
        _put(h + AT_PLEN, <uint64_t>pl, 4)
        _put(h + AT_BLEN, <uint64_t>bl, 4)
        at = HEAD
        memcpy(h + at, PyBytes_AS_STRING(topic), tl)
        at += tl
        memcpy(h + at, PyBytes_AS_STRING(msgid), ml)
        at += ml
        memcpy(h + at, PyBytes_AS_STRING(tag), gl)
        at += gl
        memcpy(h + at, PyBytes_AS_STRING(k), kl)
        at += kl
        memcpy(h + at, PyBytes_AS_STRING(pr), pl)
        at += pl
        if crc_in_cpu:
            c = chronoq_crc32c_extend(chronoq_crc32c(h + CRC_FROM, <size_t>(at - CRC_FROM)),
                                      <const unsigned char*>PyBytes_AS_STRING(body), <size_t>bl)
        else:
            c = extend(crc(head), body)
        prefix = PyBytes_FromStringAndSize(NULL, CRC_FROM)
        p = <unsigned char*>PyBytes_AS_STRING(prefix)
        _put(p, <uint64_t>size, 4)
        p[4], p[5] = MAGIC_BYTE, VERSION_BYTE
        _put(p + AT_CRC, c, 4)
        out.append(prefix)
        out.append(head)
        out.append(body)
        sizes.append(size)
    return sizes
