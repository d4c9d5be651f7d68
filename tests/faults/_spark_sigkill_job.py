"""A Spark job in its own process (``local[2,2]``: one retry per task) whose Python
workers are SIGKILLed: the worker running the producer task of input partition 0 dies
on its first attempt after 3,000 records (mid-write), and the worker running the
consumer task of output partition 1 dies on its first attempt after 1,000 records
(mid-read). Spark retries both tasks; the exchange must equal ``partitionBy``.

Usage: ``_spark_sigkill_job.py MARK_DIR``; each kill leaves a file there first, so the
caller knows it happened. Prints one JSON line with the comparison, the embedded
daemon's totals, and whether its pool was whole when it stopped.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import urllib.request
from collections import Counter
from collections.abc import Iterator
from typing import Any


def _kill_first_attempt(mark_dir: str, what: str) -> None:
    from pyspark import TaskContext

    ctx = TaskContext.get()
    assert ctx is not None
    with open(os.path.join(mark_dir, f"killed-{what}-{ctx.taskAttemptId()}"), "w"):
        pass
    os.kill(os.getpid(), signal.SIGKILL)  # the Python worker dies: no finally, no close


def main(mark_dir: str) -> int:
    os.environ["PYSPARK_PYTHON"] = sys.executable
    from pyspark import TaskContext
    from pyspark.sql import SparkSession

    from client.spark import (
        exchange_hash,
        exchange_shuffle,
        get_embedded_daemon,
        release_exchange,
        stop_embedded_daemon,
    )

    spark = (
        SparkSession.builder.master("local[2,2]")
        .appName("exchange-sigkill")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.driver.host", "127.0.0.1")
        .config("spark.driver.bindAddress", "127.0.0.1")
        .getOrCreate()
    )
    sc = spark.sparkContext
    sc.setLogLevel("FATAL")
    records = [(i % 97, (i, f"v{i}")) for i in range(20_000)]

    def first_attempt() -> bool:
        ctx = TaskContext.get()
        return ctx is not None and ctx.attemptNumber() == 0

    def killed_producer(index: int, it: Iterator[Any]) -> Iterator[Any]:
        first = first_attempt()
        for k, rec in enumerate(it):
            if index == 0 and first and k == 3000:
                _kill_first_attempt(mark_dir, "producer")
            yield rec

    def killed_consumer(index: int, it: Iterator[Any]) -> Iterator[Any]:
        first = first_attempt()
        for k, rec in enumerate(it):
            if index == 1 and first and k == 1000:
                _kill_first_attempt(mark_dir, "consumer")
            yield rec

    src = sc.parallelize(records, 3)
    out = exchange_shuffle(src.mapPartitionsWithIndex(killed_producer), 4, mode="blocking")
    got = out.mapPartitionsWithIndex(killed_consumer).glom().collect()
    want = src.partitionBy(4, exchange_hash).glom().collect()
    equal = [Counter(map(repr, g)) == Counter(map(repr, w)) for g, w in zip(got, want, strict=True)]
    result = {
        "equal": equal,
        "counts": [len(g) for g in got],
        "expected_counts": [len(w) for w in want],
        "released": release_exchange(out),
    }
    with urllib.request.urlopen(f"http://{get_embedded_daemon().http_address}/api/stats") as r:
        stats = json.loads(r.read())
    result["totals"] = stats["totals"]
    result["partitions_left"] = stats["partitions"]["count"]
    spark.stop()
    result["pool_whole"] = stop_embedded_daemon()
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
