"""The unaligned barrier handler (FLIP-76), with an aligned-first timeout.

Flink's ``SingleCheckpointBarrierHandler`` in its unaligned and alternating forms. The
**cut** of checkpoint N at this input is, per channel, the position of that channel's
barrier N (or its EndOfPartition). Nothing is held back once the checkpoint triggered:

* the first barrier of N triggers the snapshot at once (the task forwards its own barrier
  downstream at once); from then on, every buffer that arrives on a channel whose barrier
  N has not come yet is returned for processing *and* reported as **input channel state**
  of N (``persist_input(N, channel, buffer)``, called before ``process`` returns the
  buffer: the listener copies what it keeps, the buffer still belongs to the caller);
* once every open channel delivered barrier N or ended, the channel state of N is final:
  ``input_state_complete(N)`` (also for a checkpoint that completed aligned: its channel
  state is empty).

So each record before the cut was processed before the trigger (it is in the operator
state) or is in the channel state; each record after the cut is processed after the
trigger and never persisted.

**Aligned first** (``aligned_checkpoint_timeout``; Flink's ``AlternatingWaitingFor*``
states): the first barrier starts an *aligned* checkpoint; channels that delivered an
exactly-once barrier are blocked upstream (as in the aligned handler) until the checkpoint
triggers. If every open channel aligns in time, the checkpoint triggers aligned. If the
alignment lasts longer than the timeout, it turns unaligned: the snapshot triggers, the
held channels are resumed (what they send is after the cut), and what still arrives on the
other channels before their barrier is channel state. The timeout is looked at on every
``process``/``poll_next`` call; ``next_deadline()`` says when a caller that waits for
input should call ``poll_next`` at the latest. Held channels send nothing (they are
blocked upstream), so a handler never parks: channel state is what flows in after the
trigger on channels still before their barrier.

**Forced aligned** (Flink's ``FORCED_ALIGNED``): a checkpoint whose first barrier comes
on a channel that already delivered EndOfData, or a savepoint, is collected aligned with
no timeout. The final checkpoint of FLIP-147 is such a checkpoint (its barriers follow
EndOfData on every channel), so it triggers after the task's input ended and what
``end_input`` emits precedes its barrier, as in the aligned handler.

**Priority barriers.** A barrier that overtook buffers upstream (``options.unaligned``)
does not block its channel; the buffers it overtook arrive after it, flagged with
``overtaken_by``: they are before the cut, so they are channel state too. Such a barrier
makes its checkpoint unaligned at once, aligned first or not (unless forced aligned). The
handler does not know how many buffers a priority barrier overtook: its channel's part of
the cut ends with the channel's next data buffer that is not flagged for that checkpoint
(or its EndOfData or EndOfPartition), or when the reader says the gate had nothing
more (``input_drained``: the overtaken buffers were queued behind the barrier, so they
are all in), so a channel that goes quiet right after such a barrier does not hold the
checkpoint back.

The other rules are the aligned handler's: a newer barrier or cancellation marker
subsumes the pending checkpoint (``abort_checkpoint(SUBSUMED)``), a marker of the pending
one aborts it (CANCELLED), older barriers and markers are ignored, EndOfPartition closes
its channel (it counts as its barrier), every exactly-once barrier received is resumed
exactly once. A listener that raises in ``trigger_checkpoint`` leaves the checkpoint
untaken here: its later barriers are ignored, nothing is persisted for it, the error
propagates (the held channels are resumed first). After an abort nothing more is persisted
for that checkpoint and ``input_state_complete`` never comes for it.

States (``_TRANSITIONS``)::

    IDLE --first barrier, timeout 0 or None--> COLLECTING_UNALIGNED (trigger)
    IDLE --first barrier, timeout > 0--> COLLECTING_ALIGNED
    COLLECTING_ALIGNED --all channels aligned: trigger--> IDLE
    COLLECTING_ALIGNED --timeout: trigger, resume held--> COLLECTING_UNALIGNED
    COLLECTING_UNALIGNED --all channels' barriers: input_state_complete--> IDLE
    COLLECTING_* --marker, newer barrier/marker: abort--> IDLE / COLLECTING_*
    any --close()--> CLOSED
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from typing import Final, Protocol

from exchange.buffers.buffer import Buffer
from exchange.checkpointing.barrier_handler import (
    BarrierHandlerStats,
    ChannelBlockedError,
    CheckpointBarrierHandler,
    CheckpointFailureReason,
    CheckpointListener,
    Clock,
    ResumeConsumption,
    is_aligned_barrier,
)
from exchange.consumer.single_input_gate import BufferOrEvent
from exchange.errors import ConfigError, IllegalStateError, UsageError
from exchange.events.events import (
    CancelCheckpointMarker,
    CheckpointBarrier,
    CheckpointType,
    EndOfDataEvent,
    EndOfPartitionEvent,
)

__all__ = [
    "ChannelCutListener",
    "UnalignedBarrierHandler",
    "UnalignedCheckpointListener",
    "UnalignedState",
]


class UnalignedCheckpointListener(CheckpointListener, Protocol):
    """The task side of an unaligned handler: also told the checkpoint's channel state."""

    def persist_input(self, checkpoint_id: int, channel_index: int, buffer: Buffer) -> None:
        """``buffer`` is input channel state of ``checkpoint_id`` (copy what you keep)."""

    def input_state_complete(self, checkpoint_id: int) -> None:
        """Every channel's barrier came: the channel state of ``checkpoint_id`` is final."""


