"""The data port: serves PartitionRequests to remote RemoteInputChannels.

One ``PartitionRequestServerProtocol`` per connection (Flink's PartitionRequestServerHandler
plus Netty's channel): it feeds received bytes to the sans-I/O ``FrameDecoder``, runs the
handshake, and hands requests, credits and cancellations to the connection's
``PartitionRequestQueue``, which decides what to send.

Writability is Netty's: ``transport.set_write_buffer_limits(high, low)``; asyncio calls
``pause_writing`` above the high watermark (the channel is unwritable and the queue stops)
and ``resume_writing`` below the low one (``channelWritabilityChanged``: the queue goes on).

Buffers are written zero-copy (``writelines([header, memoryview])``), so a buffer may only
be recycled when the transport no longer holds its bytes. The transport always holds the
*last* ``get_write_buffer_size()`` bytes written, so a buffer whose frame ended at or before
``bytes_written - get_write_buffer_size()`` is out and is recycled then.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable
from typing import Final, cast

from exchange.buffers.buffer import Buffer
from exchange.errors import (
    ExchangeError,
    PartitionError,
    ProtocolError,
    UsageError,
)
from exchange.network.credit_based_view_reader import CreditBasedSequenceNumberingViewReader
from exchange.network.partition_request_queue import PartitionRequestQueue
from exchange.partition.result_partition_manager import ResultPartitionManager
from exchange.protocol.codec import FrameDecoder, encode, encode_buffer_response_header
from exchange.protocol.handshake import ServerHandshake
from exchange.protocol.local_messages import Released, ReleaseDataset
from exchange.protocol.messages import (
    AddCredit,
    CancelPartitionRequest,
    CloseRequest,
    ErrorCode,
    ErrorResponse,
    Message,
    NewBufferSize,
    PartitionRequest,
    ResumeConsumption,
    error_response_for,
)

__all__ = ["DataServer", "PartitionRequestServerProtocol"]

log = logging.getLogger("exchange.server.data")

_REAP_INTERVAL: Final = 0.005


class DataServer:
    """The TCP server of one daemon's data port."""

    def __init__(
        self,
        manager: ResultPartitionManager,
        *,
        segment_size: int,
        secret: bytes | None = None,
        high_watermark: int | None = None,
        low_watermark: int | None = None,
        max_connections: int = 1024,
        handshake_timeout: float = 10.0,
        max_frame_size: int | None = None,
        release_dataset: Callable[[str], int] | None = None,
        close_timeout: float = 1.0,
    ) -> None:
        self.manager = manager
        self.release_dataset = (
            release_dataset if release_dataset is not None else (manager.release_dataset)
        )
        self.segment_size = segment_size
        self.secret = secret
        self.high_watermark = high_watermark if high_watermark is not None else 2 * segment_size
        self.low_watermark = low_watermark if low_watermark is not None else segment_size + 1
        if not 0 <= self.low_watermark < self.high_watermark:
            raise UsageError(
                f"need 0 <= low watermark < high watermark, got {self.low_watermark}, "
                f"{self.high_watermark}"
            )
        self.max_connections = max_connections
        self.handshake_timeout = handshake_timeout
        # How long a closing connection may take to flush its last bytes (an error, the
        # shutdown notice) before it is aborted: a peer that stopped reading must not
        # keep a closed connection, and the buffers it holds, forever.
        self.close_timeout = close_timeout
        # Control frames only arrive here; a small limit keeps hostile lengths cheap.
        self.max_frame_size = max_frame_size if max_frame_size is not None else 4096
        self.connections: set[PartitionRequestServerProtocol] = set()
        self._server: asyncio.Server | None = None
        self.total_connections = 0
        self.rejected_connections = 0
        # what connections sent before they closed (the counters are cumulative)
        self.closed_bytes_sent = 0
        self.closed_buffers_sent = 0

    async def start(self, host: str, port: int) -> tuple[str, int]:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            self.protocol_factory, host, port, reuse_address=True
        )
        sock = self._server.sockets[0].getsockname()
        return str(sock[0]), int(sock[1])

    def protocol_factory(self) -> PartitionRequestServerProtocol:
        return PartitionRequestServerProtocol(self)

    @property
    def address(self) -> tuple[str, int] | None:
        if self._server is None or not self._server.sockets:
            return None
        sock = self._server.sockets[0].getsockname()
        return str(sock[0]), int(sock[1])

    def stop_accepting(self) -> None:
        if self._server is not None:
            self._server.close()

    async def close(self) -> None:
        """Stop accepting and close every connection (its views are released).

        Returns once every connection is gone: one whose peer does not read its last bytes
        is aborted after ``close_timeout``.
        """
        self.stop_accepting()
        for conn in list(self.connections):
            conn.close_with_error(ErrorCode.SERVER_SHUTDOWN, "daemon is shutting down")
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.close_timeout
        while self.connections and loop.time() < deadline:
            await asyncio.sleep(0.005)
        for conn in list(self.connections):
            conn.abort()
        if self._server is not None:
            await self._server.wait_closed()
            self._server = None
        # Let connection_lost callbacks run.
        for _ in range(3):
            if not self.connections:
                break
            await asyncio.sleep(0)

    def stats(self) -> dict[str, int]:
        return {
            "connections": len(self.connections),
            "total_connections": self.total_connections,
            "rejected_connections": self.rejected_connections,
            "readers": sum(c.queue.num_readers for c in self.connections),
            "bytes_sent": self.closed_bytes_sent
            + sum(c.queue.bytes_sent for c in self.connections),
            "buffers_sent": self.closed_buffers_sent
            + sum(c.queue.buffers_sent for c in self.connections),
        }


