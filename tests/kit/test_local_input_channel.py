"""LocalInputChannel: partition requests with backoff, typed errors on bad requests."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import msgpack
import pytest

from exchange.consumer import RecordReader, SingleInputGate
from exchange.consumer.input_channel import backoff_delays
from exchange.errors import (
    ConsumerAlreadyAttachedError,
    IllegalStateError,
    PartitionNotFoundError,
    PartitionReleasedError,
    SubpartitionIndexError,
    UsageError,
)
from exchange.partition import (
    ResultPartition,
    ResultPartitionID,
    ResultPartitionManager,
    ResultPartitionType,
)
from exchange.serialization.record_codec import MsgpackCodec
from tests.kit.local_input_channel import LocalInputChannel
from tests.kit.partition_writer import ResultPartitionWriter

pytestmark = pytest.mark.timeout(10)

PIPELINED = ResultPartitionType.PIPELINED
PartitionFactory = Callable[..., ResultPartition]
GateOpener = Callable[..., Any]


def test_backoff_doubles_up_to_the_maximum_then_stops() -> None:
    assert list(backoff_delays(0.1, 1.0)) == [0.1, 0.2, 0.4, 0.8, 1.0]
    assert list(backoff_delays(0.05, 0.05)) == [0.05]


@pytest.mark.parametrize(("initial", "maximum"), [(0, 1), (-1, 1), (0.5, 0.1)])
def test_bad_backoff_settings(initial: float, maximum: float) -> None:
    gate = SingleInputGate()
    with pytest.raises(UsageError, match="backoff"):
        LocalInputChannel(
            gate,
            0,
            ResultPartitionManager(),
            ResultPartitionID("p", 0),
            0,
            backoff_initial=initial,
            backoff_max=maximum,
        )


@pytest.mark.parametrize("index", [-1, "0", None])
def test_bad_subpartition_index_at_construction(index: Any) -> None:
    with pytest.raises(UsageError, match="subpartition_index"):
        LocalInputChannel(
            SingleInputGate(), 0, ResultPartitionManager(), ResultPartitionID("p", 0), index
        )


@pytest.mark.asyncio
async def test_request_before_registration_succeeds_once_registered(
    make_partition: PartitionFactory, open_gate: GateOpener
) -> None:
    pid = ResultPartitionID("late", 0)
    gate = await open_gate([(pid, 0)], request=False, backoff_initial=0.05, backoff_max=1.0)
    requesting = asyncio.create_task(gate.request_partitions())
    await asyncio.sleep(0.15)  # a few retries, all before the partition exists
    assert not requesting.done()
    part = make_partition(pid, PIPELINED, 1)
    registered = time.monotonic()
    await asyncio.wait_for(requesting, 30)
    # the next retry, at most backoff_max later (room for a loaded machine)
    assert time.monotonic() - registered < 1.0 + 5
    async with ResultPartitionWriter(part) as writer:
        await writer.emit(("hello",))
    assert await asyncio.wait_for(RecordReader(gate).read_all(), 10) == [("hello",)]


@pytest.mark.asyncio
async def test_request_of_unregistered_partition_fails_after_the_backoff(
    manager: ResultPartitionManager, open_gate: GateOpener, monkeypatch: pytest.MonkeyPatch
) -> None:
    attempts: list[float] = []
    lookup = manager.create_subpartition_view

    def counting(*args: Any) -> Any:
        attempts.append(time.monotonic())
        return lookup(*args)

    monkeypatch.setattr(manager, "create_subpartition_view", counting)
    pid = ResultPartitionID("never", 0)
    gate = await open_gate([(pid, 0)], request=False, backoff_initial=0.01, backoff_max=0.08)
    start = time.monotonic()
    with pytest.raises(PartitionNotFoundError) as info:
        await asyncio.wait_for(gate.request_partitions(), 10)
    assert info.value.partition_id == pid
    # delays 0.01, 0.02, 0.04, 0.08: five attempts, then the error
    assert len(attempts) == 5
    assert time.monotonic() - start >= 0.15
    assert gate.is_closed  # a failed request releases the gate


@pytest.mark.asyncio
async def test_released_partition_fails_at_once_without_backoff(
    make_partition: PartitionFactory, manager: ResultPartitionManager, open_gate: GateOpener
) -> None:
    part = make_partition("released", PIPELINED, 1)
    manager.release_partition(part.partition_id)
    start = time.monotonic()
    with pytest.raises(PartitionReleasedError):
        await open_gate([(part.partition_id, 0)], backoff_initial=10.0, backoff_max=30.0)
    assert time.monotonic() - start < 5  # no backoff (one would take 10 s)


@pytest.mark.asyncio
async def test_subpartition_index_out_of_range(
    make_partition: PartitionFactory, open_gate: GateOpener
) -> None:
    part = make_partition("range", PIPELINED, 2)
    with pytest.raises(SubpartitionIndexError, match=r"index 2 out of range \[0, 2\)"):
        await open_gate([(part.partition_id, 0), (part.partition_id, 2)])
    # the failed gate released the view it had obtained for subpartition 0, which counts
    # as its consumer leaving early
    assert part.subpartitions[0].is_released
    assert not part.subpartitions[1].is_released
    part.release()


@pytest.mark.asyncio
async def test_two_readers_on_one_pipelined_subpartition(
    make_partition: PartitionFactory, open_gate: GateOpener
) -> None:
    part = make_partition("twice", PIPELINED, 1)
    first = await open_gate([(part.partition_id, 0)], name="first")
    with pytest.raises(ConsumerAlreadyAttachedError):
        await open_gate([(part.partition_id, 0)], name="second")
    async with ResultPartitionWriter(part) as writer:
        await writer.emit_all([(1,), (2,)])
    assert await asyncio.wait_for(RecordReader(first).read_all(), 10) == [(1,), (2,)]


@pytest.mark.asyncio
async def test_polling_before_request_is_illegal_and_after_release_is_empty(
    manager: ResultPartitionManager,
) -> None:
    gate = SingleInputGate()
    ch = LocalInputChannel(gate, 0, manager, ResultPartitionID("p", 0), 0)
    gate.set_input_channels([ch])
    with pytest.raises(IllegalStateError, match="not requested"):
        ch.get_next_buffer()
    ch.release_all_resources()
    assert ch.get_next_buffer() is None
    with pytest.raises(IllegalStateError, match="released"):
        await ch.request_subpartition()
    gate.close()


@pytest.mark.asyncio
async def test_counts_bytes_and_buffers(
    make_partition: PartitionFactory, open_gate: GateOpener
) -> None:
    part = make_partition("count", PIPELINED, 1)
    gate = await open_gate([(part.partition_id, 0)])
    async with ResultPartitionWriter(part, codec=MsgpackCodec(), buffer_timeout=-1) as writer:
        await writer.emit_all([(b"q" * 2000,)] * 5)
    await asyncio.wait_for(RecordReader(gate, MsgpackCodec()).read_all(), 10)
    ch = gate.channels[0]
    assert ch.buffers_in == 4  # 3 data buffers + EndOfPartition
    assert ch.bytes_in == 5 * 2004 + 1


@pytest.mark.asyncio
async def test_new_buffer_size_reaches_the_producer(
    make_partition: PartitionFactory, open_gate: GateOpener
) -> None:
    part = make_partition("debloat", PIPELINED, 1, (1, 8))
    gate = await open_gate([(part.partition_id, 0)])
    gate.channels[0].notify_new_buffer_size(1024)
    records = [(i, "d" * 100) for i in range(100)]

    async def produce() -> None:
        async with ResultPartitionWriter(part, codec=MsgpackCodec(), buffer_timeout=-1) as writer:
            await writer.emit_all(records)

    sizes: list[int] = []

    async def consume() -> None:
        while (boe := await gate.get_next()) is not None:
            if boe.buffer is not None:
                sizes.append(boe.buffer.size)
                boe.buffer.release()

    await asyncio.wait_for(asyncio.gather(produce(), consume()), 5)
    assert max(sizes) == 1024
    assert sum(sizes) == sum(len(msgpack.packb(r)) for r in records)
