"""Hostile bytes over live sockets against a daemon process.

Every bad connection must end with the daemon closing it (after a fatal ErrorResponse
where the protocol calls for one), and must harm nothing else: a well-behaved client
streams data from the same daemon the whole time and must get every record, and the
daemon's pool must be whole at the end. The decoder's own fuzzing (hypothesis) lives in
``tests/protocol``; here sequences of real and mutated frames go over real sockets.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import struct
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import pytest

from client.network import ConnectionManager
from exchange.consumer import RecordReader, SingleInputGate
from exchange.consumer.remote_input_channel import RemoteInputChannel
from exchange.errors import AuthenticationError, ProtocolError
from exchange.memory import NetworkBufferPool
from exchange.partition import ResultPartitionID
from exchange.protocol.codec import MAGIC, InPlaceFrameDecoder, encode, max_frame_size_for
from exchange.protocol.handshake import ClientHandshake
from exchange.protocol.messages import (
    AddCredit,
    AuthResponse,
    BufferResponse,
    CancelPartitionRequest,
    ClientHello,
    CloseRequest,
    DataType,
    ErrorCode,
    ErrorResponse,
    Message,
    NewBufferSize,
    PartitionRequest,
    ResumeConsumption,
    ServerHello,
)

SEG = 32 * 1024
SECRET = "s3cret"
GOOD = "good-stream"
Spawn = Callable[..., Awaitable[Any]]
PoolFactory = Callable[..., NetworkBufferPool]
# A long, throttled stream that outlives the bad connections.
GOOD_STREAM = {
    "dataset": GOOD,
    "records": 30_000,
    "payload": 100,
    "sleep_every": 300,
    "sleep": 0.01,
    "buffer_timeout": 0.01,
}


def frame(msg: Message) -> bytes:
    return b"".join(encode(msg))


def header(length: int, msg_id: int, magic: int = MAGIC) -> bytes:
    return struct.pack(">IIB", length, magic, msg_id)


@dataclass
class Outcome:
    messages: list[Message]
    closed_by_server: bool
    decode_error: ProtocolError | None


async def raw_session(
    port: int,
    chunks: list[bytes],
    *,
    secret: bytes | None = None,
    handshake: bool = False,
    half_close: bool = False,
    timeout: float = 5.0,
) -> Outcome:
    """Send ``chunks`` (after a real handshake if asked) and read until the server closes."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    decoder = InPlaceFrameDecoder(max_frame_size_for(SEG))
    messages: list[Message] = []
    closed = False
    error: ProtocolError | None = None
    try:
        if handshake:
            hs = ClientHandshake(secret)
            for m in hs.start():
                writer.write(frame(m))
            while not hs.is_established:
                data = await asyncio.wait_for(reader.read(65536), timeout)
                assert data, "server closed during the handshake"
                for m in decoder.feed(data):
                    for out in hs.receive(m):
                        writer.write(frame(out))
        try:
            for chunk in chunks:
                writer.write(chunk)
                await writer.drain()
            if half_close:
                writer.write_eof()
        except OSError:
            pass  # the daemon gave up on us before we were done: read what it said
        async with asyncio.timeout(timeout):
            while True:
                try:
                    data = await reader.read(65536)
                except OSError:  # reset instead of closed: the daemon is done with us
                    data = b""
                if not data:
                    closed = True
                    break
                try:
                    messages.extend(decoder.feed(data))
                except ProtocolError as e:  # the daemon must only ever send valid frames
                    error = e
                    break
    except TimeoutError:
        pass
    finally:
        writer.close()
        with contextlib.suppress(OSError):  # reset by the daemon: that is fine here
            await writer.wait_closed()
    return Outcome(messages, closed, error)


