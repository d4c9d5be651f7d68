"""CheckpointCoordinator: scripted sequences on a fake clock, and a property over ack orders."""

from __future__ import annotations

from collections.abc import Iterable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from exchange.checkpointing import (
    AbortReason,
    CheckpointConfig,
    CheckpointCoordinator,
    CheckpointFailureReason,
    CheckpointState,
    Command,
    CompletedCheckpoint,
    CoordinatorState,
    DiscardCheckpoint,
    FailJob,
    FinalizeCheckpoint,
    NotifyAborted,
    NotifyComplete,
    PendingCheckpoint,
    TriggerCheckpoint,
)
from exchange.errors import ConfigError, IllegalStateError, UsageError

from .conftest import FakeClock

TASKS = ("src-0", "src-1", "map-0", "sink-0")
SOURCES = ("src-0", "src-1")


def make(
    clock: FakeClock,
    *,
    tasks: Iterable[str] = TASKS,
    restored: CompletedCheckpoint | None = None,
    start: bool = True,
    **config: object,
) -> CheckpointCoordinator:
    cfg = CheckpointConfig(**{"interval": 1.0, **config})  # type: ignore[arg-type]
    coord = CheckpointCoordinator(
        cfg,
        tasks,
        clock=clock,
        source_tasks=[t for t in tasks if t.startswith("src")] or None,
        restored=restored,
        wall_clock_ms=lambda: int(clock.now * 1000),
    )
    if start:
        coord.start()
    return coord


def tick(coord: CheckpointCoordinator) -> list[Command]:
    coord.tick()
    return coord.poll_commands()


def ack_all(
    coord: CheckpointCoordinator, checkpoint_id: int, tasks: Iterable[str] = TASKS
) -> list[Command]:
    for t in tasks:
        coord.acknowledge(t, checkpoint_id, f"{t}@{checkpoint_id}")
    return coord.poll_commands()


def complete(
    coord: CheckpointCoordinator, checkpoint_id: int, tasks: Iterable[str] = TASKS
) -> list[Command]:
    out = ack_all(coord, checkpoint_id, tasks)
    assert isinstance(out[-1], FinalizeCheckpoint) and out[-1].checkpoint_id == checkpoint_id
    coord.checkpoint_finalized(checkpoint_id)
    return out + coord.poll_commands()


# -- configuration ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("setting", "value"),
    [
        ("interval", 0),
        ("interval", -1.0),
        ("interval", float("nan")),
        ("interval", float("inf")),
        ("interval", True),
        ("timeout", 0),
        ("min_pause", -0.1),
        ("max_concurrent", 2),
        ("max_concurrent", 0),
        ("tolerable_failed_checkpoints", -1),
        ("tolerable_failed_checkpoints", 1.5),
        ("retained", 0),
        ("mode", "exactly-once"),
        ("mode", "none"),
    ],
)
def test_config_rejects_bad_values_naming_the_setting(setting: str, value: object) -> None:
    kwargs: dict[str, object] = {"interval": 1.0, setting: value}
    with pytest.raises(ConfigError) as err:
        CheckpointConfig(**kwargs)  # type: ignore[arg-type]
    assert err.value.setting == setting
    assert setting in str(err.value)


def test_config_defaults_are_flinks() -> None:
    cfg = CheckpointConfig(interval=1)
    assert (cfg.timeout, cfg.min_pause, cfg.max_concurrent) == (600.0, 0.0, 1)
    assert (cfg.tolerable_failed_checkpoints, cfg.retained, cfg.mode) == (0, 1, "exactly_once")
    assert cfg.exactly_once and not CheckpointConfig(1, mode="at_least_once").exactly_once


def test_max_concurrent_refusal_says_only_one_is_supported() -> None:
    with pytest.raises(ConfigError, match="only 1 concurrent checkpoint is supported"):
        CheckpointConfig(interval=1.0, max_concurrent=3)


def test_coordinator_rejects_bad_task_sets() -> None:
    clock = FakeClock()
    with pytest.raises(UsageError):
        CheckpointCoordinator(CheckpointConfig(1.0), [], clock=clock)
    with pytest.raises(UsageError):
        CheckpointCoordinator(CheckpointConfig(1.0), ["a"], clock=clock, source_tasks=["b"])


# -- the schedule -----------------------------------------------------------------------


