# The compiled outbound batch of a data-port connection (exchange/network/outbound.pyx).
# Python code sees the class through outbound.pyi.

from exchange.buffers.buffer cimport Buffer

cdef class OutboundBatch:
    cdef public list out
    cdef public Py_ssize_t out_bytes
    cdef public list buffers
    cdef public long long bytes_written
    cdef public int corked
    cdef public list descriptors
    cdef public bint established
    cdef object _arena
    cdef list _arena_segments
    cdef readonly object in_flight
    cdef public dict held
    cdef public Py_ssize_t num_held
    cdef public long long bytes_shared
    cdef object _conn
    cdef object _transport
    cdef object _fail_reader
    cdef Py_ssize_t _batch_bytes

    cdef int _send_shared(
        self, object receiver_id, object sequence_number, object backlog, Buffer buf
    ) except -1
    cpdef frame_descriptors(self)
    cdef int _release(self, object receiver_id, Buffer buf) except -1
