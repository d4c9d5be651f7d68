"""Network memory: segments, the global NetworkBufferPool and LocalBufferPools."""

from __future__ import annotations

from exchange.memory.availability import AvailabilityHelper
from exchange.memory.buffer_listener import BufferListener, NotificationResult
from exchange.memory.local_buffer_pool import LocalBufferPool
from exchange.memory.local_pool_stats import LocalBufferPoolStats
from exchange.memory.memory_segment import MemorySegment
from exchange.memory.network_buffer_pool import (
    DEFAULT_SEGMENT_SIZE,
    DEFAULT_TOTAL_SEGMENTS,
    MIN_SEGMENT_SIZE,
    NetworkBufferPool,
    NetworkBufferPoolStats,
)

__all__ = [
    "DEFAULT_SEGMENT_SIZE",
    "DEFAULT_TOTAL_SEGMENTS",
    "MIN_SEGMENT_SIZE",
    "AvailabilityHelper",
    "BufferListener",
    "LocalBufferPool",
    "LocalBufferPoolStats",
    "MemorySegment",
    "NetworkBufferPool",
    "NetworkBufferPoolStats",
    "NotificationResult",
]
