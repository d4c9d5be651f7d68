"""server.http_server: the HTTP port on a real socket, over a daemon of real engine objects.

The daemon is a stand-in for ``server.daemon.Daemon`` (same attributes) built from a real
NetworkBufferPool, ResultPartitionManager, RecordWriter-filled partitions and a DataServer on
port 0. Clients speak raw HTTP over asyncio streams so hostile requests can be sent as is.
The dashboard is also rendered by a headless Chromium when one is installed.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import shutil
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import msgpack
import pytest
import pytest_asyncio
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from client.network import ConnectionManager
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
from server.http_server import (
    DEFAULT_MAX_HEAD_BYTES,
    HttpRequestError,
    HttpServer,
    Request,
    parse_request_head,
)
from server.metrics import TaskReport
from server.partition_request_server import DataServer
from tests.kit.partition_writer import ResultPartitionWriter
from tests.kit.polling import wait_until

SEGMENTS = 256
SEGMENT_SIZE = 4096
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
#: Set to a path (e.g. docs/dashboard.png) to keep the browser test's screenshot there.
SCREENSHOT_ENV = "EXCHANGE_DASHBOARD_SCREENSHOT"


# -- a stand-in daemon of real engine objects -------------------------------------------------


class StandInDaemon:
    """The DaemonView protocol over real engine objects, as server.daemon.Daemon has it."""

    def __init__(self, spill_dir: Path) -> None:
        self.daemon_id = "daemon-http-1"
        self.started_at = time.time() - 3725.0
        self.config = DaemonConfig(
            network_memory=SEGMENTS * SEGMENT_SIZE, segment_size=SEGMENT_SIZE
        )
        self.network_pool = NetworkBufferPool(SEGMENTS, SEGMENT_SIZE)
        self.manager = ResultPartitionManager()
        self.data_server = DataServer(self.manager, segment_size=SEGMENT_SIZE)
        self.data_address = "?"
        self.spill_dir = spill_dir
        self.shutting_down = False
        self.created = 0
        self.retired = {"bytes_out": 0.0, "buffers_out": 0.0, "back_pressured_seconds": 0.0}
        self.released = 0
        #: (task, gate, metrics) the consumer tasks "reported" (TaskMetrics)
        self.reports: list[tuple[str, str, dict[str, float]]] = list(TASK_REPORTS)

    def create_partition(
        self, pid: ResultPartitionID, ptype: ResultPartitionType, n: int, maximum: int
    ) -> ResultPartition:
        pool = self.network_pool.create_buffer_pool(n, maximum)
        try:
            part = ResultPartition(pid, ptype, n, pool, spill_dir=self.spill_dir)
        except BaseException:
            pool.destroy()
            raise
        self.manager.register_result_partition(part)

        def on_release(p: ResultPartition) -> None:
            s = p.stats()
            self.retired["bytes_out"] += s.bytes_out
            self.retired["buffers_out"] += s.buffers_out
            self.retired["back_pressured_seconds"] += s.back_pressured_seconds
            self.released += 1

        part.add_release_listener(on_release)
        self.created += 1
        return part

    def local_endpoint_stats(self) -> dict[str, int]:
        return {
            "producers": 2,
            "consumers": 1,
            "bytes_received": 0,
            "buffers_received": 0,
            "partitions_created": self.created,
            "producer_failures": 0,
        }

    def task_reports(self) -> list[TaskReport]:
        return [TaskReport(t, g, m, time.time() - 0.25) for t, g, m in self.reports]

    def totals(self) -> dict[str, float]:
        live = [p.stats() for p in self.manager.partitions]
        return {
            "bytes_in": self.retired["bytes_out"] + sum(s.bytes_out for s in live),
            "bytes_out": self.retired["bytes_out"] + sum(s.bytes_out for s in live),
            "buffers_out": self.retired["buffers_out"] + sum(s.buffers_out for s in live),
            "partitions_created": self.created,
            "partitions_released": self.released,
            "partitions_failed": 0,
            "back_pressured_seconds": self.retired["back_pressured_seconds"]
            + sum(s.back_pressured_seconds for s in live),
        }


#: A debloating, checkpointing consumer task and one that only checkpoints.
TASK_REPORTS: list[tuple[str, str, dict[str, float]]] = [
    (
        "clicks-sessionized/3",
        "reader",
        {
            "buffer_size": 4096,
            "throughput": 2_500_000,
            "buffers_in_use": 12,
            "estimated_time_to_consume": 0.0197,
            "num_triggered": 41,
            "num_aborted": 2,
            "last_alignment_duration": 0.0125,
            "last_aligned_bytes": 81920,
        },
    ),
    (
        "orders/0",
        "reader",
        {"num_triggered": 7, "num_aborted": 0, "last_alignment_duration": 1.5},
    ),
]

BLOCKING_ID = ResultPartitionID("orders-by-customer", 4, 17)
BLOCKING_RECORDS = [{"order": i, "note": "n" * 50} for i in range(2000)]
PIPELINED_ID = ResultPartitionID("clicks-sessionized", 1, 23)


@pytest_asyncio.fixture
async def daemon(tmp_path: Path) -> AsyncIterator[StandInDaemon]:
    """A stand-in daemon with a finished blocking partition and a pipelined one with backlog."""
    d = StandInDaemon(tmp_path)
    host, port = await d.data_server.start("127.0.0.1", 0)
    d.data_address = f"{host}:{port}"
    writer: ResultPartitionWriter | None = None
    try:
        block = d.create_partition(BLOCKING_ID, ResultPartitionType.BLOCKING, 2, 4)
        async with ResultPartitionWriter(block, codec=MsgpackCodec(), buffer_timeout=-1) as w:
            await w.emit_all(BLOCKING_RECORDS)
        pipe = d.create_partition(PIPELINED_ID, ResultPartitionType.PIPELINED, 2, 12)
        writer = ResultPartitionWriter(pipe, codec=MsgpackCodec(), buffer_timeout=-1)
        await writer.emit_all([b"c" * 900] * 30)
        await writer.flush()
        yield d
    finally:
        if writer is not None and not writer.partition.is_released:
            await writer.close()
        await d.data_server.close()
        d.manager.release_all()
        d.network_pool.check_consistency()
        assert d.network_pool.is_whole(), d.network_pool.stats()
        d.network_pool.destroy()


@pytest_asyncio.fixture
async def http(daemon: StandInDaemon) -> AsyncIterator[tuple[HttpServer, int]]:
    server = HttpServer(daemon, read_timeout=0.5)
    _, port = await server.start("127.0.0.1", 0)
    try:
        yield server, port
    finally:
        await server.close()


class Reply:
    def __init__(self, raw: bytes) -> None:
        head, _, self.body = raw.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        version, status, _ = lines[0].split(" ", 2)
        assert version == "HTTP/1.1"
        self.status = int(status)
        self.headers = {}
        for line in lines[1:]:
            name, _, val = line.partition(":")
            self.headers[name.strip().lower()] = val.strip()
        assert int(self.headers["content-length"]) == len(self.body)
        assert self.headers["connection"] == "close"

    def json(self) -> Any:
        assert self.headers["content-type"] == "application/json"
        return json.loads(self.body)


async def request(port: int, raw: bytes) -> Reply:
    """Send ``raw`` and read the reply up to the server's close."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(raw)
        await writer.drain()
        data = await asyncio.wait_for(reader.read(), 5)
    finally:
        writer.close()
        await writer.wait_closed()
    return Reply(data)


