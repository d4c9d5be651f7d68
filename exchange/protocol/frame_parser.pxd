# The compiled frame parser's interface: other compiled modules cimport these types and
# call their cdef methods at C speed (uvloop's one .pxd per module). Python code sees the
# same classes through frame_parser.pyi.

cdef class BufferResponseHeader:
    cdef readonly unsigned long long receiver_id
    cdef readonly unsigned int sequence_number
    cdef readonly unsigned int backlog
    cdef readonly object data_type
    cdef readonly bint compressed
    cdef readonly Py_ssize_t size


cdef class PayloadReceived:
    cdef readonly object header
    cdef readonly object payload


cdef class InPlaceFrameDecoder:
    cdef Py_ssize_t _max_frame_size
    cdef object _sink
    cdef dict _data_frames
    cdef object _accept
    cdef Py_ssize_t _read_ahead
    cdef Py_ssize_t _want
    cdef bytearray _scratch
    cdef object _view
    cdef Py_ssize_t _start
    cdef Py_ssize_t _end
    cdef Py_ssize_t _frame_len
    cdef int _msg_id
    cdef bint _inline
    cdef object _target
    cdef Py_ssize_t _target_size
    cdef Py_ssize_t _filled
    cdef object _header
    cdef object _error
    cdef readonly long long bytes_received

    cdef void _grow(self, Py_ssize_t size) except *
    cdef void _poison(self, object exc)
    cdef void _land(self, list out)
    cdef void _parse(self, list out) except *
    cdef object _decode_control(self, Py_ssize_t start, Py_ssize_t length, int msg_id)
