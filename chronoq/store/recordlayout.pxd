# The record header's layout for the compiled build's C walks over records (record.pxd's check
# and encoder, routing.pxd's dispatch): field offsets and rules from record.py's layout table, and
# a reader and a writer of little-endian integers (also the schedule log's and recall handles'). A
# .pxd only, no module: each walk cimports it and compiles it in. A value here that drifted from
# record.py fails tests/unit/test_record.py and test_routing.py, which hold each C walk to its
# module's Python loop.
from libc.stdint cimport uint64_t

cdef enum:
    HEAD = 60            # record.HEADER_SIZE
    AT_CRC = 6
    CRC_FROM = 10        # record.CRC_START: the CRC covers [10, total)
    AT_FLAGS = 10
    AT_QID = 12
    AT_QOFF = 14
    AT_BORN = 22
    AT_STORED = 30
    AT_DELIVER = 38
    AT_TLEN = 46
    AT_MLEN = 47
    AT_TAGLEN = 48
    AT_KLEN = 50
    AT_PLEN = 52
    AT_BLEN = 56
    MAGIC_BYTE = 0xC9    # record.MAGIC
    VERSION_BYTE = 1     # record.VERSION
    SIZE_MAX = 64 * 1024 * 1024 + 256 * 1024  # record.RECORD_SIZE_MAX
    DELAYED = 1          # record.FLAG_DELAYED


cdef inline uint64_t _le(const unsigned char* b, int n) noexcept nogil:
    """The little-endian unsigned integer of ``n`` bytes at ``b`` (C compilers make one load of it)."""
    cdef uint64_t v = 0
    cdef int i = n - 1
    while i >= 0:
        v = (v << 8) | b[i]
        i -= 1
    return v


cdef inline void _put(unsigned char* p, uint64_t v, int n) noexcept nogil:
    """``v``'s low ``n`` bytes at ``p``, little-endian (C compilers make one store of it)."""
    cdef int i
    for i in range(n):
        p[i] = <unsigned char>(v >> (8 * i))
