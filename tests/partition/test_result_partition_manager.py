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
from exchange.memory.network_buffer_pool import NetworkBufferPool
from exchange.partition import (
    ResultPartition,
    ResultPartitionID,
    ResultPartitionManager,
    ResultPartitionType,
)
from exchange.partition.result_partition_manager import MAX_ABANDONED_PER_APP

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


# -- subpartitions abandoned by their consumers -----------------------------------------


def _app_partition(
    nbp: NetworkBufferPool, pid: ResultPartitionID, n: int, app: str
) -> ResultPartition:
    pool = nbp.create_buffer_pool(n, 2 * n + 2)
    return ResultPartition(pid, PIPELINED, n, pool, app_id=app)


def test_abandoning_releases_a_subpartition_never_requested_as_an_early_reader_does(
    make_partition: PartitionFactory, manager: ResultPartitionManager
) -> None:
    part = make_partition(ResultPartitionID("ab", 0), PIPELINED, 3)
    failures: list[BaseException] = []
    part.add_consumer_failure_listener(failures.append)
    view = manager.create_subpartition_view(part.partition_id, 1, Listener())

    assert manager.abandon_subpartition("ab", 0) == 1
    assert part.subpartitions[0].is_released and not part.is_released
    [cause] = failures
    assert isinstance(cause, PartitionReleasedError)
    assert "released by its consumer before the end" in str(cause)
    with pytest.raises(PartitionReleasedError):
        manager.create_subpartition_view(part.partition_id, 0, Listener())
    # a subpartition that has its reader is that reader's business
    assert manager.abandon_subpartition("ab", 1) == 0
    assert not view.is_released
    # again, and out of range: nothing more
    assert manager.abandon_subpartition("ab", 0) == 0
    assert manager.abandon_subpartition("ab", 7) == 0
    assert len(failures) == 1


def test_a_partition_created_after_the_abandon_gets_that_subpartition_released_at_once(
    make_partition: PartitionFactory, manager: ResultPartitionManager
) -> None:
    assert manager.abandon_subpartition("later", 1) == 0  # nothing of it exists yet
    assert manager.abandoned() == {"later": frozenset({1})}
    late = make_partition(ResultPartitionID("later", 5, 9), PIPELINED, 2)
    other = make_partition(ResultPartitionID("other", 5, 9), PIPELINED, 2)
    blocking = make_partition(ResultPartitionID("later", 6), ResultPartitionType.BLOCKING, 2)
    failures: list[BaseException] = []
    late.add_consumer_failure_listener(failures.append)

    assert manager.apply_abandoned(late) == 1
    assert late.subpartitions[1].is_released and not late.subpartitions[0].is_released
    assert "released by its consumer before the end" in str(failures[0])
    assert manager.apply_abandoned(other) == 0  # another dataset
    assert manager.apply_abandoned(blocking) == 0  # read again by whoever asks
    assert not any(s.is_released for s in [*other.subpartitions, *blocking.subpartitions])


def test_a_finished_partition_whose_subpartitions_are_all_abandoned_or_read_goes(
    make_partition: PartitionFactory, manager: ResultPartitionManager
) -> None:
    part = make_partition(ResultPartitionID("whole", 0), PIPELINED, 2)
    part.finish()
    view = manager.create_subpartition_view(part.partition_id, 1, Listener())
    while (next_ := view.get_next_buffer()) is not None:  # the EndOfPartition
        next_.buffer.release()
    view.release_all_resources()
    assert not part.is_released  # subpartition 0 still waits for its reader
    assert manager.abandon_subpartition("whole", 0) == 1
    assert part.is_released and part.buffer_pool.is_destroyed
    assert len(manager) == 0


def test_abandoned_subpartitions_go_with_the_dataset_and_are_bounded(
    manager: ResultPartitionManager,
) -> None:
    manager.abandon_subpartition("r", 0)
    manager.abandon_subpartition("r", 3)
    manager.abandon_subpartition("kept", 1)
    assert manager.release_dataset("r") == 0
    assert manager.abandoned() == {"kept": frozenset({1})}

    # at most MAX_ABANDONED_PER_APP pairs per application: its oldest datasets go first
    for i in range(MAX_ABANDONED_PER_APP + 10):
        manager.abandon_subpartition(f"d{i // 100}", i % 100)
    remembered = manager.abandoned()
    assert sum(len(s) for s in remembered.values()) <= MAX_ABANDONED_PER_APP
    assert "kept" not in remembered and "d0" not in remembered
    assert remembered[f"d{(MAX_ABANDONED_PER_APP + 9) // 100}"]
    manager.release_all()
    assert manager.abandoned() == {}
    with pytest.raises(UsageError):
        manager.abandon_subpartition("r", -1)


def test_an_abandon_touches_only_its_own_application(
    nbp: NetworkBufferPool, manager: ResultPartitionManager
) -> None:
    ours = _app_partition(nbp, ResultPartitionID("shared-name", 0), 2, "app-a")
    theirs = _app_partition(nbp, ResultPartitionID("shared-name", 1), 2, "app-b")
    manager.register_result_partition(ours)
    manager.register_result_partition(theirs)
    assert manager.abandon_subpartition("shared-name", 0, app_id="app-b") == 1
    assert theirs.subpartitions[0].is_released and not ours.subpartitions[0].is_released
    assert manager.abandoned("app-a") == {}
    later = _app_partition(nbp, ResultPartitionID("shared-name", 2), 2, "app-a")
    manager.register_result_partition(later)
    assert manager.apply_abandoned(later) == 0
    # app-b's dataset release forgets app-b's abandon only
    manager.abandon_subpartition("shared-name", 1, app_id="app-a")
    manager.release_dataset("shared-name", app_id="app-b")
    assert manager.abandoned("app-b") == {}
    assert manager.abandoned("app-a") == {"shared-name": frozenset({1})}