def test_nothing_is_triggered_before_start_or_before_the_interval() -> None:
    clock = FakeClock()
    coord = make(clock, start=False)
    clock.advance(5)
    assert tick(coord) == []
    assert coord.next_deadline() is None
    coord.start()
    assert coord.next_deadline() == pytest.approx(clock.now + 1.0)
    clock.advance(0.999)
    assert tick(coord) == []
    clock.advance(0.001)
    [trigger] = tick(coord)
    assert trigger == TriggerCheckpoint(1, int(clock.now * 1000), SOURCES, exactly_once=True)
    assert coord.pending is not None and coord.pending.state is CheckpointState.PENDING


def test_interval_schedule_and_one_checkpoint_at_a_time() -> None:
    clock = FakeClock()
    coord = make(clock, interval=2.0)
    clock.advance(2)
    assert [c.checkpoint_id for c in tick(coord) if isinstance(c, TriggerCheckpoint)] == [1]
    clock.advance(5)  # overdue, but checkpoint 1 is still pending: no second one
    assert tick(coord) == []
    out = complete(coord, 1)
    assert [type(c) for c in out] == [FinalizeCheckpoint, NotifyComplete]
    # due at last trigger + interval, which has passed: fires at once
    [trigger] = tick(coord)
    assert isinstance(trigger, TriggerCheckpoint) and trigger.checkpoint_id == 2
    complete(coord, 2)
    clock.advance(1.5)
    assert tick(coord) == []
    clock.advance(0.5)
    assert [type(c) for c in tick(coord)] == [TriggerCheckpoint]


def test_min_pause_counts_from_the_end_of_the_previous_checkpoint() -> None:
    clock = FakeClock()
    coord = make(clock, interval=1.0, min_pause=3.0)
    clock.advance(1)
    tick(coord)
    clock.advance(2.5)  # checkpoint 1 takes 2.5 s
    complete(coord, 1)
    end = clock.now
    assert coord.next_deadline() == pytest.approx(end + 3.0)
    clock.advance(2.9)
    assert tick(coord) == []
    clock.advance(0.1)
    [trigger] = tick(coord)
    assert isinstance(trigger, TriggerCheckpoint) and trigger.checkpoint_id == 2


def test_at_least_once_mode_is_in_the_trigger() -> None:
    clock = FakeClock()
    coord = make(clock, mode="at_least_once")
    clock.advance(1)
    [trigger] = tick(coord)
    assert isinstance(trigger, TriggerCheckpoint) and not trigger.exactly_once


# -- completion, acks -------------------------------------------------------------------


def test_completion_needs_every_ack_then_the_metadata() -> None:
    clock = FakeClock()
    coord = make(clock)
    clock.advance(1)
    tick(coord)
    for t in TASKS[:-1]:
        coord.acknowledge(t, 1, f"h-{t}")
    assert coord.poll_commands() == []
    coord.acknowledge("sink-0", 1, "h-sink-0")
    [fin] = coord.poll_commands()
    assert isinstance(fin, FinalizeCheckpoint)
    assert fin.handles == {t: f"h-{t}" for t in TASKS}
    assert coord.pending is not None and coord.pending.state is CheckpointState.FINALIZING
    assert coord.latest_completed is None  # not before the metadata is durable
    clock.advance(10_000)  # no timeout while finalizing: the metadata may be written
    assert tick(coord) == []
    coord.checkpoint_finalized(1)
    assert coord.poll_commands() == [NotifyComplete(1)]
    assert coord.latest_completed == CompletedCheckpoint(1, fin.timestamp, fin.handles)
    assert coord.history[-1].state is CheckpointState.COMPLETED
    assert coord.stats().completed == 1


def test_duplicate_ack_is_ignored_and_counted_and_its_handle_kept() -> None:
    clock = FakeClock()
    coord = make(clock)
    clock.advance(1)
    tick(coord)
    coord.acknowledge("src-0", 1, "first")
    coord.acknowledge("src-0", 1, "second")
    assert coord.poll_commands() == []
    assert coord.stats().duplicate_acks == 1
    out = ack_all(coord, 1, TASKS[1:])
    assert isinstance(out[-1], FinalizeCheckpoint) and out[-1].handles["src-0"] == "first"
    coord.acknowledge("src-0", 1, "third")  # while finalizing
    coord.checkpoint_finalized(1)
    coord.poll_commands()
    coord.acknowledge("map-0", 1, "fourth")  # after completion
    assert coord.poll_commands() == []
    assert coord.stats().duplicate_acks == 3


