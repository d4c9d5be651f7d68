"""The driver's view of a running streaming job, published to its local daemon.

The coordinator loop (``client.streaming.environment``) feeds a :class:`JobStatusTracker`
what it sees: each attempt's start, the tasks' messages (an acknowledgement carries the
task's record counts and the checkpoint's alignment and state size, as Flink's
``CheckpointMetrics`` do), the coordinator's commands (trigger, complete, abort) and the
attempt's end. The tracker keeps the job's state, the tasks' latest figures and the
recent checkpoint history, and sends them as ``JobStatus`` (local message 77) to the
driver's local daemon (the daemon given to the environment, else ``$EXCHANGE_DAEMON`` or
the default socket) when something changes and at most every ``interval`` seconds; that
daemon's dashboard and ``/metrics`` show it. A failure to publish (no daemon on the
driver's host, a refused message) stops the publishing, never the job.

A failed attempt reports one root cause, as Flink's exception history does: the
:class:`FailureCollector` gathers every failure seen during the attempt (a task's
TaskFailed carries when it failed and whether its error is a consequence of another
failure; a ControlLost is stamped when the task's connection ended) and names the earliest
failure that is not a consequence, whatever order the messages arrived in; the others are
listed as its consequences (Flink's concurrent exceptions). Times are wall clocks of the
tasks' and the driver's hosts: across hosts they order failures as well as the hosts'
clocks agree (NTP keeps them within milliseconds; a consequence flag never depends on it).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Final

from client.local_connection import LocalConnection, resolve_daemon_socket
from client.runtime import get_runtime
from client.streaming.control import ControlLost
from client.streaming.graph import JobGraph
from client.streaming.task import dataset_of
from exchange.best_effort import best_effort
from exchange.checkpointing.coordinator import NotifyAborted, NotifyComplete, TriggerCheckpoint
from exchange.protocol.driver_messages import CheckpointAck, TaskFailed, TaskFinished
from exchange.protocol.local_messages import (
    MAX_JOB_CHECKPOINTS,
    MAX_JOB_FAILURE_LENGTH,
    MAX_JOB_FAILURES,
    MAX_JOB_TASKS,
    CheckpointRecord,
    JobStatus,
    JobTask,
)

__all__ = [
    "AttemptFailure",
    "CheckpointEntry",
    "FailureCollector",
    "FailureReport",
    "JobStatusTracker",
    "TaskFigures",
]

log = logging.getLogger("exchange.streaming.status")

#: Seconds between two JobStatus messages while nothing but counts changes.
PUBLISH_INTERVAL: Final = 1.0


@dataclass
class TaskFigures:
    """One task of the current attempt, as its acknowledgements reported it."""

    task: str
    name: str
    subtask: int
    outputs: tuple[str, ...]
    channels: int
    records_in: int = 0
    records_out: int = 0


@dataclass
class CheckpointEntry:
    """One checkpoint of the history (see ``CheckpointRecord``)."""

    checkpoint_id: int
    trigger_time: float
    started: float
    status: str = "IN_PROGRESS"
    duration: float | None = None
    alignment: float | None = None
    aligned_bytes: int = 0
    state_bytes: int = 0
    acks: int = 0
    unaligned: bool = False
    #: task -> in-flight input bytes it persisted (tasks that triggered it unaligned)
    persisted: dict[str, int] = field(default_factory=dict)

    def record(self) -> CheckpointRecord:
        return CheckpointRecord(
            self.checkpoint_id,
            self.status,
            self.trigger_time,
            self.duration,
            self.alignment,
            self.aligned_bytes,
            self.state_bytes,
            self.unaligned,
            tuple(sorted(self.persisted.items())),
        )


@dataclass(frozen=True)
class FailureReport:
    """One failure seen during an attempt."""

    #: a task id, or "" for the driver itself
    task: str
    #: when it failed (wall clock, seconds): the task's, or the driver's for a lost task
    time: float
    message: str
    #: caused by another failure (an upstream partition released, a cancellation)
    consequence: bool = False


@dataclass(frozen=True)
class AttemptFailure:
    """Why one attempt failed: its root cause, then the failures that followed from it
    (oldest first), as Flink's ``RootExceptionHistoryEntry`` and its concurrent
    exceptions."""

    attempt: int
    root_cause: str
    consequences: tuple[str, ...] = ()


class FailureCollector:
    """The failures of one attempt, in whatever order they arrive; names the root cause.

    The root cause is the earliest failure that is not a consequence (the earliest of all
    when every one is). A task lost after the driver began failing the attempt (Spark kills
    the other tasks) is a consequence; so is a task's report of an error its code marked as
    one (see ``client.streaming.task``).
    """

    def __init__(self, *, wall_clock: Callable[[], float] = time.time) -> None:
        self._wall = wall_clock
        self.reports: list[FailureReport] = []
        #: when the driver learnt of the first failure (and began cancelling the attempt)
        self.failing_since: float | None = None

    @property
    def failed(self) -> bool:
        return bool(self.reports)

    def add(self, report: FailureReport) -> None:
        self.reports.append(report)
        if self.failing_since is None:
            self.failing_since = self._wall()

    def driver_failure(self, message: str) -> None:
        """The driver's own finding (a failed checkpoint, a cancel, the Spark stage's end):
        a consequence when a failure was already known."""
        self.add(FailureReport("", self._wall(), message, consequence=self.failed))

    def on_message(self, task: str, msg: object) -> None:
        """A TaskFailed or ControlLost (other messages are ignored)."""
        match msg:
            case TaskFailed():
                self.add(
                    FailureReport(
                        task, msg.time, f"task {task} failed: {msg.error}".strip(), msg.consequence
                    )
                )
            case ControlLost():
                consequence = self.failing_since is not None and msg.time >= self.failing_since
                self.add(
                    FailureReport(
                        task, msg.time, f"task {task} lost: {msg.error}".strip(), consequence
                    )
                )

    def root_cause(self) -> FailureReport | None:
        if not self.reports:
            return None
        order = {id(r): i for i, r in enumerate(self.reports)}
        return min(self.reports, key=lambda r: (r.consequence, r.time, order[id(r)]))

    def result(self, attempt: int) -> AttemptFailure | None:
        root = self.root_cause()
        if root is None:
            return None
        rest = sorted((r for r in self.reports if r is not root), key=lambda r: r.time)
        return AttemptFailure(attempt, root.message, tuple(r.message for r in rest))


class JobStatusTracker:
    """State, tasks and checkpoint history of one job (thread-safe; read with ``snapshot``)."""

    def __init__(
        self,
        job_id: str,
        daemon_socket: str | None,
        *,
        secret: bytes | None = None,
        interval: float = PUBLISH_INTERVAL,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self.job_id = job_id
        self.interval = interval
        self._clock = clock
        self._wall = wall_clock
        self._lock = threading.Lock()
        self.state = "RUNNING"
        self.attempt = 0
        self.restarts = -1  # the first attempt makes it 0
        self.started_at = wall_clock()
        self.completed = 0
        self.failed = 0
        self.tasks: dict[str, TaskFigures] = {}
        #: (attempt, checkpoint id) -> entry: a restored job reuses the ids after the
        #: checkpoint it restored, so a failed attempt's checkpoint keeps its own entry
        self.history: OrderedDict[tuple[int, int], CheckpointEntry] = OrderedDict()
        self.failures: list[str] = []
        self._socket = daemon_socket
        self._secret = secret  # the application's credential: the job is its
        self._conn: LocalConnection | None = None
        self._last_sent = float("-inf")
        self._dirty = True
        #: JobStatus messages sent; True once publishing failed (no more are sent)
        self.published = 0
        self.publish_failed = False

    # -- what the coordinator loop reports --------------------------------------------------

    def attempt_started(self, attempt: int, graph: JobGraph) -> None:
        """A new attempt runs ``graph``: RUNNING, its tasks at zero."""
        tasks: dict[str, TaskFigures] = {}
        for spec in graph.tasks[:MAX_JOB_TASKS]:
            vertex = graph.vertex(spec.vertex_id)
            outputs = tuple(dataset_of(self.job_id, attempt, e) for e in vertex.outputs)
            channels = sum(graph.vertex(e.source).parallelism for e in vertex.inputs)
            name = " -> ".join(n.name for n in vertex.nodes)[:256]
            tasks[spec.task_id] = TaskFigures(
                spec.task_id, name, spec.subtask, outputs[:8], channels
            )
        with self._lock:
            self.attempt = attempt
            self.restarts += 1
            self.state = "RUNNING"
            self.tasks = tasks
            for entry in self.history.values():  # a dead attempt's checkpoints never complete
                if entry.status == "IN_PROGRESS":
                    entry.status = "FAILED"
                    self.failed += 1
            self._dirty = True
        self.publish(force=True)

    def on_message(self, task: str, msg: object) -> None:
        """A task's control message: CheckpointAck and TaskFinished carry figures."""
        if not isinstance(msg, CheckpointAck | TaskFinished):
            return
        with self._lock:
            figures = self.tasks.get(task)
            if figures is not None:
                figures.records_in = max(figures.records_in, msg.records_in)
                if isinstance(msg, CheckpointAck):
                    figures.records_out = max(figures.records_out, msg.records_out)
            if isinstance(msg, CheckpointAck):
                entry = self.history.get((self.attempt, msg.checkpoint_id))
                if entry is not None:
                    entry.acks += 1
                    entry.state_bytes += msg.state_bytes
                    entry.aligned_bytes += msg.aligned_bytes
                    if msg.unaligned:
                        entry.unaligned = True
                        entry.persisted[task] = msg.persisted_bytes
                    if msg.alignment is not None:
                        entry.alignment = max(entry.alignment or 0.0, msg.alignment)

    def on_command(self, cmd: object) -> None:
        """A command of the CheckpointCoordinator, as the loop carries it out."""
        now = self._clock()
        with self._lock:
            match cmd:
                case TriggerCheckpoint():
                    self.history[(self.attempt, cmd.checkpoint_id)] = CheckpointEntry(
                        cmd.checkpoint_id, cmd.timestamp / 1000.0, now
                    )
                    while len(self.history) > MAX_JOB_CHECKPOINTS:
                        self.history.popitem(last=False)
                case NotifyComplete():
                    self._end(cmd.checkpoint_id, "COMPLETED", now)
                    self.completed += 1
                case NotifyAborted():
                    self._end(cmd.checkpoint_id, "FAILED", now)
                    self.failed += 1
                case _:
                    return
            self._dirty = True

    def _end(self, checkpoint_id: int, status: str, now: float) -> None:
        entry = self.history.get((self.attempt, checkpoint_id))
        if entry is not None:
            entry.status = status
            entry.duration = max(0.0, now - entry.started)

    def attempt_failed(self, error: str) -> None:
        with self._lock:
            self.state = "RESTARTING"
            self.failures.append(error[:MAX_JOB_FAILURE_LENGTH])
            del self.failures[:-MAX_JOB_FAILURES]
            self._dirty = True
        self.publish(force=True)

    def job_ended(self, state: str) -> None:
        """FINISHED, FAILED or CANCELED; the last status is sent, the connection closed."""
        with self._lock:
            self.state = state
            self._dirty = True
        self.publish(force=True)
        self.close()

    # -- reading and publishing -------------------------------------------------------------

    def snapshot(self) -> JobStatus:
        with self._lock:
            return JobStatus(
                self.job_id,
                self.state,
                self.attempt,
                max(self.restarts, 0),
                self.started_at,
                self.completed,
                self.failed,
                tuple(
                    JobTask(
                        t.task,
                        t.name,
                        t.subtask,
                        t.outputs,
                        t.channels,
                        t.records_in,
                        t.records_out,
                    )
                    for t in self.tasks.values()
                ),
                tuple(e.record() for e in self.history.values()),
                tuple(self.failures),
            )

    def publish(self, *, force: bool = False) -> None:
        """Send the status if it changed (``force``) or ``interval`` passed since the last."""
        if self.publish_failed:
            return
        now = self._clock()
        elapsed = now - self._last_sent
        due = elapsed >= self.interval or (self._dirty and elapsed >= self.interval / 4)
        if not (force or due):
            return
        self._last_sent = now
        self._dirty = False
        status = self.snapshot()
        try:
            get_runtime().run(self._send(status))
            self.published += 1
        except Exception as e:
            log.info("job %s: stops publishing its status to the daemon: %r", self.job_id, e)
            self.publish_failed = True
            self.close()

    async def _send(self, status: JobStatus) -> None:
        if self._conn is None:
            self._conn = await LocalConnection.connect(
                resolve_daemon_socket(self._socket), secret=self._secret
            )
        self._conn.check()
        self._conn.send(status)

    def close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:

            async def stop() -> None:
                conn.close()

            with best_effort(log, "closing the job-status connection"):
                get_runtime().run(stop())
