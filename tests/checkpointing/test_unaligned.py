"""UnalignedBarrierHandler: one test per rule (Flink's UnalignedCheckpointsTest and the
AlternatingWaitingFor* cases of SingleCheckpointBarrierHandler)."""

from __future__ import annotations

from typing import Any

import pytest

from exchange.buffers.buffer import Buffer
from exchange.checkpointing import (
    ChannelBlockedError,
    CheckpointFailureReason,
    CheckpointingMode,
    UnalignedBarrierHandler,
    UnalignedState,
    create_barrier_handler,
)
from exchange.errors import ConfigError, UsageError
from exchange.events.events import CheckpointBarrier, CheckpointOptions, EndOfDataEvent
from exchange.memory import NetworkBufferPool
from tests.checkpointing.conftest import (
    FakeClock,
    Task,
    barrier,
    cancel,
    data,
    eop,
    event,
    feed,
)


class UTask(Task):
    """A Task that also takes channel state: ("persist", id, channel, payload), ("done", id)."""

    def persist_input(self, checkpoint_id: int, channel_index: int, buffer: Buffer) -> None:
        self.log.append(("persist", checkpoint_id, channel_index, buffer.to_bytes()))

    def input_state_complete(self, checkpoint_id: int) -> None:
        self.log.append(("done", checkpoint_id))

    def callbacks(self) -> list[tuple[Any, ...]]:
        return [e for e in self.log if e[0] in ("trigger", "abort", "persist", "done")]


@pytest.fixture
def utask() -> UTask:
    return UTask()


def make(
    n: int, t: UTask, clock: FakeClock, timeout: float | None = None
) -> UnalignedBarrierHandler:
    h = create_barrier_handler(
        CheckpointingMode.UNALIGNED, n, t, clock, t.resume, aligned_checkpoint_timeout=timeout
    )
    assert isinstance(h, UnalignedBarrierHandler)
    return h


def test_first_barrier_triggers_at_once_and_later_input_is_channel_state(
    utask: UTask, clock: FakeClock, pool: NetworkBufferPool
) -> None:
    h = make(3, utask, clock)
    feed(h, utask, [data(0, b"a", pool), barrier(1, 1)])
    assert utask.log == [("rec", 0, b"a"), ("resume", 1), ("trigger", 1)]
    utask.clear()
    feed(
        h,
        utask,
        [data(0, b"b", pool), data(1, b"post", pool), data(2, b"c", pool), barrier(0, 1)],
    )
    # before their barrier: processed AND persisted; after it (channel 1): processed only
    assert utask.log == [
        ("persist", 1, 0, b"b"),
        ("rec", 0, b"b"),
        ("rec", 1, b"post"),
        ("persist", 1, 2, b"c"),
        ("rec", 2, b"c"),
        ("resume", 0),
    ]
    utask.clear()
    feed(h, utask, [barrier(2, 1), data(2, b"d", pool)])
    assert utask.log == [("resume", 2), ("done", 1), ("rec", 2, b"d")]
    assert h.state is UnalignedState.IDLE
    assert h.last_persisted_bytes == 2 and h.last_unaligned and h.num_unaligned == 1
    h.close()


def test_single_channel_completes_with_its_barrier(utask: UTask, clock: FakeClock) -> None:
    h = make(1, utask, clock)
    feed(h, utask, [barrier(0, 5, aligned=False)])
    assert utask.callbacks() == [("trigger", 5), ("done", 5)]
    assert ("resume", 0) not in utask.log  # an at-least-once-type barrier blocks nothing


def test_newer_barrier_subsumes_pending(
    utask: UTask, clock: FakeClock, pool: NetworkBufferPool
) -> None:
    h = make(2, utask, clock)
    feed(h, utask, [barrier(0, 1), data(1, b"x", pool), barrier(0, 2), data(1, b"y", pool)])
    feed(h, utask, [barrier(1, 1), barrier(1, 2)])  # the late barrier 1 is obsolete
    assert utask.callbacks() == [
        ("trigger", 1),
        ("persist", 1, 1, b"x"),
        ("abort", 1, CheckpointFailureReason.SUBSUMED),
        ("trigger", 2),
        ("persist", 2, 1, b"y"),
        ("done", 2),
    ]
    assert utask.log.count(("resume", 1)) == 2 and utask.log.count(("resume", 0)) == 2


def test_cancel_marker_aborts_and_stops_persisting(
    utask: UTask, clock: FakeClock, pool: NetworkBufferPool
) -> None:
    h = make(2, utask, clock)
    feed(h, utask, [barrier(0, 1), cancel(1, 1), data(1, b"x", pool), barrier(1, 1)])
    assert utask.callbacks() == [("trigger", 1), ("abort", 1, CheckpointFailureReason.CANCELLED)]
    assert ("rec", 1, b"x") in utask.log


