"""RecordReader: events in order with records, barrier resumption, failures never short."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest

from exchange.consumer import RecordReader
from exchange.errors import (
    CorruptRecordError,
    PartitionReleasedError,
    ProducerFailedError,
    ProtocolError,
)
from exchange.events import (
    AbstractEvent,
    CancelCheckpointMarker,
    CheckpointBarrier,
    CheckpointOptions,
    EndOfDataEvent,
    EndOfPartitionEvent,
    EventSerializer,
)
from exchange.partition import ResultPartition, ResultPartitionType
from exchange.serialization.record_codec import MsgpackCodec
from tests.conformance.partition_fill import add_raw_bytes
from tests.kit.partition_writer import ResultPartitionWriter

pytestmark = pytest.mark.timeout(10)

PIPELINED = ResultPartitionType.PIPELINED
PartitionFactory = Callable[..., ResultPartition]
GateOpener = Callable[..., Any]


@pytest.mark.asyncio
@pytest.mark.parametrize("buffer_timeout", [-1, 0, 0.005])
async def test_events_arrive_in_order_with_records_on_every_channel(
    make_partition: PartitionFactory, open_gate: GateOpener, buffer_timeout: float
) -> None:
    n = 3
    part = make_partition("events", PIPELINED, n)
    gate = await open_gate([(part.partition_id, s) for s in range(n)])
    log: list[tuple[int, Any]] = []  # (channel, record or event)

    def handler(event: AbstractEvent, channel: int) -> None:
        log.append((channel, event))

    reader = RecordReader(gate, event_handler=handler)
    expected: list[list[Any]] = [[] for _ in range(n)]
    writer = ResultPartitionWriter(part, buffer_timeout=buffer_timeout)

    async def produce() -> None:
        seq = 0
        for cp in range(1, 4):
            for _ in range(40):
                target = seq % n if cp != 2 else 0  # checkpoint 2: only channel 0 has data
                record = [target, seq, "p" * (seq * 31 % 900)]
                await writer.emit_to(record, target)
                expected[target].append(record)
                seq += 1
            barrier = CheckpointBarrier(cp, 1000 + cp, CheckpointOptions(exactly_once=cp != 3))
            await writer.broadcast_event(barrier)
            for ch in range(n):
                expected[ch].append(barrier)
            if cp == 2:
                await writer.broadcast_event(CancelCheckpointMarker(cp))
                for ch in range(n):
                    expected[ch].append(CancelCheckpointMarker(cp))
            await asyncio.sleep(0)
        await writer.close()
        for ch in range(n):
            expected[ch].append(EndOfPartitionEvent.INSTANCE)

    async def consume() -> None:
        while (batch := await reader.next_batch()) is not None:
            log.extend((rec[0], rec) for rec in batch)

    await asyncio.wait_for(asyncio.gather(produce(), consume()), 8)
    for ch in range(n):
        assert [item for c, item in log if c == ch] == expected[ch], ch
    assert reader.records_in == 120


@pytest.mark.asyncio
async def test_barrier_handler_returning_true_keeps_the_channel_blocked(
    make_partition: PartitionFactory, open_gate: GateOpener
) -> None:
    part = make_partition("aligned", PIPELINED, 2)
    gate = await open_gate([(part.partition_id, 0), (part.partition_id, 1)])
    seen: list[tuple[int, AbstractEvent]] = []

    def aligner(event: AbstractEvent, channel: int) -> bool:
        seen.append((channel, event))
        return isinstance(event, CheckpointBarrier)  # "I resume consumption myself"

    reader = RecordReader(gate, event_handler=aligner)
    writer = ResultPartitionWriter(part, buffer_timeout=-1)
    await writer.emit_to(("before", 0), 0)
    await writer.broadcast_event(CheckpointBarrier(1, 0))
    await writer.emit_to(("after", 0), 0)
    await writer.emit_to(("after", 1), 1)
    await writer.flush()

    assert await asyncio.wait_for(reader.next_batch(), 10) == [("before", 0)]
    pending = asyncio.create_task(reader.next_batch())
    await asyncio.sleep(0.2)
    assert not pending.done()  # both channels are blocked behind their barrier
    assert sorted(ch for ch, _ in seen) == [0, 1]
    gate.resume_consumption(1)
    assert await asyncio.wait_for(pending, 10) == [("after", 1)]
    pending = asyncio.create_task(reader.next_batch())
    await asyncio.sleep(0.1)
    assert not pending.done()  # channel 0 still blocked
    gate.resume_consumption(0)
    assert await asyncio.wait_for(pending, 10) == [("after", 0)]
    await writer.close()
    assert await asyncio.wait_for(reader.read_all(), 10) == []


@pytest.mark.asyncio
@pytest.mark.parametrize("answer", [None, False])
async def test_reader_resumes_by_itself_when_the_handler_does_not_take_charge(
    make_partition: PartitionFactory, open_gate: GateOpener, answer: bool | None
) -> None:
    part = make_partition("auto", PIPELINED, 1, (1, 8))  # room for 5 buffers unread
    gate = await open_gate([(part.partition_id, 0)])
    barriers: list[AbstractEvent] = []

    def handler(event: AbstractEvent, channel: int) -> bool | None:
        barriers.append(event)
        return answer

    reader = RecordReader(gate, event_handler=handler)
    async with ResultPartitionWriter(part, buffer_timeout=-1) as writer:
        for cp in range(5):
            await writer.emit((cp,))
            await writer.broadcast_event(CheckpointBarrier(cp, 0))
    assert await asyncio.wait_for(reader.read_all(), 10) == [(cp,) for cp in range(5)]
    assert barriers[:-1] == [CheckpointBarrier(cp, 0) for cp in range(5)]


@pytest.mark.asyncio
async def test_reader_without_handler_passes_barriers(
    make_partition: PartitionFactory, open_gate: GateOpener
) -> None:
    part = make_partition("nohandler", PIPELINED, 1)
    gate = await open_gate([(part.partition_id, 0)])
    async with ResultPartitionWriter(part, buffer_timeout=-1) as writer:
        await writer.emit((1,))
        await writer.broadcast_event(CheckpointBarrier(1, 0))
        await writer.emit((2,))
    got = [r async for r in RecordReader(gate)]
    assert got == [(1,), (2,)]


@pytest.mark.asyncio
async def test_producer_failure_is_an_error_not_a_short_read(
    make_partition: PartitionFactory, open_gate: GateOpener
) -> None:
    part = make_partition("dies", PIPELINED, 2)
    gate = await open_gate([(part.partition_id, 0), (part.partition_id, 1)])
    reader = RecordReader(gate)
    writer = ResultPartitionWriter(part, buffer_timeout=0.01)
    await writer.emit_all((i,) for i in range(100))
    await writer.flush()
    got = await asyncio.wait_for(reader.next_batch(), 10)
    assert got
    waiting = asyncio.create_task(reader.read_all())
    await asyncio.sleep(0.05)
    await writer.fail(MemoryError("task killed"))
    with pytest.raises(ProducerFailedError, match="task killed") as info:
        await asyncio.wait_for(waiting, 10)
    assert isinstance(info.value.__cause__, MemoryError)
    assert info.value.partition_id == part.partition_id
    reader.close()


@pytest.mark.asyncio
async def test_producer_failure_after_all_data_but_before_end(
    make_partition: PartitionFactory, open_gate: GateOpener
) -> None:
    part = make_partition("almost", PIPELINED, 1)
    gate = await open_gate([(part.partition_id, 0)])
    reader = RecordReader(gate)
    writer = ResultPartitionWriter(part, buffer_timeout=0)
    await writer.emit(("all there is",))
    assert await asyncio.wait_for(reader.next_batch(), 10) == [("all there is",)]
    await writer.fail(None)
    with pytest.raises(ProducerFailedError):
        await asyncio.wait_for(reader.next_batch(), 10)
    reader.close()


@pytest.mark.asyncio
async def test_consumer_closing_early_fails_the_writer(
    make_partition: PartitionFactory, open_gate: GateOpener
) -> None:
    part = make_partition("quits", PIPELINED, 1)
    gate = await open_gate([(part.partition_id, 0)])
    reader = RecordReader(gate)
    writer = ResultPartitionWriter(part, buffer_timeout=0)
    await writer.emit((1,))
    assert await asyncio.wait_for(reader.next_batch(), 10) == [(1,)]
    reader.close()
    with pytest.raises(PartitionReleasedError):
        await writer.emit((2,))
    await writer.fail(None)


@pytest.mark.asyncio
async def test_stream_ending_inside_a_record_is_corrupt(
    make_partition: PartitionFactory, open_gate: GateOpener
) -> None:
    part = make_partition("torn", PIPELINED, 1)
    gate = await open_gate([(part.partition_id, 0)])
    # a whole record [1, 2], then an array of 3 with only one element
    add_raw_bytes(part, 0, b"\x92\x01\x02\x93\x01")
    part.finish()
    reader = RecordReader(gate, MsgpackCodec())  # raw msgpack bytes above
    assert await asyncio.wait_for(reader.next_batch(), 10) == [[1, 2]]
    with pytest.raises(CorruptRecordError, match="ended inside a record"):
        await asyncio.wait_for(reader.next_batch(), 10)
    reader.close()


@pytest.mark.asyncio
async def test_garbage_bytes_are_corrupt_records(
    make_partition: PartitionFactory, open_gate: GateOpener
) -> None:
    part = make_partition("garbage", PIPELINED, 1)
    gate = await open_gate([(part.partition_id, 0)])
    add_raw_bytes(part, 0, b"\x01\xc1\x02")  # 0xc1: never used in msgpack
    part.finish()
    reader = RecordReader(gate)
    with pytest.raises(CorruptRecordError):
        await asyncio.wait_for(reader.read_all(), 10)
    reader.close()


# -- end of data (FLIP-147) ------------------------------------------------------------------


def test_end_of_data_serializes_as_one_byte_distinct_from_end_of_partition() -> None:
    data = EventSerializer.to_bytes(EndOfDataEvent.INSTANCE)
    assert data == bytes((3,))
    assert EventSerializer.from_bytes(data) is EndOfDataEvent.INSTANCE
    buf = EventSerializer.to_buffer(EndOfDataEvent.INSTANCE)
    assert not EventSerializer.is_end_of_partition(buf)
    with pytest.raises(CorruptRecordError):
        EventSerializer.from_bytes(data + b"x")


@pytest.mark.asyncio
async def test_end_of_data_turns_true_once_every_channel_delivered_it(
    make_partition: PartitionFactory, open_gate: GateOpener
) -> None:
    """The records before EndOfData arrive before it; ``end_of_data`` is False after the
    first channel's and True from the last one's on; barriers and EndOfPartition follow."""
    part = make_partition("eod", PIPELINED, 2)
    gate = await open_gate([(part.partition_id, 0), (part.partition_id, 1)])
    log: list[Any] = []
    reader: RecordReader | None = None

    def handler(event: AbstractEvent, channel: int) -> None:
        assert reader is not None
        if isinstance(event, EndOfDataEvent):
            log.append(("eod", channel, reader.stream.end_of_data))

    reader = RecordReader(gate, event_handler=handler)
    async with ResultPartitionWriter(part, buffer_timeout=-1) as writer:
        await writer.emit_to(("a", 0), 0)
        await writer.emit_to(("b", 1), 1)
        await writer.broadcast_event(EndOfDataEvent.INSTANCE)
        await writer.broadcast_event(CheckpointBarrier(7, 0))
    while (batch := await asyncio.wait_for(reader.next_batch(), 2)) is not None:
        log.extend(batch)
    assert sorted(log[:2]) == [("a", 0), ("b", 1)]
    eods = log[2:]
    assert sorted(e[1] for e in eods) == [0, 1]
    assert [e[2] for e in eods] == [False, True] and reader.stream.end_of_data


@pytest.mark.asyncio
@pytest.mark.parametrize("then", ["record", "end-of-data"])
async def test_anything_but_events_after_end_of_data_is_a_protocol_error(
    make_partition: PartitionFactory, open_gate: GateOpener, then: str
) -> None:
    part = make_partition("after-eod", PIPELINED, 1)
    gate = await open_gate([(part.partition_id, 0)])
    reader = RecordReader(gate)
    async with ResultPartitionWriter(part, buffer_timeout=-1) as writer:
        await writer.broadcast_event(EndOfDataEvent.INSTANCE)
        if then == "record":
            await writer.emit(("late",))
        else:
            await writer.broadcast_event(EndOfDataEvent.INSTANCE)
    with pytest.raises(ProtocolError, match=r"after its EndOfData|EndOfData twice"):
        await asyncio.wait_for(reader.read_all(), 2)
    reader.close()
