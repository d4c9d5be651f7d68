# The compiled AvailabilityHelper's fields and C methods (cimported by local_buffer_pool.pyx;
# Python code sees the class through availability.pyi).

cdef class AvailabilityHelper:
    cdef bint _available
    cdef list _waiters
    cdef object _failure

    cdef void c_set_available(self) except *
    cdef inline void c_set_unavailable(self) noexcept:
        self._available = False
