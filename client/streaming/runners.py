"""Where a streaming job's tasks run: Spark's barrier stage, or local processes.

``StreamEnvironment.execute(runner=...)`` hands each attempt's tasks to a runner; the
driver's side (the CheckpointCoordinator, the control channel, checkpoints, restarts) is
the same for both, and so are the tasks (``client.streaming.task.run_task``), the daemon
they write through and the checkpoint storage:

* ``SparkRunner`` (``runner="spark"``): every task is one Spark task of one barrier stage,
  so all run at once; cancelling the attempt cancels its Spark job group.
* ``LocalRunner`` (``runner="local"``): every task is one Python process started from
  ``sys.executable`` on this machine (Flink's MiniCluster, Bytewax's ``run_main``): no
  JVM, for unit tests and quick trials. The job (its graph and functions) travels to the
  process with cloudpickle, as Spark ships it; the process runs the task and exits 0, or
  prints the traceback and exits 1. Cancelling an attempt SIGKILLs its processes, as Spark
  kills a cancelled barrier stage's workers hard: nothing of a task of a dead attempt runs
  on, and the driver releases what it held on the daemon. A task process killed from
  outside (``kill -9``) fails the attempt like a killed Spark worker, and the job
  restarts from its latest completed checkpoint.
"""

from __future__ import annotations

import logging
import os
import pickle
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import TYPE_CHECKING, Any, Final, Protocol

from exchange.errors import UsageError

if TYPE_CHECKING:
    from client.streaming.graph import JobGraph
    from client.streaming.task import JobSpec

__all__ = ["LocalRunner", "Runner", "SparkRunner", "Stage", "TaskProcessError", "runner_for"]

log = logging.getLogger("exchange.streaming.runner")

#: Seconds between a local task process failing and its stage reporting the failure: the
#: task's own ``failed`` message (with its traceback) reaches the driver first.
_FAILURE_GRACE: Final = 1.0


class TaskProcessError(Exception):
    """A local task process exited with a failure (its traceback went to stderr)."""


class Stage(Protocol):
    """One attempt's running tasks."""

    def done(self) -> bool:
        """True once every task ended (or the stage failed)."""

    @property
    def error(self) -> BaseException | None:
        """Why the stage failed (once ``done``); None when every task ended well."""

    def cancel(self) -> None:
        """Stop every task of the stage now (any thread; idempotent)."""

    def join(self, timeout: float) -> None:
        """Wait up to ``timeout`` seconds for the stage to be done."""


class Runner(Protocol):
    """Runs the tasks of a job's attempts."""

    name: str
    #: what the attempt's tasks are, in messages ("the Spark stage")
    stage_title: str

    def prepare(self, graph: JobGraph, daemon: str | None) -> str | None:
        """Check that the job can run (slots, the workers' Python) before any attempt;
        returns the daemon hint the tasks get (``daemon`` if given)."""

    def driver_host(self) -> str:
        """The address the tasks reach the driver's control server at."""

    def describe(self) -> str:
        """Where the tasks run, for messages (the checkpoint lease names its owner so)."""

    def application_id(self) -> str:
        """The application the tasks' credential is minted for (their partitions are its)."""

    def launch(self, job: JobSpec, group: str) -> Stage:
        """Start every task of ``job`` (``group`` names the attempt)."""


# -- Spark ------------------------------------------------------------------------------------


class _SparkStage:
    def __init__(self, sc: Any, job: JobSpec, group: str) -> None:
        from client.streaming.task import run_task

        self._sc = sc
        self._group = group
        self._outcome: queue.Queue[BaseException | None] = queue.Queue()
        self._done = False
        self._error: BaseException | None = None
        n = job.graph.num_tasks

        def stage() -> None:
            try:
                sc.setJobGroup(group, f"streaming job {job.job_id}", interruptOnCancel=True)
                rdd = sc.parallelize(range(n), n).barrier()
                rdd.mapPartitions(lambda it: [run_task(job, i) for i in it]).collect()
                self._outcome.put(None)
            except BaseException as e:
                self._outcome.put(e)

        self._thread = threading.Thread(target=stage, name=f"stream-{group}", daemon=True)
        self._thread.start()

    def done(self) -> bool:
        if not self._done:
            try:
                self._error = self._outcome.get_nowait()
            except queue.Empty:
                return False
            self._done = True
        return True

    @property
    def error(self) -> BaseException | None:
        return self._error

    def cancel(self) -> None:
        self._sc.cancelJobGroup(self._group)

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)


class SparkRunner:
    """Every task one Spark task of one barrier stage (see the module's docstring)."""

    name = "spark"
    stage_title = "the Spark stage"

    def __init__(self, sc: Any) -> None:
        self.sc = sc

    def prepare(self, graph: JobGraph, daemon: str | None) -> str | None:
        from client.spark import _daemon_hint, _slots, check_executor_python

        needed, slots = graph.num_tasks, _slots(self.sc)
        if needed > slots:
            raise UsageError(
                f"the job needs {needed} task slots at once (one per subtask: a barrier "
                f"stage), the cluster has {slots}; lower the parallelism or add cores"
            )
        # the executors' Python must import this package, or every task dies with a bare
        # ModuleNotFoundError after every restart: the probe fixes it in local mode (the
        # driver's interpreter) and says so, with the fix, elsewhere
        check_executor_python(self.sc)
        return daemon if daemon is not None else _daemon_hint(self.sc)

    def driver_host(self) -> str:
        return str(self.sc.getConf().get("spark.driver.host", "127.0.0.1"))

    def describe(self) -> str:
        return f"Spark application {self.sc.applicationId}"

    def application_id(self) -> str:
        return str(self.sc.applicationId or "")

    def launch(self, job: JobSpec, group: str) -> Stage:
        return _SparkStage(self.sc, job, group)


