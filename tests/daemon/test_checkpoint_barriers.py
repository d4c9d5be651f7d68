"""Checkpoint barriers through real processes: producer tasks (child processes) broadcast a
barrier every 100 ms while records flow through a daemon; the consumer task's reader runs
the barrier handler and calls the task's ``trigger_checkpoint`` exactly between the records
before and after each barrier (exactly once), or after all of them (at least once).
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest

from client.consumer import AsyncPartitionReader, PartitionLocation, PartitionReader
from client.runtime import get_runtime
from exchange.checkpointing import CheckpointFailureReason
from exchange.errors import UsageError
from exchange.events.events import CheckpointOptions
from exchange.partition.result_partition_id import ResultPartitionID

pytestmark = pytest.mark.timeout(120)

Daemon = Any


class Task:
    """The consumer task: counts records per producer; a checkpoint snapshots the counts."""

    def __init__(self, producers: int) -> None:
        self.seen = [0] * producers
        self.snapshots: dict[int, list[int]] = {}
        self.aborted: dict[int, CheckpointFailureReason] = {}
        self.options: dict[int, CheckpointOptions] = {}
        self.thread: threading.Thread | None = None

    def on_record(self, record: Any) -> None:
        index, seq, _ = record
        assert seq == self.seen[index], f"producer {index}: got {seq}, expected {self.seen[index]}"
        self.seen[index] += 1

    def trigger_checkpoint(self, checkpoint_id: int, timestamp: int, options: Any) -> None:
        assert threading.current_thread() is self.thread, "callback outside the task thread"
        assert checkpoint_id not in self.snapshots
        self.snapshots[checkpoint_id] = list(self.seen)
        self.options[checkpoint_id] = options

    def abort_checkpoint(self, checkpoint_id: int, reason: CheckpointFailureReason) -> None:
        assert threading.current_thread() is self.thread, "callback outside the task thread"
        self.aborted[checkpoint_id] = reason


def _run(
    start_daemon: Any,
    dm: Any,
    *,
    mode: str,
    aligned: bool,
    cancel: tuple[int, ...] = (),
    task: type[Task] = Task,
) -> tuple[Task, list[list[dict[str, Any]]], PartitionReader]:
    d = start_daemon()
    n_producers, n_barriers = 2, 12
    dataset = f"cp-{mode}"
    producers = [
        dm.BarrierProducer(
            d.local_socket,
            dataset,
            i,
            barriers=n_barriers,
            interval=0.1,
            aligned=aligned,
            cancel=cancel if i == 1 else (),
        )
        for i in range(n_producers)
    ]
    try:
        for p in producers:
            p.wait_writing()  # the partitions exist: a slow start never exhausts the backoff
        consumer = task(n_producers)
        consumer.thread = threading.current_thread()
        locations = [
            PartitionLocation(
                ResultPartitionID(dataset, i, 0), 0, d.data_address, d.daemon_id, d.local_socket
            )
            for i in range(n_producers)
        ]
        reader = PartitionReader(
            locations,
            checkpoint_listener=consumer,
            checkpointing_mode=mode,
            backoff_initial=0.01,
            backoff_max=0.1,
        )
        with reader:
            for record in reader.records():
                consumer.on_record(record)
        logs = [p.lines() for p in producers]
    finally:
        for p in producers:
            p.cleanup()
    d.wait_pool_whole()
    return consumer, logs, reader


def test_exactly_once_trigger_sees_exactly_the_records_before_each_barrier(
    start_daemon: Any, dm: Any
) -> None:
    cancelled = (4, 9)
    task, logs, reader = _run(start_daemon, dm, mode="exactly_once", aligned=True, cancel=cancelled)
    assert task.seen == [log[-1]["done"] for log in logs]  # nothing lost or duplicated
    barriers = [{e["barrier"]: e["emitted"] for e in log if "barrier" in e} for log in logs]
    expected_triggered = [c for c in range(1, 13) if c not in cancelled]
    assert sorted(task.snapshots) == expected_triggered
    for cid in expected_triggered:
        # Exactly the records each producer emitted before barrier cid: none after it.
        assert task.snapshots[cid] == [barriers[0][cid], barriers[1][cid]], cid
        assert task.options[cid].exactly_once
    # Producer 1 cancelled these: the alignment aborts (producer 0's channel is resumed).
    assert task.aborted == {c: CheckpointFailureReason.CANCELLED for c in cancelled}
    stats = reader.barrier_stats
    assert stats is not None
    assert stats.num_triggered == len(expected_triggered)
    # every aligned barrier got exactly one ResumeConsumption: 2 per triggered checkpoint,
    # 1 per cancelled one (producer 0's barrier arrived before or after the marker)
    assert stats.num_resumed == 2 * len(expected_triggered) + len(cancelled)


class UnalignedTask(Task):
    """Also takes the channel state of unaligned checkpoints, and when it is complete."""

    def __init__(self, producers: int) -> None:
        super().__init__(producers)
        self.persisted: dict[int, dict[int, list[int]]] = {}
        self.complete: list[int] = []

    def persist_records(
        self, checkpoint_id: int, channel: int, records: list[Any], nbytes: int
    ) -> None:
        assert threading.current_thread() is self.thread, "callback outside the task thread"
        assert checkpoint_id in self.snapshots and checkpoint_id not in self.complete
        assert nbytes > 0 and all(r[0] == channel for r in records)
        self.persisted.setdefault(checkpoint_id, {}).setdefault(channel, []).extend(
            r[1] for r in records
        )

    def persist_partial_record(self, checkpoint_id: int, channel: int, data: bytes) -> None:
        # only after a priority barrier (the producers here send queued ones)
        raise AssertionError(f"a partial record at the cut of {checkpoint_id}, {channel}")

    def input_state_complete(self, checkpoint_id: int) -> None:
        assert threading.current_thread() is self.thread, "callback outside the task thread"
        self.complete.append(checkpoint_id)


def test_unaligned_snapshot_plus_channel_state_is_exactly_the_records_before_each_barrier(
    start_daemon: Any, dm: Any
) -> None:
    """Mode unaligned through a real daemon: each checkpoint triggers at its first barrier;
    per producer, the records seen before the trigger plus those persisted as channel
    state are exactly the ones it emitted before its barrier (contiguous, none after).
    Nothing blocks a channel, so a producer that runs ahead may deliver barrier N + 1
    before the other delivers N: N is then subsumed (aborted), as in Flink."""
    cancelled = (4, 9)
    task, logs, reader = _run(
        start_daemon, dm, mode="unaligned", aligned=True, cancel=cancelled, task=UnalignedTask
    )
    assert isinstance(task, UnalignedTask)
    assert task.seen == [log[-1]["done"] for log in logs]  # nothing lost or duplicated
    barriers = [{e["barrier"]: e["emitted"] for e in log if "barrier" in e} for log in logs]
    assert task.complete and task.complete == sorted(task.complete)
    assert 12 in task.complete  # the last one has nothing newer to subsume it
    assert not set(task.complete) & set(task.aborted)
    assert set(task.complete) | set(task.aborted) == set(range(1, 13))
    for cid in task.complete:
        for p in range(2):
            before = task.snapshots[cid][p]
            persisted = task.persisted.get(cid, {}).get(p, [])
            assert persisted == list(range(before, barriers[p][cid])), (cid, p)
    for cid, reason in task.aborted.items():
        assert reason in (CheckpointFailureReason.CANCELLED, CheckpointFailureReason.SUBSUMED)
        if reason is CheckpointFailureReason.CANCELLED:
            assert cid in cancelled
    assert set(cancelled) <= set(task.aborted)
    assert reader.barrier_stats is not None
    print(
        "persisted per checkpoint:",
        {c: sum(len(x) for x in v.values()) for c, v in task.persisted.items()},
    )


def test_at_least_once_trigger_sees_at_least_the_records_before_each_barrier(
    start_daemon: Any, dm: Any
) -> None:
    task, logs, reader = _run(start_daemon, dm, mode="at_least_once", aligned=False)
    assert task.seen == [log[-1]["done"] for log in logs]
    barriers = [{e["barrier"]: e["emitted"] for e in log if "barrier" in e} for log in logs]
    assert sorted(task.snapshots) == list(range(1, 13))
    for cid, snap in task.snapshots.items():
        assert snap[0] >= barriers[0][cid] and snap[1] >= barriers[1][cid], cid
        assert not task.options[cid].exactly_once
    assert task.aborted == {}
    stats = reader.barrier_stats
    assert stats is not None and stats.num_resumed == 0  # unaligned: nothing was blocked


def test_reader_refuses_bad_checkpoint_arguments(start_daemon: Any) -> None:
    d = start_daemon()
    loc = PartitionLocation(ResultPartitionID("x", 0, 0), 0, d.data_address)
    with pytest.raises(UsageError, match="checkpointing_mode"):
        PartitionReader([loc], checkpoint_listener=Task(1), checkpointing_mode="sometimes")
    with pytest.raises(UsageError, match="checkpoint_alignment_limit"):
        PartitionReader([loc], checkpoint_listener=Task(1), checkpoint_alignment_limit=-1)
    with pytest.raises(UsageError, match="trigger_checkpoint"):
        PartitionReader([loc], checkpoint_listener=object())  # type: ignore[arg-type]


class RaisingTask(Task):
    """Its snapshot of checkpoint ``failing`` raises (a full disk, a bug)."""

    def __init__(self, producers: int, failing: int) -> None:
        super().__init__(producers)
        self.failing = failing

    def trigger_checkpoint(self, checkpoint_id: int, timestamp: int, options: Any) -> None:
        super().trigger_checkpoint(checkpoint_id, timestamp, options)
        if checkpoint_id == self.failing:
            raise RuntimeError(f"injected: snapshot {checkpoint_id} failed")


def test_a_listener_that_raises_leaves_no_channel_blocked(start_daemon: Any, dm: Any) -> None:
    """The async reader's listener raises at checkpoint 3; its caller survives the error
    and reads on. Every channel was resumed in spite of the error: every record arrives,
    and the later checkpoints align as usual. Before, the resume came after the listener,
    so both aligned channels stayed blocked upstream and the read never ended."""
    d = start_daemon()
    n_producers, n_barriers = 2, 6
    producers = [
        dm.BarrierProducer(
            d.local_socket, "cp-raise", i, barriers=n_barriers, interval=0.1, aligned=True
        )
        for i in range(n_producers)
    ]
    task = RaisingTask(n_producers, failing=3)
    errors: list[str] = []

    async def read() -> None:
        task.thread = threading.current_thread()  # the loop's: callbacks run in next_batch
        reader = await AsyncPartitionReader.open(
            [
                PartitionLocation(
                    ResultPartitionID("cp-raise", i, 0), 0, d.data_address, d.daemon_id
                )
                for i in range(n_producers)
            ],
            checkpoint_listener=task,
            backoff_initial=0.01,
            backoff_max=0.1,
        )
        try:
            while True:
                try:
                    batch = await asyncio.wait_for(reader.next_batch(), 30)
                except RuntimeError as e:
                    errors.append(str(e))
                    continue
                if batch is None:
                    return
                for record in batch:
                    task.on_record(record)
        finally:
            await reader.close()

    try:
        for p in producers:
            p.wait_writing()
        get_runtime().run(read())
        logs = [p.lines() for p in producers]
    finally:
        for p in producers:
            p.cleanup()
    assert errors == ["injected: snapshot 3 failed"]
    assert task.seen == [log[-1]["done"] for log in logs]  # nothing lost, nothing blocked
    assert sorted(task.snapshots) == list(range(1, n_barriers + 1))
    barriers = [{e["barrier"]: e["emitted"] for e in log if "barrier" in e} for log in logs]
    for cid in range(4, n_barriers + 1):  # aligned as usual after the error
        assert task.snapshots[cid] == [barriers[0][cid], barriers[1][cid]], cid
    d.wait_pool_whole()
