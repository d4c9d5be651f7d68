"""A blocking partition whose spill fails (a full disk, a quota, a file that will not
close) is released whole: files deleted, pool destroyed, listeners told, whatever step
fails; the writer gets a SpillError naming the directory (docs/security.md, Disk space)."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from exchange.errors import (
    CorruptRecordError,
    LimitExceededError,
    PartitionReleasedError,
    SpillError,
)
from exchange.memory import NetworkBufferPool
from exchange.partition import ResultPartition, ResultPartitionID, ResultPartitionType
from exchange.partition.bounded_data import MAX_READ_SEGMENTS, READ_SEGMENTS
from exchange.partition.reader_budget import ReaderBudget
from exchange.partition.spill_space import SpillSpace

BLOCKING = ResultPartitionType.BLOCKING


def blocking(
    nbp: NetworkBufferPool, directory: Path, space: SpillSpace | None = None
) -> ResultPartition:
    pool = nbp.create_buffer_pool(2, 8)
    return ResultPartition(
        ResultPartitionID("spill", 0),
        BLOCKING,
        2,
        pool,
        spill_dir=directory,
        keep_manifest=True,
        spill_account=space.account("app") if space is not None else None,
    )


def push(part: ResultPartition, target: int, n: int = 1000) -> None:
    buf = part.buffer_pool.request_buffer()
    assert buf is not None
    buf.segment.view()[:n] = b"x" * n
    buf.set_size(n)
    part.add_buffer(target, buf)


def test_a_spill_quota_releases_the_partition_and_raises_a_spill_error(
    nbp: NetworkBufferPool, tmp_path: Path
) -> None:
    space = SpillSpace(tmp_path, quota=3000)
    part = blocking(nbp, tmp_path, space)
    released: list[ResultPartition] = []
    part.add_release_listener(released.append)
    push(part, 0)
    push(part, 1)
    with pytest.raises(SpillError, match="spill_quota_per_app=3000") as info:
        for _ in range(3):
            push(part, 0)
    assert info.value.setting == "spill_quota_per_app"
    assert info.value.partition_id == part.partition_id
    assert info.value.directory == str(tmp_path)
    assert part.is_released and released == [part]
    assert part.buffer_pool.is_destroyed
    assert list(tmp_path.iterdir()) == []  # manifest and both files gone
    assert space.used("app") == 0
    with pytest.raises(PartitionReleasedError, match="spill_quota_per_app"):
        part.check_writable(1)  # what the producer's next push meets


def test_a_full_disk_at_finish_releases_the_partition(
    nbp: NetworkBufferPool, tmp_path: Path
) -> None:
    space = SpillSpace(tmp_path, min_free=1 << 20, free=lambda _: 10, check_every=1)
    pool = nbp.create_buffer_pool(2, 8)
    with pytest.raises(SpillError, match="spill_min_free"):  # refused before a file exists
        ResultPartition(
            ResultPartitionID("full", 0),
            BLOCKING,
            2,
            pool,
            spill_dir=tmp_path,
            spill_account=space.account(""),
        )
    pool.destroy()
    assert list(tmp_path.iterdir()) == []


def test_release_runs_every_step_when_one_fails(
    nbp: NetworkBufferPool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    part = blocking(nbp, tmp_path)
    push(part, 0)
    push(part, 1)
    part.finish()
    told: list[str] = []

    def failing_listener(_: ResultPartition) -> None:
        told.append("first")
        raise RuntimeError("a listener failed")

    part.add_release_listener(failing_listener)
    part.add_release_listener(lambda _: told.append("second"))
    sub0 = part.subpartitions[0]

    def eio() -> None:
        raise OSError(errno.EIO, "I/O error")

    monkeypatch.setattr(sub0.data, "close", eio)  # type: ignore[union-attr]
    with pytest.raises(OSError, match="I/O error"):
        part.release()
    assert told == ["first", "second"]  # every listener heard of it
    assert part.buffer_pool.is_destroyed
    remaining = sorted(p.name for p in tmp_path.iterdir())
    assert len(remaining) == 1 and remaining[0].endswith(".0.bin")  # only the one that failed


def test_spill_space_counts_per_application(tmp_path: Path) -> None:
    free = [10_000]
    space = SpillSpace(tmp_path, quota=1000, min_free=500, free=lambda _: free[0], check_every=100)
    a, b = space.account("a"), space.account("b")
    a.charge(600)
    b.charge(600)  # each application has its own quota
    with pytest.raises(SpillError, match="spill_quota_per_app=1000"):
        a.charge(401)
    assert space.used("a") == 600  # a refused charge counts nothing
    free[0] = 499
    with pytest.raises(SpillError, match="499 bytes free, below the floor spill_min_free=500"):
        b.charge(100)
    with pytest.raises(SpillError, match="spill_min_free"):
        space.account("c").check_new()
    a.refund(600)
    b.refund(600)
    assert space.total_used == 0


class _Listener:
    def notify_data_available(self) -> None:
        pass


def file_partition(
    nbp: NetworkBufferPool, directory: Path, budget: ReaderBudget
) -> ResultPartition:
    """A one-subpartition blocking partition in ``file`` storage, its readers counted
    against ``budget``'s account of ``app`` (file readers hold read segments; mmap's none)."""
    return ResultPartition(
        ResultPartitionID("r", 0),
        BLOCKING,
        1,
        nbp.create_buffer_pool(1, 4),
        spill_dir=directory,
        bounded_data_kind="file",
        reader_account=budget.account("app"),
    )


def test_readers_count_against_their_applications_budget(
    nbp: NetworkBufferPool, tmp_path: Path
) -> None:
    budget = ReaderBudget(max_readers=2, max_memory=3 * nbp.segment_size * READ_SEGMENTS)
    part = file_partition(nbp, tmp_path, budget)
    push(part, 0)
    part.finish()
    fds = len(os.listdir("/proc/self/fd"))
    a = part.create_subpartition_view(0, _Listener())
    b = part.create_subpartition_view(0, _Listener())
    assert budget.usage("app") == (2, 2 * nbp.segment_size * READ_SEGMENTS)
    with pytest.raises(LimitExceededError, match="max_readers_per_app=2"):
        part.create_subpartition_view(0, _Listener())
    a.release_all_resources()
    c = part.create_subpartition_view(0, _Listener())
    assert budget.usage("other") == (0, 0)  # another application's budget is its own
    b.release_all_resources()
    c.release_all_resources()
    assert budget.usage("app") == (0, 0)
    # a file damaged in place (same inode and size): the reader fails at its first buffer
    # and gives back its descriptor, its read segments and its place in the budget
    path = part.subpartitions[0].data.path  # type: ignore[union-attr]
    with open(path, "r+b") as f:
        f.write(b"\xff")
    with pytest.raises(CorruptRecordError, match="bad data type"):
        part.create_subpartition_view(0, _Listener())
    assert budget.usage("app") == (0, 0)
    assert len(os.listdir("/proc/self/fd")) == fds
    part.release()


@pytest.mark.parametrize("path", ["reader released", "partition released first"])
def test_grown_read_segments_are_charged_and_given_back(
    nbp: NetworkBufferPool, tmp_path: Path, path: str
) -> None:
    seg = nbp.segment_size
    budget = ReaderBudget(max_memory=16 * seg * READ_SEGMENTS)
    part = file_partition(nbp, tmp_path, budget)
    for _ in range(3 * MAX_READ_SEGMENTS):
        push(part, 0)
    part.finish()
    view = part.create_subpartition_view(0, _Listener())
    assert budget.usage("app") == (1, seg * READ_SEGMENTS)  # the base, charged at creation
    out = []  # a consumer slow to give buffers back: the reader grows its segments
    while (polled := view.get_next_buffer()) is not None:
        out.append(polled.buffer)
    assert len(out) == MAX_READ_SEGMENTS  # each buffer handed out holds one segment
    assert budget.usage("app") == (1, seg * MAX_READ_SEGMENTS)
    if path == "partition released first":
        part.release()  # the data waits for its reader; the reader's charge stays
        assert budget.usage("app") == (1, seg * MAX_READ_SEGMENTS)
    view.release_all_resources()
    assert budget.usage("app") == (0, 0)
    for buf in out:
        buf.release()
    assert budget.usage("app") == (0, 0)
    part.release()
