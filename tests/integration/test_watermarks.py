"""Netty's write watermarks on the data port, against a client that stops reading.

The DataServer runs in this process (so its transport can be sampled); the client is a
raw asyncio protocol that completes the handshake, asks for a subpartition with far more
credit than it has memory for, and then pauses reading its socket. Credit no longer
stops the server: only writability does. The server must pause (``pause_writing``), keep
its transport's buffer below the high watermark plus one frame, and so block the producer.
"""

from __future__ import annotations

import asyncio
import gc
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import pytest

from exchange.errors import PartitionReleasedError
from exchange.memory import NetworkBufferPool
from exchange.partition import (
    ResultPartition,
    ResultPartitionID,
    ResultPartitionManager,
    ResultPartitionType,
)
from exchange.protocol.codec import (
    BUFFER_RESPONSE_HEADER_SIZE,
    InPlaceFrameDecoder,
    encode,
    max_frame_size_for,
)
from exchange.protocol.handshake import ClientHandshake
from exchange.protocol.messages import BufferResponse, DataType, ErrorResponse, PartitionRequest
from exchange.serialization.record_codec import BytesCodec
from server.partition_request_server import DataServer, PartitionRequestServerProtocol
from tests.conformance.partition_fill import add_full_buffers, full_buffer_payload
from tests.kit.partition_writer import ResultPartitionWriter

SEG = 32 * 1024
FRAME = SEG + BUFFER_RESPONSE_HEADER_SIZE
HIGH, LOW = 2 * SEG, SEG + 1
RECORD = 4096
TOTAL = 20 * 1024 * 1024
POOL_MAX = 16


class RawClient(asyncio.Protocol):
    """Handshake by hand, then PartitionRequests; counts what arrives."""

    def __init__(self) -> None:
        loop = asyncio.get_running_loop()
        self.decoder = InPlaceFrameDecoder(max_frame_size_for(SEG))
        self.handshake = ClientHandshake(None)
        self.established: asyncio.Future[None] = loop.create_future()
        self.closed: asyncio.Future[None] = loop.create_future()
        self.end_of_partition: asyncio.Future[None] = loop.create_future()
        self.transport: asyncio.Transport | None = None
        self.bytes_received = 0
        self.payload_bytes = 0
        self.sequence: list[int] = []
        self.others: list[Any] = []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport = cast(asyncio.Transport, transport)
        for msg in self.handshake.start():
            transport.writelines(encode(msg))

    def data_received(self, data: bytes) -> None:
        self.bytes_received += len(data)
        for msg in self.decoder.feed(data):
            if not self.handshake.is_established:
                assert self.handshake.receive(msg) == []
                self.established.set_result(None)
            elif isinstance(msg, BufferResponse):
                self.sequence.append(msg.sequence_number)
                if msg.data_type is DataType.DATA_BUFFER:
                    self.payload_bytes += msg.size
                    self.check(msg)
                elif not self.end_of_partition.done():
                    self.end_of_partition.set_result(None)
            else:
                self.others.append(msg)

    def check(self, msg: BufferResponse) -> None:
        """Called with each data buffer (a subclass checks its bytes)."""

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.closed.done():
            self.closed.set_result(None)

    def request(self, pid: ResultPartitionID, credit: int) -> None:
        assert self.transport is not None
        self.transport.writelines(encode(PartitionRequest(pid, 0, 1, credit)))


@pytest.fixture
def server_pool() -> Iterator[NetworkBufferPool]:
    pool = NetworkBufferPool(64, SEG)
    yield pool
    try:
        pool.check_consistency()
        assert pool.is_whole(), pool.stats()
    finally:
        pool.destroy()


async def cleanup(
    server: DataServer,
    manager: ResultPartitionManager,
    producer: asyncio.Task[None],
    client: RawClient | None,
) -> None:
    """Whatever happened: nothing may stay open (a uvloop loop with open handles can hang
    on close)."""
    if client is not None and client.transport is not None:
        client.transport.abort()
        await asyncio.wait_for(client.closed, 5)
    await asyncio.wait_for(server.close(), 5)
    producer.cancel()
    await asyncio.gather(producer, return_exceptions=True)
    manager.release_all()


