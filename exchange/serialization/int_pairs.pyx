# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""The packed frame of the default codec: a batch of ``(int, int)`` records as fixed-width
integers instead of a pickle, written and read by C loops.

A frame of the default codec (``pickle_batch.py``) is ``u32 big-endian length | payload``;
a pickle payload starts with pickle's PROTO opcode (0x80). A packed payload starts with
``PAIRS_TAG`` (0xB1, no pickle opcode)::

    u8  0xB1 | u8 layout | u32 little-endian count | count x (key, value)

``layout`` bit 0 set: keys are 8 bytes, else 4; bit 1: values are 8 bytes, else 4; the
other bits are 0. Keys and values are little-endian two's complement, record after record.
The payload is exactly ``6 + count * (key width + value width)`` bytes.

``encode_int_pairs`` packs a batch only when every record is exactly a ``tuple`` of two
items each exactly an ``int`` in [-2**63, 2**63): a ``bool`` (``True`` must come back as
``True``), an ``int`` subclass, a larger int, a namedtuple or ``Row`` (tuple subclasses),
``None`` or any other item makes it return None after the first such record, and the
caller pickles the whole batch. The decoder builds ``(int, int)`` tuples equal to the
ones written. Each column is 4 bytes wide when all of the batch's values fit in 32 bits.

