"""The asyncio side of a client connection: moves bytes, wakes futures, nothing else.

Both client connections (``PartitionRequestClientHandler`` for reading, ``LocalConnection``
for producing and control calls) share this ``asyncio.BufferedProtocol`` around a sans-I/O
``ClientConnection`` (``exchange.protocol.client_connection``), which owns the handshake,
the decoding and what to send. The transport receives straight into the buffer the
connection asks for (``get_buffer``), so a BufferResponse payload lands in its segment.

Hooks for subclasses: ``on_message`` (messages the core hands over), ``on_connection_lost``;
and ``ready`` (the handshake is done, or failed with its typed error), ``closed``, ``send``,
``fail``, ``check``, ``close``/``aclose``.

``connect`` opens every client connection of the package (data port, local socket, the
driver's control and rendezvous services): one address syntax (``exchange.addresses``),
one retry loop, one error.
"""

from __future__ import annotations

import asyncio
import os
import ssl
from collections.abc import Callable, Collection
from typing import Final, TypeVar, cast

from client.tls import connect_kwargs
from exchange.addresses import parse_address
from exchange.errors import ExchangeError, ProtocolError, TransportError
from exchange.protocol.client_connection import (
    ClientConnection,
    ConnectionEvent,
    ConnectionFailed,
    HandshakeComplete,
    MessageReceived,
)
from exchange.protocol.codec import InPlaceFrameDecoder, encode
from exchange.protocol.messages import Message

__all__ = [
    "APP_ID_ENV",
    "DEFAULT_CONNECT_TIMEOUT",
    "FramedProtocol",
    "HandshakingClientProtocol",
    "app_id_from_env",
    "connect",
]

#: Environment variable naming the application a task speaks for (docs/security.md).
APP_ID_ENV: Final = "EXCHANGE_APP_ID"
#: Seconds one connection attempt may take.
DEFAULT_CONNECT_TIMEOUT: Final = 10.0

_P = TypeVar("_P", bound=asyncio.BaseProtocol)


async def connect(
    address: str,
    factory: Callable[[], _P],
    *,
    retries: int = 0,
    backoff: float = 0.1,
    timeout: float = DEFAULT_CONNECT_TIMEOUT,
    ssl_context: ssl.SSLContext | None = None,
    peer: str = "the peer",
    hint: str = "",
) -> _P:
    """The protocol ``factory`` made for a connection to ``address`` (``host:port``,
    ``[v6]:port`` or ``unix:/path``; TLS with ``ssl_context`` over TCP).

    Up to ``retries`` more attempts after a refused or timed-out one, ``backoff`` seconds
    apart, doubling. Then a TransportError naming ``peer`` and the address, the last
    error and ``hint``; a malformed address is a UsageError at once.
    """
    host, port = parse_address(address)
    loop = asyncio.get_running_loop()
    delay = backoff
    last: OSError | TimeoutError | None = None
    for attempt in range(retries + 1):
        if attempt:
            await asyncio.sleep(delay)
            delay *= 2
        if port == 0:
            opening = loop.create_unix_connection(factory, host)
        else:
            opening = loop.create_connection(
                factory, host, port, **connect_kwargs(host, ssl_context)
            )
        try:
            _, protocol = await asyncio.wait_for(opening, timeout)
        except (OSError, TimeoutError) as e:
            last = e
            continue
        return protocol
    tries = f" after {retries + 1} attempts" if retries else ""
    raise TransportError(f"cannot reach {peer} at {address}{tries}: {last}{hint}") from last


def app_id_from_env() -> str:
    """``$EXCHANGE_APP_ID``, or "" (no application) when unset."""
    return os.environ.get(APP_ID_ENV, "")


class HandshakingClientProtocol(asyncio.BufferedProtocol):
    """Subclasses implement ``on_message`` and may extend ``on_connection_lost``."""

    def __init__(
        self,
        address: str,
        secret: bytes | None,
        max_frame_size: int,
        app_id: str | None = None,
    ) -> None:
        """``app_id``: the application to authenticate for; None: ``$EXCHANGE_APP_ID``."""
        self.address = address
        self._app_id = app_id if app_id is not None else app_id_from_env()
        self._loop = asyncio.get_running_loop()
        self.connection = self._new_connection(secret, max_frame_size)
        # The transport asks where to receive twice per data frame: straight to the
        # connection's decoder (the transport binds this when the protocol is set).
        self.get_buffer = self.connection.get_buffer  # type: ignore[method-assign]
        self._transport: asyncio.Transport | None = None
        self.ready: asyncio.Future[None] = self._loop.create_future()
        self.closed: asyncio.Future[None] = self._loop.create_future()

    def _new_connection(self, secret: bytes | None, max_frame_size: int) -> ClientConnection:
        return ClientConnection(self.address, secret, max_frame_size, app_id=self._app_id)

    @property
    def error(self) -> ExchangeError | None:
        return self.connection.error

    @property
    def bytes_received(self) -> int:
        return self.connection.bytes_received

    # -- asyncio.BufferedProtocol --------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)
        self.connection.start()
        self._flush()

    def get_buffer(self, sizehint: int) -> memoryview:  # replaced per instance in __init__
        return self.connection.get_buffer(sizehint)

    def buffer_updated(self, nbytes: int) -> None:
        conn = self.connection
        if conn.buffer_updated(nbytes):  # events to handle or bytes to send
            if conn.has_events:
                self._handle(conn.events_received())
            self._flush()

    def eof_received(self) -> bool | None:
        return None  # close the transport; connection_lost reports it

    def connection_lost(self, exc: Exception | None) -> None:
        self._transport = None
        err = self.connection.connection_lost(exc)
        if not self.ready.done():
            self.ready.set_exception(err)
            self.ready.exception()  # retrieved here; whoever awaits it re-raises it
        self.on_connection_lost(err)
        if not self.closed.done():
            self.closed.set_result(None)

    def _handle(self, events: list[ConnectionEvent]) -> None:
        for event in events:
            match event:
                case MessageReceived(message=msg):
                    try:
                        self.on_message(msg)
                    except ExchangeError as e:
                        self.fail(e)
                case HandshakeComplete():
                    if not self.ready.done():
                        self.ready.set_result(None)
                case ConnectionFailed():
                    if self._transport is not None:
                        self._transport.close()

    def _flush(self) -> None:
        t = self._transport
        if t is not None:
            data = self.connection.data_to_send()
            if data and not t.is_closing():
                t.writelines(data)

    # -- for subclasses ------------------------------------------------------------------

    def on_message(self, msg: Message) -> None:
        raise NotImplementedError

    def on_connection_lost(self, error: ExchangeError) -> None:
        """Fail whatever waits on this connection."""

    # -- sending and closing -------------------------------------------------------------

    @property
    def is_open(self) -> bool:
        return self._transport is not None and self.connection.is_open

    def send(self, msg: Message) -> None:
        self.connection.send(msg)
        self._flush()

    def check(self) -> None:
        """Raise the connection's error, or TransportError if it is closed."""
        self.connection.check()

    def fail(self, err: ExchangeError) -> None:
        """A connection-level failure: remember it and close."""
        self.connection.fail(err)
        self._handle(self.connection.events_received())

    def close(self) -> None:
        self.connection.close()
        if self._transport is not None:
            self._transport.close()

    async def aclose(self) -> None:
        self.close()
        await self.closed


