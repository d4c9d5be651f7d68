# The compiled request queue's fields (exchange/network/partition_request_queue.pyx).
# Python code sees the class through partition_request_queue.pyi.

from exchange.network.credit_based_view_reader cimport (
    CreditBasedSequenceNumberingViewReader as Reader,
)

cdef class PartitionRequestQueue:
    cdef object _channel
    cdef object _schedule
    cdef object _available  # deque of Readers, each at most once
    cdef dict _readers  # receiver id -> Reader
    cdef bint _released
    cdef public object buffers_sent
    cdef public object bytes_sent

    cdef int _enqueue(self, Reader reader, bint priority) except -1
    cdef int _fail_reader(self, Reader reader, cause) except -1
    cdef int _drop(self, Reader reader) except -1
    cdef int _send_release_error(self, Reader reader) except -1
