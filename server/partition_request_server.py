"""The data port: serves PartitionRequests to remote RemoteInputChannels.

``DataServer`` is the TCP server. Each connection is a ``PartitionRequestServerProtocol``,
a thin asyncio adapter around the sans-I/O ``exchange.network.ServerConnection``, which
owns the handshake, the role's message set, the ``PartitionRequestQueue`` and the
recycling of sent buffers. The adapter only moves bytes in, forwards writability and
connection loss, and keeps the server's books (connection limit, counters).

Admission, at accept (before a byte is read): a connection counts towards
``max_connections`` from then on. Until it has authenticated (TLS, then the handshake) it
also counts as *unauthenticated*: at most ``max_unauthenticated_per_peer`` of those per
peer address (more are refused) and ``max_unauthenticated`` overall; when the overall
limit is reached, the oldest unauthenticated connection of the address holding the most is
dropped for the newcomer, so silent sockets from a few addresses can neither take the
slots of authenticated work (which keeps ``max_connections - max_unauthenticated``) nor
keep a new peer out. With TLS the socket is accepted plain and upgraded with
``loop.start_tls`` within ``handshake_timeout``, so a socket that never starts TLS is
counted and dropped like one that never authenticates. ``require_tls_remote`` refuses
plain connections from peers that are not on loopback.

Writability is Netty's: ``transport.set_write_buffer_limits(high, low)``; asyncio calls
``pause_writing`` above the high watermark (the channel is unwritable and the queue stops)
and ``resume_writing`` below the low one (``channelWritabilityChanged``: the queue goes on).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import ipaddress
import logging
import socket
import ssl
import time
from collections.abc import Callable, Mapping
from typing import Any, ClassVar, Final, cast

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
from server.config import DEFAULT_HIGH_WATERMARK_SEGMENTS, DEFAULT_LOW_WATERMARK_SEGMENTS

__all__ = ["DataServer", "PartitionRequestServerProtocol", "is_loopback"]

log = logging.getLogger("exchange.server.data")

#: The listening socket's backlog (asyncio's default).
LISTEN_BACKLOG: Final = 100
#: Sockets accepted per wake-up of the listening socket.
ACCEPT_BATCH: Final = 64
#: Out of descriptors: accepting pauses this long (what asyncio's own servers do).
ACCEPT_RETRY_DELAY: Final = 1.0
_OUT_OF_RESOURCES: Final = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})


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
        max_unauthenticated: int | None = None,
        max_unauthenticated_per_peer: int | None = None,
        require_tls_remote: bool = False,
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
        self.high_watermark = (
            high_watermark
            if high_watermark is not None
            else DEFAULT_HIGH_WATERMARK_SEGMENTS * segment_size
        )
        self.low_watermark = (
            low_watermark
            if low_watermark is not None
            else DEFAULT_LOW_WATERMARK_SEGMENTS * segment_size
        )
        if not 0 <= self.low_watermark < self.high_watermark:
            raise UsageError(
                f"need 0 <= low watermark < high watermark, got {self.low_watermark}, "
                f"{self.high_watermark}"
            )
        self.max_connections = max_connections
        # None: no limit of their own (the local endpoint: one user, one peer)
        self.max_unauthenticated = max_unauthenticated
        self.max_unauthenticated_per_peer = max_unauthenticated_per_peer
        self.require_tls_remote = require_tls_remote
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
        #: accepted, protocol not made yet (TLS being set up)
        self.accepting: set[PartitionRequestServerProtocol] = set()
        #: peer address -> its unauthenticated connections, oldest first
        self.unauthenticated: dict[str, dict[PartitionRequestServerProtocol, None]] = {}
        self.ssl_context: ssl.SSLContext | None = None
        self._server: asyncio.Server | None = None  # the local endpoint's Unix server
        self._listener: socket.socket | None = None  # the data port (see ``_on_accept``)
        self._accept_paused: asyncio.TimerHandle | None = None
        self._connecting: set[asyncio.Task[None]] = set()
        self._last_fd_warning = 0.0
        self._last_refusal_warning = -10.0
        self.total_connections = 0
        self.rejected_connections = 0
        self.timed_out_connections = 0
        #: unauthenticated connections dropped for a newcomer (see the module docstring)
        self.evicted_connections = 0
        # what connections sent before they closed (the counters are cumulative)
        self.closed_bytes_sent = 0
        self.closed_buffers_sent = 0
        self._no_connections: asyncio.Future[None] | None = None

    async def start(
        self, host: str, port: int, ssl_context: ssl.SSLContext | None = None
    ) -> tuple[str, int]:
        """Listen on ``host:port``; every accepted socket is admitted (see the module
        docstring) before a protocol or TLS is set up for it."""
        loop = asyncio.get_running_loop()
        self.ssl_context = ssl_context
        infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        if not infos:
            raise OSError(f"cannot resolve {host!r}")
        family, kind, proto, _, addr = infos[0]
        sock = socket.socket(family, kind, proto)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind(addr)
            sock.listen(LISTEN_BACKLOG)
            sock.setblocking(False)
        except BaseException:
            sock.close()
            raise
        self._listener = sock
        loop.add_reader(sock.fileno(), self._on_accept)
        name = sock.getsockname()
        return str(name[0]), int(name[1])

    def _on_accept(self) -> None:
        """Accept what is waiting (a bounded batch); out of descriptors: log, pause 1 s."""
        listener = self._listener
        if listener is None:
            return
        for _ in range(ACCEPT_BATCH):
            try:
                sock, addr = listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:
                if e.errno in _OUT_OF_RESOURCES:
                    self._out_of_descriptors(e)
                else:
                    log.warning("accept on the data port failed: %s", e)
                return
            self._accepted(sock, addr)

    def _out_of_descriptors(self, e: OSError) -> None:
        loop = asyncio.get_running_loop()
        now = loop.time()
        if now - self._last_fd_warning >= 10.0:  # once per 10 s, not per attempt
            self._last_fd_warning = now
            log.error(
                "the data port cannot accept: %s; %d connections are open (max_connections "
                "%d); new connections wait %.0f s. Raise RLIMIT_NOFILE or lower the limits",
                e,
                self.num_connections,
                self.max_connections,
                ACCEPT_RETRY_DELAY,
            )
        listener = self._listener
        if listener is not None and self._accept_paused is None:
            loop.remove_reader(listener.fileno())
            self._accept_paused = loop.call_later(ACCEPT_RETRY_DELAY, self._resume_accepting)

    def _resume_accepting(self) -> None:
        self._accept_paused = None
        if self._listener is not None:
            asyncio.get_running_loop().add_reader(self._listener.fileno(), self._on_accept)

    def _accepted(self, sock: socket.socket, addr: Any) -> None:
        sock.setblocking(False)
        proto = self.protocol_factory()
        proto.peer_host = str(addr[0])
        proto.peer = f"{addr[0]}:{addr[1]}"
        refused = self._admit(proto)
        ctx = self.ssl_context
        if refused is not None and ctx is not None:
            self.refused(proto.peer, refused)
            sock.close()  # it cannot read an error before TLS
            return
        proto._refused = refused  # a plain peer reads why (connection_made)
        if refused is None:  # a refused one does not count: it is closed at once
            self.accepting.add(proto)
        proto._sock = sock
        task = asyncio.get_running_loop().create_task(self._connect(proto, sock, ctx))
        self._connecting.add(task)
        task.add_done_callback(self._connecting.discard)

    async def _connect(
        self, proto: PartitionRequestServerProtocol, sock: socket.socket, ctx: ssl.SSLContext | None
    ) -> None:
        """Set up the transport (TLS within the handshake timeout); the protocol's
        ``connection_made`` runs when it is ready."""
        loop = asyncio.get_running_loop()
        try:
            await loop.connect_accepted_socket(
                lambda: proto,
                sock,
                ssl=ctx,
                ssl_handshake_timeout=self.handshake_timeout if ctx is not None else None,
            )
        except Exception as e:  # the peer's failure (a TLS handshake), or our abort
            log.info("connection from %s failed before it was made: %r", proto.peer, e)
            # a transport that took the socket over detaches it when it closes: then this
            # does nothing
            sock.close()
            self._connection_closed(proto)
        finally:
            proto._sock = None

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
        if self._listener is not None:
            name = self._listener.getsockname()
            return str(name[0]), int(name[1])
        if self._server is None or not self._server.sockets:
            return None
        sock = self._server.sockets[0].getsockname()
        return str(sock[0]), int(sock[1])

    def stop_accepting(self) -> None:
        if self._server is not None:
            self._server.close()
        listener, self._listener = self._listener, None
        if listener is not None:
            if self._accept_paused is not None:
                self._accept_paused.cancel()
                self._accept_paused = None
            else:
                asyncio.get_running_loop().remove_reader(listener.fileno())
            listener.close()

    async def close(self) -> None:
        """Stop accepting and close every connection (its views are released).

        Returns once every connection is gone: one whose peer does not read its last bytes
        is aborted after ``close_timeout``.
        """
        self.stop_accepting()
        for pending in list(self.accepting):
            pending.abort()
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
        if self._connecting:  # their sockets are shut down: they end at once
            await asyncio.wait(list(self._connecting), timeout=self.close_timeout)

    @property
    def num_connections(self) -> int:
        """Every connection accepted and not lost: what ``max_connections`` bounds."""
        return len(self.connections) + len(self.accepting)

    @property
    def num_unauthenticated(self) -> int:
        return sum(len(conns) for conns in self.unauthenticated.values())

    def _admit(self, proto: PartitionRequestServerProtocol) -> str | None:
        """Count a new connection; None, or why it is refused."""
        proto._admitted = True
        self.total_connections += 1
        if self.num_connections >= self.max_connections:
            return f"too many connections (limit {self.max_connections})"
        host = proto.peer_host
        if host is None:
            return None
        if self.require_tls_remote and self.ssl_context is None and not is_loopback(host):
            return "this daemon takes plain connections from loopback only (require_tls_remote)"
        per_peer = self.max_unauthenticated_per_peer
        held = len(self.unauthenticated.get(host, ()))
        if per_peer is not None and held >= per_peer:
            return f"too many unauthenticated connections from {host} (limit {per_peer})"
        limit = self.max_unauthenticated
        if limit is not None and self.num_unauthenticated >= limit:
            # the oldest of the address that holds the most makes room for the newcomer,
            # unless the newcomer's address would then hold as many (it churns its own)
            busiest = max(self.unauthenticated.values(), key=len)
            if len(busiest) <= held + 1:
                return f"too many unauthenticated connections (limit {limit})"
            victim = next(iter(busiest))
            self._authenticated(victim)
            self.evicted_connections += 1
            log.debug(
                "dropping unauthenticated connection %s for %s (max_unauthenticated_connections "
                "%d reached)",
                victim.peer,
                proto.peer,
                limit,
            )
            victim.abort()
        self.unauthenticated.setdefault(host, {})[proto] = None
        return None

    def refused(self, peer: str, reason: str) -> None:
        """Count a refused connection; a warning at most every 10 s (a flood of them
        must not flood the log), the others at debug level."""
        self.rejected_connections += 1
        now = time.monotonic()
        if now - self._last_refusal_warning >= 10.0:
            self._last_refusal_warning = now
            log.warning(
                "refused connection from %s: %s (%d refused so far)",
                peer,
                reason,
                self.rejected_connections,
            )
        else:
            log.debug("refused connection from %s: %s", peer, reason)

    def _authenticated(self, proto: PartitionRequestServerProtocol) -> None:
        """``proto`` no longer counts as unauthenticated (it authenticated, or it is gone)."""
        host = proto.peer_host
        if host is None:
            return
        mine = self.unauthenticated.get(host)
        if mine is None or proto not in mine:
            return
        del mine[proto]
        if not mine:
            del self.unauthenticated[host]

    async def _wait_for_no_connections(self, timeout: float) -> None:
        if not self.num_connections:
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
        self._authenticated(conn)
        self.accepting.discard(conn)
        if conn not in self.connections:
            self._maybe_no_connections()
            return
        self.connections.discard(conn)
        if conn.connection is not None and conn.connection.timed_out:
            self.timed_out_connections += 1
        queue = conn.queue
        self.closed_bytes_sent += queue.bytes_sent
        self.closed_buffers_sent += queue.buffers_sent
        self._maybe_no_connections()

    def _maybe_no_connections(self) -> None:
        waiter = self._no_connections
        if not self.num_connections and waiter is not None and not waiter.done():
            waiter.set_result(None)

    def stats(self) -> dict[str, int]:
        return {
            "connections": self.num_connections,
            "unauthenticated_connections": self.num_unauthenticated,
            "total_connections": self.total_connections,
            "rejected_connections": self.rejected_connections,
            "evicted_connections": self.evicted_connections,
            "timed_out_connections": self.timed_out_connections,
            "readers": sum(c.queue.num_readers for c in self.connections),
            "bytes_sent": self.closed_bytes_sent
            + sum(c.queue.bytes_sent for c in self.connections),
            "buffers_sent": self.closed_buffers_sent
            + sum(c.queue.buffers_sent for c in self.connections),
        }


def is_loopback(host: str) -> bool:
    """True for a loopback address (127.0.0.0/8, ::1, and ::ffff:127.x); False for
    anything else, wildcards and host names included."""
    try:
        addr = ipaddress.ip_address(host.partition("%")[0])
    except ValueError:
        return False
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        return addr.ipv4_mapped.is_loopback
    return addr.is_loopback


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
        #: the peer's address without its port (None on a Unix socket)
        self.peer_host: str | None = None
        #: set by the data port at accept: the socket while the transport is set up (TLS),
        #: why it is refused, whether it was dropped meanwhile
        self._sock: socket.socket | None = None
        self._refused: str | None = None
        self._admitted = False
        self._dropped = False

    def _conn(self) -> ServerConnection:
        conn = self.connection
        if conn is None:
            raise IllegalStateError("the connection is not made yet")
        return conn

    # -- asyncio.Protocol ----------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport = cast(asyncio.Transport, transport)
        srv = self._server
        if not self._admitted:  # a Unix socket: admitted here, not at accept
            peer = transport.get_extra_info("peername")
            self.peer = str(peer) if peer else "unix"
            self._refused = srv._admit(self)
        srv.accepting.discard(self)
        if self._dropped or transport.is_closing():  # dropped while it was being set up
            transport.abort()
            srv._connection_closed(self)
            return
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
            on_established=lambda: srv._authenticated(self),
        )
        refused = self._refused
        if refused is not None:
            srv.refused(self.peer, refused)
            code = (
                ErrorCode.ACCESS_DENIED
                if "require_tls_remote" in refused
                else ErrorCode.TOO_MANY_CONNECTIONS
            )
            conn.close_with_error(code, refused)
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
        conn = self.connection
        self._server._connection_closed(self)
        if conn is None:  # closed before it was made
            return
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
        elif self._sock is not None:  # being set up: it fails at once, and is off the books
            self._dropped = True
            with contextlib.suppress(OSError):  # the transport may have closed it already
                self._sock.shutdown(socket.SHUT_RDWR)
            self._server._connection_closed(self)
        elif self._transport is not None:
            self._transport.abort()

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
