"""ServerConnection with no socket and no loop: bytes in, frames out, buffers recycled.

``FakeTransport`` behaves like an asyncio transport in the ways that matter here: the
"kernel" takes at most ``socket_space`` bytes at once, the rest stays in the write buffer
*as the very memoryviews written* (so a buffer recycled too early would show up as
corrupted bytes on the wire), and crossing the high / low watermark calls
``pause_writing`` / ``resume_writing``. ``FakeTimers`` is a virtual clock. What the server
wrote is decoded with the real ``InPlaceFrameDecoder``.
"""

from __future__ import annotations

import heapq
import struct
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import pytest

from exchange.buffers.buffer import DataType
from exchange.errors import IllegalStateError, ProtocolError, UsageError
from exchange.memory import NetworkBufferPool
from exchange.network.server_connection import (
    DATA_PORT_MESSAGES,
    ServerConnection,
    ServerConnectionSettings,
    ServerConnectionState,
)
from exchange.partition import ResultPartition, ResultPartitionID, ResultPartitionManager
from exchange.partition.bounded_data import HEADER as BOUNDED_DATA_HEADER
from exchange.protocol.codec import InPlaceFrameDecoder, encode, max_frame_size_for
from exchange.protocol.handshake import ClientHandshake
from exchange.protocol.local_messages import (
    CreatePartition,
    DaemonInfoRequest,
    FailPartition,
    FinishPartition,
    PushBuffer,
    Released,
    ReleaseDataset,
    SharedBufferResponse,
)
from exchange.protocol.messages import (
    AddCredit,
    AuthOk,
    BufferResponse,
    CancelPartitionRequest,
    CloseRequest,
    ErrorCode,
    ErrorResponse,
    Message,
    PartitionRequest,
    Ping,
    Pong,
    ServerHello,
)
from server.partition_request_server import DataServer
from tests.conformance.partition_fill import add_full_buffers
from tests.conformance.partition_fill import full_buffer_payload as expected_payload

PartitionFactory = Callable[..., ResultPartition]
SECRET = b"s3cret"
HANDSHAKE_TIMEOUT = 5.0
CLOSE_TIMEOUT = 1.0
REAP_INTERVAL = 0.005


# -- fakes ------------------------------------------------------------------------------


class Handle:
    def __init__(self) -> None:
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


@dataclass(order=True)
class _Timer:
    when: float
    seq: int
    callback: Callable[[], object] = field(compare=False)
    handle: Handle = field(compare=False)


class FakeTimers:
    """``call_soon`` / ``call_later`` on a virtual clock; nothing runs until asked."""

    def __init__(self) -> None:
        self.now = 0.0
        self.soon: deque[Callable[[], object]] = deque()
        self._timers: list[_Timer] = []
        self._seq = 0

    def call_soon(self, callback: Callable[[], object], /) -> object:
        self.soon.append(callback)
        return None

    def call_later(self, delay: float, callback: Callable[[], object], /) -> Handle:
        handle = Handle()
        self._seq += 1
        heapq.heappush(self._timers, _Timer(self.now + delay, self._seq, callback, handle))
        return handle

    def run(self) -> None:
        """Run ready callbacks (and what they schedule) like one loop iteration after
        another; an exception escaping one fails the test, as it would be lost in asyncio."""
        while self.soon:
            self.soon.popleft()()

    def advance(self, seconds: float) -> None:
        end = self.now + seconds
        self.run()
        while self._timers and self._timers[0].when <= end:
            timer = heapq.heappop(self._timers)
            self.now = timer.when
            if not timer.handle.cancelled:
                timer.callback()
            self.run()
        self.now = end

    @property
    def pending_timers(self) -> int:
        return sum(1 for t in self._timers if not t.handle.cancelled)


class FakeTransport:
    """A transport whose kernel takes ``socket_space`` bytes at once (None: everything)."""

    def __init__(
        self,
        socket_space: int | None = None,
        high: int = 1 << 62,
        low: int = 0,
        half_close: bool = False,
    ) -> None:
        self.socket_space = socket_space
        self.high, self.low = high, low
        self.conn: ServerConnection | None = None
        self.wire = bytearray()  # what the peer received
        self.held: deque[memoryview] = deque()  # the write buffer: views, never copies
        self.held_bytes = 0
        self.paused = False
        self.closing = False
        self.aborted = False
        self.half_close = half_close  # True: can_write_eof, as a plain TCP/Unix transport
        self.eof_written = False
        self.fail_buffer_writes = False
        self.writes = 0  # writelines calls (send syscalls, for a real transport)

    def writelines(self, list_of_data: Iterable[bytes | memoryview], /) -> None:
        self.writes += 1
        pieces = [memoryview(p).cast("B") for p in list_of_data]
        if self.fail_buffer_writes and len(pieces) == 2:
            raise RuntimeError("transport broke")
        for piece in pieces:
            if self.held or (self.socket_space is not None and len(piece) > self.socket_space):
                take = 0 if self.held else (self.socket_space or 0)
                self.wire += piece[:take]
                if self.socket_space is not None:
                    self.socket_space -= take
                self.held.append(piece[take:])
                self.held_bytes += len(piece) - take
            else:
                self.wire += piece
                if self.socket_space is not None:
                    self.socket_space -= len(piece)
        if not self.paused and self.held_bytes > self.high:
            self.paused = True
            assert self.conn is not None
            self.conn.pause_writing()

    def get_write_buffer_size(self) -> int:
        return self.held_bytes

    def drain(self, n: int | None = None) -> None:
        """The peer read ``n`` bytes (all if None) of the write buffer."""
        n = self.held_bytes if n is None else min(n, self.held_bytes)
        while n:
            piece = self.held[0]
            k = min(n, len(piece))
            self.wire += piece[:k]
            n -= k
            self.held_bytes -= k
            if k == len(piece):
                self.held.popleft()
            else:
                self.held[0] = piece[k:]
        if self.paused and self.held_bytes <= self.low:
            self.paused = False
            assert self.conn is not None
            self.conn.resume_writing()

    def is_closing(self) -> bool:
        return self.closing

    def close(self) -> None:
        self.closing = True

    def can_write_eof(self) -> bool:
        return self.half_close

    def write_eof(self) -> None:
        assert self.half_close and not self.closing
        self.eof_written = True

    def abort(self) -> None:
        self.closing = True
        self.aborted = True


