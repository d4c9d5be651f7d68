"""SingleInputGate: channel bookkeeping, end of input, closing."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest

from exchange.consumer import RecordReader, SingleInputGate
from exchange.errors import IllegalStateError, UsageError
from exchange.events import EndOfPartitionEvent
from exchange.partition import (
    ResultPartition,
    ResultPartitionID,
    ResultPartitionManager,
    ResultPartitionType,
)
from tests.kit.local_input_channel import LocalInputChannel
from tests.kit.partition_writer import ResultPartitionWriter

pytestmark = pytest.mark.timeout(10)

PIPELINED = ResultPartitionType.PIPELINED
PartitionFactory = Callable[..., ResultPartition]
GateOpener = Callable[..., Any]


@pytest.mark.asyncio
async def test_gate_without_channels_ends_at_once() -> None:
    gate = SingleInputGate("empty")
    await gate.request_partitions()
    assert gate.is_finished
    assert await asyncio.wait_for(gate.get_next(), 10) is None
    assert await RecordReader(gate).read_all() == []
    gate.close()


def test_channels_must_be_numbered_and_belong_to_the_gate() -> None:
    manager = ResultPartitionManager()
    pid = ResultPartitionID("p", 0)
    gate, other = SingleInputGate("a"), SingleInputGate("b")
    with pytest.raises(UsageError, match="is not channel 0"):
        gate.set_input_channels([LocalInputChannel(gate, 1, manager, pid, 0)])
    with pytest.raises(UsageError, match="is not channel 0"):
        gate.set_input_channels([LocalInputChannel(other, 0, manager, pid, 0)])


@pytest.mark.asyncio
async def test_channels_cannot_change_after_request(
    make_partition: PartitionFactory, open_gate: GateOpener, manager: ResultPartitionManager
) -> None:
    part = make_partition("fixed", PIPELINED, 1)
    gate = await open_gate([(part.partition_id, 0)])
    await gate.request_partitions()  # idempotent
    with pytest.raises(IllegalStateError, match="before partitions are requested"):
        gate.set_input_channels([LocalInputChannel(gate, 0, manager, part.partition_id, 0)])
    part.release()


@pytest.mark.asyncio
async def test_buffers_and_events_then_end(
    make_partition: PartitionFactory, open_gate: GateOpener
) -> None:
    a = make_partition("a", PIPELINED, 1)
    b = make_partition("b", PIPELINED, 1)
    gate = await open_gate([(a.partition_id, 0), (b.partition_id, 0)])
    assert gate.poll_next() is None
    async with ResultPartitionWriter(a, buffer_timeout=-1) as writer:
        await writer.emit(("from a",))
    first = await asyncio.wait_for(gate.get_next(), 10)
    assert first is not None and first.buffer is not None and first.channel_index == 0
    first.buffer.release()
    eop = await asyncio.wait_for(gate.get_next(), 10)
    assert eop is not None and eop.event == EndOfPartitionEvent.INSTANCE
    assert not gate.is_finished  # channel 1 is still open
    pending = asyncio.create_task(gate.get_next())
    await asyncio.sleep(0.05)
    assert not pending.done()
    await ResultPartitionWriter(b).close()
    last = await asyncio.wait_for(pending, 10)
    assert last is not None and last.event == EndOfPartitionEvent.INSTANCE
    assert last.channel_index == 1
    assert gate.is_finished
    assert await gate.get_next() is None
    assert a.is_released and b.is_released  # both consumed


@pytest.mark.asyncio
async def test_close_releases_views_and_refuses_polls(
    make_partition: PartitionFactory, open_gate: GateOpener
) -> None:
    part = make_partition("closing", PIPELINED, 2)
    gate = await open_gate([(part.partition_id, 0), (part.partition_id, 1)])
    waiting = asyncio.create_task(gate.get_next())
    await asyncio.sleep(0)
    gate.close()
    gate.close()  # idempotent
    assert gate.is_closed
    with pytest.raises(IllegalStateError, match="closed"):
        await asyncio.wait_for(waiting, 10)  # a waiting reader wakes up and learns it
    with pytest.raises(IllegalStateError, match="closed"):
        gate.poll_next()
    assert part.is_released  # its consumer went away before the end
