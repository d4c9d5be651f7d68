"""Failures end to end: each one a clear, typed error, its buffers released, no hang.

Missing partitions, a producer that fails mid-stream, a consumer process killed with
SIGKILL, a daemon process killed with SIGKILL, a daemon that is not there.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from client.network import ConnectionManager
from exchange.consumer import RecordReader, SingleInputGate
from exchange.errors import PartitionNotFoundError, ProducerFailedError, TransportError
from exchange.memory import NetworkBufferPool
from exchange.partition import ResultPartitionID

SEG = 32 * 1024
Spawn = Callable[..., Awaitable[Any]]
PoolFactory = Callable[..., NetworkBufferPool]


async def read_until_error(
    gate: SingleInputGate, records: list[Any], timeout: float = 10
) -> BaseException | None:
    """Read into ``records`` until the end (None) or an error (returned)."""
    reader = RecordReader(gate)
    try:
        async with asyncio.timeout(timeout):
            await gate.request_partitions()
            while (batch := await reader.next_batch()) is not None:
                records.extend(batch)
    except TimeoutError:
        raise
    except Exception as e:
        return e
    finally:
        reader.close()
    return None


def assert_in_order_prefix(records: list[Any], producer: int = 0) -> None:
    seqs = [i for p, _, i, _ in records if p == producer]
    assert seqs == list(range(len(seqs)))


@pytest.mark.asyncio(loop_factories=["asyncio"])
async def test_unknown_partition_fails_after_retries(
    spawn_server: Spawn, client_pool: PoolFactory, net: Any
) -> None:
    daemon = await spawn_server()
    nbp = client_pool(16, SEG)
    cm = ConnectionManager(segment_size=SEG)
    gate = net.make_gate(
        daemon.address, [ResultPartitionID("nope", 0)], 0, cm, nbp, backoff=(0.01, 0.04)
    )
    loop = asyncio.get_running_loop()
    start = loop.time()
    with pytest.raises(PartitionNotFoundError) as info:
        await net.read_all(gate, timeout=10)
    elapsed = loop.time() - start
    assert elapsed >= 0.01 + 0.02 + 0.04  # it retried with backoff before giving up
    assert "nope" in str(info.value)
    assert len(cm.connections) == 1  # a missing partition does not end the connection
    await cm.close()
    await daemon.quit()
    await net.assert_no_other_tasks()


@pytest.mark.asyncio(loop_factories=["uvloop"])
async def test_late_producer_is_found_on_retry(
    spawn_server: Spawn, client_pool: PoolFactory, net: Any
) -> None:
    n = 500
    daemon = await spawn_server(
        streams=[{"dataset": "late", "records": n, "start_delay": 0.3, "payload": 10}]
    )
    nbp = client_pool(16, SEG)
    cm = ConnectionManager(segment_size=SEG)
    gate = net.make_gate(
        daemon.address, [ResultPartitionID("late", 0)], 0, cm, nbp, backoff=(0.02, 1.28)
    )
    records = await net.read_all(gate)
    net.check_records(records, [0], 0, n, 10)
    await cm.close()
    await daemon.expect("producer_done")
    await daemon.quit()
    await net.assert_no_other_tasks()


@pytest.mark.asyncio(loop_factories=["asyncio", "uvloop"])
async def test_producer_failure_reaches_the_consumer(
    spawn_server: Spawn, client_pool: PoolFactory, net: Any
) -> None:
    fail_after = 3_000
    daemon = await spawn_server(
        streams=[
            {"dataset": "fails", "records": 10_000, "payload": 100, "fail_after": fail_after}
            | {"await_readers": 1}  # mid-stream: the consumer is attached before it fails
        ]
    )
    nbp = client_pool(16, SEG)
    cm = ConnectionManager(segment_size=SEG)
    gate = net.make_gate(daemon.address, [ResultPartitionID("fails", 0)], 0, cm, nbp)
    records: list[Any] = []
    error = await read_until_error(gate, records)
    assert isinstance(error, ProducerFailedError), error
    assert "injected failure" in str(error)
    assert len(records) <= fail_after
    assert_in_order_prefix(records)
    assert len(cm.connections) == 1  # per-channel error: the connection survives
    await cm.close()
    done = await daemon.expect("producer_done")
    assert "injected failure" in done["error"]
    await daemon.quit()
    await net.assert_no_other_tasks()


@pytest.mark.asyncio(loop_factories=["asyncio"])
async def test_killed_consumer_releases_the_daemons_views_and_buffers(
    spawn_server: Spawn, spawn_client: Spawn, net: Any
) -> None:
    daemon = await spawn_server(
        segments=128,
        streams=[{"dataset": "kill", "records": 10**7, "payload": 200, "pool_max": 16}],
    )
    consumer = await spawn_client(
        address=daemon.address, dataset="kill", producers=1, subpartition=0, report_every=2000
    )
    await consumer.expect("records")  # mid-stream
    st = await daemon.stats()
    assert st["server"]["readers"] == 1 and st["pool"]["in_use"] > 0
    consumer.kill()
    await consumer.wait()
    # Without the release the daemon would hold them forever (no keepalive), so a bound
    # that load cannot reach still tells the two apart.
    await daemon.wait_for_stats(
        lambda s: (
            s["server"]["connections"] == 0
            and s["server"]["readers"] == 0
            and s["partitions"] == 0
            and s["pool"]["in_use"] == 0
            and s["pool"]["local_pools"] == 0
        ),
        timeout=10.0,
    )
    done = await daemon.expect("producer_done")
    assert "released" in done["error"]  # the producer learned that its consumer left
    await daemon.quit()
    await net.assert_no_other_tasks()


@pytest.mark.asyncio(loop_factories=["asyncio", "uvloop"])
async def test_killed_daemon_is_a_transport_error(
    spawn_server: Spawn, client_pool: PoolFactory, net: Any
) -> None:
    daemon = await spawn_server(
        streams=[
            {"dataset": "dies", "records": 10**7, "payload": 100}
            | {"sleep_every": 200, "sleep": 0.005}
        ]
    )
    nbp = client_pool(16, SEG)
    cm = ConnectionManager(segment_size=SEG)
    gate = net.make_gate(daemon.address, [ResultPartitionID("dies", 0)], 0, cm, nbp)
    reader = RecordReader(gate)
    records: list[Any] = []
    try:
        async with asyncio.timeout(10):
            await gate.request_partitions()
            while len(records) < 2000:
                batch = await reader.next_batch()
                assert batch is not None
                records.extend(batch)
        daemon.kill()
        with pytest.raises(TransportError, match="lost"):
            async with asyncio.timeout(10):
                while (batch := await reader.next_batch()) is not None:
                    records.extend(batch)
    finally:
        reader.close()
    assert_in_order_prefix(records)
    # The dead connection is forgotten (its closed-callbacks may run after the reader woke).
    async with asyncio.timeout(5):
        while cm.connections:
            await asyncio.sleep(0.005)
    await cm.close()
    await daemon.wait()
    await net.assert_no_other_tasks()


@pytest.mark.asyncio(loop_factories=["asyncio"])
async def test_no_daemon_is_a_transport_error(
    spawn_server: Spawn, client_pool: PoolFactory, net: Any
) -> None:
    daemon = await spawn_server()
    address = daemon.address
    await daemon.quit()  # the port is closed now
    nbp = client_pool(16, SEG)
    cm = ConnectionManager(segment_size=SEG, connect_retries=2, connect_backoff=0.01)
    gate = net.make_gate(address, [ResultPartitionID("x", 0)], 0, cm, nbp)
    with pytest.raises(TransportError, match=r"cannot reach daemon at .* after 3 attempts"):
        await net.read_all(gate, timeout=10)
    await cm.close()
    await net.assert_no_other_tasks()


@pytest.mark.asyncio(loop_factories=["uvloop"])
async def test_consumer_leaving_early_cancels_only_its_stream(
    spawn_server: Spawn, client_pool: PoolFactory, net: Any
) -> None:
    """A gate closed mid-stream sends CancelPartitionRequest: the daemon releases that
    view (its producer learns) while another stream on the same connection goes on."""
    n, payload = 3_000, 100
    daemon = await spawn_server(
        streams=[
            {"dataset": "quits", "records": 10**7, "payload": payload},
            {"dataset": "stays", "records": n, "payload": payload}
            | {"sleep_every": 500, "sleep": 0.02},
        ]
    )
    nbp = client_pool(32, SEG)
    cm = ConnectionManager(segment_size=SEG)
    quitter = net.make_gate(daemon.address, [ResultPartitionID("quits", 0)], 0, cm, nbp)
    stayer = net.make_gate(daemon.address, [ResultPartitionID("stays", 0)], 0, cm, nbp)
    staying = asyncio.create_task(net.read_all(stayer))
    reader = RecordReader(quitter)
    records: list[Any] = []
    try:
        async with asyncio.timeout(10):
            await quitter.request_partitions()
            while len(records) < 1000:
                batch = await reader.next_batch()
                assert batch is not None
                records.extend(batch)
    finally:
        reader.close()  # leaves early
    assert_in_order_prefix(records)
    # The producer learns that its consumer left, while the connection is still open.
    quits = await daemon.expect("producer_done", dataset="quits")
    assert "released" in quits["error"]
    net.check_records(await staying, [0], 0, n, payload)
    assert len(cm.connections) == 1  # one connection served both, and survived the cancel
    await cm.close()
    stays = await daemon.expect("producer_done", dataset="stays")
    assert stays["error"] is None
    await daemon.quit()
    await net.assert_no_other_tasks()


@pytest.mark.asyncio(loop_factories=["asyncio"])
async def test_daemon_shutdown_mid_stream_is_a_transport_error(
    spawn_server: Spawn, client_pool: PoolFactory, net: Any
) -> None:
    daemon = await spawn_server(
        streams=[
            {"dataset": "bye", "records": 10**7, "payload": 100}
            | {"sleep_every": 200, "sleep": 0.005}
        ]
    )
    nbp = client_pool(16, SEG)
    cm = ConnectionManager(segment_size=SEG)
    gate = net.make_gate(daemon.address, [ResultPartitionID("bye", 0)], 0, cm, nbp)
    reader = RecordReader(gate)
    records: list[Any] = []
    try:
        async with asyncio.timeout(10):
            await gate.request_partitions()
            while len(records) < 1000:
                batch = await reader.next_batch()
                assert batch is not None
                records.extend(batch)
        daemon.send("quit")  # the daemon closes every connection with SERVER_SHUTDOWN
        with pytest.raises(TransportError, match="shutting down"):
            async with asyncio.timeout(10):
                while (batch := await reader.next_batch()) is not None:
                    records.extend(batch)
    finally:
        reader.close()
    assert_in_order_prefix(records)
    bye = await daemon.expect("bye")
    assert bye["whole"] and bye["connections"] == 0, bye
    assert await daemon.wait() == 0
    await cm.close()
    await net.assert_no_other_tasks()
