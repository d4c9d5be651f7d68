"""PipelinedSubpartition: a bounded queue of BufferConsumers streamed to one reader.

Follows Flink's rules:

* only the last buffer in the queue may be unfinished, so every buffer but the last is
  readable, and the last one becomes readable on ``flush``;
* the reader is notified when the first finished buffer appears, on flush, and on an
  event, and otherwise learns from ``BufferAndBacklog.is_data_available`` whether to come
  back; so a reader is never notified for every buffer;
* the backlog is the number of finished data buffers queued, which the network announces
  to the receiver so it can ask for floating buffers;
* after an aligned checkpoint barrier is polled, the subpartition is *blocked* until the
  reader calls ``resume_consumption`` (exactly-once alignment on the sender side).
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING

from exchange.buffers.buffer import DataType
from exchange.buffers.buffer_builder import BufferConsumer
from exchange.errors import (
    ConsumerAlreadyAttachedError,
    IllegalStateError,
    PartitionReleasedError,
    UsageError,
)
from exchange.events.events import EndOfPartitionEvent, EventSerializer
from exchange.partition.subpartition_view import BufferAndBacklog, BufferAvailabilityListener

if TYPE_CHECKING:
    from exchange.partition.result_partition import ResultPartition

__all__ = ["PipelinedSubpartition", "PipelinedSubpartitionView"]


class PipelinedSubpartition:
    """One pipelined subpartition of a ResultPartition."""

    def __init__(self, index: int, parent: ResultPartition) -> None:
        self.index = index
        self._parent = parent
        self._buffers: deque[BufferConsumer] = deque()
        self._backlog = 0
        self._finished = False
        self._released = False
        self._failure: BaseException | None = None
        self._flush_requested = False
        self._blocked = False
        self._view: PipelinedSubpartitionView | None = None
        self._sequence_number = 0
        self._consumed = False  # the reader polled EndOfPartition
        self.buffer_size = parent.segment_size
        self.total_bytes = 0
        self.total_buffers = 0

    # -- writer side ---------------------------------------------------------------------

    @property
    def is_finished(self) -> bool:
        return self._finished

    @property
    def is_released(self) -> bool:
        return self._released

    @property
    def failure_cause(self) -> BaseException | None:
        return self._failure

    def add(self, consumer: BufferConsumer) -> bool:
        """Queue a buffer; False (and the consumer closed) when finished or released."""
        if self._finished or self._released:
            consumer.close()
            return False
        self._buffers.append(consumer)
        if consumer.is_buffer:
            self._backlog += 1
        if self._should_notify():
            self._notify()
        return True

    def on_buffer_finished(self) -> None:
        """The writer finished the last buffer: it is readable now."""
        if self._released or not self._buffers or self._flush_requested:
            return
        if len(self._buffers) == 1 and not self._blocked and self._view is not None:
            self._notify()

    def flush(self) -> None:
        """Make a partially filled last buffer readable."""
        if self._released or not self._buffers or self._flush_requested:
            return
        last_has_data = len(self._buffers) == 1 and self._buffers[-1].is_data_available
        self._flush_requested = len(self._buffers) > 1 or last_has_data
        if last_has_data and not self._blocked:
            self._notify()

    def finish(self) -> None:
        """Append EndOfPartition; nothing may be added afterwards."""
        if self._finished:
            return
        if self._released:
            raise PartitionReleasedError(
                f"subpartition {self.index} was released", self._parent.partition_id
            )
        self._buffers.append(EventSerializer.to_buffer_consumer(EndOfPartitionEvent.INSTANCE))
        self._finished = True
        self._flush_requested = True
        if not self._blocked:
            self._notify()

    def release(self, cause: BaseException | None = None) -> None:
        """Drop every queued buffer; a reader learns ``cause`` (or a plain release)."""
        if self._released:
            return
        self._released = True
        if self._failure is None:
            self._failure = cause
        while self._buffers:
            self._buffers.popleft().close()
        self._backlog = 0
        if self._view is not None:
            self._view._listener.notify_data_available()

    # -- reader side ---------------------------------------------------------------------

    def create_read_view(self, listener: BufferAvailabilityListener) -> PipelinedSubpartitionView:
        if self._released:
            raise PartitionReleasedError(
                f"subpartition {self.index} was released", self._parent.partition_id
            )
        if self._view is not None:
            raise ConsumerAlreadyAttachedError(
                f"subpartition {self.index} is already consumed; a pipelined subpartition "
                "can only be consumed once",
                self._parent.partition_id,
            )
        view = PipelinedSubpartitionView(self, listener)
        self._view = view
        if self._is_data_available():
            listener.notify_data_available()
        return view

    def _finished_buffer_count(self) -> int:
        n = len(self._buffers)
        if n == 1 and self._buffers[-1].is_finished:
            return 1
        return max(0, n - 1)

    def _should_notify(self) -> bool:
        return (
            self._view is not None
            and not self._flush_requested
            and not self._blocked
            and self._finished_buffer_count() == 1
        )

    def _notify(self) -> None:
        view = self._view
        if view is not None:
            view._listener.notify_data_available()

    def _is_data_available(self) -> bool:
        return not self._blocked and (self._flush_requested or self._finished_buffer_count() > 0)

    def _next_data_type(self) -> DataType | None:
        if self._buffers:
            return self._buffers[0].data_type
        return None

    def _backlog_now(self) -> int:
        if self._blocked or not self._buffers:
            return 0
        if self._flush_requested or self._finished or not self._buffers[-1].is_buffer:
            return self._backlog
        return max(self._backlog - 1, 0)

    def poll_buffer(self) -> BufferAndBacklog | None:
        """The next readable buffer, or None (Flink's ``pollBuffer``)."""
        if self._blocked or self._released:
            return None
        buffers = self._buffers
        if not buffers:
            self._flush_requested = False
        buffer = None
        while buffers:
            consumer = buffers[0]
            buffer = consumer.build()
            if len(buffers) == 1:
                self._flush_requested = False
            if consumer.is_finished:
                buffers.popleft().close()
                if consumer.is_buffer:
                    self._backlog -= 1
            if buffer.size > 0:
                break
            buffer.release()
            buffer = None
            if not consumer.is_finished:
                break
        if buffer is None:
            return None
        data_type = buffer.data_type
        if data_type.is_blocking_upstream:
            self._blocked = True
        elif data_type is DataType.EVENT_BUFFER and not buffers and self._finished:
            self._consumed = True
        self.total_bytes += buffer.size
        self.total_buffers += 1
        seq = self._sequence_number
        self._sequence_number = seq + 1
        available = self._is_data_available()
        return BufferAndBacklog(
            buffer,
            available,
            self._backlog_now(),
            self._next_data_type() if available else None,
            seq,
        )

    def availability_and_backlog(self, num_credits: int) -> tuple[bool, int]:
        if num_credits > 0:
            available = self._is_data_available()
        else:
            nxt = self._next_data_type()
            available = (
                not self._blocked
                and nxt is not None
                and nxt.is_event
                and (self._flush_requested or self._finished_buffer_count() > 0)
            )
        return available, self._backlog_now()

    def resume_consumption(self) -> None:
        if not self._blocked:
            raise IllegalStateError(f"subpartition {self.index} is not blocked")
        self._blocked = False
        if self._is_data_available():
            self._notify()

    def set_buffer_size(self, size: int) -> None:
        if size <= 0:
            raise UsageError(f"buffer size must be positive, got {size}")
        self.buffer_size = min(size, self._parent.segment_size)

    def _on_view_released(self) -> None:
        self._view = None
        if not self._consumed and not self._released:
            # The reader left before the end: a consumer failure the producer must see.
            cause = PartitionReleasedError(
                f"subpartition {self.index} was released by its consumer before the end",
                self._parent.partition_id,
            )
            self.release(cause)
            self._parent._on_consumer_failure(cause)
        self._parent._on_subpartition_consumed(self.index)

    @property
    def buffers_in_backlog(self) -> int:
        return self._backlog_now()

    @property
    def num_queued_buffers(self) -> int:
        return len(self._buffers)

    def __repr__(self) -> str:
        return (
            f"PipelinedSubpartition(#{self.index}, queued={len(self._buffers)}, "
            f"backlog={self._backlog}, finished={self._finished}, released={self._released})"
        )


class PipelinedSubpartitionView:
    """The single reader's view of a PipelinedSubpartition."""

    __slots__ = ("_listener", "_released", "_subpartition")

    def __init__(self, subpartition: PipelinedSubpartition, listener: BufferAvailabilityListener):
        self._subpartition = subpartition
        self._listener = listener
        self._released = False

    def get_next_buffer(self) -> BufferAndBacklog | None:
        if self._released:
            return None
        return self._subpartition.poll_buffer()

    def get_availability_and_backlog(self, num_credits: int) -> tuple[bool, int]:
        if self._released:
            return False, 0
        return self._subpartition.availability_and_backlog(num_credits)

    def resume_consumption(self) -> None:
        self._subpartition.resume_consumption()

    def notify_new_buffer_size(self, size: int) -> None:
        self._subpartition.set_buffer_size(size)

    def release_all_resources(self) -> None:
        if not self._released:
            self._released = True
            self._subpartition._on_view_released()

    @property
    def is_released(self) -> bool:
        return self._released or self._subpartition.is_released

    @property
    def failure_cause(self) -> BaseException | None:
        return self._subpartition.failure_cause

    def __repr__(self) -> str:
        return f"PipelinedSubpartitionView({self._subpartition!r})"
