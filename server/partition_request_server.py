"""The data port: serves PartitionRequests to remote RemoteInputChannels.

``DataServer`` is the TCP server. Each connection is a ``PartitionRequestServerProtocol``,
a thin asyncio adapter around the sans-I/O ``exchange.network.ServerConnection``, which
owns the handshake, the role's message set, the ``PartitionRequestQueue`` and the
recycling of sent buffers. The adapter only moves bytes in, forwards writability and
connection loss, and keeps the server's books (connection limit, counters).

Writability is Netty's: ``transport.set_write_buffer_limits(high, low)``; asyncio calls
``pause_writing`` above the high watermark (the channel is unwritable and the queue stops)
and ``resume_writing`` below the low one (``channelWritabilityChanged``: the queue goes on).
"""

from __future__ import annotations

import asyncio
import logging
import ssl
from collections.abc import Callable, Mapping
from typing import Any, ClassVar, cast

from exchange.errors import IllegalStateError, UsageError
from exchange.network.partition_request_queue import PartitionRequestQueue
from exchange.network.server_connection import (
    DATA_PORT_MESSAGES,
    ServerConnection,
    ServerConnectionSettings,
)
from exchange.partition.result_partition_manager import ResultPartitionManager
from exchange.protocol.codec import DataFrameSpec
from exchange.protocol.messages import ErrorCode, ErrorResponse, Message

__all__ = ["DataServer", "PartitionRequestServerProtocol"]

log = logging.getLogger("exchange.server.data")


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
        max_requests: int = 512,
        handshake_timeout: float = 10.0,
        peer_timeout: float | None = 60.0,
        max_frame_size: int | None = None,
        release_dataset: Callable[[str, str], int] | None = None,
        close_timeout: float = 1.0,
    ) -> None:
        self.manager = manager
        self.release_dataset: Callable[[str, str], int] = (
            release_dataset
            if release_dataset is not None
            else lambda ds, app: manager.release_dataset(ds, app_id=app)
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
        self.max_requests = max_requests
        self.handshake_timeout = handshake_timeout
        # A peer that leaves a keepalive Ping unanswered this long is dropped (None: never).
        self.peer_timeout = peer_timeout
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
        self.timed_out_connections = 0
        # what connections sent before they closed (the counters are cumulative)
        self.closed_bytes_sent = 0
        self.closed_buffers_sent = 0
        self._no_connections: asyncio.Future[None] | None = None

    async def start(
        self, host: str, port: int, ssl_context: ssl.SSLContext | None = None
    ) -> tuple[str, int]:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            self.protocol_factory, host, port, reuse_address=True, ssl=ssl_context
        )
        sock = self._server.sockets[0].getsockname()
        return str(sock[0]), int(sock[1])

    @property
    def connection_settings(self) -> ServerConnectionSettings:
        return ServerConnectionSettings(
            secret=self.secret,
            handshake_timeout=self.handshake_timeout,
            peer_timeout=self.peer_timeout,
            max_requests=self.max_requests,
            close_timeout=self.close_timeout,
            max_frame_size=self.max_frame_size,
            # Netty's rule: output not flushed yet counts towards the high watermark
            write_batch_bytes=self.high_watermark,
        )

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
        await self._wait_for_no_connections(self.close_timeout)
        for conn in list(self.connections):
            conn.abort()
        if self._server is not None:
            await self._server.wait_closed()
            self._server = None
        # Aborted transports report connection_lost from the loop's next iterations.
        await self._wait_for_no_connections(self.close_timeout)

    async def _wait_for_no_connections(self, timeout: float) -> None:
        if not self.connections:
            return
        self._no_connections = asyncio.get_running_loop().create_future()
        try:
            await asyncio.wait_for(asyncio.shield(self._no_connections), timeout)
        except TimeoutError:
            pass
        finally:
            self._no_connections = None

    def _connection_closed(self, conn: PartitionRequestServerProtocol) -> None:
        """Book-keeping of a lost connection (its counters stay in the totals)."""
        if conn not in self.connections:
            return
        self.connections.discard(conn)
        if conn.connection is not None and conn.connection.timed_out:
            self.timed_out_connections += 1
        queue = conn.queue
        self.closed_bytes_sent += queue.bytes_sent
        self.closed_buffers_sent += queue.buffers_sent
        waiter = self._no_connections
        if not self.connections and waiter is not None and not waiter.done():
            waiter.set_result(None)

    def stats(self) -> dict[str, int]:
        return {
            "connections": len(self.connections),
            "total_connections": self.total_connections,
            "rejected_connections": self.rejected_connections,
            "timed_out_connections": self.timed_out_connections,
            "readers": sum(c.queue.num_readers for c in self.connections),
            "bytes_sent": self.closed_bytes_sent
            + sum(c.queue.bytes_sent for c in self.connections),
            "buffers_sent": self.closed_buffers_sent
            + sum(c.queue.buffers_sent for c in self.connections),
        }


