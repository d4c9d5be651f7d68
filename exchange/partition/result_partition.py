"""ResultPartition: the output of one producer, split into subpartitions.

Owns its LocalBufferPool (``num_required = number of subpartitions``, as in Flink) and the
BufferBuilders being filled: one *unicast* builder per subpartition, or one *broadcast*
builder shared by all subpartitions (a record broadcast is copied into memory once; each
subpartition holds its own consumer of that one buffer). Switching between unicast and
broadcast, and emitting an event, first finishes the open builders so that order holds.

Writing is asynchronous only where it must be: when the pool has no free segment the
writer awaits one, which is how a slow reader slows the producer (backpressure).

Producers that build buffers elsewhere hand them over with ``add_buffer(target, buffer)``;
``target == ALL_SUBPARTITIONS`` queues one buffer for every subpartition (one segment,
reference counted: it returns to the pool once every subpartition's reader released it).

Lifecycle (``states.py``): WRITING -> FINISHED -> RELEASED, or FAILED / RELEASED early.
The pool lives until the partition is released: a pipelined partition's queued buffers
hold its segments until they are read (a blocking partition, whose data is spilled, gives
its pool back at ``finish``). A pipelined partition is released once every subpartition
is done: consumed (its reader polled EndOfPartition) or failed (its reader left early).
Whoever must hear of the end registers a listener (``add_release_listener``,
``add_consumer_failure_listener``); listeners are called in order, each once.
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Final, NamedTuple, TypeVar

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
from exchange.partition.states import PARTITION_TRANSITIONS, ResultPartitionState, transition
from exchange.partition.subpartition_view import BufferAvailabilityListener, ResultSubpartitionView

if TYPE_CHECKING:
    from exchange.serialization.spanning_record_serializer import SpanningRecordSerializer

__all__ = ["ALL_SUBPARTITIONS", "ResultPartition", "ResultPartitionStats", "ResultSubpartition"]

#: ``add_buffer`` target meaning "every subpartition reads this one buffer" (the value the
#: local-endpoint protocol and the writer use for the same meaning).
ALL_SUBPARTITIONS: Final = 0xFFFFFFFF

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


_T = TypeVar("_T")

ReleaseListener = Callable[["ResultPartition"], None]
ConsumerFailureListener = Callable[[BaseException], None]

_WRITING: Final = ResultPartitionState.WRITING
_FINISHED: Final = ResultPartitionState.FINISHED
_FAILED: Final = ResultPartitionState.FAILED
_RELEASED: Final = ResultPartitionState.RELEASED


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
        self._state = _WRITING
        self._finished_at_release = False  # history for statistics, not a state
        self._failure: BaseException | None = None
        self._done: set[int] = set()  # pipelined subpartitions consumed or failed
        self._bytes_out = 0
        self._buffers_out = 0
        self._back_pressured = 0.0
        self._release_listeners: list[ReleaseListener] = []
        self._consumer_failure_listeners: list[ConsumerFailureListener] = []

    # -- lifecycle -----------------------------------------------------------------------

    @property
    def state(self) -> ResultPartitionState:
        return self._state

    def _transition(self, to: ResultPartitionState) -> None:
        self._state = transition(PARTITION_TRANSITIONS, self._state, to, self)

    @property
    def num_subpartitions(self) -> int:
        return len(self.subpartitions)

    @property
    def is_finished(self) -> bool:
        """The producer finished it (it may have been released since, e.g. consumed)."""
        return self._finished_at_release if self._state.is_released else self._state is _FINISHED

    @property
    def is_released(self) -> bool:
        return self._state.is_released

    @property
    def failure_cause(self) -> BaseException | None:
        return self._failure

    def add_release_listener(self, listener: ReleaseListener) -> None:
        """Call ``listener(partition)`` once the partition is released or failed (at once
        if it is already)."""
        if self._state.is_released:
            listener(self)
            return
        self._release_listeners.append(listener)

    def remove_release_listener(self, listener: ReleaseListener) -> None:
        """Forget ``listener`` (no error if it is not registered)."""
        if listener in self._release_listeners:
            self._release_listeners.remove(listener)

    def add_consumer_failure_listener(self, listener: ConsumerFailureListener) -> None:
        """Call ``listener(cause)`` whenever a reader leaves a pipelined subpartition before
        its end: a producer not writing into that subpartition would not notice otherwise."""
        self._consumer_failure_listeners.append(listener)

    def remove_consumer_failure_listener(self, listener: ConsumerFailureListener) -> None:
        if listener in self._consumer_failure_listeners:
            self._consumer_failure_listeners.remove(listener)

    @property
    def on_release(self) -> ReleaseListener:
        """Deprecated slot, kept while callers move to ``add_release_listener``.

        Assigning adds a listener and never replaces one. Reading gives a no-op, so a
        caller that wraps the old value and calls it calls no listener twice.
        """
        return _ignore

    @on_release.setter
    def on_release(self, listener: ReleaseListener | None) -> None:
        if listener is not None:
            self.add_release_listener(listener)

    @property
    def on_consumer_failure(self) -> ConsumerFailureListener:
        """Deprecated: assigning adds a consumer-failure listener (see ``on_release``)."""
        return _ignore

    @on_consumer_failure.setter
    def on_consumer_failure(self, listener: ConsumerFailureListener | None) -> None:
        if listener is not None:
            self.add_consumer_failure_listener(listener)

    # -- writing records -----------------------------------------------------------------

    def record_back_pressure(self, seconds: float) -> None:
        """The producer waited ``seconds`` for a segment of this partition's pool (Flink's
        backPressuredTime); whoever drives the writer measures it."""
        if seconds > 0:
            self._back_pressured += seconds

    def check_writable(self, target: int | None = None) -> None:
        """Raise if nothing may be written (finished, released, or a reader failed)."""
        state = self._state
        if state.is_released:
            cause = self._failure
            if isinstance(cause, PartitionReleasedError):
                raise cause
            raise PartitionReleasedError(
                "partition was released" + (f": {cause}" if cause else ""), self.partition_id
            )
        if state is _FINISHED:
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
        if self._state is not _WRITING:
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
            # counted once (the old writer's figure); add_buffer counts per subpartition
            self._bytes_out += builder.finish()
            self._buffers_out += 1
            for sub in self.subpartitions:
                sub.on_buffer_finished()
            builder.close()

    def add_buffer(self, target: int, buffer: Buffer) -> None:
        """Queue a complete buffer built elsewhere for ``target`` or ``ALL_SUBPARTITIONS``.

        Takes over ``buffer`` (one reference); it is released if the partition cannot take
        it. For ``ALL_SUBPARTITIONS`` every subpartition holds a reference of its own on the
        one segment.
        """
        subs = self.subpartitions
        n = len(subs)
        try:
            if target == ALL_SUBPARTITIONS:
                self.check_writable()
                for i in range(n):
                    self.check_writable(i)
            elif not 0 <= target < n:
                raise SubpartitionIndexError(
                    f"subpartition index {target} out of range [0, {n})", self.partition_id
                )
            else:
                self.check_writable(target)
            if self._broadcast is not None or any(b is not None for b in self._unicast):
                raise UsageError("add_buffer cannot be mixed with a RecordWriter")
        except BaseException:
            buffer.release()
            raise
        size = buffer.size
        if target != ALL_SUBPARTITIONS:
            if not subs[target].add(BufferConsumer.of_buffer(buffer)):
                self.check_writable(target)  # pragma: no cover - checked above
            self._bytes_out += size
            self._buffers_out += 1
            return
        for _ in range(n - 1):
            buffer.retain()
        for sub in subs:  # none refuses: every one was checked writable above
            sub.add(BufferConsumer.of_buffer(buffer))
        self._bytes_out += size * n
        self._buffers_out += n

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
        if self._state.is_released:
            return
        if self.partition_type.is_blocking:
            self._finish_broadcast()
            self._finish_unicasts()
        for sub in self.subpartitions:
            sub.flush()

    def finish(self) -> None:
        """Close every builder and append EndOfPartition to every subpartition.

        Idempotent; on a released partition it raises what every write raises there.
        """
        if self._state is _FINISHED:
            return
        self.check_writable()
        self._finish_broadcast()
        self._finish_unicasts()
        for sub in self.subpartitions:
            sub.finish()
        self._transition(_FINISHED)
        if self.partition_type.is_blocking:
            # Everything is spilled and nothing more will be requested: give the pool's
            # segments and its claim on the global pool back now. A pipelined partition
            # keeps its pool until released: its unread buffers still hold segments.
            self.buffer_pool.destroy()

    def fail(self, cause: BaseException | None) -> None:
        """The producer failed: readers get a ProducerFailedError instead of a short read.

        Also after ``finish``: unread pipelined data is dropped (as Flink's
        ``ResultPartition.fail``). A no-op once released: the first end wins.
        """
        if self._state.is_released:
            return
        if isinstance(cause, ProducerFailedError):
            err = cause
        else:
            err = ProducerFailedError(
                "producer failed" + (f": {cause}" if cause is not None else ""),
                self.partition_id,
            )
            if cause is not None:
                err.__cause__ = cause
        self.release(err)

    def release(self, cause: BaseException | None = None) -> None:
        """Release every subpartition and every buffer; then tell the release listeners.

        With a ProducerFailedError as ``cause`` the partition ends FAILED, else RELEASED.
        Idempotent.
        """
        if self._state.is_released:
            return
        self._finished_at_release = self._state is _FINISHED
        self._transition(_FAILED if isinstance(cause, ProducerFailedError) else _RELEASED)
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
        listeners, self._release_listeners = self._release_listeners, []
        _call_all(listeners, self)

    # -- reading -------------------------------------------------------------------------

    def create_subpartition_view(
        self, index: int, listener: BufferAvailabilityListener
    ) -> ResultSubpartitionView:
        if not isinstance(index, int) or not 0 <= index < len(self.subpartitions):
            raise SubpartitionIndexError(
                f"subpartition index {index!r} out of range [0, {len(self.subpartitions)})",
                self.partition_id,
            )
        if self._state is _FAILED:
            cause = self._failure
            raise ProducerFailedError(
                f"partition failed: {cause}" if cause else "producer failed", self.partition_id
            )
        if self._state is _RELEASED:
            raise PartitionReleasedError("partition was released", self.partition_id)
        return self.subpartitions[index].create_read_view(listener)

    def _on_consumer_failure(self, cause: BaseException) -> None:
        _call_all(list(self._consumer_failure_listeners), cause)

    def _on_subpartition_done(self, index: int) -> None:
        """A pipelined subpartition's reader is gone, after its end or early (a failure).

        Once every subpartition is done, no reader will come: the partition is released
        (with the first consumer failure as its cause, if any).
        """
        if self._state.is_released or index in self._done:
            return
        self._done.add(index)
        if len(self._done) == len(self.subpartitions):
            cause = next(
                (s.failure_cause for s in self.subpartitions if s.failure_cause is not None),
                None,
            )
            self.release(cause)

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
            self.is_finished,
            self.is_released,
        )

    def __repr__(self) -> str:
        return (
            f"ResultPartition({self.partition_id}, {self.partition_type.value}, "
            f"{len(self.subpartitions)} subpartitions, {self._state.value})"
        )


def _ignore(_: object) -> None:
    """What the deprecated listener slots read as."""


def _call_all(listeners: list[Callable[[_T], None]], arg: _T) -> None:
    """Call every listener, even when one raises; then re-raise the first error."""
    error: BaseException | None = None
    for listener in listeners:
        try:
            listener(arg)
        except BaseException as e:  # re-raised below, after the others ran
            if error is None:
                error = e
    if error is not None:
        raise error


def _safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name)[:64]
