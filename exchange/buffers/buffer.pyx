# cython: language_level=3
"""Buffer (Flink's NetworkBuffer): a reference-counted view of a memory segment, compiled.

A buffer owns one reference to its segment. ``retain`` adds one, ``release`` drops one,
and the last release hands the segment to the buffer's recycler exactly once. Read-only
slices share the segment and its count: creating or retaining a slice retains the root,
releasing the slice releases the root, so every slice must be released exactly once per
reference it holds.

Compiled (a ``cdef class``, its fields C slots) because every buffer of every process
crosses it several times (received, queued, handed over, decoded, recycled): a property
read or a ``release`` is a C call, not an interpreted frame. The API is the one the Python
class had; ``buffer.pyi`` types it for mypy. There is no Python version of this module.
"""

from enum import IntEnum
from typing import Protocol

from exchange.errors import IllegalReferenceCountError, UsageError

__all__ = ["Buffer", "BufferRecycler", "DataType", "FreeingRecycler"]


class DataType(IntEnum):
    """What a buffer carries: serialized records, or one serialized event.

    ``ALIGNED_CHECKPOINT_BARRIER`` is an event that blocks its subpartition once polled,
    until the consumer sends ResumeConsumption (Flink's ``isBlockingUpstream``).
    ``PRIORITIZED_EVENT_BUFFER`` is an event that overtakes every buffer queued ahead of
    it, in the subpartition and in the receiving channel, and needs no credit (an
    unaligned checkpoint barrier; Flink's ``hasPriority``).
    """

    DATA_BUFFER = 0
    EVENT_BUFFER = 1
    ALIGNED_CHECKPOINT_BARRIER = 2
    PRIORITIZED_EVENT_BUFFER = 3

    @property
    def is_buffer(self):
        return self is DataType.DATA_BUFFER

    @property
    def is_event(self):
        return self is not DataType.DATA_BUFFER

    @property
    def is_blocking_upstream(self):
        return self is DataType.ALIGNED_CHECKPOINT_BARRIER

    @property
    def has_priority(self):
        return self is DataType.PRIORITIZED_EVENT_BUFFER


class BufferRecycler(Protocol):
    """Whoever lent a segment gets it back through ``recycle``."""

    def recycle(self, segment): ...


class _FreeingRecycler:
    """Recycler for unpooled segments: frees them."""

    __slots__ = ()

    def recycle(self, segment):
        segment.free()


FreeingRecycler = _FreeingRecycler()


cdef object _DATA_BUFFER = DataType.DATA_BUFFER


cdef class Buffer:
    """A readable region ``[offset, offset + size)`` of a segment, reference counted."""

    def __init__(self, segment, recycler, size=0, data_type=DataType.DATA_BUFFER):
        if not 0 <= size <= segment.size:
            raise UsageError(f"buffer size {size} outside [0, {segment.size}]")
        self._segment = segment
        self._recycler = recycler
        self._offset = 0
        self._size = size
        self._data_type = data_type
        self._refs = 1
        self._parent = None
        self.compressed = False

    @classmethod
    def wrap(cls, data, data_type):
        """An unpooled buffer holding a copy of ``data`` (events, tests)."""
        from exchange.memory.memory_segment import MemorySegment

        n = len(data) if not isinstance(data, memoryview) else data.nbytes
        segment = MemorySegment.allocate_unpooled(max(n, 1))
        segment.put(0, data)
        return cls(segment, FreeingRecycler, n, data_type)

    # -- what it holds -------------------------------------------------------------------

    @property
    def data_type(self):
        return self._data_type

    @property
    def is_buffer(self):
        """True for data buffers, False for events (Flink's ``isBuffer``)."""
        return self._data_type is _DATA_BUFFER

    @property
    def segment(self):
        return self._segment

    @property
    def size(self):
        """Readable bytes."""
        return self._size

    @property
    def offset(self):
        """Where the readable bytes start in the segment (non-zero for slices)."""
        return self._offset

    def set_size(self, size):
        if self._parent is not None:
            raise UsageError("a read-only slice cannot change its size")
        if not 0 <= size <= self._segment.size:
            raise UsageError(f"buffer size {size} outside [0, {self._segment.size}]")
        self._size = size

    def memoryview(self):
        """The readable bytes, zero-copy. Valid until the buffer is released."""
        self._check_alive()
        cdef Py_ssize_t off = self._offset
        return self._segment.view()[off : off + self._size]

    def to_bytes(self):
        return bytes(self.memoryview())

    # -- reference counting --------------------------------------------------------------

    @property
    def ref_count(self):
        return self._refs if self._parent is None else self._parent._refs

    @property
    def is_recycled(self):
        return self._refs == 0

    def retain(self):
        self._check_alive()
        self._refs += 1
        if self._parent is not None:
            # a slice shares its root's count (Flink's retainBuffer on a sliced buffer)
            self._parent._refs += 1
        return self

    def release(self):
        """Drop one reference; the last one recycles the segment."""
        cdef Py_ssize_t refs = self._refs
        if refs <= 0:
            raise IllegalReferenceCountError("buffer released more often than retained")
        self._refs = refs - 1
        parent = self._parent
        if parent is not None:
            parent.release()  # every reference a slice holds is one on its root
        elif refs == 1:
            self._recycler.recycle(self._segment)

    def read_only_slice(self, offset=0, length=None):
        """A slice sharing this buffer's segment; it holds one reference on this buffer."""
        self._check_alive()
        if length is None:
            length = self._size - offset
        if offset < 0 or length < 0 or offset + length > self._size:
            raise UsageError(f"slice [{offset}, {offset + length}) outside buffer of {self._size}")
        cdef Buffer root = self if self._parent is None else self._parent
        root._refs += 1
        cdef Buffer sl = Buffer.__new__(Buffer)
        sl._segment = self._segment
        sl._recycler = self._recycler
        sl._offset = self._offset + offset
        sl._size = length
        sl._data_type = self._data_type
        sl._refs = 1
        sl._parent = root
        sl.compressed = self.compressed
        return sl

    cdef int _check_alive(self) except -1:
        if self._refs <= 0:
            raise IllegalReferenceCountError("buffer used after its last release")
        return 0

    def __repr__(self):
        return (
            f"Buffer({self._data_type.name}, size={self._size}, refs={self.ref_count}, "
            f"segment={self._segment.index})"
        )
