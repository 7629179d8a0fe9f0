# C types for the compiled build of grpcmsg.py (Cython reads this file beside it; the pure build
# ignores it, and both run the same source): a request's header fields are sorted by a C integer
# kind, its messages cut with C offsets.
import cython

cdef Py_ssize_t _F_META, _F_META_BIN, _F_SKIP, _F_CONTENT_TYPE, _F_TIMEOUT, _F_ENCODING, _F_TE, _F_MALFORMED
cdef Py_ssize_t _F_PATH, _F_METHOD, _F_SCHEME, _F_AUTHORITY, _F_BAD_PSEUDO, _F_PSEUDO, _REQUIRED

@cython.locals(out=list, pos=Py_ssize_t, n=Py_ssize_t, flag=Py_ssize_t, length=Py_ssize_t)
cpdef list cut_messages(buf, Py_ssize_t limit, encoding)

@cython.locals(metadata=list, kind=Py_ssize_t, kinds=dict, seen=Py_ssize_t, bit=Py_ssize_t, regular=bint)
cpdef tuple request_head(fields)

cpdef timeout_s(text)
