"""Prometheus metrics and the JSON snapshot of one exchange daemon.

The engine keeps plain statistics (``NetworkBufferPool.stats()``, ``ResultPartition.stats()``,
``DataServer.stats()``, the daemon's cumulative ``totals()``); nothing here is updated on the
data path. :class:`ExchangeCollector` reads those statistics when Prometheus scrapes and turns
them into metric families, and :func:`stats_snapshot` turns the same numbers into the dict
behind ``/api/stats`` and the dashboard. Both run on the daemon's event loop thread, the one
thread that owns the engine objects, so a scrape sees one consistent state.

Names follow Flink's meanings:

- ``exchange_out_pool_usage`` is Flink's ``outPoolUsage``: segments a partition's
  LocalBufferPool has handed out / its current size, 0..1. Near 1 means the producer waits
  for buffers, i.e. it is backpressured.
- ``exchange_back_pressured_seconds_total`` counts the seconds producers spent waiting for a
  buffer. Flink's ``backPressuredTimeMsPerSecond`` is its rate::

      rate(exchange_back_pressured_seconds_total[1m]) * 1000

  (per producer: the same over ``exchange_partition_back_pressured_seconds_total``).
- ``exchange_bytes_out_total`` / ``exchange_buffers_out_total`` are Flink's ``numBytesOut`` /
  ``numBuffersOut``: what producers wrote into result partitions, kept across releases.
- ``exchange_asyncio_tasks`` counts the tasks alive on the daemon's event loop when scraped
  (omitted when collected off the loop); steady under a steady load, so a long run
  (``bench/soak.py``) watches it for leaks.

Consumer tasks report their input gates' figures to the daemon (``TaskMetrics``, local
message 76): ``exchange_gate_*`` (buffer debloating: the announced buffer size, throughput,
buffers in use, estimated time to consume) and ``exchange_checkpoint*`` (the last aligned
checkpoint's alignment time and bytes, checkpoints triggered and aborted: gauges of the
task's own counts, since a task's series vanish when its connection closes), labelled
``task`` and ``gate``. A series exists only while its task reports; at most
:data:`MAX_LABELLED_TASKS` gates get series (the count ``exchange_task_gates_reporting``
covers them all).

Streaming jobs whose drivers publish their status here (``JobStatus``, local message 77;
``server.jobs``) get ``exchange_job_*`` series labelled ``job`` (state, restarts,
checkpoints completed and failed, the last completed checkpoint's duration, alignment and
sizes) and ``exchange_task_*`` series labelled ``job`` and ``task``: Flink's back-pressure
ratio (``backPressuredTimeMsPerSecond`` / 1000) and its status (OK / LOW / HIGH, as a
``level`` label), input and output pool usage, the debloated buffer size, records in and
out (gauges of the current attempt's counts).

Per-partition series are bounded: the first :data:`MAX_LABELLED_PARTITIONS` partitions (in
registration order, so a partition keeps its series while it lives) get their own labels, the
rest are folded into one series labelled ``"_other"``: counts and bytes summed, pool usage the
maximum (a sum of ratios means nothing; the worst one is what shows backpressure).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Final, Protocol

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import CollectorRegistry

from exchange import __version__
from exchange.memory.network_buffer_pool import NetworkBufferPoolStats
from exchange.partition.result_partition import ResultPartition, ResultPartitionStats
from exchange.partition.result_partition_type import ResultPartitionType
from server.config import DaemonConfig
from server.jobs import JobView

__all__ = [
    "MAX_LABELLED_PARTITIONS",
    "MAX_LABELLED_TASKS",
    "OTHER_LABEL",
    "TASK_COUNTERS",
    "TASK_GAUGES",
    "DaemonView",
    "ExchangeCollector",
    "MonotonicCounter",
    "PartitionRow",
    "PartitionSummary",
    "SentCounters",
    "TaskReport",
    "build_registry",
    "stats_snapshot",
    "summarize_partitions",
]

#: Partitions with their own label values; the rest share ``OTHER_LABEL``.
MAX_LABELLED_PARTITIONS: Final = 200
OTHER_LABEL: Final = "_other"
PARTITION_LABELS: Final = ("dataset", "partition", "attempt")
#: Task gates with their own series (the first in (task, gate) order).
MAX_LABELLED_TASKS: Final = 200
TASK_LABELS: Final = ("task", "gate")

#: (TaskMetrics name, Prometheus gauge, help) of each figure a task's gate reports.
TASK_GAUGES: Final = (
    (
        "buffer_size",
        "exchange_gate_buffer_size_bytes",
        "Buffer size a consumer gate announced to its producers (buffer debloating).",
    ),
    (
        "throughput",
        "exchange_gate_throughput_bytes_per_second",
        "Throughput a consumer gate measured (buffer debloating).",
    ),
    (
        "buffers_in_use",
        "exchange_gate_buffers_in_use",
        "Buffers queued in a consumer gate plus its producers' announced backlog.",
    ),
    (
        "estimated_time_to_consume",
        "exchange_gate_estimated_time_to_consume_seconds",
        "Seconds a consumer gate needs to consume its in-flight buffers at its throughput.",
    ),
    (
        "last_alignment_duration",
        "exchange_checkpoint_alignment_seconds",
        "Seconds from the first barrier to the trigger of a gate's last triggered checkpoint.",
    ),
    (
        "last_aligned_bytes",
        "exchange_checkpoint_aligned_bytes",
        "Bytes parked or processed during a gate's last checkpoint alignment.",
    ),
)

#: (TaskMetrics name, Prometheus counter, help) of each count a task's gate reports: it
#: only grows while the task runs (a new task starts again at 0: a counter reset), so it is
#: a counter (exported as ``<name>_total``), for ``rate()`` and ``increase()``.
TASK_COUNTERS: Final = (
    (
        "num_triggered",
        "exchange_checkpoints_triggered",
        "Checkpoints a consumer task's gate triggered (the task's count, since it started).",
    ),
    (
        "num_aborted",
        "exchange_checkpoints_aborted",
        "Checkpoints a consumer task's gate aborted (the task's count, since it started).",
    ),
)


# -- what the collector reads ------------------------------------------------------------


class NetworkPoolView(Protocol):
    def stats(self) -> NetworkBufferPoolStats: ...


class PartitionManagerView(Protocol):
    @property
    def partitions(self) -> list[ResultPartition]: ...


class DataServerView(Protocol):
    def stats(self) -> dict[str, int]: ...


class DaemonView(Protocol):
    """What metrics and the HTTP port read from a daemon (``server.daemon.Daemon``).

    ``local_endpoint_stats()`` has the keys producers, consumers, bytes_received,
    buffers_received, partitions_created, producer_failures, bytes_shared_memory,
    bytes_socket, shared_arenas, consumer_bytes_shared_memory, consumer_bytes_socket,
    consumer_segments_held, consumer_segments_pinned, consumer_reads_refused. ``totals()``
    holds cumulative buffers_received, partitions_created, producer_failures, output_state_bytes,
    output_state_buffers. ``totals()`` holds cumulative
    counters that survive partition release: bytes_in, bytes_out, buffers_out,
    partitions_created, partitions_released, partitions_failed, back_pressured_seconds
    (optionally bytes_sent / buffers_sent of the data port, preferred when present).
    A missing key reads as 0. ``shutting_down`` is read with ``getattr(..., False)``, and
    ``task_reports()`` (a list of :class:`TaskReport`) and ``job_views()`` (a list of
    ``server.jobs.JobView``) are optional the same way.
    """

    @property
    def daemon_id(self) -> str: ...

    @property
    def started_at(self) -> float: ...

    @property
    def data_address(self) -> str: ...

    @property
    def config(self) -> DaemonConfig: ...

    @property
    def network_pool(self) -> NetworkPoolView: ...

    @property
    def manager(self) -> PartitionManagerView: ...

    @property
    def data_server(self) -> DataServerView: ...

    def local_endpoint_stats(self) -> dict[str, int]: ...

    def totals(self) -> dict[str, float]: ...


# -- reading the daemon ------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class TaskReport:
    """The latest figures a consumer task reported for one input gate (``TaskMetrics``).

    ``metrics`` holds only what the task has (no debloating figures when it is off);
    ``received_at`` is the daemon's ``time.time()`` when the report arrived.
    """

    task: str
    gate: str
    metrics: Mapping[str, float]
    received_at: float
    #: the application of the connection it came on ("": none)
    app_id: str = ""


def _job_views(d: DaemonView) -> list[JobView]:
    views = getattr(d, "job_views", None)
    return list(views()) if views is not None else []


def _task_reports(d: DaemonView) -> list[TaskReport]:
    reports = getattr(d, "task_reports", None)
    return list(reports()) if reports is not None else []


@dataclass(frozen=True, slots=True)
class PartitionRow:
    """One partition's statistics, or the ``_other`` fold of many."""

    dataset: str
    partition: str
    attempt: str
    type: str
    stats: ResultPartitionStats

    @property
    def labels(self) -> list[str]:
        return [self.dataset, self.partition, self.attempt]

    @classmethod
    def of(cls, part: ResultPartition) -> PartitionRow:
        pid = part.partition_id
        return cls(
            pid.dataset_id,
            str(pid.partition_index),
            str(pid.attempt_id),
            part.partition_type.value,
            part.stats(),
        )


