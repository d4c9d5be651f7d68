"""A priority barrier jumps the reader's hand-off (issue 22, through a real daemon).

A ``PartitionReader`` in mode unaligned whose task thread does not iterate for a while:
the loop thread has handed it several buffers (the hand-off holds them, decoded by
nobody yet) when a producer's unaligned barrier comes. The barrier does not wait behind
them: at the task's next record boundary the checkpoint triggers, the handed-over buffers
of the barrier's channel are decoded at once and persisted as input channel state (their
records still reach the task afterwards, in order), and the channel state completes
before the task processed them, as Flink's mailbox takes a priority event at once. The
cut holds: every record the producer sent before the barrier is processed before the
trigger or persisted, never both, and the records after it are the producer's output
channel state.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from client.consumer import PartitionLocation, PartitionReader
from client.producer import PartitionWriter
from exchange.checkpointing.barrier_handler import CheckpointFailureReason
from exchange.events.events import CheckpointOptions
from exchange.partition.result_partition_id import ResultPartitionID
from tests.kit.polling import wait_for

pytestmark = pytest.mark.timeout(120)

RECORD = b"r" * 3000  # one record per 4 KiB buffer (flushed after each)
N = 14  # fits in the partition's pool on the daemon (16) before anyone reads
CHECKPOINT = 5


class Task:
    """The task side: what it processed and the listener's calls, in one ordered log."""

    def __init__(self) -> None:
        self.log: list[tuple[str, Any]] = []

    def trigger_checkpoint(self, cid: int, ts: int, options: CheckpointOptions) -> None:
        self.log.append(("trigger", cid))

    def abort_checkpoint(self, cid: int, reason: CheckpointFailureReason) -> None:
        self.log.append(("abort", cid))

    def persist_records(self, cid: int, channel: int, records: list[Any], nbytes: int) -> None:
        self.log.append(("persist", [r[0] for r in records]))

    def persist_partial_record(self, cid: int, channel: int, data: bytes) -> None:
        self.log.append(("partial", data))

    def input_state_complete(self, cid: int) -> None:
        self.log.append(("complete", cid))

    def processed(self, records: list[Any]) -> None:
        self.log.append(("processed", [r[0] for r in records]))

    def of(self, kind: str) -> list[Any]:
        return [v for k, v in self.log if k == kind]


@contextlib.contextmanager
def _barrier_behind_the_hand_off(
    d: Any, w: PartitionWriter, task: Task, jumped: threading.Event
) -> Iterator[tuple[Iterator[list[Any]], list[Any]]]:
    """``N`` records from ``w``, one per buffer; an unaligned reader whose task processes
    the first buffer's records and stops reading while the loop thread hands it more;
    then barrier ``CHECKPOINT`` (unaligned) at the reader: its record lists and the
    first list."""
    for i in range(N):
        w.emit((i, RECORD))
        w.flush()
    pid = w.partition_id
    loc = PartitionLocation(pid, 0, d.data_address, d.daemon_id, d.local_socket)
    with PartitionReader([loc], checkpoint_listener=task, checkpointing_mode="unaligned") as reader:
        reader.set_priority_notify(jumped.set)
        lists = reader.record_lists(on_available=lambda: None)
        first: list[Any] = []
        while not first:  # the task processes one buffer's records, then stops reading
            first = next(lists)
        task.processed(first)
        # the loop thread hands over what the gate's credit let in meanwhile (in the
        # hand-off, or taken by the task thread and not decoded yet)
        wait_for(
            lambda: reader.handoff_statistics()[0].items_sent >= 6,
            60,
            "buffers handed to the task thread",
        )
        w.broadcast_barrier(CHECKPOINT, 1, unaligned=True)
        wait_for(jumped.is_set, 60, "the barrier at the reader")
        yield lists, first


