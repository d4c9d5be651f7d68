"""ResultPartitionManager: the registry of a daemon's (or process's) result partitions."""

from __future__ import annotations

from collections import OrderedDict
from typing import Final

from exchange.errors import (
    PartitionError,
    PartitionNotFoundError,
    PartitionReleasedError,
    ProducerFailedError,
    UsageError,
    error_reason,
)
from exchange.partition.result_partition import ResultPartition
from exchange.partition.result_partition_id import ResultPartitionID
from exchange.partition.subpartition_view import BufferAvailabilityListener, ResultSubpartitionView

__all__ = ["ResultPartitionManager"]

_REMEMBER_RELEASED: Final = 4096


class ResultPartitionManager:
    """Registers partitions, hands out subpartition views, releases partitions."""

    def __init__(self) -> None:
        self._partitions: dict[ResultPartitionID, ResultPartition] = {}
        # Recently released ids, so a late reader hears "released" (or "producer failed",
        # or "data lost"), not "not found". Kept as (error type, text): an exception would
        # pin its traceback.
        self._released: OrderedDict[ResultPartitionID, tuple[type[PartitionError], str]] = (
            OrderedDict()
        )

    def register_result_partition(self, partition: ResultPartition) -> None:
        pid = partition.partition_id
        if pid in self._partitions:
            raise UsageError(f"result partition {pid} is already registered")
        self._partitions[pid] = partition
        self._released.pop(pid, None)
        partition.add_release_listener(self._on_partition_released)

    def get_partition(self, pid: ResultPartitionID) -> ResultPartition:
        part = self._partitions.get(pid)
        if part is None:
            released = self._released.get(pid)
            if released is not None:
                error_type, reason = released
                raise error_type(reason, pid)
            raise PartitionNotFoundError("partition not found", pid)
        return part

    def create_subpartition_view(
        self, pid: ResultPartitionID, index: int, listener: BufferAvailabilityListener
    ) -> ResultSubpartitionView:
        return self.get_partition(pid).create_subpartition_view(index, listener)

    def release_partition(self, pid: ResultPartitionID, cause: BaseException | None = None) -> bool:
        """Release one partition; False if it is not registered."""
        part = self._partitions.get(pid)
        if part is None:
            return False
        part.release(cause)
        return True

    def release_dataset(
        self, dataset_id: str, cause: BaseException | None = None, *, app_id: str | None = None
    ) -> int:
        """Release every partition of one exchange (of application ``app_id`` only, unless
        None); returns how many."""
        pids = [
            pid
            for pid, part in self._partitions.items()
            if pid.dataset_id == dataset_id and (app_id is None or part.app_id == app_id)
        ]
        for pid in pids:
            self._partitions[pid].release(cause)
        return len(pids)

    def release_all(self, cause: BaseException | None = None) -> None:
        for part in list(self._partitions.values()):
            part.release(cause)

    def _on_partition_released(self, partition: ResultPartition) -> None:
        pid = partition.partition_id
        if self._partitions.get(pid) is partition:
            del self._partitions[pid]
            cause = partition.failure_cause
            failed = isinstance(cause, ProducerFailedError)
            reason = "failed: " + error_reason(cause) if cause else "released"
            self._remember(
                pid,
                ProducerFailedError if failed else PartitionReleasedError,
                f"partition was released ({reason})",
            )

    def remember_gone(self, pid: ResultPartitionID, error: PartitionError) -> None:
        """A partition this manager never held is gone for good (it died with a previous
        daemon, or its data did not survive): readers asking for it get ``error``'s type
        and message instead of a not-found they would retry."""
        if pid not in self._partitions:
            self._remember(pid, type(error), error.reason)

    def _remember(
        self, pid: ResultPartitionID, error_type: type[PartitionError], text: str
    ) -> None:
        self._released[pid] = (error_type, text)
        while len(self._released) > _REMEMBER_RELEASED:
            self._released.popitem(last=False)

    @property
    def partitions(self) -> list[ResultPartition]:
        return list(self._partitions.values())

    def __len__(self) -> int:
        return len(self._partitions)

    def __contains__(self, pid: object) -> bool:
        return pid in self._partitions
