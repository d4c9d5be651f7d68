"""CheckpointBarrierTracker (at least once): the branches seed 004 lists, scripted."""

from __future__ import annotations

import pytest

from exchange.checkpointing import (
    MAX_CHECKPOINTS_TO_TRACK,
    CheckpointBarrierTracker,
    CheckpointFailureReason,
)
from exchange.errors import IllegalStateError, UsageError
from tests.checkpointing.conftest import FakeClock, Task, barrier, cancel, data, eop, feed

SUBSUMED = CheckpointFailureReason.SUBSUMED
CANCELLED = CheckpointFailureReason.CANCELLED


def tracker(n: int, task: Task, clock: FakeClock) -> CheckpointBarrierTracker:
    return CheckpointBarrierTracker(n, task, clock, task.resume)


def test_single_channel_triggers_on_every_new_barrier_between_the_records(
    task: Task, clock: FakeClock
) -> None:
    t = tracker(1, task, clock)
    feed(t, task, [data(0, b"a"), barrier(0, 1, False), data(0, b"b"), barrier(0, 2, False)])
    assert task.log == [("rec", 0, b"a"), ("trigger", 1), ("rec", 0, b"b"), ("trigger", 2)]
    task.clear()
    feed(t, task, [barrier(0, 2, False), barrier(0, 1, False)])  # not newer: ignored
    assert task.log == []


def test_single_channel_cancel_marker_aborts_at_once(task: Task, clock: FakeClock) -> None:
    t = tracker(1, task, clock)
    feed(t, task, [cancel(0, 3), barrier(0, 3, False), barrier(0, 4, False)])
    assert task.log == [("abort", 3, CANCELLED), ("trigger", 4)]


def test_two_channels_never_block_and_trigger_on_the_last_barrier(
    task: Task, clock: FakeClock
) -> None:
    t = tracker(2, task, clock)
    feed(
        t,
        task,
        [barrier(0, 1, False), data(0, b"post0"), data(1, b"pre1"), barrier(1, 1, False)],
    )
    assert task.log == [("rec", 0, b"post0"), ("rec", 1, b"pre1"), ("trigger", 1)]
    assert t.pending_checkpoint_ids == []


def test_completing_a_newer_checkpoint_subsumes_older_pending_ones(
    task: Task, clock: FakeClock
) -> None:
    t = tracker(3, task, clock)
    feed(t, task, [barrier(0, 1, False), barrier(0, 2, False), barrier(1, 1, False)])
    assert t.pending_checkpoint_ids == [1, 2]
    feed(t, task, [barrier(1, 2, False), barrier(2, 2, False)])
    assert task.callbacks() == [("abort", 1, SUBSUMED), ("trigger", 2)]
    task.clear()
    feed(t, task, [barrier(2, 1, False)])  # late barrier of a subsumed checkpoint: ignored
    assert task.log == [] and t.pending_checkpoint_ids == []


def test_at_most_fifty_pending_checkpoints(task: Task, clock: FakeClock) -> None:
    t = tracker(2, task, clock)
    feed(t, task, [barrier(0, i, False) for i in range(1, MAX_CHECKPOINTS_TO_TRACK + 2)])
    assert t.pending_checkpoint_ids == list(range(2, MAX_CHECKPOINTS_TO_TRACK + 2))
    assert task.log == [("abort", 1, SUBSUMED)]
    task.clear()
    feed(t, task, [barrier(1, 1, False)])  # dropped: can no longer trigger
    assert task.log == []


def test_cancel_marker_aborts_that_checkpoint_and_all_older_pending(
    task: Task, clock: FakeClock
) -> None:
    t = tracker(2, task, clock)
    feed(t, task, [barrier(0, 1, False), barrier(0, 2, False), barrier(0, 3, False)])
    feed(t, task, [cancel(1, 2)])
    assert task.callbacks() == [("abort", 1, SUBSUMED), ("abort", 2, CANCELLED)]
    assert t.pending_checkpoint_ids == [3]
    task.clear()
    # the aborted entry 2 left when every channel spoke; a second marker is a no-op
    feed(t, task, [cancel(1, 2), barrier(1, 3, False)])
    assert task.log == [("trigger", 3)]