``decode_int_pairs`` (cimported by ``framing.pyx``: the reader's split of a received
frame) raises ``CorruptRecordError`` for a payload shorter than its header, an unknown
layout, or a length that is not the header plus ``count`` records; it allocates nothing
before those checks. There is no Python version of this module.
"""

from cpython.list cimport PyList_New, PyList_SET_ITEM
from cpython.mem cimport PyMem_Free, PyMem_Malloc
from cpython.object cimport PyObject
from cpython.ref cimport Py_INCREF
from libc.stdint cimport int32_t, int64_t, uint32_t, uint64_t

from exchange.errors import CorruptRecordError

__all__ = ["HEADER_SIZE", "PAIRS_TAG", "encode_int_pairs"]

cdef extern from "Python.h":
    ctypedef struct PyTypeObject:
        pass
    PyTypeObject PyLong_Type
    PyTypeObject PyTuple_Type
    PyTypeObject* Py_TYPE(PyObject*)
    Py_ssize_t PyTuple_GET_SIZE(PyObject*)
    PyObject* PyTuple_GET_ITEM(PyObject*, Py_ssize_t)
    PyObject* PyList_GET_ITEM(PyObject*, Py_ssize_t)
    long long PyLong_AsLongLongAndOverflow(PyObject*, int*)
    object PyLong_FromLongLong(long long)
    object PyBytes_FromStringAndSize(char*, Py_ssize_t)
    void PyObject_GC_UnTrack(object)
    char* PyBytes_AS_STRING(object)

#: The first byte of a packed payload.
PAIRS_TAG = _PAIRS_TAG
#: Bytes of a packed payload before its records (tag, layout, count).
HEADER_SIZE = _HEADER


cdef inline void _put_le(unsigned char* p, uint64_t v, int width) noexcept nogil:
    cdef int i
    for i in range(width):
        p[i] = <unsigned char>(v >> (8 * i))


cdef inline int64_t _get_le(const unsigned char* p, int width) noexcept nogil:
    """The little-endian signed integer of ``width`` (4 or 8: a constant once inlined,
    and the shifts compile to one load) bytes at ``p``."""
    cdef uint32_t lo = (
        (<uint32_t>p[0]) | ((<uint32_t>p[1]) << 8) | ((<uint32_t>p[2]) << 16)
        | ((<uint32_t>p[3]) << 24)
    )
    if width == 4:
        return <int64_t>(<int32_t>lo)
    return <int64_t>(
        (<uint64_t>lo) | ((<uint64_t>p[4]) << 32) | ((<uint64_t>p[5]) << 40)
        | ((<uint64_t>p[6]) << 48) | ((<uint64_t>p[7]) << 56)
    )


cdef inline Py_ssize_t _u32_le(const unsigned char* p) noexcept nogil:
    return <Py_ssize_t>(
        (<uint32_t>p[0]) | ((<uint32_t>p[1]) << 8) | ((<uint32_t>p[2]) << 16)
        | ((<uint32_t>p[3]) << 24)
    )


cdef inline bint _wide(int64_t v) noexcept nogil:
    return v < -2147483648 or v > 2147483647


def encode_int_pairs(records, Py_ssize_t max_payload):
    """``records`` (a list) as one packed frame (``u32 big-endian length | payload``), or
    None when a record is not exactly ``(int, int)`` within 64 bits, the batch is empty or
    not a list, or the payload would exceed ``max_payload`` bytes."""
    cdef Py_ssize_t n, i, size
    cdef PyObject* rec
    cdef PyObject* k
    cdef PyObject* v
    cdef int overflow = 0
    cdef int64_t kv, vv
    cdef bint wide_k = False, wide_v = False
    cdef int kw, vw
    cdef int64_t* pairs
    cdef unsigned char* out
    if type(records) is not list:
        return None
    n = len(<list>records)
    if n == 0 or n > (max_payload - _HEADER) // 8:
        return None
    pairs = <int64_t*>PyMem_Malloc(<size_t>n * 2 * sizeof(int64_t))
    if pairs == NULL:
        raise MemoryError()
    try:
        for i in range(n):
            rec = PyList_GET_ITEM(<PyObject*>records, i)
            if Py_TYPE(rec) != &PyTuple_Type or PyTuple_GET_SIZE(rec) != 2:
                return None
            k = PyTuple_GET_ITEM(rec, 0)
            v = PyTuple_GET_ITEM(rec, 1)
            if Py_TYPE(k) != &PyLong_Type or Py_TYPE(v) != &PyLong_Type:
                return None
            # exact ints: no error is possible, only an overflow
            kv = PyLong_AsLongLongAndOverflow(k, &overflow)
            if overflow:
                return None
            vv = PyLong_AsLongLongAndOverflow(v, &overflow)
            if overflow:
                return None
            wide_k |= _wide(kv)
            wide_v |= _wide(vv)
            pairs[2 * i] = kv
            pairs[2 * i + 1] = vv
        kw = 8 if wide_k else 4
        vw = 8 if wide_v else 4
        size = _HEADER + n * (kw + vw)
        if size > max_payload:
            return None
        frame = PyBytes_FromStringAndSize(NULL, 4 + size)
        out = <unsigned char*>PyBytes_AS_STRING(frame)
        out[0] = <unsigned char>(size >> 24)
        out[1] = <unsigned char>(size >> 16)
        out[2] = <unsigned char>(size >> 8)
        out[3] = <unsigned char>size
        out[4] = _PAIRS_TAG
        out[5] = (1 if wide_k else 0) | (2 if wide_v else 0)
        _put_le(out + 6, <uint64_t>n, 4)
        out += 4 + _HEADER
        for i in range(n):
            _put_le(out, <uint64_t>pairs[2 * i], kw)
            _put_le(out + kw, <uint64_t>pairs[2 * i + 1], vw)
            out += kw + vw
        return frame
    finally:
        PyMem_Free(pairs)


cdef list decode_int_pairs(const unsigned char* p, Py_ssize_t n):
    """The records of a packed payload of ``n`` bytes at ``p`` (its first byte is
    ``PAIRS_TAG``)."""
    cdef Py_ssize_t count, i
    cdef int kw, vw, layout
    cdef list out
    cdef object t
    if n < _HEADER:
        raise CorruptRecordError(
            f"a packed frame of {n} bytes is shorter than its {_HEADER}-byte header"
        )
    layout = p[1]
    if layout > 3:
        raise CorruptRecordError(f"a packed frame has an unknown layout {layout}")
    kw = 8 if layout & 1 else 4
    vw = 8 if layout & 2 else 4
    count = _u32_le(p + 2)
    if (n - _HEADER) % (kw + vw) or (n - _HEADER) // (kw + vw) != count:
        raise CorruptRecordError(
            f"a packed frame of {n} bytes claims {count} records of {kw + vw} bytes"
            f" ({_HEADER + count * (kw + vw)} bytes)"
        )
    out = PyList_New(count)
    p += _HEADER
    # one loop per layout, so that the widths are constants in each
    if layout == 0:
        _fill(out, p, count, 4, 4)
    elif layout == 1:
        _fill(out, p, count, 8, 4)
    elif layout == 2:
        _fill(out, p, count, 4, 8)
    else:
        _fill(out, p, count, 8, 8)
    return out


cdef inline int _fill(
    list out, const unsigned char* p, Py_ssize_t count, int kw, int vw
) except -1:
    """Set ``out[i]`` to the ``i``-th record at ``p``. A tuple of two ints cannot be in a
    reference cycle: it is untracked by the cyclic GC at once (the GC would untrack it at
    its first collection, after traversing it)."""
    cdef Py_ssize_t i
    cdef object t
    for i in range(count):
        t = (PyLong_FromLongLong(_get_le(p, kw)), PyLong_FromLongLong(_get_le(p + kw, vw)))
        PyObject_GC_UnTrack(t)
        Py_INCREF(t)
        PyList_SET_ITEM(out, i, t)
        p += kw + vw
    return 0
