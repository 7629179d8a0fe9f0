# C types for the compiled build of fields.py (Cython reads this file beside it; the pure build
# ignores it, and both run the same source): the helpers a message's encoding calls several times
# (chronoq.protocol.rocketmq.outgoing, per message) are C functions to modules that cimport them.
import cython

cpdef bytes varint(n)
cpdef bytes field(bytes k, payload)
cpdef bytes string_field(bytes k, text)
@cython.locals(rest=Py_ssize_t, head=bytes)
cpdef bytes timestamp(ms)
