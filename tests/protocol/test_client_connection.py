"""PartitionRequestClientConnection with no socket: bytes in, channel effects and bytes out.

Real RemoteInputChannels on a real, leak-checked NetworkBufferPool (the ``nbp`` fixture);
the daemon is played by a ServerHandshake and encoded frames.
"""

from __future__ import annotations

import struct
import traceback
from collections.abc import AsyncIterator
from types import TracebackType
from typing import Any

import pytest
import pytest_asyncio

from exchange.buffers.buffer import DataType
from exchange.consumer.remote_input_channel import RemoteInputChannel
from exchange.consumer.single_input_gate import SingleInputGate
from exchange.errors import (
    AuthenticationError,
    FrameTooLargeError,
    IllegalStateError,
    PartitionReleasedError,
    ProducerFailedError,
    ProtocolError,
    TransportError,
    UnknownMessageError,
    UsageError,
)
from exchange.events.events import EndOfPartitionEvent, EventSerializer
from exchange.memory import NetworkBufferPool
from exchange.partition import ResultPartitionID
from exchange.protocol import (
    MAGIC,
    AddCredit,
    BufferResponse,
    CancelPartitionRequest,
    ClientHello,
    CloseRequest,
    ErrorCode,
    ErrorResponse,
    InPlaceFrameDecoder,
    Message,
    NewBufferSize,
    PartitionRequest,
    Ping,
    Pong,
    ResumeConsumption,
    ServerHandshake,
    encode,
    max_frame_size_for,
)
from exchange.protocol.client_connection import (
    ClientConnectionState,
    ConnectionFailed,
    HandshakeComplete,
    MessageReceived,
    PartitionRequestClientConnection,
)
from exchange.protocol.local_messages import (
    AddProducerCredit,
    ArenaMapped,
    RecycleSegments,
    RequestArena,
    SharedArena,
    SharedBufferResponse,
)

ADDRESS = "10.0.0.1:7100"
SEG = 4096
PIDS = [ResultPartitionID("cc", i) for i in range(2)]


def frames(*msgs: Message) -> bytes:
    return b"".join(b"".join(encode(m)) for m in msgs)


def sent(conn: PartitionRequestClientConnection) -> list[Message]:
    return InPlaceFrameDecoder().feed(b"".join(bytes(p) for p in conn.data_to_send()))


class Provider:
    def __init__(self, conn: PartitionRequestClientConnection) -> None:
        self.conn = conn

    async def create_partition_request_client(self, address: str) -> Any:
        return self.conn


def data(rid: int, seq: int, payload: bytes, backlog: int = 0) -> BufferResponse:
    return BufferResponse(rid, seq, backlog, DataType.DATA_BUFFER, False, payload)


def establish(conn: PartitionRequestClientConnection, secret: bytes | None = None) -> None:
    server = ServerHandshake(secret)
    conn.start()
    while not conn.is_established:
        replies = [out for m in sent(conn) for out in server.receive(m)]
        conn.receive_data(frames(*replies))
        assert conn.state is not ClientConnectionState.FAILED, conn.error


class Setup:
    def __init__(self, nbp: NetworkBufferPool, *, shared_reads: bool = False) -> None:
        self.conn = PartitionRequestClientConnection(
            ADDRESS, None, max_frame_size_for(SEG), shared_reads=shared_reads
        )
        self.gate = SingleInputGate("cc", nbp.create_buffer_pool(0, 4))
        self.channels = [
            RemoteInputChannel(
                self.gate, i, pid, 0, ADDRESS, Provider(self.conn), nbp, num_exclusive=2
            )
            for i, pid in enumerate(PIDS)
        ]
        self.gate.set_input_channels(self.channels)


@pytest_asyncio.fixture
async def s(nbp: NetworkBufferPool) -> AsyncIterator[Setup]:
    setup = Setup(nbp)
    establish(setup.conn)
    assert setup.conn.events_received() == [HandshakeComplete(False)]
    await setup.gate.request_partitions()
    yield setup
    setup.gate.close()
    setup.conn.connection_lost(None)


def test_handshake_with_a_secret() -> None:
    conn = PartitionRequestClientConnection(ADDRESS, b"k", max_frame_size_for(SEG))
    assert conn.state is ClientConnectionState.CONNECTING
    establish(conn, b"k")
    assert conn.authenticated
    assert conn.events_received() == [HandshakeComplete(True)]
    with pytest.raises(IllegalStateError):
        conn.start()


