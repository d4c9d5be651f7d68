"""Consumers: read subpartitions of partitions on any daemon.

``AsyncPartitionReader`` builds a SingleInputGate with one RemoteInputChannel per location:
over TCP to a remote daemon's data port, or over the Unix socket when the partition lives
on this host's daemon (same protocol, no TCP). It owns a small NetworkBufferPool (exclusive
buffers per channel + floating buffers per gate), which must be whole when it closes.

``PartitionReader`` is the synchronous facade: the background loop pulls buffers, copies
their bytes out (releasing the buffer at once, which returns credit upstream) and hands
them over in batches; the task thread decodes them (faster than decoding on the loop
thread: no GIL ping-pong). At most ``window`` batches wait in between (bounded memory).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Final

from client.network import UNIX_PREFIX, ConnectionManager
from client.runtime import ClientRuntime, get_runtime
from exchange.consumer.input_channel import DEFAULT_BACKOFF_INITIAL, DEFAULT_BACKOFF_MAX
from exchange.consumer.record_reader import RecordReader
from exchange.consumer.remote_input_channel import RemoteInputChannel
from exchange.consumer.single_input_gate import SingleInputGate
from exchange.errors import CorruptRecordError, IllegalStateError, UsageError
from exchange.events.events import AbstractEvent, CheckpointBarrier, EndOfPartitionEvent
from exchange.memory.network_buffer_pool import NetworkBufferPool
from exchange.partition.result_partition_id import ResultPartitionID
from exchange.serialization.codec import RecordCodec, default_codec

__all__ = ["AsyncPartitionReader", "PartitionLocation", "PartitionReader"]

_BATCH_BUFFERS: Final = 64

EventHandler = Callable[[AbstractEvent, int], bool | None]


@dataclass(frozen=True, slots=True)
class PartitionLocation:
    """Where one input of a consumer lives.

    ``data_address`` is the daemon's data port (``host:port``); ``local_socket`` and
    ``daemon_id`` let a reader on the same host use the Unix socket instead.
    """

    partition_id: ResultPartitionID
    subpartition_index: int
    data_address: str
    daemon_id: str | None = None
    local_socket: str | None = None

    def address_for(self, local_daemon_id: str | None) -> str:
        if self.local_socket and local_daemon_id is not None and local_daemon_id == self.daemon_id:
            return UNIX_PREFIX + self.local_socket
        return self.data_address


class AsyncPartitionReader:
    """Reads records from a list of partition locations (asyncio API)."""

    def __init__(
        self,
        gate: SingleInputGate,
        pool: NetworkBufferPool,
        connections: ConnectionManager,
        codec: RecordCodec,
        event_handler: EventHandler | None,
    ) -> None:
        self.gate = gate
        self.pool = pool
        self.connections = connections
        self.codec = codec
        self.reader = RecordReader(gate, codec, event_handler)
        self._closed = False

    @classmethod
    async def open(
        cls,
        locations: Sequence[PartitionLocation],
        *,
        local_daemon_id: str | None = None,
        codec: RecordCodec | None = None,
        secret: bytes | None = None,
        segment_size: int = 32 * 1024,
        num_exclusive: int = 2,
        num_floating: int = 8,
        backoff_initial: float = DEFAULT_BACKOFF_INITIAL,
        backoff_max: float = DEFAULT_BACKOFF_MAX,
        event_handler: EventHandler | None = None,
    ) -> AsyncPartitionReader:
        if num_exclusive < 1 or num_floating < 0:
            raise UsageError("num_exclusive must be >= 1 and num_floating >= 0")
        for loc in locations:
            if not isinstance(loc, PartitionLocation):
                raise UsageError(f"expected PartitionLocation, got {loc!r}")
        n = len(locations)
        pool = NetworkBufferPool(max(n * num_exclusive + num_floating, 1), segment_size)
        connections = ConnectionManager(secret=secret, segment_size=segment_size)
        gate = SingleInputGate(
            "reader", pool.create_buffer_pool(0, max(num_floating, 1)) if num_floating else None
        )
        channels = [
            RemoteInputChannel(
                gate,
                i,
                loc.partition_id,
                loc.subpartition_index,
                loc.address_for(local_daemon_id),
                connections,
                pool,
                num_exclusive=num_exclusive,
                backoff_initial=backoff_initial,
                backoff_max=backoff_max,
            )
            for i, loc in enumerate(locations)
        ]
        gate.set_input_channels(channels)
        self = cls(gate, pool, connections, codec or default_codec(), event_handler)
        try:
            await gate.request_partitions()
        except BaseException:
            await self.close()
            raise
        return self

    async def next_batch(self) -> list[Any] | None:
        return await self.reader.next_batch()

    async def __aiter__(self) -> AsyncIterator[Any]:
        while True:
            batch = await self.reader.next_batch()
            if batch is None:
                return
            for r in batch:
                yield r

    async def read_all(self) -> list[Any]:
        return await self.reader.read_all()

    async def close(self) -> None:
        """Release every channel and connection; the reader's pool must be whole."""
        if self._closed:
            return
        self._closed = True
        self.gate.close()
        await self.connections.close()
        self.pool.check_consistency()
        whole = self.pool.is_whole()
        self.pool.destroy()
        if not whole:  # pragma: no cover - a leak is a bug; make it loud
            raise IllegalStateError("reader's network buffer pool is not whole after close")

    async def __aenter__(self) -> AsyncPartitionReader:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


