"""RecordWriter: records in, serialized into a ResultPartition's subpartitions.

Each target subpartition has its own SpanningRecordSerializer. Small records collect in
the serializer's intermediate buffer and are copied into the partition's BufferBuilders
one buffer's worth at a time, so the per-record cost is one encode and one append; a
large record is copied across as many buffers as it needs. Copying is the only step that
can wait: when the partition's pool is empty the writer awaits a buffer (backpressure).

Flushing (Flink's output flusher): with ``buffer_timeout`` > 0 a background task makes
everything written so far readable every ``buffer_timeout`` seconds; 0 flushes after every
record; -1 flushes only when buffers fill, on ``flush()`` and on ``close()``. The flusher
never waits for buffers: when the writer is backpressured there is nothing new to flush.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import Iterable
from typing import Any, Final

from exchange.errors import IllegalStateError, UsageError, WriterClosedError
from exchange.events.events import AbstractEvent
from exchange.partition.result_partition import ResultPartition
from exchange.serialization.codec import MsgpackCodec, RecordCodec
from exchange.serialization.spanning_record_serializer import SpanningRecordSerializer
from exchange.writer.channel_selector import ChannelSelector, RoundRobinSelector
from exchange.writer.hashing import deterministic_hash

__all__ = ["DEFAULT_BUFFER_TIMEOUT", "BroadcastRecordWriter", "RecordWriter"]

DEFAULT_BUFFER_TIMEOUT: Final = 0.1
_NO_KEY: Final[Any] = object()
#: Records taken from ``emit_all``'s iterable at a time on the one-subpartition path.
_CHUNK: Final = 1024


class RecordWriter:
    """Writes records into one ResultPartition. Use from one task at a time."""

    def __init__(
        self,
        partition: ResultPartition,
        selector: ChannelSelector | None = None,
        codec: RecordCodec | None = None,
        *,
        buffer_timeout: float = DEFAULT_BUFFER_TIMEOUT,
    ) -> None:
        if buffer_timeout != -1 and buffer_timeout < 0:
            raise UsageError(f"buffer_timeout must be >= 0 or -1, got {buffer_timeout}")
        self.partition = partition
        self.num_channels = partition.num_subpartitions
        self.selector: ChannelSelector = selector if selector is not None else RoundRobinSelector()
        self.selector.setup(self.num_channels)
        self.codec: RecordCodec = codec if codec is not None else MsgpackCodec()
        self._serializers = [SpanningRecordSerializer(self.codec) for _ in range(self.num_channels)]
        self._broadcast_serializer = SpanningRecordSerializer(self.codec)
        self._spill_at = partition.segment_size
        self.buffer_timeout = buffer_timeout
        self._flush_always = buffer_timeout == 0
        self._flusher: asyncio.Task[None] | None = None
        self._busy = False
        self._closed = False
        self.records_out = 0

    # -- emitting ------------------------------------------------------------------------

    async def emit(self, record: Any, key: Any = _NO_KEY) -> None:
        """Emit to the subpartition the selector (or ``key``'s hash) picks."""
        if key is _NO_KEY:
            target = self.selector.select_channel(record)
        else:
            target = deterministic_hash(key) % self.num_channels
        await self.emit_to(record, target)

    async def emit_to(self, record: Any, target: int) -> None:
        """Emit to subpartition ``target``."""
        if self._closed or self.partition.is_released:
            self._raise_not_writable()
        if self._flusher is None and self.buffer_timeout > 0:
            self._start_flusher()
        ser = self._serializers[target]
        self.records_out += 1
        if ser.serialize_record(record) >= self._spill_at or self._flush_always:
            await self._copy(target)
            if self._flush_always:
                self.partition.flush(target)

    async def emit_all(self, records: Iterable[Any]) -> int:
        """Emit many records through the selector; returns how many."""
        if self._closed or self.partition.is_released:
            self._raise_not_writable()
        if self._flush_always:
            n = 0
            for r in records:
                await self.emit(r)
                n += 1
            return n
        if self._flusher is None and self.buffer_timeout > 0:
            self._start_flusher()
        if self.num_channels == 1:
            return await self._emit_all_to_one(records)
        select = self.selector.select_channel
        sers = [s.serialize_record for s in self._serializers]
        spill_at = self._spill_at
        n = 0
        for record in records:
            target = select(record)
            if sers[target](record) >= spill_at:
                await self._copy(target)
            n += 1
        self.records_out += n
        return n

    async def _emit_all_to_one(self, records: Iterable[Any]) -> int:
        """One subpartition takes every record: no selection, and the serializer's batch
        path (``serialize_until``), a buffer's worth at a time."""
        ser = self._serializers[0]
        spill_at = self._spill_at
        it = iter(records)
        n = 0
        while chunk := list(itertools.islice(it, _CHUNK)):
            taken = iter(chunk)
            while ser.serialize_until(taken, spill_at) >= spill_at:
                await self._copy(0)
            n += len(chunk)
            self.records_out += len(chunk)
        return n

    async def broadcast_emit(self, record: Any) -> None:
        """Emit one record to every subpartition (serialized and copied once)."""
        if self._closed or self.partition.is_released:
            self._raise_not_writable()
        await self._copy_all_unicast()
        self._broadcast_serializer.serialize_record(record)
        self.records_out += 1
        await self._copy_broadcast()
        if self._flush_always:
            self.partition.flush_all()

    async def broadcast_event(self, event: AbstractEvent) -> None:
        """Send ``event`` to every subpartition after every record emitted so far."""
        if self._closed or self.partition.is_released:
            self._raise_not_writable()
        await self._copy_all_unicast()
        await self._copy_broadcast()
        self.partition.broadcast_event(event)
        if self._flush_always:
            self.partition.flush_all()

    def _raise_not_writable(self) -> None:
        if self._closed:
            raise WriterClosedError("RecordWriter is closed")
        # released, e.g. by a consumer that left early: say so now, not a buffer later
        self.partition.check_writable()

    # -- copying into buffers ------------------------------------------------------------

    async def _copy(self, target: int) -> None:
        if self._busy:
            raise IllegalStateError("RecordWriter used by two tasks at once")
        self._busy = True
        try:
            await self.partition.emit(target, self._serializers[target])
        finally:
            self._busy = False
        self._serializers[target].prune()

    async def _copy_all_unicast(self) -> None:
        for i, ser in enumerate(self._serializers):
            if ser.has_serialized_data:
                await self._copy(i)

    async def _copy_broadcast(self) -> None:
        ser = self._broadcast_serializer
        if not ser.has_serialized_data:
            return
        if self._busy:
            raise IllegalStateError("RecordWriter used by two tasks at once")
        self._busy = True
        try:
            await self.partition.broadcast(ser)
        finally:
            self._busy = False
        ser.prune()

    # -- flushing and closing ------------------------------------------------------------

    async def flush(self) -> None:
        """Make everything emitted so far readable (may wait for buffers)."""
        await self._copy_all_unicast()
        await self._copy_broadcast()
        self.partition.flush_all()

    def _flush_nowait(self) -> None:
        """The output flusher's pass: move pending bytes where a buffer is at hand."""
        if self._busy or self._closed or self.partition.is_released:
            return
        subpartitions = self.partition.subpartitions
        for i, ser in enumerate(self._serializers):
            # A subpartition whose consumer left is the writer's to report (at its next
            # copy into it), not a reason for the flusher to die and stop flushing the rest.
            if ser.has_serialized_data and not subpartitions[i].is_released:
                self.partition.emit_nowait(i, ser)
        if self._broadcast_serializer.has_serialized_data:
            self.partition.broadcast_nowait(self._broadcast_serializer)
        self.partition.flush_all()

    def _start_flusher(self) -> None:
        self._flusher = asyncio.get_running_loop().create_task(
            self._run_flusher(), name=f"output-flusher[{self.partition.partition_id}]"
        )

    async def _run_flusher(self) -> None:
        interval = self.buffer_timeout
        while True:
            await asyncio.sleep(interval)
            self._flush_nowait()

    async def _stop_flusher(self) -> None:
        task, self._flusher = self._flusher, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def close(self) -> None:
        """Flush, finish the partition (EndOfPartition everywhere) and stop the flusher."""
        if self._closed:
            return
        try:
            await self.flush()
            self.partition.finish()
        finally:
            self._closed = True
            await self._stop_flusher()

    async def fail(self, cause: BaseException | None = None) -> None:
        """Abort: the partition is failed and its readers get a ProducerFailedError."""
        self._closed = True
        await self._stop_flusher()
        for ser in self._serializers:
            ser.clear()
        self._broadcast_serializer.clear()
        self.partition.fail(cause)

    @property
    def is_closed(self) -> bool:
        return self._closed

    async def __aenter__(self) -> RecordWriter:
        return self

    async def __aexit__(self, exc_type: object, exc: BaseException | None, tb: object) -> None:
        if exc is None:
            await self.close()
        else:
            await self.fail(exc)


class BroadcastRecordWriter(RecordWriter):
    """Every record to every subpartition; each record serialized and copied once."""

    async def emit(self, record: Any, key: Any = _NO_KEY) -> None:
        await self.broadcast_emit(record)

    async def emit_all(self, records: Iterable[Any]) -> int:
        n = 0
        for r in records:
            await self.broadcast_emit(r)
            n += 1
        return n
