# The compiled Buffer's fields: other compiled modules cimport the type and read them at
# C speed. Python code sees the class through buffer.pyi.

cdef class Buffer:
    cdef object _segment
    cdef object _recycler
    cdef Py_ssize_t _offset
    cdef Py_ssize_t _size
    cdef object _data_type
    cdef Py_ssize_t _refs
    cdef Buffer _parent
    cdef public bint compressed

    cdef int _check_alive(self) except -1
