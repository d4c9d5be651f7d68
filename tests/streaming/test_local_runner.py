"""Streaming jobs through the local runner (``execute(runner="local")``): the same tasks,
the same daemon (the embedded one) and the same checkpoints as on Spark, in local
processes, no JVM. Real pipelines: a keyed running sum into a collect sink, a restart
after a task process is SIGKILLed, a rerun on a finished job's checkpoints, a missing
input path, a print sink, the driver's log, and job definitions that are mistakes."""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from client.streaming import (
    CollectSink,
    FileSink,
    GeneratorSource,
    LocalRunner,
    RunningReduce,
    SourceNotFoundError,
    StreamEnvironment,
)
from exchange.errors import UsageError
from tests.kit.jobs import JobThread

pytestmark = pytest.mark.timeout(300)

KEYS = 5


def event(i: int) -> tuple[int, int]:
    return (i % KEYS, i)


def add(a: tuple[int, int], b: tuple[int, int]) -> tuple[int, int]:
    return (a[0], a[1] + b[1])


def expected_totals(n: int) -> dict[int, list[int]]:
    """Per key, the running sums of its values in order."""
    out: dict[int, list[int]] = {}
    for i in range(n):
        sums = out.setdefault(i % KEYS, [])
        sums.append((sums[-1] if sums else 0) + i)
    return out


def totals_by_key(records: list[Any]) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for key, (k, total) in records:
        assert key == k
        out.setdefault(key, []).append(total)
    return out


class PidMark:
    """A keyed running sum that leaves its process id in ``pids/<attempt>-<subtask>``."""

    def __init__(self, pids: str) -> None:
        self.pids = pids

    def open(self, rc: Any) -> None:
        self.total = rc.value_state("total", 0)
        ctx = rc.operator_context
        tmp = os.path.join(self.pids, f".{ctx.attempt}-{ctx.subtask_index}")
        with open(tmp, "w") as f:
            f.write(str(os.getpid()))
        os.replace(tmp, os.path.join(self.pids, f"{ctx.attempt}-{ctx.subtask_index}"))

    def process_element(self, value: tuple[int, int], ctx: Any, out: Any) -> None:
        total = self.total.value() + value[1]
        self.total.update(total)
        out.collect((ctx.current_key, (value[0], total)))


@pytest.fixture(scope="module", autouse=True)
def _daemon_pool_whole() -> Iterator[None]:
    from client import spark as xs

    yield
    assert xs.stop_embedded_daemon() is True, "embedded daemon's pool not whole at exit"


def _all_exited(runner: LocalRunner) -> bool:
    return runner.stage is not None and all(p.poll() is not None for p in runner.stage.procs)


def test_a_keyed_pipeline_runs_in_local_processes_and_returns_what_it_collected(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="exchange.streaming.driver")
    env = StreamEnvironment(None, checkpoint_dir=str(tmp_path / "ckpt"), checkpoint_interval=0.2)
    name = (
        env.from_generator(event, count=300, parallelism=2)
        .key_by(lambda e: e[0])
        .process(RunningReduce(add), parallelism=2)
        .collect(name="totals")
    )
    runner = LocalRunner()
    result = env.execute(runner=runner)
    assert name == "totals"
    got = result.collected["totals"]
    assert len(got) == 300 and all(type(r) is tuple and type(r[1]) is tuple for r in got)
    # two source subtasks interleave a key's values: per key one running sum per value,
    # never falling, ending at the key's total
    want = expected_totals(300)
    for key, totals in totals_by_key(got).items():
        assert sorted(totals) == totals and len(totals) == len(want[key])
        assert totals[-1] == want[key][-1]
    assert result.restarts == 0 and result.checkpoints[-1].is_final
    assert not result.already_finished
    assert sum(v for k, v in result.records.items() if k.startswith("v0-")) == 300
    assert _all_exited(runner) and len(runner.stage.procs) == 4  # type: ignore[union-attr]
    said = [r.getMessage() for r in caplog.records]
    assert any("attempt" in m and "no checkpoint to restore" in m for m in said)
    assert any("dashboard http://" in m for m in said)
    assert any("final checkpoint" in m and " done in " in m and " ms" in m for m in said)
    assert any(" finished in " in m for m in said)

    # a rerun on the checkpoints of a job that read all its input: nothing runs
    caplog.clear()
    again = env.execute(runner=runner)
    assert again.already_finished and again.collected == {} and again.restarts == 0
    assert again.last_checkpoint_id == result.last_checkpoint_id
    assert any("nothing to run" in r.getMessage() for r in caplog.records)


def test_a_killed_task_process_restarts_the_job_from_its_checkpoint_exactly_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="exchange.streaming.driver")
    pids = tmp_path / "pids"
    pids.mkdir()
    n = 1500
    env = StreamEnvironment(None, checkpoint_dir=str(tmp_path / "ckpt"), checkpoint_interval=0.2)
    (
        env.from_generator(event, count=n, rate=300.0)
        .key_by(lambda e: e[0])
        .process(PidMark(str(pids)))
        .collect(name="totals")
    )
    runner = LocalRunner()
    job = JobThread(env, runner=runner, restart_backoff=0.1)
    thread, outcome = job.thread, job.outcome
    try:
        deadline = time.monotonic() + 120
        while not (
            env.status is not None
            and env.status.snapshot().checkpoints_completed >= 2
            and len(list(pids.iterdir())) == 1
        ):
            assert time.monotonic() < deadline, "no checkpoint in 120 s"
            assert thread.is_alive(), outcome
            time.sleep(0.05)
        (first,) = pids.iterdir()
        os.kill(int(first.read_text()), signal.SIGKILL)
    finally:
        thread.join(240)
    assert not thread.is_alive()
    result = outcome["result"]
    assert result.restarts == 1
    assert "killed by signal 9" in result.failures[0] or "lost" in result.failures[0]
    assert len(list(pids.iterdir())) == 2  # a second attempt ran the keyed task
    got = result.collected["totals"]
    assert totals_by_key(got) == expected_totals(n)  # nothing lost, nothing twice
    assert _all_exited(runner)
    said = [r.getMessage() for r in caplog.records]
    assert any("restarting in" in m and "because" in m for m in said)
    assert any("restoring checkpoint" in m for m in said)


