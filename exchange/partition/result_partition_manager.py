"""ResultPartitionManager: the registry of a daemon's (or process's) result partitions.

Partition ids are per application: the registry is keyed by (application, partition id),
so one application can neither see, nor take first, nor learn of another's ids: asking
for a partition another application holds, or held, is answered exactly as asking for one
that never existed (``PartitionNotFoundError``). ``""`` is the namespace of "no
application" (no secret, or a client of the daemon's secret that names none).

Abandoned subpartitions: a consumer that gives up before the end may never have asked for
its subpartition of some partition (it did not exist yet, or its request had not come).
``abandon_subpartition`` releases that subpartition of the dataset's pipelined partitions
now, and remembers (application, dataset, subpartition), so that a partition of that
dataset created later gets it released as soon as it exists (``apply_abandoned``): its
producer sees "released by its consumer before the end", as if the consumer had
requested it and left. The memory is bounded: it goes when the dataset is released
(``release_dataset``), and an application's oldest datasets are forgotten first beyond
``MAX_ABANDONED_PER_APP`` remembered (dataset, subpartition) pairs.
"""

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
from exchange.partition.bounded_data import ReadMemory
from exchange.partition.result_partition import ResultPartition
from exchange.partition.result_partition_id import ResultPartitionID
from exchange.partition.subpartition_view import BufferAvailabilityListener, ResultSubpartitionView

__all__ = ["MAX_ABANDONED_PER_APP", "ResultPartitionManager"]

_REMEMBER_RELEASED: Final = 4096
#: Abandoned (dataset, subpartition) pairs remembered per application at most.
MAX_ABANDONED_PER_APP: Final = 4096

#: (application, partition id): how the registry keys a partition
_Key = tuple[str, ResultPartitionID]


