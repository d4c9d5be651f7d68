"""AlignedBarrierHandler: both strategies through the branches seed 004 lists, scripted."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from exchange.checkpointing import (
    AlignedBarrierHandler,
    AlignmentState,
    AlignmentStrategy,
    BufferBlocker,
    BufferSpiller,
    CachedBufferBlocker,
    ChannelBlockedError,
    CheckpointBarrierTracker,
    CheckpointFailureReason,
    CheckpointingMode,
    create_barrier_handler,
)
from exchange.errors import ConfigError, IllegalStateError, UsageError
from exchange.events.events import AbstractEvent
from exchange.memory import NetworkBufferPool
from tests.checkpointing.conftest import (
    FakeClock,
    Task,
    barrier,
    cancel,
    data,
    drain,
    eop,
    event,
    feed,
)

R = CheckpointFailureReason


def blocking(
    n: int, task: Task, clock: FakeClock, limit: int | None = None
) -> AlignedBarrierHandler:
    return AlignedBarrierHandler(n, task, clock, task.resume, max_aligned_bytes=limit)


# -- blocking upstream --------------------------------------------------------------------


def test_blocking_triggers_when_all_aligned_then_resumes_every_channel(
    task: Task, clock: FakeClock
) -> None:
    h = blocking(3, task, clock)
    feed(h, task, [data(0, b"a"), barrier(0, 1), data(1, b"b"), barrier(2, 1)])
    assert h.state is AlignmentState.COLLECTING_BARRIERS
    feed(h, task, [data(1, b"c"), barrier(1, 1)])
    assert task.log == [
        ("rec", 0, b"a"),
        ("rec", 1, b"b"),
        ("rec", 1, b"c"),
        ("trigger", 1),
        ("resume", 0),
        ("resume", 1),
        ("resume", 2),
    ]
    assert h.state is AlignmentState.WAITING_FOR_FIRST_BARRIER


def test_blocking_input_on_a_held_channel_is_a_protocol_error(
    task: Task, clock: FakeClock, pool: NetworkBufferPool
) -> None:
    h = blocking(2, task, clock)
    feed(h, task, [barrier(0, 1)])
    with pytest.raises(ChannelBlockedError) as err:
        h.process(data(0, b"x", pool))
    assert (err.value.channel_index, err.value.checkpoint_id) == (0, 1)
    h.close()  # the refused buffer was released: the pool fixture checks


def test_single_channel_triggers_and_resumes_at_once(task: Task, clock: FakeClock) -> None:
    h = blocking(1, task, clock)
    feed(h, task, [data(0, b"a"), barrier(0, 1), data(0, b"b"), barrier(0, 1), cancel(0, 2)])
    assert task.log == [
        ("rec", 0, b"a"),
        ("trigger", 1),
        ("resume", 0),
        ("rec", 0, b"b"),
        ("resume", 0),  # the repeated barrier: obsolete, resumed, nothing else
        ("abort", 2, R.CANCELLED),
    ]
    assert h.stats().last_alignment_duration == 0.0


def test_newer_barrier_subsumes_the_current_alignment(task: Task, clock: FakeClock) -> None:
    h = blocking(2, task, clock)
    feed(h, task, [barrier(0, 1), barrier(1, 2)])
    assert task.log == [("abort", 1, R.SUBSUMED), ("resume", 0)]
    assert h.current_checkpoint_id == 2 and h.stats().aligning_checkpoint_id == 2
    task.clear()
    feed(h, task, [barrier(0, 1), barrier(0, 2)])  # the trailing 1 is obsolete
    assert task.log == [("resume", 0), ("trigger", 2), ("resume", 0), ("resume", 1)]


def test_cancel_marker_for_the_current_alignment(task: Task, clock: FakeClock) -> None:
    h = blocking(3, task, clock)
    feed(h, task, [barrier(0, 1), barrier(1, 1), cancel(2, 1), barrier(2, 1)])
    assert task.log == [("abort", 1, R.CANCELLED), ("resume", 0), ("resume", 1), ("resume", 2)]


def test_cancel_marker_for_a_newer_checkpoint_aborts_both(task: Task, clock: FakeClock) -> None:
    h = blocking(2, task, clock)
    feed(h, task, [barrier(0, 1), cancel(1, 3)])
    assert task.log == [("abort", 1, R.SUBSUMED), ("resume", 0), ("abort", 3, R.CANCELLED)]
    task.clear()
    feed(h, task, [barrier(0, 3), barrier(1, 2), barrier(1, 4), barrier(0, 4)])
    assert task.log == [
        ("resume", 0),
        ("resume", 1),
        ("trigger", 4),
        ("resume", 0),
        ("resume", 1),
    ]


def test_cancel_marker_for_an_older_checkpoint_is_ignored(task: Task, clock: FakeClock) -> None:
    h = blocking(2, task, clock)
    feed(h, task, [barrier(0, 5), cancel(1, 4), cancel(1, 5)])
    assert task.callbacks() == [("abort", 5, R.CANCELLED)]


def test_cancel_marker_without_alignment(task: Task, clock: FakeClock) -> None:
    h = blocking(2, task, clock)
    feed(h, task, [cancel(0, 2), cancel(1, 2), barrier(0, 2), barrier(1, 1)])
    assert task.log == [("abort", 2, R.CANCELLED), ("resume", 0), ("resume", 1)]
    assert h.state is AlignmentState.WAITING_FOR_FIRST_BARRIER


def test_end_of_partition_during_alignment_aborts_and_closes_the_channel(
    task: Task, clock: FakeClock
) -> None:
    h = blocking(3, task, clock)
    feed(h, task, [barrier(0, 1), eop(2)])
    assert task.log == [("abort", 1, R.END_OF_INPUT), ("resume", 0), ("eop", 2)]
    assert h.num_open_channels == 2
    task.clear()
    feed(h, task, [barrier(0, 2), barrier(1, 2)])  # two open channels are enough now
    assert task.callbacks() == [("trigger", 2)]
    task.clear()
    feed(h, task, [eop(1), barrier(0, 3)])
    assert task.log == [("eop", 1), ("trigger", 3), ("resume", 0)]


def test_alignment_limit_counts_bytes_processed_while_blocked(task: Task, clock: FakeClock) -> None:
    h = blocking(2, task, clock, limit=10)
    feed(h, task, [data(1, b"12345"), barrier(0, 1), data(1, b"123456"), data(1, b"12345")])
    assert task.log == [
        ("rec", 1, b"12345"),  # before the alignment: not counted
        ("rec", 1, b"123456"),
        ("abort", 1, R.ALIGNMENT_LIMIT),
        ("resume", 0),
        ("rec", 1, b"12345"),
    ]
    task.clear()
    feed(h, task, [barrier(1, 1)])  # the aborted checkpoint's trailing barrier
    assert task.log == [("resume", 1)]


def test_alignment_duration_and_bytes(task: Task, clock: FakeClock) -> None:
    h = blocking(2, task, clock)
    feed(h, task, [barrier(0, 7)])
    clock.advance(1.25)
    feed(h, task, [data(1, b"abcd")])
    assert h.stats().current_alignment_duration == 1.25
    clock.advance(0.75)
    feed(h, task, [barrier(1, 7)])
    s = h.stats()
    assert s.last_alignment_duration == 2.0 and s.last_aligned_bytes == 4
    assert (s.num_triggered, s.num_aborted, s.num_resumed, s.aligning_checkpoint_id) == (
        1,
        0,
        2,
        None,
    )
    assert h.last_alignment_duration == 2.0 and h.last_aligned_bytes == 4


def test_not_exactly_once_barrier_holds_nothing_back(task: Task, clock: FakeClock) -> None:
    """An at-least-once barrier counts towards alignment; its channel keeps flowing."""
    h = blocking(2, task, clock)
    feed(h, task, [barrier(0, 1, aligned=False), data(0, b"post"), barrier(1, 1)])
    assert task.log == [("rec", 0, b"post"), ("trigger", 1), ("resume", 1)]
    task.clear()
    feed(h, task, [barrier(0, 2, aligned=False), eop(0)])  # ended after its barrier: waits
    assert task.log == [("eop", 0)]
    feed(h, task, [barrier(1, 2)])
    assert task.callbacks() == [("trigger", 2)]


def test_abort_alignment_by_the_task(task: Task, clock: FakeClock) -> None:
    h = blocking(2, task, clock)
    assert h.abort_alignment(R.TIMEOUT) is None
    feed(h, task, [barrier(0, 1)])
    assert h.abort_alignment(R.TIMEOUT) == 1
    assert task.log == [("abort", 1, R.TIMEOUT), ("resume", 0)]


# -- parking -------------------------------------------------------------------------------


@pytest.fixture(params=["cached", "spilled"])
def blocker(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[BufferBlocker]:
    b: BufferBlocker = (
        CachedBufferBlocker() if request.param == "cached" else (BufferSpiller(tmp_path, 4096))
    )
    yield b
    b.close()
    assert list(tmp_path.iterdir()) == []


def parking(
    n: int, task: Task, clock: FakeClock, blocker: BufferBlocker, limit: int | None = None
) -> AlignedBarrierHandler:
    return AlignedBarrierHandler(
        n,
        task,
        clock,
        task.resume,
        strategy=AlignmentStrategy.PARKING,
        blocker=blocker,
        max_aligned_bytes=limit,
    )


def test_parking_holds_aligned_channels_and_replays_after_the_trigger(
    task: Task, clock: FakeClock, blocker: BufferBlocker, pool: NetworkBufferPool
) -> None:
    h = parking(2, task, clock, blocker)
    feed(h, task, [data(0, b"pre0", pool), barrier(0, 1), data(0, b"post0", pool)])
    feed(h, task, [data(1, b"pre1", pool), data(0, b"post0'", pool)])
    assert task.log == [("rec", 0, b"pre0"), ("resume", 0), ("rec", 1, b"pre1")]
    assert h.stats().buffered_bytes == 11
    out = h.process(barrier(1, 1))
    assert out is None and not h.is_empty()
    with pytest.raises(IllegalStateError, match="poll_next"):
        h.process(data(1, b"too early", pool))
    feed(h, task, [])
    assert task.log[3:] == [
        ("resume", 1),  # parking resumes at once, the trigger follows
        ("trigger", 1),
        ("rec", 0, b"post0"),
        ("rec", 0, b"post0'"),
    ]
    s = h.stats()
    assert s.last_aligned_bytes == 11 and s.total_parked_bytes == 11 and s.buffered_bytes == 0
    assert h.is_empty()
    h.close()


def test_parking_limit_aborts_and_replays(
    task: Task, clock: FakeClock, blocker: BufferBlocker, pool: NetworkBufferPool
) -> None:
    h = parking(2, task, clock, blocker, limit=8)
    feed(h, task, [barrier(0, 1), data(0, b"1234", pool), data(1, b"other", pool)])
    feed(h, task, [data(0, b"56789", pool), data(0, b"after", pool), barrier(1, 1)])
    assert task.log == [
        ("resume", 0),
        ("rec", 1, b"other"),
        ("abort", 1, R.ALIGNMENT_LIMIT),
        ("rec", 0, b"1234"),
        ("rec", 0, b"56789"),
        ("rec", 0, b"after"),
        ("resume", 1),
    ]
    h.close()


def test_nested_alignment_while_replaying_keeps_order(
    task: Task, clock: FakeClock, blocker: BufferBlocker, pool: NetworkBufferPool
) -> None:
    h = parking(2, task, clock, blocker)
    feed(h, task, [barrier(0, 1), data(0, b"a", pool), barrier(0, 2), data(0, b"b", pool)])
    feed(h, task, [cancel(0, 9), eop(0)])  # parked too: events keep their place
    feed(h, task, [data(1, b"x", pool), barrier(1, 1)])
    # replay: a passes, barrier 2 starts alignment 2, b, the marker and eop are parked again
    assert task.log == [
        ("resume", 0),
        ("rec", 1, b"x"),
        ("resume", 1),
        ("trigger", 1),
        ("rec", 0, b"a"),
        ("resume", 0),
    ]
    assert h.stats().aligning_checkpoint_id == 2
    task.clear()
    feed(h, task, [data(1, b"y", pool), barrier(1, 2), data(1, b"z", pool)])
    assert task.log == [
        ("rec", 1, b"y"),
        ("resume", 1),
        ("trigger", 2),
        ("rec", 0, b"b"),
        ("abort", 9, R.CANCELLED),
        ("eop", 0),
        ("rec", 1, b"z"),
    ]
    assert h.num_open_channels == 1
    h.close()


def test_alignment_completing_inside_a_replay_replays_its_parked_input_first(
    task: Task, clock: FakeClock, blocker: BufferBlocker, pool: NetworkBufferPool
) -> None:
    """Flink's stack of sequences: the newer parked input goes before the older rest."""
    h = parking(3, task, clock, blocker)
    feed(h, task, [barrier(0, 1), barrier(1, 1), data(0, b"x0", pool), barrier(0, 2)])
    feed(h, task, [data(0, b"y0", pool), data(1, b"x1", pool), barrier(1, 2)])
    feed(h, task, [data(0, b"z0", pool), data(1, b"y1", pool)])
    task.clear()
    feed(h, task, [eop(2)])  # aborts 1; replay: 2 aligns, y0 parks again, 2 completes
    assert task.log == [
        ("abort", 1, R.END_OF_INPUT),
        ("eop", 2),
        ("rec", 0, b"x0"),
        ("resume", 0),
        ("rec", 1, b"x1"),
        ("resume", 1),
        ("trigger", 2),
        ("rec", 0, b"y0"),
        ("rec", 0, b"z0"),
        ("rec", 1, b"y1"),
    ]
    h.close()