async def get(port: int, path: str) -> Reply:
    return await request(port, f"GET {path} HTTP/1.1\r\nHost: localhost\r\n\r\n".encode())


def metric_samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def labels(pid: ResultPartitionID) -> tuple[tuple[str, str], ...]:
    return tuple(
        sorted(
            {
                "dataset": pid.dataset_id,
                "partition": str(pid.partition_index),
                "attempt": str(pid.attempt_id),
            }.items()
        )
    )


# -- routes -------------------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_metrics_are_prometheus_text_with_the_engines_numbers(
    http: tuple[HttpServer, int], daemon: StandInDaemon
) -> None:
    _, port = http
    reply = await get(port, "/metrics")
    assert reply.status == 200
    assert reply.headers["content-type"].startswith("text/plain; version=0.0.4")
    samples = metric_samples(reply.body.decode())
    pool = daemon.network_pool.stats()
    block = daemon.manager.get_partition(BLOCKING_ID).stats()
    pipe = daemon.manager.get_partition(PIPELINED_ID).stats()
    assert samples[("exchange_network_segments_total", ())] == SEGMENTS
    assert samples[("exchange_network_segments_used", ())] == pool.in_use_segments > 0
    assert samples[("exchange_network_segments_available", ())] == pool.available_segments
    packed = sum(len(msgpack.packb(r)) for r in BLOCKING_RECORDS)
    assert block.bytes_out == packed
    assert samples[("exchange_partition_bytes_out_total", labels(BLOCKING_ID))] == packed
    assert samples[("exchange_backlog_buffers", labels(PIPELINED_ID))] == pipe.backlog > 0
    assert samples[("exchange_out_pool_usage", labels(PIPELINED_ID))] == pipe.out_pool_usage
    assert samples[("exchange_bytes_out_total", ())] == block.bytes_out + pipe.bytes_out
    assert samples[("exchange_partitions", (("type", "blocking"),))] == 1
    assert samples[("exchange_producers", ())] == 2
    # what consumer tasks reported, labelled task and gate; only the figures they have
    busy = (("gate", "reader"), ("task", "clicks-sessionized/3"))
    quiet = (("gate", "reader"), ("task", "orders/0"))
    assert samples[("exchange_task_gates_reporting", ())] == 2
    assert samples[("exchange_gate_buffer_size_bytes", busy)] == 4096
    assert samples[("exchange_gate_throughput_bytes_per_second", busy)] == 2_500_000
    assert samples[("exchange_gate_buffers_in_use", busy)] == 12
    assert samples[("exchange_gate_estimated_time_to_consume_seconds", busy)] == 0.0197
    assert samples[("exchange_checkpoint_alignment_seconds", busy)] == 0.0125
    assert samples[("exchange_checkpoint_aligned_bytes", busy)] == 81920
    assert samples[("exchange_checkpoints_triggered_total", busy)] == 41
    assert samples[("exchange_checkpoints_aborted_total", busy)] == 2
    assert samples[("exchange_checkpoints_triggered_total", quiet)] == 7
    assert samples[("exchange_checkpoint_alignment_seconds", quiet)] == 1.5
    assert ("exchange_gate_buffer_size_bytes", quiet) not in samples
    assert ("exchange_checkpoint_aligned_bytes", quiet) not in samples
    # the query string does not matter
    assert (await get(port, "/metrics?name[]=x")).status == 200


