"""CheckpointCoordinator: the driver's checkpoint logic (Flink's JobManager role), sans I/O.

The coordinator is a plain object: the driver's I/O layer feeds it what happens
(``tick``, ``acknowledge``, ``decline``, ``task_finished``, ``checkpoint_finalized``, ...)
and executes the commands it queues (``poll_commands``). It never sleeps, starts no
thread and touches no file; time comes from an injected clock. Usage::

    coord = CheckpointCoordinator(CheckpointConfig(interval=1.0), tasks, clock=time.monotonic,
                                  source_tasks=sources, restored=latest)
    coord.start()                              # all tasks of the attempt are running
    while running:
        coord.tick()
        for cmd in coord.poll_commands():
            match cmd:
                case TriggerCheckpoint(): ...  # tell cmd.tasks to inject barrier cmd.checkpoint_id
                case FinalizeCheckpoint(): ... # write the metadata; then checkpoint_finalized(id)
                case NotifyComplete(): ...     # every task hears it; sinks commit
                case NotifyAborted(): ...      # every task hears it
                case DiscardCheckpoint(): ...  # delete what the handles point to
                case FailJob(): ...            # fail the attempt; then restart() and start()
        wait_for_messages(timeout=coord.next_deadline() - now)

A checkpoint's life is one table (``_TRANSITIONS``): PENDING (waiting for acks) →
FINALIZING (all acked; the driver writes the metadata, the commit point) → COMPLETED, or
PENDING/FINALIZING → ABORTED (declined, expired, a task finished, failover, shutdown, or
the metadata could not be written). NotifyComplete is only queued once the metadata is
durable, so a sink never commits for a checkpoint that a restore would not see.

Decisions, with Flink's behaviour where it has one:

* **At most one concurrent checkpoint** (``max_concurrent`` other than 1 is refused).
* **Schedule**: the next checkpoint is due at ``max(last trigger + interval, end of the
  previous checkpoint + min_pause)``; the first one an ``interval`` after ``start()``.
  A requested final checkpoint is due at ``end of the previous + min_pause``.
* **Timeout** (``CHECKPOINT_EXPIRED``): a PENDING checkpoint older than ``timeout`` is
  aborted at the next ``tick``. A FINALIZING one is not: its metadata may already be
  written, so only the driver can say whether it completed.
* **Late and unknown messages** are peer input and never raise: an ack for an aborted
  checkpoint is counted and its handle discarded (Flink discards late subtask state); an
  ack or decline for a checkpoint id never triggered, or from a task not in the job, is
  counted and ignored. A **duplicate ack** (same task, same checkpoint) is counted and
  ignored, and its handle is *not* discarded (it may be the very state the first ack
  named).
* **Tolerable failures** (``CheckpointFailureManager``): only expiry, a task's own
  decline (``CheckpointFailureReason.DECLINED``) and a failed finalization count;
  subsumption, cancellation markers, alignment limits, end of input, a finished task and
  failover do not. Each checkpoint counts once (ABORTED is final in the table), and only
  if newer than the last completed one; a completed checkpoint resets the count. More
  than ``tolerable_failed_checkpoints`` consecutive failures queue FailJob.
* **Ids** strictly increase and are never reused, aborted or not; after a restore they
  continue from the restored checkpoint's id + 1, or from ``first_checkpoint_id`` when
  that is higher (the driver passes the next id no earlier attempt used: the failed
  attempt's tasks may still write state under its ids).
* **Finished tasks** (bounded inputs, FLIP-147) are not asked for later checkpoints; each
  completed checkpoint records which tasks had finished before it was triggered. A task
  that finishes while a checkpoint still waits for its ack aborts it (not counted).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import Final, NamedTuple

from exchange.checkpointing.barrier_handler import (
    CheckpointFailureReason,
    CheckpointingMode,
    Clock,
)
from exchange.errors import ConfigError, IllegalStateError, UsageError

__all__ = [
    "AbortReason",
    "CheckpointConfig",
    "CheckpointCoordinator",
    "CheckpointState",
    "CheckpointStatus",
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
    "TriggerCheckpoint",
]

#: Handles are opaque to the coordinator (a path, a URL, a small dict): it only stores
#: them, hands them to FinalizeCheckpoint and gives them back in DiscardCheckpoint.
Handle = object

#: Flink's default checkpoint timeout: 10 minutes.
DEFAULT_TIMEOUT: Final = 600.0
#: Checkpoint statuses kept for ``history`` (the dashboard's checkpoint table).
HISTORY_SIZE: Final = 64

_MODES: Final = tuple(m.value for m in CheckpointingMode)


# -- configuration ------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class CheckpointConfig:
    """Checkpointing settings (Flink's ``CheckpointCoordinatorConfiguration``); seconds."""

    interval: float
    timeout: float = DEFAULT_TIMEOUT
    min_pause: float = 0.0
    max_concurrent: int = 1
    tolerable_failed_checkpoints: int = 0
    retained: int = 1
    #: exactly_once (aligned), unaligned (exactly once, in-flight input persisted) or
    #: at_least_once
    mode: str = "exactly_once"
    #: unaligned only: each checkpoint starts aligned and turns unaligned once its
    #: alignment took this long (Flink's ``aligned-checkpoint-timeout``); None or 0:
    #: unaligned from the first barrier
    aligned_checkpoint_timeout: float | None = None

    def __post_init__(self) -> None:
        if not _positive(self.interval):
            raise ConfigError("interval", f"must be a number > 0 seconds, got {self.interval!r}")
        if not _positive(self.timeout):
            raise ConfigError("timeout", f"must be a number > 0 seconds, got {self.timeout!r}")
        if not _number(self.min_pause) or self.min_pause < 0:
            raise ConfigError("min_pause", f"must be a number >= 0 seconds, got {self.min_pause!r}")
        if self.max_concurrent != 1 or type(self.max_concurrent) is not int:
            raise ConfigError(
                "max_concurrent",
                f"only 1 concurrent checkpoint is supported, got {self.max_concurrent!r}",
            )
        if (
            type(self.tolerable_failed_checkpoints) is not int
            or self.tolerable_failed_checkpoints < 0
        ):
            raise ConfigError(
                "tolerable_failed_checkpoints",
                f"must be an int >= 0, got {self.tolerable_failed_checkpoints!r}",
            )
        if type(self.retained) is not int or self.retained < 1:
            raise ConfigError("retained", f"must be an int >= 1, got {self.retained!r}")
        if self.mode not in _MODES:
            raise ConfigError("mode", f"must be one of {', '.join(_MODES)}, got {self.mode!r}")
        t = self.aligned_checkpoint_timeout
        if t is not None:
            if self.mode != "unaligned":
                raise ConfigError(
                    "aligned_checkpoint_timeout",
                    f"applies to mode unaligned only (a checkpoint that starts aligned and "
                    f"turns unaligned), not to {self.mode}",
                )
            if not _number(t) or not 0 <= t < float("inf"):
                raise ConfigError(
                    "aligned_checkpoint_timeout", f"must be a number >= 0 seconds, got {t!r}"
                )

    @property
    def exactly_once(self) -> bool:
        """Exactly once: aligned, or unaligned (barriers still block upstream at first)."""
        return self.mode in ("exactly_once", "unaligned")

    @property
    def unaligned(self) -> bool:
        return self.mode == "unaligned"


def _number(value: object) -> bool:
    return type(value) in (int, float) and value == value  # not bool, not NaN


def _positive(value: object) -> bool:
    return _number(value) and 0 < value < float("inf")  # type: ignore[operator]


# -- commands (the output) ----------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class TriggerCheckpoint:
    """Tell ``tasks`` (the running sources) to take checkpoint ``checkpoint_id``."""

    checkpoint_id: int
    timestamp: int  # wall-clock milliseconds, the barrier's timestamp
    tasks: tuple[str, ...]
    exactly_once: bool = True
    is_final: bool = False


@dataclass(frozen=True, slots=True)
class FinalizeCheckpoint:
    """Every task acknowledged: write the checkpoint's metadata (the commit point), then
    call ``checkpoint_finalized`` (or ``finalize_failed``)."""

    checkpoint_id: int
    timestamp: int
    handles: Mapping[str, Handle]
    finished_tasks: frozenset[str]
    is_final: bool


@dataclass(frozen=True, slots=True)
class NotifyComplete:
    """Checkpoint ``checkpoint_id`` is complete: tell every running task (sinks commit)."""

    checkpoint_id: int
    is_final: bool = False


@dataclass(frozen=True, slots=True)
class NotifyAborted:
    """Checkpoint ``checkpoint_id`` was aborted: tell every running task."""

    checkpoint_id: int
    reason: AbortReason
    detail: str = ""


@dataclass(frozen=True, slots=True)
class DiscardCheckpoint:
    """Delete what ``handles`` point to (a subsumed or aborted checkpoint, a late ack)."""

    checkpoint_id: int
    handles: Mapping[str, Handle]
    whole_checkpoint: bool = True  # False: only these handles (a late ack), not the directory


@dataclass(frozen=True, slots=True)
class FailJob:
    """Too many consecutive checkpoint failures: fail this attempt of the job."""

    reason: str
    checkpoint_id: int


Command = (
    TriggerCheckpoint
    | FinalizeCheckpoint
    | NotifyComplete
    | NotifyAborted
    | DiscardCheckpoint
    | FailJob
)


# -- checkpoints ------------------------------------------------------------------------


class AbortReason(Enum):
    """Why the coordinator aborted a checkpoint (Flink's ``CheckpointFailureReason``)."""

    DECLINED = "a task declined the checkpoint"
    EXPIRED = "the checkpoint expired before every task acknowledged"
    TASK_FINISHED = "a task finished before acknowledging"
    FINALIZE_FAILED = "the checkpoint's metadata could not be written"
    JOB_FAILOVER = "the job is failing over"
    COORDINATOR_SHUTDOWN = "the checkpoint coordinator shut down"


#: Task-side decline reasons that count against ``tolerable_failed_checkpoints``.
_COUNTED_DECLINES: Final = frozenset({CheckpointFailureReason.DECLINED})
#: Coordinator-side abort reasons that count (DECLINED depends on the task's reason).
_COUNTED_ABORTS: Final = frozenset({AbortReason.EXPIRED, AbortReason.FINALIZE_FAILED})


class CheckpointState(Enum):
    PENDING = "pending"
    FINALIZING = "finalizing"
    COMPLETED = "completed"
    ABORTED = "aborted"


#: Every legal move of a checkpoint; anything else raises IllegalStateError.
_TRANSITIONS: Final[Mapping[CheckpointState, frozenset[CheckpointState]]] = {
    CheckpointState.PENDING: frozenset({CheckpointState.FINALIZING, CheckpointState.ABORTED}),
    CheckpointState.FINALIZING: frozenset({CheckpointState.COMPLETED, CheckpointState.ABORTED}),
    CheckpointState.COMPLETED: frozenset(),
    CheckpointState.ABORTED: frozenset(),
}


@dataclass(slots=True)
class PendingCheckpoint:
    """A triggered checkpoint waiting for its acknowledgements (Flink's name)."""

    checkpoint_id: int
    timestamp: int
    trigger_time: float
    tasks_to_ack: frozenset[str]
    finished_tasks: frozenset[str]
    is_final: bool
    handles: dict[str, Handle] = field(default_factory=dict)
    state: CheckpointState = CheckpointState.PENDING

    @property
    def not_yet_acknowledged(self) -> frozenset[str]:
        return self.tasks_to_ack - self.handles.keys()

    @property
    def fully_acknowledged(self) -> bool:
        return len(self.handles) == len(self.tasks_to_ack)

    def move_to(self, new: CheckpointState) -> None:
        if new not in _TRANSITIONS[self.state]:
            raise IllegalStateError(
                f"checkpoint {self.checkpoint_id}: {self.state.value} -> {new.value} is not allowed"
            )
        self.state = new


@dataclass(frozen=True, slots=True)
class CompletedCheckpoint:
    """A checkpoint whose metadata is durable; what a restore starts from."""

    checkpoint_id: int
    timestamp: int
    handles: Mapping[str, Handle]
    finished_tasks: frozenset[str] = frozenset()
    is_final: bool = False


class CheckpointStatus(NamedTuple):
    """One row of the checkpoint history."""

    checkpoint_id: int
    state: CheckpointState
    trigger_time: float
    end_time: float | None
    num_acknowledged: int
    num_tasks: int
    reason: AbortReason | None
    is_final: bool

    @property
    def duration(self) -> float | None:
        return None if self.end_time is None else self.end_time - self.trigger_time


class CoordinatorStats(NamedTuple):
    """Plain counters, ready to export as metrics."""

    triggered: int
    completed: int
    aborted: int
    consecutive_failures: int
    late_messages: int
    duplicate_acks: int
    unknown_messages: int
    latest_completed_id: int | None


class CoordinatorState(Enum):
    IDLE = "idle"  # created or restarting: no checkpoint is triggered
    RUNNING = "running"
    FINISHED = "finished"  # the final checkpoint completed
    SHUT_DOWN = "shut_down"


_COORDINATOR_TRANSITIONS: Final[Mapping[CoordinatorState, frozenset[CoordinatorState]]] = {
    CoordinatorState.IDLE: frozenset({CoordinatorState.RUNNING, CoordinatorState.SHUT_DOWN}),
    CoordinatorState.RUNNING: frozenset(
        {CoordinatorState.IDLE, CoordinatorState.FINISHED, CoordinatorState.SHUT_DOWN}
    ),
    CoordinatorState.FINISHED: frozenset({CoordinatorState.IDLE, CoordinatorState.SHUT_DOWN}),
    CoordinatorState.SHUT_DOWN: frozenset(),
}


# -- the coordinator ----------------------------------------------------------------------


def _wall_clock_ms() -> int:
    return time.time_ns() // 1_000_000


class CheckpointCoordinator:
    """Triggers, completes and aborts checkpoints of one job; see the module docstring."""

    def __init__(
        self,
        config: CheckpointConfig,
        tasks: Iterable[str],
        *,
        clock: Clock,
        source_tasks: Iterable[str] | None = None,
        restored: CompletedCheckpoint | None = None,
        first_checkpoint_id: int = 1,
        wall_clock_ms: Callable[[], int] = _wall_clock_ms,
    ) -> None:
        if type(first_checkpoint_id) is not int or first_checkpoint_id < 1:
            raise UsageError(
                f"first_checkpoint_id must be an int >= 1, got {first_checkpoint_id!r}"
            )
        self._config = config
        self._tasks: frozenset[str] = frozenset(tasks)
        if not self._tasks:
            raise UsageError("a checkpoint coordinator needs at least one task")
        self._sources: frozenset[str] = (
            self._tasks if source_tasks is None else frozenset(source_tasks)
        )
        if not self._sources or not self._sources <= self._tasks:
            raise UsageError(
                f"source tasks {sorted(self._sources)} must be a non-empty subset of the tasks"
            )
        self._clock = clock
        self._wall_clock_ms = wall_clock_ms
        self._state = CoordinatorState.IDLE
        self._commands: deque[Command] = deque()
        self._pending: PendingCheckpoint | None = None
        self._completed: deque[CompletedCheckpoint] = deque()
        self._aborted_ids: set[int] = set()  # to tell late messages from unknown ones
        self._finished: set[str] = set()
        self._next_id = 1
        self._first_id = 1
        self._last_trigger: float | None = None
        self._last_end: float | None = None
        self._started_at = 0.0
        self._final_requested = False
        # CheckpointFailureManager
        self._consecutive_failures = 0
        self._last_success_id = -1
        # statistics
        self._triggered = 0
        self._num_completed = 0
        self._num_aborted = 0
        self._late = 0
        self._duplicates = 0
        self._unknown = 0
        self._history: deque[CheckpointStatus] = deque(maxlen=HISTORY_SIZE)
        if restored is not None:
            self._completed.append(restored)
            self._next_id = self._first_id = restored.checkpoint_id + 1
            self._last_success_id = restored.checkpoint_id
        # Flink's CheckpointIDCounter outlives a failover: an id a failed attempt used
        # (whose tasks may still write under it) is never handed out again.
        self._next_id = self._first_id = max(self._next_id, first_checkpoint_id)

    # -- properties ------------------------------------------------------------------------

    @property
    def config(self) -> CheckpointConfig:
        return self._config

    @property
    def state(self) -> CoordinatorState:
        return self._state

    @property
    def pending(self) -> PendingCheckpoint | None:
        return self._pending

    @property
    def latest_completed(self) -> CompletedCheckpoint | None:
        return self._completed[-1] if self._completed else None

    @property
    def retained(self) -> tuple[CompletedCheckpoint, ...]:
        return tuple(self._completed)

    @property
    def next_checkpoint_id(self) -> int:
        return self._next_id

    @property
    def running_tasks(self) -> frozenset[str]:
        return self._tasks - self._finished

    @property
    def history(self) -> tuple[CheckpointStatus, ...]:
        return tuple(self._history)

    def stats(self) -> CoordinatorStats:
        latest = self.latest_completed
        return CoordinatorStats(
            triggered=self._triggered,
            completed=self._num_completed,
            aborted=self._num_aborted,
            consecutive_failures=self._consecutive_failures,
            late_messages=self._late,
            duplicate_acks=self._duplicates,
            unknown_messages=self._unknown,
            latest_completed_id=None if latest is None else latest.checkpoint_id,
        )

    def poll_commands(self) -> list[Command]:
        """Every command queued since the last call, oldest first."""
        out = list(self._commands)
        self._commands.clear()
        return out

    # -- lifecycle ---------------------------------------------------------------------

    def start(self) -> None:
        """All tasks of the attempt run: begin the schedule (first checkpoint in ``interval``)."""
        self._move(CoordinatorState.RUNNING)
        self._started_at = self._clock()
        self._last_trigger = None
        self._last_end = None

    def restart(self) -> CompletedCheckpoint | None:
        """The job fails over: abort what is pending (not counted), forget finished tasks,
        stop triggering until ``start()``. Returns the checkpoint to restore from."""
        if self._state is CoordinatorState.SHUT_DOWN:
            raise IllegalStateError("the checkpoint coordinator was shut down")
        self._abort_pending(AbortReason.JOB_FAILOVER, "")
        self._finished.clear()
        self._final_requested = False
        self._consecutive_failures = 0
        if self._state is not CoordinatorState.IDLE:
            self._move(CoordinatorState.IDLE)
        return self.latest_completed

    def shutdown(self) -> None:
        """Abort what is pending and accept nothing more (idempotent)."""
        if self._state is CoordinatorState.SHUT_DOWN:
            return
        self._abort_pending(AbortReason.COORDINATOR_SHUTDOWN, "")
        self._move(CoordinatorState.SHUT_DOWN)

    def request_final_checkpoint(self) -> None:
        """Sources reached the end of their input (or a clean stop): take a final checkpoint
        as soon as the pending one, if any, has ended; none is triggered after it."""
        self._check_not_shut_down()
        self._final_requested = True

    # -- time ------------------------------------------------------------------------------

    def next_deadline(self) -> float | None:
        """When ``tick`` has something to do next (a trigger or a timeout), or None."""
        if self._state is not CoordinatorState.RUNNING:
            return None
        if self._pending is not None:
            if self._pending.state is CheckpointState.PENDING:
                return self._pending.trigger_time + self._config.timeout
            return None
        if not self.running_tasks:
            return None
        return self._due_time()

    def _due_time(self) -> float:
        cfg = self._config
        after_pause = (self._last_end if self._last_end is not None else -float("inf")) + (
            cfg.min_pause
        )
        if self._final_requested:
            return max(after_pause, self._started_at)
        base = self._last_trigger if self._last_trigger is not None else self._started_at
        return max(base + cfg.interval, after_pause)

    def tick(self) -> None:
        """Expire an overdue checkpoint, trigger a due one."""
        if self._state is not CoordinatorState.RUNNING:
            return
        now = self._clock()
        pending = self._pending
        if pending is not None:
            if (
                pending.state is CheckpointState.PENDING
                and now >= pending.trigger_time + self._config.timeout
            ):
                self._abort(pending, AbortReason.EXPIRED, f"after {self._config.timeout:g} s", now)
            else:
                return
        if self._state is not CoordinatorState.RUNNING or self._pending is not None:
            return  # the expiry failed the job
        if self.running_tasks and now >= self._due_time():
            self._trigger(now)

    def _trigger(self, now: float) -> None:
        running = self.running_tasks
        sources = self._sources & running or running
        checkpoint_id = self._next_id
        self._next_id += 1
        timestamp = self._wall_clock_ms()
        self._pending = PendingCheckpoint(
            checkpoint_id=checkpoint_id,
            timestamp=timestamp,
            trigger_time=now,
            tasks_to_ack=running,
            finished_tasks=frozenset(self._finished),
            is_final=self._final_requested,
        )
        self._last_trigger = now
        self._triggered += 1
        self._commands.append(
            TriggerCheckpoint(
                checkpoint_id,
                timestamp,
                tuple(sorted(sources)),
                exactly_once=self._config.exactly_once,
                is_final=self._final_requested,
            )
        )

    # -- task messages -------------------------------------------------------------------

    def acknowledge(self, task_id: str, checkpoint_id: int, handle: Handle = None) -> None:
        """``task_id`` snapshotted its state for ``checkpoint_id``; ``handle`` names it."""
        pending = self._pending
        if pending is None or pending.checkpoint_id != checkpoint_id:
            if checkpoint_id in self._aborted_ids and task_id in self._tasks:
                self._late += 1
                if handle is not None:
                    self._commands.append(
                        DiscardCheckpoint(checkpoint_id, {task_id: handle}, whole_checkpoint=False)
                    )
            elif self._is_completed(checkpoint_id) and task_id in self._tasks:
                self._duplicates += 1  # every task of a completed checkpoint acked already
            else:
                self._unknown += 1
            return
        if task_id not in pending.tasks_to_ack:
            self._unknown += 1
            return
        if pending.state is not CheckpointState.PENDING or task_id in pending.handles:
            self._duplicates += 1
            return
        pending.handles[task_id] = handle
        if pending.fully_acknowledged:
            pending.move_to(CheckpointState.FINALIZING)
            self._commands.append(
                FinalizeCheckpoint(
                    pending.checkpoint_id,
                    pending.timestamp,
                    dict(pending.handles),
                    pending.finished_tasks,
                    pending.is_final,
                )
            )

    def decline(
        self,
        task_id: str,
        checkpoint_id: int,
        reason: CheckpointFailureReason = CheckpointFailureReason.DECLINED,
        message: str = "",
    ) -> None:
        """``task_id`` could not take ``checkpoint_id`` (its barrier handler's ``reason``)."""
        pending = self._pending
        if pending is None or pending.checkpoint_id != checkpoint_id:
            if checkpoint_id in self._aborted_ids or self._is_completed(checkpoint_id):
                self._late += 1
            else:
                self._unknown += 1
            return
        if task_id not in pending.tasks_to_ack:
            self._unknown += 1
            return
        if pending.state is not CheckpointState.PENDING:
            self._late += 1  # fully acknowledged already: the decline cannot undo that
            return
        detail = f"task {task_id}: {reason.value}" + (f": {message}" if message else "")
        self._abort(
            pending,
            AbortReason.DECLINED,
            detail,
            self._clock(),
            counted=reason in _COUNTED_DECLINES,
        )

    def task_finished(self, task_id: str) -> None:
        """``task_id`` ended (its input is exhausted); it acknowledges no later checkpoint."""
        if task_id not in self._tasks:
            raise UsageError(f"unknown task {task_id!r}")
        if task_id in self._finished:
            return
        self._finished.add(task_id)
        pending = self._pending
        if (
            pending is not None
            and pending.state is CheckpointState.PENDING
            and task_id in pending.not_yet_acknowledged
        ):
            self._abort(pending, AbortReason.TASK_FINISHED, f"task {task_id}", self._clock())

    # -- the driver's finalization -----------------------------------------------------------

    def checkpoint_finalized(self, checkpoint_id: int) -> None:
        """The metadata of ``checkpoint_id`` is durable: it is complete."""
        pending = self._finalizing(checkpoint_id)
        now = self._clock()
        pending.move_to(CheckpointState.COMPLETED)
        self._pending = None
        self._last_end = now
        self._num_completed += 1
        self._record(pending, now, None)
        completed = CompletedCheckpoint(
            pending.checkpoint_id,
            pending.timestamp,
            dict(pending.handles),
            pending.finished_tasks,
            pending.is_final,
        )
        self._completed.append(completed)
        # CheckpointFailureManager.handleCheckpointSuccess
        if checkpoint_id > self._last_success_id:
            self._last_success_id = checkpoint_id
            self._consecutive_failures = 0
        self._commands.append(NotifyComplete(checkpoint_id, is_final=pending.is_final))
        while len(self._completed) > self._config.retained:
            old = self._completed.popleft()
            self._commands.append(DiscardCheckpoint(old.checkpoint_id, old.handles))
        if pending.is_final and self._state is CoordinatorState.RUNNING:
            self._final_requested = False
            self._move(CoordinatorState.FINISHED)

    def finalize_failed(self, checkpoint_id: int, message: str = "") -> None:
        """The metadata of ``checkpoint_id`` could not be written (and is not there)."""
        pending = self._finalizing(checkpoint_id)
        self._abort(pending, AbortReason.FINALIZE_FAILED, message, self._clock())

    def _finalizing(self, checkpoint_id: int) -> PendingCheckpoint:
        pending = self._pending
        if (
            pending is None
            or pending.checkpoint_id != checkpoint_id
            or pending.state is not CheckpointState.FINALIZING
        ):
            raise IllegalStateError(f"checkpoint {checkpoint_id} is not being finalized")
        return pending

    # -- internals ------------------------------------------------------------------------

    def _is_completed(self, checkpoint_id: int) -> bool:
        return (
            self._first_id <= checkpoint_id < self._next_id
            and checkpoint_id not in self._aborted_ids
        )

    def _abort_pending(self, reason: AbortReason, detail: str) -> None:
        if self._pending is not None:
            self._abort(self._pending, reason, detail, self._clock(), counted=False)

    def _abort(
        self,
        pending: PendingCheckpoint,
        reason: AbortReason,
        detail: str,
        now: float,
        *,
        counted: bool | None = None,
    ) -> None:
        pending.move_to(CheckpointState.ABORTED)
        self._pending = None
        self._aborted_ids.add(pending.checkpoint_id)
        self._last_end = now
        self._num_aborted += 1
        self._record(pending, now, reason)
        self._commands.append(NotifyAborted(pending.checkpoint_id, reason, detail))
        self._commands.append(DiscardCheckpoint(pending.checkpoint_id, dict(pending.handles)))
        if counted is None:
            counted = reason in _COUNTED_ABORTS
        if counted:
            self._count_failure(pending.checkpoint_id, f"{reason.value}: {detail}")

    def _count_failure(self, checkpoint_id: int, detail: str) -> None:
        """CheckpointFailureManager.checkFailureAgainstCounter."""
        if checkpoint_id <= self._last_success_id:
            return
        self._consecutive_failures += 1
        if self._consecutive_failures > self._config.tolerable_failed_checkpoints:
            failures = self._consecutive_failures
            self._consecutive_failures = 0
            self._commands.append(
                FailJob(
                    f"exceeded the checkpoint tolerable failure threshold "
                    f"({failures} consecutive failed checkpoints, tolerable "
                    f"{self._config.tolerable_failed_checkpoints}); last: checkpoint "
                    f"{checkpoint_id}: {detail}",
                    checkpoint_id,
                )
            )
            if self._state is CoordinatorState.RUNNING:
                self._move(CoordinatorState.IDLE)

    def _record(self, pending: PendingCheckpoint, now: float, reason: AbortReason | None) -> None:
        self._history.append(
            CheckpointStatus(
                pending.checkpoint_id,
                pending.state,
                pending.trigger_time,
                now,
                len(pending.handles),
                len(pending.tasks_to_ack),
                reason,
                pending.is_final,
            )
        )

    def _move(self, new: CoordinatorState) -> None:
        if new not in _COORDINATOR_TRANSITIONS[self._state]:
            raise IllegalStateError(
                f"checkpoint coordinator: {self._state.value} -> {new.value} is not allowed"
            )
        self._state = new

    def _check_not_shut_down(self) -> None:
        if self._state is CoordinatorState.SHUT_DOWN:
            raise IllegalStateError("the checkpoint coordinator was shut down")
