"""ResultPartitionWriter (the RecordWriter driven into in-process partitions) end to end
through pipelined partitions and local channels.

N writers x M readers in one loop with every selector, backpressure with a tiny pool,
the three buffer-timeout modes, and the writer's typed errors.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import pytest

from exchange.consumer import RecordReader, SingleInputGate
from exchange.errors import PartitionReleasedError, UsageError, WriterClosedError
from exchange.memory import NetworkBufferPool
from exchange.partition import ResultPartition, ResultPartitionID, ResultPartitionType
from exchange.writer import (
    BroadcastSelector,
    KeyHashSelector,
    RoundRobinSelector,
    deterministic_hash,
)
from tests.kit.partition_writer import ResultPartitionWriter
from tests.kit.polling import wait_until

pytestmark = pytest.mark.timeout(30)

PIPELINED = ResultPartitionType.PIPELINED


def _seq(record: Any) -> int:
    return int(record[1])


def _payload(writer: int, seq: int) -> str:
    # 0 .. ~1.6 KiB, and every 97th record spans several 4 KiB buffers
    size = 9_000 if seq % 97 == 13 else (seq * 37 + writer) % 1_600
    return chr(ord("a") + (seq + writer) % 26) * size


async def _read_all(gate: SingleInputGate) -> list[Any]:
    reader = RecordReader(gate)
    try:
        return await reader.read_all()
    finally:
        reader.close()


# -- N writers x M readers -----------------------------------------------------------------


@pytest.mark.asyncio
@pytest.mark.parametrize("selector", ["hash", "round_robin", "broadcast"])
@pytest.mark.parametrize("num_readers", [1, 3, 16])
@pytest.mark.parametrize("num_writers", [1, 3, 16])
async def test_n_writers_m_readers_every_record_once_in_order(
    make_partition: Callable[..., ResultPartition],
    open_gate: Callable[..., Any],
    nbp: NetworkBufferPool,
    num_writers: int,
    num_readers: int,
    selector: str,
) -> None:
    # writer 1 writes nothing (an empty partition); with 16 subpartitions and few records
    # some subpartitions of the hash selector stay empty
    counts = [0 if w == 1 else 40 + 7 * w for w in range(num_writers)]
    timeouts = [-1, 0, 0.005]
    parts = [
        make_partition(ResultPartitionID("nxm", w), PIPELINED, num_readers)
        for w in range(num_writers)
    ]
    gates = [
        await open_gate([(p.partition_id, r) for p in parts], name=f"reader-{r}")
        for r in range(num_readers)
    ]

    async def write(w: int) -> None:
        part = parts[w]
        timeout = timeouts[w % 3]
        writer: ResultPartitionWriter
        if selector == "broadcast":
            writer = ResultPartitionWriter(part, BroadcastSelector(), buffer_timeout=timeout)
        elif selector == "hash":
            writer = ResultPartitionWriter(part, KeyHashSelector(_seq), buffer_timeout=timeout)
        else:
            writer = ResultPartitionWriter(part, RoundRobinSelector(), buffer_timeout=timeout)
        records = ((w, seq, _payload(w, seq)) for seq in range(counts[w]))
        if w % 2:
            await writer.emit_all(records)
        else:
            for record in records:
                await writer.emit(record)
        await writer.close()

    results = await asyncio.wait_for(
        asyncio.gather(*(write(w) for w in range(num_writers)), *(_read_all(g) for g in gates)),
        25,
    )
    received: list[Any] = list(results[num_writers:])

    for w in range(num_writers):
        seen: list[int] = []
        for r, records in enumerate(received):
            mine = [rec for rec in records if rec[0] == w]
            seqs = [rec[1] for rec in mine]
            if selector == "broadcast":
                expected = list(range(counts[w]))
            elif selector == "hash":
                expected = [s for s in range(counts[w]) if deterministic_hash(s) % num_readers == r]
            else:
                expected = [s for s in range(counts[w]) if s % num_readers == r]
            assert seqs == expected, (w, r)
            assert all(rec[2] == _payload(w, rec[1]) for rec in mine)
            seen += seqs
        if selector != "broadcast":
            assert sorted(seen) == list(range(counts[w]))  # every record exactly once
    for gate in gates:
        assert gate.is_finished or gate.is_closed
    for part in parts:
        assert part.is_finished and part.is_released  # consumed: released by its readers
    assert nbp.num_in_use == 0


@pytest.mark.asyncio
async def test_empty_partition_and_empty_subpartitions_end_the_gate(
    make_partition: Callable[..., ResultPartition], open_gate: Callable[..., Any]
) -> None:
    empty = make_partition("empty", PIPELINED, 3)
    sparse = make_partition("sparse", PIPELINED, 16)
    gate = await open_gate(
        [(empty.partition_id, s) for s in range(3)] + [(sparse.partition_id, s) for s in range(16)]
    )
    await ResultPartitionWriter(empty).close()
    async with ResultPartitionWriter(sparse, RoundRobinSelector(), buffer_timeout=-1) as writer:
        await writer.emit_all([("a",), ("b",), ("c",)])  # subpartitions 3..15 stay empty
    records = await asyncio.wait_for(_read_all(gate), 5)
    assert records == [("a",), ("b",), ("c",)]


@pytest.mark.asyncio
async def test_emit_with_explicit_key_and_target(
    make_partition: Callable[..., ResultPartition], open_gate: Callable[..., Any]
) -> None:
    part = make_partition("keyed", PIPELINED, 4)
    gates = [await open_gate([(part.partition_id, s)]) for s in range(4)]
    writer = ResultPartitionWriter(part, buffer_timeout=-1)
    await writer.emit(("x", 1), key="routing-key")
    await writer.emit_to(("y", 2), 3)
    await writer.close()
    assert writer.records_out == 2
    got = await asyncio.gather(*(_read_all(g) for g in gates))
    key_target = deterministic_hash("routing-key") % 4
    expected: list[list[Any]] = [[] for _ in range(4)]
    expected[key_target].append(("x", 1))
    expected[3].append(("y", 2))
    assert got == expected


# -- backpressure --------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_backpressure_blocks_writer_within_pool_and_resumes(
    make_partition: Callable[..., ResultPartition],
    open_gate: Callable[..., Any],
    nbp: NetworkBufferPool,
) -> None:
    max_segments = 3
    part = make_partition("bp", PIPELINED, 1, pool_size=(1, max_segments))
    gate = await open_gate([(part.partition_id, 0)])
    reader = RecordReader(gate)
    # ~620 KiB: ~150 buffers of 4 KiB (distinct strings: pickle stores a shared one once)
    records = [(i, f"{i:0200d}") for i in range(3_000)]
    writer = ResultPartitionWriter(part, buffer_timeout=0.01)
    peak = {"global": 0, "local": 0}
    stop = asyncio.Event()

    async def sample() -> None:
        while not stop.is_set():
            peak["global"] = max(peak["global"], nbp.num_in_use)
            if not part.buffer_pool.is_destroyed:
                peak["local"] = max(peak["local"], part.buffer_pool.num_requested)
            await asyncio.sleep(0.001)

    async def produce() -> None:
        await writer.emit_all(records)
        await writer.close()

    sampler = asyncio.create_task(sample())
    producer = asyncio.create_task(produce())
    got: list[Any] = []
    while len(got) < 100:
        batch = await asyncio.wait_for(reader.next_batch(), 10)
        assert batch is not None
        got += batch
    # the reader stops: the writer fills the pool and waits for a buffer
    pool = part.buffer_pool
    seen = [-1]

    def held() -> bool:
        # a writer that can go on runs while the poll sleeps (one loop): no byte added to
        # the partition with its pool full and unavailable is a writer waiting for a buffer
        before, seen[0] = seen[0], part.stats().bytes_out
        return pool.num_in_use == max_segments and not pool.is_available and before == seen[0]

    await wait_until(held, 30, "the writer waiting for a buffer of its full pool")
    assert nbp.num_in_use <= max_segments
    stalled_at = part.stats().bytes_out
    await asyncio.sleep(0.3)  # time to move on, were it not held: it is not
    assert part.stats().bytes_out == stalled_at
    assert not producer.done()
    assert pool.num_in_use == max_segments
    # the reader resumes: everything arrives
    got += await asyncio.wait_for(reader.read_all(), 10)
    await asyncio.wait_for(producer, 5)
    stop.set()
    await sampler
    reader.close()
    assert [tuple(r) for r in got] == records
    assert peak["global"] <= max_segments
    assert peak["local"] <= max_segments
    assert part.stats().back_pressured_seconds >= 0.3  # at least the time it was held above


@pytest.mark.asyncio
async def test_writer_blocked_on_pool_wakes_with_error_when_partition_is_released(
    make_partition: Callable[..., ResultPartition],
    open_gate: Callable[..., Any],
    manager: Any,
) -> None:
    part = make_partition("bp-release", PIPELINED, 1, pool_size=(1, 2))
    await open_gate([(part.partition_id, 0)])  # a reader that never reads
    writer = ResultPartitionWriter(part, buffer_timeout=-1)
    producer = asyncio.create_task(writer.emit_all((i, f"{i:0500d}") for i in range(1_000)))
    pool = part.buffer_pool
    await wait_until(lambda: pool.num_in_use == 2 and not pool.is_available, 30, "a full pool")
    assert not producer.done()
    manager.release_partition(part.partition_id)
    with pytest.raises(PartitionReleasedError):
        await asyncio.wait_for(producer, 30)
    await writer.fail(None)


# -- buffer timeout (output flusher) -------------------------------------------------------


@pytest.mark.asyncio
async def test_buffer_timeout_zero_makes_every_record_readable_at_once(
    make_partition: Callable[..., ResultPartition], open_gate: Callable[..., Any]
) -> None:
    part = make_partition("t0", PIPELINED, 2)
    gate = await open_gate([(part.partition_id, 0), (part.partition_id, 1)])
    reader = RecordReader(gate)
    writer = ResultPartitionWriter(part, RoundRobinSelector(), buffer_timeout=0)
    for i in range(6):
        await writer.emit((i, "small"))
        # readable synchronously, with no flush and no other task having run
        boe = gate.poll_next()
        assert boe is not None and boe.buffer is not None
        assert boe.channel_index == i % 2
        boe.buffer.release()
    await writer.emit_all([(6, "a"), (7, "b")])
    assert await asyncio.wait_for(reader.next_batch(), 10) == [(6, "a")]
    assert await asyncio.wait_for(reader.next_batch(), 10) == [(7, "b")]
    await writer.close()
    assert await asyncio.wait_for(reader.next_batch(), 10) is None
    reader.close()


@pytest.mark.asyncio
async def test_buffer_timeout_50ms_moves_a_lone_record_in_bounded_time(
    make_partition: Callable[..., ResultPartition], open_gate: Callable[..., Any]
) -> None:
    part = make_partition("t50", PIPELINED, 1)
    gate = await open_gate([(part.partition_id, 0)])
    reader = RecordReader(gate)
    writer = ResultPartitionWriter(part, buffer_timeout=0.05)
    for i in range(3):
        start = time.monotonic()
        await writer.emit(("lone", i))
        assert gate.poll_next() is None  # not readable before the flusher ran
        assert await asyncio.wait_for(reader.next_batch(), 10) == [("lone", i)]
        assert time.monotonic() - start < 5  # bounded (without a flusher: never)
    await writer.close()
    assert await reader.read_all() == []
    reader.close()


@pytest.mark.asyncio
async def test_buffer_timeout_minus_one_moves_only_full_buffers(
    make_partition: Callable[..., ResultPartition], open_gate: Callable[..., Any]
) -> None:
    part = make_partition("tm1", PIPELINED, 1)
    gate = await open_gate([(part.partition_id, 0)])
    reader = RecordReader(gate)
    writer = ResultPartitionWriter(part, buffer_timeout=-1)
    await writer.emit(("lone", 0))
    pending = asyncio.create_task(reader.next_batch())
    await asyncio.sleep(0.3)
    assert not pending.done()
    await writer.flush()
    assert await asyncio.wait_for(pending, 10) == [("lone", 0)]
    # enough records to fill a buffer: the full buffer moves without a flush
    big = [("r", i, f"{i:0100d}") for i in range(100)]  # ~10 KiB
    await writer.emit_all(big)
    got: list[Any] = []
    while len(got) < 30:
        batch = await asyncio.wait_for(reader.next_batch(), 10)
        assert batch is not None
        got += batch
    rest = asyncio.create_task(reader.read_all())
    await asyncio.sleep(0.05)
    assert not rest.done()  # the last, partly filled buffer waits for close
    await writer.close()
    got += await asyncio.wait_for(rest, 10)
    assert [tuple(r) for r in got] == big
    reader.close()


@pytest.mark.parametrize("timeout", [-2, -0.5, -1.5])
def test_buffer_timeout_must_be_non_negative_or_minus_one(
    make_partition: Callable[..., ResultPartition], timeout: float
) -> None:
    part = make_partition("bad-timeout", PIPELINED, 1)
    with pytest.raises(UsageError, match="buffer_timeout"):
        ResultPartitionWriter(part, buffer_timeout=timeout)
    part.release()


# -- closing and failing -------------------------------------------------------------------


@pytest.mark.asyncio
async def test_every_write_after_close_is_writer_closed_error(
    make_partition: Callable[..., ResultPartition], open_gate: Callable[..., Any]
) -> None:
    part = make_partition("closed", PIPELINED, 2)
    gate = await open_gate([(part.partition_id, 0), (part.partition_id, 1)])
    writer = ResultPartitionWriter(part)
    await writer.emit(("before",))
    await writer.close()
    await writer.close()  # idempotent
    assert writer.is_closed
    with pytest.raises(WriterClosedError):
        await writer.emit(("after",))
    with pytest.raises(WriterClosedError):
        await writer.emit_to(("after",), 1)
    with pytest.raises(WriterClosedError):
        await writer.emit_all([("after",)])
    with pytest.raises(WriterClosedError):
        await writer.broadcast_emit(("after",))
    from exchange.events import CancelCheckpointMarker

    with pytest.raises(WriterClosedError):
        await writer.broadcast_event(CancelCheckpointMarker(1))
    # the partition itself refuses too
    with pytest.raises(WriterClosedError):
        part.broadcast_event(CancelCheckpointMarker(1))
    assert await _read_all(gate) == [("before",)]


@pytest.mark.asyncio
async def test_context_manager_fails_the_partition_on_error(
    make_partition: Callable[..., ResultPartition], open_gate: Callable[..., Any]
) -> None:
    from exchange.errors import ProducerFailedError

    part = make_partition("ctx", PIPELINED, 1)
    gate = await open_gate([(part.partition_id, 0)])
    with pytest.raises(KeyError):
        async with ResultPartitionWriter(part, buffer_timeout=0) as writer:
            await writer.emit(("ok",))
            raise KeyError("task failed")
    with pytest.raises(ProducerFailedError, match="task failed") as info:
        await _read_all(gate)
    assert isinstance(info.value.__cause__, KeyError)


@pytest.mark.asyncio
async def test_emit_after_consumer_left_raises_partition_released(
    make_partition: Callable[..., ResultPartition], open_gate: Callable[..., Any]
) -> None:
    part = make_partition("left", PIPELINED, 1)
    gate = await open_gate([(part.partition_id, 0)])
    reader = RecordReader(gate)
    writer = ResultPartitionWriter(part, buffer_timeout=0.01)
    await writer.emit_all((i, "v") for i in range(50))
    assert await asyncio.wait_for(reader.next_batch(), 10)
    reader.close()  # the consumer goes away before the end
    assert part.is_released
    with pytest.raises(PartitionReleasedError, match="consumer"):
        await writer.emit(("next",))
    with pytest.raises(PartitionReleasedError):
        await writer.emit_all([("next",)])
    with pytest.raises(PartitionReleasedError):
        await writer.close()
    assert writer.is_closed


@pytest.mark.asyncio
async def test_flusher_keeps_flushing_other_subpartitions_when_one_consumer_left(
    make_partition: Callable[..., ResultPartition], open_gate: Callable[..., Any]
) -> None:
    part = make_partition("one-left", PIPELINED, 2)
    staying = await open_gate([(part.partition_id, 0)], name="staying")
    leaving = await open_gate([(part.partition_id, 1)], name="leaving")
    leaving.close()  # consumer of subpartition 1 leaves before anything was written
    assert part.subpartitions[1].is_released and not part.is_released
    reader = RecordReader(staying)
    writer = ResultPartitionWriter(part, buffer_timeout=0.01)
    await writer.emit_to(("to-gone",), 1)  # stays in the serializer of subpartition 1
    for i in range(3):
        await writer.emit_to(("kept", i), 0)
        # the output flusher still moves subpartition 0's records
        assert await asyncio.wait_for(reader.next_batch(), 10) == [("kept", i)]
    # the writer learns about subpartition 1 when it copies into it
    with pytest.raises(PartitionReleasedError, match="consumer"):
        await writer.flush()
    await writer.fail(None)
    reader.close()


# -- mixed emits, huge records -------------------------------------------------------------


@pytest.mark.asyncio
@pytest.mark.parametrize("buffer_timeout", [-1, 0, 0.005])
async def test_unicast_and_broadcast_records_keep_their_order_per_subpartition(
    make_partition: Callable[..., ResultPartition],
    open_gate: Callable[..., Any],
    buffer_timeout: float,
) -> None:
    n = 3
    part = make_partition("mixed", PIPELINED, n)
    gates = [await open_gate([(part.partition_id, s)]) for s in range(n)]
    writer = ResultPartitionWriter(part, RoundRobinSelector(), buffer_timeout=buffer_timeout)
    expected: list[list[Any]] = [[] for _ in range(n)]

    async def produce() -> None:
        for i in range(300):
            if i % 7 == 0:
                record = ["all", i, "b" * (i % 500)]
                await writer.broadcast_emit(record)
                for sub in expected:
                    sub.append(record)
            else:
                record = ["one", i, "u" * (i * 13 % 2_000)]
                target = i % n
                await writer.emit_to(record, target)
                expected[target].append(record)
        await writer.close()

    results = await asyncio.wait_for(asyncio.gather(produce(), *(_read_all(g) for g in gates)), 10)
    assert list(results[1:]) == expected


@pytest.mark.asyncio
async def test_record_larger_than_the_whole_pool_streams_through(
    make_partition: Callable[..., ResultPartition],
    open_gate: Callable[..., Any],
    nbp: NetworkBufferPool,
) -> None:
    part = make_partition("huge", PIPELINED, 1, pool_size=(1, 3))
    gate = await open_gate([(part.partition_id, 0)])
    huge = ("huge", b"\xab" * (40 * 4096))  # ten times the pool
    peak = 0

    async def produce() -> None:
        async with ResultPartitionWriter(part, buffer_timeout=-1) as writer:
            await writer.emit(("small", b""))
            await writer.emit(huge)
            await writer.emit(("small", b"!"))

    async def watch() -> None:
        nonlocal peak
        while not part.is_finished:
            peak = max(peak, nbp.num_in_use)
            await asyncio.sleep(0)

    _, got, _ = await asyncio.wait_for(asyncio.gather(produce(), _read_all(gate), watch()), 10)
    assert got == [("small", b""), huge, ("small", b"!")]
    assert peak <= 3


@pytest.mark.asyncio
async def test_broadcast_writer_serializes_and_copies_each_record_once(
    make_partition: Callable[..., ResultPartition], open_gate: Callable[..., Any]
) -> None:
    part = make_partition("bcast", PIPELINED, 4)
    gates = [await open_gate([(part.partition_id, s)]) for s in range(4)]
    writer = ResultPartitionWriter(part, BroadcastSelector(), buffer_timeout=-1)
    records = [(i, f"{i:0700d}") for i in range(60)]  # ~42 KiB

    async def produce() -> None:
        assert await writer.emit_all(records) == 60
        await writer.emit(("last",))
        await writer.close()

    _, *got = await asyncio.wait_for(asyncio.gather(produce(), *(_read_all(g) for g in gates)), 10)
    assert all(g == [*records, ("last",)] for g in got)
    # one buffer shared by all subpartitions: the bytes were cut (and copied) once
    assert writer.writer.stats.bytes_out < 50_000
    assert part.buffer_pool.is_destroyed or part.buffer_pool.num_in_use == 0