async def produce(part: ResultPartition, total: int) -> None:
    async with ResultPartitionWriter(part, codec=BytesCodec(), buffer_timeout=-1) as writer:
        record = bytes(RECORD)
        for _ in range(total // RECORD):
            await writer.emit_to(record, 0)


async def stalled_client(
    server: DataServer,
    host: str,
    port: int,
    pid: ResultPartitionID,
    factory: type[RawClient] = RawClient,
) -> tuple[RawClient, PartitionRequestServerProtocol, list[int]]:
    """Connect with a small receive buffer, request with huge credit, stop reading.

    Returns the client, the server's protocol for it, and a list that collects the
    server transport's buffer size right after every BufferResponse written.
    """
    loop = asyncio.get_running_loop()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    await loop.sock_connect(sock, (host, port))
    _, client = await loop.create_connection(factory, sock=sock)
    await asyncio.wait_for(client.established, 5)
    [proto] = server.connections
    transport = proto.transport
    assert transport is not None
    # The server's socket buffer is small too, so the watermark is reached soon.
    transport.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    after_write: list[int] = []
    conn = proto.connection
    assert conn is not None
    send_buffer = conn.send_buffer

    def recording_send_buffer(*args: Any) -> None:
        send_buffer(*args)
        if proto.transport is not None:
            after_write.append(proto.transport.get_write_buffer_size())

    conn.send_buffer = recording_send_buffer  # type: ignore[method-assign]
    client.request(pid, credit=1_000_000)
    assert client.transport is not None
    client.transport.pause_reading()
    return client, proto, after_write


async def wait_until_stalled(
    proto: PartitionRequestServerProtocol, part: ResultPartition, timeout: float = 20
) -> int:
    """Sample the write buffer until the server is paused and the producer blocked (its
    pool full): with a client that does not read, nothing can change that any more.

    Conditions, not a quiet period: a loaded machine can make any period look quiet.
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    max_sampled = 0
    while True:
        transport = proto.transport
        assert transport is not None, "the server dropped the stalled connection"
        max_sampled = max(max_sampled, transport.get_write_buffer_size())
        if not proto.is_writable and part.stats().out_pool_usage == 1.0:
            return max_sampled
        assert loop.time() < deadline, (
            f"no stall: paused {proto.paused_count}, sent {proto.queue.bytes_sent}"
        )
        await asyncio.sleep(0.001 if proto.paused_count == 0 else 0.005)


@pytest.mark.asyncio(loop_factories=["asyncio", "uvloop"])
async def test_stalled_reader_pauses_the_server_and_blocks_the_producer(
    server_pool: NetworkBufferPool, net: Any
) -> None:
    manager = ResultPartitionManager()
    server = DataServer(manager, segment_size=SEG, high_watermark=HIGH, low_watermark=LOW)
    host, port = await server.start("127.0.0.1", 0)
    pid = ResultPartitionID("wm", 0)
    part = ResultPartition(
        pid, ResultPartitionType.PIPELINED, 1, server_pool.create_buffer_pool(1, POOL_MAX)
    )
    manager.register_result_partition(part)
    producer = asyncio.create_task(produce(part, TOTAL))
    client: RawClient | None = None
    try:
        client, proto, after_write = await stalled_client(server, host, port, pid)
        max_sampled = await wait_until_stalled(proto, part)
        assert proto.paused_count > 0
        assert not proto.is_writable
        assert max_sampled <= HIGH + FRAME, max_sampled
        assert after_write and max(after_write) <= HIGH + FRAME, max(after_write)
        assert not producer.done(), "the producer should be blocked by backpressure"
        assert part.stats().out_pool_usage == 1.0
        assert server_pool.num_in_use <= POOL_MAX  # the daemon holds no more than the pool
        assert proto.queue.bytes_sent < TOTAL // 2

        assert client.transport is not None
        client.transport.resume_reading()  # reading again: everything arrives, in order
        await asyncio.wait_for(client.end_of_partition, 30)
        await asyncio.wait_for(producer, 5)
        assert client.payload_bytes == TOTAL + 4 * (TOTAL // RECORD)
        assert client.sequence == list(range(len(client.sequence)))
        assert client.others == []
        assert max(after_write) <= HIGH + FRAME
    finally:
        await cleanup(server, manager, producer, client)
    assert server.connections == set()
    assert len(manager) == 0
    await net.assert_no_other_tasks()


@pytest.mark.asyncio(loop_factories=["asyncio", "uvloop"])
async def test_close_with_a_stalled_client_releases_everything(
    server_pool: NetworkBufferPool, net: Any
) -> None:
    """Shutting the daemon down must not wait for a client that never reads again."""
    manager = ResultPartitionManager()
    server = DataServer(manager, segment_size=SEG, high_watermark=HIGH, low_watermark=LOW)
    host, port = await server.start("127.0.0.1", 0)
    pid = ResultPartitionID("wm", 1)
    part = ResultPartition(
        pid, ResultPartitionType.PIPELINED, 1, server_pool.create_buffer_pool(1, POOL_MAX)
    )
    manager.register_result_partition(part)
    producer = asyncio.create_task(produce(part, TOTAL))
    client: RawClient | None = None
    try:
        client, proto, _ = await stalled_client(server, host, port, pid)
        await wait_until_stalled(proto, part)

        await asyncio.wait_for(server.close(), 5)
        assert server.connections == set()
        assert proto.queue.num_readers == 0
        with pytest.raises(PartitionReleasedError, match="released"):
            await asyncio.wait_for(producer, 5)  # its consumer is gone
        assert len(manager) == 0
        assert server_pool.num_in_use == 0, server_pool.stats()
    finally:
        await cleanup(server, manager, producer, client)
    await net.assert_no_other_tasks()


def _mapped(path: Path) -> bool:
    """Whether this process still maps ``path`` (deleted or not)."""
    with open("/proc/self/maps") as f:
        return any(str(path) in line for line in f)


class _CheckingClient(RawClient):
    """Also checks each data buffer's bytes against what ``add_full_buffers`` wrote."""

    def __init__(self) -> None:
        super().__init__()
        self.bad: list[int] = []

    def check(self, msg: BufferResponse) -> None:
        if bytes(msg.payload) != full_buffer_payload(SEG, msg.sequence_number):
            self.bad.append(msg.sequence_number)


@pytest.mark.asyncio(loop_factories=["asyncio", "uvloop"])
async def test_a_mapped_partition_released_under_a_stalled_reader(
    server_pool: NetworkBufferPool, net: Any, tmp_path: Path
) -> None:
    """``mmap`` storage sends slices of the mapped spill file: the server's transport
    holds some when the partition is released under a consumer that stopped reading. The
    release raises nothing; the bytes already queued arrive intact, then the channel's
    error; the file is deleted once the reader is gone (unlinked, never truncated under
    the mapping: no SIGBUS), and once the connection is gone, so is the mapping, and the
    pool is whole."""
    manager = ResultPartitionManager()
    server = DataServer(manager, segment_size=SEG, high_watermark=HIGH, low_watermark=LOW)
    host, port = await server.start("127.0.0.1", 0)
    pid = ResultPartitionID("mapped", 0)
    part = ResultPartition(
        pid,
        ResultPartitionType.BLOCKING,
        1,
        server_pool.create_buffer_pool(1, POOL_MAX),
        spill_dir=tmp_path,
        bounded_data_kind="mmap",
    )
    manager.register_result_partition(part)
    add_full_buffers(part, 0, 200)  # 6.4 MB: far more than the socket buffers hold
    part.finish()
    (spill_file,) = tmp_path.glob("*.bin")
    assert _mapped(spill_file)
    idle = asyncio.create_task(asyncio.sleep(0))  # no producer: the partition is finished
    client: RawClient | None = None
    try:
        loop = asyncio.get_running_loop()
        client, proto, _ = await stalled_client(server, host, port, pid, _CheckingClient)
        checking = cast(_CheckingClient, client)
        assert proto.transport is not None and checking.transport is not None
        deadline = loop.time() + 30
        while proto.is_writable or proto.transport.get_write_buffer_size() == 0:
            assert loop.time() < deadline, f"no stall: sent {proto.queue.bytes_sent}"
            await asyncio.sleep(0.005)
        queued = proto.transport.get_write_buffer_size()  # slices of the mapping

        assert manager.release_partition(pid)
        assert _mapped(spill_file)  # the transport's queued slices are still its pages
        checking.transport.resume_reading()
        deadline = loop.time() + 30
        while not checking.others:
            assert loop.time() < deadline, f"no error after {len(checking.sequence)} buffers"
            await asyncio.sleep(0.005)
        assert checking.bad == []  # every byte as written, read after the file was deleted
        assert checking.sequence == list(range(len(checking.sequence)))
        assert checking.payload_bytes >= queued - 2 * FRAME  # what was queued arrived
        assert len(checking.sequence) < 200
        (error,) = checking.others
        assert isinstance(error, ErrorResponse) and "released" in error.message
        deadline = loop.time() + 30
        while spill_file.exists():  # deleted once its reader is gone (Flink's rule)
            assert loop.time() < deadline, "the released partition's file was kept"
            await asyncio.sleep(0.005)
    finally:
        await cleanup(server, manager, idle, client)
    assert server.connections == set()
    assert len(manager) == 0
    gc.collect()
    assert not _mapped(spill_file)  # the last slice gone, the mapping with it
    assert list(tmp_path.iterdir()) == []
    await net.assert_no_other_tasks()