def test_unknown_checkpoints_and_tasks_are_ignored_and_counted() -> None:
    clock = FakeClock()
    coord = make(clock)
    coord.acknowledge("src-0", 7, "h")  # never triggered
    coord.decline("src-0", 7)
    clock.advance(1)
    tick(coord)
    coord.acknowledge("stranger", 1, "h")
    coord.decline("stranger", 1)
    assert coord.poll_commands() == []
    assert coord.stats().unknown_messages == 4
    assert coord.pending is not None and coord.pending.state is CheckpointState.PENDING


def test_finalization_calls_out_of_turn_are_usage_errors() -> None:
    clock = FakeClock()
    coord = make(clock)
    with pytest.raises(IllegalStateError):
        coord.checkpoint_finalized(1)
    clock.advance(1)
    tick(coord)
    with pytest.raises(IllegalStateError):
        coord.checkpoint_finalized(1)  # still pending acks
    with pytest.raises(IllegalStateError):
        coord.finalize_failed(1)


def test_transition_table_refuses_illegal_moves() -> None:
    p = PendingCheckpoint(1, 0, 0.0, frozenset({"a"}), frozenset(), False)
    with pytest.raises(IllegalStateError):
        p.move_to(CheckpointState.COMPLETED)  # PENDING -> COMPLETED skips finalization
    p.move_to(CheckpointState.ABORTED)
    for state in CheckpointState:
        with pytest.raises(IllegalStateError):
            p.move_to(state)


# -- aborts -----------------------------------------------------------------------------


def test_timeout_aborts_and_late_acks_are_discarded() -> None:
    clock = FakeClock()
    coord = make(clock, timeout=5.0, tolerable_failed_checkpoints=5)
    clock.advance(1)
    tick(coord)
    coord.acknowledge("src-0", 1, "h-src-0")
    assert coord.next_deadline() == pytest.approx(clock.now + 5.0)
    clock.advance(4.999)
    assert tick(coord) == []
    clock.advance(0.001)
    out = tick(coord)
    assert out[0] == NotifyAborted(1, AbortReason.EXPIRED, "after 5 s")
    assert out[1] == DiscardCheckpoint(1, {"src-0": "h-src-0"})
    assert coord.stats().consecutive_failures == 1
    # the interval has long passed: the next checkpoint comes in the same tick
    assert [type(c) for c in out[2:]] == [TriggerCheckpoint]
    assert out[2].checkpoint_id == 2
    coord.acknowledge("src-1", 1, "late")
    assert coord.poll_commands() == [
        DiscardCheckpoint(1, {"src-1": "late"}, whole_checkpoint=False)
    ]
    coord.decline("src-1", 1)
    assert coord.poll_commands() == []
    assert coord.stats().late_messages == 2
    assert coord.pending is not None and coord.pending.checkpoint_id == 2


def test_decline_aborts_and_the_next_checkpoint_follows_the_schedule() -> None:
    clock = FakeClock()
    coord = make(clock, tolerable_failed_checkpoints=1)
    clock.advance(1)
    tick(coord)
    coord.acknowledge("src-0", 1, "h0")
    coord.decline("map-0", 1, CheckpointFailureReason.DECLINED, "snapshot failed: disk full")
    out = coord.poll_commands()
    assert out[0] == NotifyAborted(
        1, AbortReason.DECLINED, "task map-0: declined by the task: snapshot failed: disk full"
    )
    assert out[1] == DiscardCheckpoint(1, {"src-0": "h0"})
    assert coord.history[-1].state is CheckpointState.ABORTED
    assert coord.history[-1].reason is AbortReason.DECLINED
    clock.advance(0.5)
    assert tick(coord) == []
    clock.advance(0.5)
    [trigger] = tick(coord)
    assert isinstance(trigger, TriggerCheckpoint) and trigger.checkpoint_id == 2