@pytest.mark.asyncio
async def test_healthz_is_ok_until_shutdown(
    http: tuple[HttpServer, int], daemon: StandInDaemon
) -> None:
    _, port = http
    reply = await get(port, "/healthz")
    assert (reply.status, reply.json()) == (200, {"status": "ok"})
    daemon.shutting_down = True
    reply = await get(port, "/healthz")
    assert (reply.status, reply.json()) == (503, {"status": "shutting_down"})


@pytest.mark.asyncio
async def test_api_stats_is_the_snapshot(
    http: tuple[HttpServer, int], daemon: StandInDaemon
) -> None:
    _, port = http
    reply = await get(port, "/api/stats")
    assert reply.status == 200
    assert reply.headers["cache-control"] == "no-store"
    stats = reply.json()
    pool = daemon.network_pool.stats()
    assert stats["daemon_id"] == "daemon-http-1"
    assert stats["data_address"] == daemon.data_address
    assert 3725 <= stats["uptime_seconds"] < 3800
    assert stats["network"]["total_segments"] == SEGMENTS
    assert stats["network"]["used_segments"] == pool.in_use_segments
    assert stats["network"]["available_segments"] == pool.available_segments
    assert stats["local"]["producers"] == 2
    assert stats["data_port"]["connections"] == 0
    assert stats["partitions"]["count"] == 2
    items = {item["id"]: item for item in stats["partitions"]["items"]}
    block = daemon.manager.get_partition(BLOCKING_ID).stats()
    pipe = daemon.manager.get_partition(PIPELINED_ID).stats()
    assert items[str(BLOCKING_ID)]["bytes_out"] == block.bytes_out
    assert items[str(BLOCKING_ID)]["finished"] is True
    assert items[str(PIPELINED_ID)]["backlog"] == pipe.backlog
    assert items[str(PIPELINED_ID)]["out_pool_usage"] == pipe.out_pool_usage
    assert items[str(PIPELINED_ID)]["subpartitions"] == 2
    assert stats["totals"]["bytes_out"] == block.bytes_out + pipe.bytes_out
    tasks = stats["tasks"]
    assert tasks["count"] == 2
    assert [(t["id"], t["task"], t["gate"], t["metrics"]) for t in tasks["items"]] == [
        (f"{t}/{g}", t, g, m) for t, g, m in TASK_REPORTS
    ]
    assert all(0.2 <= t["age_seconds"] < 5 for t in tasks["items"])


