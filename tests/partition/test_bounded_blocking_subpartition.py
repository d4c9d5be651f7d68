"""Blocking partitions: written beyond the pool's memory, read many times, files deleted."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from exchange.consumer import RecordReader, SingleInputGate
from exchange.errors import PartitionNotReadyError, PartitionReleasedError
from exchange.events import CheckpointBarrier, EndOfPartitionEvent
from exchange.memory import NetworkBufferPool
from exchange.partition import ResultPartition, ResultPartitionManager, ResultPartitionType
from exchange.writer import RoundRobinSelector
from tests.kit.partition_writer import ResultPartitionWriter

pytestmark = pytest.mark.timeout(20)

BLOCKING = ResultPartitionType.BLOCKING
PartitionFactory = Callable[..., ResultPartition]
GateOpener = Callable[..., Any]

POOL_SEGMENTS = 8
SEGMENT = 4096


def _records(total_bytes: int) -> list[tuple[int, str]]:
    out: list[tuple[int, str]] = []
    size = 0
    i = 0
    while size < total_bytes:
        payload = f"{i:0{i * 53 % 700}d}" if i % 211 else f"{i:012000d}"  # some span buffers
        out.append((i, payload))
        size += len(payload) + 8
        i += 1
    return out


async def _read_interleaved(gate: SingleInputGate, name: str, log: list[str]) -> list[Any]:
    """Read batch by batch, yielding to the loop after each, so two readers interleave."""
    reader = RecordReader(gate)
    out: list[Any] = []
    while (batch := await reader.next_batch()) is not None:
        out += batch
        log.append(name)
        await asyncio.sleep(0)
    reader.close()
    return out


@pytest.mark.asyncio
@pytest.mark.parametrize("kind", ["file", "mmap"])
async def test_ten_times_the_pool_written_then_read_twice_at_once(
    make_partition: PartitionFactory,
    open_gate: GateOpener,
    manager: ResultPartitionManager,
    nbp: NetworkBufferPool,
    tmp_path: Path,
    kind: str,
) -> None:
    spill = tmp_path / "spill"
    part = make_partition("big", BLOCKING, 1, (1, POOL_SEGMENTS), spill, kind=kind)
    records = _records(10 * POOL_SEGMENTS * SEGMENT + 10_000)
    writer = ResultPartitionWriter(part, buffer_timeout=-1)
    peak = 0
    for start in range(0, len(records), 50):
        await writer.emit_all(records[start : start + 50])
        peak = max(peak, part.buffer_pool.num_requested, nbp.num_in_use)
    await writer.close()
    assert peak <= POOL_SEGMENTS
    assert part.is_finished
    assert nbp.num_in_use == 0  # everything is on disk
    files = list(spill.iterdir())
    assert len(files) == 1
    assert files[0].stat().st_size >= 10 * POOL_SEGMENTS * SEGMENT

    gates = [await open_gate([(part.partition_id, 0)], name=f"r{i}") for i in range(2)]
    log: list[str] = []
    first, second = await asyncio.wait_for(
        asyncio.gather(*(_read_interleaved(g, f"r{i}", log) for i, g in enumerate(gates))), 15
    )
    expected = list(records)
    assert first == expected
    assert second == expected
    # both readers were in the middle of the data at the same time
    assert log.index("r1") < len(log) - 1 - log[::-1].index("r0")
    # read again, after the first two readers are done: the same bytes
    third = await open_gate([(part.partition_id, 0)], name="r2")
    assert await asyncio.wait_for(_read_interleaved(third, "r2", log), 10) == expected

    assert list(spill.iterdir()) == files  # a blocking partition is not released by reads
    assert manager.release_partition(part.partition_id)
    assert list(spill.iterdir()) == []


@pytest.mark.asyncio
@pytest.mark.parametrize("kind", ["file", "mmap"])
async def test_release_while_reading_fails_the_reader_and_deletes_files_after_it(
    make_partition: PartitionFactory,
    open_gate: GateOpener,
    manager: ResultPartitionManager,
    tmp_path: Path,
    kind: str,
) -> None:
    spill = tmp_path / "spill"
    part = make_partition("cut", BLOCKING, 1, (1, 4), spill, kind=kind)
    async with ResultPartitionWriter(part, buffer_timeout=-1) as writer:
        await writer.emit_all((i, f"{i:0300d}") for i in range(1_000))
    gate = await open_gate([(part.partition_id, 0)])
    reader = RecordReader(gate)
    assert await reader.next_batch()
    manager.release_partition(part.partition_id)
    assert len(list(spill.iterdir())) == 1  # the reader still has it open
    with pytest.raises(PartitionReleasedError):
        await asyncio.wait_for(reader.read_all(), 10)
    reader.close()
    assert list(spill.iterdir()) == []
    with pytest.raises(PartitionReleasedError):
        await open_gate([(part.partition_id, 0)])


@pytest.mark.asyncio
@pytest.mark.parametrize("kind", ["file", "mmap"])
async def test_several_subpartitions_with_broadcast_and_events(
    make_partition: PartitionFactory, open_gate: GateOpener, tmp_path: Path, kind: str
) -> None:
    part = make_partition("multi", BLOCKING, 3, spill_dir=tmp_path, kind=kind)
    events: list[tuple[int, Any]] = []
    writer = ResultPartitionWriter(part, RoundRobinSelector(), buffer_timeout=-1)
    await writer.emit_all((i,) for i in range(30))
    await writer.broadcast_emit(("all",))
    await writer.broadcast_event(CheckpointBarrier(5, 0))
    await writer.emit_all((i,) for i in range(30, 33))
    await writer.close()
    for sub in range(3):
        gate = await open_gate([(part.partition_id, sub)])

        def handler(event: Any, channel: int) -> None:
            events.append((channel, event))

        got = await RecordReader(gate, event_handler=handler).read_all()
        expected = [(i,) for i in range(30) if i % 3 == sub] + [("all",), (30 + sub,)]
        assert got == expected
    barrier, eop = CheckpointBarrier(5, 0), EndOfPartitionEvent.INSTANCE
    assert [e for _, e in events] == [barrier, eop] * 3


@pytest.mark.asyncio
async def test_empty_blocking_partition_reads_as_end_of_partition(
    make_partition: PartitionFactory, open_gate: GateOpener, tmp_path: Path
) -> None:
    part = make_partition("none", BLOCKING, 2, spill_dir=tmp_path)
    await ResultPartitionWriter(part).close()
    gate = await open_gate([(part.partition_id, 0), (part.partition_id, 1)])
    assert await RecordReader(gate).read_all() == []
    assert gate.is_finished


@pytest.mark.asyncio
async def test_reading_before_the_partition_is_finished_is_a_partition_error(
    make_partition: PartitionFactory, open_gate: GateOpener, tmp_path: Path
) -> None:
    part = make_partition("unfinished", BLOCKING, 1, spill_dir=tmp_path)
    writer = ResultPartitionWriter(part, buffer_timeout=-1)
    await writer.emit(("x",))
    with pytest.raises(PartitionNotReadyError, match="not finished"):
        await open_gate([(part.partition_id, 0)])
    await writer.close()
    gate = await open_gate([(part.partition_id, 0)])
    assert await RecordReader(gate).read_all() == [("x",)]


def test_blocking_partition_needs_one_required_segment_per_subpartition(
    make_partition: PartitionFactory, tmp_path: Path
) -> None:
    from exchange.errors import UsageError

    with pytest.raises(UsageError, match="at least 4 required"):
        make_partition("small", BLOCKING, 4, (2, 8), tmp_path)
    assert list(tmp_path.iterdir()) == []
