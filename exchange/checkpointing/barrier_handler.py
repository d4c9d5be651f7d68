"""CheckpointBarrierHandler: the seam between an input gate and the task.

A handler takes every buffer or event the gate returns (``process``) and hands back what
the task sees next; input it parked earlier comes out of ``poll_next``. The ordering
contract, the same for every handler:

* callbacks (``trigger_checkpoint``, ``abort_checkpoint``) run inside ``process`` or
  ``poll_next``, in the caller's thread, before the call returns;
* everything returned by calls *before* a ``trigger_checkpoint`` call is pre-barrier,
  everything returned by calls after it is post-barrier (a call that triggers returns the
  first post-barrier item, if any, after the callback);
* barriers and cancellation markers are consumed; EndOfPartition and other events pass;
* ``poll_next`` must return None before the next ``process`` (replay comes before newer
  input), else ``process`` raises IllegalStateError.

Barriers whose options say ``exactly_once`` travel as ``ALIGNED_CHECKPOINT_BARRIER``, which
blocks the channel's subpartition upstream until ResumeConsumption: every handler calls
``resume(channel)`` exactly once for each such barrier it receives, whatever becomes of its
checkpoint.
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from enum import Enum
from typing import NamedTuple, Protocol

from exchange.consumer.single_input_gate import BufferOrEvent
from exchange.errors import IllegalStateError, ProtocolError, UsageError
from exchange.events.events import (
    AbstractEvent,
    CheckpointBarrier,
    CheckpointOptions,
    EventSerializer,
)

__all__ = [
    "BarrierHandlerStats",
    "ChannelBlockedError",
    "CheckpointBarrierHandler",
    "CheckpointFailureReason",
    "CheckpointListener",
    "CheckpointingMode",
    "Clock",
    "ResumeConsumption",
    "is_aligned_barrier",
    "payload_size",
]

#: Monotonic seconds (``time.monotonic`` in production, a fake in tests).
Clock = Callable[[], float]

#: ``resume(channel_index)``: send ResumeConsumption for that channel's subpartition.
ResumeConsumption = Callable[[int], None]


class CheckpointingMode(Enum):
    """Exactly once aligns a task's inputs at each barrier; at least once only tracks them."""

    EXACTLY_ONCE = "exactly_once"
    AT_LEAST_ONCE = "at_least_once"
    #: exactly once without waiting for alignment (FLIP-76): in-flight input is persisted
    UNALIGNED = "unaligned"


class CheckpointFailureReason(Enum):
    """Why a checkpoint was aborted at this input (Flink's ``CheckpointFailureReason``)."""

    SUBSUMED = "subsumed by a newer checkpoint"
    CANCELLED = "cancelled by a CancelCheckpointMarker"
    ALIGNMENT_LIMIT = "alignment exceeded the maximum aligned bytes"
    END_OF_INPUT = "an input ended during alignment"
    DECLINED = "declined by the task"
    TIMEOUT = "alignment timed out"


class CheckpointListener(Protocol):
    """The task side: told when a checkpoint is to be taken or was aborted."""

    def trigger_checkpoint(
        self, checkpoint_id: int, timestamp: int, options: CheckpointOptions
    ) -> None: ...

    def abort_checkpoint(self, checkpoint_id: int, reason: CheckpointFailureReason) -> None: ...


class BarrierHandlerStats(NamedTuple):
    """Plain statistics of a handler, ready to export as metrics."""

    num_triggered: int
    num_aborted: int
    #: the checkpoint being aligned now, or None
    aligning_checkpoint_id: int | None
    #: seconds from the first barrier to the trigger, of the last triggered checkpoint
    last_alignment_duration: float
    #: bytes parked (parking) or processed (blocking, tracker) during that alignment
    last_aligned_bytes: int
    #: seconds the current alignment has lasted so far (0.0 when not aligning)
    current_alignment_duration: float
    #: bytes held by the handler now: parked, or waiting for replay
    buffered_bytes: int
    #: bytes parked since the handler was created
    total_parked_bytes: int
    num_resumed: int


