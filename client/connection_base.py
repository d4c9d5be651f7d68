"""The client end of a daemon connection: handshake first, then messages.

Both client connections (``PartitionRequestClientHandler`` for reading, ``LocalConnection``
for producing and control calls) share this: the sans-I/O decoder and handshake, a
``ready`` future that resolves once the handshake is done (or fails with its typed
error), a ``closed`` future, and one place that turns a lost connection into an error.
"""

from __future__ import annotations

import asyncio
from typing import cast

from exchange.errors import ExchangeError, TransportError
from exchange.protocol.codec import FrameDecoder, encode
from exchange.protocol.handshake import ClientHandshake
from exchange.protocol.messages import Message

__all__ = ["HandshakingClientProtocol"]


class HandshakingClientProtocol(asyncio.Protocol):
    """Subclasses implement ``on_message`` and may extend ``on_connection_lost``."""

    def __init__(self, address: str, secret: bytes | None, max_frame_size: int) -> None:
        self.address = address
        self._loop = asyncio.get_running_loop()
        self._decoder = FrameDecoder(max_frame_size)
        self._handshake = ClientHandshake(secret, address=address)
        self._transport: asyncio.Transport | None = None
        self.ready: asyncio.Future[None] = self._loop.create_future()
        self.closed: asyncio.Future[None] = self._loop.create_future()
        self.error: ExchangeError | None = None
        self._closed_by_us = False
        self.bytes_received = 0

    # -- asyncio.Protocol ----------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)
        for msg in self._handshake.start():
            self.send(msg)

    def data_received(self, data: bytes) -> None:
        self.bytes_received += len(data)
        try:
            hs = self._handshake
            for msg in self._decoder.feed(data):
                if hs.is_established:
                    self.on_message(msg)
                    continue
                for out in hs.receive(msg):
                    self.send(out)
                if hs.is_established and not self.ready.done():
                    self.ready.set_result(None)
        except ExchangeError as e:
            self.fail(e)

    def connection_lost(self, exc: Exception | None) -> None:
        self._transport = None
        if self.error is None and not self._closed_by_us:
            self.error = TransportError(
                f"connection to daemon {self.address} lost" + (f": {exc}" if exc else "")
            )
        err = self.error or TransportError(f"connection to daemon {self.address} closed")
        if not self.ready.done():
            self.ready.set_exception(err)
            self.ready.exception()  # retrieved here; whoever awaits it re-raises it
        self.on_connection_lost(err)
        if not self.closed.done():
            self.closed.set_result(None)

    # -- for subclasses ------------------------------------------------------------------

    def on_message(self, msg: Message) -> None:
        raise NotImplementedError

    def on_connection_lost(self, error: ExchangeError) -> None:
        """Fail whatever waits on this connection."""

    # -- sending and closing -------------------------------------------------------------

    @property
    def is_open(self) -> bool:
        return self._transport is not None and self.error is None

    def send(self, msg: Message) -> None:
        t = self._transport
        if t is not None and not t.is_closing():
            t.writelines(encode(msg))

    def check(self) -> None:
        """Raise the connection's error, or TransportError if it is closed."""
        if self.error is not None:
            raise self.error
        if self._transport is None:
            raise TransportError(f"connection to daemon {self.address} is closed")

    def fail(self, err: ExchangeError) -> None:
        """A connection-level failure: remember it and close."""
        if self.error is None:
            self.error = err
        if self._transport is not None:
            self._transport.close()

    def close(self) -> None:
        self._closed_by_us = True
        if self._transport is not None:
            self._transport.close()

    async def aclose(self) -> None:
        self.close()
        await self.closed
