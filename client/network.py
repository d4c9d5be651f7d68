"""Client side of the data protocol: one connection per remote daemon, shared by channels.

``ConnectionManager`` creates connections lazily (with connect retries) and hands every
RemoteInputChannel of the process the same ``PartitionRequestClientHandler`` for a given
address. The handler (Flink's NettyPartitionRequestClient plus
CreditBasedPartitionRequestClientHandler) routes BufferResponses by receiver id into the
channel's own buffers, turns ErrorResponses into typed errors on the right channel (or on
all of them when fatal), and writes PartitionRequest / AddCredit / ResumeConsumption /
NewBufferSize / CancelPartitionRequest for the channels.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import logging
from typing import Final, cast

from exchange.buffers.buffer import Buffer
from exchange.consumer.remote_input_channel import RemoteInputChannel
from exchange.errors import (
    AuthenticationError,
    ExchangeError,
    ProtocolError,
    TransportError,
    UsageError,
)
from exchange.protocol.codec import FrameDecoder, encode, max_frame_size_for
from exchange.protocol.handshake import ClientHandshake
from exchange.protocol.messages import (
    AddCredit,
    BufferResponse,
    CancelPartitionRequest,
    CloseRequest,
    ErrorCode,
    ErrorResponse,
    Message,
    NewBufferSize,
    PartitionRequest,
    ResumeConsumption,
    error_for_response,
)

__all__ = [
    "UNIX_PREFIX",
    "ConnectionManager",
    "PartitionRequestClientHandler",
    "parse_address",
]

log = logging.getLogger("exchange.client.network")

DEFAULT_CONNECT_TIMEOUT: Final = 10.0


UNIX_PREFIX: Final = "unix:"


def parse_address(address: str) -> tuple[str, int]:
    """``host:port`` or ``[v6]:port`` to (host, port); UsageError when malformed.

    ``unix:/path`` (a daemon's local socket) gives ``(path, 0)``.
    """
    if isinstance(address, str) and address.startswith(UNIX_PREFIX):
        path = address[len(UNIX_PREFIX) :]
        if not path:
            raise UsageError(f"daemon address {address!r} names no socket path")
        return path, 0
    if not isinstance(address, str):
        raise UsageError(f"daemon address must be a 'host:port' string, got {address!r}")
    host, sep, port_s = address.rpartition(":")
    if not sep or not host or not port_s.isdigit():
        raise UsageError(f"daemon address {address!r} is not of the form host:port")
    port = int(port_s)
    if not 0 < port < 65536:
        raise UsageError(f"daemon address {address!r}: port out of range")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return host, port


class PartitionRequestClientHandler(asyncio.Protocol):
    """One connection to a remote daemon's data port."""

    def __init__(self, address: str, secret: bytes | None, max_frame_size: int) -> None:
        self.address = address
        self._loop = asyncio.get_running_loop()
        self._decoder = FrameDecoder(max_frame_size)
        self._handshake = ClientHandshake(secret, address=address)
        self._transport: asyncio.Transport | None = None
        self._channels: dict[int, RemoteInputChannel] = {}
        self._ids = itertools.count(1)
        self._credit_pending: list[RemoteInputChannel] = []
        self._credit_scheduled = False
        self.ready: asyncio.Future[None] = self._loop.create_future()
        self.closed: asyncio.Future[None] = self._loop.create_future()
        self._error: ExchangeError | None = None
        self.bytes_received = 0

    # -- asyncio.Protocol ----------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport = cast(asyncio.Transport, transport)
        for msg in self._handshake.start():
            self._send(msg)

    def data_received(self, data: bytes) -> None:
        self.bytes_received += len(data)
        try:
            for msg in self._decoder.feed(data):
                self._dispatch(msg)
        except ExchangeError as e:
            self._fail(e)

    def connection_lost(self, exc: Exception | None) -> None:
        self._transport = None
        err = self._error or TransportError(
            f"connection to daemon {self.address} lost" + (f": {exc}" if exc else "")
        )
        if not self.ready.done():
            self.ready.set_exception(err)
            self.ready.exception()  # mark retrieved; the connector re-raises it
        channels = list(self._channels.values())
        self._channels.clear()
        for ch in channels:
            if not ch.finished and not ch.is_released:
                ch.set_error(err)
        if not self.closed.done():
            self.closed.set_result(None)

    # -- receiving -----------------------------------------------------------------------

    def _dispatch(self, msg: Message) -> None:
        hs = self._handshake
        if not hs.is_established:
            for out in hs.receive(msg):
                self._send(out)
            if hs.is_established and not self.ready.done():
                self.ready.set_result(None)
            return
        if type(msg) is BufferResponse:
            self._on_buffer_response(msg)
        elif isinstance(msg, ErrorResponse):
            self._on_error_response(msg)
        else:
            raise ProtocolError(f"unexpected {type(msg).__name__} from daemon {self.address}")

    def _on_buffer_response(self, msg: BufferResponse) -> None:
        ch = self._channels.get(msg.receiver_id)
        if ch is None:
            return  # cancelled meanwhile: the bytes are dropped, no buffer was taken
        payload = msg.payload
        n = len(payload)
        if msg.data_type.is_buffer:
            buf = ch.request_buffer()
            if buf is None:
                raise ProtocolError(
                    f"daemon {self.address} sent a buffer to receiver {msg.receiver_id} "
                    "without credit"
                )
            seg = buf.segment
            if n > seg.size:
                buf.release()
                raise ProtocolError(
                    f"buffer of {n} bytes exceeds the receiver's {seg.size}-byte segments; "
                    "all daemons and clients must use the same segment size"
                )
            seg.view()[:n] = payload
            buf.set_size(n)
            buf.compressed = msg.compressed
        else:
            buf = Buffer.wrap(payload, msg.data_type)
        ch.on_buffer(buf, msg.sequence_number, msg.backlog)

    def _on_error_response(self, msg: ErrorResponse) -> None:
        if msg.is_fatal:
            err = error_for_response(msg, self.address)
            if msg.code is ErrorCode.AUTH_FAILED and not isinstance(err, AuthenticationError):
                err = AuthenticationError(str(err))
            self._fail(err)
            return
        rid = msg.receiver_id
        assert rid is not None
        ch = self._channels.get(rid)
        if ch is None:
            return
        if msg.code is ErrorCode.PARTITION_NOT_FOUND:
            if ch.on_partition_not_found():
                return
            self._channels.pop(rid, None)
            return
        self._channels.pop(rid, None)
        ch.set_error(error_for_response(msg, self.address, ch.partition_id))

    def _fail(self, err: ExchangeError) -> None:
        """A connection-level failure: every channel of this connection fails."""
        if self._error is None:
            self._error = err
            log.warning("connection to %s failed: %s", self.address, err)
        transport = self._transport
        if transport is not None:
            transport.close()

    # -- PartitionRequestClient ----------------------------------------------------------

    def _send(self, msg: Message) -> None:
        transport = self._transport
        if transport is not None and not transport.is_closing():
            transport.writelines(encode(msg))

    def _check_open(self) -> None:
        if self._transport is None or self._error is not None:
            raise self._error or TransportError(f"connection to daemon {self.address} is closed")

    def request_subpartition(self, channel: RemoteInputChannel) -> None:
        self._check_open()
        if channel.receiver_id < 0:
            channel.receiver_id = next(self._ids)
        self._channels[channel.receiver_id] = channel
        self._send(
            PartitionRequest(
                channel.partition_id,
                channel.subpartition_index,
                channel.receiver_id,
                channel.initial_credit,
            )
        )

    def notify_credit_available(self, channel: RemoteInputChannel) -> None:
        self._credit_pending.append(channel)
        if not self._credit_scheduled:
            self._credit_scheduled = True
            self._loop.call_soon(self._flush_credits)

    def _flush_credits(self) -> None:
        self._credit_scheduled = False
        pending, self._credit_pending = self._credit_pending, []
        for ch in pending:
            credit = ch.get_and_reset_unannounced_credit()
            if credit > 0 and self._channels.get(ch.receiver_id) is ch:
                self._send(AddCredit(ch.receiver_id, credit))

    def resume_consumption(self, channel: RemoteInputChannel) -> None:
        if self._channels.get(channel.receiver_id) is channel:
            self._send(ResumeConsumption(channel.receiver_id))

    def notify_new_buffer_size(self, channel: RemoteInputChannel, size: int) -> None:
        if self._channels.get(channel.receiver_id) is channel:
            self._send(NewBufferSize(channel.receiver_id, size))

    def cancel_request(self, channel: RemoteInputChannel) -> None:
        if self._channels.pop(channel.receiver_id, None) is not None:
            self._send(CancelPartitionRequest(channel.receiver_id))

    # -- lifecycle -----------------------------------------------------------------------

    @property
    def is_open(self) -> bool:
        return self._transport is not None and self._error is None

    @property
    def num_channels(self) -> int:
        return len(self._channels)

    async def close(self) -> None:
        transport = self._transport
        if transport is not None:
            self._send(CloseRequest())
            transport.close()
        await self.closed


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
    ) -> None:
        if connect_retries < 0 or connect_backoff <= 0 or connect_timeout <= 0:
            raise UsageError("connect_retries >= 0, connect_backoff > 0, connect_timeout > 0")
        self._secret = secret
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
        host, port = parse_address(address)
        loop = asyncio.get_running_loop()
        delay = self._backoff
        last: BaseException | None = None
        for attempt in range(self._retries + 1):
            if attempt:
                await asyncio.sleep(delay)
                delay *= 2

            def factory() -> PartitionRequestClientHandler:
                return PartitionRequestClientHandler(address, self._secret, self._max_frame_size)

            try:
                if port == 0:
                    conn = loop.create_unix_connection(factory, host)
                else:
                    conn = loop.create_connection(factory, host, port)
                _, handler = await asyncio.wait_for(conn, self._timeout)
            except (OSError, TimeoutError) as e:
                last = e
                continue
            try:
                await asyncio.wait_for(asyncio.shield(handler.ready), self._timeout)
            except TimeoutError:
                await handler.close()
                raise TransportError(f"handshake with daemon {address} timed out") from None
            except ExchangeError:
                await handler.close()
                raise
            self._clients[address] = handler
            handler.closed.add_done_callback(functools.partial(self._forget, address, handler))
            return handler
        raise TransportError(
            f"cannot connect to daemon {address} after {self._retries + 1} attempts: {last}"
        )

    def _forget(
        self, address: str, handler: PartitionRequestClientHandler, _f: object = None
    ) -> None:
        if self._clients.get(address) is handler:
            del self._clients[address]

    @property
    def connections(self) -> list[PartitionRequestClientHandler]:
        return list(self._clients.values())

    async def close(self) -> None:
        for task in list(self._connecting.values()):
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
        for client in list(self._clients.values()):
            await client.close()
        self._clients.clear()
