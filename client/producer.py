"""Producers: write one ResultPartition on the local daemon.

``AsyncPartitionWriter`` is the asyncio API; ``PartitionWriter`` is its synchronous facade
for PySpark task code: records are serialized in the calling thread (no GIL ping-pong),
cut into segment-sized buffers per subpartition, and handed to the process's background
loop a batch at a time, which pushes them to the daemon as credit allows. When the
partition's pool on the daemon is full, the push waits: the task blocks (backpressure).

Flushing follows the buffer timeout: 0 pushes after every record, -1 only full buffers
(and on flush/close), otherwise partial buffers are pushed once ``buffer_timeout`` seconds
passed since the last flush (checked as records are emitted).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from types import TracebackType
from typing import Any, Final

from client.local_connection import LocalConnection, resolve_daemon_socket
from client.runtime import ClientRuntime, get_runtime
from exchange.errors import RecordTooLargeError, UsageError, WriterClosedError
from exchange.events.events import AbstractEvent, EventSerializer
from exchange.partition.result_partition_id import ResultPartitionID
from exchange.protocol.local_messages import (
    ALL_SUBPARTITIONS,
    CreatePartition,
    FailPartition,
    FinishPartition,
    PartitionCreated,
    PartitionFinished,
)
from exchange.serialization.codec import MsgpackCodec, RecordCodec
from exchange.writer.hashing import FIBONACCI_64, deterministic_hash

__all__ = ["AsyncPartitionWriter", "PartitionWriter", "SubpartitionChunker"]

DEFAULT_BUFFER_TIMEOUT: Final = 0.1
_NO_KEY: Final[Any] = object()
_BATCH_BYTES: Final = 256 * 1024
_KEY_CACHE: Final = 1 << 16
_M64: Final = 0xFFFFFFFFFFFFFFFF
_I63: Final = 2**63

Chunk = tuple[int, bytes]


class SubpartitionChunker:
    """Serializes records per subpartition and cuts the byte streams into buffers."""

    def __init__(self, num_subpartitions: int, segment_size: int, codec: RecordCodec) -> None:
        self.n = num_subpartitions
        self.segment_size = segment_size
        self._bufs = [bytearray() for _ in range(num_subpartitions)]
        enc = codec.new_encoder()
        self._encode_into = enc.encode_into
        self.max_record_size = enc.max_record_size
        fast = enc.encode
        self.pack: Callable[[Any], bytes | bytearray | memoryview] = (
            fast if fast is not None else self._encode_slow
        )
        self.records = 0

    def _encode_slow(self, record: Any) -> bytes:
        tmp = bytearray()
        self._encode_into(record, tmp)
        return bytes(tmp)

    def add(self, index: int, record: Any, out: list[Chunk]) -> None:
        buf = self._bufs[index]
        self._encode_into(record, buf)
        self.records += 1
        if len(buf) >= self.segment_size:
            self._cut(index, out)

    def add_all(self, index: int, encoded: bytes, out: list[Chunk]) -> None:
        """Append already encoded bytes (a broadcast record, encoded once)."""
        buf = self._bufs[index]
        buf += encoded
        if len(buf) >= self.segment_size:
            self._cut(index, out)

    def encode(self, record: Any) -> bytes:
        tmp = bytearray()
        self._encode_into(record, tmp)
        return bytes(tmp)

    def _cut(self, index: int, out: list[Chunk]) -> None:
        buf = self._bufs[index]
        seg = self.segment_size
        while len(buf) >= seg:
            out.append((index, bytes(buf[:seg])))
            del buf[:seg]

    def drain(self, out: list[Chunk]) -> None:
        """Every pending byte, as (possibly partial) buffers."""
        for i, buf in enumerate(self._bufs):
            if buf:
                self._cut(i, out)
                if buf:
                    out.append((i, bytes(buf)))
                    buf.clear()

    @property
    def pending_bytes(self) -> int:
        return sum(len(b) for b in self._bufs)


class AsyncPartitionWriter:
    """Writes one partition on the local daemon, from asyncio code."""

    def __init__(
        self,
        conn: LocalConnection,
        partition_id: ResultPartitionID,
        num_subpartitions: int,
        segment_size: int,
        codec: RecordCodec,
        buffer_timeout: float,
    ) -> None:
        self.conn = conn
        self.partition_id = partition_id
        self.num_subpartitions = num_subpartitions
        self.segment_size = segment_size
        self.codec = codec
        self.buffer_timeout = buffer_timeout
        self.chunker = SubpartitionChunker(num_subpartitions, segment_size, codec)
        self._out: list[Chunk] = []
        self._closed = False
        self._last_flush = time.monotonic()
        self.result: PartitionFinished | None = None

    @classmethod
    async def open(
        cls,
        partition_id: ResultPartitionID,
        num_subpartitions: int,
        *,
        blocking: bool = False,
        daemon_socket: str | None = None,
        codec: RecordCodec | None = None,
        secret: bytes | None = None,
        buffer_timeout: float = DEFAULT_BUFFER_TIMEOUT,
    ) -> AsyncPartitionWriter:
        if not isinstance(num_subpartitions, int) or num_subpartitions <= 0:
            raise UsageError(f"num_subpartitions must be a positive int, got {num_subpartitions!r}")
        if buffer_timeout != -1 and buffer_timeout < 0:
            raise UsageError(f"buffer_timeout must be >= 0 or -1, got {buffer_timeout}")
        path = resolve_daemon_socket(daemon_socket)
        conn = await LocalConnection.connect(path, secret=secret)
        try:
            reply = await conn.request(CreatePartition(partition_id, blocking, num_subpartitions))
        except BaseException:
            await conn.aclose()
            raise
        assert isinstance(reply, PartitionCreated)
        return cls(
            conn,
            partition_id,
            num_subpartitions,
            reply.segment_size,
            codec if codec is not None else MsgpackCodec(),
            buffer_timeout,
        )

    # -- the data path, shared with the sync facade ---------------------------------------

    async def push_chunks(self, chunks: list[Chunk]) -> None:
        push = self.conn.push
        for index, data in chunks:
            await push(index, data)

    def _check_open(self) -> None:
        if self._closed:
            raise WriterClosedError(f"writer of {self.partition_id} is closed")

    async def _after_add(self) -> None:
        timeout = self.buffer_timeout
        if timeout == 0:
            self.chunker.drain(self._out)
        elif timeout > 0:
            now = time.monotonic()
            if now - self._last_flush >= timeout:
                self._last_flush = now
                self.chunker.drain(self._out)
        if self._out:
            out, self._out = self._out, []
            await self.push_chunks(out)

    # -- API -------------------------------------------------------------------------------

    async def emit(self, record: Any, key: Any = _NO_KEY) -> None:
        """Emit to the subpartition of ``key`` (default: ``record[0]``)."""
        k = record[0] if key is _NO_KEY else key
        await self.emit_to(record, deterministic_hash(k) % self.num_subpartitions)

    async def emit_to(self, record: Any, index: int) -> None:
        self._check_open()
        if not 0 <= index < self.num_subpartitions:
            raise UsageError(f"subpartition {index} out of range [0, {self.num_subpartitions})")
        self.chunker.add(index, record, self._out)
        await self._after_add()

    async def broadcast(self, record: Any) -> None:
        self._check_open()
        encoded = self.chunker.encode(record)
        for i in range(self.num_subpartitions):
            self.chunker.add_all(i, encoded, self._out)
        await self._after_add()

    async def broadcast_event(self, event: AbstractEvent) -> None:
        """Send ``event`` to every subpartition after every record emitted so far."""
        self._check_open()
        await self.flush()
        data_type = EventSerializer.to_buffer_data_type(event)
        self.conn.push_event(ALL_SUBPARTITIONS, data_type, EventSerializer.to_bytes(event))

    async def flush(self) -> None:
        self.chunker.drain(self._out)
        self._last_flush = time.monotonic()
        out, self._out = self._out, []
        await self.push_chunks(out)

    async def close(self) -> PartitionFinished:
        """Flush, finish the partition (EndOfPartition everywhere), wait for the daemon."""
        self._check_open()
        await self.flush()
        reply = await self.conn.request(FinishPartition())
        self._closed = True
        await self.conn.aclose()
        assert isinstance(reply, PartitionFinished)
        self.result = reply
        return reply

    async def fail(self, cause: BaseException | str | None = None) -> None:
        """Abort: the daemon fails the partition, its readers get ProducerFailedError."""
        if self._closed:
            return
        self._closed = True
        self.conn.send(FailPartition(str(cause) if cause is not None else "aborted"))
        await self.conn.aclose()

    async def __aenter__(self) -> AsyncPartitionWriter:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: object
    ) -> None:
        if exc is None:
            await self.close()
        else:
            await self.fail(exc)


class PartitionWriter:
    """Synchronous facade over AsyncPartitionWriter for PySpark task code.

    Use as a context manager: leaving it normally closes the partition; leaving it with an
    exception fails the partition, so readers never mistake a crash for the end.
    """

    def __init__(
        self,
        partition_id: ResultPartitionID,
        num_subpartitions: int,
        *,
        blocking: bool = False,
        daemon_socket: str | None = None,
        codec: RecordCodec | None = None,
        secret: bytes | None = None,
        buffer_timeout: float = DEFAULT_BUFFER_TIMEOUT,
        runtime: ClientRuntime | None = None,
    ) -> None:
        self._rt = runtime if runtime is not None else get_runtime()
        self._core = self._rt.run(
            AsyncPartitionWriter.open(
                partition_id,
                num_subpartitions,
                blocking=blocking,
                daemon_socket=daemon_socket,
                codec=codec,
                secret=secret,
                buffer_timeout=buffer_timeout,
            )
        )
        self.partition_id = partition_id
        self.num_subpartitions = num_subpartitions
        self.segment_size = self._core.segment_size
        self._chunker = self._core.chunker
        self._out: list[Chunk] = []
        self._out_bytes = 0
        self._timeout = buffer_timeout
        self._last_flush = time.monotonic()
        self._closed = False

    @property
    def records_written(self) -> int:
        return self._chunker.records

    def _check_open(self) -> None:
        if self._closed:
            raise WriterClosedError(f"writer of {self.partition_id} is closed")

    def _ship(self, force: bool = False) -> None:
        out = self._out
        if out and (force or len(out) * self.segment_size >= _BATCH_BYTES):
            self._out = []
            self._rt.run(self._core.push_chunks(out))

    def _tick(self) -> None:
        t = self._timeout
        if t == 0:
            self._chunker.drain(self._out)
            self._ship(force=True)
        elif t > 0:
            now = time.monotonic()
            if now - self._last_flush >= t:
                self._last_flush = now
                self._chunker.drain(self._out)
                self._ship(force=True)
            else:
                self._ship()
        else:
            self._ship()

    def emit(self, record: Any, key: Any = _NO_KEY) -> None:
        """Emit to the subpartition of ``key`` (default: ``record[0]``)."""
        self._check_open()
        k = record[0] if key is _NO_KEY else key
        self._chunker.add(deterministic_hash(k) % self.num_subpartitions, record, self._out)
        self._tick()

    def emit_to(self, record: Any, index: int) -> None:
        self._check_open()
        if not isinstance(index, int) or not 0 <= index < self.num_subpartitions:
            raise UsageError(f"subpartition {index!r} out of range [0, {self.num_subpartitions})")
        self._chunker.add(index, record, self._out)
        self._tick()

    def emit_all(
        self,
        records: Iterable[Any],
        partition_func: Callable[[Any], int] | None = None,
        key_func: Callable[[Any], Any] | None = None,
    ) -> int:
        """Emit many records; each goes to ``partition_func(key) % n`` (default: the
        deterministic hash of the key), the key being ``key_func(record)`` or ``record[0]``.

        The hot loop of every PySpark producer: per record one key lookup in a bounded
        key-to-subpartition cache (skewed keys repeat), one ``Packer.pack`` and one append.
        """
        self._check_open()
        n = self.num_subpartitions
        chunker = self._chunker
        bufs = chunker._bufs
        pack = chunker.pack
        max_record = chunker.max_record_size
        seg = self.segment_size
        out = self._out
        # Only keys of exactly these types are cached: keys Python finds equal but the
        # hash tells apart (1, True, 1.0, or tuples of them) must not share an entry.
        cache: dict[Any, int] = {}
        cache_get = cache.get
        count = 0
        check_every = 1 if self._timeout == 0 else 512
        hash_ints = partition_func is None
        for record in records:
            key = record[0] if key_func is None else key_func(record)
            t = type(key)
            if t is int and hash_ints and -_I63 <= key < _I63:
                # deterministic_hash's int path, inlined: cheaper than any cache lookup
                index = ((((key & _M64) * FIBONACCI_64) & _M64) >> 32) % n
            else:
                cacheable = t is int or t is str or t is bytes
                index = cache_get(key) if cacheable else None
                if index is None:
                    if partition_func is None:
                        index = deterministic_hash(key) % n
                    else:
                        p = partition_func(key)
                        if not isinstance(p, int):
                            raise UsageError(f"partition function returned {p!r}, not an int")
                        index = p % n
                    if cacheable and len(cache) < _KEY_CACHE:
                        cache[key] = index
            data = pack(record)
            buf = bufs[index]
            buf += data
            count += 1
            if len(buf) >= seg:
                # every record larger than a segment passes here, so this check suffices
                if len(data) > max_record:
                    del buf[len(buf) - len(data) :]
                    raise RecordTooLargeError(len(data), max_record)
                chunker._cut(index, out)
                if len(out) * seg >= _BATCH_BYTES:
                    self._tick()
                    out = self._out
            if count % check_every == 0:
                self._tick()
                out = self._out
        chunker.records += count
        self._tick()
        return count

    def broadcast(self, record: Any) -> None:
        self._check_open()
        encoded = self._chunker.encode(record)
        for i in range(self.num_subpartitions):
            self._chunker.add_all(i, encoded, self._out)
        self._chunker.records += 1
        self._tick()

    def broadcast_event(self, event: AbstractEvent) -> None:
        self._check_open()
        self.flush()
        self._rt.run(self._core.broadcast_event(event))

    def flush(self) -> None:
        self._check_open()
        self._chunker.drain(self._out)
        self._last_flush = time.monotonic()
        self._ship(force=True)

    def close(self) -> PartitionFinished:
        self.flush()
        self._closed = True
        return self._rt.run(self._core.close())

    def fail(self, cause: BaseException | str | None = None) -> None:
        if self._closed:
            return
        self._closed = True
        self._rt.run(self._core.fail(cause))

    def __enter__(self) -> PartitionWriter:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc is None:
            self.close()
        else:
            self.fail(exc)
