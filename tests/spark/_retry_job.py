"""A Spark job in its own process (``local[2,2]``: one retry per task) for the retry test.

The producer task of input partition 0 fails on its first attempt after emitting records;
the exchange must still equal ``partitionBy`` (no duplicates from the failed attempt).
Usage: ``_retry_job.py MARK_DIR``; the failing attempt leaves a file there, so the caller
knows the failure happened. Prints one JSON line with the comparison, the embedded
daemon's totals, and whether its pool was whole when it stopped.
"""

from __future__ import annotations

import json
import os
import sys
import urllib.request
from collections import Counter
from collections.abc import Iterator
from typing import Any


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
        .appName("exchange-retry")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.sql.shuffle.partitions", "2")
        .config("spark.driver.host", "127.0.0.1")
        .config("spark.driver.bindAddress", "127.0.0.1")
        .getOrCreate()
    )
    sc = spark.sparkContext
    sc.setLogLevel("FATAL")
    records = [(i % 97, (i, f"v{i}")) for i in range(20_000)]

    def flaky(index: int, it: Iterator[Any]) -> Iterator[Any]:
        ctx = TaskContext.get()
        first = ctx is not None and ctx.attemptNumber() == 0
        for k, rec in enumerate(it):
            if index == 0 and first and k == 3000:
                with open(os.path.join(mark_dir, f"failed-{ctx.taskAttemptId()}"), "w"):
                    pass
                raise RuntimeError("injected failure of the first attempt")
            yield rec

    src = sc.parallelize(records, 3)
    out = exchange_shuffle(src.mapPartitionsWithIndex(flaky), 4, mode="blocking")
    got = out.glom().collect()
    want = src.partitionBy(4, exchange_hash).glom().collect()
    equal = [Counter(map(repr, g)) == Counter(map(repr, w)) for g, w in zip(got, want, strict=True)]
    result = {
        "equal": equal,
        "counts": [len(g) for g in got],
        "expected_counts": [len(w) for w in want],
        "released": release_exchange(out),
    }
    with urllib.request.urlopen(f"http://{get_embedded_daemon().http_address}/api/stats") as r:
        result["totals"] = json.loads(r.read())["totals"]
    spark.stop()
    result["pool_whole"] = stop_embedded_daemon()
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
