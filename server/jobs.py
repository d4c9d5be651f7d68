"""Streaming jobs as this daemon sees them: the driver's JobStatus joined with what the
daemon measures itself.

A job's driver publishes ``JobStatus`` (local message 77): state, attempt, restarts, each
task's record counts and output datasets, the checkpoint history. The daemon adds, per
task, what only it knows:

* **back pressure**, Flink's ``backPressuredTimeMsPerSecond`` / 1000: the share of the
  last :data:`BACK_PRESSURE_WINDOW` seconds the task spent waiting for credit on its
  output partitions (``ResultPartition.back_pressured_seconds``, the time the producer
  session had no segment to grant, plus the wait going on now, as Flink's TimerGauge
  counts its current measurement), and Flink's status of it: OK up to 10 %, LOW up to
  50 %, HIGH above (the web UI's thresholds). The longest-waiting output counts.
* **output pool usage**, Flink's ``outPoolUsage``: the fullest output partition's pool.
* **input pool usage**, as Flink's ``inPoolUsage`` reads: the buffers the task's gate
  holds or has announced (``buffers_in_use`` of its TaskMetrics) over the buffers a gate
  of its channels has (exclusive x channels + floating), at most 1; and the **debloated
  buffer size** its gate last announced. Both need buffer debloating on (``--debloat``).

Only tasks whose partitions live on this daemon get back pressure and output figures: on a
cluster, a daemon knows the tasks on its host. Everything here runs on the daemon's loop.

A status belongs to the application its driver's connection authenticated for: jobs are
kept per (application, job id), joined only with that application's partitions and task
reports, and an application keeps at most :data:`MAX_JOBS_PER_APP` jobs here. When the
board is full, the least recently updated job of the application holding the most goes,
so one application publishing many jobs cannot push another's off the dashboard.
"""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Final, Protocol

from exchange.consumer.input_channel import STREAMING_FLOATING_BUFFERS
from exchange.partition.result_partition import ResultPartition
from exchange.protocol.local_messages import JobStatus
from server.config import DaemonConfig

__all__ = [
    "BACK_PRESSURE_WINDOW",
    "MAX_JOBS",
    "MAX_JOBS_PER_APP",
    "JobBoard",
    "JobView",
    "TaskView",
    "back_pressure_level",
]

#: Jobs whose latest status a daemon keeps (see the module docstring for which goes).
MAX_JOBS: Final = 8
#: Jobs one application keeps on the board (its least recently updated goes first).
MAX_JOBS_PER_APP: Final = 4
#: Seconds over which a task's back pressure is measured.
BACK_PRESSURE_WINDOW: Final = 5.0
#: Shortest span of samples a ratio is computed from.
_MIN_SPAN: Final = 0.5
#: Flink's web UI: OK <= 10 %, LOW <= 50 %, HIGH above.
_LOW: Final = 0.10
_HIGH: Final = 0.50


def back_pressure_level(ratio: float | None) -> str | None:
    """Flink's back-pressure status of a ratio (None: not measured)."""
    if ratio is None:
        return None
    if ratio <= _LOW:
        return "OK"
    return "LOW" if ratio <= _HIGH else "HIGH"


class _Report(Protocol):
    @property
    def task(self) -> str: ...

    @property
    def app_id(self) -> str: ...

    @property
    def metrics(self) -> Mapping[str, float]: ...


@dataclass(frozen=True, slots=True)
class TaskView:
    """One task of a job with the daemon's figures (None: the daemon does not have it)."""

    task: str
    name: str
    subtask: int
    records_in: int
    records_out: int
    back_pressure_ratio: float | None
    back_pressure: str | None
    out_pool_usage: float | None
    in_pool_usage: float | None
    buffer_size: int | None

    def json(self) -> dict[str, Any]:
        return {
            "task": self.task,
            "name": self.name,
            "subtask": self.subtask,
            "records_in": self.records_in,
            "records_out": self.records_out,
            "back_pressure_ratio": self.back_pressure_ratio,
            "back_pressure": self.back_pressure,
            "out_pool_usage": self.out_pool_usage,
            "in_pool_usage": self.in_pool_usage,
            "buffer_size": self.buffer_size,
        }


@dataclass(frozen=True, slots=True)
class JobView:
    """A job's latest status, its tasks with the daemon's figures."""

    status: JobStatus
    received_at: float
    tasks: tuple[TaskView, ...]
    #: the application of the driver that published it ("": none)
    app_id: str = ""

    def json(self, now: float) -> dict[str, Any]:
        s = self.status
        return {
            "job": s.job,
            "application": self.app_id,
            "state": s.state,
            "attempt": s.attempt,
            "restarts": s.restarts,
            "started_at": s.started_at,
            "age_seconds": max(0.0, now - self.received_at),
            "checkpoints_completed": s.checkpoints_completed,
            "checkpoints_failed": s.checkpoints_failed,
            "tasks": [t.json() for t in self.tasks],
            "checkpoints": [
                {
                    "id": c.checkpoint_id,
                    "status": c.status,
                    "trigger_time": c.trigger_time,
                    "duration": c.duration,
                    "alignment": c.alignment,
                    "aligned_bytes": c.aligned_bytes,
                    "state_bytes": c.state_bytes,
                    "unaligned": c.unaligned,
                    "persisted_bytes": dict(c.persisted_bytes),
                }
                for c in s.checkpoints
            ],
            "failures": list(s.failures),
        }


