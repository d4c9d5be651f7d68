# The compiled MemorySegment's fields (other compiled modules may cimport the type).

cdef class MemorySegment:
    cdef object _view
    cdef Py_ssize_t _size
    cdef public Py_ssize_t index

    cpdef bint is_in(self, list segments)