def test_a_server_without_the_secret_fails_the_connection() -> None:
    conn = PartitionRequestClientConnection(ADDRESS, b"k", max_frame_size_for(SEG))
    conn.start()
    (hello,) = sent(conn)
    assert isinstance(hello, ClientHello)
    conn.receive_data(frames(*ServerHandshake(None).receive(hello)))
    assert conn.state is ClientConnectionState.FAILED
    (event,) = conn.events_received()
    assert isinstance(event, ConnectionFailed) and isinstance(event.error, AuthenticationError)
    with pytest.raises(AuthenticationError):
        conn.check()
    assert conn.connection_lost(None) is event.error
    assert conn.state is ClientConnectionState.CLOSED


def depth(tb: TracebackType | None) -> int:
    return len(traceback.extract_tb(tb))


def test_check_raises_a_fresh_copy_of_the_error_each_time_and_its_traceback_stays_short() -> None:
    # Raising the one stored error object on every call appended each raise's frames to
    # its __traceback__: it grew with every failed batch of a producer.
    conn = PartitionRequestClientConnection(ADDRESS, None, max_frame_size_for(SEG))
    establish(conn)
    conn.events_received()
    limit = max_frame_size_for(SEG)
    conn.receive_data(struct.pack(">IIB", limit + 1, MAGIC, 11))
    stored = conn.error
    assert isinstance(stored, FrameTooLargeError)
    stored_tb = stored.__traceback__
    depths = []
    for _ in range(5):
        with pytest.raises(FrameTooLargeError) as info:
            conn.check()
        err = info.value
        assert err is not stored
        assert (str(err), err.size, err.limit) == (str(stored), limit + 1, limit)
        depths.append(depth(err.__traceback__))
    # this test and check(), then where the decoder first raised it; the original unchanged
    assert depths == [2 + depth(stored_tb)] * 5
    assert stored.__traceback__ is stored_tb
    conn.connection_lost(None)


def test_data_before_the_handshake_is_a_protocol_error() -> None:
    conn = PartitionRequestClientConnection(ADDRESS, None, max_frame_size_for(SEG))
    conn.start()
    conn.receive_data(frames(data(1, 0, b"x")))
    assert isinstance(conn.error, ProtocolError)
    assert conn.state is ClientConnectionState.FAILED


@pytest.mark.asyncio
async def test_requests_are_written_and_payloads_land_in_credited_buffers(s: Setup) -> None:
    a, b = s.channels
    assert sent(s.conn) == [
        # 2 exclusive buffers each; the gate's 4 floating ones (what it can hold beyond)
        PartitionRequest(PIDS[0], 0, a.receiver_id, 2, 4),
        PartitionRequest(PIDS[1], 0, b.receiver_id, 2, 4),
    ]
    first_free = a._queue.take()  # floating first, then exclusive: the next one to fill
    assert first_free is not None
    a._queue.exclusive.appendleft(first_free)
    s.conn.receive_data(frames(data(a.receiver_id, 0, b"one"), data(b.receiver_id, 0, b"two")))
    s.conn.receive_data(frames(data(a.receiver_id, 1, b"three")))
    got = [a.get_next_buffer(), a.get_next_buffer(), b.get_next_buffer()]
    assert [bytes(g.buffer.memoryview()) for g in got if g] == [b"one", b"three", b"two"]
    # zero-copy: the bytes were received into the channel's own credited segment
    assert got[0] is not None and got[0].buffer.segment is first_free.segment
    for g in got:
        assert g is not None
        g.buffer.release()
    assert s.conn.events_received() == []


@pytest.mark.asyncio
async def test_credit_is_announced_in_one_add_credit_per_channel_and_flush(s: Setup) -> None:
    a, b = s.channels
    sent(s.conn)
    s.conn.receive_data(frames(*(data(a.receiver_id, i, b"x") for i in range(2))))
    s.conn.receive_data(frames(data(b.receiver_id, 0, b"y")))
    bufs = [a.get_next_buffer(), a.get_next_buffer(), b.get_next_buffer()]
    for g in bufs:
        assert g is not None
        g.buffer.release()  # each returning exclusive buffer is one credit
    assert s.conn.notify_credit_available(a) is False  # a flush is already due
    s.conn.flush_credits()
    assert sorted(sent(s.conn), key=lambda m: m.receiver_id) == [  # type: ignore[attr-defined]
        AddCredit(a.receiver_id, 2),
        AddCredit(b.receiver_id, 1),
    ]
    s.conn.flush_credits()
    assert sent(s.conn) == []