def _fold(rows: list[PartitionRow]) -> PartitionRow:
    """The ``_other`` row: sums, except pool usage (the maximum)."""
    stats = [r.stats for r in rows]
    folded = ResultPartitionStats(
        num_subpartitions=sum(s.num_subpartitions for s in stats),
        bytes_out=sum(s.bytes_out for s in stats),
        buffers_out=sum(s.buffers_out for s in stats),
        backlog=sum(s.backlog for s in stats),
        out_pool_usage=max(s.out_pool_usage for s in stats),
        back_pressured_seconds=sum(s.back_pressured_seconds for s in stats),
        finished=all(s.finished for s in stats),
        released=all(s.released for s in stats),
    )
    return PartitionRow(OTHER_LABEL, OTHER_LABEL, OTHER_LABEL, OTHER_LABEL, folded)


@dataclass(frozen=True, slots=True)
class PartitionSummary:
    """Registered partitions: labelled rows, the fold of the rest, counts by type."""

    rows: list[PartitionRow]
    other: PartitionRow | None
    num_other: int
    by_type: dict[str, int]
    finished_by_type: dict[str, int]

    @property
    def count(self) -> int:
        return sum(self.by_type.values())


def summarize_partitions(
    partitions: Iterable[ResultPartition], limit: int = MAX_LABELLED_PARTITIONS
) -> PartitionSummary:
    """Read every partition's stats once; fold those past ``limit`` into ``_other``."""
    by_type = {t.value: 0 for t in ResultPartitionType}
    finished = dict(by_type)
    rows: list[PartitionRow] = []
    for part in partitions:
        row = PartitionRow.of(part)
        by_type[row.type] = by_type.get(row.type, 0) + 1
        finished[row.type] = finished.get(row.type, 0) + row.stats.finished
        rows.append(row)
    if len(rows) <= limit:
        return PartitionSummary(rows, None, 0, by_type, finished)
    rest = rows[limit:]
    return PartitionSummary(rows[:limit], _fold(rest), len(rest), by_type, finished)