def test_parked_end_of_partition_does_not_abort_until_replayed(
    task: Task, clock: FakeClock, blocker: BufferBlocker
) -> None:
    h = parking(2, task, clock, blocker)
    feed(h, task, [barrier(0, 1), eop(0), barrier(1, 1)])
    assert task.log == [("resume", 0), ("resume", 1), ("trigger", 1), ("eop", 0)]
    h.close()


def test_close_releases_everything_parked(
    task: Task, clock: FakeClock, blocker: BufferBlocker, pool: NetworkBufferPool
) -> None:
    h = parking(3, task, clock, blocker)
    feed(h, task, [barrier(0, 1), data(0, b"p", pool), barrier(1, 1), data(1, b"q", pool)])
    feed(h, task, [barrier(2, 1)])  # triggers; replay pending and not drained below
    h2 = parking(2, task, clock, CachedBufferBlocker())
    feed(h2, task, [barrier(0, 1), data(0, b"r", pool)])
    h.close()
    h2.close()
    h.close()  # idempotent
    assert h.state is AlignmentState.CLOSED
    with pytest.raises(IllegalStateError):
        h.poll_next()


def test_parking_subsumed_by_a_newer_barrier_replays_before_the_new_alignment_input(
    task: Task, clock: FakeClock, blocker: BufferBlocker, pool: NetworkBufferPool
) -> None:
    h = parking(2, task, clock, blocker)
    feed(h, task, [barrier(0, 1), data(0, b"a", pool), barrier(1, 2), data(1, b"b", pool)])
    feed(h, task, [barrier(0, 2)])
    assert task.log == [
        ("resume", 0),
        ("abort", 1, R.SUBSUMED),
        ("resume", 1),
        ("rec", 0, b"a"),
        ("resume", 0),
        ("trigger", 2),
        ("rec", 1, b"b"),
    ]
    h.close()


