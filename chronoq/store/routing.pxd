# The compiled build's walk of routing.py (Cython reads this file beside it; the pure build ignores
# it and runs ``route``'s Python loop, the reference). ``_route_in_c`` reads each record's routing
# fields as C integers straight from the chunk, appends its 24-byte entry to its run's bytearray
# through a pointer, and makes Python objects per run or per new name only: a topic whose bytes
# equal the last one's keeps its name, a tag equal to the last one's keeps its CRC, and a queue's
# run is found by its slot (queue id & 63, checked against the id and the topic object) without
# a (topic, queue id) key or a dict lookup. Every record is bounds-checked against ``stop`` before
# a field is read, so a misread length fails route's assert instead of reading past the chunk.
from cpython.bytearray cimport PyByteArray_AS_STRING, PyByteArray_GET_SIZE, PyByteArray_Resize
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize, PyBytes_GET_SIZE
from libc.stdint cimport int64_t, uint64_t
from libc.string cimport memcmp

# Field offsets in a record (record.py's layout table; record.ROUTE's unpacking reads the same).
from chronoq.store.recordlayout cimport (AT_DELIVER, AT_FLAGS, AT_MLEN, AT_QID, AT_QOFF, AT_STORED, AT_TAGLEN, AT_TLEN,
                                         DELAYED, HEAD, _le)

DEF ENTRY_BYTES = 24  # consumequeue.ENTRY_SIZE: "<QIIq"
DEF SLOTS = 64  # runs remembered by queue id (a power of two: a mask picks the slot)


cdef inline void _put_le(unsigned char* b, uint64_t v, int n) noexcept nogil:
    cdef int i = 0
    while i < n:
        b[i] = <unsigned char>(v & 0xFF)
        v >>= 8
        i += 1


cdef inline void _entry(unsigned char* e, uint64_t offset, uint64_t length, uint64_t crc, int64_t stored) noexcept nogil:
    """A consume-queue entry (ENTRY's "<QIIq") laid down at ``e``."""
    _put_le(e, offset, 8)
    _put_le(e + 8, length, 4)
    _put_le(e + 12, crc, 4)
    _put_le(e + 16, <uint64_t>stored, 8)


cdef inline int _extend(bytearray run, uint64_t offset, uint64_t length, uint64_t crc, int64_t stored) except -1:
    """Append one entry to ``run`` in place (a bytearray grows by over-allocating: amortized)."""
    cdef Py_ssize_t n = PyByteArray_GET_SIZE(run)
    PyByteArray_Resize(run, n + ENTRY_BYTES)
    _entry(<unsigned char*>PyByteArray_AS_STRING(run) + n, offset, length, crc, stored)
    return 0


cdef inline Py_ssize_t _route_in_c(bytes chunk, Py_ssize_t p, Py_ssize_t stop, long long at, dict batch,
                                   list taps, object add_entry, object topic_name, object crc32) except -1:
    """``route``'s walk; ``topic_name`` and ``crc32`` are record.topic_name and zlib.crc32, handed in
    (a .pxd's inline function sees no names of the module's Python scope)."""
    cdef const unsigned char* buf = <const unsigned char*>PyBytes_AS_STRING(chunk)
    cdef const unsigned char* r
    cdef unsigned char e[ENTRY_BYTES]
    cdef Py_ssize_t total, t, tlen, taglen, made = 0, slot
    cdef Py_ssize_t last_tlen = -1, last_taglen = -1
    cdef uint64_t qoff, tag_crc = 0, last_tag_crc = 0
    cdef int64_t stored
    cdef long long qid
    cdef long long slot_qid[SLOTS]
    cdef long long slot_next[SLOTS]  # the queue offset the slot's run continues with
    cdef list slot_topic = [None] * SLOTS
    cdef list slot_run = [None] * SLOTS
    cdef bytes last_raw = b""  # the last topic's bytes
    cdef bytes last_tag = b""
    cdef object topic = None
    cdef object run, key
    cdef bytearray entries
    assert 0 <= p <= stop <= PyBytes_GET_SIZE(chunk), (p, stop, len(chunk))
    for slot in range(SLOTS):
        slot_qid[slot] = -1
    while p < stop:
        if stop - p < HEAD:
            break
        r = buf + p
        total = <Py_ssize_t>_le(r, 4)
        if total < HEAD or total > stop - p:
            break
        if _le(r + AT_FLAGS, 2) & DELAYED:  # the timer absorbs these itself: no entry
            if taps is not None:
                taps.append(p)
            p += total
            continue
        if _le(r + AT_DELIVER, 8) and taps is not None:
            taps.append(p)
        qid = <long long>_le(r + AT_QID, 2)
        qoff = _le(r + AT_QOFF, 8)
        stored = <int64_t>_le(r + AT_STORED, 8)
        tlen = r[AT_TLEN]
        taglen = <Py_ssize_t>_le(r + AT_TAGLEN, 2)
        t = p + HEAD
        if HEAD + tlen + r[AT_MLEN] + taglen > total:
            break
        if tlen != last_tlen or memcmp(buf + t, PyBytes_AS_STRING(last_raw), tlen) != 0:
            last_raw = chunk[t:t + tlen]
            last_tlen = tlen
            topic = topic_name(last_raw)
        t += tlen + r[AT_MLEN]
        if not taglen:
            tag_crc = 0
        elif taglen != last_taglen or memcmp(buf + t, PyBytes_AS_STRING(last_tag), taglen) != 0:
            last_tag = chunk[t:t + taglen]
            last_taglen = taglen
            last_tag_crc = crc32(last_tag)
            tag_crc = last_tag_crc
        else:
            tag_crc = last_tag_crc
        slot = qid & (SLOTS - 1)
        if slot_qid[slot] == qid and <long long>qoff == slot_next[slot] and slot_topic[slot] is topic:
            _extend(<bytearray>slot_run[slot], at + p, total, tag_crc, stored)  # (the common case)
            slot_next[slot] += 1
        else:
            key = (topic, qid)
            run = batch.get(key)
            if run is not None and run[0] + len(run[1]) // ENTRY_BYTES == qoff:
                _extend(<bytearray>run[1], at + p, total, tag_crc, stored)
            else:
                _entry(e, at + p, total, tag_crc, stored)
                add_entry(batch, key, qoff, PyBytes_FromStringAndSize(<char*>e, ENTRY_BYTES))
                run = batch[key]
            entries = run[1]
            slot_qid[slot] = qid
            slot_topic[slot] = topic
            slot_run[slot] = entries
            slot_next[slot] = run[0] + PyByteArray_GET_SIZE(entries) // ENTRY_BYTES
        made += 1
        p += total
    assert p == stop, (p, stop)  # whole records: a walk that overran misread a length
    return made