class FramedProtocol(asyncio.BufferedProtocol):
    """One connection of the driver's services (control, rendezvous), either end: typed
    messages of ``exchange.protocol.driver_messages`` on the project's framing, no
    handshake (the first message carries the service's token).

    The decoder accepts the ids in ``accept`` up to ``max_frame_size`` bytes (settable:
    a server raises it once a peer has registered). Subclasses implement ``on_message``
    and ``on_lost`` (called once, with the error that ended the connection: the
    ProtocolError of a bad frame, else a TransportError).
    """

    def __init__(self, accept: Collection[int], max_frame_size: int) -> None:
        self._decoder = InPlaceFrameDecoder(max_frame_size, accept=accept)
        self.get_buffer = self._decoder.get_buffer  # type: ignore[method-assign]
        self.transport: asyncio.Transport | None = None
        self.error: ExchangeError | None = None
        self._loop = asyncio.get_running_loop()
        self._paused = False
        self._drain_waiters: list[asyncio.Future[None]] = []
        self.closed: asyncio.Future[None] = self._loop.create_future()

    @property
    def max_frame_size(self) -> int:
        return self._decoder.max_frame_size

    @max_frame_size.setter
    def max_frame_size(self, value: int) -> None:
        self._decoder.max_frame_size = value

    # -- asyncio.BufferedProtocol --------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)

    def get_buffer(self, sizehint: int) -> memoryview:  # replaced per instance in __init__
        return self._decoder.get_buffer(sizehint)

    def buffer_updated(self, nbytes: int) -> None:
        try:
            messages = self._decoder.buffer_updated(nbytes)
        except ProtocolError as e:
            self.fail(e)
            return
        for msg in messages:
            if self.transport is None or self.transport.is_closing():
                return
            if isinstance(msg, Message):
                self.on_message(msg)

    def eof_received(self) -> bool | None:
        return None  # close the transport; connection_lost reports it

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        if self.error is None:
            ended = "mid-frame" if self._decoder.buffered else "by the peer"
            self.error = TransportError(f"connection closed {ended}" + (f": {exc}" if exc else ""))
        self._wake_drain()
        self.on_lost(self.error)
        if not self.closed.done():
            self.closed.set_result(None)

    def pause_writing(self) -> None:
        self._paused = True

    def resume_writing(self) -> None:
        self._paused = False
        self._wake_drain()

    def _wake_drain(self) -> None:
        waiters, self._drain_waiters = self._drain_waiters, []
        for fut in waiters:
            if not fut.done():
                fut.set_result(None)

    # -- for subclasses ------------------------------------------------------------------

    def on_message(self, msg: Message) -> None:
        raise NotImplementedError

    def on_lost(self, error: ExchangeError) -> None:
        """The connection ended (``error`` says why)."""

    # -- sending and closing -------------------------------------------------------------

    @property
    def is_open(self) -> bool:
        return self.transport is not None and not self.transport.is_closing()

    def send(self, msg: Message) -> None:
        """Queue ``msg`` (dropped once the connection is closing)."""
        self.write(encode(msg))

    def write(self, frames: list[bytes | memoryview]) -> None:
        """Queue frames ``encode`` made (encoded by the caller, e.g. on its own thread)."""
        if self.transport is not None and not self.transport.is_closing():
            self.transport.writelines(frames)

    async def drain(self) -> None:
        """Wait until the transport's buffer is below its high-water mark."""
        if self._paused and self.transport is not None:
            fut = self._loop.create_future()
            self._drain_waiters.append(fut)
            await fut

    def fail(self, error: ExchangeError) -> None:
        """End the connection at once (what is queued is dropped) for ``error``."""
        if self.error is None:
            self.error = error
        if self.transport is not None:
            self.transport.abort()

    def close(self) -> None:
        """End the connection once what is queued is written."""
        if self.transport is not None:
            self.transport.close()
