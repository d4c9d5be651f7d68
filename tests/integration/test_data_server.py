"""DataServer limits on real sockets, in this process: handshake timeout, max connections."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import pytest

from client.network import ConnectionManager
from exchange.errors import TransportError
from exchange.partition import ResultPartitionManager
from exchange.protocol.codec import FrameDecoder, encode
from exchange.protocol.messages import ClientHello, ErrorCode, ErrorResponse, Message
from server.partition_request_server import DataServer


async def read_until_closed(reader: asyncio.StreamReader, timeout: float) -> list[Message]:
    decoder = FrameDecoder()
    out: list[Message] = []
    async with asyncio.timeout(timeout):
        while data := await reader.read(65536):
            out.extend(decoder.feed(data))
    return out


@pytest.mark.asyncio(loop_factories=["asyncio", "uvloop"])
@pytest.mark.parametrize("slowloris", [False, True])
async def test_handshake_timeout_closes_silent_and_slow_clients(slowloris: bool, net: Any) -> None:
    manager = ResultPartitionManager()
    server = DataServer(manager, segment_size=32 * 1024, handshake_timeout=0.2)
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
        messages = await read_until_closed(reader, timeout=5)
        assert loop.time() - start < 2
        [err] = messages
        assert isinstance(err, ErrorResponse) and err.is_fatal
        assert err.code is ErrorCode.PROTOCOL_ERROR and "timed out" in err.message
        await asyncio.sleep(0.01)
        assert server.connections == set()
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
