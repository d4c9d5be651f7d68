"""DataServer on real sockets, in this process: handshake timeout, max connections, the
data port's message set, and a reader's error that must fail only its channel."""

from __future__ import annotations

import asyncio
import contextlib
import os
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from client.network import ConnectionManager
from exchange.consumer import RecordReader, SingleInputGate
from exchange.errors import LocalProtocolError, PartitionError, ProtocolError, TransportError
from exchange.memory import NetworkBufferPool
from exchange.partition import (
    ResultPartition,
    ResultPartitionID,
    ResultPartitionManager,
    ResultPartitionType,
)
from exchange.protocol.codec import InPlaceFrameDecoder, encode
from exchange.protocol.handshake import ClientHandshake
from exchange.protocol.local_messages import CreatePartition
from exchange.protocol.messages import (
    ClientHello,
    ErrorCode,
    ErrorResponse,
    Message,
    error_for_response,
)
from exchange.serialization.record_codec import BytesCodec
from server.partition_request_server import DataServer
from tests.kit.partition_writer import ResultPartitionWriter

SEG = 32 * 1024


async def read_until_closed(reader: asyncio.StreamReader, timeout: float) -> list[Message]:
    decoder = InPlaceFrameDecoder()
    out: list[Message] = []
    async with asyncio.timeout(timeout):
        while data := await reader.read(65536):
            out.extend(decoder.feed(data))
    return out


@pytest.mark.asyncio(loop_factories=["asyncio", "uvloop"])
@pytest.mark.parametrize("slowloris", [False, True])
async def test_handshake_timeout_closes_silent_and_slow_clients(slowloris: bool, net: Any) -> None:
    manager = ResultPartitionManager()
    # close_timeout: how long the server waits for the client's EOF after its own
    server = DataServer(manager, segment_size=32 * 1024, handshake_timeout=0.2, close_timeout=60)
    host, port = await server.start("127.0.0.1", 0)
    reader, writer = await asyncio.open_connection(host, port)
    try:
        loop = asyncio.get_running_loop()
        start = loop.time()
        if slowloris:  # a byte of the hello every 50 ms: activity, but no frame in time
            hello = b"".join(encode(ClientHello(1, bytes(16))))
            for b in hello[:3]:
                writer.write(bytes([b]))
                await asyncio.sleep(0.05)
        # The server half-closes and keeps reading: a byte of the hello still on its way
        # when it closes no longer makes the kernel reset the connection (which dropped the
        # error frame with it), so the error always arrives, then EOF.
        messages = await read_until_closed(reader, timeout=15)
        assert loop.time() - start < 10  # the handshake timeout, with room for a loaded machine
        [err] = messages
        assert isinstance(err, ErrorResponse) and err.is_fatal
        assert err.code is ErrorCode.PROTOCOL_ERROR and "timed out" in err.message
        writer.close()  # the server's connection ends at our EOF, not at its close_timeout
        async with asyncio.timeout(30):
            while server.connections:
                await asyncio.sleep(0.01)
        assert loop.time() - start < 30  # at our EOF, not the close_timeout (60 s)
    finally:
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()
        await server.close()
    await net.assert_no_other_tasks()


@pytest.mark.asyncio(loop_factories=["asyncio"])
async def test_connections_over_the_limit_are_refused(net: Any) -> None:
    manager = ResultPartitionManager()
    server = DataServer(manager, segment_size=32 * 1024, max_connections=2)
    host, port = await server.start("127.0.0.1", 0)
    managers = [ConnectionManager(connect_retries=0) for _ in range(3)]
    try:
        for cm in managers[:2]:
            await cm.create_partition_request_client(f"{host}:{port}")
        with pytest.raises(TransportError, match="too many connections"):
            await managers[2].create_partition_request_client(f"{host}:{port}")
        assert len(server.connections) == 2
        assert server.rejected_connections == 1
        # A slot that frees up can be used again.
        await managers[0].close()
        async with asyncio.timeout(5):
            while len(server.connections) > 1:
                await asyncio.sleep(0.005)
        await managers[2].create_partition_request_client(f"{host}:{port}")
        assert len(server.connections) == 2
    finally:
        for cm in managers:
            await cm.close()
        await server.close()
    assert server.connections == set()
    await net.assert_no_other_tasks()


