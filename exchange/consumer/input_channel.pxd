# The compiled InputChannel's fields (exchange/consumer/input_channel.pyx): the remote
# channel (remote_input_channel.pyx) extends the type and reads them at C speed. Python
# code sees the class through input_channel.pyi.

cdef class InputChannel:
    cdef public object gate
    cdef public object channel_index
    cdef public object partition_id
    cdef public object subpartition_index
    cdef public double backoff_initial
    cdef public double backoff_max
    cdef public object _error
    cdef public bint _released
    cdef public bint queued
    cdef public bint queued_with_priority
    cdef public bint finished
    cdef public long long bytes_in
    cdef public long long buffers_in
