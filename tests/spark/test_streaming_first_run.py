"""A first run as a new PySpark user makes it: the docs' example as written, and
``execute`` without ``PYSPARK_PYTHON`` when the ``python3`` on PATH lacks the package (the
executor-Python probe fails fast, naming the fix, instead of a bare ModuleNotFoundError
in the workers after every restart)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.kit.docs import ROOT, python_blocks, run_block

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