@pytest.mark.asyncio
async def test_dashboard_page(http: tuple[HttpServer, int]) -> None:
    _, port = http
    for path in ("/", "/index.html"):
        reply = await get(port, path)
        assert reply.status == 200
        assert reply.headers["content-type"] == "text/html; charset=utf-8"
        assert "connect-src 'self'" in reply.headers["content-security-policy"]
        page = reply.body.decode()
        assert 'id="seg-total"' in page and "api/stats" in page
        # self-contained: nothing is loaded from elsewhere
        assert "http://" not in page.replace("http://www.w3.org/2000/svg", "")
        assert "https://" not in page and "<script src" not in page


@pytest.mark.asyncio
async def test_unknown_path_and_other_methods(http: tuple[HttpServer, int]) -> None:
    _, port = http
    assert (await get(port, "/nope")).status == 404
    assert (await get(port, "/metrics/")).status == 404
    for method in ("POST", "PUT", "DELETE", "HEAD", "OPTIONS"):
        reply = await request(port, f"{method} /metrics HTTP/1.1\r\nHost: x\r\n\r\n".encode())
        assert reply.status == 405, method
        assert reply.headers["allow"] == "GET"
    reply = await request(port, b"GET /healthz HTTP/1.0\r\n\r\n")
    assert reply.status == 200


# -- limits and hostile clients -----------------------------------------------------------------


@pytest.mark.asyncio
async def test_oversized_request_line_gets_431_and_the_server_keeps_serving(
    http: tuple[HttpServer, int],
) -> None:
    server, port = http
    long_line = b"GET /" + b"a" * (2 * DEFAULT_MAX_HEAD_BYTES) + b" HTTP/1.1\r\n\r\n"
    reply = await request(port, long_line)
    assert reply.status == 431
    headers = b"".join(b"X-Filler-%d: %s\r\n" % (i, b"v" * 200) for i in range(60))
    reply = await request(port, b"GET /healthz HTTP/1.1\r\n" + headers + b"\r\n")
    assert reply.status == 431
    many = b"".join(b"X-%d: 1\r\n" % i for i in range(150))
    reply = await request(port, b"GET /healthz HTTP/1.1\r\n" + many + b"\r\n")
    assert reply.status == 431
    assert (await get(port, "/healthz")).status == 200
    assert server.num_connections == 0


@pytest.mark.parametrize(
    ("raw", "status"),
    [
        (b"GARBAGE\r\n\r\n", 400),
        (b"GET  /healthz HTTP/1.1\r\n\r\n", 400),
        (b"GET healthz HTTP/1.1\r\n\r\n", 400),
        (b"GET http://x/healthz HTTP/1.1\r\n\r\n", 400),
        (b"GET /healthz HTTP/1.1\r\nNo colon here\r\n\r\n", 400),
        (b"GET /healthz HTTP/1.1\r\nHost : x\r\n\r\n", 400),
        (b"GET /healthz HTTP/1.1\r\nHost: x\r\n folded\r\n\r\n", 400),
        (b"GET /h\xe9 HTTP/1.1\r\n\r\n", 400),
        (b"G(T /healthz HTTP/1.1\r\n\r\n", 400),
        (b"GET /healthz HTTP/2.0\r\n\r\n", 505),
        (b"GET /healthz HTTPS/1.1\r\n\r\n", 400),
    ],
)
@pytest.mark.asyncio
async def test_malformed_requests(http: tuple[HttpServer, int], raw: bytes, status: int) -> None:
    _, port = http
    assert (await request(port, raw)).status == status