class ResultPartitionManager:
    """Registers partitions, hands out subpartition views, releases partitions."""

    def __init__(self) -> None:
        self._partitions: dict[_Key, ResultPartition] = {}
        # Recently released ids, so a late reader hears "released" (or "producer failed",
        # or "data lost"), not "not found". Kept as (error type, text): an exception would
        # pin its traceback.
        self._released: OrderedDict[_Key, tuple[type[PartitionError], str]] = OrderedDict()
        # application -> dataset -> subpartitions its consumers abandoned (oldest first)
        self._abandoned: dict[str, OrderedDict[str, set[int]]] = {}
        self._abandoned_count: dict[str, int] = {}

    def register_result_partition(self, partition: ResultPartition) -> None:
        pid = partition.partition_id
        key = (partition.app_id, pid)
        if key in self._partitions:
            raise UsageError(f"result partition {pid} is already registered")
        self._partitions[key] = partition
        self._released.pop(key, None)
        partition.add_release_listener(self._on_partition_released)

    def get_partition(self, pid: ResultPartitionID, app_id: str = "") -> ResultPartition:
        """Application ``app_id``'s partition ``pid``; PartitionNotFoundError if it has none
        (whoever else has one), or the error it was released with."""
        key = (app_id, pid)
        part = self._partitions.get(key)
        if part is None:
            released = self._released.get(key)
            if released is not None:
                error_type, reason = released
                raise error_type(reason, pid)
            raise PartitionNotFoundError("partition not found", pid)
        return part

    def create_subpartition_view(
        self,
        pid: ResultPartitionID,
        index: int,
        listener: BufferAvailabilityListener,
        app_id: str = "",
        read_memory: ReadMemory | None = None,
    ) -> ResultSubpartitionView:
        """A view of application ``app_id``'s subpartition (``read_memory``: where a
        blocking one reads its data buffers first, see ``ResultPartition``)."""
        part = self.get_partition(pid, app_id)
        return part.create_subpartition_view(index, listener, read_memory)

    def release_partition(
        self, pid: ResultPartitionID, cause: BaseException | None = None, app_id: str = ""
    ) -> bool:
        """Release one partition; False if it is not registered."""
        part = self._partitions.get((app_id, pid))
        if part is None:
            return False
        part.release(cause)
        return True

    def release_dataset(
        self, dataset_id: str, cause: BaseException | None = None, *, app_id: str | None = None
    ) -> int:
        """Release every partition of one exchange (of application ``app_id`` only, unless
        None); returns how many."""
        parts = [
            part
            for (app, pid), part in self._partitions.items()
            if pid.dataset_id == dataset_id and (app_id is None or app == app_id)
        ]
        for part in parts:
            part.release(cause)
        for app in [app_id] if app_id is not None else list(self._abandoned):
            self._forget_abandoned(app, dataset_id)
        return len(parts)

    def abandon_subpartition(self, dataset_id: str, subpartition: int, app_id: str = "") -> int:
        """The consumer of ``subpartition`` of application ``app_id``'s dataset
        ``dataset_id`` gave up: that subpartition of each of the dataset's pipelined
        partitions that never had its reader is released as a reader leaving early
        releases it, now and (remembered) in every partition of the dataset registered
        later. Returns how many partitions it released a subpartition of now."""
        if not isinstance(subpartition, int) or isinstance(subpartition, bool) or subpartition < 0:
            raise UsageError(f"subpartition must be an int >= 0, got {subpartition!r}")
        datasets = self._abandoned.setdefault(app_id, OrderedDict())
        subs = datasets.setdefault(dataset_id, set())
        datasets.move_to_end(dataset_id)
        if subpartition not in subs:
            subs.add(subpartition)
            count = self._abandoned_count.get(app_id, 0) + 1
            while count > MAX_ABANDONED_PER_APP:  # the oldest dataset goes first
                _, oldest = datasets.popitem(last=False)
                count -= len(oldest)
            self._abandoned_count[app_id] = count
            if not datasets:
                del self._abandoned[app_id], self._abandoned_count[app_id]
        parts = [
            part
            for (app, pid), part in self._partitions.items()
            if app == app_id and pid.dataset_id == dataset_id
        ]
        return sum(part.abandon_subpartition(subpartition) for part in parts)

    def apply_abandoned(self, partition: ResultPartition) -> int:
        """Release the subpartitions of a newly registered ``partition`` whose consumers
        abandoned them before it existed (call it once whoever writes the partition
        listens to it: its producer learns at once). Returns how many."""
        datasets = self._abandoned.get(partition.app_id)
        subs = datasets.get(partition.partition_id.dataset_id) if datasets else None
        if not subs:
            return 0
        return sum(partition.abandon_subpartition(k) for k in sorted(subs))

    def abandoned(self, app_id: str = "") -> dict[str, frozenset[int]]:
        """Application ``app_id``'s remembered abandoned subpartitions, by dataset."""
        return {ds: frozenset(subs) for ds, subs in self._abandoned.get(app_id, {}).items()}

    def _forget_abandoned(self, app_id: str, dataset_id: str) -> None:
        datasets = self._abandoned.get(app_id)
        if datasets is None or dataset_id not in datasets:
            return
        left = self._abandoned_count[app_id] - len(datasets.pop(dataset_id))
        if datasets:
            self._abandoned_count[app_id] = left
        else:
            del self._abandoned[app_id], self._abandoned_count[app_id]

    def release_all(self, cause: BaseException | None = None) -> None:
        self._abandoned.clear()
        self._abandoned_count.clear()
        for part in list(self._partitions.values()):
            part.release(cause)

    def _on_partition_released(self, partition: ResultPartition) -> None:
        pid = partition.partition_id
        key = (partition.app_id, pid)
        if self._partitions.get(key) is partition:
            del self._partitions[key]
            cause = partition.failure_cause
            failed = isinstance(cause, ProducerFailedError)
            reason = "failed: " + error_reason(cause) if cause else "released"
            self._remember(
                key,
                ProducerFailedError if failed else PartitionReleasedError,
                f"partition was released ({reason})",
            )

    def remember_gone(
        self, pid: ResultPartitionID, error: PartitionError, app_id: str = ""
    ) -> None:
        """Application ``app_id``'s partition that this manager never held is gone for
        good (it died with a previous daemon, or its data did not survive): its readers get
        ``error``'s type and message instead of a not-found they would retry."""
        key = (app_id, pid)
        if key not in self._partitions:
            self._remember(key, type(error), error.reason)

    def _remember(self, key: _Key, error_type: type[PartitionError], text: str) -> None:
        self._released[key] = (error_type, text)
        while len(self._released) > _REMEMBER_RELEASED:
            self._released.popitem(last=False)

    def has_finished_blocking(self, app_id: str) -> bool:
        """True if application ``app_id`` has a finished blocking partition here."""
        return any(
            app == app_id and part.partition_type.is_blocking and part.is_finished
            for (app, _), part in self._partitions.items()
        )

    @property
    def partitions(self) -> list[ResultPartition]:
        return list(self._partitions.values())

    def __len__(self) -> int:
        return len(self._partitions)

    def __contains__(self, pid: object) -> bool:
        """Whether ``pid`` is registered for "no application" (``(app_id, pid)``: for
        that application)."""
        key = pid if isinstance(pid, tuple) else ("", pid)
        return key in self._partitions
