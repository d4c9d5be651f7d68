"""Client side of the data protocol: one connection per remote daemon, shared by channels.

``ConnectionManager`` creates connections lazily (with connect retries) and hands every
RemoteInputChannel of the process the same ``PartitionRequestClientHandler`` for a given
address. The handler only moves bytes: its sans-I/O ``PartitionRequestClientConnection``
(Flink's NettyPartitionRequestClient plus CreditBasedPartitionRequestClientHandler) routes
BufferResponses by receiver id (each payload received straight into a credited buffer of
its channel), turns ErrorResponses into typed errors on the right channel (or on all of
them when fatal), batches AddCredit (one per channel per loop iteration) and writes
PartitionRequest / ResumeConsumption / NewBufferSize / CancelPartitionRequest.

A connection to this host's daemon over its Unix socket (``unix:/path``) asks for its
application's shared arena after the handshake; when the daemon offers it, the handler
fetches and maps it (``client.arena_handout``, as a producer does) and data buffers then
arrive as segment descriptors read in place (``exchange.protocol.client_connection``).
Without an offer, or when mapping fails (logged), they keep coming over the socket.

``read_timeout`` (``ConnectionManager(read_timeout=...)``, by default
``$EXCHANGE_READ_TIMEOUT``, unset: off): the handler runs a timer that asks the connection
whether nothing has arrived for that long while a channel has credit out; if so the
connection is aborted and its channels fail with a ``TransportError``.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import mmap
import os
import ssl
from typing import Final, Literal

from client.arena_handout import map_offered_arena, unmap_arena
from client.connection_base import DEFAULT_CONNECT_TIMEOUT, HandshakingClientProtocol, connect
from client.tls import client_ssl_context
from exchange.addresses import UNIX_PREFIX, parse_address
from exchange.best_effort import cancel_and_wait
from exchange.consumer.remote_input_channel import RemoteInputChannel
from exchange.errors import (
    ExchangeError,
    ProtocolError,
    SharedMemoryUnavailableError,
    TransportError,
    UsageError,
)
from exchange.protocol.client_connection import PartitionRequestClientConnection
from exchange.protocol.codec import max_frame_size_for
from exchange.protocol.local_messages import NoArena, SharedArena
from exchange.protocol.messages import Message

__all__ = [
    "READ_TIMEOUT_ENV",
    "ConnectionManager",
    "PartitionRequestClientHandler",
    "read_timeout_from_env",
]

log = logging.getLogger("exchange.client.network")

#: Environment variable with the default read timeout in seconds (unset or empty: off).
READ_TIMEOUT_ENV: Final = "EXCHANGE_READ_TIMEOUT"


def read_timeout_from_env() -> float | None:
    """``$EXCHANGE_READ_TIMEOUT`` in seconds, or None when unset; UsageError when invalid."""
    raw = os.environ.get(READ_TIMEOUT_ENV, "").strip()
    if not raw:
        return None
    try:
        value = float(raw)
    except ValueError:
        raise UsageError(f"${READ_TIMEOUT_ENV}={raw!r} is not a number of seconds") from None
    if not 0 < value < float("inf"):
        raise UsageError(f"${READ_TIMEOUT_ENV}={raw!r} must be a positive number of seconds")
    return value


class PartitionRequestClientHandler(HandshakingClientProtocol):
    """One connection to a remote daemon's data port: the asyncio side of a
    ``PartitionRequestClientConnection``, which does the routing and the accounting."""

    connection: PartitionRequestClientConnection

    def __init__(
        self,
        address: str,
        secret: bytes | None,
        max_frame_size: int,
        read_timeout: float | None = None,
        app_id: str | None = None,
    ) -> None:
        self._read_timeout = read_timeout
        self._read_timer: asyncio.TimerHandle | None = None
        #: the daemon's local socket (``unix:`` addresses): shared memory may be offered
        self._socket_path = address[len(UNIX_PREFIX) :] if address.startswith(UNIX_PREFIX) else None
        self._arena: mmap.mmap | None = None
        self._arena_view: memoryview | None = None
        self._mapping: asyncio.Task[None] | None = None
        # set once the daemon answered RequestArena (the arena mapped, or why not)
        self._arena_answer: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        #: the inode of the shared arena mapped (None: buffers come over the socket)
        self.arena_inode: int | None = None
        super().__init__(address, secret, max_frame_size, app_id)
        self.connection.on_give_back_pending = self._schedule_flush

    def _new_connection(
        self, secret: bytes | None, max_frame_size: int
    ) -> PartitionRequestClientConnection:
        return PartitionRequestClientConnection(
            self.address,
            secret,
            max_frame_size,
            read_timeout=self._read_timeout,
            app_id=self._app_id,
            shared_reads=self._socket_path is not None,
        )

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self._arm_read_timer()

    def _arm_read_timer(self) -> None:
        timeout = self._read_timeout
        if timeout is not None and self._transport is not None:
            # a quarter of the timeout: it fires at most 25 % late
            self._read_timer = self._loop.call_later(timeout / 4, self._on_read_timer)

    def _on_read_timer(self) -> None:
        self._read_timer = None
        conn = self.connection
        if conn.check_read_timeout(self._loop.time()):
            log.warning("%s", conn.error)
            self._handle(conn.events_received())
            if self._transport is not None:
                self._transport.abort()  # the peer may not read a FIN either
            return
        self._arm_read_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._read_timer is not None:
            self._read_timer.cancel()
            self._read_timer = None
        if self._mapping is not None:
            self._mapping.cancel()
        super().connection_lost(exc)
        if not self._arena_answer.done():
            self._arena_answer.set_result(None)  # whoever waits sees the connection's error
        self._unmap()

    def on_message(self, msg: Message) -> None:  # the connection handles all but offers
        if type(msg) is SharedArena and self._socket_path is not None and self._mapping is None:
            self._mapping = self._loop.create_task(self._map_arena(self._socket_path, msg))
            return
        if type(msg) is NoArena and not self._arena_answer.done():
            log.info("reading from %s over the socket: %s", self.address, msg.reason)
            self._arena_answer.set_result(None)
            return
        raise ProtocolError(f"unexpected {type(msg).__name__} from daemon {self.address}")

    # -- shared memory -------------------------------------------------------------------

    async def request_arena(self, timeout: float) -> None:
        """Ask the daemon (on its Unix socket) for the application's shared arena and
        wait until it is mapped or the daemon said why not (a later offer is mapped as
        it comes)."""
        self.connection.request_arena()
        self._flush()
        try:
            async with asyncio.timeout(timeout):
                await asyncio.shield(self._arena_answer)
        except TimeoutError:
            raise TransportError(f"daemon {self.address} did not answer RequestArena") from None

    async def _map_arena(self, socket_path: str, offer: SharedArena) -> None:
        try:
            try:
                arena, inode = await map_offered_arena(socket_path, offer, DEFAULT_CONNECT_TIMEOUT)
            except SharedMemoryUnavailableError as e:
                log.warning("reading from %s over the socket: %s", self.address, e)
                return
            if not self.is_open:
                arena.close()
                return
            self._arena, self.arena_inode = arena, inode
            self._arena_view = view = memoryview(arena)
            self.connection.arena_mapped(view)
            self._flush()
        finally:
            if not self._arena_answer.done():
                self._arena_answer.set_result(None)

    def _unmap(self) -> None:
        view, self._arena_view = self._arena_view, None
        arena, self._arena = self._arena, None
        unmap_arena(view, arena)

    def _schedule_flush(self) -> None:
        self._loop.call_soon(self._flush_credits)

    # -- PartitionRequestClient ----------------------------------------------------------

    def request_subpartition(self, channel: RemoteInputChannel) -> None:
        self.connection.request_subpartition(channel)
        self._flush()

    def notify_credit_available(self, channel: RemoteInputChannel) -> None:
        if self.connection.notify_credit_available(channel):
            self._loop.call_soon(self._flush_credits)

    def _flush_credits(self) -> None:
        self.connection.flush_credits()
        self._flush()

    def resume_consumption(self, channel: RemoteInputChannel) -> None:
        self.connection.resume_consumption(channel)
        self._flush()

    def notify_new_buffer_size(self, channel: RemoteInputChannel, size: int) -> None:
        self.connection.notify_new_buffer_size(channel, size)
        self._flush()

    def cancel_request(self, channel: RemoteInputChannel) -> None:
        self.connection.cancel_request(channel)
        self._flush()

    # -- lifecycle -----------------------------------------------------------------------

    @property
    def num_channels(self) -> int:
        return self.connection.num_channels

    async def aclose(self) -> None:
        """Say goodbye (CloseRequest) and wait until the connection is gone."""
        self.connection.send_close_request()
        self._flush()
        await super().aclose()


class ConnectionManager:
    """One shared connection per daemon address, created on first use."""

    def __init__(
        self,
        *,
        secret: bytes | None = None,
        segment_size: int = 32 * 1024,
        connect_retries: int = 3,
        connect_backoff: float = 0.1,
        connect_timeout: float = DEFAULT_CONNECT_TIMEOUT,
        ssl_context: ssl.SSLContext | Literal["env"] | None = "env",
        read_timeout: float | Literal["env"] | None = "env",
        app_id: str | None = None,
    ) -> None:
        """``app_id``: the application to authenticate for (None: ``$EXCHANGE_APP_ID``)."""
        if connect_retries < 0 or connect_backoff <= 0 or connect_timeout <= 0:
            raise UsageError("connect_retries >= 0, connect_backoff > 0, connect_timeout > 0")
        if read_timeout == "env":
            read_timeout = read_timeout_from_env()
        elif read_timeout is not None and not (
            isinstance(read_timeout, int | float) and 0 < read_timeout < float("inf")
        ):
            raise UsageError(
                f"read_timeout must be a positive number of seconds, got {read_timeout!r}"
            )
        self._read_timeout = read_timeout
        self._app_id = app_id
        self._secret = secret
        # TLS to data ports: the given context, or the one $EXCHANGE_TLS_CA_FILE names
        self._ssl_context = client_ssl_context() if ssl_context == "env" else ssl_context
        self._max_frame_size = max_frame_size_for(segment_size)
        self._retries = connect_retries
        self._backoff = connect_backoff
        self._timeout = connect_timeout
        self._clients: dict[str, PartitionRequestClientHandler] = {}
        self._connecting: dict[str, asyncio.Task[PartitionRequestClientHandler]] = {}

    async def create_partition_request_client(self, address: str) -> PartitionRequestClientHandler:
        client = self._clients.get(address)
        if client is not None and client.is_open:
            return client
        task = self._connecting.get(address)
        if task is None:
            parse_address(address)
            task = asyncio.get_running_loop().create_task(self._connect(address))
            self._connecting[address] = task
            task.add_done_callback(lambda _t: self._connecting.pop(address, None))
        return await asyncio.shield(task)

    async def _connect(self, address: str) -> PartitionRequestClientHandler:
        def factory() -> PartitionRequestClientHandler:
            return PartitionRequestClientHandler(
                address, self._secret, self._max_frame_size, self._read_timeout, self._app_id
            )

        handler = await connect(
            address,
            factory,
            retries=self._retries,
            backoff=self._backoff,
            timeout=self._timeout,
            ssl_context=self._ssl_context,
            peer="daemon",
        )
        try:
            await asyncio.wait_for(asyncio.shield(handler.ready), self._timeout)
        except TimeoutError:
            await handler.aclose()
            raise TransportError(f"handshake with daemon {address} timed out") from None
        except ExchangeError:
            await handler.aclose()
            raise
        if address.startswith(UNIX_PREFIX):
            try:
                await handler.request_arena(self._timeout)
                handler.check()
            except ExchangeError:
                await handler.aclose()
                raise
        self._clients[address] = handler
        handler.closed.add_done_callback(functools.partial(self._forget, address, handler))
        return handler

    def _forget(
        self, address: str, handler: PartitionRequestClientHandler, _f: object = None
    ) -> None:
        if self._clients.get(address) is handler:
            del self._clients[address]

    @property
    def connections(self) -> list[PartitionRequestClientHandler]:
        return list(self._clients.values())

    async def close(self) -> None:
        for address, task in list(self._connecting.items()):
            await cancel_and_wait(task, log, f"connecting to {address}")
        for client in list(self._clients.values()):
            await client.aclose()
        self._clients.clear()