class PartitionRequestServerProtocol(asyncio.BufferedProtocol):
    """One client connection: asyncio's callbacks, forwarded to a ``ServerConnection``.

    Subclasses (the daemon's local endpoint) override ``on_message`` for the messages of
    their role, declare those in ``accepted_messages``, and call ``super().on_message``
    for the data protocol's. A role receiving data frames declares them in
    ``data_frames`` and implements ``body_sink`` / ``on_payload``: the transport receives
    straight into ``get_buffer()``'s view, which is the payload's segment while one lands.
    """

    #: Messages this role accepts after the handshake; any other is a protocol error.
    accepted_messages: ClassVar[frozenset[type[Message]]] = DATA_PORT_MESSAGES
    #: Frames whose payload lands in place (None: every frame is decoded from scratch).
    data_frames: ClassVar[Mapping[int, DataFrameSpec] | None] = None

    def __init__(self, server: DataServer) -> None:
        self._server = server
        self._loop = asyncio.get_running_loop()
        self._transport: asyncio.Transport | None = None
        self.connection: ServerConnection | None = None
        self.peer = "?"

    def _conn(self) -> ServerConnection:
        conn = self.connection
        if conn is None:
            raise IllegalStateError("the connection is not made yet")
        return conn

    # -- asyncio.Protocol ----------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport = cast(asyncio.Transport, transport)
        peer = transport.get_extra_info("peername")
        self.peer = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else str(peer)
        srv = self._server
        self.connection = conn = ServerConnection(
            transport,
            self._loop,
            srv.manager,
            srv.connection_settings,
            on_message=self.on_message,
            accepted_messages=self.accepted_messages,
            release_dataset=srv.release_dataset,
            peer=self.peer,
            data_frames=self.data_frames,
            body_sink=self.body_sink if self.data_frames is not None else None,
            on_payload=self.on_payload if self.data_frames is not None else None,
        )
        srv.total_connections += 1
        if len(srv.connections) >= srv.max_connections:
            srv.rejected_connections += 1
            conn.close_with_error(
                ErrorCode.TOO_MANY_CONNECTIONS,
                f"too many connections (limit {srv.max_connections})",
            )
            return
        srv.connections.add(self)
        transport.set_write_buffer_limits(high=srv.high_watermark, low=srv.low_watermark)

    # The transport reads only after connection_made: the connection is there (these two
    # run twice per data frame, so without the ``_conn()`` check).
    def get_buffer(self, sizehint: int) -> memoryview:
        return self.connection.get_buffer(sizehint)  # type: ignore[union-attr]

    def buffer_updated(self, nbytes: int) -> None:
        self.connection.buffer_updated(nbytes)  # type: ignore[union-attr]

    def pause_writing(self) -> None:
        self._conn().pause_writing()

    def resume_writing(self) -> None:
        self._conn().resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        conn = self._conn()
        self._server._connection_closed(self)
        conn.connection_lost(exc)
        self._transport = None

    # -- hooks for subclasses ------------------------------------------------------------

    def on_message(self, msg: Message) -> None:
        """Handle one accepted message after the handshake (the data protocol here)."""
        self._conn().handle_message(msg)

    def body_sink(self, header: Any) -> memoryview | None:
        """Where the payload of a data frame lands (None: decode it as a message)."""
        return None

    def on_payload(self, header: Any, payload: memoryview) -> None:
        """A data frame's payload has landed in the view ``body_sink`` returned."""
        raise IllegalStateError("this connection takes no data frames")

    def send(self, message: Message) -> None:
        self._conn().send(message)

    def _close_with(self, resp: ErrorResponse) -> None:
        self._conn().close_with(resp)

    def close_with_error(self, code: ErrorCode, message: str) -> None:
        self._conn().close_with_error(code, message)

    def close(self) -> None:
        """Close once the bytes already written are out; the readers are released now."""
        if self.connection is not None:
            self.connection.close()

    def abort(self) -> None:
        """Drop the connection without flushing (connection_lost releases its buffers)."""
        if self.connection is not None:
            self.connection.abort()

    # -- state, for the server's books and tests -----------------------------------------

    @property
    def queue(self) -> PartitionRequestQueue:
        return self._conn().queue

    @property
    def is_writable(self) -> bool:
        return self.connection is not None and self.connection.is_writable

    @property
    def paused_count(self) -> int:
        return 0 if self.connection is None else self.connection.paused_count

    @property
    def transport(self) -> asyncio.Transport | None:
        return self._transport
