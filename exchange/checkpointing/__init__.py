"""Checkpoint barrier handlers: what the task sees of an input gate around checkpoints.

Sans I/O: the handler is fed what the gate returns and calls back into the task
(``trigger_checkpoint`` / ``abort_checkpoint``) and upstream (``resume(channel)``, which
sends ResumeConsumption). Time comes from an injected clock. Usage, in the task's thread::

    handler = create_barrier_handler(
        CheckpointingMode.EXACTLY_ONCE, gate.num_channels, task, time.monotonic,
        resume=gate.resume_consumption,
        blocker=None,                 # or CachedBufferBlocker() / BufferSpiller(dir, page)
        max_aligned_bytes=limit,      # checkpoint_alignment_limit; None/0 = unlimited
    )
    while True:
        boe = handler.poll_next()     # parked input first (parking strategy only)
        if boe is None:
            raw = gate.poll_next()    # or await gate.get_next()
            if raw is None:
                break
            boe = handler.process(raw)
            if boe is None:
                continue              # a barrier or marker was consumed, or input parked
        deliver(boe)                  # deserialize records, recycle the buffer
    handler.close()

Everything delivered before ``task.trigger_checkpoint(n, ...)`` runs is before barrier
``n``, everything after it is after (see ``barrier_handler`` for the full contract).
"""

from __future__ import annotations

import os
from typing import Final, cast

from exchange.checkpointing.aligner import (
    AlignedBarrierHandler,
    AlignmentMode,
    AlignmentState,
    AlignmentStrategy,
)
from exchange.checkpointing.barrier_handler import (
    BarrierHandlerStats,
    ChannelBlockedError,
    CheckpointBarrierHandler,
    CheckpointFailureReason,
    CheckpointingMode,
    CheckpointListener,
    Clock,
    ResumeConsumption,
)
from exchange.checkpointing.barrier_tracker import (
    MAX_CHECKPOINTS_TO_TRACK,
    CheckpointBarrierTracker,
)
from exchange.checkpointing.buffer_blocker import (
    BufferBlocker,
    BufferOrEventSequence,
    BufferSpiller,
    CachedBufferBlocker,
)
from exchange.checkpointing.coordinator import (
    AbortReason,
    CheckpointConfig,
    CheckpointCoordinator,
    CheckpointState,
    CheckpointStatus,
    Command,
    CompletedCheckpoint,
    CoordinatorState,
    CoordinatorStats,
    DiscardCheckpoint,
    FailJob,
    FinalizeCheckpoint,
    NotifyAborted,
    NotifyComplete,
    PendingCheckpoint,
    TriggerCheckpoint,
)
from exchange.checkpointing.unaligned import (
    UnalignedBarrierHandler,
    UnalignedCheckpointListener,
    UnalignedState,
)
from exchange.errors import UsageError

__all__ = [
    "MAX_CHECKPOINTS_TO_TRACK",
    "AbortReason",
    "AlignedBarrierHandler",
    "AlignmentMode",
    "AlignmentState",
    "AlignmentStrategy",
    "BarrierHandlerStats",
    "BufferBlocker",
    "BufferOrEventSequence",
    "BufferSpiller",
    "CachedBufferBlocker",
    "ChannelBlockedError",
    "CheckpointBarrierHandler",
    "CheckpointBarrierTracker",
    "CheckpointConfig",
    "CheckpointCoordinator",
    "CheckpointFailureReason",
    "CheckpointListener",
    "CheckpointState",
    "CheckpointStatus",
    "CheckpointingMode",
    "Clock",
    "Command",
    "CompletedCheckpoint",
    "CoordinatorState",
    "CoordinatorStats",
    "DiscardCheckpoint",
    "FailJob",
    "FinalizeCheckpoint",
    "NotifyAborted",
    "NotifyComplete",
    "PendingCheckpoint",
    "ResumeConsumption",
    "TriggerCheckpoint",
    "UnalignedBarrierHandler",
    "UnalignedCheckpointListener",
    "UnalignedState",
    "create_barrier_handler",
]


_CHANNEL_STATE_METHODS: Final = ("persist_input", "input_state_complete")


def create_barrier_handler(
    mode: CheckpointingMode,
    num_channels: int,
    listener: CheckpointListener,
    clock: Clock,
    resume: ResumeConsumption | None = None,
    *,
    blocker: BufferBlocker | None = None,
    spill_dir: str | os.PathLike[str] | None = None,
    page_size: int | None = None,
    max_aligned_bytes: int | None = None,
    aligned_checkpoint_timeout: float | None = None,
    alignment: AlignmentMode | None = None,
) -> CheckpointBarrierHandler:
    """The handler for ``mode`` (Flink's ``InputProcessorUtil.createCheckpointBarrierHandler``).

    Exactly once blocks upstream unless a ``blocker`` is given, or ``spill_dir`` and
    ``page_size`` (a BufferSpiller), which select parking. ``alignment`` (a job's
    setting) decides instead when given: ``buffer`` parks in memory, ``spill`` in a
    private directory under ``spill_dir`` (None: the temporary directory) removed when
    the handler closes. Unaligned needs a listener that takes channel state
    (``UnalignedCheckpointListener``) and never parks (``alignment`` None or
    ``block_upstream``); ``aligned_checkpoint_timeout`` (seconds, unaligned only) starts
    each checkpoint aligned, blocking upstream.
    """
    if aligned_checkpoint_timeout is not None and mode is not CheckpointingMode.UNALIGNED:
        raise UsageError(f"aligned_checkpoint_timeout applies to unaligned mode, not {mode.value}")
    if mode is CheckpointingMode.AT_LEAST_ONCE:
        return CheckpointBarrierTracker(num_channels, listener, clock, resume)
    if mode is CheckpointingMode.UNALIGNED:
        if blocker is not None or alignment not in (None, AlignmentMode.BLOCK_UPSTREAM):
            raise UsageError("unaligned checkpoints never park input: no blocker or alignment")
        if not all(callable(getattr(listener, m, None)) for m in _CHANNEL_STATE_METHODS):
            raise UsageError(
                "unaligned checkpoints need a listener with persist_input and "
                "input_state_complete (UnalignedCheckpointListener)"
            )
        return UnalignedBarrierHandler(
            num_channels,
            cast(UnalignedCheckpointListener, listener),
            clock,
            resume,
            aligned_checkpoint_timeout=aligned_checkpoint_timeout,
        )
    if alignment is AlignmentMode.BUFFER:
        blocker = CachedBufferBlocker()
    elif alignment is AlignmentMode.SPILL:
        if page_size is None:
            raise UsageError("spilling alignment needs the page size")
        blocker = BufferSpiller.private(spill_dir, page_size)
    elif alignment is AlignmentMode.BLOCK_UPSTREAM:
        blocker = None
        spill_dir = None
    if blocker is None and spill_dir is not None:
        if page_size is None:
            raise UsageError("spilling alignment needs the page size")
        blocker = BufferSpiller(spill_dir, page_size)
    strategy = AlignmentStrategy.BLOCKING_UPSTREAM if blocker is None else AlignmentStrategy.PARKING
    try:
        return AlignedBarrierHandler(
            num_channels,
            listener,
            clock,
            resume,
            strategy=strategy,
            blocker=blocker,
            max_aligned_bytes=max_aligned_bytes,
        )
    except BaseException:
        if blocker is not None:
            blocker.close()  # a private spill directory goes with it
        raise
