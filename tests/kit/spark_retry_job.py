"""A Spark job in its own process (``local[2,2]``: one retry per task) whose first attempts
fail, and Spark's retries must recover: the exchange must equal ``partitionBy``.

``FAILURE`` says how the first attempts fail:

* ``raise``: the producer task of input partition 0 raises after 3,000 records;
* ``sigkill``: the Python worker running the producer task of input partition 0 is
  SIGKILLed after 3,000 records (mid-write, no ``finally``), and the worker running the
  consumer task of output partition 1 after 1,000 records (mid-read).
* ``pipelined-retry``: a pipelined exchange of the 3 input partitions into 2 (an
  ordinary stage, which Spark retries task by task) whose task writing input partition
  0 raises after 3,000 records: no retry can complete it, the job must fail (the JSON
  line says with what), never hang, and leave the daemon whole.

Usage: ``spark_retry_job.py FAILURE MARK_DIR``; each failure first leaves a file
``FAILURE-{producer,consumer}-<taskAttemptId>`` there, so the caller knows it happened.
Prints one JSON line with the comparison, the embedded daemon's totals and partitions
left, and whether its pool was whole when it stopped. ``run_job`` runs it and returns
that line.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections import Counter
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
FAILURES = ("raise", "sigkill", "pipelined-retry")
RECORDS = 20_000


def run_job(failure: str, mark_dir: Path, env: Mapping[str, str]) -> dict[str, Any]:
    """Run the job in a process of its own; its JSON line, parsed."""
    res = subprocess.run(
        [sys.executable, __file__, failure, str(mark_dir)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=dict(env),
        timeout=240,
    )
    assert res.returncode == 0, res.stderr[-4000:]
    result: dict[str, Any] = json.loads(res.stdout.strip().splitlines()[-1])
    return result


def _fail_first_attempt(failure: str, mark_dir: str, what: str) -> None:
    from pyspark import TaskContext

    ctx = TaskContext.get()
    assert ctx is not None
    with open(os.path.join(mark_dir, f"{failure}-{what}-{ctx.taskAttemptId()}"), "w"):
        pass
    if failure == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)  # the Python worker dies: no finally, no close
    raise RuntimeError(f"injected failure of the first attempt of the {what}")


def main(failure: str, mark_dir: str) -> int:
    if failure not in FAILURES:
        raise SystemExit(f"FAILURE must be one of {FAILURES}, got {failure!r}")
    os.environ["PYSPARK_PYTHON"] = sys.executable
    from pyspark import TaskContext
    from pyspark.sql import SparkSession

    from client.spark import exchange_shuffle, release_exchange

    spark = (
        SparkSession.builder.master("local[2,2]")
        .appName(f"exchange-retry-{failure}")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.driver.host", "127.0.0.1")
        .config("spark.driver.bindAddress", "127.0.0.1")
        .getOrCreate()
    )
    sc = spark.sparkContext
    sc.setLogLevel("FATAL")
    records = [(i % 97, (i, f"v{i}")) for i in range(RECORDS)]

    def failing(what: str, partition: int, after: int) -> Any:
        def wrap(index: int, it: Iterator[Any]) -> Iterator[Any]:
            ctx = TaskContext.get()
            first = ctx is not None and ctx.attemptNumber() == 0
            for k, rec in enumerate(it):
                if index == partition and first and k == after:
                    _fail_first_attempt(failure, mark_dir, what)
                yield rec

        return wrap

    src = sc.parallelize(records, 3)
    if failure == "pipelined-retry":
        piped = exchange_shuffle(
            src.mapPartitionsWithIndex(failing("producer", 0, 3000)), 2, mode="pipelined"
        )
        try:
            piped.count()
            error = ""
        except Exception as e:  # the job's failure, reported to the caller
            error = str(e)
        return _report({"error": error}, spark)
    out = exchange_shuffle(
        src.mapPartitionsWithIndex(failing("producer", 0, 3000)), 4, mode="blocking"
    )
    read = out
    if failure == "sigkill":
        read = out.mapPartitionsWithIndex(failing("consumer", 1, 1000))
    got = read.glom().collect()
    want = src.partitionBy(4).glom().collect()
    equal = [Counter(map(repr, g)) == Counter(map(repr, w)) for g, w in zip(got, want, strict=True)]
    result = {
        "equal": equal,
        "counts": [len(g) for g in got],
        "expected_counts": [len(w) for w in want],
        "released": release_exchange(out),
    }
    return _report(result, spark)


def _report(result: dict[str, Any], spark: Any) -> int:
    """Print the result with the daemon's totals, partitions left and pool state."""
    from client.spark import get_embedded_daemon, stop_embedded_daemon

    url = f"http://{get_embedded_daemon().http_address}/api/stats"
    deadline = time.monotonic() + 60  # a killed task's connections close a little later
    while True:
        with urllib.request.urlopen(url) as r:
            stats = json.loads(r.read())
        if stats["partitions"]["count"] == 0 or time.monotonic() >= deadline:
            break
        time.sleep(0.1)
    result["totals"] = stats["totals"]
    result["partitions_left"] = stats["partitions"]["count"]
    spark.stop()
    result["pool_whole"] = stop_embedded_daemon()
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
