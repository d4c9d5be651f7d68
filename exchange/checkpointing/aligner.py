"""The aligned (exactly-once) barrier handler, with two strategies behind one handler.

A checkpoint is aligned when every open channel has delivered its barrier; until then the
channels that already delivered it must not feed the task. How they are held back:

* ``BLOCKING_UPSTREAM`` (Flink >= 1.11): an aligned barrier blocks its subpartition at the
  producer, so nothing arrives on that channel; when the checkpoint triggers or aborts,
  ``resume(channel)`` is called for each held channel (input that arrives anyway raises
  ChannelBlockedError). The limit counts bytes processed on the other channels meanwhile.
* ``PARKING`` (seed 004's BarrierBuffer), for inputs that cannot be held upstream: the
  channel is resumed at once and what it sends is parked in a BufferBlocker; when the
  checkpoint triggers or aborts, the parked input is rolled over into a sequence and
  replayed through ``poll_next`` before any newer input. Replayed input passes through the
  same logic, so a barrier in it can start the next alignment while older parked input is
  still queued: sequences form a stack, newest first (Flink's ``queuedBuffered``), which
  keeps every channel's order. The limit counts parked bytes.

Either way every aligned barrier received gets exactly one ``resume``: at alignment end for
a held channel (blocking), at once otherwise (parking, obsolete or duplicate barriers).
That holds when the listener raises too (the resume is in a ``finally``): a caller that
survives the error reads on, and the failed checkpoint is simply not taken here.
A barrier whose options are not exactly-once (it does not block upstream) counts towards
alignment but holds nothing back: that input is at least once for its checkpoint.

States and their transitions (``_TRANSITIONS``)::

    WAITING_FOR_FIRST_BARRIER --barrier newer than current--> COLLECTING_BARRIERS
    COLLECTING_BARRIERS --all open channels aligned: trigger--> WAITING_FOR_FIRST_BARRIER
    COLLECTING_BARRIERS --newer barrier: abort SUBSUMED--> COLLECTING_BARRIERS
    COLLECTING_BARRIERS --marker, EndOfPartition, limit: abort--> WAITING_FOR_FIRST_BARRIER
    any --close()--> CLOSED
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from enum import Enum
from typing import Final

from exchange.checkpointing.barrier_handler import (
    BarrierHandlerStats,
    ChannelBlockedError,
    CheckpointBarrierHandler,
    CheckpointFailureReason,
    CheckpointListener,
    Clock,
    ResumeConsumption,
)
from exchange.checkpointing.buffer_blocker import BufferBlocker, BufferOrEventSequence
from exchange.consumer.single_input_gate import BufferOrEvent
from exchange.errors import ConfigError, IllegalStateError, UsageError
from exchange.events.events import CancelCheckpointMarker, CheckpointBarrier, EndOfPartitionEvent

__all__ = ["AlignedBarrierHandler", "AlignmentMode", "AlignmentState", "AlignmentStrategy"]


class AlignmentMode(Enum):
    """What a job asks of its aligned (exactly-once) handlers: the ``alignment`` setting.

    ``block_upstream`` (the default) holds an aligned channel at its producer;
    ``buffer`` parks its input in memory (``CachedBufferBlocker``); ``spill`` parks it in
    private spill files (``BufferSpiller``), releasing each buffer at once.
    """

    BLOCK_UPSTREAM = "block_upstream"
    BUFFER = "buffer"
    SPILL = "spill"

    @classmethod
    def parse(cls, value: object, setting: str = "alignment") -> AlignmentMode:
        """``value`` as a mode (a mode or its name); ConfigError naming ``setting``."""
        if isinstance(value, AlignmentMode):
            return value
        if isinstance(value, str):
            for mode in cls:
                if mode.value == value:
                    return mode
        raise ConfigError(setting, f"must be one of {[m.value for m in cls]}, got {value!r}")

    @property
    def strategy(self) -> AlignmentStrategy:
        if self is AlignmentMode.BLOCK_UPSTREAM:
            return AlignmentStrategy.BLOCKING_UPSTREAM
        return AlignmentStrategy.PARKING


class AlignmentStrategy(Enum):
    """How channels that delivered the barrier are held back during alignment."""

    BLOCKING_UPSTREAM = "blocking_upstream"
    PARKING = "parking"


class AlignmentState(Enum):
    WAITING_FOR_FIRST_BARRIER = "waiting_for_first_barrier"
    COLLECTING_BARRIERS = "collecting_barriers"
    CLOSED = "closed"


_W, _C, _X = (
    AlignmentState.WAITING_FOR_FIRST_BARRIER,
    AlignmentState.COLLECTING_BARRIERS,
    AlignmentState.CLOSED,
)
_TRANSITIONS: Final[dict[AlignmentState, frozenset[AlignmentState]]] = {
    _W: frozenset({_C, _X}),
    _C: frozenset({_W, _C, _X}),
    _X: frozenset({_X}),
}


@dataclass(slots=True)
class _Alignment:
    """The checkpoint being aligned."""

    barrier: CheckpointBarrier
    started_at: float
    aligned: set[int] = field(default_factory=set)  # channels that delivered the barrier
    held: set[int] = field(default_factory=set)  # blocked upstream or parked
    bytes: int = 0

    @property
    def checkpoint_id(self) -> int:
        return self.barrier.checkpoint_id


class AlignedBarrierHandler(CheckpointBarrierHandler):
    """Exactly-once barrier alignment (Flink's SingleCheckpointBarrierHandler/BarrierBuffer).

    ``max_aligned_bytes`` (None or 0: unlimited) aborts an alignment with ALIGNMENT_LIMIT
    once more bytes than that were parked (parking) or processed (blocking) during it.
    """

    def __init__(
        self,
        num_channels: int,
        listener: CheckpointListener,
        clock: Clock,
        resume: ResumeConsumption | None = None,
        *,
        strategy: AlignmentStrategy = AlignmentStrategy.BLOCKING_UPSTREAM,
        blocker: BufferBlocker | None = None,
        max_aligned_bytes: int | None = None,
    ) -> None:
        if resume is None:
            raise UsageError("the aligned handler needs resume= to resume blocked channels")
        super().__init__(num_channels, listener, clock, resume)
        if (strategy is AlignmentStrategy.PARKING) != (blocker is not None):
            raise UsageError("the parking strategy needs a BufferBlocker, blocking upstream none")
        if max_aligned_bytes is not None and max_aligned_bytes < 0:
            raise ConfigError(
                "checkpoint_alignment_limit", f"must be >= 0 bytes, got {max_aligned_bytes}"
            )
        self.strategy = strategy
        self.max_aligned_bytes = max_aligned_bytes or 0
        self._blocker = blocker
        self._state = AlignmentState.WAITING_FOR_FIRST_BARRIER
        self._alignment: _Alignment | None = None
        self._current_id = -1  # newest checkpoint seen (aligned, triggered or aborted)
        self._open: set[int] = set(range(num_channels))
        self._replay: deque[BufferOrEventSequence] = deque()
        self._total_parked = 0

    @property
    def state(self) -> AlignmentState:
        return self._state

    @property
    def current_checkpoint_id(self) -> int:
        """The newest checkpoint id seen; -1 before the first barrier or marker."""
        return self._current_id

    @property
    def num_open_channels(self) -> int:
        return len(self._open)

    # -- input ---------------------------------------------------------------------------

    def process(self, boe: BufferOrEvent) -> BufferOrEvent | None:
        self._check_input(boe)
        if self._replay:
            if boe.buffer is not None:
                boe.buffer.release()  # the handler owned it
            raise IllegalStateError("parked input is pending: call poll_next until None")
        return self._handle(boe)

    def poll_next(self) -> BufferOrEvent | None:
        self._check_open()
        while self._replay:
            seq = self._replay[0]
            boe = seq.get_next()
            if boe is None:
                seq.cleanup()
                self._replay.popleft()
                continue
            out = self._handle(boe)
            if out is not None:
                return out
        return None

    def is_empty(self) -> bool:
        return not self._replay

    def abort_alignment(self, reason: CheckpointFailureReason) -> int | None:
        """Abort the current alignment (the task declined, a timeout); its id or None."""
        self._check_open()
        al = self._alignment
        if al is None:
            return None
        self._end_alignment(reason)
        return al.checkpoint_id

    def _handle(self, boe: BufferOrEvent) -> BufferOrEvent | None:
        ch = boe.channel_index
        al = self._alignment
        if al is not None and ch in al.held:
            if self._blocker is None:
                if boe.buffer is not None:
                    boe.buffer.release()
                raise ChannelBlockedError(ch, al.checkpoint_id)
            size = self._blocker.add(boe)
            al.bytes += size
            self._total_parked += size
            self._check_limit(al)
            return None
        if boe.buffer is not None:
            if al is not None and self._blocker is None:
                al.bytes += boe.buffer.size
                try:
                    self._check_limit(al)
                except BaseException:
                    boe.buffer.release()  # the listener failed: nobody else gets the buffer
                    raise
            return boe
        event = boe.event
        match event:
            case CheckpointBarrier():
                self._on_barrier(event, ch)
                return None
            case CancelCheckpointMarker():
                self._on_cancel(event.checkpoint_id)
                return None
            case EndOfPartitionEvent():
                self._on_end_of_partition(ch)
        return boe

    # -- events --------------------------------------------------------------------------

    def _on_barrier(self, barrier: CheckpointBarrier, ch: int) -> None:
        cid = barrier.checkpoint_id
        blocks = barrier.options.exactly_once
        al = self._alignment
        if al is not None and cid == al.checkpoint_id and ch not in al.aligned:
            self._align_channel(al, ch, blocks)
        elif cid > self._current_id:
            if al is not None:
                try:
                    self._end_alignment(CheckpointFailureReason.SUBSUMED)
                except BaseException:
                    # the listener failed on the subsumed checkpoint: this barrier aligns
                    # nothing now, but it blocked its channel, and later barriers of its
                    # checkpoint are obsolete (resumed at once)
                    self._current_id = cid
                    if blocks:
                        self._resume_channel(ch)
                    raise
            al = self._start_alignment(barrier)
            self._align_channel(al, ch, blocks)
        else:
            # obsolete (older checkpoint, or the current one already triggered, aborted or
            # cancelled) or a repeat: nothing to align, but its channel was blocked
            if blocks:
                self._resume_channel(ch)
            return
        if self._open <= al.aligned:
            self._end_alignment(None)

    def _align_channel(self, al: _Alignment, ch: int, blocks: bool) -> None:
        al.aligned.add(ch)
        if blocks:
            al.held.add(ch)
            if self._blocker is not None:
                self._resume_channel(ch)  # read ahead: what it sends is parked

    def _on_cancel(self, cid: int) -> None:
        al = self._alignment
        if al is not None:
            if cid == al.checkpoint_id:
                self._end_alignment(CheckpointFailureReason.CANCELLED)
            elif cid > al.checkpoint_id:
                self._end_alignment(CheckpointFailureReason.SUBSUMED)
                self._current_id = cid
                self._abort(cid, CheckpointFailureReason.CANCELLED)
            # else: a marker of a checkpoint older than the one aligning
        elif cid > self._current_id:
            self._current_id = cid  # later barriers of it are ignored
            self._abort(cid, CheckpointFailureReason.CANCELLED)

    def _on_end_of_partition(self, ch: int) -> None:
        self._open.discard(ch)
        al = self._alignment
        if al is not None and ch not in al.aligned:
            self._end_alignment(CheckpointFailureReason.END_OF_INPUT)

    def _check_limit(self, al: _Alignment) -> None:
        if self.max_aligned_bytes and al.bytes > self.max_aligned_bytes:
            self._end_alignment(CheckpointFailureReason.ALIGNMENT_LIMIT)

    # -- transitions ---------------------------------------------------------------------

    def _transition(self, new: AlignmentState) -> None:
        if new not in _TRANSITIONS[self._state]:
            raise IllegalStateError(f"barrier handler cannot go from {self._state} to {new}")
        self._state = new

    def _start_alignment(self, barrier: CheckpointBarrier) -> _Alignment:
        self._transition(AlignmentState.COLLECTING_BARRIERS)
        self._current_id = barrier.checkpoint_id
        al = self._alignment = _Alignment(barrier, self.clock())
        return al

    def _end_alignment(self, reason: CheckpointFailureReason | None) -> None:
        """Trigger (``reason`` None) or abort the current alignment, then release it."""
        al = self._alignment
        assert al is not None
        self._transition(AlignmentState.WAITING_FOR_FIRST_BARRIER)
        self._alignment = None
        try:
            if reason is None:
                self.last_alignment_duration = self.clock() - al.started_at
                self.last_aligned_bytes = al.bytes
                b = al.barrier
                self._trigger(b.checkpoint_id, b.timestamp, b.options)
            else:
                self._abort(al.checkpoint_id, reason)
        finally:
            # whatever the listener did (it may raise), the held input flows again: a
            # caller that survives the error must not find its channels blocked forever
            if self._blocker is not None:
                seq = self._blocker.roll_over()
                if seq is not None:
                    self._replay.appendleft(seq)  # before older parked input still queued
            else:
                for ch in sorted(al.held):
                    self._resume_channel(ch)

    # -- lifecycle -----------------------------------------------------------------------

    def stats(self) -> BarrierHandlerStats:
        al = self._alignment
        buffered = sum(s.size for s in self._replay)
        if self._blocker is not None:
            buffered += self._blocker.bytes_blocked
        return BarrierHandlerStats(
            num_triggered=self.num_triggered,
            num_aborted=self.num_aborted,
            aligning_checkpoint_id=al.checkpoint_id if al is not None else None,
            last_alignment_duration=self.last_alignment_duration,
            last_aligned_bytes=self.last_aligned_bytes,
            current_alignment_duration=self.clock() - al.started_at if al is not None else 0.0,
            buffered_bytes=buffered,
            total_parked_bytes=self._total_parked,
            num_resumed=self.num_resumed,
        )

    def close(self) -> None:
        """Release everything parked or queued for replay; no callbacks, no resumes."""
        if self._state is AlignmentState.CLOSED:
            return
        self._transition(AlignmentState.CLOSED)
        self._alignment = None
        while self._replay:
            self._replay.popleft().cleanup()
        if self._blocker is not None:
            self._blocker.close()
        super().close()

    def __repr__(self) -> str:
        return (
            f"AlignedBarrierHandler({self.strategy.value}, {self._state.value}, "
            f"current={self._current_id}, open={len(self._open)}/{self.num_channels})"
        )