class _Samples:
    """(time, back-pressured seconds) of one task's outputs within the window."""

    __slots__ = ("points",)

    def __init__(self) -> None:
        self.points: deque[tuple[float, float]] = deque()

    def add(self, now: float, value: float, window: float) -> None:
        pts = self.points
        if pts and value < pts[-1][1]:  # new partitions (a restart): start over
            pts.clear()
        pts.append((now, value))
        while len(pts) > 2 and now - pts[1][0] >= window:
            pts.popleft()

    def ratio(self) -> float | None:
        if len(self.points) < 2:
            return None
        (t0, v0), (t1, v1) = self.points[0], self.points[-1]
        if t1 - t0 < _MIN_SPAN:
            return None
        return min(1.0, max(0.0, (v1 - v0) / (t1 - t0)))


class JobBoard:
    """The latest JobStatus of each job, and the daemon's samples of its tasks."""

    def __init__(
        self,
        partitions: Callable[[], Iterable[ResultPartition]],
        reports: Callable[[], Iterable[_Report]],
        config: DaemonConfig,
        *,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
        window: float = BACK_PRESSURE_WINDOW,
        waiting: Callable[[], Mapping[tuple[str, int], float]] = dict,
    ) -> None:
        self._partitions = partitions
        self._waiting = waiting
        self._reports = reports
        self.config = config
        self._clock = clock
        self._wall = wall_clock
        self.window = window
        #: (application, job) -> (status, wall time received), least recently updated first
        self._jobs: OrderedDict[tuple[str, str], tuple[JobStatus, float]] = OrderedDict()
        #: (application, job, task) -> back-pressure samples
        self._samples: dict[tuple[str, str, str], _Samples] = {}
        self.updates = 0

    def update(self, status: JobStatus, app_id: str = "") -> None:
        """Keep ``status`` as the latest of application ``app_id``'s job (and take a
        sample of its tasks)."""
        key = (app_id, status.job)
        self._jobs[key] = (status, self._wall())
        self._jobs.move_to_end(key)
        mine = [k for k in self._jobs if k[0] == app_id]
        if len(mine) > MAX_JOBS_PER_APP:
            self._forget(mine[0])
        while len(self._jobs) > MAX_JOBS:
            held: dict[str, int] = {}
            for app, _ in self._jobs:
                held[app] = held.get(app, 0) + 1
            busiest = max(held, key=lambda a: held[a])  # the first of equals: the staler
            self._forget(next(k for k in self._jobs if k[0] == busiest))
        self.updates += 1
        self._sample()

    def _forget(self, key: tuple[str, str]) -> None:
        del self._jobs[key]
        for sample in [k for k in self._samples if k[:2] == key]:
            del self._samples[sample]

    def _outputs(self) -> dict[tuple[str, str, int], ResultPartition]:
        return {
            (p.app_id, p.partition_id.dataset_id, p.partition_id.partition_index): p
            for p in self._partitions()
        }

    def _sample(self) -> dict[tuple[str, str, int], ResultPartition]:
        """Sample every running task's back-pressured time; returns the partitions read."""
        parts = self._outputs()
        waiting = self._waiting()
        now = self._clock()
        live: set[tuple[str, str, str]] = set()
        for (app, _), (status, _) in self._jobs.items():
            if status.state != "RUNNING":
                continue
            for t in status.tasks:
                outs = [parts.get((app, d, t.subtask)) for d in t.outputs]
                if not outs or any(p is None for p in outs):
                    continue
                waited = max(
                    p.stats().back_pressured_seconds + waiting.get((d, t.subtask), 0.0)
                    for d, p in zip(t.outputs, outs, strict=True)
                    if p is not None
                )
                key = (app, status.job, t.task)
                live.add(key)
                self._samples.setdefault(key, _Samples()).add(now, waited, self.window)
        for key in [k for k in self._samples if k not in live]:
            del self._samples[key]
        return parts

    def views(self) -> list[JobView]:
        """Every job kept, most recently updated last, with fresh figures."""
        parts = self._sample()
        gates: dict[tuple[str, str], Mapping[str, float]] = {}
        for r in self._reports():
            gates.setdefault((r.app_id, r.task), r.metrics)
        cfg = self.config
        out = []
        for (app, _), (status, received) in self._jobs.items():
            running = status.state == "RUNNING"
            tasks = []
            for t in status.tasks:
                ratio = usage = in_usage = size = None
                if running:
                    samples = self._samples.get((app, status.job, t.task))
                    ratio = samples.ratio() if samples is not None else None
                    if not t.outputs:
                        ratio = 0.0  # a sink: never waits for output buffers
                    outs = [
                        parts[(app, d, t.subtask)]
                        for d in t.outputs
                        if (app, d, t.subtask) in parts
                    ]
                    if outs:
                        usage = max(p.stats().out_pool_usage for p in outs)
                    gate = gates.get((app, f"{status.job}/{t.task}"))
                    if gate is not None:
                        floating = cfg.floating_buffers_per_gate
                        capacity = cfg.exclusive_buffers_per_channel * t.channels + (
                            STREAMING_FLOATING_BUFFERS if floating is None else floating
                        )
                        in_use = gate.get("buffers_in_use")
                        if in_use is not None and capacity > 0:
                            in_usage = min(1.0, float(in_use) / capacity)
                        announced = gate.get("buffer_size")
                        size = int(announced) if announced is not None else None
                tasks.append(
                    TaskView(
                        t.task,
                        t.name,
                        t.subtask,
                        t.records_in,
                        t.records_out,
                        ratio,
                        back_pressure_level(ratio),
                        usage,
                        in_usage,
                        size,
                    )
                )
            out.append(JobView(status, received, tuple(tasks), app))
        return out