def test_a_priority_barrier_jumps_the_buffers_handed_to_the_task(
    start_daemon: Callable[..., Any],
) -> None:
    d = start_daemon("--segment-size", "4kb")
    pid = ResultPartitionID("unaligned-handoff", 0, 0)
    w = PartitionWriter(pid, 1, blocking=False, daemon_socket=d.local_socket, buffer_timeout=0)
    task = Task()
    jumped = threading.Event()
    try:
        with _barrier_behind_the_hand_off(d, w, task, jumped) as (lists, first):
            assert task.of("trigger") == []  # the task is busy: the barrier waits for it
            # the task's next record boundary: the barrier goes first, and the channel
            # state (the buffers it overtook in the hand-off) completes right away
            nxt: list[Any] = []
            while not nxt:
                nxt = next(lists)
            assert task.of("trigger") == [CHECKPOINT]
            assert task.of("complete") == [CHECKPOINT]
            task.processed(nxt)
            w.close()
            for records in lists:
                task.processed(records)
        state = w.output_channel_state(CHECKPOINT).result(timeout=60)
    finally:
        w.fail("test over")  # no-op once closed
    processed = [i for batch in task.of("processed") for i in batch]
    assert processed == list(range(N))  # every record once, in order
    kinds = [k for k, _ in task.log]
    t = kinds.index("trigger")
    before = [i for k, v in task.log[:t] if k == "processed" for i in v]
    persisted = [i for batch in task.of("persist") for i in batch]
    # the cut: before the trigger or persisted, never both, never neither, up to the
    # records the daemon still held (the producer's output channel state)
    assert before == first_ids(first)
    assert persisted == list(range(len(before), len(before) + len(persisted)))
    assert len(persisted) >= 4  # the hand-off's buffers were overtaken, not waited for
    assert len(before) + len(persisted) + state.num_buffers == N
    assert task.of("partial") == []  # one record per buffer: nothing cut
    # the state completed before the task processed what it persisted
    assert kinds.index("complete") < kinds.index("processed", t)
    d.wait_pool_whole()


def first_ids(records: list[Any]) -> list[int]:
    return [r[0] for r in records]


class CidTask(Task):
    """``Task``, whose persisted records are logged per checkpoint."""

    def persist_records(self, cid: int, channel: int, records: list[Any], nbytes: int) -> None:
        self.log.append(("persist", [r[0] for r in records]))
        self.log.append((f"persist-{cid}", [r[0] for r in records]))


def test_a_priority_barrier_jumps_record_lists_decoded_and_not_processed_yet(
    start_daemon: Callable[..., Any],
) -> None:
    """Checkpoint 5 jumps the hand-off: its channel state is decoded ahead and waits for
    the task as record lists. The task processes one of them; then checkpoint 6's
    priority barrier comes. It triggers at the task's next record boundary, not after
    the task worked through the lists decoded for checkpoint 5 (before, the reader
    jumped only with nothing decoded waiting: a task blocked on its output between two
    of them held the barrier until its consumer freed a batch): those lists are
    persisted as checkpoint 6's channel state, first, and processed after its trigger.
    The cut of 6 holds: processed before its trigger, or persisted, or the producer's
    output state, each record exactly once."""
    d = start_daemon("--segment-size", "4kb")
    pid = ResultPartitionID("unaligned-handoff-ready", 0, 0)
    w = PartitionWriter(pid, 1, blocking=False, daemon_socket=d.local_socket, buffer_timeout=0)
    task = CidTask()
    jumped = threading.Event()
    try:
        with _barrier_behind_the_hand_off(d, w, task, jumped) as (lists, _):
            nxt: list[Any] = []
            while not nxt:
                nxt = next(lists)
            assert task.of("complete") == [CHECKPOINT]
            task.processed(nxt)
            persisted5 = [i for batch in task.of(f"persist-{CHECKPOINT}") for i in batch]
            waiting = [i for i in persisted5 if i > max(nxt[-1][0], 0)]
            assert len(waiting) >= 2, persisted5  # decoded for 5, not processed yet
            jumped.clear()
            w.broadcast_barrier(CHECKPOINT + 1, 2, unaligned=True)
            wait_for(jumped.is_set, 60, "barrier 6 at the reader")
            nxt = []
            while not nxt:
                nxt = next(lists)
            assert task.of("trigger") == [CHECKPOINT, CHECKPOINT + 1]
            task.processed(nxt)
            w.close()
            for records in lists:
                task.processed(records)
        state = w.output_channel_state(CHECKPOINT + 1).result(timeout=60)
    finally:
        w.fail("test over")  # no-op once closed
    processed = [i for batch in task.of("processed") for i in batch]
    assert processed == list(range(N))  # every record once, in order
    t6 = task.log.index(("trigger", CHECKPOINT + 1))
    before = [i for k, v in task.log[:t6] if k == "processed" for i in v]
    persisted6 = [i for batch in task.of(f"persist-{CHECKPOINT + 1}") for i in batch]
    assert before and before == list(range(len(before)))
    # the lists waiting at the trigger come first in 6's channel state
    assert persisted6[: len(waiting)] == waiting
    assert persisted6 == list(range(len(before), len(before) + len(persisted6)))
    assert len(before) + len(persisted6) + state.num_buffers == N
    d.wait_pool_whole()