class GoodConsumer:
    """Reads the good stream in a task, counting records as they arrive."""

    def __init__(self, address: str, nbp: NetworkBufferPool, secret: bytes | None) -> None:
        self.cm = ConnectionManager(segment_size=SEG, secret=secret)
        gate = SingleInputGate("good", nbp.create_buffer_pool(0, 4))
        pid = ResultPartitionID(GOOD, 0)
        gate.set_input_channels([RemoteInputChannel(gate, 0, pid, 0, address, self.cm, nbp)])
        self.reader = RecordReader(gate)
        self.records: list[Any] = []
        self.task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        try:
            await self.reader.gate.request_partitions()
            while (batch := await self.reader.next_batch()) is not None:
                self.records.extend(batch)
        finally:
            self.reader.close()

    async def progressed(self, timeout: float = 5.0) -> None:
        """Wait until more records arrive: the daemon is still serving this stream."""
        before = len(self.records)
        async with asyncio.timeout(timeout):
            while len(self.records) == before:
                assert not self.task.done(), "the good stream ended early"
                await asyncio.sleep(0.005)

    async def finish(self, net: Any) -> None:
        await asyncio.wait_for(self.task, 30)
        net.check_records(self.records, [0], 0, GOOD_STREAM["records"], GOOD_STREAM["payload"])
        await self.cm.close()


def fatal(outcome: Outcome, code: ErrorCode | None) -> None:
    """The server closed the connection, after a fatal ErrorResponse ``code`` if given."""
    assert outcome.decode_error is None, outcome.decode_error
    assert outcome.closed_by_server, f"the daemon kept the connection open: {outcome}"
    errors = [m for m in outcome.messages if isinstance(m, ErrorResponse)]
    if code is None:
        assert errors == []
    else:
        assert errors, outcome.messages
        assert errors[-1].code is code and errors[-1].is_fatal, errors


HELLO = frame(ClientHello(1, bytes(16)))
# (what, bytes sent, the fatal ErrorResponse expected or None, half-close after sending)
BAD_BEFORE_HANDSHAKE: list[tuple[str, list[bytes], ErrorCode | None, bool]] = [
    ("garbage", [b"GET / HTTP/1.1\r\nHost: daemon\r\n\r\n"], ErrorCode.PROTOCOL_ERROR, False),
    ("wrong magic", [header(27, 1, 0xCAFEBABE) + HELLO[9:]], ErrorCode.PROTOCOL_ERROR, False),
    ("oversized length", [header(0x7FFF_FFFF, 10)], ErrorCode.PROTOCOL_ERROR, False),
    ("length below header", [header(3, 1)], ErrorCode.PROTOCOL_ERROR, False),
    ("unknown id", [header(9, 99)], ErrorCode.PROTOCOL_ERROR, False),
    ("short hello body", [header(12, 1) + b"\x00\x01\x02"], ErrorCode.PROTOCOL_ERROR, False),
    ("wrong version", [frame(ClientHello(99, bytes(16)))], ErrorCode.VERSION_MISMATCH, False),
    (
        "request before hello",
        [frame(PartitionRequest(ResultPartitionID(GOOD, 0), 0, 1, 2))],
        ErrorCode.PROTOCOL_ERROR,
        False,
    ),
    (
        "hello byte by byte, then garbage",
        [*(bytes([b]) for b in HELLO), b"\xff" * 9],
        ErrorCode.PROTOCOL_ERROR,
        False,
    ),
    ("truncated frame, then EOF", [HELLO[:11]], None, True),
    ("bad mac", [HELLO, frame(AuthResponse(bytes(32)))], ErrorCode.AUTH_FAILED, False),
]
BAD_AFTER_HANDSHAKE: list[tuple[str, list[bytes], ErrorCode | None]] = [
    ("zero credit", [header(21, 12) + struct.pack(">QI", 1, 0)], ErrorCode.PROTOCOL_ERROR),
    ("short AddCredit", [header(12, 12) + b"abc"], ErrorCode.PROTOCOL_ERROR),
    (
        "BufferResponse from a client",
        [frame(BufferResponse(1, 0, 0, DataType.DATA_BUFFER, False, b"x" * 100))],
        ErrorCode.PROTOCOL_ERROR,
    ),
    ("second hello", [HELLO], ErrorCode.PROTOCOL_ERROR),
    ("oversized after handshake", [header(5000, 17) + bytes(100)], ErrorCode.PROTOCOL_ERROR),
    (
        "bad UTF-8 dataset id",
        [header(42, 10) + b"\x00\x03\xff\xfe\xfd" + bytes(28)],
        ErrorCode.PROTOCOL_ERROR,
    ),
]


