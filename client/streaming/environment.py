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
import logging
import operator
import os
import pickle
import queue
import re
import secrets
import signal
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Final

from client.local_connection import mint_app_credential, release_dataset, resolve_secret
from client.runtime import get_runtime
from client.streaming.checkpoint_storage import (
    CheckpointLease,
    CheckpointLeaseError,
    CheckpointMetadata,
    CheckpointStorage,
    operator_files,
)
from client.streaming.control import ControlLost, ControlServer
from client.streaming.functions import Operator, Source
from client.streaming.graph import JobGraph, Node, Partitioning, check_operator_id
from client.streaming.job_status import AttemptFailure, FailureCollector, JobStatusTracker
from client.streaming.runners import Runner, runner_for
from client.streaming.task import JobSpec, dataset_of
from exchange.best_effort import best_effort
from exchange.checkpointing import AlignmentMode
from exchange.checkpointing.coordinator import (
    CheckpointConfig,
    CheckpointCoordinator,
    CompletedCheckpoint,
    DiscardCheckpoint,
    FailJob,
    FinalizeCheckpoint,
    NotifyAborted,
    NotifyComplete,
    TriggerCheckpoint,
)
from exchange.config_values import parse_duration, parse_size
from exchange.errors import ConfigError, ExchangeError, UsageError
from exchange.protocol.driver_messages import (
    CheckpointAbort,
    CheckpointAck,
    CheckpointComplete,
    CheckpointDecline,
    CheckpointTrigger,
    FinishTask,
    RegisterTask,
    RestorePoint,
    SourceExhausted,
    StartTask,
    StopInput,
    TaskDaemon,
    TaskFailed,
    TaskFinished,
)
from exchange.protocol.messages import Message
from exchange.state import DEFAULT_MAX_PARALLELISM, NonRestoredStateError, checkpoint_key
from exchange.state.key_groups import MAX_MAX_PARALLELISM

__all__ = [
    "AttemptFailure",
    "CheckpointInfo",
    "DataStream",
    "JobFailedError",
    "JobResult",
    "KeyedStream",
    "StreamEnvironment",
]

#: Seconds a failed attempt waits, after its Spark stage ended, for its tasks' connections
#: to end: the failure reports still in flight decide the attempt's root cause.
_LATE_REPORTS_WAIT = 10.0

log = logging.getLogger("exchange.streaming.driver")


class JobFailedError(ExchangeError):
    """The job failed more often than ``restart_attempts`` allowed, or was cancelled hard;
    ``failures`` holds each attempt's root cause, oldest first; ``failure_history`` the
    same with each root cause's consequences."""

    def __init__(
        self,
        message: str,
        failures: list[str],
        failure_history: list[AttemptFailure] | None = None,
    ) -> None:
        super().__init__(message)
        self.failures = failures
        self.failure_history = failure_history if failure_history is not None else []


@dataclass(frozen=True)
class CheckpointInfo:
    """One completed checkpoint, as ``JobResult.checkpoints`` lists it."""

    checkpoint_id: int
    #: seconds from the trigger to the metadata being durable
    duration: float
    #: the longest alignment of any task (seconds from its first barrier to its snapshot)
    alignment: float
    #: bytes of state written by all tasks
    bytes: int
    is_final: bool = False
    #: some task triggered it unaligned (mode unaligned; at its first barrier, or when its
    #: alignment outlasted ``aligned_checkpoint_timeout``)
    unaligned: bool = False
    #: per task, the bytes of in-flight input it persisted as channel state (unaligned)
    persisted_bytes: dict[str, int] = field(default_factory=dict)
    #: bytes all tasks processed (``block_upstream``) or parked in memory or spill files
    #: (``buffer``, ``spill``) while aligning this checkpoint
    aligned_bytes: int = 0


@dataclass
class JobResult:
    """What ``execute`` returns."""

    job_id: str
    restarts: int
    checkpoints_completed: int
    last_checkpoint_id: int | None
    duration: float
    #: the root cause of each failed attempt, oldest first
    failures: list[str] = field(default_factory=list)
    #: every checkpoint completed by this driver, oldest first, over all attempts
    checkpoints: list[CheckpointInfo] = field(default_factory=list)
    #: (checkpoint id, reason) of every checkpoint aborted by this driver
    aborted_checkpoints: list[tuple[int, str]] = field(default_factory=list)
    #: records each task of the last attempt took in (a source: records it emitted)
    records: dict[str, int] = field(default_factory=dict)
    #: True when the job ended by ``cancel()`` / Ctrl-C (a clean stop), not end of input
    stopped: bool = False
    #: sink name -> the records of a ``CollectSink`` (``DataStream.collect``), exactly
    #: once: those of completed checkpoints, subtask by subtask, each in arrival order
    collected: dict[str, list[Any]] = field(default_factory=dict)
    #: True when nothing ran: the checkpoint directory holds the final checkpoint of a job
    #: that already read all its input (a rerun; use a new ``checkpoint_dir`` to run again)
    already_finished: bool = False
    #: each failed attempt's root cause with the failures that followed from it
    failure_history: list[AttemptFailure] = field(default_factory=list)


