"""Buffers: reference-counted views of memory segments, and the consumers that queue them."""

from __future__ import annotations

from exchange.buffers.buffer import Buffer, BufferRecycler, DataType, FreeingRecycler
from exchange.buffers.buffer_consumer import BufferConsumer

__all__ = [
    "Buffer",
    "BufferConsumer",
    "BufferRecycler",
    "DataType",
    "FreeingRecycler",
]