# -- construction ---------------------------------------------------------------------------


def test_configuration_is_checked(task: Task, clock: FakeClock, tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="BufferBlocker"):
        AlignedBarrierHandler(2, task, clock, task.resume, strategy=AlignmentStrategy.PARKING)
    with pytest.raises(UsageError, match="BufferBlocker"):
        AlignedBarrierHandler(2, task, clock, task.resume, blocker=CachedBufferBlocker())
    with pytest.raises(UsageError, match="resume"):
        AlignedBarrierHandler(2, task, clock)
    with pytest.raises(ConfigError, match="checkpoint_alignment_limit"):
        AlignedBarrierHandler(2, task, clock, task.resume, max_aligned_bytes=-1)
    with pytest.raises(UsageError, match="page size"):
        create_barrier_handler(CheckpointingMode.EXACTLY_ONCE, 2, task, clock, spill_dir=tmp_path)


def test_factory_picks_the_handler(task: Task, clock: FakeClock, tmp_path: Path) -> None:
    t = create_barrier_handler(CheckpointingMode.AT_LEAST_ONCE, 2, task, clock, task.resume)
    assert isinstance(t, CheckpointBarrierTracker)
    b = create_barrier_handler(CheckpointingMode.EXACTLY_ONCE, 2, task, clock, task.resume)
    assert isinstance(b, AlignedBarrierHandler)
    assert b.strategy is AlignmentStrategy.BLOCKING_UPSTREAM
    s = create_barrier_handler(
        CheckpointingMode.EXACTLY_ONCE,
        2,
        task,
        clock,
        task.resume,
        spill_dir=tmp_path,
        page_size=4096,
        max_aligned_bytes=0,
    )
    assert isinstance(s, AlignedBarrierHandler)
    assert s.strategy is AlignmentStrategy.PARKING and s.max_aligned_bytes == 0
    assert "parking" in repr(s)
    s.close()


