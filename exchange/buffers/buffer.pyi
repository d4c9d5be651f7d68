# Types of the compiled Buffer (exchange/buffers/buffer.pyx), for mypy --strict.
from enum import IntEnum
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from exchange.memory.memory_segment import MemorySegment

__all__ = ["Buffer", "BufferRecycler", "DataType", "FreeingRecycler"]

class DataType(IntEnum):
    """What a buffer carries: serialized records, or one serialized event."""

    DATA_BUFFER = 0
    EVENT_BUFFER = 1
    ALIGNED_CHECKPOINT_BARRIER = 2
    PRIORITIZED_EVENT_BUFFER = 3

    @property
    def is_buffer(self) -> bool: ...
    @property
    def is_event(self) -> bool: ...
    @property
    def is_blocking_upstream(self) -> bool: ...
    @property
    def has_priority(self) -> bool: ...

class BufferRecycler(Protocol):
    """Whoever lent a segment gets it back through ``recycle``."""

    def recycle(self, segment: MemorySegment) -> None: ...

FreeingRecycler: BufferRecycler

class Buffer:
    """A readable region ``[offset, offset + size)`` of a segment, reference counted."""

    compressed: bool
    def __init__(
        self,
        segment: MemorySegment,
        recycler: BufferRecycler,
        size: int = 0,
        data_type: DataType = ...,
    ) -> None: ...
    @classmethod
    def wrap(cls, data: bytes | bytearray | memoryview, data_type: DataType) -> Buffer: ...
    @property
    def data_type(self) -> DataType: ...
    @property
    def is_buffer(self) -> bool: ...
    @property
    def segment(self) -> MemorySegment: ...
    @property
    def size(self) -> int: ...
    def set_size(self, size: int) -> None: ...
    def memoryview(self) -> memoryview: ...
    def to_bytes(self) -> bytes: ...
    @property
    def ref_count(self) -> int: ...
    @property
    def is_recycled(self) -> bool: ...
    def retain(self) -> Buffer: ...
    def release(self) -> None: ...
    def read_only_slice(self, offset: int = 0, length: int | None = None) -> Buffer: ...
