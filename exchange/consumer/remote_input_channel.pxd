# The compiled remote channel's fields (exchange/consumer/remote_input_channel.pyx): its
# receive path (a buffer's arrival, credit, the free-buffer queue) runs as C calls. Python
# code sees the classes through remote_input_channel.pyi.

from exchange.buffers.buffer cimport Buffer
from exchange.consumer.input_channel cimport InputChannel


cdef class AvailableBufferQueue:
    cdef public object floating
    cdef public object exclusive

    cdef Py_ssize_t size(self)
    cpdef Py_ssize_t add_exclusive(self, Buffer buffer, Py_ssize_t num_required) except -1
    cpdef Buffer take(self)


cdef class RemoteInputChannel(InputChannel):
    cdef public object address
    cdef object _provider
    cdef object _network_pool
    cdef public Py_ssize_t initial_credit
    cdef object _buffer_request_timeout
    cdef object _client
    cdef object _received
    cdef Py_ssize_t _num_priority
    cdef object _overtaken
    cdef unsigned long long _expected_sequence
    cdef Py_ssize_t _unannounced_credit
    cdef bint _credit_notified
    cdef public AvailableBufferQueue _queue
    cdef Py_ssize_t _num_required
    cdef bint _waiting_for_floating
    cdef Py_ssize_t _exclusive_segments
    cdef object _delays
    cdef public object receiver_id
    cdef public Py_ssize_t sender_backlog
    cdef object _buffer_size
    cdef public Py_ssize_t floating_share
    cdef Py_ssize_t _floor

    cpdef Buffer request_buffer(self)
    cpdef void on_buffer(self, Buffer buffer, unsigned long long sequence_number,
                         long long backlog) except *
    cdef void _on_priority_event(self, Buffer buffer) except *
    cpdef void on_sender_backlog(self, Py_ssize_t backlog) except *
    cdef Py_ssize_t _request_floating_buffers(self, Py_ssize_t num_required) except -1
    cdef void _add_credit(self, Py_ssize_t n) except *
    cdef void _maybe_announce(self) except *
