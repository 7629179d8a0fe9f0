# C types for the compiled build of sending.py (Cython reads this file beside it; the pure build
# ignores it, and both run the same source).
import cython


cdef class Sender:
    cdef public object config, clock, registry, store, timer, trace, _dedupe
    cdef public dict _round_robin, _tags, sent_by_topic

    cpdef bytes tag_bytes(self, tag)
    cpdef list _checked_ids(self, ids)
    @cython.locals(start=Py_ssize_t, queues=Py_ssize_t, out=list, counters=dict)
    cpdef list _queues(self, batch, Py_ssize_t n, names, one, topic_of, groups, bint commit)
    @cython.locals(n=Py_ssize_t)
    cpdef _count_sent(self, list topics)
