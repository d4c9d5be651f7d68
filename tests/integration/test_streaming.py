"""End to end over loopback: a daemon process serves, this process reads.

Every record is ``[producer, subpartition, seq, payload]``; each test checks that every
record arrives exactly once and in order per producer (sequence numbers of the buffers
are checked by every RemoteInputChannel on the way), then that both processes are clean:
pools whole, no connection, no task.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from client.consumer import PartitionLocation, PartitionReader
from client.network import ConnectionManager
from exchange.consumer import RecordReader
from exchange.errors import IllegalStateError
from exchange.events import AbstractEvent, CheckpointBarrier
from exchange.memory import NetworkBufferPool
from exchange.partition import ResultPartitionID

SEG = 32 * 1024
Spawn = Callable[..., Awaitable[Any]]
PoolFactory = Callable[..., NetworkBufferPool]


@pytest.mark.asyncio(loop_factories=["asyncio", "uvloop"])
async def test_one_producer_one_consumer(
    spawn_server: Spawn, client_pool: PoolFactory, net: Any
) -> None:
    n, payload = 20_000, 200
    daemon = await spawn_server(streams=[{"dataset": "one", "records": n, "payload": payload}])
    nbp = client_pool(64, SEG)
    cm = ConnectionManager(segment_size=SEG)
    gate = net.make_gate(daemon.address, [ResultPartitionID("one", 0)], 0, cm, nbp)
    records = await net.read_all(gate)
    net.check_records(records, [0], 0, n, payload)
    assert gate.channels[0].buffers_in > 0
    await cm.close()
    assert cm.connections == []
    done = await daemon.expect("producer_done")
    assert done["error"] is None
    bye = await daemon.quit()
    assert bye["server"]["total_connections"] == 1
    await net.assert_no_other_tasks()


@pytest.mark.asyncio(loop_factories=["uvloop"])
async def test_eight_by_eight(spawn_server: Spawn, client_pool: PoolFactory, net: Any) -> None:
    """8 producers x 8 subpartitions, read by 8 gates over 8 connections."""
    n, payload = 1_500, 64
    daemon = await spawn_server(
        segment_size=8192,
        segments=512,
        streams=[
            {"dataset": "ex", "producers": 8, "subpartitions": 8, "records": n}
            | {"payload": payload, "pool_max": 24}
        ],
    )
    nbp = client_pool(8 * 8 * 2 + 8 * 4, 8192)
    pids = [ResultPartitionID("ex", p) for p in range(8)]
    managers = [ConnectionManager(segment_size=8192) for _ in range(8)]
    gates = [
        net.make_gate(daemon.address, pids, j, managers[j], nbp, floating=4, name=f"g{j}")
        for j in range(8)
    ]
    results = await asyncio.gather(*(net.read_all(g) for g in gates))
    for j, records in enumerate(results):
        net.check_records(records, range(8), j, n, payload)
    for cm in managers:
        await cm.close()
    st = await daemon.wait_for_stats(lambda s: s["producers_done"] == 8, 10)
    assert st["producer_errors"] == []
    bye = await daemon.quit()
    assert bye["server"]["total_connections"] == 8
    await net.assert_no_other_tasks()


@pytest.mark.asyncio(loop_factories=["asyncio", "uvloop"])
async def test_32_channels_share_one_connection(
    spawn_server: Spawn, client_pool: PoolFactory, net: Any
) -> None:
    n, payload = 1_000, 100
    daemon = await spawn_server(
        segment_size=8192,
        segments=512,
        streams=[{"dataset": "wide", "producers": 32, "records": n, "payload": payload}],
    )
    nbp = client_pool(32 * 2 + 16, 8192)
    cm = ConnectionManager(segment_size=8192)
    pids = [ResultPartitionID("wide", p) for p in range(32)]
    gate = net.make_gate(daemon.address, pids, 0, cm, nbp, floating=16)
    records = await net.read_all(gate)
    net.check_records(records, range(32), 0, n, payload)
    assert len(cm.connections) == 1
    await cm.close()
    bye = await daemon.quit()
    assert bye["server"]["total_connections"] == 1  # all 32 channels on one connection
    await net.assert_no_other_tasks()


@pytest.mark.asyncio(loop_factories=["uvloop"])
async def test_credit_stops_the_sender_and_backpressures_the_producer(
    spawn_server: Spawn, client_pool: PoolFactory, net: Any
) -> None:
    """A consumer that stops reading gets no more than its buffers' worth; the producer
    blocks, the daemon's memory stays bounded; reading again delivers everything."""
    exclusive, floating, pool_max = 2, 3, 8
    n, payload = 4_000, 1000  # ~4 MB: far more than the buffers on both sides
    daemon = await spawn_server(
        segments=64,
        streams=[
            {"dataset": "credit", "records": n, "payload": payload, "pool_max": pool_max}
            | {"buffer_timeout": -1}
        ],
    )
    nbp = client_pool(16, SEG)
    cm = ConnectionManager(segment_size=SEG)
    gate = net.make_gate(
        daemon.address,
        [ResultPartitionID("credit", 0)],
        0,
        cm,
        nbp,
        floating=floating,
        exclusive=exclusive,
    )
    await gate.request_partitions()  # requested, but the gate is not polled
    [handler] = cm.connections
    loop = asyncio.get_running_loop()

    # Wait until the client has received everything it has room for and it stays there.
    stable_since, last = loop.time(), -1
    deadline = loop.time() + 10
    while loop.time() - stable_since < 0.3:
        assert loop.time() < deadline, f"never settled: {handler.bytes_received} bytes"
        if handler.bytes_received != last:
            last, stable_since = handler.bytes_received, loop.time()
        await asyncio.sleep(0.02)

    credit_bytes = (exclusive + floating) * SEG
    slack = 28 + 41 + (exclusive + floating) * 31  # handshake + frame headers
    assert handler.bytes_received <= credit_bytes + slack
    # The backlog made the channel take floating buffers: more than the exclusive ones came.
    assert handler.bytes_received > exclusive * SEG
    st = await daemon.stats()
    assert st["producers_done"] == 0  # the producer is blocked in emit
    assert st["pool"]["in_use"] <= pool_max  # bounded: only the partition's pool
    await asyncio.sleep(0.3)
    st2 = await daemon.stats()
    assert st2["producers_done"] == 0
    assert st2["server"]["bytes_sent"] == st["server"]["bytes_sent"]
    assert handler.bytes_received == last

    records = await net.read_all(gate)  # reading again resumes the stream
    net.check_records(records, [0], 0, n, payload)
    assert handler.bytes_received > n * payload
    await cm.close()
    st = await daemon.wait_for_stats(lambda s: s["producers_done"] == 1, 10)
    assert st["producer_errors"] == []
    await daemon.quit()
    await net.assert_no_other_tasks()


