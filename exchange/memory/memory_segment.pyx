# cython: language_level=3
"""MemorySegment: a fixed-size window over one contiguous arena, compiled.

The NetworkBufferPool allocates one anonymous ``mmap`` and carves it into segments, so a
later shared-memory path can map the same arena. Segments never move or grow; a freed
segment refuses every use.

Compiled (a ``cdef class``) with ``Buffer`` (exchange/buffers/buffer.pyx): every buffer
received or sent asks its segment for its view. ``memory_segment.pyi`` types it for mypy.
There is no Python version of this module.
"""

from exchange.errors import SegmentFreedError, UsageError

__all__ = ["MemorySegment"]

cdef Py_ssize_t _UNPOOLED = -1


cdef class MemorySegment:
    """A bounds-checked, fixed-size region of memory.

    ``index`` is the segment's position in its arena (``-1`` for unpooled segments);
    pools use it to detect a segment handed out twice.
    """

    def __init__(self, view, index=_UNPOOLED):
        if view.readonly:
            raise UsageError("a memory segment needs a writable view")
        if view.ndim != 1 or view.itemsize != 1:
            raise UsageError("a memory segment needs a flat byte view")
        self._view = view
        self._size = view.nbytes
        self.index = index

    @classmethod
    def allocate_unpooled(cls, size):
        """A segment on its own heap memory (events, tests, oversized records)."""
        if not isinstance(size, int) or size <= 0:
            raise UsageError(f"segment size must be a positive int, got {size!r}")
        return cls(memoryview(bytearray(size)))

    @property
    def size(self):
        return self._size

    @property
    def is_freed(self):
        return self._view is None

    @property
    def is_pooled(self):
        return self.index != _UNPOOLED

    cpdef bint is_in(self, list segments):
        """True if this is one of ``segments``, an arena's segments by index (its
        ``index`` says where): ``NetworkBufferPool.owns``, in C for compiled callers."""
        cdef Py_ssize_t i = self.index
        return 0 <= i < len(segments) and segments[i] is self

    def view(self):
        """The whole segment as a writable memoryview."""
        view = self._view
        if view is None:
            raise SegmentFreedError(f"memory segment {self.index} was freed")
        return view

    def get(self, offset, length):
        """Copy ``length`` bytes starting at ``offset``."""
        self._check_range(offset, length)
        return bytes(self.view()[offset : offset + length])

    def put(self, offset, data):
        """Copy ``data`` into the segment at ``offset``."""
        n = len(data) if not isinstance(data, memoryview) else data.nbytes
        self._check_range(offset, n)
        self.view()[offset : offset + n] = data

    def free(self):
        """Release the segment; any later use raises SegmentFreedError."""
        view = self._view
        if view is None:
            raise SegmentFreedError(f"memory segment {self.index} was freed twice")
        self._view = None
        view.release()

    def _check_range(self, offset, length):
        if offset < 0 or length < 0 or offset + length > self._size:
            raise IndexError(
                f"range [{offset}, {offset + length}) outside segment of {self._size} bytes"
            )

    def __repr__(self):
        state = "freed" if self._view is None else f"{self._size}B"
        return f"MemorySegment(index={self.index}, {state})"
