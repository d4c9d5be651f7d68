"""RecordWriter.emit_all into a partition of one subpartition: the batch path.

With one subpartition every record goes to it, so ``emit_all`` skips the selector and
serializes a buffer's worth at a time (``serialize_until``), in chunks of the iterable.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from exchange.consumer import RecordReader, SingleInputGate
from exchange.partition import ResultPartition
from exchange.serialization.codec import BytesCodec
from exchange.writer import RecordWriter

pytestmark = pytest.mark.timeout(30)


async def read_all(gate: SingleInputGate, codec: Any = None) -> list[Any]:
    reader = RecordReader(gate, codec=codec)
    try:
        return await reader.read_all()
    finally:
        reader.close()


@pytest.mark.asyncio
@pytest.mark.parametrize("count", [0, 1, 1023, 1024, 1025, 5000])
@pytest.mark.parametrize("as_generator", [False, True])
async def test_every_record_once_in_order_and_counted(
    make_partition: Callable[..., ResultPartition],
    open_gate: Callable[..., Any],
    count: int,
    as_generator: bool,
) -> None:
    part = make_partition(1, "pipelined", 1, (1, 4))  # a small pool: backpressure
    gate = await open_gate([(1, 0)])
    reading = asyncio.create_task(read_all(gate))
    records = [(i, "x" * (i % 300)) for i in range(count)]
    source: Any = (r for r in records) if as_generator else records
    async with RecordWriter(part, buffer_timeout=-1) as writer:
        assert await writer.emit_all(source) == count
        assert writer.records_out == count
        assert await writer.emit_all([("last", "")]) == 1
    got = await asyncio.wait_for(reading, 10)
    assert [tuple(r) for r in got] == [*records, ("last", "")]


@pytest.mark.asyncio
async def test_large_bytes_records_span_buffers(
    make_partition: Callable[..., ResultPartition], open_gate: Callable[..., Any]
) -> None:
    part = make_partition(1, "pipelined", 1, (1, 4))
    gate = await open_gate([(1, 0)])
    codec = BytesCodec()
    reading = asyncio.create_task(read_all(gate, codec))
    records = [bytes([i % 256]) * (i * 997 % 10_000) for i in range(300)]
    async with RecordWriter(part, codec=codec, buffer_timeout=-1) as writer:
        assert await writer.emit_all(iter(records)) == len(records)
    assert await asyncio.wait_for(reading, 10) == records


@pytest.mark.asyncio
async def test_a_bad_record_keeps_the_ones_before_it(
    make_partition: Callable[..., ResultPartition], open_gate: Callable[..., Any]
) -> None:
    part = make_partition(1, "pipelined", 1, (1, 4))
    gate = await open_gate([(1, 0)])
    codec = BytesCodec()
    reading = asyncio.create_task(read_all(gate, codec))

    def source() -> Iterator[Any]:
        yield b"a"
        yield b"b"
        yield "not bytes"

    async with RecordWriter(part, codec=codec, buffer_timeout=-1) as writer:
        with pytest.raises(TypeError):
            await writer.emit_all(source())
        assert await writer.emit_all([b"c"]) == 1
    assert await asyncio.wait_for(reading, 10) == [b"a", b"b", b"c"]
