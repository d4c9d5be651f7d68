"""ResultPartitionManager: registry, lookups, release by id / dataset / all."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from exchange.errors import (
    PartitionNotFoundError,
    PartitionReleasedError,
    ProducerFailedError,
    UsageError,
)
from exchange.partition import (
    ResultPartition,
    ResultPartitionID,
    ResultPartitionManager,
    ResultPartitionType,
)

PIPELINED = ResultPartitionType.PIPELINED
PartitionFactory = Callable[..., ResultPartition]


class Listener:
    def notify_data_available(self) -> None:
        pass


def test_register_lookup_and_duplicates(
    make_partition: PartitionFactory, manager: ResultPartitionManager
) -> None:
    part = make_partition(ResultPartitionID("ds", 3, 7), PIPELINED, 1)
    assert ResultPartitionID("ds", 3, 7) in manager
    assert manager.get_partition(ResultPartitionID("ds", 3, 7)) is part
    assert len(manager) == 1 and manager.partitions == [part]
    twin = make_partition(ResultPartitionID("ds", 3, 7), PIPELINED, 1, register=False)
    with pytest.raises(UsageError, match="already registered"):
        manager.register_result_partition(twin)
    twin.release()


def test_unknown_partition_is_not_found(manager: ResultPartitionManager) -> None:
    pid = ResultPartitionID("nowhere", 0)
    with pytest.raises(PartitionNotFoundError, match="not found") as info:
        manager.create_subpartition_view(pid, 0, Listener())
    assert info.value.partition_id == pid
    assert not manager.release_partition(pid)


def test_other_attempt_is_another_partition(
    make_partition: PartitionFactory, manager: ResultPartitionManager
) -> None:
    make_partition(ResultPartitionID("ds", 0, 1), PIPELINED, 1)
    with pytest.raises(PartitionNotFoundError):
        manager.get_partition(ResultPartitionID("ds", 0, 2))


def test_released_partition_says_released_not_not_found(
    make_partition: PartitionFactory, manager: ResultPartitionManager
) -> None:
    part = make_partition("gone", PIPELINED, 1)
    assert manager.release_partition(part.partition_id)
    assert part.partition_id not in manager
    with pytest.raises(PartitionReleasedError, match=r"released \(released\)"):
        manager.create_subpartition_view(part.partition_id, 0, Listener())
    failed = make_partition("failed", PIPELINED, 1)
    failed.fail(RuntimeError("oom"))
    with pytest.raises(ProducerFailedError, match=r"failed: .*oom"):
        manager.get_partition(failed.partition_id)


def test_reregistering_a_released_id_works(
    make_partition: PartitionFactory, manager: ResultPartitionManager
) -> None:
    first = make_partition("again", PIPELINED, 1)
    manager.release_partition(first.partition_id)
    second = make_partition("again", PIPELINED, 1)
    assert manager.get_partition(second.partition_id) is second


def test_release_dataset_and_all(
    make_partition: PartitionFactory, manager: ResultPartitionManager
) -> None:
    a = [make_partition(ResultPartitionID("a", i), PIPELINED, 1) for i in range(3)]
    b = [make_partition(ResultPartitionID("b", i), PIPELINED, 1) for i in range(2)]
    assert manager.release_dataset("a") == 3
    assert all(p.is_released for p in a) and not any(p.is_released for p in b)
    assert manager.release_dataset("a") == 0
    manager.release_all()
    assert all(p.is_released for p in b)
    assert len(manager) == 0