def test_cancel_marker_of_a_pending_checkpoint_keeps_counting_its_barriers(
    task: Task, clock: FakeClock
) -> None:
    t = tracker(3, task, clock)
    feed(t, task, [barrier(0, 5, False), cancel(1, 5)])
    assert task.log == [("abort", 5, CANCELLED)]
    assert t.pending_checkpoint_ids == [5]
    feed(t, task, [barrier(2, 5, False)])  # all spoke: entry removed, no trigger
    assert t.pending_checkpoint_ids == []
    assert task.callbacks() == [("abort", 5, CANCELLED)]


def test_cancel_marker_of_a_new_checkpoint(task: Task, clock: FakeClock) -> None:
    t = tracker(2, task, clock)
    feed(t, task, [barrier(0, 1, False), cancel(0, 4)])
    assert task.log == [("abort", 1, SUBSUMED), ("abort", 4, CANCELLED)]
    assert t.pending_checkpoint_ids == [4]
    task.clear()
    feed(t, task, [barrier(1, 4, False), barrier(1, 3, False), cancel(1, 2)])
    assert task.log == [] and t.pending_checkpoint_ids == []


def test_end_of_partition_closes_a_channel_and_completes_pending(
    task: Task, clock: FakeClock
) -> None:
    t = tracker(3, task, clock)
    feed(t, task, [barrier(0, 1, False), barrier(1, 1, False), barrier(0, 2, False)])
    feed(t, task, [eop(2)])
    # 1 became complete (and so did nothing newer): 1 triggers, 2 stays pending
    assert task.log == [("trigger", 1), ("eop", 2)]
    assert t.num_open_channels == 2 and t.pending_checkpoint_ids == [2]
    task.clear()
    feed(t, task, [eop(1)])
    assert task.log == [("trigger", 2), ("eop", 1)]
    task.clear()
    feed(t, task, [barrier(0, 3, False)])  # one open channel left: the fast path
    assert task.log == [("trigger", 3)]


def test_end_of_partition_triggers_the_newest_complete_and_subsumes_older(
    task: Task, clock: FakeClock
) -> None:
    t = tracker(2, task, clock)
    feed(t, task, [barrier(0, 1, False), barrier(0, 2, False), eop(1)])
    assert task.log == [("abort", 1, SUBSUMED), ("trigger", 2), ("eop", 1)]


def test_aligned_type_barriers_are_resumed_at_once_and_duplicates_ignored(
    task: Task, clock: FakeClock
) -> None:
    t = tracker(2, task, clock)
    feed(t, task, [barrier(0, 1), data(1, b"x"), barrier(0, 1), barrier(1, 1)])
    assert task.log == [("resume", 0), ("rec", 1, b"x"), ("resume", 0), ("resume", 1),
                        ("trigger", 1)]  # fmt: skip
    assert t.num_resumed == 3


def test_alignment_time_and_bytes_by_the_injected_clock(task: Task, clock: FakeClock) -> None:
    t = tracker(2, task, clock)
    feed(t, task, [barrier(0, 1, False)])
    clock.advance(2.5)
    feed(t, task, [data(1, b"12345")])
    s = t.stats()
    assert s.aligning_checkpoint_id == 1 and s.current_alignment_duration == 2.5
    clock.advance(0.5)
    feed(t, task, [barrier(1, 1, False)])
    s = t.stats()
    assert (s.num_triggered, s.num_aborted, s.aligning_checkpoint_id) == (1, 0, None)
    assert s.last_alignment_duration == 3.0 and s.last_aligned_bytes == 5
    assert s.current_alignment_duration == 0.0 and s.buffered_bytes == 0


def test_misuse_is_refused(task: Task, clock: FakeClock) -> None:
    with pytest.raises(UsageError):
        CheckpointBarrierTracker(0, task, clock)
    t = tracker(2, task, clock)
    with pytest.raises(UsageError, match="channel index"):
        t.process(data(2, b"x"))
    no_resume = CheckpointBarrierTracker(2, task, clock)
    with pytest.raises(UsageError, match="resume"):
        no_resume.process(barrier(0, 1))
    t.close()
    with pytest.raises(IllegalStateError):
        t.process(eop(0))
    assert t.is_empty() and t.is_closed
