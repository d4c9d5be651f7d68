"""ProducerSession (the daemon's side of a producer task), sans I/O.

Credit is reserved segments, granted in batches as consumers free segments (through the
pool's BufferListener); pushes land in them; the lifecycle ends exactly once; and a reader
that leaves one subpartition early fails the partition for every other reader (defect 1).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from exchange.buffers.buffer import DataType
from exchange.errors import (
    IllegalStateError,
    PartitionReleasedError,
    ProducerFailedError,
    ProtocolError,
    SubpartitionIndexError,
)
from exchange.events.events import CancelCheckpointMarker, EventSerializer
from exchange.local import ProducerSession, ProducerSessionState
from exchange.partition import ALL_SUBPARTITIONS, ResultPartition, ResultPartitionType
from exchange.protocol.local_messages import AddProducerCredit, PartitionFinished
from exchange.protocol.messages import ErrorResponse, Message

PIPELINED = ResultPartitionType.PIPELINED


class Task:
    """What the session sends to the task, and the error it aborts with."""

    def __init__(self) -> None:
        self.sent: list[Message] = []
        self.aborted: list[ErrorResponse] = []

    @property
    def credit(self) -> int:
        return sum(m.credit for m in self.sent if isinstance(m, AddProducerCredit))


def session_for(
    make_partition: Callable[..., ResultPartition], n: int, pool: tuple[int, int], credit: int
) -> tuple[ResultPartition, ProducerSession, Task]:
    part = make_partition("p", PIPELINED, n, pool_size=pool)
    task = Task()
    s = ProducerSession(part, task.sent.append, max_credit=credit, on_abort=task.aborted.append)
    return part, s, task


def push(s: ProducerSession, target: int, data: bytes) -> None:
    s.on_push(target, DataType.DATA_BUFFER, memoryview(data))


def drain(part: ResultPartition, sub: int) -> int:
    """Read and release what subpartition ``sub`` holds (a consumer freeing segments)."""
    view = part.subpartitions[sub]._view
    n = 0
    while view is not None and (b := view.get_next_buffer()) is not None:
        b.buffer.release()
        n += 1
    return n


class Listener:
    def notify_data_available(self) -> None:
        pass


def test_first_grant_is_what_the_pool_has_free(make_partition: Callable[..., Any]) -> None:
    part, s, task = session_for(make_partition, 1, (1, 4), credit=8)
    assert s.start() == 4 and s.credit_outstanding == 4
    assert task.sent == []
    part.release()


def test_credit_comes_back_in_batches_as_consumers_free_segments(
    make_partition: Callable[..., Any],
) -> None:
    part, s, task = session_for(make_partition, 1, (1, 8), credit=8)
    part.create_subpartition_view(0, Listener())
    assert s.start() == 8
    for i in range(8):
        push(s, 0, bytes([i]) * 100)
    assert s.credit_outstanding == 0 and task.credit == 0  # the pool is full: no credit
    # the consumer frees segments one by one: the task, out of credit, hears at once, and
    # then in batches of max_credit // 4, not one message per buffer
    freed = drain(part, 0)
    assert freed == 8
    assert s.num_reserved == 8
    unannounced = s.num_reserved - s.credit_outstanding
    assert task.credit == 8 - unannounced and 0 <= unannounced < 8 // 4
    assert 1 < len(task.sent) <= 1 + 8 // 2
    # the task spends its credit: once it has none, the rest is granted at once
    for _ in range(task.credit):
        push(s, 0, b"again")
    assert task.credit == 8 and s.credit_outstanding == unannounced
    part.release()


def test_push_without_credit_or_too_large_is_a_protocol_error(
    make_partition: Callable[..., Any],
) -> None:
    part, s, _ = session_for(make_partition, 1, (1, 1), credit=1)
    s.start()
    with pytest.raises(ProtocolError, match="exceeds"):
        push(s, 0, b"x" * (part.segment_size + 1))
    push(s, 0, b"ok")
    with pytest.raises(ProtocolError, match="without credit"):
        push(s, 0, b"no credit left")
    part.release()


def test_bad_subpartition_releases_the_segment(make_partition: Callable[..., Any]) -> None:
    part, s, _ = session_for(make_partition, 2, (2, 4), credit=2)
    s.start()
    with pytest.raises(SubpartitionIndexError):
        push(s, 5, b"x")
    part.release()


def test_broadcast_buffers_and_events(make_partition: Callable[..., Any]) -> None:
    part, s, _ = session_for(make_partition, 3, (3, 6), credit=2)
    views = [part.create_subpartition_view(i, Listener()) for i in range(3)]
    s.start()
    push(s, ALL_SUBPARTITIONS, b"shared")
    s.on_push(
        ALL_SUBPARTITIONS,
        DataType.EVENT_BUFFER,
        memoryview(EventSerializer.to_bytes(CancelCheckpointMarker(3))),
    )
    with pytest.raises(ProtocolError, match="broadcast"):
        s.on_push(
            0,
            DataType.EVENT_BUFFER,
            memoryview(EventSerializer.to_bytes(CancelCheckpointMarker(4))),
        )
    assert isinstance(s.finish(), PartitionFinished)
    for v in views:
        got = []
        while (b := v.get_next_buffer()) is not None:
            got.append(bytes(b.buffer.memoryview()) if b.buffer.is_buffer else b.buffer.data_type)
            b.buffer.release()
        assert got[0] == b"shared" and got[1] is DataType.EVENT_BUFFER
        v.release_all_resources()


def test_lifecycle_ends_once(make_partition: Callable[..., Any]) -> None:
    part, s, _ = session_for(make_partition, 1, (1, 2), credit=2)
    s.start()
    s.finish()
    assert s.state is ProducerSessionState.FINISHED
    assert not s.fail("late")  # the first end wins
    with pytest.raises(ProtocolError):
        s.finish()
    with pytest.raises(ProtocolError):
        push(s, 0, b"x")
    with pytest.raises(IllegalStateError):
        s._transition(ProducerSessionState.OPEN)
    part.release()


def test_failed_task_fails_the_partition_and_returns_its_reservations(
    make_partition: Callable[..., Any], nbp: Any
) -> None:
    part, s, _ = session_for(make_partition, 1, (1, 4), credit=4)
    s.start()
    assert s.fail("task died")
    assert s.state is ProducerSessionState.FAILED and s.num_reserved == 0
    assert part.is_released and isinstance(part.failure_cause, ProducerFailedError)


def test_partition_released_under_the_task_tells_it(make_partition: Callable[..., Any]) -> None:
    part, s, task = session_for(make_partition, 1, (1, 4), credit=4)
    s.start()
    part.release(PartitionReleasedError("daemon stopping"))
    assert s.state is ProducerSessionState.ABORTED and s.num_reserved == 0
    assert len(task.aborted) == 1


def test_reader_leaving_early_fails_the_partition_for_every_other_reader(
    make_partition: Callable[..., Any],
) -> None:
    """Defect 1: the readers of the other subpartitions must get an error, not wait for
    an EndOfPartition that never comes."""
    part, s, task = session_for(make_partition, 2, (2, 6), credit=2)
    leaving = part.create_subpartition_view(0, Listener())
    staying = part.create_subpartition_view(1, Listener())
    s.start()
    push(s, 1, b"first")
    leaving.release_all_resources()  # its reader left before the end
    assert s.state is ProducerSessionState.ABORTED
    assert len(task.aborted) == 1
    assert part.is_released
    assert staying.is_released
    assert isinstance(staying.failure_cause, PartitionReleasedError | ProducerFailedError)
    staying.release_all_resources()