def test_other_events_pass_through_every_handler(task: Task, clock: FakeClock) -> None:
    class Watermark(AbstractEvent):
        __slots__ = ()

    wm = Watermark()
    handlers = [
        blocking(2, task, clock),
        CheckpointBarrierTracker(2, task, clock, task.resume),
    ]
    for h in handlers:
        feed(h, task, [event(0, wm)])
        h.close()
    assert task.log == [("event", 0, wm), ("event", 0, wm)]


# -- a listener that raises (issue 18) ----------------------------------------------------


class Failing(Task):
    """A task whose trigger (or abort) of ``checkpoint_id`` raises, once."""

    def __init__(self, on: str, checkpoint_id: int) -> None:
        super().__init__()
        self.on = on
        self.checkpoint_id = checkpoint_id

    def _maybe_fail(self, kind: str, checkpoint_id: int) -> None:
        if kind == self.on and checkpoint_id == self.checkpoint_id:
            self.on = ""
            raise RuntimeError(f"injected: {kind} {checkpoint_id}")

    def trigger_checkpoint(self, checkpoint_id: int, timestamp: int, options: Any) -> None:
        super().trigger_checkpoint(checkpoint_id, timestamp, options)
        self._maybe_fail("trigger", checkpoint_id)

    def abort_checkpoint(self, checkpoint_id: int, reason: CheckpointFailureReason) -> None:
        super().abort_checkpoint(checkpoint_id, reason)
        self._maybe_fail("abort", checkpoint_id)