# -- the synchronous facade ------------------------------------------------------------

_DATA: Final = 0
_EVENT: Final = 1
_END: Final = 2
_ERROR: Final = 3


class _Handoff:
    """Batches from the loop thread to the task thread; at most ``window`` in between."""

    def __init__(self, loop: asyncio.AbstractEventLoop, window: int) -> None:
        self._loop = loop
        self._items: deque[list[tuple[int, int, Any]]] = deque()
        self._cond = threading.Condition()
        self._space = asyncio.Semaphore(window)

    async def put(self, batch: list[tuple[int, int, Any]]) -> None:
        await self._space.acquire()
        with self._cond:
            self._items.append(batch)
            self._cond.notify()

    def get(self) -> list[tuple[int, int, Any]]:
        with self._cond:
            while not self._items:
                self._cond.wait()
            batch = self._items.popleft()
        self._loop.call_soon_threadsafe(self._space.release)
        return batch


class PartitionReader:
    """Iterate the records of a set of partition locations from synchronous code."""

    def __init__(
        self,
        locations: Sequence[PartitionLocation],
        *,
        local_daemon_id: str | None = None,
        codec: RecordCodec | None = None,
        secret: bytes | None = None,
        segment_size: int = 32 * 1024,
        num_exclusive: int = 2,
        num_floating: int = 8,
        backoff_initial: float = DEFAULT_BACKOFF_INITIAL,
        backoff_max: float = DEFAULT_BACKOFF_MAX,
        event_handler: EventHandler | None = None,
        runtime: ClientRuntime | None = None,
        window: int = 4,
    ) -> None:
        self._rt = runtime if runtime is not None else get_runtime()
        self.codec: RecordCodec = codec if codec is not None else default_codec()
        self._handler = event_handler
        self._core = self._rt.run(
            AsyncPartitionReader.open(
                locations,
                local_daemon_id=local_daemon_id,
                codec=self.codec,
                secret=secret,
                segment_size=segment_size,
                num_exclusive=num_exclusive,
                num_floating=num_floating,
                backoff_initial=backoff_initial,
                backoff_max=backoff_max,
            )
        )
        self._decoders = [self.codec.new_decoder() for _ in locations]
        self._handoff = _Handoff(self._rt.loop, window)
        self._pump_future = self._rt.submit(self._pump())
        self._done = False
        self._closed = False
        self.records_read = 0

    async def _pump(self) -> None:
        """Loop thread: move buffers (as bytes) and events to the task thread."""
        gate = self._core.gate
        put = self._handoff.put
        try:
            while True:
                batch: list[tuple[int, int, Any]] = []
                boe = gate.poll_next()
                if boe is None:
                    boe = await gate.get_next()
                    if boe is None:
                        await put([(_END, 0, None)])
                        return
                while boe is not None:
                    buf = boe.buffer
                    if buf is not None:
                        try:
                            batch.append((_DATA, boe.channel_index, bytes(buf.memoryview())))
                        finally:
                            buf.release()
                    else:
                        event = boe.event
                        batch.append((_EVENT, boe.channel_index, event))
                        if isinstance(event, CheckpointBarrier) and event.options.exactly_once:
                            gate.resume_consumption(boe.channel_index)
                    if len(batch) >= _BATCH_BUFFERS:
                        break
                    boe = gate.poll_next()
                await put(batch)
        except asyncio.CancelledError:
            raise
        except BaseException as e:
            await put([(_ERROR, 0, e)])

    def __iter__(self) -> Iterator[Any]:
        return self.records()

    def records(self) -> Iterator[Any]:
        """Every record, in order per channel; raises the stream's error if it fails.

        A reader closed before the end (an early ``break`` closes it) raises
        IllegalStateError: nothing would ever arrive, and an empty read would pass for
        a short one.
        """
        if self._closed and not self._done:
            raise IllegalStateError("the PartitionReader was closed before the end of its input")
        decoders = self._decoders
        get = self._handoff.get
        try:
            while not self._done:
                for kind, ch, item in get():
                    if kind == _DATA:
                        dec = decoders[ch]
                        dec.feed(item)
                        recs = dec.take()
                        if recs:
                            self.records_read += len(recs)
                            yield from recs
                    elif kind == _EVENT:
                        self._on_event(item, ch)
                    elif kind == _END:
                        self._done = True
                    else:
                        self._done = True
                        raise item
        finally:
            self.close()

    def read_all(self) -> list[Any]:
        return list(self.records())

    def _on_event(self, event: AbstractEvent, channel: int) -> None:
        if isinstance(event, EndOfPartitionEvent) and self._decoders[channel].has_partial_record:
            raise CorruptRecordError(f"channel {channel} ended inside a record")
        if self._handler is not None:
            self._handler(event, channel)

    def close(self) -> None:
        """Stop reading and release everything (idempotent; safe after an early stop)."""
        if self._closed:
            return
        self._closed = True
        self._pump_future.cancel()
        self._rt.run(self._close_async())

    async def _close_async(self) -> None:
        pump = asyncio.wrap_future(self._pump_future)
        with contextlib.suppress(BaseException):
            await pump
        await self._core.close()

    def __enter__(self) -> PartitionReader:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
