# The compiled framing's classes (exchange/serialization/framing.pyx).

from exchange.buffers.buffer cimport Buffer

cdef class DecoderBase:
    cdef public list _ready
    cdef public object _error


cdef class LengthPrefixedDecoder(DecoderBase):
    cdef Py_ssize_t _limit
    cdef unsigned char _head[4]
    cdef int _headlen
    cdef readonly bytearray _frame  # read by tests: the memory a cut frame holds
    cdef Py_ssize_t _need
    cdef Py_ssize_t _have
    cdef readonly bytearray _scratch
    cdef bint _int_pairs

    cdef int _queue(self, list records) except -1

    cdef int _feed(self, object view, Py_ssize_t base=*, Py_ssize_t length=*) except -1
    cdef int _feed_buffer(self, Buffer buf) except -1
    cdef Py_ssize_t _complete(self, const unsigned char* p, Py_ssize_t end) except -2
    cdef bytearray _start_frame(self, Py_ssize_t n)
