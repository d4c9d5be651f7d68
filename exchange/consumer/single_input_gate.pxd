# The compiled gate's fields (exchange/consumer/single_input_gate.pyx). Python code sees
# the class through single_input_gate.pyi.

from exchange.consumer.input_channel cimport InputChannel


cdef class SingleInputGate:
    cdef public object name
    cdef public object buffer_pool
    cdef public list channels
    cdef object _with_data
    cdef Py_ssize_t _num_priority_channels
    cdef Py_ssize_t _num_finished
    cdef object _availability
    cdef bint _requested
    cdef bint _closed
    cdef public object debloater
    cdef bint _idle
    cdef public bint reports_idle

    cdef void _queue_priority(self, InputChannel channel) except *
    cdef void _dequeued(self, InputChannel channel) except *
    cdef void _on_queued(self) except *
    cdef void _retire(self, InputChannel ch) except *
