"""Writing records: the one write path (a sans-I/O RecordWriter and its asyncio driver),
channel selectors, deterministic hashing."""

from __future__ import annotations

from exchange.writer.async_record_writer import AsyncRecordWriter, BufferSink
from exchange.writer.channel_selector import (
    BroadcastSelector,
    ChannelSelector,
    KeyHashSelector,
    PartitionerSelector,
    RoundRobinSelector,
)
from exchange.writer.hashing import deterministic_hash, partition_for_key
from exchange.writer.record_writer import (
    ALL_SUBPARTITIONS,
    DEFAULT_BUFFER_TIMEOUT,
    OutputBuffer,
    RecordWriter,
    WriterStats,
)

__all__ = [
    "ALL_SUBPARTITIONS",
    "DEFAULT_BUFFER_TIMEOUT",
    "AsyncRecordWriter",
    "BroadcastSelector",
    "BufferSink",
    "ChannelSelector",
    "KeyHashSelector",
    "OutputBuffer",
    "PartitionerSelector",
    "RecordWriter",
    "RoundRobinSelector",
    "WriterStats",
    "deterministic_hash",
    "partition_for_key",
]