@pytest.mark.asyncio
async def test_slowloris_client_is_closed_after_the_read_timeout(
    http: tuple[HttpServer, int],
) -> None:
    server, port = http  # read_timeout=0.5
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    loop = asyncio.get_running_loop()
    start = loop.time()

    async def dribble() -> None:
        writer.write(b"GET /healthz HTTP/1.1\r\n")
        for i in range(400):  # 20 s of activity: far past the read timeout
            await asyncio.sleep(0.05)
            if writer.is_closing() or reader.at_eof():
                return
            try:
                writer.write(b"X-Slow-%d: 1\r\n" % i)
                await writer.drain()
            except ConnectionError:
                return

    dribbling = asyncio.create_task(dribble())
    try:
        # Others are served meanwhile.
        assert (await get(port, "/healthz")).status == 200
        data = await asyncio.wait_for(reader.read(), 15)
        elapsed = loop.time() - start
    finally:
        dribbling.cancel()
        await asyncio.gather(dribbling, return_exceptions=True)
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()
    assert Reply(data).status == 408
    # after the read timeout, long before the dribble ends (a timeout reset by each byte
    # would answer only then); room for a loaded machine
    assert 0.45 <= elapsed < 10
    for _ in range(50):
        if server.num_connections == 0:
            break
        await asyncio.sleep(0.01)
    assert server.num_connections == 0


@pytest.mark.asyncio
async def test_silent_client_gets_408(http: tuple[HttpServer, int]) -> None:
    _, port = http
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        data = await asyncio.wait_for(reader.read(), 3)
    finally:
        writer.close()
        await writer.wait_closed()
    assert Reply(data).status == 408


@pytest.mark.asyncio
async def test_client_hanging_up_midway_costs_nothing(http: tuple[HttpServer, int]) -> None:
    server, port = http
    for partial in (b"", b"GET /heal", b"GET /healthz HTTP/1.1\r\nHost: x\r\n"):
        _, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(partial)
        await writer.drain()
        writer.close()
        await writer.wait_closed()
    for _ in range(50):
        if server.num_connections == 0:
            break
        await asyncio.sleep(0.01)
    assert server.num_connections == 0
    assert (await get(port, "/healthz")).status == 200


async def _wait_connections(server: HttpServer, n: int) -> None:
    for _ in range(500):
        if server.num_connections == n:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"{server.num_connections} connections, expected {n}")


@pytest.mark.asyncio
async def test_connection_limit_still_answers_healthz(daemon: StandInDaemon) -> None:
    # idle clients on other addresses hold every slot: /healthz is answered, the rest 503
    server = HttpServer(daemon, read_timeout=2.0, max_connections=2)
    _, port = await server.start("127.0.0.1", 0)
    idle = [
        await asyncio.open_connection("127.0.0.1", port, local_addr=(f"127.0.0.{2 + i}", 0))
        for i in range(2)
    ]
    try:
        await _wait_connections(server, 2)
        assert (await get(port, "/healthz")).status == 200
        assert (await get(port, "/api/stats")).status == 503
    finally:
        for _, w in idle:
            w.close()
            await w.wait_closed()
        await server.close()