@pytest.mark.parametrize(
    "reason",
    [
        CheckpointFailureReason.SUBSUMED,
        CheckpointFailureReason.CANCELLED,
        CheckpointFailureReason.ALIGNMENT_LIMIT,
        CheckpointFailureReason.END_OF_INPUT,
        CheckpointFailureReason.TIMEOUT,
    ],
)
def test_declines_that_are_not_failures_never_fail_the_job(reason: CheckpointFailureReason) -> None:
    clock = FakeClock()
    coord = make(clock)  # tolerable 0
    for n in range(1, 6):
        clock.advance(1)
        [trigger] = tick(coord)
        assert isinstance(trigger, TriggerCheckpoint) and trigger.checkpoint_id == n
        coord.decline("sink-0", n, reason)
        out = coord.poll_commands()
        assert not any(isinstance(c, FailJob) for c in out)
    assert coord.stats().consecutive_failures == 0
    assert coord.state is CoordinatorState.RUNNING


def test_tolerable_failures_then_fail_job_and_a_success_resets_the_count() -> None:
    clock = FakeClock()
    coord = make(clock, tolerable_failed_checkpoints=2)
    for n in (1, 2):
        clock.advance(1)
        tick(coord)
        coord.decline("src-0", n)
    assert coord.stats().consecutive_failures == 2
    clock.advance(1)
    tick(coord)
    complete(coord, 3)  # resets
    assert coord.stats().consecutive_failures == 0
    for n in (4, 5):
        clock.advance(1)
        tick(coord)
        coord.decline("src-0", n)
        assert not any(isinstance(c, FailJob) for c in coord.poll_commands())
    clock.advance(1)
    tick(coord)
    coord.decline("src-1", 6, message="boom")
    out = coord.poll_commands()
    fail = out[-1]
    assert isinstance(fail, FailJob) and fail.checkpoint_id == 6
    assert "3 consecutive failed checkpoints, tolerable 2" in fail.reason and "boom" in fail.reason
    assert coord.state is CoordinatorState.IDLE
    clock.advance(100)
    assert tick(coord) == []  # nothing triggered until the job restarts


def test_zero_tolerable_failures_fail_on_the_first_expiry() -> None:
    clock = FakeClock()
    coord = make(clock, timeout=2.0)
    clock.advance(1)
    tick(coord)
    clock.advance(2)
    out = tick(coord)
    assert [type(c) for c in out] == [NotifyAborted, DiscardCheckpoint, FailJob]
    assert coord.state is CoordinatorState.IDLE


def test_finalize_failure_aborts_and_counts() -> None:
    clock = FakeClock()
    coord = make(clock, tolerable_failed_checkpoints=1)
    clock.advance(1)
    tick(coord)
    ack_all(coord, 1)
    coord.finalize_failed(1, "write failed")
    out = coord.poll_commands()
    assert out[0] == NotifyAborted(1, AbortReason.FINALIZE_FAILED, "write failed")
    assert out[1] == DiscardCheckpoint(1, {t: f"{t}@1" for t in TASKS})
    assert coord.stats().consecutive_failures == 1
    assert coord.latest_completed is None


# -- retention (subsumption) ------------------------------------------------------------


def test_completed_checkpoints_beyond_retained_are_discarded_after_the_new_one() -> None:
    clock = FakeClock()
    coord = make(clock, retained=2)
    for n in (1, 2):
        clock.advance(1)
        tick(coord)
        out = complete(coord, n)
        assert not any(isinstance(c, DiscardCheckpoint) for c in out)
    clock.advance(1)
    tick(coord)
    out = complete(coord, 3)
    assert out[-2:] == [NotifyComplete(3), DiscardCheckpoint(1, {t: f"{t}@1" for t in TASKS})]
    assert [c.checkpoint_id for c in coord.retained] == [2, 3]


# -- finished tasks and the final checkpoint --------------------------------------------


def test_finished_tasks_are_not_asked_and_are_recorded() -> None:
    clock = FakeClock()
    coord = make(clock)
    coord.task_finished("src-1")
    coord.task_finished("src-1")  # idempotent
    with pytest.raises(UsageError):
        coord.task_finished("nobody")
    clock.advance(1)
    [trigger] = tick(coord)
    assert isinstance(trigger, TriggerCheckpoint) and trigger.tasks == ("src-0",)
    live = [t for t in TASKS if t != "src-1"]
    out = ack_all(coord, 1, live)
    fin = out[-1]
    assert isinstance(fin, FinalizeCheckpoint) and fin.finished_tasks == {"src-1"}
    coord.checkpoint_finalized(1)
    assert coord.latest_completed is not None
    assert coord.latest_completed.finished_tasks == {"src-1"}