def test_newer_cancel_marker_subsumes_then_cancels(utask: UTask, clock: FakeClock) -> None:
    h = make(2, utask, clock)
    feed(h, utask, [barrier(0, 1), cancel(1, 3), barrier(1, 3), cancel(0, 2)])
    assert utask.callbacks() == [
        ("trigger", 1),
        ("abort", 1, CheckpointFailureReason.SUBSUMED),
        ("abort", 3, CheckpointFailureReason.CANCELLED),
    ]


def test_end_of_partition_counts_as_barrier(
    utask: UTask, clock: FakeClock, pool: NetworkBufferPool
) -> None:
    h = make(3, utask, clock)
    feed(h, utask, [barrier(0, 1), data(1, b"x", pool), eop(1)])
    assert utask.callbacks() == [("trigger", 1), ("persist", 1, 1, b"x")]
    feed(h, utask, [eop(2)])
    assert utask.callbacks()[-1] == ("done", 1)
    # ended channels no longer count for the next checkpoint
    feed(h, utask, [barrier(0, 2)])
    assert utask.callbacks()[-2:] == [("trigger", 2), ("done", 2)]
    assert h.num_open_channels == 1


def test_failing_snapshot_leaves_checkpoint_untaken(
    utask: UTask, clock: FakeClock, pool: NetworkBufferPool
) -> None:
    h = make(2, utask, clock)

    def boom(*_: Any) -> None:
        raise RuntimeError("snapshot failed")

    utask.trigger_checkpoint = boom  # type: ignore[method-assign]
    with pytest.raises(RuntimeError, match="snapshot failed"):
        feed(h, utask, [barrier(0, 1)])
    assert utask.log == [("resume", 0)]
    feed(h, utask, [data(1, b"x", pool), barrier(1, 1)])  # not persisted, barrier obsolete
    assert utask.log[1:] == [("rec", 1, b"x"), ("resume", 1)]
    assert h.state is UnalignedState.IDLE


def test_aligned_first_completes_aligned_within_timeout(
    utask: UTask, clock: FakeClock, pool: NetworkBufferPool
) -> None:
    h = make(2, utask, clock, timeout=1.0)
    feed(h, utask, [barrier(0, 1), data(1, b"x", pool)])
    assert h.state is UnalignedState.COLLECTING_ALIGNED and h.next_deadline() == clock.now + 1.0
    with pytest.raises(ChannelBlockedError):
        h.process(data(0, b"blocked", pool))
    clock.advance(0.5)
    feed(h, utask, [barrier(1, 1)])
    assert utask.log == [
        ("rec", 1, b"x"),
        ("trigger", 1),
        ("resume", 0),
        ("resume", 1),
        ("done", 1),
    ]
    assert not h.last_unaligned and h.num_aligned == 1 and h.last_alignment_duration == 0.5


def test_aligned_first_turns_unaligned_after_timeout(
    utask: UTask, clock: FakeClock, pool: NetworkBufferPool
) -> None:
    h = make(3, utask, clock, timeout=1.0)
    feed(h, utask, [barrier(0, 1), data(1, b"pre", pool), barrier(1, 1)])
    assert ("trigger", 1) not in utask.log
    clock.advance(0.99)
    assert h.poll_next() is None and h.state is UnalignedState.COLLECTING_ALIGNED
    clock.advance(0.01)
    assert h.poll_next() is None  # the deadline, checked on poll
    assert h.state is UnalignedState.COLLECTING_UNALIGNED and h.next_deadline() is None
    assert utask.log[-3:] == [("trigger", 1), ("resume", 0), ("resume", 1)]
    utask.clear()
    feed(h, utask, [data(0, b"post", pool), data(2, b"c", pool), barrier(2, 1)])
    assert utask.log == [
        ("rec", 0, b"post"),
        ("persist", 1, 2, b"c"),
        ("rec", 2, b"c"),
        ("resume", 2),
        ("done", 1),
    ]
    assert h.last_unaligned and h.persisting_channels() == frozenset()


def test_timeout_is_checked_on_process(
    utask: UTask, clock: FakeClock, pool: NetworkBufferPool
) -> None:
    h = make(2, utask, clock, timeout=0.2)
    feed(h, utask, [barrier(0, 1)])
    clock.advance(0.3)
    out = h.process(data(1, b"x", pool))  # turns unaligned first: x is channel state
    assert out is not None
    utask.deliver(out)
    assert utask.callbacks() == [("trigger", 1), ("persist", 1, 1, b"x")]


def test_aligned_first_cancel_resumes_held(utask: UTask, clock: FakeClock) -> None:
    h = make(2, utask, clock, timeout=1.0)
    feed(h, utask, [barrier(0, 1), cancel(1, 1)])
    assert utask.log == [("abort", 1, CheckpointFailureReason.CANCELLED), ("resume", 0)]
    clock.advance(5)
    assert h.poll_next() is None and h.num_triggered == 0


