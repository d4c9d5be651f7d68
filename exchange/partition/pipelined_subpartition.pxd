# The compiled pipelined subpartition's fields (exchange/partition/pipelined_subpartition.pyx):
# the data port's view reader cimports the types and polls at C speed. Python code sees
# the classes through pipelined_subpartition.pyi.

from exchange.buffers.buffer cimport Buffer

cdef class PipelinedSubpartitionView

cdef class PipelinedSubpartition:
    cdef public object index
    cdef object _parent
    cdef object _buffers
    cdef Py_ssize_t _backlog
    cdef Py_ssize_t _num_priority
    cdef object _channel_state_listener
    cdef public object state
    cdef object _failure
    cdef bint _flush_requested
    cdef bint _blocked
    cdef PipelinedSubpartitionView _view
    cdef object _sequence_number
    cdef public object buffer_size
    cdef list _buffer_size_listeners
    cdef public object total_bytes
    cdef public object total_buffers
    # of the last buffer c_poll returned
    cdef bint polled_available
    cdef Py_ssize_t polled_backlog
    cdef object polled_next_type
    cdef object polled_sequence_number

    cdef int _notify(self) except -1
    cdef int _notify_priority(self) except -1
    cdef bint _is_data_available(self)
    cdef object _next_data_type(self)
    cdef Py_ssize_t _backlog_now(self)
    cdef Buffer c_poll(self)

cdef class PipelinedSubpartitionView:
    cdef PipelinedSubpartition _subpartition
    cdef object _listener
    cdef public object state