# -- local processes --------------------------------------------------------------------------


def _cloudpickle() -> Any:
    """cloudpickle (the job's functions are lambdas and closures), or pyspark's copy."""
    try:
        import cloudpickle

        return cloudpickle
    except ImportError:
        pass
    try:
        from pyspark import cloudpickle as pyspark_cloudpickle

        return pyspark_cloudpickle
    except ImportError:
        raise UsageError(
            "the local runner ships the job's functions to its task processes with "
            "cloudpickle: pip install cloudpickle (or pyspark, which bundles it)"
        ) from None


class _LocalStage:
    def __init__(self, job: JobSpec, group: str, env: dict[str, str]) -> None:
        cp = _cloudpickle()
        self._group = group
        self._error: BaseException | None = None
        self._failed_at = 0.0
        self._cancelled = False
        self.procs: list[subprocess.Popen[bytes]] = []
        # sys.path first (plain pickle), so the job's modules import in the child
        path = pickle.dumps(list(sys.path), protocol=pickle.HIGHEST_PROTOCOL)
        try:
            for index in range(job.graph.num_tasks):
                body = cp.dumps((job, index), protocol=pickle.HIGHEST_PROTOCOL)
                proc = subprocess.Popen(
                    [sys.executable, "-m", "client.streaming.task_process"],
                    stdin=subprocess.PIPE,
                    env=env,
                )
                self.procs.append(proc)
                assert proc.stdin is not None
                proc.stdin.write(len(path).to_bytes(8, "big") + path + body)
                proc.stdin.close()
        except BaseException:
            self.cancel()
            raise
        log.debug("attempt %s: task processes %s", group, [p.pid for p in self.procs])

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def done(self) -> bool:
        codes = [p.poll() for p in self.procs]
        for index, code in enumerate(codes):
            if code not in (None, 0) and self._error is None:
                how = f"killed by signal {-code}" if code < 0 else f"exited with status {code}"
                pid = self.procs[index].pid
                self._error = TaskProcessError(f"task process {index} (pid {pid}) {how}")
                self._failed_at = time.monotonic()
        if all(c is not None for c in codes):
            return True
        # a process that died before it registered never tells the driver: the stage
        # fails by itself (the others would wait for the driver's start)
        return self._error is not None and (
            self._cancelled or time.monotonic() - self._failed_at >= _FAILURE_GRACE
        )

    @property
    def error(self) -> BaseException | None:
        return self._error

    def cancel(self) -> None:
        self._cancelled = True
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGKILL)

    def join(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for p in self.procs:
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("attempt %s: task process %d did not exit", self._group, p.pid)


class LocalRunner:
    """Every task one local Python process (see the module's docstring).

    ``env``: extra environment variables for the task processes (they inherit the
    driver's)."""

    name = "local"
    stage_title = "the local task processes"

    def __init__(self, env: dict[str, str] | None = None) -> None:
        if env is not None and not (
            isinstance(env, dict)
            and all(isinstance(k, str) and isinstance(v, str) for k, v in env.items())
        ):
            raise UsageError(f"env must be a dict of str to str, got {env!r}")
        self.env = dict(env or {})
        #: the stage of the latest attempt (its processes' pids: ``stage.pids``)
        self.stage: _LocalStage | None = None

    def prepare(self, graph: JobGraph, daemon: str | None) -> str | None:
        _cloudpickle()  # fail now, not in the first attempt
        if daemon is not None or os.environ.get("EXCHANGE_DAEMON") or "EXCHANGE_DAEMON" in self.env:
            return daemon
        from client.spark import get_embedded_daemon

        return get_embedded_daemon().socket

    def driver_host(self) -> str:
        return "127.0.0.1"

    def describe(self) -> str:
        return f"local task processes of pid {os.getpid()} on {socket.gethostname()}"

    def application_id(self) -> str:
        return f"local-{os.getpid()}"

    def launch(self, job: JobSpec, group: str) -> Stage:
        self.stage = _LocalStage(job, group, {**os.environ, **self.env})
        return self.stage


def runner_for(runner: object, sc: Any) -> Runner:
    """``runner`` of ``execute``: "spark", "local" or a Runner."""
    if runner == "spark":
        if sc is None:
            raise UsageError(
                "this environment has no Spark: give it a SparkSession, or run the job in "
                "local processes with execute(runner='local')"
            )
        return SparkRunner(sc)
    if runner == "local":
        return LocalRunner()
    if isinstance(runner, (SparkRunner, LocalRunner)):
        return runner
    raise UsageError(f"runner must be 'spark', 'local' or a LocalRunner, got {runner!r}")