class ChannelCutListener(Protocol):
    """Optional on an unaligned listener: ``input_channel_cut(N, channel)`` is called when
    a channel's part of the cut of N ends after a *priority* barrier, at the first item
    of the channel that is not input channel state of N (called before that item is
    processed). What the channel's decoder holds of an incomplete record then is the head
    of a record whose tail is the producer's output channel state: the listener persists
    it (Flink's ``getUnconsumedBuffer``)."""

    def input_channel_cut(self, checkpoint_id: int, channel_index: int) -> None: ...


class UnalignedState(Enum):
    IDLE = "idle"
    COLLECTING_ALIGNED = "collecting_aligned"
    COLLECTING_UNALIGNED = "collecting_unaligned"
    CLOSED = "closed"


_I, _A, _U, _X = (
    UnalignedState.IDLE,
    UnalignedState.COLLECTING_ALIGNED,
    UnalignedState.COLLECTING_UNALIGNED,
    UnalignedState.CLOSED,
)
_TRANSITIONS: Final[dict[UnalignedState, frozenset[UnalignedState]]] = {
    _I: frozenset({_A, _U, _X}),
    _A: frozenset({_I, _A, _U, _X}),
    _U: frozenset({_I, _A, _U, _X}),
    _X: frozenset({_X}),
}


@dataclass(slots=True)
class _Pending:
    """The checkpoint whose barriers are being collected."""

    barrier: CheckpointBarrier
    started_at: float
    arrived: set[int] = field(default_factory=set)  # delivered the barrier, or ended
    held: set[int] = field(default_factory=set)  # blocked upstream (aligned phase)
    #: channels whose priority barrier came, until their next item that is not a buffer
    #: it overtook (those come right after it, flagged ``overtaken_by``)
    overtaking: set[int] = field(default_factory=set)
    forced_aligned: bool = False
    persisted_bytes: int = 0
    processed_bytes: int = 0  # during the aligned phase

    @property
    def checkpoint_id(self) -> int:
        return self.barrier.checkpoint_id


