"""PipelinedSubpartition and its view: notifications, barriers, single reader, release."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from exchange.buffers import BufferConsumer, DataType
from exchange.errors import ConsumerAlreadyAttachedError, IllegalStateError, PartitionReleasedError
from exchange.events import (
    CancelCheckpointMarker,
    CheckpointBarrier,
    CheckpointOptions,
    EndOfPartitionEvent,
    EventSerializer,
)
from exchange.partition import (
    BufferAndBacklog,
    ResultPartition,
    ResultPartitionType,
    ResultSubpartitionView,
)
from tests.kit.partition_writer import ResultPartitionWriter
from tests.kit.record_deserializer import RecordDeserializer

pytestmark = pytest.mark.timeout(10)

PIPELINED = ResultPartitionType.PIPELINED
PartitionFactory = Callable[..., ResultPartition]


class Listener:
    """Counts data-available notifications."""

    def __init__(self) -> None:
        self.notifications = 0

    def notify_data_available(self) -> None:
        self.notifications += 1


def drain(view: ResultSubpartitionView) -> list[BufferAndBacklog]:
    """Poll as a gate does: once, then while the last poll said more is available.

    The caller releases the buffers.
    """
    out = []
    while (nb := view.get_next_buffer()) is not None:
        out.append(nb)
        if not nb.is_data_available:
            break
    return out


_deserializers: dict[int, RecordDeserializer] = {}


@pytest.fixture(autouse=True)
def _fresh_deserializers() -> Iterator[None]:
    _deserializers.clear()
    yield
    _deserializers.clear()


def decode(polled: list[BufferAndBacklog], stream: int = 0) -> list[Any]:
    """Records and events of polled buffers, in order; releases every buffer. Records may
    span polls: one deserializer per ``stream`` for the whole test module's stream."""
    deser = _deserializers.setdefault(stream, RecordDeserializer())
    items: list[Any] = []
    for nb in polled:
        buf = nb.buffer
        if buf.is_buffer:
            deser.set_next_buffer(buf)
            items += deser.records()
        else:
            items.append(EventSerializer.from_buffer(buf))
            buf.release()
    return items


@pytest.mark.asyncio
async def test_reader_is_notified_on_first_finished_buffer_flush_and_event(
    make_partition: PartitionFactory,
) -> None:
    part = make_partition("notify", PIPELINED, 1)
    listener = Listener()
    view = part.create_subpartition_view(0, listener)
    assert listener.notifications == 0
    writer = ResultPartitionWriter(part, buffer_timeout=-1)
    await writer.emit(("small",))
    assert listener.notifications == 0  # still in the serializer / an unfinished buffer
    await writer.flush()
    assert listener.notifications == 1
    assert decode(drain(view)) == [("small",)]
    # four buffers' worth: notified when the first one is readable, not once per buffer
    await writer.emit_all((f"{i:01000d}",) for i in range(16))
    assert 2 <= listener.notifications <= 3
    before = listener.notifications
    polled = drain(view)
    assert [nb.is_data_available for nb in polled][-1] is False
    assert len(decode(polled)) >= 8  # the rest waits in the writer's open batch/buffer
    await writer.broadcast_event(CancelCheckpointMarker(7))
    assert listener.notifications > before  # (the gate ignores repeated notifications)
    items = decode(drain(view))
    assert items[-1] == CancelCheckpointMarker(7)
    await writer.close()
    items = decode(drain(view))
    assert items[-1] == EndOfPartitionEvent.INSTANCE
    view.release_all_resources()
    assert part.is_released  # fully consumed


@pytest.mark.asyncio
async def test_backlog_and_sequence_numbers(make_partition: PartitionFactory) -> None:
    part = make_partition("backlog", PIPELINED, 1, pool_size=(1, 8))
    view = part.create_subpartition_view(0, Listener())
    writer = ResultPartitionWriter(part, buffer_timeout=-1)
    await writer.emit_all(
        [(bytes([i]) * 4000,) for i in range(4)]
    )  # 4 buffers, the last one unfinished
    assert part.stats().backlog == 3
    polled = drain(view)
    assert [nb.sequence_number for nb in polled] == list(range(len(polled)))
    assert [nb.buffers_in_backlog for nb in polled] == list(range(len(polled) - 1, -1, -1))
    assert polled[0].next_data_type is DataType.DATA_BUFFER
    assert polled[-1].next_data_type is None
    decode(polled)
    await writer.close()
    decode(drain(view))
    view.release_all_resources()