@pytest.mark.asyncio
async def test_connections_per_peer_are_capped(daemon: StandInDaemon) -> None:
    server = HttpServer(daemon, read_timeout=5.0, max_connections_per_peer=3)
    _, port = await server.start("127.0.0.1", 0)
    idle = [
        await asyncio.open_connection("127.0.0.1", port, local_addr=("127.0.0.2", 0))
        for _ in range(3)
    ]
    try:
        await _wait_connections(server, 3)
        reader, writer = await asyncio.open_connection(
            "127.0.0.1", port, local_addr=("127.0.0.2", 0)
        )
        with contextlib.suppress(ConnectionError):  # closed unanswered
            assert await asyncio.wait_for(reader.read(), 5) == b""
        writer.close()
        assert server.refused_connections == 1
        assert (await get(port, "/api/stats")).status == 200  # another address is served
    finally:
        for _, w in idle:
            w.close()
            await w.wait_closed()
        await server.close()
    assert server.num_connections == 0 and server._per_peer == {}


@pytest.mark.asyncio
async def test_close_drops_open_connections(daemon: StandInDaemon) -> None:
    server = HttpServer(daemon, read_timeout=60.0)
    _, port = await server.start("127.0.0.1", 0)
    clients = [await asyncio.open_connection("127.0.0.1", port) for _ in range(3)]
    for _ in range(50):
        if server.num_connections == 3:
            break
        await asyncio.sleep(0.01)
    assert server.num_connections == 3
    loop = asyncio.get_running_loop()
    start = loop.time()
    await server.close()
    assert loop.time() - start < 20  # never waits for the clients' read timeout (60 s)
    assert server.num_connections == 0
    for reader, writer in clients:
        with contextlib.suppress(ConnectionError):
            assert await asyncio.wait_for(reader.read(), 10) == b""
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()
    with pytest.raises(OSError):
        await asyncio.open_connection("127.0.0.1", port)


# -- the parser, without sockets -------------------------------------------------------------------


def test_parse_request_head() -> None:
    req = parse_request_head(b"GET /api/stats?x=1 HTTP/1.1\r\nHost: h\r\nX-A:  b \r\n\r\n")
    assert req == Request(
        "GET", "/api/stats?x=1", "/api/stats", "x=1", "HTTP/1.1", (("host", "h"), ("x-a", "b"))
    )
    assert req.header("HOST") == "h"
    assert req.header("missing") is None
    with pytest.raises(HttpRequestError) as err:
        parse_request_head(b"GET / HTTP/1.1\r\n\r\n", max_head_bytes=10)
    assert err.value.status == 431
    with pytest.raises(HttpRequestError) as err:
        parse_request_head(b"GET / HTTP/1.1\r\n")
    assert err.value.status == 400


@given(st.binary(max_size=400))
def test_any_bytes_parse_or_raise_http_request_error(data: bytes) -> None:
    for head in (data, data + b"\r\n\r\n", b"GET / HTTP/1.1\r\n" + data + b"\r\n\r\n"):
        try:
            req = parse_request_head(head)
        except HttpRequestError as e:
            assert e.status in (400, 431, 505)
        else:
            assert req.path.startswith("/")


# -- the dashboard in a real browser -----------------------------------------------------------


async def read_remote(d: StandInDaemon, pid: ResultPartitionID) -> int:
    connections = ConnectionManager(segment_size=SEGMENT_SIZE)
    gate = SingleInputGate("dashboard-consumer")
    channel = RemoteInputChannel(gate, 0, pid, 0, d.data_address, connections, d.network_pool)
    gate.set_input_channels([channel])
    n = 0
    try:
        await gate.request_partitions()
        reader = RecordReader(gate, MsgpackCodec())
        while (batch := await reader.next_batch()) is not None:
            n += len(batch)
    finally:
        gate.close()
        await connections.close()
    return n


async def traffic(d: StandInDaemon, stop: asyncio.Event) -> None:
    """Producers and remote consumers streaming pipelined partitions until ``stop``."""
    i = 0
    while not stop.is_set():
        pid = ResultPartitionID("live-stream", 0, i)
        part = d.create_partition(pid, ResultPartitionType.PIPELINED, 1, 8)
        size = 200 + 150 * (i % 7)

        async def produce(part: ResultPartition = part, size: int = size) -> None:
            async with ResultPartitionWriter(part, codec=MsgpackCodec(), buffer_timeout=-1) as w:
                await w.emit_all([b"s" * size] * 2000)

        await asyncio.gather(produce(), read_remote(d, pid))
        i += 1
        await asyncio.sleep(0.02 * (i % 5))


