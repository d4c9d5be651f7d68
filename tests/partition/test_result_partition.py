"""ResultPartition: construction limits, views, lifecycle, statistics."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest

from exchange.consumer import RecordReader
from exchange.errors import (
    PartitionError,
    PartitionReleasedError,
    ProducerFailedError,
    SubpartitionIndexError,
    UsageError,
    WriterClosedError,
)
from exchange.events import EndOfPartitionEvent
from exchange.memory import NetworkBufferPool
from exchange.partition import ResultPartition, ResultPartitionID, ResultPartitionType
from exchange.writer import RoundRobinSelector
from tests.kit.partition_writer import ResultPartitionWriter

pytestmark = pytest.mark.timeout(10)

PIPELINED = ResultPartitionType.PIPELINED
PartitionFactory = Callable[..., ResultPartition]


class Listener:
    def notify_data_available(self) -> None:
        pass


@pytest.mark.parametrize("ptype", list(ResultPartitionType))
def test_pool_must_guarantee_one_segment_per_subpartition(
    nbp: NetworkBufferPool, ptype: ResultPartitionType, tmp_path: Any
) -> None:
    pool = nbp.create_buffer_pool(1, 64)
    with pytest.raises(UsageError, match="at least 4 required segments"):
        ResultPartition(ResultPartitionID("p", 0), ptype, 4, pool, spill_dir=tmp_path)
    pool.destroy()


@pytest.mark.asyncio
async def test_one_segment_per_subpartition_is_enough_for_a_pipelined_writer(
    make_partition: PartitionFactory, open_gate: Callable[..., Any]
) -> None:
    # Why the check above exists: with 4 subpartitions and 2 segments (as this test once
    # ran) both segments end up in open, unfinished builders and the writer waits for a
    # third forever. With 4 it always progresses.
    part = make_partition("dl", PIPELINED, 4, (4, 4))
    gate = await open_gate([(part.partition_id, s) for s in range(4)])
    writer = ResultPartitionWriter(part, RoundRobinSelector(), buffer_timeout=0.01)
    reader = RecordReader(gate)

    async def produce() -> None:
        await writer.emit_all((i, f"{i:0100d}") for i in range(5_000))
        await writer.close()

    _, got = await asyncio.wait_for(asyncio.gather(produce(), reader.read_all()), 10)
    assert len(got) == 5_000


@pytest.mark.parametrize("n", [0, -1, 1.0])
def test_rejects_bad_subpartition_count(nbp: NetworkBufferPool, n: Any) -> None:
    pool = nbp.create_buffer_pool(1, 2)
    with pytest.raises(UsageError, match="num_subpartitions"):
        ResultPartition(ResultPartitionID("p", 0), PIPELINED, n, pool)
    pool.destroy()


@pytest.mark.parametrize("index", [-1, 3, 100, "0", None, 1.0])
def test_subpartition_index_out_of_range(make_partition: PartitionFactory, index: Any) -> None:
    part = make_partition("idx", PIPELINED, 3)
    with pytest.raises(SubpartitionIndexError, match="out of range") as info:
        part.create_subpartition_view(index, Listener())
    # a peer's request named it: one stream's failure, not the API misuse of a UsageError
    assert isinstance(info.value, PartitionError) and not isinstance(info.value, UsageError)
    assert (info.value.index, info.value.num_subpartitions) == (index, 3)
    assert info.value.partition_id == part.partition_id


def test_view_of_released_partition(make_partition: PartitionFactory) -> None:
    part = make_partition("rel", PIPELINED, 2)
    part.release()
    part.release()  # idempotent
    assert part.is_released
    with pytest.raises(PartitionReleasedError):
        part.create_subpartition_view(0, Listener())


@pytest.mark.asyncio
async def test_finish_appends_end_of_partition_everywhere_and_keeps_the_pool_until_read(
    make_partition: PartitionFactory, nbp: NetworkBufferPool
) -> None:
    part = make_partition("fin", PIPELINED, 3)
    views = [part.create_subpartition_view(i, Listener()) for i in range(3)]
    writer = ResultPartitionWriter(part, buffer_timeout=-1)
    await writer.emit_all((i,) for i in range(9))
    await writer.close()
    assert part.is_finished and not part.is_released
    assert not part.buffer_pool.is_destroyed  # the queued buffers still hold segments
    assert part.buffer_pool.num_in_use == 3
    part.finish()  # idempotent
    for view in views:
        nb = view.get_next_buffer()
        assert nb is not None and nb.buffer.is_buffer
        nb.buffer.release()
        nb = view.get_next_buffer()
        assert nb is not None and not nb.buffer.is_buffer
        from exchange.events import EventSerializer

        assert EventSerializer.from_buffer(nb.buffer) == EndOfPartitionEvent.INSTANCE
        nb.buffer.release()
        view.release_all_resources()
    assert part.is_released  # every subpartition consumed
    assert part.is_finished  # ... after its producer finished it
    assert part.buffer_pool.is_destroyed
    with pytest.raises(PartitionReleasedError):
        part.check_writable()


@pytest.mark.asyncio
async def test_fail_gives_readers_producer_failed_with_the_cause(
    make_partition: PartitionFactory,
) -> None:
    part = make_partition("failing", PIPELINED, 1)
    view = part.create_subpartition_view(0, Listener())
    cause = OSError("disk on fire")
    part.fail(cause)
    assert view.is_released
    err = view.failure_cause
    assert isinstance(err, ProducerFailedError)
    assert err.__cause__ is cause and "disk on fire" in str(err)
    view.release_all_resources()
    with pytest.raises(PartitionReleasedError, match="producer failed"):
        part.check_writable()


@pytest.mark.asyncio
async def test_stats_count_bytes_buffers_and_backlog(make_partition: PartitionFactory) -> None:
    part = make_partition("stats", PIPELINED, 1, (1, 8))
    view = part.create_subpartition_view(0, Listener())
    writer = ResultPartitionWriter(part, buffer_timeout=-1)
    await writer.emit_all([(bytes([i]) * 1000,) for i in range(10)])  # ~10 KiB
    stats = part.stats()
    assert stats.num_subpartitions == 1
    # only full buffers left the writer so far
    assert stats.buffers_out >= 1 and stats.bytes_out == stats.buffers_out * 4096
    assert stats.backlog == stats.buffers_out
    await writer.flush()
    stats = part.stats()
    assert stats.bytes_out == writer.writer.stats.bytes_out > 10_000
    assert stats.backlog == stats.buffers_out == 3
    assert 0 < stats.out_pool_usage <= 1
    assert not stats.finished and not stats.released
    await writer.close()
    stats = part.stats()
    assert stats.finished and stats.buffers_out == 3
    assert stats.bytes_out == writer.writer.stats.bytes_out  # nothing more at close
    assert stats.out_pool_usage > 0  # unread buffers hold their segments
    while (nb := view.get_next_buffer()) is not None:
        nb.buffer.release()
    view.release_all_resources()
    assert part.stats().released


@pytest.mark.asyncio
async def test_nothing_may_be_written_after_finish(make_partition: PartitionFactory) -> None:
    part = make_partition("after-finish", PIPELINED, 1)
    part.finish()
    with pytest.raises(WriterClosedError):
        part.check_writable()
    writer = ResultPartitionWriter(part, buffer_timeout=-1)
    with pytest.raises(WriterClosedError):
        await writer.emit(("late",))  # refused at once, not a buffer later
    with pytest.raises(WriterClosedError):
        await writer.flush()
    await writer.fail(None)
