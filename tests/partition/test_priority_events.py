"""Unaligned checkpoint barriers in a PipelinedSubpartition (Flink's addPriorityElement).

Replays the cases of Flink's ``PipelinedSubpartitionWithReadViewTest`` for priority
events: the barrier is polled before every buffer still queued, needs no credit, keeps
the order of earlier priority events, waits while the subpartition is blocked by an
aligned barrier; the buffers it overtook are still sent after it and handed, as retained
slices in order, to the output-channel-state listener with the checkpoint id (Flink's
``ChannelStateWriter.addOutputData``). A buffer already polled is not overtaken.
"""

from __future__ import annotations

import struct
from collections.abc import Callable

import pytest

from exchange.buffers import Buffer, DataType
from exchange.errors import CorruptRecordError, IllegalStateError, UsageError
from exchange.events import (
    CancelCheckpointMarker,
    CheckpointBarrier,
    CheckpointOptions,
    CheckpointType,
    EndOfPartitionEvent,
    EventSerializer,
)
from exchange.memory import NetworkBufferPool
from exchange.partition import ResultPartition, ResultSubpartitionView
from tests.conformance.partition_fill import add_full_buffers

pytestmark = pytest.mark.timeout(20)

PartitionFactory = Callable[..., ResultPartition]
UNALIGNED = CheckpointOptions(unaligned=True)


def unaligned(cid: int) -> CheckpointBarrier:
    return CheckpointBarrier(cid, 1000 + cid, UNALIGNED)


class Listener:
    def __init__(self) -> None:
        self.data = 0
        self.priority = 0

    def notify_data_available(self) -> None:
        self.data += 1

    def notify_priority_event(self) -> None:
        self.priority += 1