@pytest.mark.asyncio(loop_factories=["asyncio", "uvloop"])
async def test_aligned_barriers_block_and_resume_over_the_wire(
    spawn_server: Spawn, client_pool: PoolFactory, net: Any
) -> None:
    """Each aligned barrier blocks its subpartition on the daemon until the reader sends
    ResumeConsumption; the stream would stall at the first one otherwise."""
    n, every, payload = 5_000, 500, 50
    daemon = await spawn_server(
        streams=[
            {"dataset": "cp", "records": n, "payload": payload, "barrier_every": every}
            | {"buffer_timeout": -1}
        ]
    )
    nbp = client_pool(16, SEG)
    cm = ConnectionManager(segment_size=SEG)
    gate = net.make_gate(daemon.address, [ResultPartitionID("cp", 0)], 0, cm, nbp)
    seen: list[tuple[int, int]] = []

    def on_event(event: AbstractEvent, channel: int) -> None:
        if isinstance(event, CheckpointBarrier):  # None: the reader resumes consumption
            seen.append((event.checkpoint_id, reader.records_in))

    reader = RecordReader(gate, event_handler=on_event)
    try:
        async with asyncio.timeout(20):
            await gate.request_partitions()
            records = await reader.read_all()
    finally:
        reader.close()
    net.check_records(records, [0], 0, n, payload)
    # In band: barrier k comes after exactly k * every records, none lost or reordered.
    assert seen == [(k, k * every) for k in range(1, n // every)]
    await cm.close()
    assert (await daemon.expect("producer_done"))["error"] is None
    await daemon.quit()
    await net.assert_no_other_tasks()


# -- the synchronous PartitionReader (task thread + the client runtime's loop) -------------


def _locations(daemon: Any, dataset: str, producers: int = 1) -> list[PartitionLocation]:
    return [
        PartitionLocation(ResultPartitionID(dataset, p), 0, daemon.address)
        for p in range(producers)
    ]


@pytest.mark.asyncio(loop_factories=["asyncio"])
async def test_close_from_another_thread_unblocks_records(spawn_server: Spawn, net: Any) -> None:
    """Defect 8: ``records()`` blocked waiting for data must end promptly, with a typed
    error, when another thread closes the reader; the reader's pool is whole after."""
    daemon = await spawn_server(
        streams=[
            {"dataset": "stall", "records": 20, "payload": 10, "sleep_every": 5}
            | {"sleep": 3600, "buffer_timeout": 0.001}
        ]
    )
    reader = await asyncio.to_thread(PartitionReader, _locations(daemon, "stall"), segment_size=SEG)
    got: list[Any] = []
    outcome: list[BaseException | None] = []

    def read() -> None:
        try:
            for record in reader.records():
                got.append(record)
            outcome.append(None)
        except BaseException as e:
            outcome.append(e)

    thread = threading.Thread(target=read)
    thread.start()
    async with asyncio.timeout(10):
        while len(got) < 5:  # then the producer sleeps: records() blocks
            await asyncio.sleep(0.01)
    await asyncio.to_thread(reader.close)  # raises if the reader's pool is not whole
    await asyncio.to_thread(thread.join, 10)
    assert not thread.is_alive(), "records() still blocked after close()"
    assert len(got) == 5
    [error] = outcome
    assert isinstance(error, IllegalStateError) and "closed" in str(error)
    with pytest.raises(IllegalStateError, match="closed"):
        next(iter(reader.records()))
    await daemon.quit()
    await net.assert_no_other_tasks()


@pytest.mark.asyncio(loop_factories=["asyncio"])
async def test_sync_reader_delivers_events_in_order_in_the_task_thread(
    spawn_server: Spawn, net: Any
) -> None:
    """Barriers reach the handler in the task thread, in band with the records, and the
    stream moves on only because the handler resumes consumption itself."""
    n, every, payload = 3_000, 500, 50
    daemon = await spawn_server(
        streams=[
            {"dataset": "sync-cp", "records": n, "payload": payload, "barrier_every": every}
            | {"buffer_timeout": -1}
        ]
    )
    seen: list[tuple[int, int, bool]] = []
    records: list[Any] = []

    def run() -> None:
        task_thread = threading.current_thread()

        def on_event(event: AbstractEvent, channel: int) -> bool:
            if isinstance(event, CheckpointBarrier):
                seen.append(
                    (event.checkpoint_id, len(records), threading.current_thread() is task_thread)
                )
                reader.resume_consumption(channel)
                return True
            return False

        reader = PartitionReader(
            _locations(daemon, "sync-cp"),
            segment_size=SEG,
            event_handler=on_event,
            auto_resume_barriers=False,
            window=2,
        )
        with reader:
            for record in reader:
                records.append(record)

    await asyncio.wait_for(asyncio.to_thread(run), 30)
    net.check_records(records, [0], 0, n, payload)
    assert seen == [(k, k * every, True) for k in range(1, n // every)]
    assert (await daemon.expect("producer_done"))["error"] is None
    await daemon.quit()
    await net.assert_no_other_tasks()


@pytest.mark.asyncio(loop_factories=["asyncio"])
async def test_sync_reader_reads_many_channels_and_leaves_its_pool_whole(
    spawn_server: Spawn, net: Any
) -> None:
    n, payload = 4_000, 300
    daemon = await spawn_server(
        streams=[{"dataset": "sync-many", "producers": 4, "records": n, "payload": payload}]
    )

    def run() -> list[Any]:
        with PartitionReader(
            _locations(daemon, "sync-many", 4), segment_size=SEG, num_floating=2, window=1
        ) as reader:
            return reader.read_all()  # close() raises if the pool is not whole

    records = await asyncio.wait_for(asyncio.to_thread(run), 30)
    net.check_records(records, range(4), 0, n, payload)
    await daemon.quit()
    await net.assert_no_other_tasks()
