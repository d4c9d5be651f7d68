"""A first run as a new PySpark user makes it: the docs' example as written; ``execute``
without ``PYSPARK_PYTHON`` when the ``python3`` on PATH lacks the package (the
executor-Python probe runs before any attempt: a local run switches to the driver's
interpreter, remote executors fail fast naming the fix, instead of a bare
ModuleNotFoundError in the workers after every restart); a collect sink's records returned
to the driver exactly once through a SIGKILLed Spark worker."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from tests.kit.docs import ROOT, python_blocks, run_block
from tests.kit.modules import load_module

st: Any = load_module(
    "exchange_tests_streaming_pipeline", Path(__file__).with_name("_streaming.py")
)

pytestmark = [pytest.mark.spark, pytest.mark.timeout(600)]


def test_the_docs_spark_example_runs_as_written(spark: Any) -> None:
    (example,) = [b for b in python_blocks("docs/streaming.md") if "SparkSession" in b]
    namespace = run_block(example, "docs/streaming.md")
    result: Any = namespace["result"]
    assert result.restarts == 0 and len(result.collected["totals"]) == 1000
    assert result.checkpoints and result.checkpoints[-1].is_final


_DRIVER = """
import tempfile
from pyspark.sql import SparkSession
from client.spark import check_executor_python
from client.streaming import StreamEnvironment
from exchange.errors import UsageError

spark = SparkSession.builder.master("local[2]").config("spark.ui.enabled", "false").getOrCreate()
spark.sparkContext.setLogLevel("FATAL")


class Elsewhere:
    # the same context as the driver of a cluster sees it: the executors are remote
    master = "spark://elsewhere:7077"
    applicationId = "app-elsewhere"

    def __init__(self, sc):
        self._sc = sc

    def __getattr__(self, name):
        return getattr(self._sc, name)


try:
    check_executor_python(Elsewhere(spark.sparkContext))
except UsageError as e:
    print("USAGE-ERROR", e, flush=True)
env = StreamEnvironment(spark, checkpoint_dir=tempfile.mkdtemp())
env.from_generator(lambda i: i, count=10).collect(name="out")
result = env.execute()
print("RAN", sorted(result.collected["out"]), flush=True)
spark.stop()
"""


def test_without_pyspark_python_a_local_run_uses_the_driver_python_a_cluster_fails_fast(
    tmp_path: Path,
) -> None:
    """The workers' ``python3`` (the one on PATH: Debian's, without msgpack or this
    package) cannot run a task. The executor-Python probe (``check_executor_python``,
    which ``execute`` runs as ``exchange_shuffle`` does) sees it before any attempt: a
    local run, whose executors are on this machine, switches to the driver's interpreter
    with a warning and runs; with remote executors it is a UsageError naming the fix."""
    system = Path("/usr/bin/python3")
    if not system.exists():
        pytest.skip("no system python3")
    probe = subprocess.run([system, "-c", "import msgpack"], capture_output=True)
    if probe.returncode == 0:
        pytest.skip("the system python3 has msgpack: it could run tasks")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python3").symlink_to(system)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYSPARK_")}
    env["PATH"] = os.pathsep.join([str(bin_dir), "/usr/bin", "/bin"])
    env["PYTHONPATH"] = str(ROOT)
    proc = subprocess.run(
        [sys.executable, "-c", _DRIVER],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=540,
    )
    out, err = proc.stdout, proc.stderr
    assert proc.returncode == 0, out[-3000:] + err[-3000:]
    (usage,) = [line for line in out.splitlines() if line.startswith("USAGE-ERROR")]
    assert "cannot import the exchange client" in usage and "PYSPARK_PYTHON" in usage
    assert "'python3'" in usage  # the interpreter the executors run
    assert "RAN [0, 1, 2, 3, 4, 5, 6, 7, 8, 9]" in out, out[-3000:] + err[-3000:]
    assert "this local run uses the driver's interpreter" in err


def test_collected_records_reach_the_driver_exactly_once_through_a_sigkill(
    spark: Any, tmp_path: Path
) -> None:
    from pyspark import cloudpickle

    from client.streaming import StreamEnvironment

    cloudpickle.register_pickle_by_value(st)  # type: ignore[no-untyped-call]
    probes, ckpt = tmp_path / "probes", tmp_path / "ckpt"
    probes.mkdir()
    p, n = str(probes), 3000
    env = StreamEnvironment(spark, checkpoint_dir=str(ckpt), checkpoint_interval="300ms")
    (
        env.add_source(lambda: st.ProbedGenerator(p, n, rate=600.0), name="gen")
        .key_by(st.key_of, name="bykey")
        .process(st.RunningSum(), name="sums")
        .collect(name="rows")
    )
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["result"] = env.execute(restart_backoff=0.2)
        except BaseException as e:
            outcome["error"] = e

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        first = st.wait_for(lambda: st.pids(probes), 120, "the source opened")
        pid = first[min(first)]["gen-0"]
        st.wait_for(lambda: any(ckpt.glob("chk-*/_metadata")), 120, "a completed checkpoint")
        os.kill(pid, signal.SIGKILL)
    finally:
        thread.join(240)
    assert not thread.is_alive() and "error" not in outcome, outcome
    result = outcome["result"]
    assert result.restarts >= 1
    rows = result.collected["rows"]
    assert Counter(r[1] for r in rows) == Counter(st.event(i) for i in range(n))
    st.check_running_sums(rows)