class ChannelBlockedError(ProtocolError):
    """Input arrived on a channel that is blocked upstream (no ResumeConsumption yet)."""

    def __init__(self, channel_index: int, checkpoint_id: int) -> None:
        super().__init__(
            f"channel {channel_index} sent input after the aligned barrier of checkpoint "
            f"{checkpoint_id} before it was resumed"
        )
        self.channel_index = channel_index
        self.checkpoint_id = checkpoint_id


def payload_size(boe: BufferOrEvent) -> int:
    """Bytes a buffer or event takes on the wire (its serialized size for events)."""
    if boe.buffer is not None:
        return boe.buffer.size
    assert boe.event is not None
    return len(EventSerializer.to_bytes(boe.event))


def _no_resume(channel_index: int) -> None:
    raise UsageError(
        f"an aligned barrier arrived on channel {channel_index} but the handler was built "
        "without a resume callback; pass resume= to resume the blocked subpartition"
    )


class CheckpointBarrierHandler(abc.ABC):
    """Decides, buffer by buffer, what the task sees and when checkpoints trigger."""

    def __init__(
        self,
        num_channels: int,
        listener: CheckpointListener,
        clock: Clock,
        resume: ResumeConsumption | None = None,
    ) -> None:
        if num_channels < 1:
            raise UsageError(f"a barrier handler needs at least one channel, got {num_channels}")
        self.num_channels = num_channels
        self.listener = listener
        self.clock = clock
        self._resume = resume if resume is not None else _no_resume
        self._closed = False
        self.num_triggered = 0
        self.num_aborted = 0
        self.num_resumed = 0
        self.last_alignment_duration = 0.0
        self.last_aligned_bytes = 0

    # -- the contract --------------------------------------------------------------------

    @abc.abstractmethod
    def process(self, boe: BufferOrEvent) -> BufferOrEvent | None:
        """Take one item from the gate; return what the task sees now (None: nothing)."""

    def poll_next(self) -> BufferOrEvent | None:
        """The next replayed item; None when nothing is parked for replay."""
        self._check_open()
        return None

    def is_empty(self) -> bool:
        """True if nothing is waiting for replay (Flink's ``isEmpty``)."""
        return True

    @abc.abstractmethod
    def stats(self) -> BarrierHandlerStats: ...

    def close(self) -> None:
        """Release everything the handler holds. Idempotent."""
        self._closed = True

    @property
    def is_closed(self) -> bool:
        return self._closed

    # -- helpers for subclasses ----------------------------------------------------------

    def _check_input(self, boe: BufferOrEvent) -> None:
        """Refuse bad input; the handler owned its buffer, so it releases it first."""
        try:
            self._check_open()
            if not 0 <= boe.channel_index < self.num_channels:
                raise UsageError(
                    f"channel index {boe.channel_index} outside [0, {self.num_channels})"
                )
            if (boe.buffer is None) == (boe.event is None):
                raise UsageError("a BufferOrEvent holds exactly one of buffer and event")
        except UsageError:
            if boe.buffer is not None and not boe.buffer.is_recycled:
                boe.buffer.release()
            raise

    def _check_open(self) -> None:
        if self._closed:
            raise IllegalStateError("the barrier handler is closed")

    def _trigger(self, checkpoint_id: int, timestamp: int, options: CheckpointOptions) -> None:
        self.num_triggered += 1
        self.listener.trigger_checkpoint(checkpoint_id, timestamp, options)

    def _abort(self, checkpoint_id: int, reason: CheckpointFailureReason) -> None:
        self.num_aborted += 1
        self.listener.abort_checkpoint(checkpoint_id, reason)

    def _resume_channel(self, channel_index: int) -> None:
        self.num_resumed += 1
        self._resume(channel_index)


def is_aligned_barrier(event: AbstractEvent | None) -> bool:
    """True for a barrier that blocks its subpartition upstream until resumed (an
    exactly-once barrier, unless it is a priority barrier: ``options.unaligned``)."""
    return (
        isinstance(event, CheckpointBarrier)
        and event.options.exactly_once
        and not event.options.unaligned
    )