class StateSink:
    """An output-channel-state listener that keeps what it is handed."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, int, list[Buffer]]] = []

    def __call__(self, index: int, checkpoint_id: int, buffers: list[Buffer]) -> None:
        self.calls.append((index, checkpoint_id, buffers))

    def tags(self) -> list[tuple[int, int, list[int]]]:
        return [(i, cid, [tag(b) for b in bufs]) for i, cid, bufs in self.calls]

    def release(self) -> None:
        for _, _, bufs in self.calls:
            for b in bufs:
                b.release()


def tag(buf: Buffer) -> int:
    return int(struct.unpack_from(">I", buf.memoryview(), 4)[0])


def poll_all(view: ResultSubpartitionView) -> list[object]:
    """Everything pollable now: data buffers as their tag, events decoded."""
    out: list[object] = []
    while (nb := view.get_next_buffer()) is not None:
        buf = nb.buffer
        out.append(tag(buf) if buf.is_buffer else EventSerializer.from_buffer(buf))
        buf.release()
    return out


def test_barrier_options_wire_form_and_validation() -> None:
    aligned = CheckpointBarrier(3, 7)
    # an aligned barrier's bytes did not change with the new flag
    assert EventSerializer.to_bytes(aligned) == struct.pack(">BQqBB", 1, 3, 7, 0, 1)
    for barrier in (
        aligned,
        unaligned(4),
        CheckpointBarrier(5, 0, CheckpointOptions(exactly_once=False)),
    ):
        assert EventSerializer.from_bytes(EventSerializer.to_bytes(barrier)) == barrier
    assert EventSerializer.to_bytes(unaligned(4))[-1] == 0b11
    assert EventSerializer.to_buffer_data_type(unaligned(4)) is DataType.PRIORITIZED_EVENT_BUFFER
    assert EventSerializer.to_buffer_data_type(aligned) is DataType.ALIGNED_CHECKPOINT_BARRIER
    assert DataType.PRIORITIZED_EVENT_BUFFER.has_priority
    assert DataType.PRIORITIZED_EVENT_BUFFER.is_event
    assert not DataType.PRIORITIZED_EVENT_BUFFER.is_blocking_upstream
    with pytest.raises(UsageError, match="exactly-once"):
        CheckpointOptions(exactly_once=False, unaligned=True)
    with pytest.raises(UsageError, match="savepoint"):
        CheckpointOptions(CheckpointType.SAVEPOINT, unaligned=True)
    for flags in (0b10, 0b100, 0xFF):  # unaligned without exactly-once; unknown bits
        with pytest.raises(CorruptRecordError):
            EventSerializer.from_bytes(struct.pack(">BQqBB", 1, 3, 7, 0, flags))


def test_unaligned_barrier_overtakes_queued_buffers_not_sent_ones(
    make_partition: PartitionFactory,
) -> None:
    part = make_partition(1, "pipelined", 1, (1, 16))
    sink = StateSink()
    part.set_output_channel_state_listener(sink)
    listener = Listener()
    view = part.create_subpartition_view(0, listener)
    add_full_buffers(part, 0, 2)
    part.broadcast_event(CancelCheckpointMarker(1))  # an event is overtaken, not state
    add_full_buffers(part, 0, 2, start=2)
    first = view.get_next_buffer()  # buffer 0 is on its way: not overtaken
    assert first is not None and tag(first.buffer) == 0
    first.buffer.release()
    assert listener.priority == 0
    part.broadcast_event(unaligned(5))
    assert listener.priority == 1
    assert sink.tags() == [(0, 5, [1, 2, 3])]
    assert poll_all(view) == [unaligned(5), 1, CancelCheckpointMarker(1), 2, 3]
    # the state holds references of its own: readable after the originals were sent
    assert [tag(b) for b in sink.calls[0][2]] == [1, 2, 3]
    sink.release()
    part.finish()
    assert poll_all(view) == [EndOfPartitionEvent.INSTANCE]
    view.release_all_resources()


def test_priority_events_keep_their_order_and_each_gets_its_state(
    make_partition: PartitionFactory,
) -> None:
    part = make_partition(1, "pipelined", 1, (1, 16))
    sink = StateSink()
    part.set_output_channel_state_listener(sink)
    view = part.create_subpartition_view(0, Listener())
    part.broadcast_event(unaligned(1))  # nothing queued: an empty state, still reported
    add_full_buffers(part, 0, 2)
    part.broadcast_event(unaligned(2))
    add_full_buffers(part, 0, 1, start=2)
    part.broadcast_event(unaligned(3))
    assert sink.tags() == [(0, 1, []), (0, 2, [0, 1]), (0, 3, [0, 1, 2])]
    assert poll_all(view) == [unaligned(1), unaligned(2), unaligned(3), 0, 1, 2]
    sink.release()
    part.release()


def test_priority_event_needs_no_credit(make_partition: PartitionFactory) -> None:
    part = make_partition(1, "pipelined", 1, (1, 16))
    view = part.create_subpartition_view(0, Listener())
    add_full_buffers(part, 0, 3)
    part.flush_all()
    assert view.get_availability_and_backlog(0) == (False, 3)
    part.broadcast_event(unaligned(9))  # no listener: nothing reported, still overtakes
    assert view.get_availability_and_backlog(0) == (True, 3)
    nb = view.get_next_buffer()
    assert nb is not None and nb.buffer.data_type is DataType.PRIORITIZED_EVENT_BUFFER
    assert nb.buffers_in_backlog == 3 and nb.next_data_type is DataType.DATA_BUFFER
    nb.buffer.release()
    assert view.get_availability_and_backlog(0) == (False, 3)
    part.release()


def test_blocked_subpartition_holds_the_priority_event_back(
    make_partition: PartitionFactory,
) -> None:
    part = make_partition(1, "pipelined", 1, (1, 16))
    listener = Listener()
    view = part.create_subpartition_view(0, listener)
    part.broadcast_event(CheckpointBarrier(1, 0))  # aligned
    add_full_buffers(part, 0, 2)
    assert poll_all(view) == [CheckpointBarrier(1, 0)]  # blocked now
    part.broadcast_event(unaligned(2))
    assert listener.priority == 0  # the reader expects nothing while blocked
    assert view.get_next_buffer() is None
    view.resume_consumption()
    assert poll_all(view) == [unaligned(2), 0, 1]
    part.release()


def test_pool_is_whole_only_once_the_state_is_released(
    make_partition: PartitionFactory, nbp: NetworkBufferPool
) -> None:
    part = make_partition(1, "pipelined", 1, (1, 16))
    sink = StateSink()
    part.set_output_channel_state_listener(sink)
    part.create_subpartition_view(0, Listener())
    add_full_buffers(part, 0, 3)
    part.broadcast_event(unaligned(4))
    part.release()  # the queue is dropped; the state still holds the segments
    assert nbp.num_available == nbp.total_segments - 3
    assert [tag(b) for b in sink.calls[0][2]] == [0, 1, 2]
    sink.release()
    assert nbp.num_available == nbp.total_segments


def test_malformed_priority_event_is_refused(make_partition: PartitionFactory) -> None:
    part = make_partition(1, "pipelined", 1, (1, 16))
    part.set_output_channel_state_listener(StateSink())
    view = part.create_subpartition_view(0, Listener())
    bogus = Buffer.wrap(
        EventSerializer.to_bytes(CancelCheckpointMarker(1)), DataType.PRIORITIZED_EVENT_BUFFER
    )
    with pytest.raises(CorruptRecordError, match="not an unaligned barrier"):
        part.add_buffer(0, bogus)
    assert view.get_next_buffer() is None
    with pytest.raises(IllegalStateError, match="already has"):
        part.set_output_channel_state_listener(StateSink())
    part.release()
