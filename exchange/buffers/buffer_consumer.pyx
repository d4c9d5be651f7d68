# cython: language_level=3, boundscheck=False, wraparound=False
"""BufferConsumer: one complete buffer queued in a subpartition, read once.

Every buffer a subpartition queues is complete when it is added (the RecordWriter cuts
whole buffers; events are serialized whole), so a consumer is a reference to a Buffer and
a flag: ``build`` hands out a read-only slice of the whole buffer the first time and an
empty one afterwards. ``copy`` gives another subpartition its own consumer of the same
buffer (a broadcast event), with a reference of its own; the segment goes back to its
recycler once every consumer is closed and every slice released.

Compiled (a ``cdef class``): the daemon makes one per buffer it relays, queues it and
polls it (``pipelined_subpartition.pyx`` reads its fields in C). ``buffer_consumer.pyi``
types it for mypy. There is no Python version of this module.
"""

from exchange.buffers.buffer cimport Buffer

from exchange.errors import IllegalStateError

__all__ = ["BufferConsumer"]


cdef class BufferConsumer:
    """A complete buffer and whether it was read; owns one reference to the buffer."""

    def __init__(self, Buffer buffer not None, *, bint read=False):
        self._buffer = buffer
        self._read = read
        self._closed = False

    @classmethod
    def of_buffer(cls, Buffer buffer not None):
        """A consumer of a complete buffer; takes over the caller's reference."""
        return cls(buffer)

    @property
    def data_type(self):
        return self._buffer._data_type

    @property
    def is_buffer(self):
        return self._buffer.is_buffer

    @property
    def is_data_available(self):
        """Bytes not read yet (False for an empty buffer)."""
        return not self._read and self._buffer._size > 0

    @property
    def unread_bytes(self):
        return 0 if self._read else self._buffer._size

    @property
    def is_closed(self):
        return self._closed

    cpdef Buffer build(self):
        """A read-only slice of the bytes not read yet: the whole buffer, then empty."""
        if self._closed:
            raise IllegalStateError("BufferConsumer is closed")
        size = self._buffer._size
        start = size if self._read else 0
        self._read = True
        return self._buffer.read_only_slice(start, size - start)

    def retained_slice(self):
        """A read-only slice of the whole buffer holding a reference of its own, whatever
        was read (an unaligned barrier's snapshot of a buffer it overtook)."""
        if self._closed:
            raise IllegalStateError("BufferConsumer is closed")
        return self._buffer.read_only_slice(0, self._buffer._size)

    def copy(self):
        """Another consumer in the same read state, sharing the buffer."""
        if self._closed:
            raise IllegalStateError("BufferConsumer is closed")
        self._buffer.retain()
        return BufferConsumer(self._buffer, read=self._read)

    cpdef close(self):
        """Drop this consumer's reference. Idempotent."""
        if not self._closed:
            self._closed = True
            self._buffer.release()

    def __repr__(self):
        return (
            f"BufferConsumer({self._buffer.data_type.name}, size={self._buffer.size}, "
            f"read={self._read})"
        )
