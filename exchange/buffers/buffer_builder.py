"""BufferBuilder and BufferConsumer: one writer fills a segment, readers see what is written.

The builder owns one reference to the underlying Buffer and every consumer owns one more;
the segment goes back to its recycler once the builder and all its consumers are closed.
Everything runs on one thread, so what the builder appended is committed at once (Flink's
``commit`` position is simply the builder's position here).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from exchange.buffers.buffer import Buffer, BufferRecycler, DataType
from exchange.errors import IllegalStateError, UsageError

if TYPE_CHECKING:
    from exchange.memory.memory_segment import MemorySegment

__all__ = ["BufferBuilder", "BufferConsumer"]


class BufferBuilder:
    """Appends bytes into one segment, up to ``capacity`` (which debloating may lower)."""

    __slots__ = ("_buffer", "_closed", "_finished", "_limit", "_pos", "_view")

    def __init__(
        self, segment: MemorySegment, recycler: BufferRecycler, capacity: int | None = None
    ) -> None:
        if capacity is None:
            capacity = segment.size
        elif not 0 < capacity <= segment.size:
            raise UsageError(f"builder capacity {capacity} outside (0, {segment.size}]")
        self._buffer = Buffer(segment, recycler, 0, DataType.DATA_BUFFER)
        self._view = segment.view()
        self._pos = 0
        self._limit = capacity
        self._finished = False
        self._closed = False

    @property
    def capacity(self) -> int:
        return self._limit

    @property
    def committed_bytes(self) -> int:
        return self._pos

    @property
    def writable_bytes(self) -> int:
        return self._limit - self._pos

    @property
    def is_full(self) -> bool:
        return self._pos >= self._limit

    @property
    def is_finished(self) -> bool:
        return self._finished

    def append(self, data: bytes | bytearray | memoryview) -> int:
        """Copy as much of ``data`` as fits; returns the number of bytes copied."""
        if self._finished:
            raise IllegalStateError("append to a finished BufferBuilder")
        pos = self._pos
        n = len(data) if not isinstance(data, memoryview) else data.nbytes
        room = self._limit - pos
        if n > room:
            n = room
            data = memoryview(data)[:n]
        if n:
            try:
                self._view[pos : pos + n] = data
            except ValueError:
                self._buffer.segment.view()  # SegmentFreedError if its pool was destroyed
                raise
            self._pos = pos + n
            self._buffer._size = pos + n
        return n

    def trim(self, new_capacity: int) -> None:
        """Lower the capacity (never below what is already written)."""
        if new_capacity <= 0:
            raise UsageError(f"capacity must be positive, got {new_capacity}")
        self._limit = max(self._pos, min(new_capacity, self._limit))

    def finish(self) -> int:
        """Mark the buffer complete; returns the number of bytes written."""
        self._finished = True
        return self._pos

    def create_buffer_consumer(self) -> BufferConsumer:
        """A consumer that sees everything appended from now on."""
        return self._consumer(self._pos)

    def create_buffer_consumer_from_beginning(self) -> BufferConsumer:
        """A consumer that sees everything, including what was already appended."""
        return self._consumer(0)

    def _consumer(self, start: int) -> BufferConsumer:
        if self._closed:
            raise IllegalStateError("BufferBuilder is closed")
        self._buffer.retain()
        return BufferConsumer(self._buffer, self, start)

    def close(self) -> None:
        """Drop the builder's reference. Idempotent."""
        if not self._closed:
            self._closed = True
            self._finished = True
            self._buffer.release()

    def __repr__(self) -> str:
        return f"BufferBuilder({self._pos}/{self._limit}, finished={self._finished})"


class BufferConsumer:
    """Reads what a builder committed, as read-only slices, each released by its reader."""

    __slots__ = ("_buffer", "_builder", "_closed", "_read_pos")

    def __init__(self, buffer: Buffer, builder: BufferBuilder | None, start: int = 0) -> None:
        self._buffer = buffer
        self._builder = builder
        self._read_pos = start
        self._closed = False

    @classmethod
    def of_buffer(cls, buffer: Buffer) -> BufferConsumer:
        """A finished consumer over a complete buffer (events); takes over its reference."""
        return cls(buffer, None, 0)

    def _write_pos(self) -> int:
        b = self._builder
        return self._buffer.size if b is None else b._pos

    @property
    def data_type(self) -> DataType:
        return self._buffer.data_type

    @property
    def is_buffer(self) -> bool:
        return self._buffer.is_buffer

    @property
    def is_finished(self) -> bool:
        b = self._builder
        return b is None or b._finished

    @property
    def is_data_available(self) -> bool:
        return self._write_pos() > self._read_pos

    @property
    def written_bytes(self) -> int:
        return self._write_pos()

    @property
    def unread_bytes(self) -> int:
        return self._write_pos() - self._read_pos

    @property
    def is_closed(self) -> bool:
        return self._closed

    def build(self) -> Buffer:
        """A slice of everything committed since the last build (may be empty)."""
        if self._closed:
            raise IllegalStateError("BufferConsumer is closed")
        end = self._write_pos()
        start = self._read_pos
        self._read_pos = end
        return self._buffer.read_only_slice(start, end - start)

    def copy(self) -> BufferConsumer:
        """Another consumer at the same read position, sharing the buffer."""
        if self._closed:
            raise IllegalStateError("BufferConsumer is closed")
        self._buffer.retain()
        return BufferConsumer(self._buffer, self._builder, self._read_pos)

    def close(self) -> None:
        """Drop this consumer's reference. Idempotent."""
        if not self._closed:
            self._closed = True
            self._buffer.release()

    def __repr__(self) -> str:
        return (
            f"BufferConsumer({self._buffer.data_type.name}, read={self._read_pos}, "
            f"written={self._write_pos()}, finished={self.is_finished})"
        )