@pytest.mark.asyncio
async def test_a_backlog_takes_floating_buffers_and_announces_them(s: Setup) -> None:
    a, _ = s.channels
    sent(s.conn)
    s.conn.receive_data(frames(data(a.receiver_id, 0, b"x", backlog=3)))
    assert a.num_available_buffers == 3 + 2  # backlog + exclusive: four floating taken
    s.conn.flush_credits()
    assert sent(s.conn) == [AddCredit(a.receiver_id, 4)]
    g = a.get_next_buffer()
    assert g is not None
    g.buffer.release()


@pytest.mark.asyncio
async def test_data_without_credit_fails_the_connection_and_every_channel(s: Setup) -> None:
    a, b = s.channels
    sent(s.conn)
    s.conn.receive_data(frames(*(data(a.receiver_id, i, b"x") for i in range(3))))
    (event,) = s.conn.events_received()
    assert isinstance(event, ConnectionFailed) and "without credit" in str(event.error)
    err = s.conn.connection_lost(None)
    assert err is event.error
    for ch in (a, b):
        with pytest.raises(ProtocolError, match="without credit"):
            while ch.get_next_buffer() is not None:
                pass


@pytest.mark.asyncio
async def test_a_failure_while_a_payload_lands_releases_its_buffer(
    s: Setup, nbp: NetworkBufferPool
) -> None:
    a, _ = s.channels
    frame = frames(data(a.receiver_id, 0, b"z" * 3000))
    s.conn.receive_data(frame[:100])  # the header is in; the rest would land in place
    assert a.num_available_buffers == 1
    s.conn.connection_lost(ConnectionResetError("reset"))
    assert a.num_available_buffers == 2  # given back to its channel
    with pytest.raises(TransportError, match="lost: reset"):
        a.get_next_buffer()


@pytest.mark.asyncio
async def test_per_channel_errors_end_one_channel_only(s: Setup) -> None:
    a, b = s.channels
    sent(s.conn)
    s.conn.receive_data(
        frames(
            ErrorResponse(ErrorCode.PRODUCER_FAILED, "boom", a.receiver_id),
            ErrorResponse(ErrorCode.PARTITION_RELEASED, "gone", 999),  # unknown: ignored
            data(b.receiver_id, 0, b"still here"),
            data(a.receiver_id, 0, b"dropped"),  # a is no longer routed: no buffer taken
        )
    )
    assert s.conn.is_established and s.conn.events_received() == []
    with pytest.raises(ProducerFailedError, match=f"daemon={ADDRESS}"):
        a.get_next_buffer()
    assert a.num_available_buffers == 2
    g = b.get_next_buffer()
    assert g is not None and bytes(g.buffer.memoryview()) == b"still here"
    g.buffer.release()
    s.conn.flush_credits()
    s.conn.notify_credit_available(a)
    s.conn.flush_credits()  # a has been unrouted: no credit for it
    assert [m for m in sent(s.conn) if getattr(m, "receiver_id", None) == a.receiver_id] == []


@pytest.mark.asyncio
async def test_a_fatal_error_response_fails_every_channel(s: Setup) -> None:
    a, b = s.channels
    s.conn.receive_data(frames(ErrorResponse(ErrorCode.PARTITION_RELEASED, "all gone")))
    (event,) = s.conn.events_received()
    assert isinstance(event, ConnectionFailed)
    s.conn.connection_lost(None)
    for ch in (a, b):
        with pytest.raises(PartitionReleasedError, match="all gone"):
            ch.get_next_buffer()


@pytest.mark.asyncio
@pytest.mark.parametrize(
    "msg", [AddCredit(1, 1), AddProducerCredit(3), PartitionRequest(PIDS[0], 0, 1, 1)]
)
async def test_messages_a_daemon_never_sends_are_refused(s: Setup, msg: Message) -> None:
    s.conn.receive_data(frames(msg))
    assert isinstance(s.conn.error, UnknownMessageError)


@pytest.mark.asyncio
async def test_events_are_delivered_without_credit(s: Setup) -> None:
    a, _ = s.channels
    eop = EventSerializer.to_bytes(EndOfPartitionEvent.INSTANCE)
    s.conn.receive_data(
        frames(BufferResponse(a.receiver_id, 0, 0, DataType.EVENT_BUFFER, False, eop))
    )
    assert a.num_available_buffers == 2
    g = a.get_next_buffer()
    assert g is not None and not g.buffer.is_buffer
    assert EventSerializer.from_buffer(g.buffer) == EndOfPartitionEvent.INSTANCE
    g.buffer.release()