#: ``CheckpointMetadata.extra["ended"]`` of a final checkpoint taken because every source
#: read all its input (not a clean stop, after which a new driver resumes)
_ENDED_INPUT: Final = "input"

#: What a job id may be: it names the job's exchanges and its checkpoint directory.
_JOB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


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
        secret_file: str | None = None,
        lease_timeout: float | str = 30.0,
        aligned_checkpoint_timeout: float | str | None = None,
        alignment: str = "block_upstream",
        alignment_limit: int | str | None = None,
        alignment_spill_dir: str | None = None,
    ) -> None:
        # the arguments first, Spark last: a bad argument is named before Spark is touched
        #: how long a record may wait in a task's partly filled output buffer (Flink's
        #: ``setBufferTimeout``)
        self.buffer_timeout = parse_duration(buffer_timeout, "buffer_timeout")
        if type(max_parallelism) is not int or not 1 <= max_parallelism <= MAX_MAX_PARALLELISM:
            raise UsageError(
                f"max_parallelism must be an int in [1, {MAX_MAX_PARALLELISM}], "
                f"got {max_parallelism!r}"
            )
        if job_id is not None and (not isinstance(job_id, str) or not _JOB_ID.fullmatch(job_id)):
            raise UsageError(
                f"job_id must be 1 to 64 letters, digits, '.', '_' or '-' (starting with a "
                f"letter or digit), got {job_id!r}"
            )
        if daemon is not None and (not isinstance(daemon, str) or not daemon):
            raise UsageError(f"daemon must be a socket path or address, got {daemon!r}")
        if secret_file is not None and (not isinstance(secret_file, str) or not secret_file):
            raise UsageError(f"secret_file must be a path, got {secret_file!r}")
        #: the daemons' shared secret (None: $EXCHANGE_SECRET_FILE, else none): it keys the
        #: checkpoint files (an HMAC per file; ``exchange.state.checkpoint_key``)
        self.secret_file = secret_file
        #: how long the driver's lease on the checkpoint directory lasts unless renewed
        #: (every third of it): a dead driver's lease frees the job after that long
        self.lease_timeout = parse_duration(lease_timeout, "lease_timeout")
        if not self.lease_timeout > 0:
            raise UsageError(f"lease_timeout must be > 0, got {lease_timeout!r}")
        self.config = CheckpointConfig(
            interval=parse_duration(checkpoint_interval, "checkpoint_interval"),
            timeout=parse_duration(checkpoint_timeout, "checkpoint_timeout"),
            min_pause=parse_duration(min_pause, "min_pause"),
            tolerable_failed_checkpoints=tolerable_failed_checkpoints,
            retained=retained_checkpoints,
            mode=mode,
            aligned_checkpoint_timeout=(
                None
                if aligned_checkpoint_timeout is None
                else parse_duration(aligned_checkpoint_timeout, "aligned_checkpoint_timeout")
            ),
        )
        #: how exactly-once alignment holds back the channels that delivered a barrier:
        #: ``block_upstream`` (at the producer), ``buffer`` (parked in the task's memory)
        #: or ``spill`` (parked in private files of the task, removed once replayed and
        #: when the task ends); ``alignment_limit`` bytes (None: the daemon's
        #: ``checkpoint_alignment_limit``) aborts an alignment that holds more
        self.alignment = AlignmentMode.parse(alignment, "alignment")
        if (
            self.alignment is not AlignmentMode.BLOCK_UPSTREAM
            and self.config.mode != "exactly_once"
        ):
            raise ConfigError(
                "alignment",
                f"{self.alignment.value!r} applies to mode 'exactly_once' (barriers are "
                f"aligned), not {self.config.mode!r}",
            )
        self.alignment_limit = (
            None if alignment_limit is None else parse_size(alignment_limit, "alignment_limit")
        )
        if alignment_spill_dir is not None and (
            not isinstance(alignment_spill_dir, str) or not alignment_spill_dir
        ):
            raise ConfigError(
                "alignment_spill_dir", f"must be a directory path, got {alignment_spill_dir!r}"
            )
        self.alignment_spill_dir = alignment_spill_dir
        if not isinstance(checkpoint_dir, str) or not checkpoint_dir:
            raise UsageError(f"checkpoint_dir must be a path or URL, got {checkpoint_dir!r}")
        self.checkpoint_dir = checkpoint_dir
        sc = getattr(spark, "sparkContext", spark)
        if spark is not None and not hasattr(sc, "parallelize"):
            raise UsageError(f"spark must be a SparkSession or SparkContext, got {spark!r}")
        self.sc = sc  # None: a job graph is built, never executed
        self.max_parallelism = max_parallelism
        self.daemon = daemon
        self.job_id = job_id or f"job{uuid.uuid4().hex[:12]}"
        self._nodes: list[Node] = []
        self._next_checkpoint_id = 1  # above every id an attempt of this driver used
        self._stop = threading.Event()  # clean stop: final checkpoint, then end
        self._cancel = threading.Event()  # hard cancel
        #: checks run before a job's first start (not before a restore)
        self._preflight: list[Callable[[], None]] = []
        self._runner: Runner | None = None  # set by execute
        #: the running (or last) job's status, published to the driver's local daemon
        self.status: JobStatusTracker | None = None
        #: the Spark application's credential, minted at execute (None: no secret here)
        self.credential: bytes | None = None

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
        """A source built by ``factory()`` (a ``client.streaming.functions.Source``): every
        subtask, and every attempt after a restart, calls it for a new instance."""
        _check_factory(factory, "add_source", "factory", Source)
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

        return self.add_source(  # validates its arguments now, in the driver
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

        # validated now; before a first start (nothing to restore) a bounded source must
        # also find a file
        self._preflight.append(FileSource(path, format=format, watch=watch).check_input)
        return self.add_source(
            lambda: FileSource(path, format=format, watch=watch),
            parallelism=parallelism,
            name=name or self._name(None, "files"),
        )

    def cancel(self) -> None:
        """Stop the running job (any thread; Ctrl-C in ``execute`` does the same).

        The first call is a clean stop: the sources stop reading, a final checkpoint is
        taken, sinks commit everything up to it, and ``execute`` returns a JobResult with
        ``stopped=True`` (a new driver resumes from that checkpoint). A second call (or a
        second Ctrl-C) cancels at once: ``execute`` raises JobFailedError and what was not
        committed stays uncommitted."""
        if self._stop.is_set():
            self._cancel.set()
        self._stop.set()

    # -- running ---------------------------------------------------------------------------

    def execute(
        self,
        *,
        restart_attempts: int = 3,
        restart_backoff: float = 1.0,
        allow_non_restored_state: bool = False,
        runner: str | Runner = "spark",
    ) -> JobResult:
        """Run the job until its bounded input is exhausted (or it is cancelled).

        ``runner``: ``"spark"`` (every task one task of a Spark barrier stage) or
        ``"local"`` (every task a local Python process, no JVM: ``client.streaming.runners``);
        a ``LocalRunner`` instance gives access to its task processes.

        The job resumes from the latest completed checkpoint in ``checkpoint_dir``; state
        there of an operator uid this job does not have raises NonRestoredStateError
        (naming it) unless ``allow_non_restored_state`` drops it (Flink's
        ``allowNonRestoredState``). Another live driver of the same checkpoint directory
        raises CheckpointLeaseError naming it. Before a first start (nothing to restore) a
        bounded file source must find a file (SourceNotFoundError); a checkpoint directory
        whose job already read all its input runs nothing (``JobResult.already_finished``)."""
        if type(restart_attempts) is not int or restart_attempts < 0:
            raise UsageError(f"restart_attempts must be an int >= 0, got {restart_attempts!r}")
        if (
            not isinstance(restart_backoff, (int, float))
            or isinstance(restart_backoff, bool)
            or not 0 <= restart_backoff < float("inf")
        ):
            raise UsageError(
                f"restart_backoff must be a number of seconds >= 0, got {restart_backoff!r}"
            )
        if not isinstance(allow_non_restored_state, bool):
            raise UsageError(
                f"allow_non_restored_state must be a bool, got {allow_non_restored_state!r}"
            )
        the_runner = runner_for(runner, self.sc)
        graph = JobGraph.build(self._nodes, self.max_parallelism)
        if not any(v.is_source for v in graph.vertices):
            raise UsageError("the job has no source")
        self.daemon = the_runner.prepare(graph, self.daemon)
        self._runner = the_runner
        secret = resolve_secret(self.secret_file)
        key = checkpoint_key(secret, self.job_id) if secret is not None else None
        # the application's credential, minted here: its tasks get it, never the secret
        self.credential = mint_app_credential(the_runner.application_id(), self.secret_file)
        storage = CheckpointStorage(self.checkpoint_dir, retained=self.config.retained, key=key)
        lease = storage.acquire_lease(
            f"driver of job {self.job_id} ({the_runner.describe()})", self.lease_timeout
        )
        try:
            latest = storage.latest_completed()
            _check_restorable(latest, graph, allow_non_restored_state)
            if latest is None:
                for check in self._preflight:
                    check()
            elif latest.is_final and latest.extra.get("ended") == _ENDED_INPUT:
                log.warning(
                    "job %s: checkpoint %d in %s is the final checkpoint of a job that read "
                    "all its input; nothing to run (use a new checkpoint_dir to run the job "
                    "again)",
                    self.job_id,
                    latest.checkpoint_id,
                    self.checkpoint_dir,
                )
                return JobResult(
                    self.job_id, 0, 0, latest.checkpoint_id, 0.0, already_finished=True
                )
            lease.keep_alive()
            with self._ctrl_c_stops():
                return self._run(graph, storage, lease, restart_attempts, restart_backoff)
        finally:
            lease.release()

    @contextlib.contextmanager
    def _ctrl_c_stops(self) -> Iterator[None]:
        """Ctrl-C in the driver (SIGINT, main thread) is ``cancel()``: a clean stop, a
        second one cancels. PySpark's own handler would cancel every Spark job at once."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return

        def on_sigint(signum: int, frame: Any) -> None:
            self.cancel()

        previous = signal.signal(signal.SIGINT, on_sigint)
        try:
            yield
        finally:
            signal.signal(signal.SIGINT, previous)

    def _run(
        self,
        graph: JobGraph,
        storage: CheckpointStorage,
        lease: CheckpointLease,
        restart_attempts: int,
        restart_backoff: float,
    ) -> JobResult:
        self.status = status = JobStatusTracker(self.job_id, self.daemon, secret=self.credential)
        assert self._runner is not None
        log.info(
            "job %s: %d tasks (%s) on %s, %s checkpoints every %g s in %s%s",
            self.job_id,
            graph.num_tasks,
            ", ".join(f"{v.name} x{v.parallelism}" for v in graph.vertices),
            self._runner.name,
            self.config.mode,
            self.config.interval,
            self.checkpoint_dir,
            "" if (url := _dashboard_url(self.daemon)) is None else f"; dashboard {url}",
        )
        started = time.monotonic()
        failures: list[str] = []
        history: list[AttemptFailure] = []
        checkpoints: list[CheckpointInfo] = []
        aborted: list[tuple[int, str]] = []
        last_attempt = 0
        for restart in range(restart_attempts + 1):
            attempt = max(time.time_ns() // 1_000_000, last_attempt + 1)
            last_attempt = attempt
            run = _Attempt(self, graph, storage, attempt, lease)
            status.attempt_started(attempt, graph)
            error = run.run()
            checkpoints.extend(run.checkpoints)
            aborted.extend(run.aborted)
            if error is None:
                status.job_ended("FINISHED")
                latest = storage.latest_completed()
                result = JobResult(
                    self.job_id,
                    restart,
                    len(checkpoints),
                    latest.checkpoint_id if latest else None,
                    time.monotonic() - started,
                    failures,
                    checkpoints,
                    aborted,
                    run.records,
                    stopped=self._stop.is_set(),
                    collected=run.collected(),
                    failure_history=history,
                )
                log.info(
                    "job %s %s in %.1f s: %d restarts, %d checkpoints, last %s",
                    self.job_id,
                    "stopped" if result.stopped else "finished",
                    result.duration,
                    restart,
                    len(checkpoints),
                    result.last_checkpoint_id,
                )
                return result
            failures.append(error)
            if run.failure is not None:
                history.append(run.failure)
                if run.failure.consequences:
                    log.info(
                        "job %s attempt %d failed: %s; consequences: %s",
                        self.job_id,
                        attempt,
                        error,
                        " | ".join(c[:200] for c in run.failure.consequences),
                    )
            status.attempt_failed(error)
            if lease.lost is not None:  # another driver runs the job now: never restart
                status.job_ended("FAILED")
                raise lease.lost
            if self._cancel.is_set():
                break
            if restart < restart_attempts:
                backoff = restart_backoff * (2**restart)
                log.warning(
                    "job %s: attempt %d failed, restarting in %.1f s (restart %d of %d) from "
                    "the latest completed checkpoint, because %s",
                    self.job_id,
                    attempt,
                    backoff,
                    restart + 1,
                    restart_attempts,
                    error.splitlines()[0] if error else error,
                )
                self._cancel.wait(backoff)
                if self._cancel.is_set():
                    break
        status.job_ended("CANCELED" if self._cancel.is_set() else "FAILED")
        log.error(
            "job %s failed after %d attempt(s): %s",
            self.job_id,
            len(failures),
            failures[-1].splitlines()[0] if failures[-1] else failures[-1],
        )
        raise JobFailedError(
            f"job {self.job_id} failed after {len(failures)} attempt(s): {failures[-1]}",
            failures,
            history,
        )


class _Attempt:
    """One attempt of a job: the Spark barrier stage plus the coordinator loop."""

    def __init__(
        self,
        env: StreamEnvironment,
        graph: JobGraph,
        storage: CheckpointStorage,
        attempt: int,
        lease: CheckpointLease,
    ) -> None:
        self.env = env
        self.lease = lease
        self.graph = graph
        self.storage = storage
        self.attempt = attempt
        self.task_ids = [t.task_id for t in graph.tasks]
        self.sources = set(graph.source_task_ids())
        self.checkpoints: list[CheckpointInfo] = []
        self.aborted: list[tuple[int, str]] = []
        self.records: dict[str, int] = {}
        # checkpoint -> (alignment, state bytes, aligned bytes)
        self._acks: dict[int, tuple[float, int, int]] = {}
        #: checkpoint -> task -> in-flight bytes it persisted (an unaligned trigger there)
        self._unaligned: dict[int, dict[str, int]] = {}
        #: collect sink name -> subtask -> its records (from the tasks' ``finished``)
        self._collected: dict[str, dict[int, list[Any]]] = {}

    def collected(self) -> dict[str, list[Any]]:
        """Every collect sink's records, subtask by subtask."""
        return {
            name: [r for _, records in sorted(parts.items()) for r in records]
            for name, parts in self._collected.items()
        }

    def run(self) -> str | None:
        env, graph = self.env, self.graph
        runner = env._runner
        assert runner is not None
        latest = self.storage.latest_completed()
        token = secrets.token_hex(16)
        server = ControlServer(token, self.attempt, set(self.task_ids), host=runner.driver_host())
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
            self.storage.key,
            env.credential,
            env.config.aligned_checkpoint_timeout,
            alignment=env.alignment.value,
            alignment_limit=env.alignment_limit,
            alignment_spill_dir=env.alignment_spill_dir,
        )
        restored = None
        restore_msg = None
        if latest is not None:
            cid = latest.checkpoint_id
            files = {t: self.storage.state_path(cid, n) for t, n in latest.task_files.items()}
            restored = CompletedCheckpoint(cid, latest.timestamp, files, latest.finished_tasks)
            uids = graph.operator_tasks()
            # only operators of this job: what else the checkpoint holds was checked (and
            # allowed to be dropped) before the first attempt
            ops = {uid: list(f) for uid, f in latest.operators.items() if uid in uids}
            restore_msg = RestorePoint(cid, {uid: tuple(f) for uid, f in ops.items()})
        log.info(
            "job %s: attempt %d starting %d tasks, %s",
            env.job_id,
            self.attempt,
            graph.num_tasks,
            "no checkpoint to restore"
            if latest is None
            else f"restoring checkpoint {latest.checkpoint_id}",
        )
        used = self.storage.checkpoint_ids()  # never reuse an id an earlier attempt used
        coord = CheckpointCoordinator(
            env.config,
            self.task_ids,
            clock=time.monotonic,
            source_tasks=graph.source_task_ids(),
            restored=restored,
            first_checkpoint_id=max([env._next_checkpoint_id, *(i + 1 for i in used)]),
        )
        group = f"{env.job_id}-{self.attempt}"
        n = graph.num_tasks
        try:
            stage = runner.launch(job, group)
        except BaseException:
            server.close()
            raise
        self._coord = coord
        self._server = server
        self._daemons: dict[str, TaskDaemon] = {}
        self._exhausted: set[str] = set()
        self._finished: set[str] = set()
        self._started = False
        self._stopping = False
        self._restore_msg = restore_msg
        self.failures = FailureCollector()
        self.failure: AttemptFailure | None = None
        try:
            while True:
                if stage.done():
                    done = stage.error
                    if done is not None:
                        self._fail(f"{runner.stage_title} failed: {type(done).__name__}: {done}")
                    elif len(self._finished) < n:
                        self._fail(f"{runner.stage_title} ended before every task finished")
                    break
                self._step()
                if self.error is not None:
                    stage.cancel()
        finally:
            env._next_checkpoint_id = max(env._next_checkpoint_id, coord.next_checkpoint_id)
            if self.error is not None:
                stage.cancel()
            stage.join(60)
            if self.failures.failed:
                self._collect_late_failures()
            server.close()
            self._release(self._daemons)
        self.failure = self.failures.result(self.attempt)
        return None if self.failure is None else self.failure.root_cause

    @property
    def error(self) -> str | None:
        """The first failure the driver learnt of (it stops the attempt); the attempt's
        root cause is chosen once every report is in (``failure``)."""
        return self.failures.reports[0].message if self.failures.reports else None

    def _fail(self, message: str) -> None:
        self.failures.driver_failure(message)

    def _collect_late_failures(self) -> None:
        """The failure reports still on their way when the stage ended: the task that
        failed first may be heard last. Waits (bounded) until every task's connection has
        ended, so everything they sent is in the inbox."""
        if not self._server.wait_disconnected(_LATE_REPORTS_WAIT):
            log.info(
                "attempt %d: tasks still connected %.0f s after the stage ended; their "
                "later failure reports are not counted",
                self.attempt,
                _LATE_REPORTS_WAIT,
            )
        while True:
            try:
                task, msg = self._server.inbox.get_nowait()
            except queue.Empty:
                return
            self.failures.on_message(task, msg)

    def _step(self) -> None:
        """One turn of the driver loop: a control message, the coordinator's commands."""
        env, coord, server = self.env, self._coord, self._server
        if env._cancel.is_set() and self.error is None:
            self._fail("cancelled")
        if self.lease.lost is not None and self.error is None:
            self._fail(str(self.lease.lost))
        if env._stop.is_set() and self._started and not self._stopping:
            self._stopping = True  # a clean stop: sources end their input now
            server.broadcast(StopInput(), self.sources)
        deadline = coord.next_deadline() if self._started else None
        wait = 0.05 if deadline is None else min(0.05, max(0.0, deadline - time.monotonic()))
        try:
            task, msg = server.inbox.get(timeout=wait)
        except queue.Empty:
            task, msg = "", None
        if msg is not None:
            if env.status is not None:
                env.status.on_message(task, msg)
            self._handle(task, msg)
        if self._started and self.error is None:
            coord.tick()
            try:
                self._execute(coord, server)
            except _AttemptFailed as e:
                self._fail(f"checkpoint failure: {e}")
        if env.status is not None:
            env.status.publish()

    def _handle(self, task: str, msg: Message | ControlLost) -> None:
        coord, server = self._coord, self._server
        match msg:
            case RegisterTask():
                self._daemons[task] = msg.daemon
                if len(self._daemons) == self.graph.num_tasks:
                    server.broadcast(StartTask(dict(self._daemons), self._restore_msg))
                    log.info(
                        "job %s: attempt %d running (%d tasks registered)",
                        self.env.job_id,
                        self.attempt,
                        len(self._daemons),
                    )
                    coord.start()
                    self._started = True
            case CheckpointAck():  # with the task's CheckpointMetrics
                cid = msg.checkpoint_id
                alignment, size, aligned = self._acks.get(cid, (0.0, 0, 0))
                self._acks[cid] = (
                    max(alignment, msg.alignment or 0.0),
                    size + msg.state_bytes,
                    aligned + msg.aligned_bytes,
                )
                if msg.unaligned or msg.persisted_bytes:
                    self._unaligned.setdefault(cid, {})[task] = msg.persisted_bytes
                coord.acknowledge(task, cid, msg.handle)
            case CheckpointDecline():
                coord.decline(task, msg.checkpoint_id, msg.reason)
            case SourceExhausted():
                self._exhausted.add(task)
                if self._exhausted >= self.sources:
                    coord.request_final_checkpoint()
            case TaskFinished():
                self._finished.add(task)
                self.records[task] = msg.records_in
                for name, blob in msg.results.items():
                    records = pickle.loads(blob)  # from a task of this attempt (token checked)
                    self._collected.setdefault(name, {})[_subtask_of(task)] = records
            case TaskFailed() | ControlLost():
                self.failures.on_message(task, msg)

    def _execute(self, coord: CheckpointCoordinator, server: ControlServer) -> None:
        for cmd in coord.poll_commands():
            if self.env.status is not None:
                self.env.status.on_command(cmd)
            match cmd:
                case TriggerCheckpoint():
                    server.broadcast(
                        CheckpointTrigger(cmd.checkpoint_id, cmd.timestamp, cmd.exactly_once),
                        set(cmd.tasks),
                    )
                case FinalizeCheckpoint():
                    names = {t: os.path.basename(str(h)) for t, h in cmd.handles.items()}
                    try:
                        self.lease.check()  # never commit for a job another driver owns
                        self.storage.commit(
                            CheckpointMetadata(
                                cmd.checkpoint_id,
                                cmd.timestamp,
                                names,
                                cmd.finished_tasks,
                                cmd.is_final,
                                extra=self._extra(cmd.checkpoint_id, cmd.is_final),
                                operators=operator_files(names, self.graph.operator_tasks()),
                            )
                        )
                    except CheckpointLeaseError as e:
                        coord.finalize_failed(cmd.checkpoint_id, str(e))
                        raise _AttemptFailed(str(e)) from e
                    except Exception as e:
                        coord.finalize_failed(cmd.checkpoint_id, str(e))
                    else:
                        coord.checkpoint_finalized(cmd.checkpoint_id)
                        self.storage.apply_retention()
                case NotifyComplete():
                    self._completed(coord, cmd.checkpoint_id, cmd.is_final)
                    server.broadcast(CheckpointComplete(cmd.checkpoint_id))
                    if cmd.is_final:
                        server.broadcast(FinishTask())
                case NotifyAborted():
                    self._acks.pop(cmd.checkpoint_id, None)
                    self._unaligned.pop(cmd.checkpoint_id, None)
                    reason = cmd.reason.value + (f": {cmd.detail}" if cmd.detail else "")
                    log.warning(
                        "job %s: checkpoint %d aborted: %s",
                        self.env.job_id,
                        cmd.checkpoint_id,
                        reason,
                    )
                    self.aborted.append((cmd.checkpoint_id, reason))
                    server.broadcast(CheckpointAbort(cmd.checkpoint_id))
                case DiscardCheckpoint():
                    if cmd.whole_checkpoint:
                        with best_effort(
                            log, f"discarding checkpoint {cmd.checkpoint_id}", logging.WARNING
                        ):
                            self.storage.discard(cmd.checkpoint_id)
                    else:
                        for h in cmd.handles.values():
                            with best_effort(log, f"removing {h}", logging.WARNING):
                                self.storage.fs.rm_file(str(h))
                case FailJob():
                    raise _AttemptFailed(cmd.reason)

    def _extra(self, checkpoint_id: int, is_final: bool) -> dict[str, Any]:
        """What the metadata says beside the files: whether the checkpoint was aligned or
        unaligned and the in-flight bytes each task persisted (mode unaligned); for a
        final checkpoint why the job ended: all input read (a rerun has nothing to do), or
        a clean stop (a rerun resumes)."""
        extra: dict[str, Any] = {}
        if self.env.config.unaligned:
            persisted = self._unaligned.get(checkpoint_id, {})
            extra["alignment"] = "unaligned" if persisted else "aligned"
            extra["persisted_bytes"] = dict(persisted)
        if is_final:
            extra["ended"] = "stop" if self.env._stop.is_set() else _ENDED_INPUT
        return extra

    def _completed(self, coord: CheckpointCoordinator, checkpoint_id: int, final: bool) -> None:
        alignment, size, aligned = self._acks.pop(checkpoint_id, (0.0, 0, 0))
        persisted = self._unaligned.pop(checkpoint_id, {})
        duration = next(
            (h.duration or 0.0 for h in coord.history if h.checkpoint_id == checkpoint_id), 0.0
        )
        self.checkpoints.append(
            CheckpointInfo(
                checkpoint_id,
                duration,
                alignment,
                size,
                final,
                unaligned=bool(persisted),
                persisted_bytes=persisted,
                aligned_bytes=aligned,
            )
        )
        log.info(
            "job %s: %scheckpoint %d done in %.0f ms (alignment %.0f ms, %d bytes %s while "
            "aligning, state %d bytes)",
            self.env.job_id,
            "final " if final else "",
            checkpoint_id,
            1000 * duration,
            1000 * alignment,
            aligned,
            "processed" if self.env.alignment is AlignmentMode.BLOCK_UPSTREAM else "parked",
            size,
        )

    def _release(self, daemons: dict[str, TaskDaemon]) -> None:
        """Release this attempt's partitions on every daemon its tasks used: tasks killed
        hard release nothing themselves."""
        addresses = {d.data_address for d in daemons.values()}
        for edge in self.graph.edges:
            for address in addresses:
                dataset = dataset_of(self.env.job_id, self.attempt, edge)
                with best_effort(log, f"releasing {dataset} on {address}", logging.WARNING):
                    get_runtime().run(release_dataset(address, dataset, secret=self.env.credential))


