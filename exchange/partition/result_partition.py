"""ResultPartition: the output of one producer, split into subpartitions.

Owns its LocalBufferPool (``num_required = number of subpartitions``, as in Flink) and the
BufferBuilders being filled: one *unicast* builder per subpartition, or one *broadcast*
builder shared by all subpartitions (a record broadcast is copied into memory once; each
subpartition holds its own consumer of that one buffer). Switching between unicast and
broadcast, and emitting an event, first finishes the open builders so that order holds.

Writing is asynchronous only where it must be: when the pool has no free segment the
writer awaits one, which is how a slow reader slows the producer (backpressure).
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

from exchange.buffers.buffer import Buffer
from exchange.buffers.buffer_builder import BufferBuilder, BufferConsumer
from exchange.errors import (
    PartitionReleasedError,
    PoolDestroyedError,
    ProducerFailedError,
    SubpartitionIndexError,
    UsageError,
    WriterClosedError,
)
from exchange.events.events import AbstractEvent, EventSerializer
from exchange.memory.local_buffer_pool import LocalBufferPool
from exchange.partition.bounded_blocking_subpartition import BoundedBlockingSubpartition
from exchange.partition.bounded_data import create_bounded_data
from exchange.partition.pipelined_subpartition import PipelinedSubpartition
from exchange.partition.result_partition_id import ResultPartitionID
from exchange.partition.result_partition_type import ResultPartitionType
from exchange.partition.subpartition_view import BufferAvailabilityListener, ResultSubpartitionView

if TYPE_CHECKING:
    from exchange.serialization.spanning_record_serializer import SpanningRecordSerializer

__all__ = ["ResultPartition", "ResultPartitionStats", "ResultSubpartition"]

ResultSubpartition = PipelinedSubpartition | BoundedBlockingSubpartition


class ResultPartitionStats(NamedTuple):
    num_subpartitions: int
    bytes_out: int
    buffers_out: int
    backlog: int
    out_pool_usage: float
    back_pressured_seconds: float
    finished: bool
    released: bool


class ResultPartition:
    """One producer's output."""

    def __init__(
        self,
        partition_id: ResultPartitionID,
        partition_type: ResultPartitionType,
        num_subpartitions: int,
        buffer_pool: LocalBufferPool,
        *,
        spill_dir: str | os.PathLike[str] | None = None,
        bounded_data_kind: str = "file",
    ) -> None:
        if not isinstance(num_subpartitions, int) or num_subpartitions <= 0:
            raise UsageError(f"num_subpartitions must be a positive int, got {num_subpartitions!r}")
        if buffer_pool.num_required < num_subpartitions:
            # Every subpartition may hold an open (unfinished, unreadable) builder: with
            # fewer guaranteed segments the writer can wait forever for a free one.
            raise UsageError(
                f"a {partition_type.value} partition of {num_subpartitions} subpartitions "
                f"needs a pool of at least {num_subpartitions} required segments"
            )
        self.partition_id = partition_id
        self.partition_type = partition_type
        self.buffer_pool = buffer_pool
        self.segment_size = buffer_pool.segment_size
        self.subpartitions: list[ResultSubpartition] = []
        if partition_type.is_blocking:
            directory = Path(spill_dir if spill_dir is not None else "/tmp/exchange-spill")
            directory.mkdir(parents=True, exist_ok=True)
            stem = f"{_safe(partition_id.dataset_id)}-{partition_id.partition_index}-" + (
                f"{partition_id.attempt_id}-{uuid.uuid4().hex[:8]}"
            )
            for i in range(num_subpartitions):
                data = create_bounded_data(
                    bounded_data_kind, directory / f"{stem}.{i}.bin", self.segment_size
                )
                self.subpartitions.append(BoundedBlockingSubpartition(i, self, data))
        else:
            for i in range(num_subpartitions):
                self.subpartitions.append(PipelinedSubpartition(i, self))
        self._unicast: list[BufferBuilder | None] = [None] * num_subpartitions
        self._broadcast: BufferBuilder | None = None
        self._finished = False
        self._released = False
        self._failure: BaseException | None = None
        self._num_consumed = 0
        self._bytes_out = 0
        self._buffers_out = 0
        self._back_pressured = 0.0
        self.on_release: Callable[[ResultPartition], None] | None = None
        #: Told when a reader leaves a pipelined subpartition before its end: a producer
        #: that is not writing into that subpartition right now would not notice otherwise.
        self.on_consumer_failure: Callable[[BaseException], None] | None = None

    @property
    def num_subpartitions(self) -> int:
        return len(self.subpartitions)

    @property
    def is_finished(self) -> bool:
        return self._finished

    @property
    def is_released(self) -> bool:
        return self._released

    @property
    def failure_cause(self) -> BaseException | None:
        return self._failure

    # -- writing records -----------------------------------------------------------------

    def check_writable(self, target: int | None = None) -> None:
        """Raise if nothing may be written (finished, released, or a reader failed)."""
        if self._released:
            cause = self._failure
            if isinstance(cause, PartitionReleasedError):
                raise cause
            raise PartitionReleasedError(
                "partition was released" + (f": {cause}" if cause else ""), self.partition_id
            )
        if self._finished:
            raise WriterClosedError(f"partition {self.partition_id} is finished")
        if target is not None:
            sub = self.subpartitions[target]
            if sub.is_released:
                cause = sub.failure_cause
                if isinstance(cause, PartitionReleasedError):
                    raise cause
                raise PartitionReleasedError(
                    f"subpartition {target} was released", self.partition_id
                )

    async def emit(self, target: int, serializer: SpanningRecordSerializer) -> None:
        """Copy everything ``serializer`` holds into ``target``'s buffers."""
        if self._broadcast is not None:
            self._finish_broadcast()
        builder = self._unicast[target]
        while serializer.has_serialized_data:
            if builder is None:
                builder = await self._new_unicast(target)
            serializer.copy_to_buffer_builder(builder)
            if builder.is_full:
                self._finish_unicast(target)
                builder = None

    async def broadcast(self, serializer: SpanningRecordSerializer) -> None:
        """Copy everything ``serializer`` holds once, into a buffer every subpartition reads."""
        if any(b is not None for b in self._unicast):
            self._finish_unicasts()
        builder = self._broadcast
        while serializer.has_serialized_data:
            if builder is None:
                builder = await self._new_broadcast()
            serializer.copy_to_buffer_builder(builder)
            if builder.is_full:
                self._finish_broadcast()
                builder = None

    def emit_nowait(self, target: int, serializer: SpanningRecordSerializer) -> bool:
        """Copy what fits without waiting for a buffer; True if everything was copied."""
        if self._broadcast is not None:
            self._finish_broadcast()
        builder = self._unicast[target]
        while serializer.has_serialized_data:
            if builder is None:
                builder = self._try_new_builder(target)
                if builder is None:
                    return False
            serializer.copy_to_buffer_builder(builder)
            if builder.is_full:
                self._finish_unicast(target)
                builder = None
        return True

    def broadcast_nowait(self, serializer: SpanningRecordSerializer) -> bool:
        """Broadcast what fits without waiting for a buffer; True if all was copied."""
        if any(b is not None for b in self._unicast):
            self._finish_unicasts()
        builder = self._broadcast
        while serializer.has_serialized_data:
            if builder is None:
                builder = self._try_new_builder(None)
                if builder is None:
                    return False
            serializer.copy_to_buffer_builder(builder)
            if builder.is_full:
                self._finish_broadcast()
                builder = None
        return True

    def _try_new_builder(self, target: int | None) -> BufferBuilder | None:
        """A new unicast (``target``) or broadcast (None) builder, if one is free now."""
        self.check_writable(target)
        subs = self.subpartitions if target is None else [self.subpartitions[target]]
        cap = min(s.buffer_size for s in subs)
        builder = self.buffer_pool.request_buffer_builder(cap if cap < self.segment_size else None)
        if builder is None:
            return None
        self._install(target, builder)
        return builder

    def _install(self, target: int | None, builder: BufferBuilder) -> None:
        if target is None:
            for sub in self.subpartitions:
                sub.add(builder.create_buffer_consumer_from_beginning())
            self._broadcast = builder
            return
        if not self.subpartitions[target].add(builder.create_buffer_consumer_from_beginning()):
            builder.close()
            self.check_writable(target)
        self._unicast[target] = builder

    async def _request_builder(self, capacity: int | None) -> BufferBuilder:
        try:
            builder = self.buffer_pool.request_buffer_builder(capacity)
            if builder is None:
                start = time.monotonic()
                try:
                    builder = await self.buffer_pool.request_buffer_builder_blocking(capacity)
                finally:
                    self._back_pressured += time.monotonic() - start
        except PoolDestroyedError:
            self.check_writable()
            raise
        if self._released or self._finished:
            builder.close()
            self.check_writable()
        return builder

    async def _new_unicast(self, target: int) -> BufferBuilder:
        self.check_writable(target)
        sub = self.subpartitions[target]
        cap = sub.buffer_size if sub.buffer_size < self.segment_size else None
        builder = await self._request_builder(cap)
        if self._unicast[target] is not None:  # pragma: no cover - single writer invariant
            builder.close()
            raise UsageError("two writers on one partition")
        self._install(target, builder)
        return builder

    async def _new_broadcast(self) -> BufferBuilder:
        self.check_writable()
        cap = min(s.buffer_size for s in self.subpartitions)
        builder = await self._request_builder(cap if cap < self.segment_size else None)
        self._install(None, builder)
        return builder

    def _finish_unicast(self, target: int) -> None:
        builder = self._unicast[target]
        if builder is not None:
            self._unicast[target] = None
            self._bytes_out += builder.finish()
            self._buffers_out += 1
            self.subpartitions[target].on_buffer_finished()
            builder.close()

    def _finish_unicasts(self) -> None:
        for i, builder in enumerate(self._unicast):
            if builder is not None:
                self._finish_unicast(i)

    def _finish_broadcast(self) -> None:
        builder = self._broadcast
        if builder is not None:
            self._broadcast = None
            self._bytes_out += builder.finish()
            self._buffers_out += 1
            for sub in self.subpartitions:
                sub.on_buffer_finished()
            builder.close()

    def add_buffer(self, target: int, buffer: Buffer) -> None:
        """Queue a complete buffer built elsewhere (a task pushing through the daemon).

        Takes over ``buffer``; it is released if the partition cannot take it.
        """
        try:
            if not 0 <= target < len(self.subpartitions):
                raise SubpartitionIndexError(
                    f"subpartition index {target} out of range [0, {len(self.subpartitions)})",
                    self.partition_id,
                )
            self.check_writable(target)
            if self._unicast[target] is not None or self._broadcast is not None:
                raise UsageError("add_buffer cannot be mixed with a RecordWriter")
        except BaseException:
            buffer.release()
            raise
        size = buffer.size
        if not self.subpartitions[target].add(BufferConsumer.of_buffer(buffer)):
            self.check_writable(target)
        self._bytes_out += size
        self._buffers_out += 1

    # -- events, flushing, finishing -----------------------------------------------------

    def broadcast_event(self, event: AbstractEvent) -> None:
        """Send an event to every subpartition, after everything written so far."""
        self.check_writable()
        self._finish_broadcast()
        self._finish_unicasts()
        consumer = EventSerializer.to_buffer_consumer(event)
        try:
            for sub in self.subpartitions:
                sub.add(consumer.copy())
        finally:
            consumer.close()

    def flush(self, target: int) -> None:
        if self.partition_type.is_blocking:
            self._finish_unicast(target)
            self._finish_broadcast()
        self.subpartitions[target].flush()

    def flush_all(self) -> None:
        """Make everything written so far readable."""
        if self._released:
            return
        if self.partition_type.is_blocking:
            self._finish_broadcast()
            self._finish_unicasts()
        for sub in self.subpartitions:
            sub.flush()

    def finish(self) -> None:
        """Close every builder and append EndOfPartition to every subpartition."""
        if self._finished:
            return
        self.check_writable()
        self._finish_broadcast()
        self._finish_unicasts()
        for sub in self.subpartitions:
            sub.finish()
        self._finished = True
        # Nothing more will be requested: in-flight segments return to the global pool.
        self.buffer_pool.destroy()

    def fail(self, cause: BaseException | None) -> None:
        """The producer failed: readers get a ProducerFailedError instead of a short read."""
        err = ProducerFailedError(
            "producer failed" + (f": {cause}" if cause is not None else ""), self.partition_id
        )
        if cause is not None:
            err.__cause__ = cause
        self.release(err)

    def release(self, cause: BaseException | None = None) -> None:
        """Release every subpartition and every buffer. Idempotent."""
        if self._released:
            return
        self._released = True
        self._failure = cause
        for i, builder in enumerate(self._unicast):
            if builder is not None:
                builder.close()
                self._unicast[i] = None
        if self._broadcast is not None:
            self._broadcast.close()
            self._broadcast = None
        for sub in self.subpartitions:
            sub.release(cause)
        self.buffer_pool.destroy()
        if self.on_release is not None:
            self.on_release(self)

    # -- reading -------------------------------------------------------------------------

    def create_subpartition_view(
        self, index: int, listener: BufferAvailabilityListener
    ) -> ResultSubpartitionView:
        if not isinstance(index, int) or not 0 <= index < len(self.subpartitions):
            raise SubpartitionIndexError(
                f"subpartition index {index!r} out of range [0, {len(self.subpartitions)})",
                self.partition_id,
            )
        if self._released:
            raise PartitionReleasedError("partition was released", self.partition_id)
        return self.subpartitions[index].create_read_view(listener)

    def _on_consumer_failure(self, cause: BaseException) -> None:
        if self.on_consumer_failure is not None:
            self.on_consumer_failure(cause)

    def _on_subpartition_consumed(self, index: int) -> None:
        """Pipelined partitions are released once every subpartition was consumed."""
        self._num_consumed += 1
        if self.partition_type.is_pipelined and self._num_consumed >= len(self.subpartitions):
            self.release(self.subpartitions[index].failure_cause)

    # -- statistics ----------------------------------------------------------------------

    def stats(self) -> ResultPartitionStats:
        pool = self.buffer_pool
        usage = 0.0 if pool.is_destroyed else pool.stats().usage
        backlog = sum(
            s.buffers_in_backlog for s in self.subpartitions if isinstance(s, PipelinedSubpartition)
        )
        return ResultPartitionStats(
            len(self.subpartitions),
            self._bytes_out,
            self._buffers_out,
            backlog,
            usage,
            self._back_pressured,
            self._finished,
            self._released,
        )

    def __repr__(self) -> str:
        return (
            f"ResultPartition({self.partition_id}, {self.partition_type.value}, "
            f"{len(self.subpartitions)} subpartitions, finished={self._finished}, "
            f"released={self._released})"
        )


def _safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name)[:64]