async def raw_handshake(host: str, port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    reader, writer = await asyncio.open_connection(host, port)
    hs = ClientHandshake(None)
    for m in hs.start():
        writer.write(b"".join(encode(m)))
    decoder = InPlaceFrameDecoder()
    async with asyncio.timeout(5):
        while not hs.is_established:
            data = await reader.read(65536)
            assert data, "closed during the handshake"
            for m in decoder.feed(data):
                assert hs.receive(m) == []
    return reader, writer


@pytest.mark.asyncio(loop_factories=["asyncio"])
async def test_the_data_port_refuses_local_endpoint_messages(net: Any) -> None:
    """Each role decodes only its own messages: a producer's CreatePartition sent to the
    data port is a protocol error, and nothing is created."""
    manager = ResultPartitionManager()
    server = DataServer(manager, segment_size=SEG)
    host, port = await server.start("127.0.0.1", 0)
    reader, writer = await raw_handshake(host, port)
    try:
        create = CreatePartition(ResultPartitionID("sneaky", 0), False, 1)
        writer.write(b"".join(encode(create)))
        [err] = await read_until_closed(reader, timeout=5)
        assert isinstance(err, ErrorResponse) and err.is_fatal
        assert err.code is ErrorCode.PROTOCOL_ERROR and "CreatePartition" in err.message
        assert len(manager) == 0
        # on the side that sent it, the answer says *we* broke the protocol: not the
        # ProtocolError the tree keeps for a misbehaving peer
        answer = error_for_response(err, f"{host}:{port}")
        assert isinstance(answer, LocalProtocolError) and not isinstance(answer, ProtocolError)
        assert answer.code == "PROTOCOL_ERROR" and "CreatePartition" in str(answer)
    finally:
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()
        await server.close()
    await net.assert_no_other_tasks()


@pytest.mark.asyncio(loop_factories=["asyncio", "uvloop"])
async def test_a_truncated_spill_file_fails_its_channel_only(
    tmp_path: Path, client_pool: Callable[..., NetworkBufferPool], net: Any
) -> None:
    """Defect 3 over loopback TCP: the reader of a blocking subpartition whose spill file
    was cut fails with a typed per-channel error; the other channel on the same connection
    reads to its end (before the fix the error was lost in an event-loop callback and
    both channels stalled)."""
    records, size = 40, 4096
    server_pool = NetworkBufferPool(16, SEG)
    manager = ResultPartitionManager()
    server = DataServer(manager, segment_size=SEG)
    cm = ConnectionManager(segment_size=SEG)
    try:
        pid = ResultPartitionID("cut", 0)
        part = ResultPartition(
            pid,
            ResultPartitionType.BLOCKING,
            2,
            server_pool.create_buffer_pool(2, 4),
            spill_dir=tmp_path,
        )
        manager.register_result_partition(part)
        async with ResultPartitionWriter(part, codec=BytesCodec(), buffer_timeout=-1) as writer:
            for i in range(records):
                for sub in (0, 1):
                    await writer.emit_to(struct.pack(">I", i) + bytes(size - 4), sub)
        path = part.subpartitions[0].data.path  # type: ignore[union-attr]
        os.truncate(path, os.path.getsize(path) // 2)  # mid-file: after the first buffers
        host, port = await server.start("127.0.0.1", 0)
        nbp = client_pool(32, SEG)
        broken = net.make_gate(f"{host}:{port}", [pid], 0, cm, nbp, name="broken")
        intact = net.make_gate(f"{host}:{port}", [pid], 1, cm, nbp, name="intact")

        async def read(gate: SingleInputGate) -> list[int]:
            reader = RecordReader(gate, BytesCodec())
            out: list[int] = []
            try:
                await gate.request_partitions()
                while (batch := await reader.next_batch()) is not None:
                    out.extend(struct.unpack_from(">I", r)[0] for r in batch)
            finally:
                reader.close()
            return out

        async with asyncio.timeout(20):
            results = await asyncio.gather(read(broken), read(intact), return_exceptions=True)
        error, good = results
        assert isinstance(error, PartitionError), error
        assert "truncated" in str(error)
        assert good == list(range(records))
        assert len(cm.connections) == 1  # the connection survived the channel's error
        [proto] = server.connections
        assert proto.queue.num_readers == 0
    finally:
        await cm.close()
        await server.close()
        manager.release_all()
    assert server.connections == set()
    server_pool.check_consistency()
    assert server_pool.is_whole(), server_pool.stats()
    server_pool.destroy()
    await net.assert_no_other_tasks()


@pytest.mark.asyncio(loop_factories=["asyncio", "uvloop"])
async def test_out_of_descriptors_at_accept_is_logged_and_survived(
    net: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """EMFILE at accept went unlogged and broke the daemon's other work: it is logged,
    accepting pauses for a second, and the connections waiting are served afterwards."""
    import resource
    import socket

    manager = ResultPartitionManager()
    server = DataServer(manager, segment_size=SEG)
    host, port = await server.start("127.0.0.1", 0)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    clients: list[socket.socket] = []
    caplog.set_level("ERROR", logger="exchange.server.data")
    resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + 8, hard))
    try:
        while True:  # the clients take the last descriptors; the server's accept finds none
            try:
                s = socket.socket()
            except OSError:
                break
            s.setblocking(False)
            with contextlib.suppress(BlockingIOError):
                s.connect((host, port))
            clients.append(s)
            await asyncio.sleep(0.01)
        async with asyncio.timeout(10):
            while "cannot accept" not in caplog.text:
                await asyncio.sleep(0.01)
        assert "Too many open files" in caplog.text and "max_connections" in caplog.text
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    try:
        async with asyncio.timeout(10):  # accepting resumes: every client gets in
            while server.total_connections < len(clients):
                await asyncio.sleep(0.02)
    finally:
        for s in clients:
            s.close()
        await server.close()
    assert server.num_connections == 0 and server.unauthenticated == {}
    await net.assert_no_other_tasks()
