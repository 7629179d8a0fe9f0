# C types for the compiled build of trace.py (Cython reads this file beside it; the pure build
# ignores it, and both run the same source).
#
# ``_add_refs_in_c`` and ``_add_runs_in_c`` are the compiled build's ``_add_refs`` (a receive's or
# an ack's events) and ``_add_runs`` (the kept send batches' events): appended to the buffer's
# columns in one loop, each integer written into its array's memory (grown by ``resize_smart``,
# which over-allocates like ``array.append``) and each name appended to its list, so an event
# costs no temporary list or array. The Python functions are the pure build's and the reference
# these are held to (tests/unit/test_trace.py).
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


cdef inline int _add_refs_in_c(object ev, unsigned int kind, object group, object popped, object given_refs,
                               long long now_ms) except -1:
    cdef c_array head = _column(ev.head, 4), ref_queue = _column(ev.ref_queue, 4)
    cdef c_array ts = _column(ev.ts, 8), due = _column(ev.due, 8), ref_offset = _column(ev.ref_offset, 8)
    cdef list topics = ev.topic, ids = ev.message_id, groups = ev.group, ref_topics = ev.ref_topic
    cdef list delivered = None
    cdef list refs = given_refs if type(given_refs) is list else list(given_refs)  # (as the pure build: any sequence)
    cdef Py_ssize_t i, n = len(refs)
    cdef long long attempt
    if popped is not None:
        delivered = popped if type(popped) is list else list(popped)
        if len(delivered) != n:
            raise AssertionError((len(delivered), n))
    for i in range(n):
        ck, index = refs[i]
        queue = ck.queue
        if delivered is None:
            _put_u32(head, kind)
            topics.append(None)
            ids.append(None)
        else:
            p = delivered[i]
            attempt = p.delivery_attempt
            if attempt < 0:  # (the pure build's array refuses it the same way)
                raise OverflowError(f"a delivery attempt is not negative: {attempt}")
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


cdef inline int _add_runs_in_c(object ev, list runs, unsigned int plain, unsigned int delayed) except -1:
    # ``plain``, ``delayed``: the head of a STORED event (its kind and flags), without and with FLAG_DELAYED.
    cdef c_array head = _column(ev.head, 4), ref_queue = _column(ev.ref_queue, 4)
    cdef c_array ts = _column(ev.ts, 8), due = _column(ev.due, 8), ref_offset = _column(ev.ref_offset, 8)
    cdef list topics = ev.topic, ids = ev.message_id, groups = ev.group, ref_topics = ev.ref_topic
    cdef list run_ids, dues
    cdef Py_ssize_t k, n
    cdef long long now_ms
    cdef tuple run
    for run in runs:
        topic, given_ids, given_now, given_dues = run
        run_ids = given_ids if type(given_ids) is list else list(given_ids)  # (the pure build takes any sequence)
        now_ms = given_now
        n = len(run_ids)
        dues = None
        if given_dues is not None:
            dues = given_dues if type(given_dues) is list else list(given_dues)
            if len(dues) != n:
                raise AssertionError((len(dues), n))
        for k in range(n):
            _put_u32(head, plain if dues is None else delayed)
            topics.append(topic)
            ids.append(run_ids[k])
            groups.append(None)
            ref_topics.append(None)
            _put_u32(ref_queue, 0)
            _put_i64(ts, now_ms)
            _put_i64(due, 0 if dues is None else <long long>dues[k])
            _put_i64(ref_offset, 0)
    return 0
