# The compiled landing of a data-port client's BufferResponses
# (exchange/protocol/data_landing.pyx). Python code sees it through data_landing.pyi.

cdef class DataLanding:
    cdef readonly object address
    cdef readonly dict channels
    cdef object _landing
    cdef public bint accepting
    # shared memory (a connection to this host's daemon): the mapped arena's segments
    cdef object _arena
    cdef Py_ssize_t _segment_size
    cdef list _segments
    cdef list _give_backs
    cdef public bint sending
    cdef public object on_give_back_pending
    cdef readonly long long segments_held
    cdef readonly long long bytes_shared

    cdef void give_back(self, Py_ssize_t index) except *