class _AttemptFailed(Exception):
    pass


def _subtask_of(task_id: str) -> int:
    return int(task_id.rpartition("-")[2])


def _dashboard_url(daemon: str | None) -> str | None:
    """The dashboard of the embedded daemon when the job uses it."""
    from client.spark import embedded_dashboard_url

    return embedded_dashboard_url(daemon)


def _check_factory(factory: object, method: str, argument: str, kind: type[Operator]) -> None:
    """A factory must be a callable that returns a new ``kind`` (each subtask and each
    attempt needs its own instance): checked once here, in the driver, so that an
    instance given by mistake fails when the job is defined, not after every restart."""
    if isinstance(factory, Operator) or not callable(factory):
        what = type(factory).__name__
        raise UsageError(
            f"{method}: {argument} must be a callable that returns a new {kind.__name__} "
            f"(the class, or e.g. lambda: {what}(...)), got a {what} instance"
            if isinstance(factory, Operator)
            else f"{method}: {argument} must be a callable that returns a new "
            f"{kind.__name__}, got {factory!r}"
        )
    made = factory()
    if not isinstance(made, kind):
        raise UsageError(
            f"{method}: {argument}() must return a {kind.__name__}, got {type(made).__name__}"
        )


def _check_restorable(
    latest: CheckpointMetadata | None, graph: JobGraph, allow_non_restored_state: bool
) -> None:
    """Every operator uid the checkpoint holds state of must be one of ``graph``'s."""
    if latest is None:
        return
    uids = graph.operator_tasks()
    unknown = sorted(uid for uid in latest.operators if uid not in uids)
    if not unknown:
        return
    if not allow_non_restored_state:
        raise NonRestoredStateError(f"chk-{latest.checkpoint_id}", unknown)
    log.warning(
        "dropping the state of operator(s) %s of checkpoint %d: not in this job "
        "(allow_non_restored_state)",
        ", ".join(unknown),
        latest.checkpoint_id,
    )


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

    def uid(self, uid: str) -> DataStream:
        """Name this operator's state ``uid`` in checkpoints (Flink's ``uid()``), instead of
        its name: a stable id that survives renaming the operator and changing the job
        around it. Uids must be unique in the job."""
        self.node.uid = check_operator_id(uid, "uid")
        return self

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
        uid: str | None = None,
    ) -> None:
        """A sink built by ``factory()`` (an ``Operator``; a class or a function that
        returns a new instance): every subtask, and every attempt, gets its own; ``uid``
        names its state (see ``uid``)."""
        _check_factory(factory, "sink_to", "factory", Operator)
        sink = self._then(factory, "sink", name, parallelism)
        if uid is not None:
            sink.uid(uid)

    def collect(self, *, name: str | None = None, parallelism: int | None = None) -> str:
        """A ``CollectSink``: ``execute`` returns its records in ``JobResult.collected[
        name]`` (exactly once: the records of completed checkpoints, subtask by subtask, each
        in arrival order). Returns the sink's name. For tests and small results: the records
        are operator state until the job ends."""
        from client.streaming.connectors import CollectSink

        sink_name = self.env._name(name, "collect")
        self.sink_to(CollectSink, name=sink_name, parallelism=parallelism)
        return sink_name

    def print(self, prefix: str | None = None, *, parallelism: int | None = None) -> None:
        """A ``PrintSink``: every record printed by its task (``prefix:subtask> record``),
        at-least-once."""
        from client.streaming.connectors import PrintSink

        self.sink_to(
            lambda: PrintSink(prefix), name=self.env._name(None, "print"), parallelism=parallelism
        )

    def sink_to_files(
        self,
        directory: str,
        *,
        format: str = "jsonl",
        parallelism: int | None = None,
        uid: str | None = None,
    ) -> None:
        """Exactly-once files (two-phase commit): visible once their checkpoint completes."""
        from client.streaming.connectors import FileSink

        self.sink_to(  # validates its arguments now
            lambda: FileSink(directory, format=format),
            name=self.env._name(None, "filesink"),
            parallelism=parallelism,
            uid=uid,
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