def test_a_print_sink_prints_every_record(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    env = StreamEnvironment(None, checkpoint_dir=str(tmp_path / "ckpt"), checkpoint_interval=0.5)
    env.from_generator(lambda i: f"record-{i}", count=20).print("seen")
    env.execute(runner="local")
    lines = [line for line in capfd.readouterr().out.splitlines() if line.startswith("seen")]
    assert sorted(lines) == sorted(f"seen> record-{i}" for i in range(20))


def test_a_source_path_that_names_no_file_is_a_typed_error_before_anything_runs(
    tmp_path: Path,
) -> None:
    env = StreamEnvironment(None, checkpoint_dir=str(tmp_path / "ckpt"))
    env.from_files(str(tmp_path / "missing" / "*.jsonl")).sink_to_files(str(tmp_path / "out"))
    t0 = time.monotonic()
    with pytest.raises(SourceNotFoundError, match="missing"):
        env.execute(runner="local")
    assert env.status is None  # no attempt started
    assert time.monotonic() - t0 < 30


def test_a_file_source_opened_on_a_host_that_sees_no_file_fails_its_task(
    tmp_path: Path,
) -> None:
    from client.streaming import FileSource, OperatorContext
    from exchange.state import OperatorStateBackend

    source = FileSource(str(tmp_path / "*.jsonl"))
    ctx = OperatorContext("j", "files", 0, 1, 0, OperatorStateBackend(0, 1))
    with pytest.raises(SourceNotFoundError):
        source.open(ctx)
    watching = FileSource(str(tmp_path / "*.jsonl"), watch=True)
    watching.open(ctx)  # an unbounded source waits for files
    watching.check_input()


@pytest.mark.parametrize(
    ("define", "argument"),
    [
        (lambda env: env.from_generator(event, count=1).sink_to(CollectSink()), "sink_to"),
        (lambda env: env.from_generator(event, count=1).sink_to(FileSink("/tmp/x")), "sink_to"),
        (lambda env: env.add_source(GeneratorSource(event, count=1)), "add_source"),
        (lambda env: env.add_source(lambda: CollectSink()), "add_source"),
        (lambda env: env.from_generator(event, count=1).sink_to(lambda: 42), "sink_to"),
    ],
)
def test_an_instance_instead_of_a_factory_fails_when_the_job_is_defined(
    tmp_path: Path, define: Any, argument: str
) -> None:
    env = StreamEnvironment(None, checkpoint_dir=str(tmp_path / "ckpt"))
    with pytest.raises(UsageError, match=rf"{argument}: factory"):
        define(env)


def test_a_class_is_a_factory(tmp_path: Path) -> None:
    env = StreamEnvironment(None, checkpoint_dir=str(tmp_path / "ckpt"))
    env.from_generator(event, count=1).sink_to(CollectSink, name="c")


def test_without_spark_the_spark_runner_says_what_to_do(tmp_path: Path) -> None:
    env = StreamEnvironment(None, checkpoint_dir=str(tmp_path / "ckpt"))
    env.from_generator(event, count=1).collect()
    with pytest.raises(UsageError, match="runner='local'"):
        env.execute()
    with pytest.raises(UsageError, match="runner must be"):
        env.execute(runner="flink")


def test_the_docs_examples_are_the_spark_one_and_the_local_one() -> None:
    from tests.kit.docs import python_blocks

    blocks = python_blocks("docs/streaming.md")
    assert [("SparkSession" in b, 'runner="local"' in b) for b in blocks] == [
        (True, False),
        (False, True),
    ]


def test_the_docs_local_example_runs_as_written() -> None:
    from tests.kit.docs import python_blocks, run_block

    (local,) = [b for b in python_blocks("docs/streaming.md") if 'runner="local"' in b]
    namespace = run_block(local, "docs/streaming.md")
    result: Any = namespace["result"]
    assert result.restarts == 0 and len(result.collected["totals"]) == 1000


def test_a_task_process_that_dies_before_registering_fails_the_attempt_at_once(
    tmp_path: Path,
) -> None:
    """One of two task processes is SIGKILLed as soon as it starts, before it can register:
    it never tells the driver, and the other waits for the driver's start (120 s). The
    attempt fails on its own within a second of the death."""
    from client.streaming import JobFailedError

    env = StreamEnvironment(None, checkpoint_dir=str(tmp_path / "ckpt"))
    env.from_generator(event, count=10).key_by(lambda e: e[0]).process(RunningReduce(add)).collect()
    runner = LocalRunner()

    def kill_first() -> None:
        deadline = time.monotonic() + 60
        while runner.stage is None or not runner.stage.procs:
            assert time.monotonic() < deadline
            time.sleep(0.001)
        os.kill(runner.stage.procs[0].pid, signal.SIGKILL)

    killer = threading.Thread(target=kill_first)
    killer.start()
    t0 = time.monotonic()
    with pytest.raises(JobFailedError) as failed:
        env.execute(runner=runner, restart_attempts=0)
    killer.join()
    assert time.monotonic() - t0 < 60
    (why,) = failed.value.failures
    assert "killed by signal 9" in why or "lost" in why, why
    assert _all_exited(runner)
