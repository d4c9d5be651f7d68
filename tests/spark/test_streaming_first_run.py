"""A first run as a new PySpark user makes it: the docs' example as written; ``execute``
without ``PYSPARK_PYTHON`` when the ``python3`` on PATH lacks the package (the
executor-Python probe fails fast, naming the fix, instead of a bare ModuleNotFoundError
in the workers after every restart); a collect sink's records returned to the driver
exactly once through a SIGKILLed Spark worker."""

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
import logging, tempfile
from pyspark.sql import SparkSession
from client.streaming import StreamEnvironment
from exchange.errors import UsageError

spark = SparkSession.builder.master("local[2]").config("spark.ui.enabled", "false").getOrCreate()
spark.sparkContext.setLogLevel("FATAL")
env = StreamEnvironment(spark, checkpoint_dir=tempfile.mkdtemp())
env.from_generator(lambda i: i, count=10).collect(name="out")
try:
    env.execute()
except UsageError as e:
    print("USAGE-ERROR", e, flush=True)
else:
    print("RAN", flush=True)
spark.stop()
"""


def test_execute_without_pyspark_python_fails_fast_naming_the_fix(tmp_path: Path) -> None:
    """The workers' ``python3`` (the one on PATH: Debian's, without msgpack or this
    package) cannot run a task; ``execute`` says so before the job's first attempt."""
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
    out = proc.stdout
    assert "USAGE-ERROR" in out, out[-3000:] + proc.stderr[-3000:]
    assert "PYSPARK_PYTHON" in out and "cannot import" in out
    assert "python3" in out  # the interpreter the executors run


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