@pytest.mark.asyncio(loop_factories=["uvloop"])
async def test_bad_input_is_rejected_and_other_streams_go_on(
    spawn_server: Spawn, client_pool: PoolFactory, net: Any
) -> None:
    daemon = await spawn_server(secret=SECRET, streams=[GOOD_STREAM])
    good = GoodConsumer(daemon.address, client_pool(16, SEG), SECRET.encode())
    await good.progressed()
    for name, chunks, code, half_close in BAD_BEFORE_HANDSHAKE:
        outcome = await raw_session(daemon.port, chunks, half_close=half_close)
        if name == "bad mac":  # the daemon answered the hello before rejecting the MAC
            assert isinstance(outcome.messages[0], ServerHello), name
            assert outcome.messages[0].auth_required
        try:
            fatal(outcome, code)
        except AssertionError as e:
            raise AssertionError(f"{name}: {e}") from None
        await good.progressed()
    for name, chunks, code in BAD_AFTER_HANDSHAKE:
        outcome = await raw_session(daemon.port, chunks, handshake=True, secret=SECRET.encode())
        try:
            fatal(outcome, code)
        except AssertionError as e:
            raise AssertionError(f"{name}: {e}") from None
        await good.progressed()
    await good.finish(net)
    st = await daemon.wait_for_stats(lambda s: s["server"]["connections"] == 0, 5)
    assert st["server"]["total_connections"] == 1 + len(BAD_BEFORE_HANDSHAKE) + len(
        BAD_AFTER_HANDSHAKE
    )
    await daemon.quit()
    assert "Traceback" not in await daemon.read_stderr()
    await net.assert_no_other_tasks()


@pytest.mark.asyncio(loop_factories=["asyncio"])
async def test_wrong_secret_is_an_authentication_error(
    spawn_server: Spawn, client_pool: PoolFactory, net: Any
) -> None:
    daemon = await spawn_server(secret=SECRET, streams=[GOOD_STREAM])
    nbp = client_pool(32, SEG)
    good = GoodConsumer(daemon.address, nbp, SECRET.encode())
    await good.progressed()
    for secret in (b"wrong", None):
        cm = ConnectionManager(segment_size=SEG, secret=secret)
        gate = net.make_gate(daemon.address, [ResultPartitionID(GOOD, 0)], 0, cm, nbp)
        with pytest.raises(AuthenticationError):
            await net.read_all(gate, timeout=10)
        assert cm.connections == []
        await cm.close()
        await good.progressed()
    await good.finish(net)
    await daemon.quit()
    await net.assert_no_other_tasks()


# -- fuzzing over live sockets ------------------------------------------------------------

FUZZ_SEQUENCES = 50
FUZZ_CONCURRENCY = 5
# What a client may send after the handshake ...
CLIENT_FRAMES = [
    frame(m)
    for m in (
        PartitionRequest(ResultPartitionID("fuzz", 0), 0, 1, 2),
        PartitionRequest(ResultPartitionID("fuzz", 1), 3, 2, 1000),
        AddCredit(1, 5),
        AddCredit(7, 1),
        ResumeConsumption(1),
        NewBufferSize(1, 4096),
        CancelPartitionRequest(1),
        CancelPartitionRequest(9),
    )
]
# ... and what it may not.
OTHER_FRAMES = [
    frame(m)
    for m in (
        CloseRequest(),
        ErrorResponse(ErrorCode.INTERNAL, "client says no"),
        BufferResponse(1, 0, 0, DataType.EVENT_BUFFER, False, b"\x00"),
        ServerHello(1, False, bytes(16)),
    )
]


def mutate(rng: random.Random, data: bytes) -> bytes:
    b = bytearray(data)
    for _ in range(rng.randint(1, 2)):
        op = rng.randrange(6)
        if op == 0 and b:  # flip a byte
            b[rng.randrange(len(b))] = rng.randrange(256)
        elif op == 1 and b:  # truncate
            del b[rng.randrange(len(b)) :]
        elif op == 2:  # insert random bytes
            pos = rng.randint(0, len(b))
            b[pos:pos] = rng.randbytes(rng.randint(1, 16))
        elif op == 3 and len(b) >= 4:  # rewrite the length field of the first frame
            b[0:4] = struct.pack(">I", rng.choice([0, 8, 9, 10, 4096, 4097, 2**31, len(b) + 7]))
        elif op == 4 and b:  # duplicate a slice
            i = rng.randrange(len(b))
            b[i:i] = b[i : i + rng.randint(1, 40)]
        elif op == 5 and len(b) > 8:  # set the message id
            b[8] = rng.choice([0, 1, 2, 3, 4, 11, 16, 17, 18, 63, 64, 127, 128, 255])
    return bytes(b)


