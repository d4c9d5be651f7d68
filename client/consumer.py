"""Consumers: read subpartitions of partitions on any daemon.

``AsyncPartitionReader`` builds a SingleInputGate with one RemoteInputChannel per location:
over TCP to a remote daemon's data port, or over the Unix socket when the partition lives
on this host's daemon (same protocol, no TCP). It owns a small NetworkBufferPool (exclusive
buffers per channel + floating buffers per gate), which must be whole when it closes.

``PartitionReader`` is the synchronous facade over the same gate and the same decode path
(``RecordStream``): the background loop hands the received Buffers themselves (no copy)
to the task thread in batches; the task thread decodes each buffer's memoryview and gives
the batch's buffers back to the loop thread in one ``call_soon_threadsafe`` (pools and
credit are loop-thread only), so credit returns as soon as a batch is decoded. At most
``window`` batches wait in between (bounded memory). Events reach ``event_handler`` in
the task thread, in order with the records; ``resume_consumption(channel)`` may be called
from any thread. ``close()`` from another thread ends a blocked ``records()`` at once with
an IllegalStateError.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections import deque
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Final

from client.network import UNIX_PREFIX, ConnectionManager
from client.runtime import ClientRuntime, get_runtime
from exchange.buffers.buffer import Buffer
from exchange.consumer.input_channel import DEFAULT_BACKOFF_INITIAL, DEFAULT_BACKOFF_MAX
from exchange.consumer.record_reader import EventHandler, RecordReader, RecordStream
from exchange.consumer.remote_input_channel import RemoteInputChannel
from exchange.consumer.single_input_gate import SingleInputGate
from exchange.errors import IllegalStateError, UsageError
from exchange.memory.network_buffer_pool import NetworkBufferPool
from exchange.partition.result_partition_id import ResultPartitionID
from exchange.serialization.codec import RecordCodec, default_codec

__all__ = ["AsyncPartitionReader", "PartitionLocation", "PartitionReader"]

_BATCH_BUFFERS: Final = 64
#: How long close() waits for buffers the task thread is still decoding.
_GIVE_BACK_TIMEOUT: Final = 30.0


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
        *,
        auto_resume_barriers: bool = True,
    ) -> None:
        self.gate = gate
        self.pool = pool
        self.connections = connections
        self.codec = codec
        self.reader = RecordReader(
            gate, codec, event_handler, auto_resume_barriers=auto_resume_barriers
        )
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
        auto_resume_barriers: bool = True,
    ) -> AsyncPartitionReader:
        """Open channels to every location and request their subpartitions.

        ``num_exclusive`` buffers per channel are its initial credit; ``num_floating`` are
        shared by the gate's channels as their backlogs ask; a partition not registered
        yet is requested again after ``backoff_initial`` doubling up to ``backoff_max``.
        ``auto_resume_barriers``: see ``exchange.consumer.record_reader``.
        """
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
        self = cls(
            gate,
            pool,
            connections,
            codec or default_codec(),
            event_handler,
            auto_resume_barriers=auto_resume_barriers,
        )
        try:
            await gate.request_partitions()
        except BaseException:
            await self.close()
            raise
        return self

    def resume_consumption(self, channel_index: int) -> None:
        """Unblock a channel after its aligned checkpoint barrier."""
        if not self.gate.is_closed:
            self.gate.resume_consumption(channel_index)

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
        self.reader.stream.clear()
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

_Item = tuple[int, int, Any]  # (kind, channel, Buffer | event | error)


def _release_all(buffers: list[Buffer]) -> None:
    for buf in buffers:
        buf.release()


class _Handoff:
    """Batches from the loop thread to the task thread; at most ``window`` in between.

    ``close()`` (any thread) wakes a waiting ``get`` (it raises IllegalStateError) and makes
    later ``put``s give their buffers back at once; ``drain()`` (loop thread) takes what
    was never consumed.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, window: int) -> None:
        if window < 1:
            raise UsageError(f"window must be >= 1, got {window}")
        self._loop = loop
        self._items: deque[list[_Item]] = deque()
        self._cond = threading.Condition()
        self._space = asyncio.Semaphore(window)
        self._closed = False

    async def put(self, batch: list[_Item]) -> bool:
        """Hand ``batch`` to the task thread; False if the handoff was closed (the caller
        keeps the batch's buffers)."""
        await self._space.acquire()
        with self._cond:
            if not self._closed:
                self._items.append(batch)
                self._cond.notify()
                return True
        return False

    def get(self) -> list[_Item]:
        with self._cond:
            while not self._items:
                if self._closed:
                    raise IllegalStateError("the PartitionReader was closed while reading")
                self._cond.wait()
            batch = self._items.popleft()
        self._loop.call_soon_threadsafe(self._space.release)
        return batch

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def drain(self) -> list[Buffer]:
        with self._cond:
            batches, self._items = list(self._items), deque()
        return [item for batch in batches for kind, _, item in batch if kind == _DATA]


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
        auto_resume_barriers: bool = True,
        runtime: ClientRuntime | None = None,
        window: int = 4,
    ) -> None:
        self._rt = runtime if runtime is not None else get_runtime()
        self.codec: RecordCodec = codec if codec is not None else default_codec()
        self._handoff = _Handoff(self._rt.loop, window)
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
        # The one decode path, run in the task thread; resuming goes to the loop thread.
        self._stream = RecordStream(
            self.codec,
            len(locations),
            self.resume_consumption,
            event_handler,
            auto_resume_barriers=auto_resume_barriers,
        )
        self._in_flight = 0  # buffers handed to the task thread, not yet given back
        self._all_back: asyncio.Event | None = None
        self._pump_future = self._rt.submit(self._pump())
        self._done = False
        self._closed = False

    @property
    def records_read(self) -> int:
        return self._stream.records_in

    async def _pump(self) -> None:
        """Loop thread: move buffers (themselves) and events to the task thread."""
        gate = self._core.gate
        put = self._handoff.put
        try:
            while True:
                batch: list[_Item] = []
                boe = gate.poll_next()
                if boe is None:
                    boe = await gate.get_next()
                    if boe is None:
                        await put([(_END, 0, None)])
                        return
                while boe is not None:
                    if boe.buffer is not None:
                        batch.append((_DATA, boe.channel_index, boe.buffer))
                    else:
                        batch.append((_EVENT, boe.channel_index, boe.event))
                    if len(batch) >= _BATCH_BUFFERS:
                        break
                    boe = gate.poll_next()
                buffers = [item for kind, _, item in batch if kind == _DATA]
                self._in_flight += len(buffers)
                try:
                    handed = await put(batch)
                except asyncio.CancelledError:
                    self._give_back(buffers)  # closed while waiting for room
                    raise
                if not handed:
                    self._give_back(buffers)
        except asyncio.CancelledError:
            raise
        except BaseException as e:
            await put([(_ERROR, 0, e)])

    def _give_back(self, buffers: list[Buffer]) -> None:
        """Loop thread: release buffers the task thread has decoded (returns credit)."""
        self._in_flight -= len(buffers)
        _release_all(buffers)
        if self._in_flight == 0 and self._all_back is not None:
            self._all_back.set()

    def resume_consumption(self, channel_index: int) -> None:
        """Unblock a channel after its aligned barrier (any thread)."""
        if not self._closed:
            self._rt.loop.call_soon_threadsafe(self._core.resume_consumption, channel_index)

    def __iter__(self) -> Iterator[Any]:
        return self.records()

    def records(self) -> Iterator[Any]:
        """Every record, in order per channel; raises the stream's error if it fails.

        A reader closed before the end (an early ``break`` closes it, and so does
        ``close()`` from another thread, even while this waits) raises IllegalStateError:
        nothing would ever arrive, and an empty read would pass for a short one.
        """
        if self._closed and not self._done:
            raise IllegalStateError("the PartitionReader was closed before the end of its input")
        get = self._handoff.get
        try:
            while not self._done:
                out = self._decode(get())
                for kind, ch, item in out:
                    if kind == _DATA:
                        yield from item
                    elif kind == _EVENT:
                        self._stream.on_event(item, ch)
                    elif kind == _END:
                        self._done = True
                    else:
                        self._done = True
                        raise item
                if self._closed and not self._done:
                    raise IllegalStateError("the PartitionReader was closed while reading")
        finally:
            self.close()

    def _decode(self, batch: list[_Item]) -> list[_Item]:
        """Decode a batch's buffers, then give them all back in one loop callback (also
        when decoding fails: the buffers not reached yet go back too)."""
        out: list[_Item] = []
        feed = self._stream.feed
        try:
            for kind, ch, item in batch:
                if kind == _DATA:
                    view = item.memoryview()
                    try:
                        records = feed(ch, view)
                    finally:
                        view.release()
                    if records:
                        out.append((_DATA, ch, records))
                else:
                    out.append((kind, ch, item))
        finally:
            buffers = [item for kind, _, item in batch if kind == _DATA]
            if buffers:
                self._rt.loop.call_soon_threadsafe(self._give_back, buffers)
        return out

    def read_all(self) -> list[Any]:
        return list(self.records())

    def close(self) -> None:
        """Stop reading and release everything (idempotent; any thread; after an early stop
        a ``records()`` still waiting raises IllegalStateError)."""
        if self._closed:
            return
        self._closed = True
        self._handoff.close()
        self._pump_future.cancel()
        self._rt.run(self._close_async())

    async def _close_async(self) -> None:
        pump = asyncio.wrap_future(self._pump_future)
        with contextlib.suppress(BaseException):
            await pump
        self._give_back(self._handoff.drain())
        if self._in_flight:  # the task thread is decoding a batch: wait for its buffers
            self._all_back = asyncio.Event()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._all_back.wait(), _GIVE_BACK_TIMEOUT)
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
