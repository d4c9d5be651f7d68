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
from typing import Final

from client.connection_base import HandshakingClientProtocol
from exchange.buffers.buffer import Buffer
from exchange.consumer.remote_input_channel import RemoteInputChannel
from exchange.errors import (
    AuthenticationError,
    ExchangeError,
    ProtocolError,
    TransportError,
    UsageError,
)
from exchange.protocol.codec import max_frame_size_for
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


class PartitionRequestClientHandler(HandshakingClientProtocol):
    """One connection to a remote daemon's data port."""

    def __init__(self, address: str, secret: bytes | None, max_frame_size: int) -> None:
        super().__init__(address, secret, max_frame_size)
        self._channels: dict[int, RemoteInputChannel] = {}
        self._ids = itertools.count(1)
        self._credit_pending: list[RemoteInputChannel] = []
        self._credit_scheduled = False

    def on_connection_lost(self, error: ExchangeError) -> None:
        channels = list(self._channels.values())
        self._channels.clear()
        for ch in channels:
            if not ch.finished and not ch.is_released:
                ch.set_error(error)

    # -- receiving -----------------------------------------------------------------------

    def on_message(self, msg: Message) -> None:
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
            self.fail(err)
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

    # -- PartitionRequestClient ----------------------------------------------------------

    def request_subpartition(self, channel: RemoteInputChannel) -> None:
        self.check()
        if channel.receiver_id < 0:
            channel.receiver_id = next(self._ids)
        self._channels[channel.receiver_id] = channel
        self.send(
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

    # -- lifecycle -----------------------------------------------------------------------

    @property
    def num_channels(self) -> int:
        return len(self._channels)

    async def aclose(self) -> None:
        """Say goodbye (CloseRequest) and wait until the connection is gone."""
        self.send(CloseRequest())
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
                await handler.aclose()
                raise TransportError(f"handshake with daemon {address} timed out") from None
            except ExchangeError:
                await handler.aclose()
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
            await client.aclose()
        self._clients.clear()
