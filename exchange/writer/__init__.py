"""Writing records: channel selectors, deterministic hashing, record writers."""

from __future__ import annotations

from exchange.writer.channel_selector import (
    BroadcastSelector,
    ChannelSelector,
    KeyHashSelector,
    PartitionerSelector,
    RoundRobinSelector,
)
from exchange.writer.hashing import deterministic_hash, partition_for_key
from exchange.writer.record_writer import (
    DEFAULT_BUFFER_TIMEOUT,
    BroadcastRecordWriter,
    RecordWriter,
)

__all__ = [
    "DEFAULT_BUFFER_TIMEOUT",
    "BroadcastRecordWriter",
    "BroadcastSelector",
    "ChannelSelector",
    "KeyHashSelector",
    "PartitionerSelector",
    "RecordWriter",
    "RoundRobinSelector",
    "deterministic_hash",
    "partition_for_key",
]