class Peer:
    """The client end: encodes what it sends, decodes what the server wrote."""

    def __init__(self, conn: ServerConnection, transport: FakeTransport, segment_size: int):
        self.conn = conn
        self.transport = transport
        self.decoder = InPlaceFrameDecoder(max_frame_size_for(segment_size))
        self._read = 0
        self.received: list[Message] = []
        self.payloads: dict[int, list[bytes]] = {}

    def send(self, *messages: Message, byte_by_byte: bool = False) -> None:
        data = b"".join(b"".join(bytes(p) for p in encode(m)) for m in messages)
        if byte_by_byte:
            for i in range(len(data)):
                self.conn.receive_data(data[i : i + 1])
        else:
            self.conn.receive_data(data)

    def read(self) -> list[Message]:
        """Decode what reached the wire since the last call."""
        new = bytes(self.transport.wire[self._read :])
        self._read = len(self.transport.wire)
        out = self.decoder.feed(new)
        for m in out:
            if isinstance(m, BufferResponse):
                self.payloads.setdefault(m.receiver_id, []).append(bytes(m.payload))
        self.received.extend(out)
        return out

    def errors(self) -> list[ErrorResponse]:
        return [m for m in self.received if isinstance(m, ErrorResponse)]

    def buffers(self, receiver_id: int) -> list[BufferResponse]:
        return [
            m
            for m in self.received
            if isinstance(m, BufferResponse) and m.receiver_id == receiver_id
        ]

    def tags(self, receiver_id: int) -> list[int]:
        """The numbers written by ``add_full_buffers`` in this receiver's data buffers."""
        return [
            struct.unpack_from(">I", m.payload, 4)[0]
            for m in self.buffers(receiver_id)
            if m.data_type is DataType.DATA_BUFFER
        ]

    def handshake(self, secret: bytes | None = None) -> None:
        hs = ClientHandshake(secret)
        self.send(*hs.start())
        while not hs.is_established:
            for m in self.read():
                out = hs.receive(m)
                if out:
                    self.send(*out)


@dataclass
class Setup:
    conn: ServerConnection
    transport: FakeTransport
    timers: FakeTimers
    peer: Peer


def connect(
    manager: ResultPartitionManager,
    segment_size: int,
    *,
    secret: bytes | None = None,
    handshake: bool = True,
    peer_timeout: float | None = None,
    max_requests: int = 16384,
    **transport_args: Any,
) -> Setup:
    socket_space = transport_args.pop("socket_space", None)
    transport = FakeTransport(**transport_args)
    timers = FakeTimers()
    settings = ServerConnectionSettings(
        secret=secret,
        handshake_timeout=HANDSHAKE_TIMEOUT,
        close_timeout=CLOSE_TIMEOUT,
        reap_interval=REAP_INTERVAL,
        # as the DataServer sets it: unflushed output counts towards the high watermark
        write_batch_bytes=min(transport.high, 256 * 1024),
        peer_timeout=peer_timeout,
        max_requests=max_requests,
    )
    conn = ServerConnection(transport, timers, manager, settings, peer="test")
    transport.conn = conn
    peer = Peer(conn, transport, segment_size)
    if handshake:
        peer.handshake(secret)
        assert conn.state is ServerConnectionState.ESTABLISHED
    transport.socket_space = socket_space  # from now on (the handshake got through)
    return Setup(conn, transport, timers, peer)


def state_of(s: Setup) -> ServerConnectionState:
    """The connection's state, read anew (mypy keeps an attribute narrowed by an earlier
    ``is`` check, though the connection moved on since)."""
    return s.conn.state


def fatal(peer: Peer, code: ErrorCode) -> ErrorResponse:
    peer.read()
    *_, err = peer.errors()
    assert err.is_fatal and err.code is code, err
    return err


def finish_close(s: Setup) -> None:
    """The transport reports the connection lost (as asyncio does after close)."""
    s.conn.connection_lost(None)
    assert s.conn.state is ServerConnectionState.CLOSED
    assert s.timers.pending_timers == 0


# -- handshake and lifecycle ------------------------------------------------------------


@pytest.mark.parametrize("byte_by_byte", [False, True])
@pytest.mark.parametrize("secret", [None, SECRET])
def test_handshake_establishes_and_cancels_its_timer(
    manager: ResultPartitionManager, byte_by_byte: bool, secret: bytes | None
) -> None:
    s = connect(manager, 4096, secret=secret, handshake=False)
    assert s.conn.state is ServerConnectionState.HANDSHAKE
    assert s.timers.pending_timers == 1  # the handshake timeout
    hs = ClientHandshake(secret)
    s.peer.send(*hs.start(), byte_by_byte=byte_by_byte)
    [hello] = s.peer.read()
    assert isinstance(hello, ServerHello) and hello.auth_required is (secret is not None)
    if secret is not None:
        assert s.conn.state is ServerConnectionState.HANDSHAKE
        s.peer.send(*hs.receive(hello), byte_by_byte=byte_by_byte)
        [ok] = s.peer.read()
        assert isinstance(ok, AuthOk)
    assert state_of(s) is ServerConnectionState.ESTABLISHED
    assert s.timers.pending_timers == 0
    s.timers.advance(2 * HANDSHAKE_TIMEOUT)
    assert state_of(s) is ServerConnectionState.ESTABLISHED
    finish_close(s)


