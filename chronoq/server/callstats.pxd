# C types for the compiled build of callstats.py (Cython reads this file beside it; the pure build
# ignores it, and both run the same source): the counting each call ends with is C calls from
# h2streams. (A varint's value stays a Python int: ten bytes of one do not fit a C integer.)
import cython


@cython.locals(end=Py_ssize_t, b=Py_ssize_t)
cdef tuple _varint(data, Py_ssize_t i)

@cython.locals(length=object, i=Py_ssize_t)
cpdef answer_code(data)


cdef class CallStats:
    cdef public Py_ssize_t bytes_in, bytes_out
    cdef public dict calls, latency, latency_sum_s, answers

    @cython.locals(buckets=list, calls=dict)
    cpdef call_ended(self, method, Py_ssize_t code, double seconds, answer=*)