def test_a_task_finishing_before_its_ack_aborts_without_counting() -> None:
    clock = FakeClock()
    coord = make(clock)
    clock.advance(1)
    tick(coord)
    coord.acknowledge("src-0", 1, "h")
    coord.task_finished("src-0")  # acked already: no effect
    assert coord.poll_commands() == []
    coord.task_finished("src-1")
    out = coord.poll_commands()
    assert out[0] == NotifyAborted(1, AbortReason.TASK_FINISHED, "task src-1")
    assert coord.stats().consecutive_failures == 0
    # with every source finished, the running tasks are triggered directly
    clock.advance(1)
    [trigger] = tick(coord)
    assert isinstance(trigger, TriggerCheckpoint) and trigger.tasks == ("map-0", "sink-0")


def test_no_checkpoint_once_every_task_finished() -> None:
    clock = FakeClock()
    coord = make(clock)
    for t in TASKS:
        coord.task_finished(t)
    clock.advance(10)
    assert tick(coord) == [] and coord.next_deadline() is None


def test_final_checkpoint_ignores_the_interval_then_finishes() -> None:
    clock = FakeClock()
    coord = make(clock, interval=60.0, min_pause=0.5)
    clock.advance(60)
    tick(coord)
    coord.request_final_checkpoint()
    clock.advance(0.1)
    assert tick(coord) == []  # the pending regular checkpoint is not the final one
    complete(coord, 1)
    clock.advance(0.4)
    assert tick(coord) == []  # min pause still applies
    clock.advance(0.1)
    [trigger] = tick(coord)
    assert isinstance(trigger, TriggerCheckpoint) and trigger.is_final
    assert trigger.checkpoint_id == 2
    out = complete(coord, 2)
    assert NotifyComplete(2, is_final=True) in out
    assert coord.state is CoordinatorState.FINISHED
    clock.advance(1000)
    assert tick(coord) == []


def test_a_failed_final_checkpoint_is_retried() -> None:
    clock = FakeClock()
    coord = make(clock, tolerable_failed_checkpoints=3)
    coord.request_final_checkpoint()
    [trigger] = tick(coord)  # due at once
    assert isinstance(trigger, TriggerCheckpoint) and trigger.is_final
    coord.decline("sink-0", 1)
    coord.poll_commands()
    [retry] = tick(coord)
    assert isinstance(retry, TriggerCheckpoint) and retry.is_final and retry.checkpoint_id == 2
    complete(coord, 2)
    assert coord.state is CoordinatorState.FINISHED


# -- restore, restart, shutdown ---------------------------------------------------------


def test_ids_continue_after_a_restore() -> None:
    clock = FakeClock()
    restored = CompletedCheckpoint(41, 123, {"src-0": "old"})
    coord = make(clock, restored=restored)
    assert coord.latest_completed == restored and coord.next_checkpoint_id == 42
    coord.acknowledge("src-0", 41, "x")  # the restored one: not ours to complete
    coord.acknowledge("src-0", 12, "x")  # older than the restore
    assert coord.poll_commands() == []
    clock.advance(1)
    [trigger] = tick(coord)
    assert isinstance(trigger, TriggerCheckpoint) and trigger.checkpoint_id == 42
    out = complete(coord, 42)
    # retained = 1: the restored checkpoint is subsumed by the first new one
    assert out[-1] == DiscardCheckpoint(41, {"src-0": "old"})


def test_ids_an_earlier_attempt_used_are_never_handed_out_again() -> None:
    """The restored checkpoint is 41 but a failed attempt triggered up to 44 (its tasks
    may still write state under those ids): the next attempt starts at 45."""
    clock = FakeClock()
    restored = CompletedCheckpoint(41, 123, {"src-0": "old"})
    cfg = CheckpointConfig(interval=1.0)
    coord = CheckpointCoordinator(
        cfg, TASKS, clock=clock, restored=restored, first_checkpoint_id=45
    )
    coord.start()
    assert coord.latest_completed == restored and coord.next_checkpoint_id == 45
    coord.acknowledge("src-0", 43, "zombie")  # the failed attempt's id: unknown here
    assert coord.poll_commands() == [] and coord.stats().unknown_messages == 1
    clock.advance(1)
    [trigger] = tick(coord)
    assert isinstance(trigger, TriggerCheckpoint) and trigger.checkpoint_id == 45
    # a floor below the restore changes nothing
    low = CheckpointCoordinator(cfg, TASKS, clock=clock, restored=restored, first_checkpoint_id=3)
    assert low.next_checkpoint_id == 42
    with pytest.raises(UsageError):
        CheckpointCoordinator(cfg, TASKS, clock=clock, first_checkpoint_id=0)