class PartitionRequestServerProtocol(asyncio.Protocol):
    """One client connection."""

    def __init__(self, server: DataServer) -> None:
        self._server = server
        self._loop = asyncio.get_running_loop()
        self._transport: asyncio.Transport | None = None
        self._decoder = FrameDecoder(server.max_frame_size)
        self._handshake = ServerHandshake(server.secret)
        self._handshake_timer: asyncio.TimerHandle | None = None
        self._writable = True
        self._closing = False
        self.queue = PartitionRequestQueue(self, self._loop.call_soon)
        self._bytes_written = 0
        self._in_flight: deque[tuple[int, Buffer]] = deque()
        self._reap_timer: asyncio.TimerHandle | None = None
        self._abort_timer: asyncio.TimerHandle | None = None
        self.paused_count = 0
        self.peer = "?"

    # -- asyncio.Protocol ----------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport = cast(asyncio.Transport, transport)
        peer = transport.get_extra_info("peername")
        self.peer = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else str(peer)
        srv = self._server
        srv.total_connections += 1
        if len(srv.connections) >= srv.max_connections:
            srv.rejected_connections += 1
            self.close_with_error(
                ErrorCode.TOO_MANY_CONNECTIONS,
                f"too many connections (limit {srv.max_connections})",
            )
            return
        srv.connections.add(self)
        transport.set_write_buffer_limits(high=srv.high_watermark, low=srv.low_watermark)
        self._handshake_timer = self._loop.call_later(
            srv.handshake_timeout, self._on_handshake_timeout
        )

    def data_received(self, data: bytes) -> None:
        if self._closing:
            return
        try:
            messages = self._decoder.feed(data)
            for msg in messages:
                self._dispatch(msg)
                if self._closing:
                    return
        except ProtocolError as e:
            log.warning("protocol error from %s: %s", self.peer, e)
            resp = self._handshake.error_response if not self._handshake.is_established else None
            if resp is None:
                resp = error_response_for(e)
            self._close_with(resp)
        except ExchangeError as e:  # a bug in a request's handling must not kill others
            log.exception("error handling data from %s", self.peer)
            self._close_with(ErrorResponse(ErrorCode.INTERNAL, str(e)))

    def pause_writing(self) -> None:
        self._writable = False
        self.paused_count += 1

    def resume_writing(self) -> None:
        self._writable = True
        self._reap()
        self.queue.write_and_flush_next()

    def connection_lost(self, exc: Exception | None) -> None:
        self._closing = True
        self._writable = False
        if self in self._server.connections:
            self._server.connections.discard(self)
            self._server.closed_bytes_sent += self.queue.bytes_sent
            self._server.closed_buffers_sent += self.queue.buffers_sent
        for timer in (self._handshake_timer, self._reap_timer, self._abort_timer):
            if timer is not None:
                timer.cancel()
        self.queue.release_all()
        while self._in_flight:
            self._in_flight.popleft()[1].release()
        self._transport = None

    # -- dispatch ------------------------------------------------------------------------

    def _dispatch(self, msg: Message) -> None:
        hs = self._handshake
        if not hs.is_established:
            for out in hs.receive(msg):
                self.send(out)
            if hs.is_established and self._handshake_timer is not None:
                self._handshake_timer.cancel()
                self._handshake_timer = None
            return
        self.on_message(msg)

    def on_message(self, msg: Message) -> None:
        """Handle one message after the handshake (subclasses add message types)."""
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
                self.close()
            case ReleaseDataset(dataset_id=ds):
                self.send(Released(self._server.release_dataset(ds)))
            case _:
                raise ProtocolError(f"unexpected {type(msg).__name__} from a client")

    def _on_partition_request(self, req: PartitionRequest) -> None:
        rid = req.receiver_id
        if self.queue.get_reader(rid) is not None:
            raise ProtocolError(f"receiver id {rid} is already in use on this connection")
        reader = CreditBasedSequenceNumberingViewReader(rid, req.initial_credit, self.queue)
        self.queue.add_reader(reader)
        try:
            reader.request_subpartition_view(
                self._server.manager, req.partition_id, req.subpartition_index
            )
        except PartitionError as e:
            self.queue.cancel(rid)
            self.send(error_response_for(e, rid))
            return
        log.debug("%s requested %s[%d]", self.peer, req.partition_id, req.subpartition_index)

    def _on_handshake_timeout(self) -> None:
        self._handshake_timer = None
        if not self._handshake.is_established and not self._closing:
            self.close_with_error(ErrorCode.PROTOCOL_ERROR, "handshake timed out")

    # -- OutboundChannel -----------------------------------------------------------------

    @property
    def is_writable(self) -> bool:
        return self._writable

    def send_buffer(
        self, receiver_id: int, sequence_number: int, backlog: int, buf: Buffer
    ) -> None:
        transport = self._transport
        if transport is None or self._closing:
            buf.release()
            return
        size = buf.size
        header = encode_buffer_response_header(
            receiver_id, sequence_number, backlog, buf.data_type, buf.compressed, size
        )
        transport.writelines((header, buf.memoryview()))
        self._bytes_written += len(header) + size
        if transport.get_write_buffer_size() == 0:
            buf.release()
            if self._in_flight:
                self._reap()
        else:
            self._in_flight.append((self._bytes_written, buf))
            self._reap()

    def send(self, message: Message) -> None:
        transport = self._transport
        if transport is None or transport.is_closing():
            return
        pieces = encode(message)
        transport.writelines(pieces)
        self._bytes_written += sum(len(p) for p in pieces)

    def _reap(self) -> None:
        """Recycle buffers whose bytes the transport has sent."""
        in_flight = self._in_flight
        transport = self._transport
        if transport is None:
            return
        sent = self._bytes_written - transport.get_write_buffer_size()
        while in_flight and in_flight[0][0] <= sent:
            in_flight.popleft()[1].release()
        if in_flight and self._reap_timer is None:
            self._reap_timer = self._loop.call_later(_REAP_INTERVAL, self._on_reap_timer)

    def _on_reap_timer(self) -> None:
        self._reap_timer = None
        self._reap()

    # -- closing -------------------------------------------------------------------------

    def close_with_error(self, code: ErrorCode, message: str) -> None:
        self._close_with(ErrorResponse(code, message))

    def _close_with(self, resp: ErrorResponse) -> None:
        self.send(resp)
        self.close()

    def close(self) -> None:
        """Close once the bytes already written are out; the readers are released now."""
        if self._closing:
            return
        self._closing = True
        # Nothing more will be sent: the views go now, not when the peer has read the rest.
        self.queue.release_all()
        transport = self._transport
        if transport is not None:
            transport.close()
            self._abort_timer = self._loop.call_later(self._server.close_timeout, self.abort)

    def abort(self) -> None:
        """Drop the connection without flushing (connection_lost releases its buffers)."""
        self._closing = True
        transport = self._transport
        if transport is not None:
            transport.abort()
