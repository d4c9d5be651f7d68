"""Result partitions: what producers write and readers read."""

from __future__ import annotations

from exchange.partition.bounded_blocking_subpartition import (
    BoundedBlockingSubpartition,
    BoundedBlockingSubpartitionReader,
)
from exchange.partition.bounded_data import (
    BoundedData,
    FileBoundedData,
    MmapBoundedData,
    create_bounded_data,
)
from exchange.partition.pipelined_subpartition import (
    PipelinedSubpartition,
    PipelinedSubpartitionView,
)
from exchange.partition.result_partition import (
    ALL_SUBPARTITIONS,
    ResultPartition,
    ResultPartitionStats,
    ResultSubpartition,
)
from exchange.partition.result_partition_id import ResultPartitionID
from exchange.partition.result_partition_manager import ResultPartitionManager
from exchange.partition.result_partition_type import ResultPartitionType
from exchange.partition.states import (
    ReaderState,
    ResultPartitionState,
    SubpartitionState,
)
from exchange.partition.subpartition_view import (
    BufferAndBacklog,
    BufferAvailabilityListener,
    ResultSubpartitionView,
)

__all__ = [
    "ALL_SUBPARTITIONS",
    "BoundedBlockingSubpartition",
    "BoundedBlockingSubpartitionReader",
    "BoundedData",
    "BufferAndBacklog",
    "BufferAvailabilityListener",
    "FileBoundedData",
    "MmapBoundedData",
    "PipelinedSubpartition",
    "PipelinedSubpartitionView",
    "ReaderState",
    "ResultPartition",
    "ResultPartitionID",
    "ResultPartitionManager",
    "ResultPartitionState",
    "ResultPartitionStats",
    "ResultPartitionType",
    "ResultSubpartition",
    "ResultSubpartitionView",
    "SubpartitionState",
    "create_bounded_data",
]
