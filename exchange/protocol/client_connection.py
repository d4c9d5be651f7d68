"""The client end of a daemon connection, sans I/O (python-websockets style).

``ClientConnection`` owns the client handshake, the in-place frame decoder and the bytes
to send. The I/O side feeds it (``get_buffer``/``buffer_updated``, the
``asyncio.BufferedProtocol`` pair, or ``receive_data``), writes ``data_to_send()`` and
acts on ``events_received()``: ``HandshakeComplete``, ``MessageReceived`` (messages the
connection does not handle itself) and ``ConnectionFailed`` (close the transport).
Received bytes never raise: a failure is recorded (``error``), the state becomes FAILED
and a ``ConnectionFailed`` event is queued.

``PartitionRequestClientConnection`` is the data-port client (Flink's
NettyPartitionRequestClient + CreditBasedPartitionRequestClientHandler): it routes
BufferResponses by receiver id, receiving each data payload straight into a buffer the
channel has credit for; turns ErrorResponses into typed errors on one channel or, without
a receiver id, on the whole connection; batches AddCredit announcements (one per channel
and ``flush_credits``); and writes PartitionRequest / ResumeConsumption / NewBufferSize /
CancelPartitionRequest / CloseRequest for its channels.

Shared memory (``shared_reads``: a connection to this host's daemon over its Unix
socket): the connection asks for its application's arena (RequestArena); an offer
(SharedArena) goes to the I/O side as a ``MessageReceived``, which maps the arena and
calls ``arena_mapped``. A SharedBufferResponse then becomes a Buffer over a memoryview of
the segment, costing the channel one credit as a BufferResponse does (a credited buffer
of the channel is taken and held unused beside it); releasing it queues the segment's
index for the next RecycleSegments (one frame per batch, sent by ``flush_credits`` after
``on_give_back_pending`` asked the I/O side for a flush) and returns the credit.

Liveness: every client answers the daemon's keepalive ``Ping`` with a ``Pong`` (the daemon
drops a peer that does not, see ``exchange.network.server_connection``). The data-port
client may also have a ``read_timeout``: ``check_read_timeout(now)``, called periodically
with the caller's clock, fails the connection when no byte has arrived for that long while
some channel has credit out (the daemon may send, and does not). A backpressured channel
(no credit out) never times out, and the daemon's Pings keep an idle stream alive when
``read_timeout`` exceeds half the daemon's ``peer_timeout``.

The lifecycle is one enum; ``_TRANSITIONS`` is the only place that says which state may
follow which::

    CONNECTING -> HANDSHAKING -> ESTABLISHED -> CLOSING -> CLOSED
                       \\______________\\____________\\-> FAILED -> CLOSED
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING, Final

from exchange.buffers.buffer import Buffer
from exchange.errors import (
    AuthenticationError,
    ExchangeError,
    IllegalStateError,
    ProtocolError,
    TransportError,
    UsageError,
    fresh_error,
)
from exchange.protocol.codec import (
    DEFAULT_READ_AHEAD,
    MAX_CONTROL_FRAME_SIZE,
    InPlaceFrameDecoder,
    PayloadReceived,
    Piece,
    encode,
)
from exchange.protocol.data_landing import DataLanding
from exchange.protocol.handshake import ClientHandshake
from exchange.protocol.local_messages import (
    ArenaMapped,
    NoArena,
    RequestArena,
    SharedArena,
    SharedBufferResponse,
    encode_recycle,
)
from exchange.protocol.messages import (
    AddCredit,
    BufferResponse,
    CancelPartitionRequest,
    CloseRequest,
    ErrorCode,
    ErrorResponse,
    Message,
    MessageId,
    NewBufferSize,
    PartitionRequest,
    Ping,
    Pong,
    ResumeConsumption,
    error_for_response,
)

if TYPE_CHECKING:
    from exchange.consumer.remote_input_channel import RemoteInputChannel

__all__ = [
    "DATA_PORT_CLIENT_MESSAGE_IDS",
    "ClientConnection",
    "ClientConnectionState",
    "ConnectionEvent",
    "ConnectionFailed",
    "HandshakeComplete",
    "MessageReceived",
    "PartitionRequestClientConnection",
]


class ClientConnectionState(Enum):
    CONNECTING = "connecting"  # no transport yet
    HANDSHAKING = "handshaking"  # ClientHello sent
    ESTABLISHED = "established"
    CLOSING = "closing"  # we are done (CloseRequest sent or transport closing)
    FAILED = "failed"  # an error ended it; the transport must be closed
    CLOSED = "closed"  # the transport is gone

    # Members are singletons: identity hashing, in C. (Enum's own ``__hash__`` is Python
    # code, run by every ``state in <frozenset>`` check on the receive path.)
    __hash__ = object.__hash__


_S = ClientConnectionState
_TRANSITIONS: Final[dict[ClientConnectionState, frozenset[ClientConnectionState]]] = {
    _S.CONNECTING: frozenset({_S.HANDSHAKING, _S.CLOSING, _S.FAILED, _S.CLOSED}),
    _S.HANDSHAKING: frozenset({_S.ESTABLISHED, _S.CLOSING, _S.FAILED, _S.CLOSED}),
    _S.ESTABLISHED: frozenset({_S.CLOSING, _S.FAILED, _S.CLOSED}),
    _S.CLOSING: frozenset({_S.FAILED, _S.CLOSED}),
    _S.FAILED: frozenset({_S.CLOSED}),
    _S.CLOSED: frozenset(),
}
_SENDING: Final = frozenset({_S.HANDSHAKING, _S.ESTABLISHED})
_RECEIVING: Final = frozenset({_S.HANDSHAKING, _S.ESTABLISHED, _S.CLOSING})
_LANDING: Final = frozenset({_S.ESTABLISHED, _S.CLOSING})

#: What a data-port client decodes; anything else from the daemon is a protocol error.
DATA_PORT_CLIENT_MESSAGE_IDS: Final = frozenset(
    {
        MessageId.SERVER_HELLO,
        MessageId.AUTH_OK,
        MessageId.BUFFER_RESPONSE,
        MessageId.ERROR_RESPONSE,
        MessageId.PING,
    }
)


# -- events -------------------------------------------------------------------------------


class ConnectionEvent:
    """Base of what ``events_received()`` returns."""

    __slots__ = ()


@dataclass(frozen=True, slots=True)
class HandshakeComplete(ConnectionEvent):
    authenticated: bool


@dataclass(frozen=True, slots=True)
class MessageReceived(ConnectionEvent):
    """A message after the handshake that this connection leaves to its user."""

    message: Message


@dataclass(frozen=True, slots=True)
class ConnectionFailed(ConnectionEvent):
    """The connection is dead: write ``data_to_send()`` (best effort) and close."""

    error: ExchangeError


# -- the generic client connection --------------------------------------------------------


class ClientConnection:
    """Handshake, framing and output of one client connection; no I/O."""

    def __init__(
        self,
        address: str,
        secret: bytes | None,
        max_frame_size: int,
        *,
        accept: Collection[int] | None = None,
        app_id: str = "",
    ) -> None:
        self.address = address
        self._handshake = ClientHandshake(secret, address=address, app_id=app_id)
        self._decoder = self._new_decoder(max_frame_size, accept)
        # The decoder's own method: the transport calls it twice per data frame.
        self.get_buffer: Callable[..., memoryview] = self._decoder.get_buffer
        self._out: list[Piece] = []
        self._events: list[ConnectionEvent] = []
        self.state = ClientConnectionState.CONNECTING
        self.error: ExchangeError | None = None

    def _new_decoder(
        self, max_frame_size: int, accept: Collection[int] | None
    ) -> InPlaceFrameDecoder:
        # Control frames only (a producer's credit, replies): a small scratch.
        return InPlaceFrameDecoder(max_frame_size, accept=accept, read_ahead=MAX_CONTROL_FRAME_SIZE)

    # -- state ---------------------------------------------------------------------------

    def _set_state(self, new: ClientConnectionState) -> None:
        if new not in _TRANSITIONS[self.state]:
            raise IllegalStateError(
                f"connection to {self.address}: {self.state.name} -> {new.name}"
            )
        self.state = new
        self._on_state(new)

    def _on_state(self, new: ClientConnectionState) -> None:
        """The state changed (a subclass's hook)."""

    @property
    def is_open(self) -> bool:
        """Handshaking or established, with no error."""
        return self.state in _SENDING

    @property
    def is_established(self) -> bool:
        return self.state is ClientConnectionState.ESTABLISHED

    @property
    def authenticated(self) -> bool:
        return self._handshake.authenticated

    @property
    def app_id(self) -> str:
        """The application this connection authenticates for ("": none)."""
        return self._handshake.app_id

    @property
    def bytes_received(self) -> int:
        return self._decoder.bytes_received

    @property
    def buffered(self) -> int:
        """Bytes of an incomplete frame (non-zero at EOF: the peer stopped mid-frame)."""
        return self._decoder.buffered

    # -- input ---------------------------------------------------------------------------

    def start(self) -> None:
        """The transport is up: queue the ClientHello."""
        self._set_state(ClientConnectionState.HANDSHAKING)
        for msg in self._handshake.start():
            self._out.extend(encode(msg))

    def buffer_updated(self, nbytes: int) -> bool:
        """``nbytes`` arrived in the last ``get_buffer()``; never raises an ExchangeError.

        Returns True when the I/O side has something to do: events to take or bytes to
        send (False for most reads: one call per received frame piece, nothing more).
        """
        try:
            items = self._decoder.buffer_updated(nbytes)
            if self.state in _RECEIVING:  # else failed or closed: what arrives is dropped
                self._deliver(items)
        except ExchangeError as e:
            self.fail(e)
        return bool(self._events) or bool(self._out)

    def receive_data(self, data: bytes | bytearray | memoryview) -> None:
        """Plain-``Protocol`` and test entry: copy ``data`` in as a transport would."""
        src = memoryview(data).cast("B")
        pos, n = 0, src.nbytes
        while pos < n and self.state in _RECEIVING:
            buf = self.get_buffer()
            k = min(buf.nbytes, n - pos)
            buf[:k] = src[pos : pos + k]
            pos += k
            self.buffer_updated(k)

    def _on_message(self, msg: Message) -> None:
        hs = self._handshake
        if not hs.is_established:
            for out in hs.receive(msg):
                self.send(out)
            if hs.is_established:
                self._set_state(ClientConnectionState.ESTABLISHED)
                self._events.append(HandshakeComplete(hs.authenticated))
            return
        if type(msg) is Ping:
            self.send(Pong())
            return
        self.on_message(msg)

    def on_message(self, msg: Message) -> None:
        """A message after the handshake; by default handed to the user as an event."""
        self._events.append(MessageReceived(msg))

    def _deliver(self, items: list[Message | PayloadReceived]) -> None:
        """Act on one read's frames, in order."""
        for item in items:
            if type(item) is PayloadReceived:  # pragma: no cover - no body sink here
                raise ProtocolError(f"unexpected data frame from {self.address}")
            assert isinstance(item, Message)
            self._on_message(item)

    # -- output --------------------------------------------------------------------------

    def send(self, msg: Message) -> None:
        """Queue ``msg`` (dropped once the connection is closing, failed or closed)."""
        if self.state in _SENDING:
            self._out.extend(encode(msg))

    def data_to_send(self) -> list[Piece]:
        """Pieces for ``transport.writelines`` (payloads are not copied)."""
        out, self._out = self._out, []
        return out

    def events_received(self) -> list[ConnectionEvent]:
        events, self._events = self._events, []
        return events

    @property
    def has_events(self) -> bool:
        return bool(self._events)

    def check(self) -> None:
        """Raise the connection's error, or TransportError if it cannot send."""
        if self.error is not None:
            raise fresh_error(self.error)
        if self.state not in _SENDING:
            raise TransportError(f"connection to daemon {self.address} is {self.state.value}")

    # -- ending --------------------------------------------------------------------------

    def fail(self, error: ExchangeError) -> None:
        """A connection-level failure: remember the first error and ask for a close."""
        if self.state in (ClientConnectionState.FAILED, ClientConnectionState.CLOSED):
            return
        if self.error is None:
            self.error = error
        self._decoder.abort()
        self._set_state(ClientConnectionState.FAILED)
        self._events.append(ConnectionFailed(error))

    def close(self) -> None:
        """We are done with the connection (the transport is being closed)."""
        if self.state in _SENDING or self.state is ClientConnectionState.CONNECTING:
            self._set_state(ClientConnectionState.CLOSING)

    def connection_lost(self, exc: BaseException | None = None) -> ExchangeError:
        """The transport is gone; returns the error whoever waits should get."""
        if self.state is ClientConnectionState.CLOSED:
            return self.error or TransportError(f"connection to daemon {self.address} closed")
        if self.error is None and self.state is not ClientConnectionState.CLOSING:
            self.error = TransportError(
                f"connection to daemon {self.address} lost" + (f": {exc}" if exc else "")
            )
        self._decoder.abort()
        self._set_state(ClientConnectionState.CLOSED)
        err = self.error or TransportError(f"connection to daemon {self.address} closed")
        self.on_connection_lost(err)
        return err

    def on_connection_lost(self, error: ExchangeError) -> None:
        """Fail whatever waits on this connection."""


# -- the data-port client -----------------------------------------------------------------


class PartitionRequestClientConnection(ClientConnection):
    """One connection to a daemon's data port, shared by RemoteInputChannels."""

    def __init__(
        self,
        address: str,
        secret: bytes | None,
        max_frame_size: int,
        *,
        read_timeout: float | None = None,
        app_id: str = "",
        shared_reads: bool = False,
    ) -> None:
        self._channels: dict[int, RemoteInputChannel] = {}
        # Payloads land in credited buffers of their channels and are handed on (compiled;
        # buffers taken for payloads not handed on yet are released if the connection dies)
        self._data = DataLanding(address, self._channels)
        accept: frozenset[int] = DATA_PORT_CLIENT_MESSAGE_IDS
        if shared_reads:
            accept = accept | {
                SharedArena.MESSAGE_ID,
                SharedBufferResponse.MESSAGE_ID,
                NoArena.MESSAGE_ID,
            }
        super().__init__(address, secret, max_frame_size, accept=accept, app_id=app_id)
        if read_timeout is not None and not (
            isinstance(read_timeout, int | float) and 0 < read_timeout < float("inf")
        ):
            raise UsageError(
                f"read_timeout must be a positive number of seconds, got {read_timeout!r}"
            )
        self.read_timeout = read_timeout
        # bytes_received when it last changed or no channel had credit out, and when
        self._progress_bytes = -1
        self._progress_at = 0.0
        self._next_id = 1
        self._credit_pending: list[RemoteInputChannel] = []
        #: shared memory: this connection may map an arena (and its segment size, once offered)
        self.shared_reads = shared_reads
        self._segment_size = 0
        self._offered = False

    def _new_decoder(
        self, max_frame_size: int, accept: Collection[int] | None
    ) -> InPlaceFrameDecoder:
        # BufferResponses: each read carries a batch of frames (DEFAULT_READ_AHEAD), parsed
        # in one call; payloads are copied from the read into their credited segments.
        return InPlaceFrameDecoder(
            max_frame_size, accept=accept, body_sink=self._data.sink, read_ahead=DEFAULT_READ_AHEAD
        )

    @property
    def num_channels(self) -> int:
        return len(self._channels)

    def channel(self, receiver_id: int) -> RemoteInputChannel | None:
        return self._channels.get(receiver_id)

    # -- receiving -----------------------------------------------------------------------

    def _on_state(self, new: ClientConnectionState) -> None:
        self._data.accepting = new in _LANDING
        self._data.sending = new in _SENDING  # shared segments released are given back

    @property
    def on_give_back_pending(self) -> Callable[[], None] | None:
        """Called when the first index is queued since the last flush (I/O side: flush)."""
        return self._data.on_give_back_pending

    @on_give_back_pending.setter
    def on_give_back_pending(self, callback: Callable[[], None] | None) -> None:
        self._data.on_give_back_pending = callback

    @property
    def segments_held(self) -> int:
        """Shared segments held now (received, not released)."""
        return self._data.segments_held

    @property
    def bytes_shared(self) -> int:
        """Payload bytes read in place from shared segments."""
        return self._data.bytes_shared

    def _deliver(self, items: list[Message | PayloadReceived]) -> None:
        self._data.deliver(items, self._on_message)  # type: ignore[arg-type]

    def on_message(self, msg: Message) -> None:
        if type(msg) is BufferResponse:
            self._on_buffer_response(msg)
        elif type(msg) is SharedBufferResponse:
            self._data.deliver_shared(msg.buffers)
        elif type(msg) is SharedArena:
            if self._offered or msg.segments:
                raise ProtocolError(f"unexpected SharedArena from daemon {self.address}")
            self._offered = True
            self._segment_size = msg.segment_size
            self._events.append(MessageReceived(msg))  # the I/O side fetches and maps it
        elif type(msg) is NoArena:
            self._events.append(MessageReceived(msg))
        elif type(msg) is ErrorResponse:
            self._on_error_response(msg)
        else:
            raise ProtocolError(f"unexpected {type(msg).__name__} from daemon {self.address}")

    def _on_buffer_response(self, msg: BufferResponse) -> None:
        """An event (or a data buffer for a receiver no longer here: dropped)."""
        ch = self._channels.get(msg.receiver_id)
        if ch is None:
            return
        if msg.data_type.is_buffer:  # only if the sink declined it, which it does not
            raise ProtocolError(f"data buffer for receiver {msg.receiver_id} not received in place")
        ch.on_buffer(Buffer.wrap(msg.payload, msg.data_type), msg.sequence_number, msg.backlog)

    # -- shared memory -------------------------------------------------------------------

    def request_arena(self) -> None:
        """Say this consumer can map its application's arena (a Unix socket only)."""
        if not self.shared_reads:
            raise UsageError("this connection reads no shared memory")
        self.send(RequestArena())

    def arena_mapped(self, arena: memoryview) -> None:
        """The offered arena is mapped (``arena``: all of it): tell the daemon."""
        if not self._offered or self._data.has_arena:
            raise IllegalStateError("arena_mapped without an offer, or twice")
        self._data.arena_mapped(arena, self._segment_size)
        self.send(ArenaMapped())

    def _flush_give_backs(self) -> None:
        pending = self._data.take_give_backs()
        if pending and self.state in _SENDING:
            self._out.append(encode_recycle(pending))

    def _on_error_response(self, msg: ErrorResponse) -> None:
        if msg.is_fatal:
            err = error_for_response(msg, self.address)
            if msg.code is ErrorCode.AUTH_FAILED and not isinstance(err, AuthenticationError):
                err = AuthenticationError(str(err))  # pragma: no cover - mapped already
            self.fail(err)
            return
        rid = msg.receiver_id
        assert rid is not None
        ch = self._channels.get(rid)
        if ch is None:
            return
        if msg.code is ErrorCode.PARTITION_NOT_FOUND:
            if ch.on_partition_not_found():
                return  # retried after the channel's backoff
            self._channels.pop(rid, None)
            return
        self._channels.pop(rid, None)
        ch.set_error(error_for_response(msg, self.address, ch.partition_id))

    # -- read timeout --------------------------------------------------------------------

    def credit_out(self) -> int:
        """Channels the daemon may send to now (announced credit not used yet)."""
        return sum(
            1 for ch in self._channels.values() if ch.num_available_buffers > ch.unannounced_credit
        )

    def check_read_timeout(self, now: float) -> bool:
        """Fail the connection (and return True) when nothing has arrived for
        ``read_timeout`` seconds of ``now``'s clock while a channel has credit out."""
        timeout = self.read_timeout
        if timeout is None or self.state is not ClientConnectionState.ESTABLISHED:
            return False
        received = self.bytes_received
        waiting = self.credit_out()
        if received != self._progress_bytes or not waiting:
            self._progress_bytes, self._progress_at = received, now
            return False
        if now - self._progress_at < timeout:
            return False
        self.fail(
            TransportError(
                f"nothing from daemon {self.address} for {now - self._progress_at:.1f}s "
                f"(read_timeout={timeout}s) while {waiting} channel(s) wait with credit"
            )
        )
        return True

    # -- PartitionRequestClient (what channels ask) ---------------------------------------

    def request_subpartition(self, channel: RemoteInputChannel) -> None:
        """Register ``channel`` (assigning its receiver id once) and ask for its data."""
        self.check()
        if not self.is_established:
            raise IllegalStateError(f"connection to {self.address} is not established yet")
        if channel.receiver_id < 0:
            channel.receiver_id = self._next_id
            self._next_id += 1
        self._channels[channel.receiver_id] = channel
        # what the channel's gate can lend it beyond its exclusive buffers: a daemon whose
        # reader reads in place lends that much to the producer's pool, no more
        floating = channel.gate.buffer_pool
        self.send(
            PartitionRequest(
                channel.partition_id,
                channel.subpartition_index,
                channel.receiver_id,
                channel.initial_credit,
                0 if floating is None else floating.max_segments,
            )
        )

    def notify_credit_available(self, channel: RemoteInputChannel) -> bool:
        """Note that ``channel`` has credit to announce; True if a flush must be scheduled
        (the first note since the last ``flush_credits``)."""
        first = not self._credit_pending
        self._credit_pending.append(channel)
        return first

    def flush_credits(self) -> None:
        """One RecycleSegments for the shared segments released, then one AddCredit per
        channel with all its unannounced credit."""
        if self._data.has_give_backs:
            self._flush_give_backs()
        pending, self._credit_pending = self._credit_pending, []
        channels = self._channels
        for ch in pending:
            credit = ch.get_and_reset_unannounced_credit()
            if credit > 0 and channels.get(ch.receiver_id) is ch:
                self.send(AddCredit(ch.receiver_id, credit))

    def resume_consumption(self, channel: RemoteInputChannel) -> None:
        if self._channels.get(channel.receiver_id) is channel:
            self.send(ResumeConsumption(channel.receiver_id))

    def notify_new_buffer_size(self, channel: RemoteInputChannel, size: int) -> None:
        if self._channels.get(channel.receiver_id) is channel:
            self.send(NewBufferSize(channel.receiver_id, size))

    def cancel_request(self, channel: RemoteInputChannel) -> None:
        if self._channels.pop(channel.receiver_id, None) is not None:
            self.send(CancelPartitionRequest(channel.receiver_id))

    def send_close_request(self) -> None:
        """Say goodbye: the daemon releases this connection's readers."""
        self.send(CloseRequest())
        self.close()

    # -- ending --------------------------------------------------------------------------

    def fail(self, error: ExchangeError) -> None:
        super().fail(error)
        self._release_landing()

    def on_connection_lost(self, error: ExchangeError) -> None:
        self._release_landing()
        self._data.drop_arena()  # (buffers still held keep their views)
        channels = list(self._channels.values())
        self._channels.clear()
        self._credit_pending.clear()
        for ch in channels:
            if not ch.finished and not ch.is_released:
                ch.set_error(error)

    def _release_landing(self) -> None:
        self._data.release_landing()
