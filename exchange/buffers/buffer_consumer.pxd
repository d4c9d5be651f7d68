# The compiled BufferConsumer's fields (exchange/buffers/buffer_consumer.pyx): the
# pipelined subpartition cimports the type. Python code sees it through buffer_consumer.pyi.

from exchange.buffers.buffer cimport Buffer

cdef class BufferConsumer:
    cdef Buffer _buffer
    cdef bint _read
    cdef bint _closed

    cpdef Buffer build(self)
    cpdef close(self)
