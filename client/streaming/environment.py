"""StreamEnvironment and DataStream: Flink's job model on Spark's scheduler (the driver).

::

    env = StreamEnvironment(spark, checkpoint_interval="1s", mode="exactly_once",
                            checkpoint_dir="file:///data/ckpt")
    events = env.from_generator(make_event, count=100_000, parallelism=2)
    totals = (events.map(parse)
                    .key_by(lambda e: e["user"])
                    .process(RunningTotals(), parallelism=2))
    totals.sink_to_files("out/", parallelism=1)
    result = env.execute(restart_attempts=3)

``execute`` runs every subtask at once as the tasks of one Spark barrier stage (checked up
front: too few task slots is a clear error), the CheckpointCoordinator here in the driver
(the JobManager's role), talking to the tasks over the control channel
(``client.streaming.control``). A failed attempt (a task or its worker killed, a daemon
gone, too many failed checkpoints) is cancelled and the whole dataflow restarts from the
latest completed checkpoint, up to ``restart_attempts`` times with a backoff. Every
attempt has its own id (milliseconds since the epoch, so also distinct across drivers):
its partitions, files and control registration carry it, so nothing of a dead attempt
reaches the next.
"""

from __future__ import annotations

import contextlib
import operator
import os
import queue
import secrets
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from client.local_connection import release_dataset
from client.runtime import get_runtime
from client.streaming.checkpoint_storage import CheckpointMetadata, CheckpointStorage
from client.streaming.control import ControlServer
from client.streaming.functions import Operator
from client.streaming.graph import JobGraph, Node, Partitioning
from client.streaming.task import JobSpec, dataset_of, run_task
from exchange.checkpointing import CheckpointFailureReason
from exchange.checkpointing.coordinator import (
    CheckpointConfig,
    CheckpointCoordinator,
    CheckpointStatus,
    CompletedCheckpoint,
    DiscardCheckpoint,
    FailJob,
    FinalizeCheckpoint,
    NotifyAborted,
    NotifyComplete,
    TriggerCheckpoint,
)
from exchange.config_values import parse_duration
from exchange.errors import ExchangeError, UsageError
from exchange.state import DEFAULT_MAX_PARALLELISM

__all__ = ["DataStream", "JobFailedError", "JobResult", "KeyedStream", "StreamEnvironment"]


class JobFailedError(ExchangeError):
    """The job failed more often than ``restart_attempts`` allowed."""


@dataclass
class JobResult:
    """What ``execute`` returns."""

    job_id: str
    restarts: int
    checkpoints_completed: int
    last_checkpoint_id: int | None
    duration: float
    failures: list[str] = field(default_factory=list)
    #: every attempt's checkpoint history (the coordinator's, oldest first)
    checkpoints: list[CheckpointStatus] = field(default_factory=list)