def test_restart_aborts_pending_and_ids_keep_increasing() -> None:
    clock = FakeClock()
    coord = make(clock)
    clock.advance(1)
    tick(coord)
    complete(coord, 1)
    clock.advance(1)
    tick(coord)
    coord.acknowledge("src-0", 2, "h")
    coord.task_finished("src-1")
    coord.poll_commands()
    clock.advance(1)
    tick(coord)  # checkpoint 3 pending
    latest = coord.restart()
    assert latest is not None and latest.checkpoint_id == 1
    out = coord.poll_commands()
    assert out[0] == NotifyAborted(3, AbortReason.JOB_FAILOVER, "")
    assert coord.state is CoordinatorState.IDLE and coord.running_tasks == set(TASKS)
    clock.advance(10)
    assert tick(coord) == []
    coord.start()
    clock.advance(1)
    [trigger] = tick(coord)
    assert isinstance(trigger, TriggerCheckpoint) and trigger.checkpoint_id == 4
    assert trigger.tasks == SOURCES


def test_shutdown_aborts_pending_and_refuses_more() -> None:
    clock = FakeClock()
    coord = make(clock)
    clock.advance(1)
    tick(coord)
    coord.shutdown()
    coord.shutdown()
    assert coord.poll_commands()[0] == NotifyAborted(1, AbortReason.COORDINATOR_SHUTDOWN, "")
    assert coord.stats().consecutive_failures == 0
    clock.advance(5)
    assert tick(coord) == []
    with pytest.raises(IllegalStateError):
        coord.start()
    with pytest.raises(IllegalStateError):
        coord.request_final_checkpoint()
    with pytest.raises(IllegalStateError):
        coord.restart()


# -- property: acks in any order complete exactly once ------------------------------------

_TASK_SET = [f"t{i}" for i in range(6)]
_noise = st.tuples(
    st.sampled_from(["dup", "future", "stranger", "tick"]),
    st.sampled_from(_TASK_SET),
    st.integers(min_value=0, max_value=6),
)


@settings(max_examples=200, deadline=None)
@given(order=st.permutations(_TASK_SET), noise=st.lists(_noise, max_size=20))
def test_acks_in_any_order_complete_exactly_once(
    order: list[str], noise: list[tuple[str, str, int]]
) -> None:
    clock = FakeClock()
    coord = CheckpointCoordinator(CheckpointConfig(1.0), _TASK_SET, clock=clock)
    coord.start()
    clock.advance(1)
    coord.tick()
    [trigger] = coord.poll_commands()
    assert isinstance(trigger, TriggerCheckpoint)
    cid = trigger.checkpoint_id
    script: list[tuple[str, str]] = [("ack", t) for t in order]
    for kind, task, pos in noise:  # interleave duplicates, strangers, ticks anywhere
        script.insert(min(pos, len(script)), (kind, task))
    acked: set[str] = set()
    commands: list[Command] = []
    for kind, task in script:
        if kind == "ack":
            acked.add(task)
            coord.acknowledge(task, cid, f"h-{task}")
        elif kind == "dup" and task in acked:  # a duplicate needs a first ack before it
            coord.acknowledge(task, cid, "again")
        elif kind == "future":
            coord.acknowledge(task, cid + 5, "future")
        elif kind == "stranger":
            coord.acknowledge("stranger", cid, "x")
        elif kind == "tick":
            clock.advance(0.1)
            coord.tick()
        commands += coord.poll_commands()
    finals = [c for c in commands if isinstance(c, FinalizeCheckpoint)]
    assert len(finals) == 1
    assert finals[0].handles == {t: f"h-{t}" for t in _TASK_SET}
    assert commands == finals  # nothing triggered, aborted or discarded meanwhile
    coord.checkpoint_finalized(cid)
    for t in _TASK_SET:  # every ack again after completion changes nothing
        coord.acknowledge(t, cid, "after")
    assert coord.poll_commands() == [NotifyComplete(cid)]
    assert coord.stats().completed == 1