@pytest.mark.asyncio
async def test_aligned_barrier_blocks_until_resume(make_partition: PartitionFactory) -> None:
    part = make_partition("barrier", PIPELINED, 1)
    listener = Listener()
    view = part.create_subpartition_view(0, listener)
    writer = ResultPartitionWriter(part, buffer_timeout=-1)
    barrier = CheckpointBarrier(1, 1234)
    await writer.emit(("before",))
    await writer.broadcast_event(barrier)
    await writer.emit(("after",))
    await writer.flush()
    polled = drain(view)
    assert polled[-1].buffer.data_type is DataType.ALIGNED_CHECKPOINT_BARRIER
    assert polled[-1].is_data_available is False
    assert decode(polled) == [("before",), barrier]
    # blocked: "after" is queued and flushed but not readable
    assert view.get_next_buffer() is None
    assert view.get_availability_and_backlog(5) == (False, 0)
    before = listener.notifications
    await writer.emit(("more",))
    await writer.flush()
    assert listener.notifications == before
    view.resume_consumption()
    assert listener.notifications == before + 1
    assert decode(drain(view)) == [("after",), ("more",)]
    with pytest.raises(IllegalStateError, match="not blocked"):
        view.resume_consumption()
    await writer.close()
    decode(drain(view))
    view.release_all_resources()


@pytest.mark.asyncio
async def test_at_least_once_barrier_and_cancel_marker_do_not_block(
    make_partition: PartitionFactory,
) -> None:
    part = make_partition("unaligned", PIPELINED, 1)
    view = part.create_subpartition_view(0, Listener())
    writer = ResultPartitionWriter(part, buffer_timeout=-1)
    barrier = CheckpointBarrier(2, 0, CheckpointOptions(exactly_once=False))
    await writer.broadcast_event(barrier)
    await writer.broadcast_event(CancelCheckpointMarker(2))
    await writer.emit(("after",))
    await writer.close()
    assert decode(drain(view)) == [
        barrier,
        CancelCheckpointMarker(2),
        ("after",),
        EndOfPartitionEvent.INSTANCE,
    ]
    view.release_all_resources()


@pytest.mark.asyncio
async def test_second_reader_is_refused_and_first_keeps_reading(
    make_partition: PartitionFactory,
) -> None:
    part = make_partition("single", PIPELINED, 2)
    view = part.create_subpartition_view(1, Listener())
    with pytest.raises(ConsumerAlreadyAttachedError, match="consumed once") as info:
        part.create_subpartition_view(1, Listener())
    assert info.value.partition_id == part.partition_id
    other = part.create_subpartition_view(0, Listener())  # another subpartition is fine
    writer = ResultPartitionWriter(part, buffer_timeout=-1)
    await writer.emit_to(("one",), 1)
    await writer.close()
    assert decode(drain(view))[0] == ("one",)
    view.release_all_resources()
    other.release_all_resources()


@pytest.mark.asyncio
async def test_consumer_leaving_early_releases_with_a_typed_cause(
    make_partition: PartitionFactory,
) -> None:
    part = make_partition("early", PIPELINED, 1)
    listener = Listener()
    view = part.create_subpartition_view(0, listener)
    writer = ResultPartitionWriter(part, buffer_timeout=-1)
    await writer.emit_all([(f"{i:03000d}",) for i in range(5)])  # queued buffers hold pool segments
    assert part.buffer_pool.num_in_use > 0
    view.release_all_resources()
    view.release_all_resources()  # idempotent
    assert view.is_released
    assert part.is_released
    assert isinstance(part.failure_cause, PartitionReleasedError)
    assert part.subpartitions[0].num_queued_buffers == 0  # type: ignore[union-attr]
    with pytest.raises(PartitionReleasedError):
        part.create_subpartition_view(0, Listener())
    await writer.fail(None)


def test_release_drops_queued_buffers_and_tells_the_reader(
    make_partition: PartitionFactory,
) -> None:
    part = make_partition("drop", PIPELINED, 1)
    listener = Listener()
    view = part.create_subpartition_view(0, listener)
    buf = part.buffer_pool.request_buffer()
    assert buf is not None
    buf.segment.put(0, b"\x01\x02")
    buf.set_size(2)
    sub = part.subpartitions[0]
    sub.add(BufferConsumer.of_buffer(buf))
    assert listener.notifications == 1
    cause = RuntimeError("gone")
    part.release(cause)
    assert listener.notifications == 2
    assert view.is_released and view.failure_cause is cause
    assert view.get_next_buffer() is None
    view.release_all_resources()
