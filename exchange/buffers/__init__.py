"""Buffers: reference-counted views of memory segments, and their builders/consumers."""

from __future__ import annotations

from exchange.buffers.buffer import Buffer, BufferRecycler, DataType, FreeingRecycler
from exchange.buffers.buffer_builder import BufferBuilder, BufferConsumer

__all__ = [
    "Buffer",
    "BufferBuilder",
    "BufferConsumer",
    "BufferRecycler",
    "DataType",
    "FreeingRecycler",
]
