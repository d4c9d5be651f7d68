# The compiled LocalBufferPool's fields and C methods: compiled callers (a channel's floating
# requests, a buffer's recycle) cimport the type. Python code sees it through the .pyi.

from exchange.memory.availability cimport AvailabilityHelper

cdef class LocalBufferPool:
    cdef object _network_pool
    cdef object _global_free
    cdef public Py_ssize_t max_overdraft_buffers
    cdef Py_ssize_t _num_overdraft
    cdef public Py_ssize_t overdraft_taken
    cdef public Py_ssize_t num_required
    cdef public Py_ssize_t max_segments
    cdef readonly Py_ssize_t current_pool_size
    cdef Py_ssize_t _num_requested
    cdef public Py_ssize_t _owed
    cdef readonly object _available
    cdef object _listeners
    cdef AvailabilityHelper _availability
    cdef bint _destroyed

    cpdef object request_buffer(self)
    cdef object _request_segment(self)
    cpdef void recycle(self, object segment) except *
    cdef void _offer(self, object segment) except *
    cdef void _return_to_global(self, object segment) except *
    cpdef void _update_owed(self) except *
    cdef void _update_availability(self) except *
