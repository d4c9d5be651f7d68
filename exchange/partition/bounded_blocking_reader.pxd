# The compiled blocking-subpartition reader's fields (exchange/partition/bounded_blocking_reader.pyx):
# the data port's view reader cimports the type and polls at C speed. Python code sees
# the class through bounded_blocking_reader.pyi.

from exchange.buffers.buffer cimport Buffer

cdef class BoundedBlockingSubpartitionReader:
    cdef object _subpartition
    cdef object _reader
    cdef object _listener
    cdef public object state
    cdef Buffer _next
    cdef public Py_ssize_t memory
    cdef Py_ssize_t _data_backlog
    cdef Py_ssize_t _sequence_number
    # of the last buffer c_poll returned
    cdef bint polled_available
    cdef Py_ssize_t polled_backlog
    cdef object polled_next_type
    cdef Py_ssize_t polled_sequence_number

    cdef bint _readable(self)
    cdef Buffer c_poll(self)