class StreamEnvironment:
    """A streaming job being defined, and its execution."""

    def __init__(
        self,
        spark: Any,
        *,
        checkpoint_dir: str,
        checkpoint_interval: float | str = 1.0,
        mode: str = "exactly_once",
        checkpoint_timeout: float | str = 600.0,
        min_pause: float | str = 0.0,
        tolerable_failed_checkpoints: int = 0,
        retained_checkpoints: int = 1,
        max_parallelism: int = DEFAULT_MAX_PARALLELISM,
        daemon: str | None = None,
        job_id: str | None = None,
        buffer_timeout: float | str = 0.01,
    ) -> None:
        self.sc = spark.sparkContext if hasattr(spark, "sparkContext") else spark
        self.config = CheckpointConfig(
            interval=parse_duration(checkpoint_interval, "checkpoint_interval"),
            timeout=parse_duration(checkpoint_timeout, "checkpoint_timeout"),
            min_pause=parse_duration(min_pause, "min_pause"),
            tolerable_failed_checkpoints=tolerable_failed_checkpoints,
            retained=retained_checkpoints,
            mode=mode,
        )
        if not isinstance(checkpoint_dir, str) or not checkpoint_dir:
            raise UsageError(f"checkpoint_dir must be a path or URL, got {checkpoint_dir!r}")
        self.checkpoint_dir = checkpoint_dir
        self.max_parallelism = max_parallelism
        #: how long a record may wait in a task's partly filled output buffer (Flink's
        #: ``setBufferTimeout``)
        self.buffer_timeout = parse_duration(buffer_timeout, "buffer_timeout")
        self.daemon = daemon
        self.job_id = job_id or f"job{uuid.uuid4().hex[:12]}"
        self._nodes: list[Node] = []
        self._cancel = threading.Event()

    # -- building --------------------------------------------------------------------------

    def _add(
        self,
        factory: Callable[[], Operator],
        name: str,
        parallelism: int,
        inputs: list[tuple[Node, Partitioning, Callable[[Any], Any] | None]],
        *,
        is_source: bool = False,
        keyed: bool = False,
    ) -> Node:
        if type(parallelism) is not int or parallelism < 1:
            raise UsageError(f"{name}: parallelism must be an int >= 1, got {parallelism!r}")
        node = Node(
            len(self._nodes),
            name,
            factory,
            parallelism,
            is_source=is_source,
            key_fn=operator.itemgetter(0) if keyed else None,
            inputs=inputs,
        )
        for up, _, _ in inputs:
            up.outputs.append(node)
        self._nodes.append(node)
        return node

    def _name(self, name: str | None, kind: str) -> str:
        return name or f"{kind}{len(self._nodes)}"

    def add_source(
        self, factory: Callable[[], Operator], *, parallelism: int = 1, name: str | None = None
    ) -> DataStream:
        """A source built by ``factory()`` (a ``client.streaming.functions.Source``)."""
        node = self._add(factory, self._name(name, "source"), parallelism, [], is_source=True)
        return DataStream(self, node)

    def from_generator(
        self,
        fn: Callable[[int], Any],
        *,
        count: int | None = None,
        rate: float | None = None,
        parallelism: int = 1,
        name: str | None = None,
    ) -> DataStream:
        """Records ``fn(0), fn(1), ...`` (``count`` of them, or unbounded), replayable."""
        from client.streaming.connectors import GeneratorSource

        GeneratorSource(fn, count=count, rate=rate)  # validate now, in the driver
        return self.add_source(
            lambda: GeneratorSource(fn, count=count, rate=rate),
            parallelism=parallelism,
            name=name or self._name(None, "generator"),
        )

    def from_files(
        self,
        path: str,
        *,
        format: str = "jsonl",
        watch: bool = False,
        parallelism: int = 1,
        name: str | None = None,
    ) -> DataStream:
        """Records of the files ``path`` names (a glob or directory; JSON lines, CSV or
        Parquet), split by file across subtasks; ``watch`` keeps looking for new files."""
        from client.streaming.connectors import FileSource

        FileSource(path, format=format, watch=watch)
        return self.add_source(
            lambda: FileSource(path, format=format, watch=watch),
            parallelism=parallelism,
            name=name or self._name(None, "files"),
        )

    def cancel(self) -> None:
        """Stop the running job (from another thread): ``execute`` raises JobFailedError."""
        self._cancel.set()

    # -- running ---------------------------------------------------------------------------

    def _check_slots(self, needed: int) -> None:
        from client.spark import _slots

        slots = _slots(self.sc)
        if needed > slots:
            raise UsageError(
                f"the job needs {needed} task slots at once (one per subtask: a barrier "
                f"stage), the cluster has {slots}; lower the parallelism or add cores"
            )

    def execute(self, *, restart_attempts: int = 3, restart_backoff: float = 1.0) -> JobResult:
        """Run the job until its bounded input is exhausted (or it is cancelled)."""
        if type(restart_attempts) is not int or restart_attempts < 0:
            raise UsageError(f"restart_attempts must be an int >= 0, got {restart_attempts!r}")
        graph = JobGraph.build(self._nodes, self.max_parallelism)
        if not any(v.is_source for v in graph.vertices):
            raise UsageError("the job has no source")
        self._check_slots(graph.num_tasks)
        if self.daemon is None:
            from client.spark import _daemon_hint

            self.daemon = _daemon_hint(self.sc)  # local mode: the embedded daemon
        storage = CheckpointStorage(self.checkpoint_dir, retained=self.config.retained)
        started = time.monotonic()
        failures: list[str] = []
        completed = 0
        history: list[CheckpointStatus] = []
        last_attempt = 0
        for restart in range(restart_attempts + 1):
            attempt = max(time.time_ns() // 1_000_000, last_attempt + 1)
            last_attempt = attempt
            run = _Attempt(self, graph, storage, attempt)
            error = run.run()
            completed += run.completed
            history.extend(run.history)
            if error is None:
                latest = storage.latest_completed()
                return JobResult(
                    self.job_id,
                    restart,
                    completed,
                    latest.checkpoint_id if latest else None,
                    time.monotonic() - started,
                    failures,
                    history,
                )
            failures.append(error)
            if self._cancel.is_set():
                break
            if restart < restart_attempts:
                time.sleep(restart_backoff * (2**restart))
        raise JobFailedError(
            f"job {self.job_id} failed after {len(failures)} attempt(s): {failures[-1]}"
        )


class _Attempt:
    """One attempt of a job: the Spark barrier stage plus the coordinator loop."""

    def __init__(
        self, env: StreamEnvironment, graph: JobGraph, storage: CheckpointStorage, attempt: int
    ) -> None:
        self.env = env
        self.graph = graph
        self.storage = storage
        self.attempt = attempt
        self.task_ids = [t.task_id for t in graph.tasks]
        self.completed = 0
        self.history: tuple[CheckpointStatus, ...] = ()

    def run(self) -> str | None:
        env, graph = self.env, self.graph
        latest = self.storage.latest_completed()
        token = secrets.token_hex(16)
        server = ControlServer(token, self.attempt, set(self.task_ids), host=_driver_host(env))
        job = JobSpec(
            env.job_id,
            self.attempt,
            token,
            server.address,
            graph,
            env.checkpoint_dir,
            env.config.mode,
            env.daemon,
            env.buffer_timeout,
        )
        restored = None
        restore_msg = None
        if latest is not None:
            files = {
                t: self.storage.task_state_path(latest.checkpoint_id, t) for t in latest.task_files
            }
            restored = CompletedCheckpoint(
                latest.checkpoint_id, latest.timestamp, files, latest.finished_tasks
            )
            restore_msg = {"checkpoint_id": latest.checkpoint_id, "files": files}
        coord = CheckpointCoordinator(
            env.config,
            self.task_ids,
            clock=time.monotonic,
            source_tasks=graph.source_task_ids(),
            restored=restored,
        )
        group = f"{env.job_id}-{self.attempt}"
        outcome: queue.Queue[BaseException | None] = queue.Queue()
        sc = env.sc
        n = graph.num_tasks

        def stage() -> None:
            try:
                sc.setJobGroup(group, f"streaming job {env.job_id}", interruptOnCancel=True)
                rdd = sc.parallelize(range(n), n).barrier()
                rdd.mapPartitions(lambda it: [run_task(job, i) for i in it]).collect()
                outcome.put(None)
            except BaseException as e:
                outcome.put(e)

        thread = threading.Thread(target=stage, name=f"stream-{group}", daemon=True)
        thread.start()
        daemons: dict[str, dict[str, Any]] = {}
        exhausted: set[str] = set()
        finished: set[str] = set()
        sources = set(graph.source_task_ids())
        error: str | None = None
        started = False
        try:
            while True:
                with contextlib.suppress(queue.Empty):
                    done = outcome.get_nowait()
                    if done is not None and error is None:
                        error = f"the Spark stage failed: {type(done).__name__}: {done}"
                    if done is None and len(finished) < n and error is None:
                        error = "the Spark stage ended before every task finished"
                    break
                if env._cancel.is_set() and error is None:
                    error = "cancelled"
                    sc.cancelJobGroup(group)
                deadline = coord.next_deadline() if started else None
                wait = (
                    0.05 if deadline is None else min(0.05, max(0.0, deadline - time.monotonic()))
                )
                try:
                    task, msg = server.inbox.get(timeout=wait)
                except queue.Empty:
                    task, msg = "", None
                if msg is not None:
                    kind = msg["type"]
                    if kind == "register":
                        daemons[task] = msg["daemon"]
                        if len(daemons) == n:
                            server.broadcast(
                                {"type": "start", "daemons": daemons, "restore": restore_msg}
                            )
                            coord.start()
                            started = True
                    elif kind == "ack":
                        coord.acknowledge(task, msg["checkpoint"], msg["handle"])
                    elif kind == "decline":
                        reason = CheckpointFailureReason[msg.get("reason", "DECLINED")]
                        coord.decline(task, msg["checkpoint"], reason)
                    elif kind == "exhausted":
                        exhausted.add(task)
                        if exhausted >= sources:
                            coord.request_final_checkpoint()
                    elif kind == "finished":
                        finished.add(task)
                    elif kind in ("failed", "lost") and error is None:
                        error = f"task {task} {kind}: {msg.get('error', '')}".strip()
                        sc.cancelJobGroup(group)
                if started and error is None:
                    coord.tick()
                    self._execute(coord, server, sources)
                    if coord.stats().completed > self.completed:
                        self.completed = coord.stats().completed
        finally:
            self.history = coord.history
            if error is not None:
                sc.cancelJobGroup(group)
            thread.join(60)
            server.close()
            self._release(daemons)
        return error

    def _execute(
        self, coord: CheckpointCoordinator, server: ControlServer, sources: set[str]
    ) -> None:
        for cmd in coord.poll_commands():
            match cmd:
                case TriggerCheckpoint():
                    server.broadcast(
                        {
                            "type": "trigger",
                            "checkpoint": cmd.checkpoint_id,
                            "timestamp": cmd.timestamp,
                            "exactly_once": cmd.exactly_once,
                        },
                        set(cmd.tasks),
                    )
                case FinalizeCheckpoint():
                    try:
                        self.storage.commit(
                            CheckpointMetadata(
                                cmd.checkpoint_id,
                                cmd.timestamp,
                                {t: os.path.basename(str(h)) for t, h in cmd.handles.items()},
                                cmd.finished_tasks,
                                cmd.is_final,
                            )
                        )
                    except Exception as e:
                        coord.finalize_failed(cmd.checkpoint_id, str(e))
                    else:
                        coord.checkpoint_finalized(cmd.checkpoint_id)
                        self.storage.apply_retention()
                case NotifyComplete():
                    server.broadcast({"type": "complete", "checkpoint": cmd.checkpoint_id})
                    if cmd.is_final:
                        server.broadcast({"type": "finish"})
                case NotifyAborted():
                    server.broadcast({"type": "abort", "checkpoint": cmd.checkpoint_id})
                case DiscardCheckpoint():
                    if cmd.whole_checkpoint:
                        with contextlib.suppress(Exception):
                            self.storage.discard(cmd.checkpoint_id)
                    else:
                        for h in cmd.handles.values():
                            with contextlib.suppress(Exception):
                                self.storage.fs.rm_file(str(h))
                case FailJob():
                    raise _AttemptFailed(cmd.reason)

    def _release(self, daemons: dict[str, dict[str, Any]]) -> None:
        """Release this attempt's partitions on every daemon its tasks used: tasks killed
        hard release nothing themselves."""
        addresses = {d["data"] for d in daemons.values()}
        for edge in self.graph.edges:
            for address in addresses:
                with contextlib.suppress(Exception):
                    get_runtime().run(
                        release_dataset(address, dataset_of(self.env.job_id, self.attempt, edge))
                    )


class _AttemptFailed(Exception):
    pass


def _driver_host(env: StreamEnvironment) -> str:
    host = env.sc.getConf().get("spark.driver.host", "127.0.0.1")
    return str(host)


class DataStream:
    """A stream of records in the job being defined."""

    def __init__(
        self,
        env: StreamEnvironment,
        node: Node,
        partitioning: Partitioning = Partitioning.FORWARD,
        key_fn: Callable[[Any], Any] | None = None,
    ) -> None:
        self.env = env
        self.node = node
        self._part = partitioning
        self._key_fn = key_fn

    def _then(
        self,
        factory: Callable[[], Operator],
        kind: str,
        name: str | None,
        parallelism: int | None,
        *,
        keyed: bool = False,
    ) -> DataStream:
        node = self.env._add(
            factory,
            self.env._name(name, kind),
            self.node.parallelism if parallelism is None else parallelism,
            [(self.node, self._part, self._key_fn)],
            keyed=keyed,
        )
        return DataStream(self.env, node)

    def map(
        self, fn: Callable[[Any], Any], *, name: str | None = None, parallelism: int | None = None
    ) -> DataStream:
        from client.streaming.operators import MapOperator

        MapOperator(fn)
        return self._then(lambda: MapOperator(fn), "map", name, parallelism)

    def flat_map(
        self, fn: Callable[[Any], Any], *, name: str | None = None, parallelism: int | None = None
    ) -> DataStream:
        from client.streaming.operators import FlatMapOperator

        FlatMapOperator(fn)
        return self._then(lambda: FlatMapOperator(fn), "flatmap", name, parallelism)

    def filter(
        self, fn: Callable[[Any], Any], *, name: str | None = None, parallelism: int | None = None
    ) -> DataStream:
        from client.streaming.operators import FilterOperator

        FilterOperator(fn)
        return self._then(lambda: FilterOperator(fn), "filter", name, parallelism)

    def rebalance(self) -> DataStream:
        return DataStream(self.env, self.node, Partitioning.REBALANCE)

    def broadcast(self) -> DataStream:
        return DataStream(self.env, self.node, Partitioning.BROADCAST)

    def key_by(self, key_fn: Callable[[Any], Any], *, name: str | None = None) -> KeyedStream:
        """Partition by ``key_fn(record)``: records travel as ``(key, record)`` pairs to the
        subtask owning the key's key group."""
        from client.streaming.operators import KeyByOperator

        KeyByOperator(key_fn)
        keyed = self._then(lambda: KeyByOperator(key_fn), "keyby", name, None)
        return KeyedStream(keyed)

    def sink_to(
        self,
        factory: Callable[[], Operator],
        *,
        name: str | None = None,
        parallelism: int | None = None,
    ) -> None:
        self._then(factory, "sink", name, parallelism)

    def sink_to_files(
        self, directory: str, *, format: str = "jsonl", parallelism: int | None = None
    ) -> None:
        """Exactly-once files (two-phase commit): visible once their checkpoint completes."""
        from client.streaming.connectors import FileSink

        FileSink(directory, format=format)
        self.sink_to(
            lambda: FileSink(directory, format=format),
            name=self.env._name(None, "filesink"),
            parallelism=parallelism,
        )


class KeyedStream:
    """A stream after ``key_by``: ``process`` runs a keyed function with keyed state."""

    def __init__(self, pairs: DataStream) -> None:
        self._pairs = pairs

    def process(
        self, fn: Any, *, name: str | None = None, parallelism: int | None = None
    ) -> DataStream:
        from client.streaming.operators import KeyedProcessOperator

        KeyedProcessOperator(fn)
        hashed = DataStream(
            self._pairs.env, self._pairs.node, Partitioning.HASH, operator.itemgetter(0)
        )
        return hashed._then(
            lambda: KeyedProcessOperator(fn), "process", name, parallelism, keyed=True
        )
