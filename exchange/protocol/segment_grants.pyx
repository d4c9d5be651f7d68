# cython: language_level=3, boundscheck=False, wraparound=False
"""A ``GrantSegments`` body's segment indices read in C (the producer task's loop thread).

The daemon encodes a grant as the msgpack map ``{"segments": [index, ...]}``
(docs/protocol.md), which ``msgpack.packb`` writes as a fixmap of one entry, the fixstr
key, an array header (fix or 16-bit) and each index in the smallest unsigned form.
``grant_indices`` reads a body of that shape (an index in any of positive fixint, uint 8,
16 or 32) straight into a tuple of ints; for any other body, valid or not, it returns None
and the codec decodes it the general way (``local_messages``), so a malformed grant
raises the same ``ProtocolError`` as before. There is no Python version
of this module.
"""

from cpython.buffer cimport PyBUF_SIMPLE, PyBuffer_Release, PyObject_GetBuffer
from cpython.long cimport PyLong_FromUnsignedLong
from cpython.ref cimport Py_INCREF
from cpython.tuple cimport PyTuple_New, PyTuple_SET_ITEM
from libc.stdint cimport uint32_t
from libc.string cimport memcmp

__all__ = ["grant_indices"]

cdef bytes _KEY = b"\xa8segments"  # fixstr of 8 bytes


cdef inline uint32_t _be(const unsigned char* p, int n) noexcept nogil:
    cdef uint32_t v = 0
    cdef int k
    for k in range(n):
        v = (v << 8) | p[k]
    return v


def grant_indices(body: object, Py_ssize_t max_count) -> object:
    """The indices of a canonical ``{"segments": [...]}`` body (1 to ``max_count`` of
    them, each a uint32) as a tuple, or None when the body is anything else."""
    cdef Py_buffer view
    cdef const unsigned char* p
    cdef Py_ssize_t size, pos, n, k
    cdef unsigned char b
    cdef int width
    cdef uint32_t v
    cdef object result = None
    cdef object item
    PyObject_GetBuffer(body, &view, PyBUF_SIMPLE)
    try:
        p = <const unsigned char*>view.buf
        size = view.len
        pos = 1 + len(_KEY)
        if size < pos + 1 or p[0] != 0x81 or memcmp(p + 1, <const char*>_KEY, len(_KEY)) != 0:
            return None
        b = p[pos]
        if b & 0xF0 == 0x90:
            n = b & 0x0F
            pos += 1
        elif b == 0xDC and size >= pos + 3:
            n = _be(p + pos + 1, 2)
            pos += 3
        else:
            return None
        if n < 1 or n > max_count or size - pos < n:
            return None
        tup = PyTuple_New(n)
        for k in range(n):
            if pos >= size:
                return None
            b = p[pos]
            if b < 0x80:
                v = b
                pos += 1
            else:
                if b == 0xCC:
                    width = 1
                elif b == 0xCD:
                    width = 2
                elif b == 0xCE:
                    width = 4
                else:
                    return None
                if size - pos - 1 < width:
                    return None
                v = _be(p + pos + 1, width)
                pos += 1 + width
            item = PyLong_FromUnsignedLong(v)
            Py_INCREF(item)  # PyTuple_SET_ITEM steals a reference
            PyTuple_SET_ITEM(tup, k, item)
        if pos != size:
            return None  # trailing bytes: the general decoder names them
        result = tup
    finally:
        PyBuffer_Release(&view)
    return result