def test_settings_validated(utask: UTask, clock: FakeClock) -> None:
    with pytest.raises(ConfigError):
        make(2, utask, clock, timeout=-1.0)
    with pytest.raises(ConfigError):
        make(2, utask, clock, timeout=float("nan"))
    with pytest.raises(UsageError, match="persist_input"):
        create_barrier_handler(CheckpointingMode.UNALIGNED, 2, Task(), clock, utask.resume)
    with pytest.raises(UsageError, match="aligned_checkpoint_timeout"):
        create_barrier_handler(
            CheckpointingMode.EXACTLY_ONCE,
            2,
            utask,
            clock,
            utask.resume,
            aligned_checkpoint_timeout=1.0,
        )


def test_barrier_after_end_of_data_forces_aligned(
    utask: UTask, clock: FakeClock, pool: NetworkBufferPool
) -> None:
    """FLIP-147's final checkpoint: its barriers follow EndOfData on every channel, so it
    triggers aligned (after the input ended), never at the first barrier, whatever time."""
    h = make(2, utask, clock)  # unaligned from the first barrier otherwise
    feed(h, utask, [event(0, EndOfDataEvent.INSTANCE), barrier(0, 7), data(1, b"last", pool)])
    clock.advance(1e6)
    assert h.poll_next() is None and h.next_deadline() is None
    assert ("trigger", 7) not in utask.log and h.state is UnalignedState.COLLECTING_ALIGNED
    feed(h, utask, [event(1, EndOfDataEvent.INSTANCE), barrier(1, 7)])
    assert utask.callbacks() == [("trigger", 7), ("done", 7)]
    assert not h.last_unaligned


def test_buffers_a_priority_barrier_overtook_are_channel_state(
    utask: UTask, clock: FakeClock, pool: NetworkBufferPool
) -> None:
    """The gate returns a priority (unaligned) barrier before the buffers it overtook in
    its channel, flagged ``overtaken_by``: those are before the cut, so channel state; the
    barrier blocks nothing upstream, so it is never resumed."""
    h = make(2, utask, clock)
    prio = CheckpointOptions(exactly_once=True, unaligned=True)
    feed(h, utask, [event(0, CheckpointBarrier(1, 1001, prio))])
    over = data(0, b"overtaken", pool)
    feed(h, utask, [over._replace(overtaken_by=(1,)), data(0, b"after", pool), barrier(1, 1)])
    assert utask.callbacks() == [("trigger", 1), ("persist", 1, 0, b"overtaken"), ("done", 1)]
    assert ("rec", 0, b"after") in utask.log and ("rec", 0, b"overtaken") in utask.log
    assert ("resume", 0) not in utask.log and ("resume", 1) in utask.log


class CutTask(UTask):
    """Also told where each channel's part of a priority barrier's cut ends."""

    def input_channel_cut(self, checkpoint_id: int, channel_index: int) -> None:
        self.log.append(("cut", checkpoint_id, channel_index))

    def callbacks(self) -> list[tuple[Any, ...]]:
        return [e for e in self.log if e[0] in ("trigger", "persist", "cut", "done")]


def test_a_channel_quiet_after_its_priority_barrier_ends_its_cut_when_the_gate_drains(
    clock: FakeClock, pool: NetworkBufferPool
) -> None:
    """A producer that sends nothing after its priority barrier (held, idle): its channel's
    run of overtaken buffers cannot end at its next buffer. When the reader finds the gate
    empty (``input_drained``), every overtaken buffer was processed (they were queued
    behind the barrier): the cut ends there for each such channel, the listener is told
    (so it can take the decoder's incomplete record), and the state is complete."""
    t = CutTask()
    h = make(2, t, clock)
    prio = CheckpointOptions(exactly_once=True, unaligned=True)
    over = data(0, b"overtaken", pool)._replace(overtaken_by=(3,))
    feed(h, t, [event(0, CheckpointBarrier(3, 1, prio)), over])
    feed(h, t, [event(1, CheckpointBarrier(3, 1, prio))])
    assert t.callbacks() == [("trigger", 3), ("persist", 3, 0, b"overtaken")]
    h.input_drained()
    assert t.callbacks()[2:] == [("cut", 3, 0), ("cut", 3, 1), ("done", 3)]
    h.input_drained()  # nothing pending: nothing happens
    assert t.callbacks()[-1] == ("done", 3) and len(t.callbacks()) == 5
    # the next buffer ends the run as before, and says where
    t.clear()
    feed(h, t, [event(0, CheckpointBarrier(4, 2, prio)), event(1, CheckpointBarrier(4, 2, prio))])
    feed(h, t, [data(0, b"next", pool)])
    assert t.callbacks() == [("trigger", 4), ("cut", 4, 0)]
    h.close()