def test_silent_client_times_out_and_a_closing_peer_is_aborted(
    manager: ResultPartitionManager,
) -> None:
    s = connect(manager, 4096, handshake=False)
    s.timers.advance(HANDSHAKE_TIMEOUT - 0.01)
    assert s.conn.state is ServerConnectionState.HANDSHAKE
    s.timers.advance(0.02)
    err = fatal(s.peer, ErrorCode.PROTOCOL_ERROR)
    assert "timed out" in err.message
    assert state_of(s) is ServerConnectionState.CLOSING and s.transport.closing
    assert not s.transport.aborted
    s.timers.advance(CLOSE_TIMEOUT)  # the peer never read its last bytes
    assert s.transport.aborted
    finish_close(s)


def test_a_closing_connection_half_closes_and_drops_what_the_peer_still_sends(
    manager: ResultPartitionManager,
) -> None:
    """With the peer's bytes unread, a full close makes the kernel send a reset that can
    destroy the ErrorResponse before the peer reads it (seen as "Connection reset by
    peer" instead of "shutting down" in a full run): where the transport can, the
    connection writes EOF after its last bytes and keeps reading, dropping what comes."""
    s = connect(manager, 4096, half_close=True)
    s.conn.close_with_error(ErrorCode.SERVER_SHUTDOWN, "daemon is shutting down")
    assert s.transport.eof_written and not s.transport.closing
    assert s.conn.state is ServerConnectionState.CLOSING
    s.peer.send(AddCredit(7, 5))  # for no channel: dropped, no error
    s.peer.send(CloseRequest())
    err = fatal(s.peer, ErrorCode.SERVER_SHUTDOWN)
    assert "shutting down" in err.message
    assert s.conn.state is ServerConnectionState.CLOSING and not s.transport.aborted
    s.timers.advance(CLOSE_TIMEOUT)  # the peer never closed its side
    assert s.transport.aborted
    finish_close(s)


# -- keepalive (peer_timeout) -------------------------------------------------------------

PEER_TIMEOUT = 4.0


def pings(peer: Peer) -> int:
    peer.read()
    return sum(1 for m in peer.received if isinstance(m, Ping))


def test_a_peer_that_answers_pings_stays_however_long(manager: ResultPartitionManager) -> None:
    s = connect(manager, 4096, peer_timeout=PEER_TIMEOUT)
    for n in range(1, 11):
        s.timers.advance(PEER_TIMEOUT / 2)
        assert pings(s.peer) == n
        s.peer.send(Pong())
    assert state_of(s) is ServerConnectionState.ESTABLISHED and not s.conn.timed_out
    s.conn.close()
    finish_close(s)


def test_a_peer_that_stops_reading_is_dropped_and_its_reader_released(
    make_partition: PartitionFactory, manager: ResultPartitionManager
) -> None:
    part = make_partition(1, "pipelined", 2)
    s = connect(manager, 4096, peer_timeout=PEER_TIMEOUT)
    s.peer.send(PartitionRequest(part.partition_id, 0, 1, 2))
    s.timers.run()
    assert s.conn.queue.num_readers == 1
    s.timers.advance(PEER_TIMEOUT / 2)
    assert pings(s.peer) == 1  # and never answered
    s.timers.advance(PEER_TIMEOUT - 0.01)
    assert state_of(s) is ServerConnectionState.ESTABLISHED
    s.timers.advance(0.02)
    assert s.transport.aborted and s.conn.timed_out
    assert s.conn.queue.num_readers == 0
    finish_close(s)


