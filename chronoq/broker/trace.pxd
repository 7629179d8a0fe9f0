# C types for the compiled build of trace.py (Cython reads this file beside it; the pure build
# ignores it, and both run the same source).
#
# ``_add_refs_in_c`` is the compiled build's ``_add_refs``: a receive's or an ack's events appended
# to the buffer's columns in one loop, each integer written into its array's memory (grown by
# ``resize_smart``, which over-allocates like ``array.append``) and each name appended to its
# list, so an event costs no temporary list or array. The Python ``_add_refs`` is the pure
# build's and the reference this one is held to (tests/unit/test_trace.py).
from cpython.array cimport array as c_array, resize_smart

cdef bint _COMPILED


cdef inline c_array _column(object column, int itemsize):
    # An Events integer column: an array.array of ``itemsize``-byte items ('I': 4, 'q': 8), which
    # the writes below address as C unsigned ints or long longs.
    cdef c_array out = <c_array?>column
    if out.ob_descr.itemsize != itemsize:
        raise TypeError(f"a trace column of {itemsize}-byte items was expected, not {out.ob_descr.itemsize}")
    return out


cdef inline int _put_u32(c_array a, unsigned int value) except -1:
    cdef Py_ssize_t n = len(a)
    resize_smart(a, n + 1)
    a.data.as_uints[n] = value
    return 0


cdef inline int _put_i64(c_array a, long long value) except -1:
    cdef Py_ssize_t n = len(a)
    resize_smart(a, n + 1)
    a.data.as_longlongs[n] = value
    return 0


cdef inline int _add_refs_in_c(object ev, unsigned int kind, object group, object popped, list refs,
                               long long now_ms) except -1:
    cdef c_array head = _column(ev.head, 4), ref_queue = _column(ev.ref_queue, 4)
    cdef c_array ts = _column(ev.ts, 8), due = _column(ev.due, 8), ref_offset = _column(ev.ref_offset, 8)
    cdef list topics = ev.topic, ids = ev.message_id, groups = ev.group, ref_topics = ev.ref_topic
    cdef list delivered = None
    cdef Py_ssize_t i, n = len(refs)
    cdef long long attempt
    cdef tuple ref
    if popped is not None:
        delivered = <list?>popped
        if len(delivered) != n:
            raise AssertionError((len(delivered), n))
    for i in range(n):
        ref = <tuple?>refs[i]
        ck, index = ref
        queue = ck.queue
        if delivered is None:
            _put_u32(head, kind)
            topics.append(None)
            ids.append(None)
        else:
            p = delivered[i]
            attempt = p.delivery_attempt
            _put_u32(head, kind | <unsigned int>(attempt if attempt < 0xFFFF else 0xFFFF) << 16)
            m = p.message
            topics.append(m.topic)
            ids.append(m.message_id)
        groups.append(group)
        ref_topics.append(queue.topic)
        _put_u32(ref_queue, <unsigned int>queue.queue_id)
        _put_i64(ts, now_ms)
        _put_i64(due, 0)
        _put_i64(ref_offset, <long long>ck.offsets[index])
    return 0
