"""server.metrics: the Prometheus collector and the /api/stats snapshot, on real engine objects.

The daemon is a stand-in for ``server.daemon.Daemon`` built from the real pieces: a
NetworkBufferPool, a ResultPartitionManager whose partitions a real RecordWriter fills, and a
real DataServer on port 0 that real RemoteInputChannels read from. Every expected number
comes from the engine's own statistics (and, where the data is fully written, from the
record sizes).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import msgpack
import pytest
import pytest_asyncio
from prometheus_client import REGISTRY, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from client.network import ConnectionManager
from exchange import __version__
from exchange.consumer.record_reader import RecordReader
from exchange.consumer.remote_input_channel import RemoteInputChannel
from exchange.consumer.single_input_gate import SingleInputGate
from exchange.memory import NetworkBufferPool
from exchange.partition import (
    ResultPartition,
    ResultPartitionID,
    ResultPartitionManager,
    ResultPartitionType,
)
from exchange.serialization.record_codec import MsgpackCodec
from server.config import DaemonConfig
from server.metrics import (
    OTHER_LABEL,
    DaemonView,
    ExchangeCollector,
    MonotonicCounter,
    SentCounters,
    build_registry,
    stats_snapshot,
)
from server.partition_request_server import DataServer
from tests.kit.partition_writer import ResultPartitionWriter
from tests.kit.polling import wait_until

SEGMENTS = 256
SEGMENT_SIZE = 4096

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


# -- a stand-in daemon of real engine objects -------------------------------------------------


class StandInDaemon:
    """Implements the DaemonView protocol the way server.daemon.Daemon does."""

    def __init__(self, spill_dir: Path) -> None:
        self.daemon_id = "daemon-test-1"
        self.started_at = time.time() - 12.5
        self.config = DaemonConfig(
            network_memory=SEGMENTS * SEGMENT_SIZE, segment_size=SEGMENT_SIZE
        )
        self.network_pool = NetworkBufferPool(SEGMENTS, SEGMENT_SIZE)
        self.manager = ResultPartitionManager()
        self.data_server = DataServer(self.manager, segment_size=SEGMENT_SIZE)
        self.data_address = "?"
        self.spill_dir = spill_dir
        self.shutting_down = False
        self.producers = 0
        self._created = 0
        self._released = 0
        self._failed = 0
        self._retired = {"bytes_out": 0.0, "buffers_out": 0.0, "back_pressured_seconds": 0.0}

    async def start(self) -> None:
        host, port = await self.data_server.start("127.0.0.1", 0)
        self.data_address = f"{host}:{port}"

    async def close(self) -> None:
        await self.data_server.close()
        self.manager.release_all()
        self.network_pool.check_consistency()
        assert self.network_pool.is_whole(), self.network_pool.stats()
        self.network_pool.destroy()

    def create_partition(
        self,
        pid: ResultPartitionID,
        ptype: ResultPartitionType,
        n: int,
        required: int,
        maximum: int,
    ) -> ResultPartition:
        pool = self.network_pool.create_buffer_pool(required, maximum)
        try:
            part = ResultPartition(pid, ptype, n, pool, spill_dir=self.spill_dir)
        except BaseException:
            pool.destroy()
            raise
        self.manager.register_result_partition(part)

        def on_release(p: ResultPartition) -> None:
            s = p.stats()
            self._retired["bytes_out"] += s.bytes_out
            self._retired["buffers_out"] += s.buffers_out
            self._retired["back_pressured_seconds"] += s.back_pressured_seconds
            self._released += 1
            self._failed += p.failure_cause is not None

        part.add_release_listener(on_release)
        self._created += 1
        return part

    def local_endpoint_stats(self) -> dict[str, int]:
        return {
            "producers": self.producers,
            "consumers": 0,
            "bytes_received": int(self.totals()["bytes_in"]),
            "buffers_received": int(self.totals()["buffers_out"]),
            "partitions_created": self._created,
            "producer_failures": self._failed,
        }

    def totals(self) -> dict[str, float]:
        live = [p.stats() for p in self.manager.partitions]
        bytes_out = self._retired["bytes_out"] + sum(s.bytes_out for s in live)
        return {
            "bytes_in": bytes_out,  # producers here write in-process: in == out
            "bytes_out": bytes_out,
            "buffers_out": self._retired["buffers_out"] + sum(s.buffers_out for s in live),
            "partitions_created": self._created,
            "partitions_released": self._released,
            "partitions_failed": self._failed,
            "back_pressured_seconds": self._retired["back_pressured_seconds"]
            + sum(s.back_pressured_seconds for s in live),
        }


@pytest_asyncio.fixture
async def daemon(tmp_path: Path) -> AsyncIterator[StandInDaemon]:
    d = StandInDaemon(tmp_path)
    await d.start()
    try:
        yield d
    finally:
        await d.close()


def scrape(collector_or_registry: Any) -> Samples:
    """Render as /metrics would, parse it back, and index the samples by name and labels."""
    text = generate_latest(collector_or_registry).decode()
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples[(name, tuple(sorted(labels.items())))]


def plabels(pid: ResultPartitionID) -> dict[str, str]:
    return {
        "dataset": pid.dataset_id,
        "partition": str(pid.partition_index),
        "attempt": str(pid.attempt_id),
    }


def packed_size(records: list[Any]) -> int:
    return sum(len(msgpack.packb(r)) for r in records)


async def read_remote(d: StandInDaemon, pid: ResultPartitionID, index: int) -> list[Any]:
    """Read one subpartition through the data port, as a consumer task on another host would."""
    connections = ConnectionManager(segment_size=SEGMENT_SIZE)
    gate = SingleInputGate("test-gate")
    channel = RemoteInputChannel(
        gate, 0, pid, index, d.data_address, connections, d.network_pool, num_exclusive=2
    )
    gate.set_input_channels([channel])
    records: list[Any] = []
    try:
        await gate.request_partitions()
        reader = RecordReader(gate, MsgpackCodec())
        while (batch := await reader.next_batch()) is not None:
            records.extend(batch)
    finally:
        gate.close()
        await connections.close()
    return records


# -- tests --------------------------------------------------------------------------------------


def test_stand_in_satisfies_the_protocol(tmp_path: Path) -> None:
    d = StandInDaemon(tmp_path)
    try:
        view: DaemonView = d  # checked by mypy; at runtime: the attributes are there
        assert view.manager.partitions == []
    finally:
        d.network_pool.destroy()


@pytest.mark.asyncio
async def test_pool_and_partition_metrics_match_engine_stats(daemon: StandInDaemon) -> None:
    # A pipelined partition written but not finished: its buffers wait in a backlog.
    pipe_id = ResultPartitionID("shuffle-7", 3, 1001)
    pipe = daemon.create_partition(pipe_id, ResultPartitionType.PIPELINED, 2, 2, 8)
    pipe_records = [bytes([i]) * 1000 for i in range(20)]
    writer = ResultPartitionWriter(pipe, codec=MsgpackCodec(), buffer_timeout=-1)
    await writer.emit_all(pipe_records)
    await writer.flush()
    # A blocking partition written completely.
    block_id = ResultPartitionID("shuffle-8", 0, 2002)
    block = daemon.create_partition(block_id, ResultPartitionType.BLOCKING, 3, 3, 6)
    block_records = [{"k": i, "v": "y" * 200} for i in range(300)]
    async with ResultPartitionWriter(block, codec=MsgpackCodec(), buffer_timeout=-1) as w:
        await w.emit_all(block_records)

    samples = scrape(build_registry(daemon))
    pool = daemon.network_pool.stats()
    ps, bs = pipe.stats(), block.stats()

    assert value(samples, "exchange_network_segments_total") == SEGMENTS
    assert value(samples, "exchange_network_segments_available") == pool.available_segments
    assert value(samples, "exchange_network_segments_used") == pool.in_use_segments
    assert pool.in_use_segments > 0
    assert value(samples, "exchange_network_segments_required") == pool.required_segments
    assert value(samples, "exchange_network_segment_size_bytes") == SEGMENT_SIZE
    assert value(samples, "exchange_network_memory_bytes") == SEGMENTS * SEGMENT_SIZE
    assert value(samples, "exchange_network_memory_used_ratio") == pool.in_use_segments / SEGMENTS
    assert value(samples, "exchange_local_buffer_pools") == pool.num_local_pools == 1

    assert value(samples, "exchange_partitions", type="pipelined") == 1
    assert value(samples, "exchange_partitions", type="blocking") == 1
    assert value(samples, "exchange_partitions_finished", type="blocking") == 1
    assert value(samples, "exchange_partitions_finished", type="pipelined") == 0

    # The unfinished pipelined partition: Flink's outPoolUsage and the backlog, exactly.
    assert ps.backlog > 0 and 0 < ps.out_pool_usage <= 1
    assert value(samples, "exchange_out_pool_usage", **plabels(pipe_id)) == ps.out_pool_usage
    assert value(samples, "exchange_backlog_buffers", **plabels(pipe_id)) == ps.backlog
    assert value(samples, "exchange_partition_bytes_out_total", **plabels(pipe_id)) == ps.bytes_out
    assert (
        value(samples, "exchange_partition_buffers_out_total", **plabels(pipe_id)) == ps.buffers_out
    )
    # The finished blocking partition holds every byte written, nothing more.
    assert bs.bytes_out == packed_size(block_records)
    assert value(samples, "exchange_partition_bytes_out_total", **plabels(block_id)) == bs.bytes_out
    assert value(samples, "exchange_backlog_buffers", **plabels(block_id)) == 0
    assert value(samples, "exchange_out_pool_usage", **plabels(block_id)) == 0.0

    assert value(samples, "exchange_bytes_out_total") == ps.bytes_out + bs.bytes_out
    assert value(samples, "exchange_buffers_out_total") == ps.buffers_out + bs.buffers_out
    assert value(samples, "exchange_bytes_received_total") == ps.bytes_out + bs.bytes_out
    assert value(samples, "exchange_partitions_created_total") == 2
    assert value(samples, "exchange_partitions_released_total") == 0

    assert value(samples, "exchange_build_info", version=__version__) == 1
    assert (
        value(
            samples,
            "exchange_daemon_info",
            daemon_id="daemon-test-1",
            data_address=daemon.data_address,
        )
        == 1
    )
    assert 12.5 <= value(samples, "exchange_uptime_seconds") < 60
    assert value(samples, "exchange_shutting_down") == 0
    assert value(samples, "exchange_connections") == 0
    await writer.close()


@pytest.mark.asyncio
async def test_remote_read_shows_on_the_data_port_and_sent_never_drops(
    daemon: StandInDaemon,
) -> None:
    pid = ResultPartitionID("remote", 0, 5)
    part = daemon.create_partition(pid, ResultPartitionType.PIPELINED, 1, 1, 16)
    records = [bytes([i]) * 700 for i in range(40)]
    async with ResultPartitionWriter(part, codec=MsgpackCodec(), buffer_timeout=-1) as w:
        await w.emit_all(records)
    written = part.stats()
    assert written.bytes_out == packed_size(records)

    collector = ExchangeCollector(daemon)
    before = scrape(collector)
    assert value(before, "exchange_connections") == 0
    assert value(before, "exchange_bytes_sent_total") == 0

    # Hold the connection open after the read by reading in a task we inspect mid-way.
    connections = ConnectionManager(segment_size=SEGMENT_SIZE)
    gate = SingleInputGate("g")
    channel = RemoteInputChannel(
        gate, 0, pid, 0, daemon.data_address, connections, daemon.network_pool
    )
    gate.set_input_channels([channel])
    try:
        await gate.request_partitions()
        got: list[Any] = []
        reader = RecordReader(gate, MsgpackCodec())
        while (batch := await reader.next_batch()) is not None:
            got.extend(batch)
        assert got == records
        during = scrape(collector)
        port = daemon.data_server.stats()
        assert port["connections"] == 1
        assert value(during, "exchange_connections") == 1
        assert value(during, "exchange_readers") == port["readers"]
        assert value(during, "exchange_connections_accepted_total") == 1
        # Every data byte went out, plus the EndOfPartition event's bytes.
        assert value(during, "exchange_bytes_sent_total") == port["bytes_sent"]
        assert port["bytes_sent"] > written.bytes_out
        assert value(during, "exchange_buffers_sent_total") == port["buffers_sent"]
        assert port["buffers_sent"] == written.buffers_out + 1
    finally:
        gate.close()
        await connections.close()
    for _ in range(20):  # the server side notices the close
        if not daemon.data_server.connections:
            break
        await asyncio.sleep(0.01)
    after = scrape(collector)
    # the data port's own counters are cumulative: a closed connection's traffic stays
    assert daemon.data_server.stats()["bytes_sent"] == port["bytes_sent"]
    assert value(after, "exchange_connections") == 0
    assert value(after, "exchange_bytes_sent_total") == value(during, "exchange_bytes_sent_total")
    assert value(after, "exchange_buffers_sent_total") == value(
        during, "exchange_buffers_sent_total"
    )
    # The consumed pipelined partition was released; its bytes stay in the totals.
    assert value(after, "exchange_partitions", type="pipelined") == 0
    assert value(after, "exchange_partitions_released_total") == 1
    assert value(after, "exchange_bytes_out_total") == written.bytes_out


@pytest.mark.asyncio
async def test_back_pressure_is_counted_in_seconds(daemon: StandInDaemon) -> None:
    pid = ResultPartitionID("slow-consumer", 0, 1)
    part = daemon.create_partition(pid, ResultPartitionType.PIPELINED, 1, 1, 2)
    records = [
        bytes([i]) * 1000 for i in range(40)
    ]  # ten buffers through a pool of two: the writer waits
    writer = ResultPartitionWriter(part, codec=MsgpackCodec(), buffer_timeout=-1)

    async def produce() -> None:
        async with writer:
            await writer.emit_all(records)

    producing = asyncio.create_task(produce())
    await wait_until(lambda: part.buffer_pool.num_in_use == 2, 30, "the writer holding the pool")
    await asyncio.sleep(0.3)  # the consumer holds back: 0.3 s of back pressure, at least
    assert not producing.done()
    samples = scrape(build_registry(daemon))
    assert value(samples, "exchange_out_pool_usage", **plabels(pid)) == 1.0
    got = await read_remote(daemon, pid, 0)
    await producing
    assert got == records
    # Released after it was consumed: the seconds survive in the daemon's totals.
    samples = scrape(build_registry(daemon))
    waited = value(samples, "exchange_back_pressured_seconds_total")
    assert waited == daemon.totals()["back_pressured_seconds"]
    assert 0.25 < waited < 10


@pytest.mark.asyncio
async def test_partition_labels_are_bounded(daemon: StandInDaemon) -> None:
    parts = [
        daemon.create_partition(
            ResultPartitionID("many", i, 0),
            ResultPartitionType.PIPELINED,
            1,
            1,
            1 if i < 200 else 4,
        )
        for i in range(205)
    ]
    # Two of the folded partitions hold unread buffers: backlog and pool usage differ.
    for i, n in ((201, 5), (203, 9)):
        writer = ResultPartitionWriter(parts[i], codec=MsgpackCodec(), buffer_timeout=-1)
        await writer.emit_all([bytes([j % 256]) * 1000 for j in range(n)])
        await writer.flush()
    rest = [p.stats() for p in parts[200:]]
    assert len({s.out_pool_usage for s in rest}) > 1 and sum(s.backlog for s in rest) > 0
    samples = scrape(ExchangeCollector(daemon, max_labelled_partitions=200))
    usage = [k for k in samples if k[0] == "exchange_out_pool_usage"]
    assert len(usage) == 201
    other = {"dataset": OTHER_LABEL, "partition": OTHER_LABEL, "attempt": OTHER_LABEL}
    assert value(samples, "exchange_backlog_buffers", **other) == sum(s.backlog for s in rest)
    assert value(samples, "exchange_partition_bytes_out_total", **other) == sum(
        s.bytes_out for s in rest
    )
    assert value(samples, "exchange_out_pool_usage", **other) == max(s.out_pool_usage for s in rest)
    assert value(samples, "exchange_partitions", type="pipelined") == 205
    assert value(samples, "exchange_out_pool_usage", **plabels(parts[199].partition_id)) == 0

    snap = stats_snapshot(daemon, max_partitions=200)
    assert len(snap["partitions"]["items"]) == 200
    assert snap["partitions"]["count"] == 205
    assert snap["partitions"]["other"]["count"] == 5
    assert snap["partitions"]["other"]["bytes_out"] == sum(s.bytes_out for s in rest)


@pytest.mark.asyncio
async def test_snapshot_fields_match_engine_stats(daemon: StandInDaemon) -> None:
    pid = ResultPartitionID("snap", 2, 9)
    part = daemon.create_partition(pid, ResultPartitionType.BLOCKING, 2, 2, 4)
    records = list(range(5000))
    async with ResultPartitionWriter(part, codec=MsgpackCodec(), buffer_timeout=-1) as w:
        await w.emit_all(records)
    snap = stats_snapshot(daemon, clock=lambda: daemon.started_at + 100.0)
    pool = daemon.network_pool.stats()
    assert snap["daemon_id"] == "daemon-test-1"
    assert snap["version"] == __version__
    assert snap["data_address"] == daemon.data_address
    assert snap["uptime_seconds"] == 100.0
    assert snap["time"] == daemon.started_at + 100.0
    assert snap["shutting_down"] is False
    assert snap["network"] == {
        "total_segments": SEGMENTS,
        "available_segments": pool.available_segments,
        "used_segments": pool.in_use_segments,
        "required_segments": pool.required_segments,
        "overdraft_segments": 0,
        "segment_size": SEGMENT_SIZE,
        "local_pools": pool.num_local_pools,
        "memory_bytes": SEGMENTS * SEGMENT_SIZE,
        "memory_used_bytes": pool.in_use_segments * SEGMENT_SIZE,
        "used_ratio": pool.in_use_segments / SEGMENTS,
    }
    s = part.stats()
    assert snap["partitions"]["items"] == [
        {
            "id": "snap#2@9",
            "dataset": "snap",
            "partition": "2",
            "attempt": "9",
            "type": "blocking",
            "subpartitions": 2,
            "bytes_out": packed_size(records),
            "buffers_out": s.buffers_out,
            "backlog": 0,
            "out_pool_usage": 0.0,
            "back_pressured_seconds": 0.0,
            "finished": True,
            "released": False,
        }
    ]
    assert snap["partitions"]["by_type"] == {"pipelined": 0, "blocking": 1}
    assert snap["partitions"]["other"] is None
    assert snap["totals"]["bytes_out"] == packed_size(records)
    assert snap["local"]["partitions_created"] == 1
    assert snap["data_port"]["connections"] == 0
    assert snap["config"]["segment_size"] == SEGMENT_SIZE
    daemon.shutting_down = True
    assert stats_snapshot(daemon)["shutting_down"] is True


def test_registry_is_private(tmp_path: Path) -> None:
    d = StandInDaemon(tmp_path)
    try:
        build_registry(d)
        assert b"exchange_" not in generate_latest(REGISTRY)
    finally:
        d.network_pool.destroy()


def test_monotonic_counter_keeps_what_closed_connections_sent() -> None:
    c = MonotonicCounter()
    assert c.update(100) == 100
    assert c.update(20) == 100  # a connection with 100 closed, a new one sent 20
    assert c.update(50) == 130
    assert c.update(0) == 130
    assert c.update(10) == 140


def test_sent_counters_prefer_the_daemons_totals() -> None:
    sent = SentCounters()
    assert sent.read({"bytes_sent": 7.0, "buffers_sent": 2.0}, {"bytes_sent": 99}) == (7.0, 2.0)
    assert sent.read({}, {"bytes_sent": 99, "buffers_sent": 3}) == (99.0, 3.0)