class UnalignedBarrierHandler(CheckpointBarrierHandler):
    """Unaligned checkpoints; aligned first for ``aligned_checkpoint_timeout`` seconds.

    ``aligned_checkpoint_timeout`` None or 0: every checkpoint is unaligned from its first
    barrier. ``> 0``: aligned first, unaligned once the alignment took that long.
    """

    def __init__(
        self,
        num_channels: int,
        listener: UnalignedCheckpointListener,
        clock: Clock,
        resume: ResumeConsumption | None = None,
        *,
        aligned_checkpoint_timeout: float | None = None,
    ) -> None:
        if resume is None:
            raise UsageError("the unaligned handler needs resume= to resume blocked channels")
        t = aligned_checkpoint_timeout
        if t is not None and (not math.isfinite(t) or t < 0):
            raise ConfigError("aligned_checkpoint_timeout", f"must be >= 0 seconds, got {t!r}")
        super().__init__(num_channels, listener, clock, resume)
        self.channel_state_listener = listener
        cut = getattr(listener, "input_channel_cut", None)
        self._on_cut: Callable[[int, int], None] | None = cut if callable(cut) else None
        self.aligned_checkpoint_timeout = t or 0.0
        self._state = UnalignedState.IDLE
        self._pending: _Pending | None = None
        self._current_id = -1  # newest checkpoint seen (barrier or marker)
        self._open: set[int] = set(range(num_channels))
        self._ended_data: set[int] = set()  # channels that delivered EndOfData
        self.num_unaligned = 0
        self.num_aligned = 0
        #: True when the last triggered checkpoint triggered unaligned
        self.last_unaligned = False
        #: bytes persisted as channel state, of the last checkpoint whose state completed
        self.last_persisted_bytes = 0
        self.total_persisted_bytes = 0

    @property
    def state(self) -> UnalignedState:
        return self._state

    @property
    def current_checkpoint_id(self) -> int:
        return self._current_id

    @property
    def num_open_channels(self) -> int:
        return len(self._open)

    @property
    def collecting_unaligned(self) -> bool:
        """A checkpoint triggered unaligned whose channel state is not complete yet."""
        return self._pending is not None and self._state is UnalignedState.COLLECTING_UNALIGNED

    def persisting_channels(self) -> frozenset[int]:
        """Channels whose input is channel state now (after the trigger, before barrier)."""
        p = self._pending
        if p is None or self._state is not UnalignedState.COLLECTING_UNALIGNED:
            return frozenset()
        return frozenset(self._open - p.arrived)

    def next_deadline(self) -> float | None:
        """Clock time at which an aligned checkpoint turns unaligned; None: no deadline."""
        p = self._pending
        if p is None or p.forced_aligned or self._state is not UnalignedState.COLLECTING_ALIGNED:
            return None
        return p.started_at + self.aligned_checkpoint_timeout

    # -- input ---------------------------------------------------------------------------

    def process(self, boe: BufferOrEvent) -> BufferOrEvent | None:
        self._check_input(boe)
        try:
            self._check_timeout()
        except BaseException:
            if boe.buffer is not None:
                boe.buffer.release()  # the listener failed: nobody else gets the buffer
            raise
        ch = boe.channel_index
        p = self._pending
        buf = boe.buffer
        if (
            p is not None
            and ch in p.overtaking
            and (
                (buf is not None and p.checkpoint_id not in boe.overtaken_by)
                or isinstance(boe.event, EndOfDataEvent)
            )
        ):
            # the buffers its priority barrier overtook are all in (events it overtook
            # come unflagged among them, later priority barriers ahead of them: neither
            # ends the run; nothing follows EndOfData): the channel's part of the cut is
            # complete, and this item is after it
            p.overtaking.discard(ch)
            if self._on_cut is not None:
                self._on_cut(p.checkpoint_id, ch)
            self._complete_if_done()
            p = self._pending
        if buf is not None:
            if p is not None:
                if ch in p.held:
                    buf.release()
                    raise ChannelBlockedError(ch, p.checkpoint_id)
                if self._state is UnalignedState.COLLECTING_UNALIGNED:
                    if ch not in p.arrived or p.checkpoint_id in boe.overtaken_by:
                        p.persisted_bytes += buf.size
                        self.total_persisted_bytes += buf.size
                        try:
                            self.channel_state_listener.persist_input(p.checkpoint_id, ch, buf)
                        except BaseException:
                            buf.release()
                            raise
                else:
                    p.processed_bytes += buf.size
            return boe
        event = boe.event
        match event:
            case CheckpointBarrier():
                self._on_barrier(event, ch)
                return None
            case CancelCheckpointMarker():
                self._on_cancel(event.checkpoint_id)
                return None
            case EndOfDataEvent():
                self._ended_data.add(ch)
            case EndOfPartitionEvent():
                self._open.discard(ch)
                if p is not None:
                    p.arrived.add(ch)
                    p.overtaking.discard(ch)
                    self._complete_if_done()
        return boe

    def input_drained(self) -> None:
        """The gate had nothing more to hand out after the items processed so far: every
        buffer a priority barrier overtook in its channel (they are queued behind it)
        has been processed, so each channel's part of the cut that waited for its next
        buffer is complete now (a producer that went quiet after its barrier does not
        hold the checkpoint back)."""
        self._check_open()
        p = self._pending
        if p is None or not p.overtaking:
            return
        for ch in sorted(p.overtaking):
            if self._on_cut is not None:
                self._on_cut(p.checkpoint_id, ch)
        p.overtaking.clear()
        self._complete_if_done()

    def poll_next(self) -> BufferOrEvent | None:
        """Nothing is ever parked; looks at the aligned timeout."""
        self._check_open()
        self._check_timeout()
        return None

    def _check_timeout(self) -> None:
        deadline = self.next_deadline()
        if deadline is not None and self.clock() >= deadline:
            self._turn_unaligned()

    # -- events --------------------------------------------------------------------------

    def _on_barrier(self, barrier: CheckpointBarrier, ch: int) -> None:
        cid = barrier.checkpoint_id
        blocks = is_aligned_barrier(barrier)
        p = self._pending
        if p is not None and cid == p.checkpoint_id and ch not in p.arrived:
            pass  # the pending checkpoint's barrier on one more channel
        elif cid > self._current_id:
            if p is not None:
                try:
                    self._end(CheckpointFailureReason.SUBSUMED)
                except BaseException:
                    self._current_id = cid  # its other barriers are obsolete now
                    if blocks:
                        self._resume_channel(ch)
                    raise
            p = self._start(barrier, forced_aligned=ch in self._ended_data)
            p.arrived.add(ch)
            if barrier.options.unaligned:
                p.overtaking.add(ch)
            if self._state is UnalignedState.COLLECTING_UNALIGNED:
                if blocks:
                    self._resume_channel(ch)
                self._trigger_pending(unaligned=True)
            elif blocks:
                p.held.add(ch)
            self._complete_if_done()
            return
        else:
            # obsolete (older, or the current one already done, aborted or cancelled) or a
            # repeat: nothing to collect, but its channel was blocked
            if blocks:
                self._resume_channel(ch)
            return
        assert p is not None
        p.arrived.add(ch)
        if barrier.options.unaligned:
            p.overtaking.add(ch)
        if self._state is UnalignedState.COLLECTING_ALIGNED:
            if blocks:
                p.held.add(ch)
            elif barrier.options.unaligned and not p.forced_aligned:
                # a priority barrier holds nothing back upstream: what follows it on
                # this channel is after the cut, so the checkpoint cannot stay aligned
                self._turn_unaligned()
                return
        elif blocks:
            self._resume_channel(ch)
        self._complete_if_done()

    def _on_cancel(self, cid: int) -> None:
        p = self._pending
        if p is not None:
            if cid == p.checkpoint_id:
                self._end(CheckpointFailureReason.CANCELLED)
            elif cid > p.checkpoint_id:
                self._end(CheckpointFailureReason.SUBSUMED)
                self._current_id = cid
                self._abort(cid, CheckpointFailureReason.CANCELLED)
            # else: a marker of a checkpoint older than the pending one
        elif cid > self._current_id:
            self._current_id = cid  # later barriers of it are ignored
            self._abort(cid, CheckpointFailureReason.CANCELLED)

    # -- transitions ---------------------------------------------------------------------

    def _transition(self, new: UnalignedState) -> None:
        if new not in _TRANSITIONS[self._state]:
            raise IllegalStateError(f"barrier handler cannot go from {self._state} to {new}")
        self._state = new

    def _start(self, barrier: CheckpointBarrier, *, forced_aligned: bool) -> _Pending:
        self._current_id = barrier.checkpoint_id
        forced = forced_aligned or barrier.options.checkpoint_type is CheckpointType.SAVEPOINT
        # a priority barrier already overtook its channel's data upstream: no alignment
        aligned_first = forced or (
            self.aligned_checkpoint_timeout > 0 and not barrier.options.unaligned
        )
        self._transition(_A if aligned_first else _U)
        p = self._pending = _Pending(barrier, self.clock(), forced_aligned=forced)
        return p

    def _trigger_pending(self, *, unaligned: bool) -> None:
        """Trigger the pending checkpoint; resume what was held. A listener that raises
        leaves the checkpoint untaken (dropped), the held channels resumed."""
        p = self._pending
        assert p is not None
        held, p.held = p.held, set()
        if unaligned:
            self._transition(_U)
        try:
            self.last_alignment_duration = self.clock() - p.started_at
            self.last_aligned_bytes = p.processed_bytes
            self.last_unaligned = unaligned
            if unaligned:
                self.num_unaligned += 1
            else:
                self.num_aligned += 1
            b = p.barrier
            self._trigger(b.checkpoint_id, b.timestamp, b.options)
        except BaseException:
            self._pending = None
            self._transition(_I)
            raise
        finally:
            for ch in sorted(held):
                self._resume_channel(ch)

    def _turn_unaligned(self) -> None:
        """The aligned phase timed out: trigger now; the rest is channel state."""
        self._trigger_pending(unaligned=True)
        self._complete_if_done()

    def _complete_if_done(self) -> None:
        """Every open channel delivered the barrier (or ended): an aligned checkpoint
        triggers now; either way its channel state is final."""
        p = self._pending
        if p is None or not self._open <= p.arrived or p.overtaking:
            return
        if self._state is UnalignedState.COLLECTING_ALIGNED:
            self._trigger_pending(unaligned=False)  # aligned: its channel state is empty
        self._finish(p)

    def _finish(self, p: _Pending) -> None:
        self._pending = None
        if self._state is not _I:
            self._transition(_I)
        self.last_persisted_bytes = p.persisted_bytes
        self.channel_state_listener.input_state_complete(p.checkpoint_id)

    def _end(self, reason: CheckpointFailureReason) -> None:
        """Abort the pending checkpoint; resume what it held."""
        p = self._pending
        assert p is not None
        self._pending = None
        self._transition(_I)
        try:
            self._abort(p.checkpoint_id, reason)
        finally:
            for ch in sorted(p.held):
                self._resume_channel(ch)

    # -- lifecycle -----------------------------------------------------------------------

    def abort_pending(self, reason: CheckpointFailureReason) -> int | None:
        """Abort the pending checkpoint (the task declined it); its id or None."""
        self._check_open()
        p = self._pending
        if p is None:
            return None
        self._end(reason)
        return p.checkpoint_id

    def stats(self) -> BarrierHandlerStats:
        p = self._pending
        aligning = p is not None and self._state is UnalignedState.COLLECTING_ALIGNED
        return BarrierHandlerStats(
            num_triggered=self.num_triggered,
            num_aborted=self.num_aborted,
            aligning_checkpoint_id=p.checkpoint_id if p is not None else None,
            last_alignment_duration=self.last_alignment_duration,
            last_aligned_bytes=self.last_aligned_bytes,
            current_alignment_duration=(
                self.clock() - p.started_at if aligning and p is not None else 0.0
            ),
            buffered_bytes=0,
            total_parked_bytes=0,
            num_resumed=self.num_resumed,
        )

    def close(self) -> None:
        """Forget the pending checkpoint; no callbacks, no resumes."""
        if self._state is UnalignedState.CLOSED:
            return
        self._transition(_X)
        self._pending = None
        super().close()

    def __repr__(self) -> str:
        return (
            f"UnalignedBarrierHandler({self._state.value}, current={self._current_id}, "
            f"timeout={self.aligned_checkpoint_timeout}, "
            f"open={len(self._open)}/{self.num_channels})"
        )
