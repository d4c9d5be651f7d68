# The compiled view reader's fields (exchange/network/credit_based_view_reader.pyx): the
# send loop in partition_request_queue.pyx cimports the type and polls it at C speed.
# Python code sees the class through credit_based_view_reader.pyi.

from exchange.buffers.buffer cimport Buffer

cdef class CreditBasedSequenceNumberingViewReader:
    cdef object _queue
    cdef object _view
    cdef public object receiver_id
    cdef public Py_ssize_t initial_credit
    cdef public Py_ssize_t credits
    cdef public bint registered_as_available
    cdef public object partition_id
    cdef public object subpartition_index
    # of the last buffer polled
    cdef readonly bint more_available
    cdef readonly Py_ssize_t backlog
    cdef readonly object sequence_number

    cpdef bint is_available(self) except -1
    cdef Buffer poll(self)
