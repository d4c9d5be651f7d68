"""ServerConnection: the server side of one data-port connection, sans I/O.

Flink's PartitionRequestServerHandler plus the Netty channel it runs on, without a socket
or an event loop. The asyncio protocol in ``server/`` hands it received bytes
(``receive_data``) and writability changes (``pause_writing`` / ``resume_writing``) and
nothing else; this object runs the handshake, decodes frames, refuses messages its role
does not accept, drives the connection's ``PartitionRequestQueue`` and recycles sent
buffers. The transport and the timers are injected (``ServerTransport``, ``Timers``: an
asyncio transport and event loop fit), so tests drive it with fakes.

Lifecycle, every transition in ``_transition``::

    HANDSHAKE --(handshake done)--> ESTABLISHED --(close / error)--> CLOSING --> CLOSED
        \\__________________(close / error)__________________/          ^
         \\_____________________(connection lost)_______________________/

Output: what one callback (received bytes, a deferred queue notification, ``resume_writing``,
the recycling timer) writes is gathered and written with one ``writelines`` when it returns
(one send syscall for many frames), or as soon as the output pending here and in the
transport reaches ``write_batch_bytes`` (the high watermark: Netty counts unflushed bytes
too), so the transport's watermarks still stop the queue; a write from outside these callbacks (the
local endpoint answering its producer) goes out at once.

Recycling: buffers are written zero-copy (``writelines([header, memoryview, ...])``), so a
buffer may only be recycled once the transport no longer holds its bytes. The transport
always holds the *last* ``get_write_buffer_size()`` bytes written, so a buffer whose frame
ended at or before ``bytes_written - get_write_buffer_size()`` is out: it is recycled on the
next write, on ``resume_writing``, or by a short timer while any are left.

Shared memory (a consumer on the daemon's Unix socket that mapped its application's
arena, ``read_arena``): a data buffer whose segment lies in that arena is sent as a
SharedBufferResponse (segment, offset, length) instead of its bytes, and held here until
the consumer gives it back by index (``give_back``, its RecycleSegments): never recycled
while the consumer may read it. ``connection_lost`` releases whatever it still held when
the consumer ended the connection (it closed, or died). When the *daemon* ended it (a
protocol error, no Pong within ``peer_timeout``, shutdown: ``dropped_by_daemon``) the
consumer's process may live on and still decode a batch from those segments: they go to
``keep_held`` instead, when set (the local endpoint pins them until that process exits,
``server.segment_pins``), and are never recycled here. A pipelined partition's buffers
lie in the arena when its producer wrote them there; a blocking partition's readers on
this connection read their data buffers from the file into spare segments of the arena
(``ArenaReads``), so they take the same path, with the same rules.

Keepalive: once established, the connection sends a ``Ping`` every ``peer_timeout / 2``
seconds while none is unanswered; a peer that has not answered with a ``Pong`` within
``peer_timeout`` of the ``Ping`` is aborted and its views and buffers are released. The
``Ping`` travels behind everything sent before it, so the rule catches a peer that stopped
reading (its TCP window closed, output no longer drained), a network that went silent and
a peer that sent half a frame and stopped (no ``Pong`` can follow the half frame); a
consumer that is merely slow or backpressured still reads its socket and answers.

Errors: a reader's view error fails that channel only (the queue's rule). A protocol
violation, and any unexpected error, in whatever callback it surfaces (received bytes, the
queue's deferred notifications, ``resume_writing``, the recycling timer), closes the
connection with a fatal ``ErrorResponse``: never an error swallowed by the event loop and a
connection that silently stops sending.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Any, Final, NamedTuple, Protocol

from exchange.buffers.buffer import Buffer
from exchange.errors import (
    IllegalStateError,
    LimitExceededError,
    PartitionError,
    ProtocolError,
    UsageError,
)
from exchange.memory.network_buffer_pool import NetworkBufferPool
from exchange.network.credit_based_view_reader import CreditBasedSequenceNumberingViewReader
from exchange.network.outbound import OutboundBatch
from exchange.network.partition_request_queue import PartitionRequestQueue
from exchange.partition.bounded_data import ReadMemory
from exchange.partition.result_partition_manager import ResultPartitionManager
from exchange.protocol.codec import (
    DEFAULT_READ_AHEAD,
    MAX_CONTROL_FRAME_SIZE,
    BodySink,
    DataFrameSpec,
    InPlaceFrameDecoder,
    PayloadReceived,
    encode,
)
from exchange.protocol.handshake import NonceFactory, ServerHandshake
from exchange.protocol.local_messages import (
    AbandonSubpartition,
    Released,
    ReleaseDataset,
)
from exchange.protocol.messages import (
    AddCredit,
    CancelPartitionRequest,
    CloseRequest,
    ErrorCode,
    ErrorResponse,
    Message,
    NewBufferSize,
    PartitionRequest,
    Ping,
    Pong,
    ResumeConsumption,
    error_response_for,
)

__all__ = [
    "DATA_PORT_MESSAGES",
    "ArenaReads",
    "Cancellable",
    "ServerConnection",
    "ServerConnectionSettings",
    "ServerConnectionState",
    "ServerConnectionStatistics",
    "ServerTransport",
    "Timers",
]

log = logging.getLogger("exchange.network.server")

#: What a client may send on the data port once the handshake is done.
DATA_PORT_MESSAGES: Final[frozenset[type[Message]]] = frozenset(
    {
        PartitionRequest,
        AddCredit,
        ResumeConsumption,
        NewBufferSize,
        CancelPartitionRequest,
        CloseRequest,
        ReleaseDataset,
        AbandonSubpartition,
    }
)


class ServerTransport(Protocol):
    """The byte sink of a connection (an ``asyncio.Transport`` is one)."""

    def writelines(self, list_of_data: Iterable[bytes | memoryview], /) -> None: ...

    def get_write_buffer_size(self) -> int: ...

    def is_closing(self) -> bool: ...

    def close(self) -> None: ...

    def abort(self) -> None: ...

    def can_write_eof(self) -> bool: ...

    def write_eof(self) -> None: ...


class Cancellable(Protocol):
    def cancel(self) -> None: ...


class Timers(Protocol):
    """Deferred calls (an asyncio event loop is one)."""

    def call_soon(self, callback: Callable[[], object], /) -> object: ...

    def call_later(self, delay: float, callback: Callable[[], object], /) -> Cancellable: ...


class ServerConnectionState(Enum):
    HANDSHAKE = "handshake"
    ESTABLISHED = "established"
    CLOSING = "closing"
    CLOSED = "closed"

    # Members are singletons: identity hashing, in C. (Enum's own ``__hash__`` is Python
    # code, run by every ``state in <frozenset>`` check on the receive path.)
    __hash__ = object.__hash__


_S = ServerConnectionState
_TRANSITIONS: Final[dict[ServerConnectionState, frozenset[ServerConnectionState]]] = {
    _S.HANDSHAKE: frozenset({_S.ESTABLISHED, _S.CLOSING, _S.CLOSED}),
    _S.ESTABLISHED: frozenset({_S.CLOSING, _S.CLOSED}),
    _S.CLOSING: frozenset({_S.CLOSED}),
    _S.CLOSED: frozenset(),
}
_OPEN: Final = frozenset({_S.HANDSHAKE, _S.ESTABLISHED})


@dataclass(frozen=True, slots=True)
class ServerConnectionSettings:
    """Per-connection settings, shared by every connection of a server.

    ``close_timeout``: how long a closing connection may take to flush its last bytes (an
    error, the shutdown notice) before it is aborted, so that a peer that stopped reading
    cannot keep a closed connection, and the buffers it holds, forever.
    ``max_requests``: partition requests open at once on one connection.
    ``peer_timeout``: a peer that does not answer a keepalive ``Ping`` within this many
    seconds (it stopped reading, or stopped mid-frame) is dropped; None: never.
    ``max_frame_size``: only control frames arrive on the server side; a small limit keeps
    hostile lengths cheap.
    """

    secret: bytes | None = None
    handshake_timeout: float = 10.0
    close_timeout: float = 1.0
    max_frame_size: int = MAX_CONTROL_FRAME_SIZE
    reap_interval: float = 0.005
    #: Output of one callback pending at most before it is written (one writelines).
    write_batch_bytes: int = 256 * 1024
    peer_timeout: float | None = 60.0
    #: Partition requests (readers) open at once on one connection; more are refused
    #: with LimitExceededError, per channel.
    max_requests: int = 512

    def __post_init__(self) -> None:
        if not isinstance(self.max_requests, int) or self.max_requests < 1:
            raise UsageError(f"max_requests must be a positive int, got {self.max_requests!r}")
        for name in ("handshake_timeout", "close_timeout", "reap_interval", "peer_timeout"):
            value = getattr(self, name)
            if name == "peer_timeout" and value is None:
                continue
            if not isinstance(value, int | float) or not 0 < value < float("inf"):
                raise UsageError(f"{name} must be a positive number of seconds, got {value!r}")


class ArenaReads:
    """The ``ReadMemory`` of a connection's blocking-partition readers: spare segments of
    the arena its consumer mapped (``read_arena``), none before it is mapped. Only
    segments no partition's pool can claim (``request_spare_segment``), so readers never
    take a writer's share; with none spare a buffer is read into the reader's own
    segments and goes as bytes (a reader never waits for the arena)."""

    __slots__ = ("_conn",)

    def __init__(self, conn: ServerConnection) -> None:
        self._conn = conn

    def request_buffer(self) -> Buffer | None:
        arena = self._conn.read_arena
        if arena is None or arena.is_destroyed:
            return None
        seg = arena.request_spare_segment()
        return None if seg is None else Buffer(seg, arena)


class ServerConnectionStatistics(NamedTuple):
    state: ServerConnectionState
    readers: int
    buffers_sent: int
    bytes_sent: int
    bytes_written: int
    in_flight_buffers: int
    paused_count: int


class ServerConnection:
    """One data-port connection: bytes in, frames out, sent buffers recycled.

    ``on_message`` handles every accepted message after the handshake; by default it is
    ``handle_message`` (the data protocol). A role that accepts more (the daemon's local
    endpoint) passes its own handler and ``accepted_messages`` and delegates the data
    protocol's messages to ``handle_message``.

    Input comes as ``get_buffer``/``buffer_updated`` (``asyncio.BufferedProtocol``'s pair)
    or ``receive_data``. A role that receives data frames (the local endpoint's PushBuffer)
    passes ``data_frames``, a ``body_sink`` (the header -> the view the payload lands in,
    or None to decode the frame as an ordinary message) and ``on_payload`` (a payload has
    landed): the kernel writes the payload straight into that view, no copy on the way.
    ``on_established`` is called once, when the handshake completes (the server's books:
    the connection no longer counts as unauthenticated).
    """

    def __init__(
        self,
        transport: ServerTransport,
        timers: Timers,
        manager: ResultPartitionManager,
        settings: ServerConnectionSettings | None = None,
        *,
        on_message: Callable[[Message], None] | None = None,
        accepted_messages: frozenset[type[Message]] = DATA_PORT_MESSAGES,
        release_dataset: Callable[[str, str], int] | None = None,
        nonce_factory: NonceFactory = os.urandom,
        peer: str = "?",
        data_frames: Mapping[int, DataFrameSpec] | None = None,
        body_sink: BodySink | None = None,
        on_payload: Callable[[Any, memoryview], None] | None = None,
        on_established: Callable[[], None] | None = None,
    ) -> None:
        if (body_sink is None) != (on_payload is None) or (body_sink is None) != (
            data_frames is None
        ):
            raise UsageError("data_frames, body_sink and on_payload go together")
        self._settings = settings = settings if settings is not None else _DEFAULT_SETTINGS
        self._transport = transport
        self._timers = timers
        self._manager = manager
        self._on_message = on_message if on_message is not None else self.handle_message
        self._accepted = accepted_messages
        self._release_dataset = (
            release_dataset
            if release_dataset is not None
            else lambda ds, app: manager.release_dataset(ds, app_id=app)
        )
        self.peer = peer
        self._state = ServerConnectionState.HANDSHAKE
        # A role that receives data frames reads batches of them (256 KiB per read); a
        # control-only role (the data port's inbound side) keeps a small scratch.
        self._decoder = InPlaceFrameDecoder(
            settings.max_frame_size,
            body_sink=body_sink,
            data_frames=data_frames,
            read_ahead=DEFAULT_READ_AHEAD if body_sink is not None else MAX_CONTROL_FRAME_SIZE,
        )
        self._on_payload = on_payload
        self._on_established = on_established
        #: Where the transport writes the next received bytes: a payload's own segment
        #: while one lands, scratch space otherwise (the decoder's method, called as is).
        self.get_buffer: Callable[..., memoryview] = self._decoder.get_buffer
        self._handshake = ServerHandshake(settings.secret, nonce_factory=nonce_factory)
        #: False between ``pause_writing`` and ``resume_writing``, and once the connection
        #: is lost (a plain attribute: the send loop reads it per buffer).
        self.is_writable = True
        self.queue = PartitionRequestQueue(self, self._schedule)
        # Output of the current callback, written with one writelines when it returns
        # (``corked`` > 0 inside a callback) or once ``write_batch_bytes`` are pending,
        # and the buffers in flight: compiled (outbound.pyx), its ``send_buffer`` is the
        # queue's, called as is (no Python frame per buffer sent).
        self._ob = ob = OutboundBatch(self, transport, settings.write_batch_bytes)
        self.send_buffer: Callable[[int, int, int, Buffer], None] = ob.send_buffer
        # (end offset of the frame in the byte stream, receiver id, buffer)
        self._in_flight = ob.in_flight
        self._reap_timer: Cancellable | None = None
        self._abort_timer: Cancellable | None = None
        self._eof_written = False  # half-closed: our EOF is out (see ``close``)
        self._handshake_timer: Cancellable | None = timers.call_later(
            settings.handshake_timeout, self._on_handshake_timeout
        )
        self._keepalive_timer: Cancellable | None = None
        # keepalive ticks (every peer_timeout / 2) since the unanswered Ping went out
        self._ping_ticks: int | None = None
        self.paused_count = 0
        #: The application the peer authenticated for ("": none); see ``check_access``.
        self.app_id = ""
        #: True once the peer was dropped for not answering a Ping in time.
        self.timed_out = False
        #: True once this side ended the connection (close or abort) other than at the
        #: peer's CloseRequest: the peer may live on (see ``keep_held``).
        self.dropped_by_daemon = False
        #: Takes the segments still held when the daemon dropped the connection (None:
        #: they are recycled with the rest, as when the consumer ended it).
        self.keep_held: Callable[[list[Buffer]], None] | None = None
        self._peer_closed = False  # the peer said CloseRequest
        #: The shared arena the consumer mapped (None: data buffers go as bytes).
        self._arena_reads: ReadMemory = ArenaReads(self)

    @property
    def num_held(self) -> int:
        """Buffers sent as descriptors and not given back yet."""
        return self._ob.num_held

    @property
    def bytes_shared(self) -> int:
        """Payload bytes sent as descriptors into ``read_arena`` (not over the socket)."""
        return self._ob.bytes_shared

    # -- lifecycle -----------------------------------------------------------------------

    @property
    def state(self) -> ServerConnectionState:
        return self._state

    @property
    def read_arena(self) -> NetworkBufferPool | None:
        """The shared arena the consumer mapped (None: data buffers go as bytes)."""
        return self._ob.arena

    @read_arena.setter
    def read_arena(self, arena: NetworkBufferPool | None) -> None:
        self._ob.arena = arena

    def _transition(self, to: ServerConnectionState) -> None:
        if to not in _TRANSITIONS[self._state]:
            raise IllegalStateError(f"connection {self.peer}: {self._state.name} -> {to.name}")
        self._state = to
        self._ob.established = to is ServerConnectionState.ESTABLISHED

    # -- input ---------------------------------------------------------------------------

    def buffer_updated(self, nbytes: int) -> None:
        """``nbytes`` were written into the last ``get_buffer()``: handle what completed."""
        if self._state not in _OPEN:
            return  # closing: nothing the peer says matters any more
        self._decode(self._decoder.buffer_updated, nbytes)

    def receive_data(self, data: bytes | bytearray | memoryview) -> None:
        """Feed received bytes (copied in as a transport would): frames are decoded and
        handled at once."""
        if self._state not in _OPEN:
            return
        self._decode(self._decoder.feed, data)

    def _decode(self, step: Callable[[Any], list[Message | PayloadReceived]], arg: Any) -> None:
        """Decode, handle what completed, write what that produced (one ``writelines``).

        Runs for every read of the transport (twice per pushed data frame): one function.
        """
        self._ob.corked += 1
        try:
            try:
                for item in step(arg):
                    if type(item) is PayloadReceived:
                        assert self._on_payload is not None
                        self._on_payload(item.header, item.payload)
                    else:
                        self._receive(item)  # type: ignore[arg-type]
                    if self._state not in _OPEN:
                        break
            except ProtocolError as e:
                log.warning("protocol error from %s: %s", self.peer, e)
                resp = self._handshake.error_response
                self.close_with(resp if resp is not None else error_response_for(e))
            except Exception as e:
                self._fail(e)
            if self._ob.out or self._ob.descriptors:
                self._flush_or_fail()
        finally:
            self._ob.corked -= 1
            if self._ob.corked == 0 and (self._ob.out or self._ob.descriptors):
                self._uncork_flush()

    def _receive(self, msg: Message) -> None:
        if self._state is ServerConnectionState.HANDSHAKE:
            hs = self._handshake
            for out in hs.receive(msg):
                self.send(out)
            if hs.is_established:
                self.app_id = hs.app_id
                self._cancel_handshake_timer()
                self._transition(ServerConnectionState.ESTABLISHED)
                self._arm_keepalive()
                if self._on_established is not None:
                    self._on_established()
            return
        if type(msg) is Pong:
            self._ping_ticks = None
            return
        if type(msg) not in self._accepted:
            raise ProtocolError(f"{type(msg).__name__} is not accepted on this connection")
        self._on_message(msg)

    def handle_message(self, msg: Message) -> None:
        """The data protocol: requests, credit, cancellation, close, dataset release,
        abandoned subpartitions."""
        if type(msg) is AddCredit:  # the one per give-back or buffer batch: no match
            self.queue.add_credit(msg.receiver_id, msg.credit)
            return
        match msg:
            case PartitionRequest():
                self._on_partition_request(msg)
            case AddCredit(receiver_id=rid, credit=credit):
                self.queue.add_credit(rid, credit)
            case ResumeConsumption(receiver_id=rid):
                self.queue.resume_consumption(rid)
            case NewBufferSize(receiver_id=rid, buffer_size=size):
                self.queue.notify_new_buffer_size(rid, size)
            case CancelPartitionRequest(receiver_id=rid):
                self.queue.cancel(rid)
            case CloseRequest():
                self._peer_closed = True
                self.close()
            case ReleaseDataset(dataset_id=ds):
                self.send(Released(self._release_dataset(ds, self.app_id)))
            case AbandonSubpartition(dataset_id=ds, subpartition=k):
                # the caller's application only: another's partitions are not touched
                self.send(Released(self._manager.abandon_subpartition(ds, k, self.app_id)))
            case _:
                raise ProtocolError(f"unexpected {type(msg).__name__} from a client")

    def give_back(self, segments: Iterable[int]) -> None:
        """The consumer is done with these segments of SharedBufferResponses (one index
        per buffer): recycle them. ProtocolError for a segment it does not hold."""
        self._ob.give_back(segments)  # compiled: one C loop

    def _release_held(self) -> None:
        ob = self._ob
        held, ob.held = ob.held, {}
        ob.num_held = 0
        keep = self.keep_held
        if held and keep is not None and self.dropped_by_daemon:
            # the consumer's process may still read them: out of our hands, never recycled
            keep([buf for entries in held.values() for _, buf in entries])
            return
        for entries in held.values():
            for rid, buf in entries:
                try:
                    buf.release()
                except Exception:
                    log.exception(
                        "%s: recycling a held buffer of receiver %d failed", self.peer, rid
                    )

    def _on_partition_request(self, req: PartitionRequest) -> None:
        rid = req.receiver_id
        if self.queue.get_reader(rid) is not None:
            raise ProtocolError(f"receiver id {rid} is already in use on this connection")
        limit = self._settings.max_requests
        if self.queue.num_readers >= limit:
            err = LimitExceededError(
                f"{self.queue.num_readers} partition requests are open on this connection",
                req.partition_id,
                setting="max_requests_per_connection",
                limit=limit,
            )
            self.send(error_response_for(err, rid))
            return
        reader = CreditBasedSequenceNumberingViewReader(rid, req.initial_credit, self.queue)
        self.queue.add_reader(reader)
        try:  # the connection's application's partition: another's is "not found"
            reader.request_subpartition_view(
                self._manager,
                req.partition_id,
                req.subpartition_index,
                self.app_id,
                self._arena_reads,
            )
        except Exception as e:
            # That one channel fails; typed errors keep their code for the client.
            if not isinstance(e, PartitionError):
                log.exception("%s: opening %s failed", self.peer, req.partition_id)
            self.queue.cancel(rid)
            self.send(error_response_for(e, rid))
            return
        log.debug("%s requested %s[%d]", self.peer, req.partition_id, req.subpartition_index)

    # -- writability ---------------------------------------------------------------------

    def pause_writing(self) -> None:
        """The transport crossed its high watermark: the queue stops."""
        self.is_writable = False
        self.paused_count += 1

    def resume_writing(self) -> None:
        """Below the low watermark again: recycle what went out, send on."""
        self.is_writable = True
        self._guarded(self._on_writable)

    def _on_writable(self) -> None:
        self._reap()
        self.queue.write_and_flush_next()

    # -- output (the queue's OutboundChannel) --------------------------------------------

    # ``send_buffer`` (an instance attribute): the compiled ``OutboundBatch.send_buffer``
    # writes one BufferResponse, zero-copy; ``buf`` is recycled once written out. A data
    # buffer in the consumer's mapped arena comes back here:

    def send(self, message: Message) -> None:
        """Write a control message (dropped once the transport is closing)."""
        if self._write_closed():
            return
        if self._ob.descriptors:
            self._ob.frame_descriptors()
        pieces = encode(message)
        self._ob.out.extend(pieces)
        self._ob.out_bytes += sum(map(len, pieces))
        if not self._ob.corked:
            self._flush()

    def _write_closed(self) -> bool:
        """Nothing more may be written: closed, closing, or our EOF is out."""
        return (
            self._state is ServerConnectionState.CLOSED
            or self._eof_written
            or self._transport.is_closing()
        )

    def _flush(self) -> None:
        """One ``writelines`` for everything written since the last one (per callback)."""
        ob = self._ob
        if ob.descriptors:
            ob.frame_descriptors()
        out = ob.out
        if not out:
            return
        buffers = ob.buffers
        out_bytes = ob.out_bytes
        ob.out, ob.out_bytes, ob.buffers = [], 0, []
        transport = self._transport
        if self._write_closed():
            ob.recycle(buffers)  # never taken over: ours to recycle
            return
        try:
            transport.writelines(out)
        except BaseException:
            ob.recycle(buffers)
            raise
        ob.bytes_written += out_bytes
        if not buffers:
            return
        if transport.get_write_buffer_size() == 0:
            ob.recycle(buffers)
            if self._in_flight:
                self._reap()
        else:
            self._in_flight.extend(buffers)
            self._reap()

    def _flush_or_fail(self) -> None:
        try:
            self._flush()
        except Exception as e:
            self._fail(e)

    def _uncork(self) -> None:
        self._ob.corked -= 1
        if self._ob.corked == 0 and (self._ob.out or self._ob.descriptors):
            self._uncork_flush()

    def _uncork_flush(self) -> None:
        try:
            self._flush()
        except Exception:
            log.exception("connection %s: writing failed", self.peer)
            self.abort()

    def _reap(self) -> None:
        """Recycle the buffers whose bytes the transport has sent."""
        left = self._ob.reap(self._ob.bytes_written - self._transport.get_write_buffer_size())
        if left and self._reap_timer is None and self._state is not _S.CLOSED:
            self._reap_timer = self._timers.call_later(
                self._settings.reap_interval, self._on_reap_timer
            )

    def _on_reap_timer(self) -> None:
        self._reap_timer = None
        self._guarded(self._reap)

    def _recycle(self, receiver_id: int, buf: Buffer) -> None:
        # Recycling runs the view's memory callback (a blocking partition's file reader
        # reads ahead into the freed segment), which may raise: that is the channel's error.
        try:
            buf.release()
        except Exception as e:
            self.queue.fail_reader(receiver_id, e)

    # -- deferred work -------------------------------------------------------------------

    def _schedule(self, callback: Callable[[], None]) -> None:
        """The queue's ``schedule``: later, and an error there is fatal, not swallowed."""
        self._timers.call_soon(lambda: self._guarded(callback))

    def _guarded(self, callback: Callable[[], None]) -> None:
        if self._state is ServerConnectionState.CLOSED:
            return
        self._ob.corked += 1
        try:
            callback()
            self._flush()
        except Exception as e:
            self._fail(e)
        finally:
            self._uncork()

    def _fail(self, exc: Exception) -> None:
        """An unexpected error: fatal for the connection, and the peer is told if the
        transport still works (if it does not, the connection is aborted)."""
        log.error("connection %s failed", self.peer, exc_info=exc)
        try:
            self.close_with(ErrorResponse(ErrorCode.INTERNAL, f"{type(exc).__name__}: {exc}"))
        except Exception:
            log.exception("connection %s: closing after an error failed", self.peer)
            self.abort()

    def _on_handshake_timeout(self) -> None:
        self._handshake_timer = None
        if self._state is ServerConnectionState.HANDSHAKE:
            self.close_with_error(ErrorCode.PROTOCOL_ERROR, "handshake timed out")

    def _arm_keepalive(self) -> None:
        timeout = self._settings.peer_timeout
        if timeout is not None and self._state is ServerConnectionState.ESTABLISHED:
            self._keepalive_timer = self._timers.call_later(timeout / 2, self._on_keepalive)

    def _on_keepalive(self) -> None:
        """Every ``peer_timeout / 2``: a Ping, unless one is out; a Ping out for two ticks
        (``peer_timeout``) drops the peer."""
        self._keepalive_timer = None
        if self._state is not ServerConnectionState.ESTABLISHED:
            return
        ticks = self._ping_ticks
        if ticks is None:
            self._ping_ticks = 0
            self._guarded(lambda: self.send(Ping()))
        elif ticks + 1 >= 2:
            self._on_peer_timeout()
            return
        else:
            self._ping_ticks = ticks + 1
        self._arm_keepalive()

    def _on_peer_timeout(self) -> None:
        log.warning(
            "connection %s: no Pong within peer_timeout=%ss (the peer stopped reading or "
            "stopped mid-frame): dropped, %d readers released",
            self.peer,
            self._settings.peer_timeout,
            self.queue.num_readers,
        )
        self.timed_out = True
        self.abort()  # the peer does not read: nothing more is worth flushing

    def _cancel_keepalive_timer(self) -> None:
        timer, self._keepalive_timer = self._keepalive_timer, None
        if timer is not None:
            timer.cancel()

    def _cancel_handshake_timer(self) -> None:
        timer, self._handshake_timer = self._handshake_timer, None
        if timer is not None:
            timer.cancel()

    # -- closing -------------------------------------------------------------------------

    def close_with_error(self, code: ErrorCode, message: str) -> None:
        self.close_with(ErrorResponse(code, message))

    def close_with(self, resp: ErrorResponse) -> None:
        """Send ``resp`` (best effort), then close."""
        self.send(resp)
        self.close()

    def close(self) -> None:
        """Close once the bytes already written are out; the readers are released now.

        Half-closes where the transport can (TLS cannot): our FIN follows the last bytes
        while what the peer still sends is read and dropped, and the transport closes at
        the peer's EOF. A full close with the peer's bytes unread (credits in flight, say)
        makes the kernel answer with a reset, which can destroy our last bytes (an
        ErrorResponse saying why) before the peer reads them. A peer that does not read
        those bytes and close within ``close_timeout`` is aborted.
        """
        if self._state not in _OPEN:
            return
        self.dropped_by_daemon = not self._peer_closed
        self._transition(ServerConnectionState.CLOSING)
        self._cancel_handshake_timer()
        self._cancel_keepalive_timer()
        self._decoder.abort()  # a payload being landed is never written again
        # Nothing more will be sent: the views go now, not when the peer has read the rest.
        self.queue.release_all()
        try:
            self._flush()  # what this callback wrote so far goes out before the close
        except Exception:
            log.exception("connection %s: writing its last bytes failed", self.peer)
            self._discard_output()
        t = self._transport
        if t.can_write_eof():
            try:
                t.write_eof()
            except OSError:  # the peer is gone already (its reset not processed yet)
                t.abort()
                return
            self._eof_written = True
        else:
            t.close()
        self._abort_timer = self._timers.call_later(self._settings.close_timeout, self.abort)

    def abort(self) -> None:
        """Drop the connection without flushing (``connection_lost`` releases the rest)."""
        self._abort_timer = None
        if self._state is ServerConnectionState.CLOSED:
            return
        if self._state is not ServerConnectionState.CLOSING:
            self.dropped_by_daemon = True
            self._transition(ServerConnectionState.CLOSING)
            self._cancel_handshake_timer()
            self._cancel_keepalive_timer()
            self._decoder.abort()
            self.queue.release_all()
        self._discard_output()
        self._transport.abort()

    def connection_lost(self, exc: BaseException | None = None) -> None:
        """The transport is gone: release every view and every buffer still in flight."""
        if self._state is ServerConnectionState.CLOSED:
            return
        self._transition(ServerConnectionState.CLOSED)
        self._decoder.abort()
        self.is_writable = False
        timers = (self._handshake_timer, self._reap_timer, self._abort_timer, self._keepalive_timer)
        for timer in timers:
            if timer is not None:
                timer.cancel()
        self._handshake_timer = self._reap_timer = self._abort_timer = None
        self._keepalive_timer = None
        self.queue.release_all()
        self._discard_output()
        self._release_held()  # back to the pool, or kept while the consumer may read it
        in_flight = self._in_flight
        while in_flight:
            _, rid, buf = in_flight.popleft()
            try:
                buf.release()
            except Exception:
                log.exception("%s: recycling a buffer of receiver %d failed", self.peer, rid)

    def _discard_output(self) -> None:
        """Drop output not written yet; its buffers are recycled (descriptors not written
        yet stay held: ``connection_lost`` returns them)."""
        self._ob.descriptors = []
        buffers = self._ob.buffers
        self._ob.out, self._ob.out_bytes, self._ob.buffers = [], 0, []
        for _, rid, buf in buffers:
            try:
                buf.release()
            except Exception:
                log.exception("%s: recycling a buffer of receiver %d failed", self.peer, rid)

    # -- statistics ----------------------------------------------------------------------

    def statistics(self) -> ServerConnectionStatistics:
        q = self.queue
        return ServerConnectionStatistics(
            self._state,
            q.num_readers,
            q.buffers_sent,
            q.bytes_sent,
            self._ob.bytes_written,
            len(self._in_flight),
            self.paused_count,
        )

    def __repr__(self) -> str:
        readers = self.queue.num_readers
        return f"ServerConnection({self.peer}, {self._state.name}, readers={readers})"


_DEFAULT_SETTINGS: Final = ServerConnectionSettings()