def fuzz_sequence(rng: random.Random) -> list[bytes]:
    """A hello (usually valid) and some frames, a few of them mutated, in random chunks."""
    frames = [HELLO if rng.random() < 0.9 else mutate(rng, HELLO)]
    for _ in range(rng.randint(0, 8)):
        f = rng.choice(CLIENT_FRAMES if rng.random() < 0.9 else OTHER_FRAMES)
        frames.append(mutate(rng, f) if rng.random() < 0.2 else f)
    if rng.random() < 0.2:
        frames.append(rng.randbytes(rng.randint(1, 64)))
    if rng.random() < 0.5:
        return frames  # frame by frame
    stream = b"".join(frames)
    chunks, pos = [], 0
    while pos < len(stream):
        n = rng.choice([1, 3, 9, 17, 64, len(stream)])
        chunks.append(stream[pos : pos + n])
        pos += n
    return chunks


@pytest.mark.asyncio(loop_factories=["uvloop"])
async def test_live_socket_fuzz(spawn_server: Spawn, client_pool: PoolFactory, net: Any) -> None:
    daemon = await spawn_server(streams=[GOOD_STREAM])
    good = GoodConsumer(daemon.address, client_pool(16, SEG), None)
    await good.progressed()
    rng = random.Random(20240611)
    sequences = [fuzz_sequence(rng) for _ in range(FUZZ_SEQUENCES)]
    sem = asyncio.Semaphore(FUZZ_CONCURRENCY)

    async def run(chunks: list[bytes]) -> Outcome:
        async with sem:
            return await raw_session(daemon.port, chunks, half_close=True)

    outcomes = await asyncio.gather(*(run(s) for s in sequences))
    for i, outcome in enumerate(outcomes):
        # Whatever it was sent, the daemon sent only valid frames and closed the connection
        # (an error, a CloseRequest, or the client's EOF), never hanging on to it.
        assert outcome.decode_error is None, (i, outcome)
        assert outcome.closed_by_server, (i, sequences[i])
    codes = [m.code for o in outcomes for m in o.messages if isinstance(m, ErrorResponse)]
    assert ErrorCode.PROTOCOL_ERROR in codes  # the mutations were caught ...
    assert ErrorCode.PARTITION_NOT_FOUND in codes  # ... and valid requests got through
    await good.progressed()
    st = await daemon.stats()
    assert st["partitions"] == 1 and st["producer_errors"] == []
    await good.finish(net)
    st = await daemon.wait_for_stats(lambda s: s["server"]["connections"] == 0, 5)
    assert st["server"]["total_connections"] == 1 + FUZZ_SEQUENCES
    await daemon.quit()
    assert "Traceback" not in await daemon.read_stderr()
    await net.assert_no_other_tasks()


@pytest.mark.asyncio(loop_factories=["asyncio"])
async def test_client_with_a_secret_refuses_a_daemon_without_one(
    spawn_server: Spawn, client_pool: PoolFactory, net: Any
) -> None:
    """Defect 9 (auth downgrade): a daemon that does not authenticate could be anyone; a
    client holding a secret must refuse it instead of reading unauthenticated data."""
    daemon = await spawn_server(streams=[GOOD_STREAM])  # no secret
    nbp = client_pool(32, SEG)
    cm = ConnectionManager(segment_size=SEG, secret=SECRET.encode())
    gate = net.make_gate(daemon.address, [ResultPartitionID(GOOD, 0)], 0, cm, nbp)
    with pytest.raises(AuthenticationError, match="does not authenticate"):
        await net.read_all(gate, timeout=10)
    assert cm.connections == []
    await cm.close()
    good = GoodConsumer(daemon.address, nbp, None)  # the daemon itself is fine
    await good.finish(net)
    await daemon.quit()
    await net.assert_no_other_tasks()
