"""ResultPartitionType: how a partition is consumed."""

from __future__ import annotations

from enum import Enum

__all__ = ["ResultPartitionType"]


class ResultPartitionType(Enum):
    """``PIPELINED``: streamed while written, consumed once, bounded by its buffer pool.
    ``BLOCKING``: written fully (spilled to files), then read any number of times."""

    PIPELINED = "pipelined"
    BLOCKING = "blocking"

    @property
    def is_pipelined(self) -> bool:
        return self is ResultPartitionType.PIPELINED

    @property
    def is_blocking(self) -> bool:
        return self is ResultPartitionType.BLOCKING