async def run_chromium(*args: str, timeout: float = 60) -> bytes:
    proc = await asyncio.create_subprocess_exec(
        CHROMIUM or "chromium",
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.DEVNULL,
    )
    try:
        out, _ = await asyncio.wait_for(proc.communicate(), timeout)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        raise
    assert proc.returncode == 0, proc.returncode
    return out


@pytest.mark.slow
@pytest.mark.skipif(CHROMIUM is None, reason="no chromium (apt-get install -y chromium)")
@pytest.mark.asyncio
async def test_dashboard_renders_live_values_in_chromium(
    http: tuple[HttpServer, int], daemon: StandInDaemon, tmp_path: Path
) -> None:
    server, port = http
    server.read_timeout = 5.0
    url = f"http://127.0.0.1:{port}/"
    common = [
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--hide-scrollbars",
    ]
    stop = asyncio.Event()
    streaming = asyncio.create_task(traffic(daemon, stop))
    try:
        # the page must find figures: at least one stream moved through the daemon
        await wait_until(lambda: daemon.totals()["bytes_out"] > 0, 30, "traffic")
        dom = (
            await run_chromium(
                *common,
                f"--user-data-dir={tmp_path / 'profile-dom'}",
                "--virtual-time-budget=5000",
                "--dump-dom",
                url,
            )
        ).decode()
        shot = tmp_path / "dashboard.png"
        await run_chromium(
            *common,
            f"--user-data-dir={tmp_path / 'profile-shot'}",
            "--virtual-time-budget=30000",
            "--window-size=1280,720",
            f"--screenshot={shot}",
            url,
        )
    finally:
        stop.set()
        await streaming
    # The script filled the page from /api/stats.
    assert f'<span id="seg-total">{SEGMENTS}</span>' in dom
    assert '<b id="daemon-id">daemon-http-1</b>' in dom
    assert f'<b id="data-address">{daemon.data_address}</b>' in dom
    assert f'<tr data-id="{BLOCKING_ID}">' in dom
    assert f'<tr data-id="{PIPELINED_ID}">' in dom
    assert '<span id="status" class="pill live">live</span>' in dom
    assert '<dd id="producers">2</dd>' in dom
    # which path the producers' and the local consumers' bytes took (the daemon's
    # choice), all filled in
    for path in ("bytes-shm", "bytes-socket", "read-shm", "read-socket"):
        assert re.search(rf'<span id="{path}">\d[\d.]* (B|KiB|MiB|GiB)</span>', dom), path
    for gauge in ("read-held", "read-pinned"):  # segments local consumers hold / pinned
        assert re.search(rf'<span id="{gauge}">\d+</span>', dom), gauge
    assert "<polyline" in dom  # the throughput chart has at least two samples
    # The consumer tasks' table: every figure of the busy task, dashes for what the
    # checkpoint-only task does not have.
    busy = dom.split('<tr data-id="clicks-sessionized/3/reader">', 1)[1].split("</tr>", 1)[0]
    cells = [c.split(">", 1)[1] for c in busy.split("</td>")[:-1]]
    assert cells[:10] == [
        "clicks-sessionized/3",
        "reader",
        "4.00 KiB",
        "2.38 MiB/s",
        "12",
        "19.7 ms",
        "12.5 ms",
        "80.0 KiB",
        "41",
        "2",
    ], cells
    assert cells[10].endswith(" ago"), cells
    quiet = dom.split('<tr data-id="orders/0/reader">', 1)[1].split("</tr>", 1)[0]
    quiet_cells = [c.split(">", 1)[1] for c in quiet.split("</td>")[:-1]]
    dash = "\u2013"  # the page's "no figure"
    assert quiet_cells[2:10] == [dash] * 4 + ["1.50 s", dash, "7", "0"], quiet_cells
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    keep = os.environ.get(SCREENSHOT_ENV)
    if keep:
        shutil.copyfile(shot, keep)