@pytest.mark.asyncio
async def test_payloads_and_events_of_one_read_reach_the_channel_in_frame_order(s: Setup) -> None:
    # One read completes data frames (landed in credited buffers, handed on by the
    # compiled landing) around an event (decoded whole, a message): the channel must see
    # them in stream order (and the sequence numbers were checked in that order).
    a, _ = s.channels
    event = EventSerializer.to_bytes(EndOfPartitionEvent.INSTANCE)
    s.conn.receive_data(
        frames(
            data(a.receiver_id, 0, b"one", backlog=1),
            BufferResponse(a.receiver_id, 1, 0, DataType.EVENT_BUFFER, False, event),
            data(a.receiver_id, 2, b"two"),
        )
    )
    assert s.conn.state is ClientConnectionState.ESTABLISHED, s.conn.error
    got = []
    while (g := a.get_next_buffer()) is not None:
        got.append(g)
    assert [g.buffer.is_buffer for g in got] == [True, False, True]
    assert EventSerializer.from_buffer(got[1].buffer) == EndOfPartitionEvent.INSTANCE
    assert [bytes(got[i].buffer.memoryview()) for i in (0, 2)] == [b"one", b"two"]
    for g in got:
        g.buffer.release()


@pytest.mark.asyncio
async def test_channel_calls_are_written_only_for_routed_channels(s: Setup) -> None:
    a, b = s.channels
    sent(s.conn)
    s.conn.resume_consumption(a)
    s.conn.notify_new_buffer_size(b, 1024)
    s.conn.cancel_request(a)
    s.conn.cancel_request(a)
    s.conn.resume_consumption(a)
    assert sent(s.conn) == [
        ResumeConsumption(a.receiver_id),
        NewBufferSize(b.receiver_id, 1024),
        CancelPartitionRequest(a.receiver_id),
    ]
    s.conn.send_close_request()
    assert s.conn.state is ClientConnectionState.CLOSING
    s.conn.resume_consumption(b)  # nothing is written after goodbye
    assert sent(s.conn) == [CloseRequest()]
    with pytest.raises(TransportError):
        s.conn.request_subpartition(b)
    assert s.conn.connection_lost(None).__class__ is TransportError
    assert s.conn.state is ClientConnectionState.CLOSED


# -- keepalive and read timeout -----------------------------------------------------------

READ_TIMEOUT = 2.0


@pytest.mark.asyncio
async def test_a_ping_is_answered_with_a_pong(s: Setup) -> None:
    sent(s.conn)
    s.conn.receive_data(frames(Ping()))
    assert sent(s.conn) == [Pong()]
    assert s.conn.events_received() == [] and s.conn.is_established


@pytest.mark.asyncio
async def test_read_timeout_fails_the_connection_when_credit_is_out_and_nothing_comes(
    s: Setup,
) -> None:
    conn = s.conn
    conn.read_timeout = READ_TIMEOUT
    a, _ = s.channels
    assert conn.credit_out() == 2  # both channels' initial credit
    assert not conn.check_read_timeout(0.0)
    assert not conn.check_read_timeout(READ_TIMEOUT - 0.1)
    conn.receive_data(frames(data(a.receiver_id, 0, b"x")))  # progress: the clock restarts
    assert not conn.check_read_timeout(READ_TIMEOUT + 0.1)
    assert not conn.check_read_timeout(2 * READ_TIMEOUT)
    assert conn.check_read_timeout(2 * READ_TIMEOUT + 0.2)
    assert conn.state is ClientConnectionState.FAILED
    (event,) = conn.events_received()
    assert isinstance(event, ConnectionFailed) and isinstance(event.error, TransportError)
    assert "read_timeout" in str(event.error)
    g = a.get_next_buffer()
    assert g is not None
    g.buffer.release()


@pytest.mark.asyncio
async def test_read_timeout_never_fires_on_a_backpressured_stream(s: Setup) -> None:
    """All announced credit used (the consumer has not returned any): the daemon may not
    send, so silence is expected, however long."""
    conn = s.conn
    conn.read_timeout = READ_TIMEOUT
    for ch in s.channels:
        conn.receive_data(frames(data(ch.receiver_id, 0, b"x"), data(ch.receiver_id, 1, b"y")))
    assert conn.credit_out() == 0
    for t in range(100):
        assert not conn.check_read_timeout(t * READ_TIMEOUT)
    assert conn.is_established