def network_stats(d: DaemonView) -> NetworkBufferPoolStats:
    """The daemon's network memory: its own pool plus its applications' shared arenas
    (``server.shared_arenas``), summed segment by segment."""
    s = d.network_pool.stats()
    arenas = getattr(d, "shared_arenas", None)
    for pool in arenas.pools() if arenas is not None else ():
        a = pool.stats()
        s = NetworkBufferPoolStats(
            s.total_segments + a.total_segments,
            s.available_segments + a.available_segments,
            s.in_use_segments + a.in_use_segments,
            s.segment_size,
            s.num_local_pools + a.num_local_pools,
            s.required_segments + a.required_segments,
            s.overdraft_segments + a.overdraft_segments,
        )
    return s


def _num(mapping: Mapping[str, float], key: str) -> float:
    value = mapping.get(key, 0)
    return float(value) if isinstance(value, int | float) else 0.0


class MonotonicCounter:
    """Keeps a counter from going down when its source sums only live things.

    ``DataServer.stats()`` sums bytes over open connections, so a closed connection takes
    its bytes with it. What the source loses is kept as ``retired``, so the exported counter
    never decreases. It can under-count: when a connection closes between two reads, what it
    sent since the last read is lost, and so is as much of the other connections' traffic
    in that interval as hides the drop.
    """

    __slots__ = ("_last", "_retired")

    def __init__(self) -> None:
        self._retired = 0.0
        self._last = 0.0

    def update(self, live: float) -> float:
        value = max(self._last, self._retired + live)
        self._retired = value - live
        self._last = value
        return value


class SentCounters:
    """The data port's cumulative bytes and buffers sent, as counters that never go down.

    A daemon whose ``totals()`` carries ``bytes_sent`` and ``buffers_sent`` is taken at its
    word; otherwise the live sums of ``DataServer.stats()`` go through MonotonicCounters.
    One instance per daemon, shared by /metrics and /api/stats so the two agree.
    """

    def __init__(self) -> None:
        self._bytes = MonotonicCounter()
        self._buffers = MonotonicCounter()

    def read(self, totals: Mapping[str, float], port: Mapping[str, int]) -> tuple[float, float]:
        if "bytes_sent" in totals and "buffers_sent" in totals:
            return _num(totals, "bytes_sent"), _num(totals, "buffers_sent")
        return (
            self._bytes.update(_num(port, "bytes_sent")),
            self._buffers.update(_num(port, "buffers_sent")),
        )


# -- Prometheus --------------------------------------------------------------------------