def _resumed(task: Task) -> list[int]:
    return sorted(e[1] for e in task.log if e[0] == "resume")


def test_a_raising_trigger_still_resumes_every_held_channel(clock: FakeClock) -> None:
    """Before, the resume came after the listener: its exception left both channels
    blocked upstream, so a reader that survived it never got input from them again."""
    task = Failing("trigger", 1)
    h = blocking(2, task, clock)
    feed(h, task, [barrier(0, 1)])
    with pytest.raises(RuntimeError, match="injected: trigger 1"):
        h.process(barrier(1, 1))
    assert _resumed(task) == [0, 1]
    assert h.state is AlignmentState.WAITING_FOR_FIRST_BARRIER
    task.clear()  # the next checkpoint aligns as usual
    feed(h, task, [data(0, b"a"), barrier(0, 2), barrier(1, 2)])
    assert task.log == [("rec", 0, b"a"), ("trigger", 2), ("resume", 0), ("resume", 1)]


def test_a_raising_abort_by_a_cancel_marker_still_resumes(clock: FakeClock) -> None:
    task = Failing("abort", 1)
    h = blocking(3, task, clock)
    feed(h, task, [barrier(0, 1), barrier(2, 1)])
    with pytest.raises(RuntimeError, match="injected: abort 1"):
        h.process(cancel(1, 1))
    assert _resumed(task) == [0, 2]
    assert h.state is AlignmentState.WAITING_FOR_FIRST_BARRIER


def test_a_raising_abort_of_a_subsumed_checkpoint_resumes_the_new_barrier_too(
    clock: FakeClock,
) -> None:
    """Barrier 2 subsumes alignment 1 and the abort of 1 raises: channel 0 (held for 1)
    and channel 1 (blocked by barrier 2, which now aligns nothing) both flow again; the
    rest of checkpoint 2 is obsolete here, checkpoint 3 aligns as usual."""
    task = Failing("abort", 1)
    h = blocking(2, task, clock)
    feed(h, task, [barrier(0, 1)])
    with pytest.raises(RuntimeError, match="injected: abort 1"):
        h.process(barrier(1, 2))
    assert _resumed(task) == [0, 1]
    task.clear()
    feed(h, task, [barrier(0, 2), barrier(0, 3), barrier(1, 3)])
    assert task.log == [("resume", 0), ("trigger", 3), ("resume", 0), ("resume", 1)]


def test_a_raising_abort_at_the_alignment_limit_releases_the_buffer(
    clock: FakeClock, pool: NetworkBufferPool
) -> None:
    task = Failing("abort", 1)
    h = blocking(2, task, clock, limit=3)
    feed(h, task, [barrier(0, 1)])
    with pytest.raises(RuntimeError, match="injected: abort 1"):
        h.process(data(1, b"abcd", pool))
    assert _resumed(task) == [0]
    h.close()  # the pool fixture checks the buffer came back


def test_a_raising_trigger_while_parking_still_replays_the_parked_input(
    clock: FakeClock,
) -> None:
    task = Failing("trigger", 1)
    h = AlignedBarrierHandler(
        2,
        task,
        clock,
        task.resume,
        strategy=AlignmentStrategy.PARKING,
        blocker=CachedBufferBlocker(),
    )
    feed(h, task, [barrier(0, 1), data(0, b"parked")])
    with pytest.raises(RuntimeError, match="injected: trigger 1"):
        h.process(barrier(1, 1))
    task.clear()
    drain(h, task)
    assert task.log == [("rec", 0, b"parked")]