def test_read_timeout_off_and_invalid() -> None:
    conn = PartitionRequestClientConnection(ADDRESS, None, max_frame_size_for(SEG))
    establish(conn)
    assert not conn.check_read_timeout(1e9)
    for bad in (0, -1.0, float("nan"), float("inf"), "2"):
        with pytest.raises(UsageError, match="read_timeout"):
            PartitionRequestClientConnection(
                ADDRESS,
                None,
                max_frame_size_for(SEG),
                read_timeout=bad,  # type: ignore[arg-type]
            )
    conn.connection_lost(None)


# -- shared memory: descriptors read in place, given back by index ------------------------


class SharedSetup(Setup):
    """A connection that reads in place, established, offered and mapped to ``arena``."""

    def __init__(self, nbp: NetworkBufferPool) -> None:
        super().__init__(nbp, shared_reads=True)
        self.arena = bytearray(4 * SEG)
        self.given_back = 0

        def pending() -> None:
            self.given_back += 1

        self.conn.on_give_back_pending = pending


@pytest_asyncio.fixture
async def sh(nbp: NetworkBufferPool) -> AsyncIterator[SharedSetup]:
    setup = SharedSetup(nbp)
    establish(setup.conn)
    setup.conn.events_received()
    setup.conn.request_arena()
    assert sent(setup.conn) == [RequestArena()]
    await setup.gate.request_partitions()
    sent(setup.conn)
    yield setup
    setup.gate.close()
    setup.conn.connection_lost(None)


def descriptor(rid: int, seq: int, segment: int, offset: int, size: int) -> SharedBufferResponse:
    return SharedBufferResponse(((rid, seq, 0, 0, 0, segment, offset, size),))


@pytest.mark.asyncio
async def test_a_descriptor_is_read_in_place_and_given_back_by_index(sh: SharedSetup) -> None:
    a = sh.channels[0]
    offer = SharedArena(bytes(32), len(sh.arena), (), SEG)
    sh.conn.receive_data(frames(offer))
    assert sh.conn.events_received() == [MessageReceived(offer)]
    sh.conn.arena_mapped(memoryview(sh.arena))
    assert sent(sh.conn) == [ArenaMapped()]
    sh.arena[2 * SEG + 100 : 2 * SEG + 105] = b"hello"
    sh.conn.flush_credits()
    sent(sh.conn)
    assert a.unannounced_credit == 0
    sh.conn.receive_data(frames(descriptor(a.receiver_id, 0, 2, 100, 5)))
    got = a.get_next_buffer()
    assert got is not None and bytes(got.buffer.memoryview()) == b"hello"
    # in place: the view is the arena's memory, not a copy
    sh.arena[2 * SEG + 100] = ord("j")
    assert bytes(got.buffer.memoryview()) == b"jello"
    # it cost one credit, as a BufferResponse does (backlog 0: a floating buffer replaces it)
    assert a.unannounced_credit == 1
    assert sh.conn.segments_held == 1 and sh.given_back == 0
    got.buffer.release()
    assert sh.conn.segments_held == 0 and sh.given_back == 1
    sh.conn.flush_credits()
    assert sent(sh.conn)[0] == RecycleSegments((2,))


@pytest.mark.asyncio
async def test_descriptors_before_the_arena_or_outside_it_fail_the_connection(
    nbp: NetworkBufferPool,
) -> None:
    for offer_first, desc in [
        (False, descriptor(1, 0, 0, 0, 10)),  # no arena mapped
        (True, descriptor(1, 0, 4, 0, 10)),  # segment past the arena's end
        (True, descriptor(1, 0, 0, SEG - 5, 10)),  # past the segment's end
    ]:
        setup = SharedSetup(nbp)
        establish(setup.conn)
        await setup.gate.request_partitions()
        if offer_first:
            setup.conn.receive_data(frames(SharedArena(bytes(32), len(setup.arena), (), SEG)))
            setup.conn.arena_mapped(memoryview(setup.arena))
        setup.conn.receive_data(frames(desc))
        assert isinstance(setup.conn.error, ProtocolError), desc
        setup.gate.close()
        setup.conn.connection_lost(None)


def test_a_connection_that_reads_no_shared_memory_refuses_offers() -> None:
    conn = PartitionRequestClientConnection(ADDRESS, None, max_frame_size_for(SEG))
    establish(conn)
    conn.receive_data(frames(SharedArena(bytes(32), 4 * SEG, (), SEG)))
    assert isinstance(conn.error, ProtocolError)
    with pytest.raises(UsageError):
        conn.request_arena()