class ExchangeCollector:
    """A prometheus_client collector that reads one daemon's statistics at scrape time."""

    def __init__(
        self,
        daemon: DaemonView,
        *,
        max_labelled_partitions: int = MAX_LABELLED_PARTITIONS,
        sent: SentCounters | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.daemon = daemon
        self.max_labelled_partitions = max_labelled_partitions
        self.sent = sent if sent is not None else SentCounters()
        self._clock = clock

    def describe(self) -> list[Metric]:
        # Nothing to check for duplicates: the registry is this daemon's own.
        return []

    def collect(self) -> Iterator[Metric]:
        d = self.daemon
        yield from self._info(d)
        yield from self._network(network_stats(d))
        yield from self._partitions(d)
        yield from self._traffic_metrics(d)
        yield from self._tasks(_task_reports(d))
        yield from self._jobs(_job_views(d))

    def _jobs(self, jobs: list[JobView]) -> Iterator[Metric]:
        state = GaugeMetricFamily(
            "exchange_job_info",
            "A streaming job whose driver publishes its status here (always 1).",
            labels=["job_id", "state"],
        )
        # counts over the job's life (its driver's): counters, exported as <name>_total
        job_counters = {
            name: CounterMetricFamily(name, doc, labels=["job_id"])
            for name, doc in (
                ("exchange_job_restarts", "Times the job restarted from a checkpoint."),
                ("exchange_job_checkpoints_completed", "Checkpoints the job completed."),
                ("exchange_job_checkpoints_failed", "Checkpoints the job aborted or lost."),
            )
        }
        job_gauges: dict[str, GaugeMetricFamily | CounterMetricFamily] = {
            name: GaugeMetricFamily(name, doc, labels=["job_id"])
            for name, doc in (
                ("exchange_job_attempt", "The job's current attempt (its id)."),
                (
                    "exchange_job_last_checkpoint_duration_seconds",
                    "Trigger to completion of the job's last completed checkpoint.",
                ),
                (
                    "exchange_job_last_checkpoint_alignment_seconds",
                    "Longest alignment of any task in the job's last completed checkpoint.",
                ),
                (
                    "exchange_job_last_checkpoint_size_bytes",
                    "State written by all tasks for the job's last completed checkpoint.",
                ),
                (
                    "exchange_job_last_checkpoint_aligned_bytes",
                    "Bytes processed or parked while aligning the last completed checkpoint.",
                ),
                (
                    "exchange_job_last_checkpoint_unaligned",
                    "1 when some task triggered the job's last completed checkpoint "
                    "unaligned, else 0.",
                ),
            )
        }
        persisted = GaugeMetricFamily(
            "exchange_job_last_checkpoint_persisted_bytes",
            "In-flight input a task persisted as channel state of the job's last completed "
            "checkpoint (unaligned).",
            labels=["job_id", "task"],
        )
        # ``job_id`` (Flink's label), not ``job``: Prometheus gives every scraped series its
        # target's ``job`` and would rename ours to ``exported_job``
        task_labels = ["job_id", "task"]
        level = GaugeMetricFamily(
            "exchange_task_back_pressure_status",
            "Flink's back-pressure status of a task (always 1): OK <= 10 %, LOW <= 50 %, "
            "HIGH above.",
            labels=[*task_labels, "level"],
        )
        task_gauges = {
            key: GaugeMetricFamily(name, doc, labels=task_labels)
            for key, name, doc in (
                (
                    "back_pressure_ratio",
                    "exchange_task_back_pressured_ratio",
                    "Share of time a task waited for output buffers (Flink's "
                    "backPressuredTimeMsPerSecond / 1000), over the last seconds.",
                ),
                (
                    "out_pool_usage",
                    "exchange_task_out_pool_usage",
                    "Flink's outPoolUsage of a task: its fullest output partition's pool, 0..1.",
                ),
                (
                    "in_pool_usage",
                    "exchange_task_in_pool_usage",
                    "Flink's inPoolUsage of a task: buffers its gate holds or was announced "
                    "over the gate's buffers, 0..1 (buffer debloating on).",
                ),
                (
                    "buffer_size",
                    "exchange_task_buffer_size_bytes",
                    "Buffer size a task's gate announced upstream (buffer debloating).",
                ),
                ("records_in", "exchange_task_records_in", "Records a task took in (attempt)."),
                ("records_out", "exchange_task_records_out", "Records a task sent on (attempt)."),
            )
        }
        job_gauges.update(job_counters)
        for view in jobs:
            s = view.status
            state.add_metric([s.job, s.state], 1.0)
            last = next((c for c in reversed(s.checkpoints) if c.status == "COMPLETED"), None)
            values: dict[str, float | None] = {
                "exchange_job_attempt": s.attempt,
                "exchange_job_restarts": s.restarts,
                "exchange_job_checkpoints_completed": s.checkpoints_completed,
                "exchange_job_checkpoints_failed": s.checkpoints_failed,
                "exchange_job_last_checkpoint_duration_seconds": None
                if last is None
                else last.duration,
                "exchange_job_last_checkpoint_alignment_seconds": None
                if last is None
                else last.alignment,
                "exchange_job_last_checkpoint_size_bytes": None
                if last is None
                else last.state_bytes,
                "exchange_job_last_checkpoint_aligned_bytes": None
                if last is None
                else last.aligned_bytes,
                "exchange_job_last_checkpoint_unaligned": None
                if last is None
                else float(last.unaligned),
            }
            if last is not None:
                for task, nbytes in last.persisted_bytes:
                    persisted.add_metric([s.job, task], float(nbytes))
            for name, value in values.items():
                if value is not None:
                    job_gauges[name].add_metric([s.job], float(value))
            for t in view.tasks:
                labels = [s.job, t.task]
                if t.back_pressure is not None:
                    level.add_metric([*labels, t.back_pressure], 1.0)
                figures = t.json()
                for key, family in task_gauges.items():
                    v = figures[key]
                    if v is not None:
                        family.add_metric(labels, float(v))
        yield state
        yield from job_gauges.values()
        yield persisted
        yield level
        yield from task_gauges.values()

    def _tasks(self, reports: list[TaskReport]) -> Iterator[Metric]:
        yield GaugeMetricFamily(
            "exchange_task_gates_reporting",
            "Consumer task gates whose figures this daemon holds (TaskMetrics).",
            value=len(reports),
        )
        shown = reports[:MAX_LABELLED_TASKS]
        families: list[tuple[str, GaugeMetricFamily | CounterMetricFamily]] = [
            (key, GaugeMetricFamily(name, doc, labels=list(TASK_LABELS)))
            for key, name, doc in TASK_GAUGES
        ]
        families += [
            (key, CounterMetricFamily(name, doc, labels=list(TASK_LABELS)))
            for key, name, doc in TASK_COUNTERS
        ]
        for key, family in families:
            for r in shown:
                value = r.metrics.get(key)
                if value is not None:
                    family.add_metric([r.task, r.gate], float(value))
            yield family

    def _info(self, d: DaemonView) -> Iterator[Metric]:
        info = GaugeMetricFamily(
            "exchange_build_info", "Version of the exchange daemon (always 1).", labels=["version"]
        )
        info.add_metric([__version__], 1.0)
        yield info
        daemon = GaugeMetricFamily(
            "exchange_daemon_info",
            "Identity of this daemon (always 1).",
            labels=["daemon_id", "data_address"],
        )
        daemon.add_metric([d.daemon_id, d.data_address], 1.0)
        yield daemon
        yield GaugeMetricFamily(
            "exchange_start_time_seconds", "Unix time the daemon started.", value=d.started_at
        )
        yield GaugeMetricFamily(
            "exchange_uptime_seconds",
            "Seconds since the daemon started.",
            value=max(0.0, self._clock() - d.started_at),
        )
        yield GaugeMetricFamily(
            "exchange_shutting_down",
            "1 while the daemon is shutting down, else 0.",
            value=1.0 if getattr(d, "shutting_down", False) else 0.0,
        )
        try:
            tasks = len(asyncio.all_tasks())
        except RuntimeError:  # collected off the event loop (a test calling collect()):
            return  # there is no loop whose tasks could be counted
        yield GaugeMetricFamily(
            "exchange_asyncio_tasks",
            "asyncio tasks alive on the daemon's event loop (one per connection, reader, "
            "sweeper...); a count that only grows is a leak.",
            value=tasks,
        )

    def _network(self, s: NetworkBufferPoolStats) -> Iterator[Metric]:
        yield GaugeMetricFamily(
            "exchange_network_segments_total",
            "Segments of the NetworkBufferPool (fixed at start).",
            value=s.total_segments,
        )
        yield GaugeMetricFamily(
            "exchange_network_segments_available",
            "Segments of the NetworkBufferPool that are free.",
            value=s.available_segments,
        )
        yield GaugeMetricFamily(
            "exchange_network_segments_used",
            "Segments of the NetworkBufferPool handed out (to local pools or as exclusive).",
            value=s.in_use_segments,
        )
        yield GaugeMetricFamily(
            "exchange_network_segments_overdraft",
            "Of the segments handed out, those producers hold as overdraft: beyond their "
            "partition's pool, to finish a record (max_overdraft_buffers_per_partition).",
            value=s.overdraft_segments,
        )
        yield GaugeMetricFamily(
            "exchange_network_segments_required",
            "Segments guaranteed to local pools and exclusive requests.",
            value=s.required_segments,
        )
        yield GaugeMetricFamily(
            "exchange_network_segment_size_bytes",
            "Size of one network segment (buffer).",
            value=s.segment_size,
        )
        yield GaugeMetricFamily(
            "exchange_network_memory_bytes",
            "Network memory of the daemon: segments x segment size.",
            value=s.total_segments * s.segment_size,
        )
        yield GaugeMetricFamily(
            "exchange_network_memory_used_bytes",
            "Network memory handed out.",
            value=s.in_use_segments * s.segment_size,
        )
        yield GaugeMetricFamily(
            "exchange_network_memory_used_ratio",
            "Network memory handed out / total, 0..1.",
            value=s.in_use_segments / s.total_segments if s.total_segments else 0.0,
        )
        yield GaugeMetricFamily(
            "exchange_local_buffer_pools",
            "LocalBufferPools carved out of the NetworkBufferPool.",
            value=s.num_local_pools,
        )

    def _partitions(self, d: DaemonView) -> Iterator[Metric]:
        summary = summarize_partitions(d.manager.partitions, self.max_labelled_partitions)
        count = GaugeMetricFamily(
            "exchange_partitions", "Result partitions registered, by type.", labels=["type"]
        )
        for t, n in summary.by_type.items():
            count.add_metric([t], n)
        yield count
        finished = GaugeMetricFamily(
            "exchange_partitions_finished",
            "Registered result partitions whose producer has finished, by type.",
            labels=["type"],
        )
        for t, n in summary.finished_by_type.items():
            finished.add_metric([t], n)
        yield finished

        labels = list(PARTITION_LABELS)
        usage = GaugeMetricFamily(
            "exchange_out_pool_usage",
            "Flink's outPoolUsage: used / current segments of a partition's buffer pool, 0..1 "
            f"(partition {OTHER_LABEL!r}: the maximum of the rest).",
            labels=labels,
        )
        backlog = GaugeMetricFamily(
            "exchange_backlog_buffers",
            "Finished buffers queued in a partition's pipelined subpartitions, not yet read.",
            labels=labels,
        )
        bytes_out = CounterMetricFamily(
            "exchange_partition_bytes_out_total",
            "Bytes written into a partition (Flink's numBytesOut of its producer).",
            labels=labels,
        )
        buffers_out = CounterMetricFamily(
            "exchange_partition_buffers_out_total",
            "Buffers finished in a partition (Flink's numBuffersOut of its producer).",
            labels=labels,
        )
        bp = CounterMetricFamily(
            "exchange_partition_back_pressured_seconds_total",
            "Seconds a partition's producer waited for a buffer; "
            "rate(...[1m])*1000 is Flink's backPressuredTimeMsPerSecond.",
            labels=labels,
        )
        rows = summary.rows if summary.other is None else [*summary.rows, summary.other]
        for row in rows:
            lv, s = row.labels, row.stats
            usage.add_metric(lv, s.out_pool_usage)
            backlog.add_metric(lv, s.backlog)
            bytes_out.add_metric(lv, s.bytes_out)
            buffers_out.add_metric(lv, s.buffers_out)
            bp.add_metric(lv, s.back_pressured_seconds)
        yield from (usage, backlog, bytes_out, buffers_out, bp)

    def _traffic_metrics(self, d: DaemonView) -> Iterator[Metric]:
        totals = d.totals()
        port = d.data_server.stats()
        local = d.local_endpoint_stats()
        bytes_sent, buffers_sent = self.sent.read(totals, port)

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            return CounterMetricFamily(name, doc, value=value)

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            return GaugeMetricFamily(name, doc, value=value)

        yield counter(
            "exchange_bytes_out_total",
            "Bytes producers wrote into result partitions (Flink's numBytesOut), all partitions "
            "ever registered.",
            _num(totals, "bytes_out"),
        )
        yield counter(
            "exchange_buffers_out_total",
            "Buffers producers finished in result partitions (Flink's numBuffersOut).",
            _num(totals, "buffers_out"),
        )
        yield counter(
            "exchange_bytes_received_total",
            "Bytes received from producer tasks.",
            _num(totals, "bytes_in"),
        )
        yield counter(
            "exchange_buffers_received_total",
            "Buffers received from producer tasks on this host.",
            _num(local, "buffers_received"),
        )
        for name, doc, prefix in (
            (
                "exchange_producer_bytes_total",
                "Bytes local producer tasks handed over, by path: written into their "
                "application's shared arena and committed by index (shared_memory), or "
                "pushed over the Unix socket (socket).",
                "",
            ),
            (
                "exchange_consumer_bytes_total",
                "Bytes consumer tasks on this host read from the daemon's local socket, by "
                "path: read in place in their application's shared arena, given as segment "
                "descriptors (shared_memory), or sent over the Unix socket (socket: events, "
                "and buffers outside an arena the reader mapped).",
                "consumer_",
            ),
        ):
            by_path = CounterMetricFamily(name, doc, labels=["path"])
            for path in ("shared_memory", "socket"):
                by_path.add_metric([path], _num(local, f"{prefix}bytes_{path}"))
            yield by_path
        yield gauge(
            "exchange_consumer_shared_segments_held",
            "Shared arena segments consumer tasks on this host hold now (read in place, not "
            "given back yet; they return when a consumer's connection closes).",
            _num(local, "consumer_segments_held"),
        )
        yield gauge(
            "exchange_consumer_shared_segments_pinned",
            "Shared arena segments kept out of the pool for consumer processes that may still "
            "read them: held when the daemon dropped their connection (a protocol error, no "
            "Pong within peer_timeout), returned when the process exits.",
            _num(local, "consumer_segments_pinned"),
        )
        yield counter(
            "exchange_consumer_in_place_reads_refused_total",
            "Consumer connections on this host that read over the socket instead of in "
            "place because their process had max_consumer_pins_per_process shared segments "
            "pinned (it lives on after the daemon dropped its connections).",
            _num(local, "consumer_reads_refused"),
        )
        yield gauge(
            "exchange_shared_arenas",
            "Applications with a shared arena on this daemon now (0 when shared memory is "
            "off or unavailable; the log says why).",
            _num(local, "shared_arenas"),
        )
        yield counter(
            "exchange_overdraft_buffers_total",
            "Overdraft segments granted to producer tasks that ran out of credit in the middle "
            "of a record (Flink's overdraft buffers).",
            _num(local, "overdraft_granted"),
        )
        yield counter(
            "exchange_output_channel_state_bytes_total",
            "Bytes of in-flight data that unaligned checkpoint barriers overtook in this "
            "daemon's subpartitions and handed back to their producer tasks to persist "
            "(output channel state, Flink's persisted in-flight data).",
            _num(local, "output_state_bytes"),
        )
        yield counter(
            "exchange_output_channel_state_buffers_total",
            "Buffers of output channel state handed back to producer tasks.",
            _num(local, "output_state_buffers"),
        )
        yield counter(
            "exchange_bytes_sent_total",
            "Bytes the data port sent to remote consumers (BufferResponse frames).",
            bytes_sent,
        )
        yield counter(
            "exchange_buffers_sent_total",
            "Buffers the data port sent to remote consumers.",
            buffers_sent,
        )
        yield counter(
            "exchange_back_pressured_seconds_total",
            "Seconds producers spent waiting for a buffer, summed over all partitions ever "
            "registered; rate(...[1m])*1000 is Flink's backPressuredTimeMsPerSecond.",
            _num(totals, "back_pressured_seconds"),
        )
        yield counter(
            "exchange_partitions_created_total",
            "Result partitions created.",
            _num(totals, "partitions_created"),
        )
        yield counter(
            "exchange_partitions_released_total",
            "Result partitions released (consumed, released by the job, or failed).",
            _num(totals, "partitions_released"),
        )
        yield counter(
            "exchange_partitions_failed_total",
            "Result partitions whose producer failed.",
            _num(totals, "partitions_failed"),
        )
        yield counter(
            "exchange_producer_failures_total",
            "Producer tasks on this host that failed or vanished.",
            _num(local, "producer_failures"),
        )
        yield gauge(
            "exchange_connections",
            "Open connections on the data port.",
            _num(port, "connections"),
        )
        yield counter(
            "exchange_connections_accepted_total",
            "Connections accepted on the data port.",
            _num(port, "total_connections"),
        )
        yield counter(
            "exchange_connections_rejected_total",
            "Connections refused on the data port (connection limits, require_tls_remote).",
            _num(port, "rejected_connections"),
        )
        yield gauge(
            "exchange_connections_unauthenticated",
            "Data-port connections still in their TLS or shared-secret handshake.",
            _num(port, "unauthenticated_connections"),
        )
        yield counter(
            "exchange_connections_evicted_total",
            "Unauthenticated data-port connections dropped to admit a newcomer "
            "(max_unauthenticated_connections reached).",
            _num(port, "evicted_connections"),
        )
        yield gauge(
            "exchange_readers",
            "Subpartition readers served on the data port (one per remote input channel).",
            _num(port, "readers"),
        )
        yield gauge(
            "exchange_producers",
            "Producer tasks connected to the local endpoint.",
            _num(local, "producers"),
        )
        yield gauge(
            "exchange_consumers",
            "Consumer tasks connected to the local endpoint.",
            _num(local, "consumers"),
        )


def build_registry(daemon: DaemonView, **collector_args: Any) -> CollectorRegistry:
    """A fresh registry (never prometheus_client's global one) holding the daemon's collector."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(ExchangeCollector(daemon, **collector_args))
    return registry


# -- /api/stats ----------------------------------------------------------------------------


def _row_json(row: PartitionRow) -> dict[str, Any]:
    s = row.stats
    return {
        "id": f"{row.dataset}#{row.partition}@{row.attempt}",
        "dataset": row.dataset,
        "partition": row.partition,
        "attempt": row.attempt,
        "type": row.type,
        "subpartitions": s.num_subpartitions,
        "bytes_out": s.bytes_out,
        "buffers_out": s.buffers_out,
        "backlog": s.backlog,
        "out_pool_usage": s.out_pool_usage,
        "back_pressured_seconds": s.back_pressured_seconds,
        "finished": s.finished,
        "released": s.released,
    }


def _task_json(r: TaskReport, now: float) -> dict[str, Any]:
    return {
        "id": f"{r.task}/{r.gate}",
        "task": r.task,
        "gate": r.gate,
        "age_seconds": max(0.0, now - r.received_at),
        "metrics": dict(r.metrics),
    }


def _spill_json(daemon: DaemonView) -> dict[str, int] | None:
    """What the blocking partitions hold of the spill directory and in readers (all
    applications together); None for a daemon without them (``spill_space`` and
    ``reader_budget`` are read with ``getattr``)."""
    space = getattr(daemon, "spill_space", None)
    budget = getattr(daemon, "reader_budget", None)
    if space is None or budget is None:
        return None
    readers, memory = budget.totals()
    return {
        "bytes": space.total_used,
        "quota_per_app": space.quota or 0,
        "min_free": space.min_free,
        "readers": readers,
        "reader_memory_bytes": memory,
    }


def stats_snapshot(
    daemon: DaemonView,
    *,
    max_partitions: int = MAX_LABELLED_PARTITIONS,
    sent: SentCounters | None = None,
    clock: Callable[[], float] = time.time,
) -> dict[str, Any]:
    """Everything the dashboard shows, as a JSON-ready dict (``/api/stats``).

    ``time`` is the server's clock, so clients compute rates from the server's timestamps.
    ``partitions.items`` lists at most ``max_partitions`` partitions in registration order;
    ``partitions.other`` folds the rest the way the ``_other`` metric series do. Pass the
    collector's ``sent`` so ``data_port.bytes_sent_total`` matches ``exchange_bytes_sent_total``.
    ``tasks.items`` are the consumer task gates reporting figures (``TaskReport``), at most
    ``max_partitions`` of them, each with the age of its last report and its ``metrics``.
    ``jobs`` are the streaming jobs publishing their status here (``server.jobs.JobView``),
    the most recently updated first.
    """
    d = daemon
    now = float(clock())
    s = network_stats(d)
    summary = summarize_partitions(d.manager.partitions, max_partitions)
    totals = {k: float(v) for k, v in d.totals().items()}
    port: dict[str, Any] = dict(d.data_server.stats())
    bytes_sent, buffers_sent = (sent if sent is not None else SentCounters()).read(totals, port)
    port["bytes_sent_total"] = int(bytes_sent)
    port["buffers_sent_total"] = int(buffers_sent)
    other = None
    if summary.other is not None:
        other = {**_row_json(summary.other), "count": summary.num_other}
    reports = _task_reports(d)
    jobs = _job_views(d)
    cfg = d.config
    return {
        "daemon_id": d.daemon_id,
        "version": __version__,
        "data_address": d.data_address,
        "started_at": d.started_at,
        "time": now,
        "uptime_seconds": max(0.0, now - d.started_at),
        "shutting_down": bool(getattr(d, "shutting_down", False)),
        "network": {
            "total_segments": s.total_segments,
            "available_segments": s.available_segments,
            "used_segments": s.in_use_segments,
            "required_segments": s.required_segments,
            "overdraft_segments": s.overdraft_segments,
            "segment_size": s.segment_size,
            "local_pools": s.num_local_pools,
            "memory_bytes": s.total_segments * s.segment_size,
            "memory_used_bytes": s.in_use_segments * s.segment_size,
            "used_ratio": s.in_use_segments / s.total_segments if s.total_segments else 0.0,
        },
        "data_port": port,
        "local": dict(d.local_endpoint_stats()),
        "totals": totals,
        "partitions": {
            "count": summary.count,
            "by_type": summary.by_type,
            "finished_by_type": summary.finished_by_type,
            "items": [_row_json(r) for r in summary.rows],
            "other": other,
        },
        "tasks": {
            "count": len(reports),
            "items": [_task_json(r, now) for r in reports[:max_partitions]],
        },
        "jobs": [j.json(now) for j in reversed(jobs)],
        "spill": _spill_json(d),
        "config": {
            "network_memory": cfg.network_memory,
            "segment_size": cfg.segment_size,
            "buffer_timeout": cfg.buffer_timeout,
            "max_connections": cfg.max_connections,
            "exclusive_buffers_per_channel": cfg.exclusive_buffers_per_channel,
            "floating_buffers_per_gate": cfg.floating_buffers_per_gate,
            "debloat_enabled": cfg.debloat_enabled,
        },
    }