@pytest.mark.parametrize("byte_by_byte", [False, True])
def test_a_peer_that_sends_half_a_frame_and_stops_is_dropped(
    manager: ResultPartitionManager, byte_by_byte: bool
) -> None:
    s = connect(manager, 4096, peer_timeout=PEER_TIMEOUT)
    frame = b"".join(bytes(p) for p in encode(Pong()))
    s.timers.advance(PEER_TIMEOUT / 2)
    assert pings(s.peer) == 1
    half = frame[: len(frame) // 2]
    if byte_by_byte:
        for i in range(len(half)):
            s.conn.receive_data(half[i : i + 1])
    else:
        s.conn.receive_data(half)
    s.timers.advance(PEER_TIMEOUT)
    assert s.transport.aborted and s.conn.timed_out
    finish_close(s)


def test_no_keepalive_before_the_handshake_or_when_off(manager: ResultPartitionManager) -> None:
    s = connect(manager, 4096, peer_timeout=None)
    s.timers.advance(10 * PEER_TIMEOUT)
    assert pings(s.peer) == 0 and s.timers.pending_timers == 0
    finish_close(s)
    h = connect(manager, 4096, handshake=False, peer_timeout=PEER_TIMEOUT)
    assert h.timers.pending_timers == 1  # only the handshake timeout
    finish_close(h)


@pytest.mark.parametrize("value", [0, -1.0, float("nan"), float("inf"), "60"])
def test_peer_timeout_must_be_positive_and_finite(value: Any) -> None:
    with pytest.raises(UsageError, match="peer_timeout"):
        ServerConnectionSettings(peer_timeout=value)


def test_wrong_secret_is_auth_failed(manager: ResultPartitionManager) -> None:
    s = connect(manager, 4096, secret=SECRET, handshake=False)
    hs = ClientHandshake(b"wrong")
    s.peer.send(*hs.start())
    [hello] = s.peer.read()
    s.peer.send(*hs.receive(hello))
    fatal(s.peer, ErrorCode.AUTH_FAILED)
    assert s.conn.state is ServerConnectionState.CLOSING
    finish_close(s)


def test_request_before_the_handshake_is_a_protocol_error(
    manager: ResultPartitionManager,
) -> None:
    s = connect(manager, 4096, handshake=False)
    s.peer.send(PartitionRequest(ResultPartitionID("x", 0), 0, 1, 2))
    fatal(s.peer, ErrorCode.PROTOCOL_ERROR)
    finish_close(s)


def test_garbage_is_fatal_and_later_bytes_are_ignored(manager: ResultPartitionManager) -> None:
    s = connect(manager, 4096)
    s.conn.receive_data(b"GET / HTTP/1.1\r\n\r\n")
    fatal(s.peer, ErrorCode.PROTOCOL_ERROR)
    written = len(s.transport.wire)
    s.peer.send(CloseRequest())  # closing: nothing the peer says matters
    assert len(s.transport.wire) == written
    finish_close(s)
    s.conn.connection_lost(None)  # idempotent
    s.conn.close()
    s.conn.abort()
    assert s.conn.state is ServerConnectionState.CLOSED


def test_illegal_transitions_raise(manager: ResultPartitionManager) -> None:
    s = connect(manager, 4096)
    with pytest.raises(IllegalStateError, match="ESTABLISHED -> HANDSHAKE"):
        s.conn._transition(ServerConnectionState.HANDSHAKE)
    finish_close(s)
    for to in ServerConnectionState:
        with pytest.raises(IllegalStateError):
            s.conn._transition(to)


# -- the role's messages ----------------------------------------------------------------

LOCAL_ENDPOINT_ONLY: list[Message] = [
    CreatePartition(ResultPartitionID("sneaky", 0), False, 1),
    PushBuffer(0, DataType.DATA_BUFFER, b"x" * 10),
    FinishPartition(),
    FailPartition("no"),
    DaemonInfoRequest(),
    ErrorResponse(ErrorCode.INTERNAL, "client says no"),
    BufferResponse(1, 0, 0, DataType.DATA_BUFFER, False, b"x"),
]


@pytest.mark.parametrize("msg", LOCAL_ENDPOINT_ONLY, ids=lambda m: type(m).__name__)
def test_the_data_port_refuses_other_roles_messages(
    manager: ResultPartitionManager, msg: Message
) -> None:
    s = connect(manager, 4096)
    s.peer.send(msg)
    err = fatal(s.peer, ErrorCode.PROTOCOL_ERROR)
    assert type(msg).__name__ in err.message
    assert len(manager) == 0  # nothing was created
    finish_close(s)


def test_a_role_with_more_messages_gets_them_and_delegates_the_rest(
    manager: ResultPartitionManager,
) -> None:
    handled: list[Message] = []
    transport, timers = FakeTransport(), FakeTimers()
    conn: ServerConnection

    def on_message(msg: Message) -> None:
        if isinstance(msg, DaemonInfoRequest):
            handled.append(msg)
        else:
            conn.handle_message(msg)

    conn = ServerConnection(
        transport,
        timers,
        manager,
        on_message=on_message,
        accepted_messages=DATA_PORT_MESSAGES | {DaemonInfoRequest},
    )
    transport.conn = conn
    peer = Peer(conn, transport, 4096)
    peer.handshake()
    peer.send(DaemonInfoRequest(), ReleaseDataset("nothing-here"))
    assert handled == [DaemonInfoRequest()]
    assert peer.read() == [Released(0)]
    peer.send(FinishPartition())
    fatal(peer, ErrorCode.PROTOCOL_ERROR)
    conn.connection_lost(None)


def test_release_dataset_on_the_data_port(
    make_partition: PartitionFactory, manager: ResultPartitionManager
) -> None:
    make_partition(ResultPartitionID("gone", 0), "pipelined", 1)
    make_partition(ResultPartitionID("gone", 1), "pipelined", 1)
    s = connect(manager, 4096)
    s.peer.send(ReleaseDataset("gone"))
    assert s.peer.read() == [Released(2)]
    assert len(manager) == 0
    finish_close(s)


def test_unknown_partition_is_a_channel_error_and_the_connection_stays(
    manager: ResultPartitionManager,
) -> None:
    s = connect(manager, 4096)
    s.peer.send(PartitionRequest(ResultPartitionID("nope", 0), 0, 3, 2))
    [err] = s.peer.read()
    assert isinstance(err, ErrorResponse) and err.receiver_id == 3
    assert err.code is ErrorCode.PARTITION_NOT_FOUND
    assert s.conn.state is ServerConnectionState.ESTABLISHED
    assert s.conn.queue.num_readers == 0
    finish_close(s)


def test_requests_beyond_max_requests_fail_alone(
    make_partition: PartitionFactory, manager: ResultPartitionManager
) -> None:
    part = make_partition(1, "pipelined", 3)
    s = connect(manager, 4096, max_requests=2)
    s.peer.send(*(PartitionRequest(part.partition_id, i, i + 1, 2) for i in range(3)))
    s.timers.run()
    s.peer.read()
    [err] = s.peer.errors()
    assert err.code is ErrorCode.LIMIT_EXCEEDED and err.receiver_id == 3
    assert "max_requests_per_connection=2" in err.message
    assert s.conn.queue.num_readers == 2 and state_of(s) is ServerConnectionState.ESTABLISHED
    s.peer.send(CancelPartitionRequest(1))  # room again: the same subpartition is served
    s.timers.run()
    s.peer.send(PartitionRequest(part.partition_id, 2, 4, 2))
    s.timers.run()
    s.peer.read()
    assert len(s.peer.errors()) == 1 and s.conn.queue.num_readers == 2
    s.conn.close()
    finish_close(s)


@pytest.mark.parametrize("value", [0, -1, 1.5, None])
def test_max_requests_must_be_a_positive_int(value: Any) -> None:
    with pytest.raises(UsageError, match="max_requests"):
        ServerConnectionSettings(max_requests=value)


def test_a_receiver_id_used_twice_is_fatal(
    make_partition: PartitionFactory, manager: ResultPartitionManager
) -> None:
    part = make_partition(1, "pipelined", 2)
    s = connect(manager, 4096)
    s.peer.send(PartitionRequest(part.partition_id, 0, 1, 2))
    s.peer.send(PartitionRequest(part.partition_id, 1, 1, 2))
    err = fatal(s.peer, ErrorCode.PROTOCOL_ERROR)
    assert "already in use" in err.message
    assert s.conn.queue.num_readers == 0  # closing released the first reader
    finish_close(s)


def test_an_unexpected_error_handling_a_message_is_fatal_internal(
    manager: ResultPartitionManager,
) -> None:
    def broken(dataset: str, app_id: str) -> int:
        raise KeyError(dataset)

    transport, timers = FakeTransport(), FakeTimers()
    conn = ServerConnection(transport, timers, manager, release_dataset=broken)
    transport.conn = conn
    peer = Peer(conn, transport, 4096)
    peer.handshake()
    peer.send(ReleaseDataset("ds"))
    err = fatal(peer, ErrorCode.INTERNAL)
    assert "KeyError" in err.message
    assert conn.state is ServerConnectionState.CLOSING
    conn.connection_lost(None)


# -- data, writability and recycling ----------------------------------------------------


def test_stream_with_watermarks_recycles_only_what_the_transport_sent(
    make_partition: PartitionFactory, manager: ResultPartitionManager, nbp: NetworkBufferPool
) -> None:
    seg = nbp.segment_size
    n = 12
    part = make_partition(1, "pipelined", 1, (1, n + 1))
    # The kernel takes one frame; the write buffer pauses above two frames.
    s = connect(manager, seg, socket_space=seg + 100, high=2 * seg, low=seg // 2)
    s.peer.send(PartitionRequest(part.partition_id, 0, 1, 100))
    add_full_buffers(part, 0, n)
    part.finish()
    s.timers.run()
    assert s.transport.paused and not s.conn.is_writable
    assert s.conn.paused_count == 1
    held = s.conn.statistics().in_flight_buffers
    assert held >= 2  # bytes still in the transport: their segments are not recycled
    in_use_while_held = nbp.num_in_use
    assert in_use_while_held >= held

    s.transport.drain(seg)  # the peer reads a little: still above the low watermark
    assert s.transport.paused
    s.timers.advance(REAP_INTERVAL)  # the reap timer recycles what went out meanwhile
    assert s.conn.statistics().in_flight_buffers < held
    while s.conn.queue.num_readers or s.transport.held_bytes:
        s.transport.drain()  # below the low watermark: resume_writing sends on
        s.timers.advance(REAP_INTERVAL)
    s.peer.read()
    assert s.peer.tags(1) == list(range(n))
    # Every payload arrived intact: no segment was reused while the transport held it.
    data = [m for m in s.peer.buffers(1) if m.data_type is DataType.DATA_BUFFER]
    assert [bytes(m.payload) for m in data] == [expected_payload(seg, i) for i in range(n)]
    assert [m.sequence_number for m in s.peer.buffers(1)] == list(range(n + 1))
    assert s.peer.buffers(1)[-1].data_type is DataType.EVENT_BUFFER
    assert s.conn.paused_count >= 1 and s.peer.errors() == []
    assert s.conn.statistics().in_flight_buffers == 0
    assert part.is_released  # fully consumed
    st = s.conn.statistics()
    assert st.buffers_sent == n + 1 and st.bytes_written == len(s.transport.wire)
    finish_close(s)


def test_connection_lost_recycles_buffers_still_in_flight(
    make_partition: PartitionFactory, manager: ResultPartitionManager, nbp: NetworkBufferPool
) -> None:
    seg = nbp.segment_size
    part = make_partition(1, "pipelined", 1, (1, 8))
    s = connect(manager, seg, socket_space=0)  # the peer never reads
    s.peer.send(PartitionRequest(part.partition_id, 0, 1, 100))
    add_full_buffers(part, 0, 5)
    s.timers.run()
    assert s.conn.statistics().in_flight_buffers == 5
    s.timers.advance(1.0)  # the reap timer finds nothing sent, and keeps looking
    assert s.conn.statistics().in_flight_buffers == 5
    s.conn.connection_lost(ConnectionResetError())
    assert s.conn.statistics().in_flight_buffers == 0
    assert s.conn.queue.num_readers == 0
    assert part.is_released  # its consumer is gone
    assert s.timers.pending_timers == 0


def test_buffers_in_the_read_arena_go_as_descriptors_held_until_given_back(
    make_partition: PartitionFactory, manager: ResultPartitionManager, nbp: NetworkBufferPool
) -> None:
    seg = nbp.segment_size
    part = make_partition(1, "pipelined", 1, (1, 8))
    s = connect(manager, seg)
    s.conn.read_arena = nbp  # the consumer mapped the pool these segments come from
    s.peer.send(PartitionRequest(part.partition_id, 0, 1, 100))
    add_full_buffers(part, 0, 3)
    part.finish()
    s.timers.run()
    got = s.peer.read()
    (batch,) = [m for m in got if isinstance(m, SharedBufferResponse)]  # one per callback
    descs = batch.buffers
    assert [(rid, seq, dt, size) for rid, seq, _, dt, _, _, _, size in descs] == [
        (1, 0, 0, seg),
        (1, 1, 0, seg),
        (1, 2, 0, seg),
    ]
    segments = [d[5] for d in descs]
    for i, (*_, index, offset, size) in enumerate(descs):  # the bytes are there, in place
        view = nbp._segments[index].view()[offset : offset + size]
        assert bytes(view) == expected_payload(seg, i)
    # the end of the partition is an event: it still comes as bytes, after them
    (end,) = s.peer.buffers(1)
    assert end.data_type is DataType.EVENT_BUFFER and end.sequence_number == 3
    assert s.conn.num_held == 3 and s.conn.bytes_shared == 3 * seg
    in_use = nbp.num_in_use
    s.conn.give_back([segments[1]])  # only that one returns
    assert s.conn.num_held == 2 and nbp.num_in_use == in_use - 1
    with pytest.raises(ProtocolError, match="not held"):
        s.conn.give_back([segments[1]])
    s.conn.connection_lost(None)  # the consumer died holding two: they return too
    assert s.conn.num_held == 0 and nbp.num_in_use == in_use - 3
    assert s.timers.pending_timers == 0


def _peer_closes(s: Setup) -> None:
    s.peer.send(CloseRequest())


def _peer_goes(s: Setup) -> None:
    pass  # its EOF, a reset, its death: the transport reports the loss


def _peer_times_out(s: Setup) -> None:
    s.timers.advance(PEER_TIMEOUT)  # a Ping unanswered for peer_timeout
    s.timers.advance(PEER_TIMEOUT)
    assert s.conn.timed_out


def _peer_breaks_the_protocol(s: Setup) -> None:
    s.peer.send(PartitionRequest(ResultPartitionID("x", 0, 0), 0, 1, 2))  # id 1 in use


@pytest.mark.parametrize(
    ("end", "kept"),
    [
        (_peer_closes, False),
        (_peer_goes, False),
        (_peer_times_out, True),
        (_peer_breaks_the_protocol, True),
        (lambda s: s.conn.close(), True),  # daemon-side close (shutdown)
    ],
    ids=["close-request", "peer-lost", "peer-timeout", "protocol-error", "daemon-close"],
)
def test_segments_held_when_the_daemon_drops_the_consumer_go_to_keep_held(
    make_partition: PartitionFactory,
    manager: ResultPartitionManager,
    nbp: NetworkBufferPool,
    end: Callable[[Setup], None],
    kept: bool,
) -> None:
    """What the consumer holds when *it* ends the connection returns to the pool; when the
    daemon drops it (its process may live on, reading), it goes to ``keep_held``."""
    part = make_partition(1, "pipelined", 1, (1, 8))
    s = connect(manager, nbp.segment_size, peer_timeout=PEER_TIMEOUT)
    s.conn.read_arena = nbp
    kept_buffers: list[Any] = []
    s.conn.keep_held = kept_buffers.extend
    s.peer.send(PartitionRequest(part.partition_id, 0, 1, 3))
    add_full_buffers(part, 0, 3)
    s.timers.run()
    assert s.conn.num_held == 3
    end(s)
    assert s.conn.dropped_by_daemon is kept
    s.conn.connection_lost(None)
    assert s.conn.num_held == 0
    assert len(kept_buffers) == (3 if kept else 0)
    in_use = nbp.num_in_use
    for buf in kept_buffers:  # what keep_held does once the consumer's process is gone
        buf.release()
    assert nbp.num_in_use == in_use - len(kept_buffers)
    part.release()


@pytest.mark.parametrize("byte_by_byte", [False, True])
def test_descriptors_written_by_a_read_alone_go_out_at_its_end(
    make_partition: PartitionFactory,
    manager: ResultPartitionManager,
    nbp: NetworkBufferPool,
    byte_by_byte: bool,
) -> None:
    """A callback whose only output is descriptors (the consumer's AddCredit let the
    queue send on) writes them when it returns, as it would BufferResponses."""
    part = make_partition(1, "pipelined", 1, (1, 8))
    s = connect(manager, nbp.segment_size)
    s.conn.read_arena = nbp
    s.peer.send(PartitionRequest(part.partition_id, 0, 1, 2))  # credit for two
    add_full_buffers(part, 0, 6)
    s.timers.run()
    (first,) = [m for m in s.peer.read() if isinstance(m, SharedBufferResponse)]
    assert [e[1] for e in first.buffers] == [0, 1]
    s.peer.send(AddCredit(1, 3), byte_by_byte=byte_by_byte)  # no timer runs after it
    (more,) = [m for m in s.peer.read() if isinstance(m, SharedBufferResponse)]
    assert [e[1] for e in more.buffers] == [2, 3, 4]
    s.conn.connection_lost(None)
    part.release()


def test_cancel_and_close_request(
    make_partition: PartitionFactory, manager: ResultPartitionManager
) -> None:
    part = make_partition(1, "pipelined", 2)
    s = connect(manager, 4096)
    s.peer.send(
        PartitionRequest(part.partition_id, 0, 1, 2),
        PartitionRequest(part.partition_id, 1, 2, 2),
    )
    assert s.conn.queue.num_readers == 2
    s.peer.send(CancelPartitionRequest(1), AddCredit(1, 3))  # late credit: ignored
    assert s.conn.queue.num_readers == 1
    s.peer.send(CloseRequest())
    assert s.conn.state is ServerConnectionState.CLOSING and s.transport.closing
    assert s.conn.queue.num_readers == 0
    assert part.is_released
    finish_close(s)


# -- defect 3: errors in callbacks ------------------------------------------------------


def truncate_spill_file(part: ResultPartition, index: int, keep_buffers: int) -> None:
    path = part.subpartitions[index].data.path  # type: ignore[union-attr]
    with open(path, "r+b") as f:
        f.truncate(
            keep_buffers * (BOUNDED_DATA_HEADER.size + part.segment_size)
            + BOUNDED_DATA_HEADER.size
            + 100
        )


@pytest.mark.parametrize("socket_space", [None, 0], ids=["written-at-once", "held-in-flight"])
def test_truncated_spill_file_fails_its_channel_the_other_completes(
    make_partition: PartitionFactory,
    manager: ResultPartitionManager,
    nbp: NetworkBufferPool,
    socket_space: int | None,
) -> None:
    """Defect 3. Written at once, the reader's error surfaces in the send loop; held in
    flight, it surfaces when a sent buffer is recycled (the file reader reads ahead into
    the freed segment), i.e. inside the reap timer or ``resume_writing``."""
    seg = nbp.segment_size
    part = make_partition(1, "blocking", 2, (2, 4))
    add_full_buffers(part, 0, 6, start=0)
    add_full_buffers(part, 1, 6, start=100)
    part.finish()
    s = connect(manager, seg, socket_space=socket_space)
    s.peer.send(
        PartitionRequest(part.partition_id, 0, 10, 50),
        PartitionRequest(part.partition_id, 1, 20, 50),
    )
    # cut under the open reader (cut before, the request itself is refused: the reader
    # opens only the file it was written as, of the size written)
    truncate_spill_file(part, 0, keep_buffers=2)
    for _ in range(200):
        s.timers.run()
        s.transport.drain()
        s.timers.advance(REAP_INTERVAL)
        if s.conn.queue.num_readers == 0 and s.conn.statistics().in_flight_buffers == 0:
            break
    s.peer.read()
    [err] = s.peer.errors()
    assert err.receiver_id == 10 and err.code is ErrorCode.INTERNAL
    assert "truncated" in err.message
    tags = s.peer.tags(10)
    assert tags == list(range(len(tags))) and len(tags) <= 2
    assert s.peer.tags(20) == list(range(100, 106))
    assert s.peer.buffers(20)[-1].data_type is DataType.EVENT_BUFFER
    assert s.conn.state is ServerConnectionState.ESTABLISHED
    assert s.conn.queue.num_readers == 0
    finish_close(s)


def test_an_unexpected_error_in_a_deferred_callback_is_fatal_not_swallowed(
    make_partition: PartitionFactory, manager: ResultPartitionManager
) -> None:
    part = make_partition(1, "pipelined", 2)
    s = connect(manager, 4096)
    s.peer.send(
        PartitionRequest(part.partition_id, 0, 1, 5),
        PartitionRequest(part.partition_id, 1, 2, 5),
    )
    s.transport.fail_buffer_writes = True
    add_full_buffers(part, 0, 1)  # the producer's notification runs later, and fails
    s.timers.run()  # nothing escapes the callback
    err = fatal(s.peer, ErrorCode.INTERNAL)
    assert "transport broke" in err.message
    assert s.conn.state is ServerConnectionState.CLOSING
    assert s.conn.queue.num_readers == 0  # every reader released
    assert part.is_released
    finish_close(s)


def test_an_error_in_resume_writing_is_fatal(
    make_partition: PartitionFactory, manager: ResultPartitionManager, nbp: NetworkBufferPool
) -> None:
    seg = nbp.segment_size
    part = make_partition(1, "pipelined", 1, (1, 8))
    s = connect(manager, seg, socket_space=0, high=seg, low=0)
    s.peer.send(PartitionRequest(part.partition_id, 0, 1, 5))
    add_full_buffers(part, 0, 4)
    s.timers.run()
    assert s.transport.paused
    s.transport.fail_buffer_writes = True
    s.transport.drain()  # resume_writing -> the queue writes -> the transport raises
    s.transport.drain()  # the peer reads the error
    err = fatal(s.peer, ErrorCode.INTERNAL)
    assert "transport broke" in err.message
    assert s.conn.queue.num_readers == 0
    finish_close(s)


def test_one_callback_writes_its_frames_with_one_writelines(
    make_partition: PartitionFactory, manager: ResultPartitionManager, nbp: NetworkBufferPool
) -> None:
    seg = nbp.segment_size
    part = make_partition(1, "pipelined", 2, (2, 12))
    s = connect(manager, seg, high=16 * seg)
    s.peer.send(
        PartitionRequest(part.partition_id, 0, 1, 0),
        PartitionRequest(part.partition_id, 1, 2, 0),
    )
    add_full_buffers(part, 0, 3)
    add_full_buffers(part, 1, 3)
    s.timers.run()
    before = s.transport.writes
    s.peer.send(AddCredit(1, 3), AddCredit(2, 3))  # one read: six buffers to send
    assert s.transport.writes == before + 1
    s.peer.read()
    assert s.peer.tags(1) == [0, 1, 2] and s.peer.tags(2) == [0, 1, 2]
    assert s.conn.statistics().in_flight_buffers == 0  # all out: recycled at once
    part.release()
    finish_close(s)


def test_the_data_ports_default_watermarks_write_8_buffers_per_writelines(
    make_partition: PartitionFactory, manager: ResultPartitionManager, nbp: NetworkBufferPool
) -> None:
    """A DataServer's defaults (high 8 segments, low 4): one callback's 16 credited buffers
    go out in two writes (at Flink's 2 segments it was eight), and the queue still stops
    at the high watermark when the peer does not read."""
    seg = nbp.segment_size
    server = DataServer(manager, segment_size=seg)
    assert (server.high_watermark, server.low_watermark) == (8 * seg, 4 * seg)
    part = make_partition(1, "pipelined", 1, (1, 20))
    s = connect(manager, seg, high=server.high_watermark, low=server.low_watermark)
    s.peer.send(PartitionRequest(part.partition_id, 0, 1, 0))
    add_full_buffers(part, 0, 16)
    s.timers.run()
    before = s.transport.writes
    s.peer.send(AddCredit(1, 16))
    assert s.transport.writes == before + 2
    s.peer.read()
    assert s.peer.tags(1) == list(range(16))
    part.release()
    finish_close(s)

    stalled = make_partition(2, "pipelined", 1, (1, 20))
    s = connect(manager, seg, high=server.high_watermark, low=server.low_watermark, socket_space=0)
    s.peer.send(PartitionRequest(stalled.partition_id, 0, 1, 0))
    add_full_buffers(stalled, 0, 16)
    s.timers.run()
    s.peer.send(AddCredit(1, 16))
    assert not s.conn.is_writable
    assert s.conn.statistics().buffers_sent == 8  # up to the high watermark, then paused
    while s.transport.held_bytes:
        s.transport.drain()  # below the low watermark: resume_writing sends the rest
        s.timers.advance(REAP_INTERVAL)
    s.peer.read()
    assert s.peer.tags(1) == list(range(16))
    stalled.release()
    finish_close(s)


def test_a_callback_writing_more_than_the_high_watermark_writes_in_batches(
    make_partition: PartitionFactory, manager: ResultPartitionManager, nbp: NetworkBufferPool
) -> None:
    seg = nbp.segment_size
    part = make_partition(1, "pipelined", 1, (1, 8))
    s = connect(manager, seg, high=2 * seg)
    s.peer.send(PartitionRequest(part.partition_id, 0, 1, 0))
    add_full_buffers(part, 0, 6)
    s.timers.run()
    before = s.transport.writes
    s.peer.send(AddCredit(1, 6))
    assert s.transport.writes == before + 3  # two frames exceed 2 segments: written
    s.peer.read()
    assert s.peer.tags(1) == list(range(6))
    part.release()
    finish_close(s)


def _blocking_with_buffers(make_partition: PartitionFactory, n: int, kind: str) -> ResultPartition:
    part = make_partition(1, "blocking", 1, kind=kind)
    add_full_buffers(part, 0, n)
    part.finish()
    return part


def _descriptors(s: Setup) -> list[tuple[int, ...]]:
    return [e for m in s.peer.read() if isinstance(m, SharedBufferResponse) for e in m.buffers]


@pytest.mark.parametrize("kind", ["file", "mmap"])
def test_a_blocking_partition_is_read_into_the_read_arena_and_goes_as_descriptors(
    make_partition: PartitionFactory,
    manager: ResultPartitionManager,
    nbp: NetworkBufferPool,
    kind: str,
) -> None:
    """A blocking partition's reader on a connection whose consumer mapped its arena reads
    each data buffer from the file into a segment of that arena: it goes as a descriptor,
    costs a credit, and is held until given back or the connection is gone."""
    seg = nbp.segment_size
    part = _blocking_with_buffers(make_partition, 4, kind)
    arena = NetworkBufferPool(8, seg)  # the application's arena, as the daemon holds it
    try:
        s = connect(manager, seg)
        s.conn.read_arena = arena
        s.peer.send(PartitionRequest(part.partition_id, 0, 1, 2))  # credit for two
        s.timers.run()
        first = _descriptors(s)
        assert [(e[1], e[3], e[6], e[7]) for e in first] == [(0, 0, 0, seg), (1, 0, 0, seg)]
        for i, e in enumerate(first):  # the file's bytes, in the arena's segments
            assert bytes(arena._segments[e[5]].view()) == expected_payload(seg, i)
        assert s.peer.buffers(1) == []  # nothing as bytes
        # the two held, one read ahead: at most credit + 1 of the arena per reader
        assert s.conn.num_held == 2 and arena.num_in_use == 3
        s.conn.give_back([first[0][5]])
        assert arena.num_in_use == 2
        s.peer.send(AddCredit(1, 8))
        s.timers.run()
        rest = _descriptors(s)
        assert [e[1] for e in rest] == [2, 3]
        for i, e in enumerate(rest, 2):
            assert bytes(arena._segments[e[5]].view()) == expected_payload(seg, i)
        (end,) = s.peer.buffers(1)  # the end of the partition: an event, as bytes
        assert end.data_type is DataType.EVENT_BUFFER and end.sequence_number == 4
        assert s.conn.bytes_shared == 4 * seg and s.conn.num_held == 3
        s.conn.connection_lost(None)  # the consumer went holding three: they return
        assert arena.is_whole() and s.conn.num_held == 0
        # the partition stays readable: a reader over bytes (no arena) reads it all again
        again = connect(manager, seg)
        again.peer.send(PartitionRequest(part.partition_id, 0, 1, 10))
        again.timers.run()
        again.peer.read()
        assert again.peer.tags(1) == [0, 1, 2, 3]
        again.conn.connection_lost(None)
    finally:
        part.release()
        arena.destroy()


def test_a_blocking_reader_with_no_spare_arena_segment_sends_that_buffer_as_bytes(
    make_partition: PartitionFactory, manager: ResultPartitionManager, nbp: NetworkBufferPool
) -> None:
    """The arena's partitions keep their share (their pools' sizes): a reader lends only
    the segments beyond it, and a buffer read while none is spare goes as bytes instead
    of waiting, in the stream's order; later ones take the arena again."""
    seg = nbp.segment_size
    part = _blocking_with_buffers(make_partition, 5, "file")
    arena = NetworkBufferPool(4, seg)
    writer_pool = arena.create_buffer_pool(3, 3)  # a writer's share: three of the four
    try:
        s = connect(manager, seg)
        s.conn.read_arena = arena
        s.peer.send(PartitionRequest(part.partition_id, 0, 1, 3))
        s.timers.run()
        got = s.peer.read()
        # buffer 0 in the one spare segment (read ahead at the request), 1 and 2 as bytes
        order: list[tuple[str, int]] = []
        for m in got:
            if isinstance(m, SharedBufferResponse):
                order += [("shared", e[1]) for e in m.buffers]
            elif isinstance(m, BufferResponse):
                order.append(("bytes", m.sequence_number))
        assert order == [("shared", 0), ("bytes", 1), ("bytes", 2)]
        assert s.peer.tags(1) == [1, 2]
        (desc,) = [e for m in got if isinstance(m, SharedBufferResponse) for e in m.buffers]
        assert bytes(arena._segments[desc[5]].view()) == expected_payload(seg, 0)
        assert arena.num_in_use == 1 and writer_pool.num_requested == 0
        s.conn.give_back([desc[5]])  # spare again: the next buffer read goes there
        s.peer.send(AddCredit(1, 8))
        s.timers.run()
        rest = _descriptors(s)
        # 3 was read ahead into a read segment of its own while nothing was spare
        assert s.peer.tags(1) == [1, 2, 3]
        assert [e[1] for e in rest] == [4]
        assert bytes(arena._segments[rest[0][5]].view()) == expected_payload(seg, 4)
        s.conn.give_back([rest[0][5]])
        s.conn.connection_lost(None)
        assert arena.num_in_use == 0
    finally:
        writer_pool.destroy()
        part.release()
        arena.destroy()
