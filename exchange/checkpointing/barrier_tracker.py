"""CheckpointBarrierTracker: at-least-once barrier handling; never blocks an input.

Every buffer passes straight through. Barriers are counted per checkpoint id in a queue of
pending checkpoints (oldest first, at most ``MAX_CHECKPOINTS_TO_TRACK``). A checkpoint
triggers once every *open* channel delivered its barrier; then it and every older pending
checkpoint leave the queue (older ones not yet aborted are aborted as SUBSUMED). A barrier
for a checkpoint not newer than the newest one seen and no longer pending is ignored. A
CancelCheckpointMarker aborts its checkpoint and every older pending one. EndOfPartition
closes a channel, which may complete pending checkpoints (the newest complete one
triggers). With one open channel every new barrier triggers at once (the fast path falls
out of the general rule). Aligned-type barriers are resumed at once: the tracker never
holds a channel back.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Final

from exchange.checkpointing.barrier_handler import (
    BarrierHandlerStats,
    CheckpointBarrierHandler,
    CheckpointFailureReason,
    CheckpointListener,
    Clock,
    ResumeConsumption,
    is_aligned_barrier,
)
from exchange.consumer.single_input_gate import BufferOrEvent
from exchange.events.events import CancelCheckpointMarker, CheckpointBarrier, EndOfPartitionEvent

__all__ = ["MAX_CHECKPOINTS_TO_TRACK", "CheckpointBarrierTracker"]

#: Pending checkpoints tracked at once; the oldest is dropped (aborted) beyond that.
MAX_CHECKPOINTS_TO_TRACK: Final = 50


@dataclass(slots=True)
class _BarrierCount:
    """One pending checkpoint: which channels delivered its barrier (or marker)."""

    checkpoint_id: int
    barrier: CheckpointBarrier | None  # None for an entry created by a cancellation marker
    started_at: float
    bytes_at_start: int
    channels: set[int] = field(default_factory=set)
    aborted: bool = False


class CheckpointBarrierTracker(CheckpointBarrierHandler):
    """Flink's CheckpointBarrierTracker (AT_LEAST_ONCE)."""

    def __init__(
        self,
        num_channels: int,
        listener: CheckpointListener,
        clock: Clock,
        resume: ResumeConsumption | None = None,
    ) -> None:
        super().__init__(num_channels, listener, clock, resume)
        self._open: set[int] = set(range(num_channels))
        self._pending: deque[_BarrierCount] = deque()
        self._latest_pending_id = -1
        self._bytes_seen = 0

    @property
    def pending_checkpoint_ids(self) -> list[int]:
        return [c.checkpoint_id for c in self._pending]

    @property
    def num_open_channels(self) -> int:
        return len(self._open)

    def process(self, boe: BufferOrEvent) -> BufferOrEvent | None:
        self._check_input(boe)
        if boe.buffer is not None:
            self._bytes_seen += boe.buffer.size
            return boe
        event = boe.event
        match event:
            case CheckpointBarrier():
                if is_aligned_barrier(event):
                    self._resume_channel(boe.channel_index)
                self._on_barrier(event, boe.channel_index)
                return None
            case CancelCheckpointMarker():
                self._on_cancel(event.checkpoint_id, boe.channel_index)
                return None
            case EndOfPartitionEvent():
                self._on_end_of_partition(boe.channel_index)
        return boe

    def _find(self, checkpoint_id: int) -> int:
        for pos, cbc in enumerate(self._pending):
            if cbc.checkpoint_id == checkpoint_id:
                return pos
        return -1

    def _on_barrier(self, barrier: CheckpointBarrier, channel: int) -> None:
        pos = self._find(barrier.checkpoint_id)
        if pos >= 0:
            self._pending[pos].channels.add(channel)
            self._complete_if_aligned(pos)
        elif barrier.checkpoint_id > self._latest_pending_id:
            self._latest_pending_id = barrier.checkpoint_id
            cbc = _BarrierCount(barrier.checkpoint_id, barrier, self.clock(), self._bytes_seen)
            cbc.channels.add(channel)
            self._pending.append(cbc)
            if len(self._pending) > MAX_CHECKPOINTS_TO_TRACK:
                self._drop_first(CheckpointFailureReason.SUBSUMED)
            self._complete_if_aligned(len(self._pending) - 1)
        # else: a barrier of a checkpoint already completed, subsumed or dropped

    def _on_cancel(self, checkpoint_id: int, channel: int) -> None:
        while self._pending and self._pending[0].checkpoint_id < checkpoint_id:
            self._drop_first(CheckpointFailureReason.SUBSUMED)
        if self._pending and self._pending[0].checkpoint_id == checkpoint_id:
            cbc = self._pending[0]
            if not cbc.aborted:
                cbc.aborted = True
                self._abort(checkpoint_id, CheckpointFailureReason.CANCELLED)
            # keep counting so that the entry leaves once every channel has spoken
            cbc.channels.add(channel)
            if self._open <= cbc.channels:
                self._pending.popleft()
        elif checkpoint_id > self._latest_pending_id:
            self._latest_pending_id = checkpoint_id
            self._abort(checkpoint_id, CheckpointFailureReason.CANCELLED)
            cbc = _BarrierCount(checkpoint_id, None, self.clock(), self._bytes_seen, aborted=True)
            cbc.channels.add(channel)
            if not self._open <= cbc.channels:
                self._pending.appendleft(cbc)  # every older entry is gone
        # else: a trailing marker of a checkpoint already finished or aborted

    def _on_end_of_partition(self, channel: int) -> None:
        self._open.discard(channel)
        for pos in range(len(self._pending) - 1, -1, -1):
            if self._complete_if_aligned(pos):
                return

    def _complete_if_aligned(self, pos: int) -> bool:
        """If pending checkpoint ``pos`` has every open channel: trigger it, drop the older."""
        cbc = self._pending[pos]
        if not self._open <= cbc.channels:
            return False
        for _ in range(pos):
            self._drop_first(CheckpointFailureReason.SUBSUMED)
        self._pending.popleft()
        if not cbc.aborted:
            assert cbc.barrier is not None
            self.last_alignment_duration = self.clock() - cbc.started_at
            self.last_aligned_bytes = self._bytes_seen - cbc.bytes_at_start
            b = cbc.barrier
            self._trigger(b.checkpoint_id, b.timestamp, b.options)
        return True

    def _drop_first(self, reason: CheckpointFailureReason) -> None:
        cbc = self._pending.popleft()
        if not cbc.aborted:
            cbc.aborted = True
            self._abort(cbc.checkpoint_id, reason)

    def stats(self) -> BarrierHandlerStats:
        live = [c for c in self._pending if not c.aborted]
        return BarrierHandlerStats(
            num_triggered=self.num_triggered,
            num_aborted=self.num_aborted,
            aligning_checkpoint_id=live[-1].checkpoint_id if live else None,
            last_alignment_duration=self.last_alignment_duration,
            last_aligned_bytes=self.last_aligned_bytes,
            current_alignment_duration=self.clock() - live[0].started_at if live else 0.0,
            buffered_bytes=0,
            total_parked_bytes=0,
            num_resumed=self.num_resumed,
        )

    def close(self) -> None:
        """Forget pending checkpoints (nothing is held: the tracker never parks)."""
        self._pending.clear()
        super().close()
