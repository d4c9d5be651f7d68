"""exchange_shuffle versus Spark's own shuffles, on the same data, in one local[2] run.

Measures records/s for:

* ``rdd.partitionBy(n).count()`` (Spark's RDD shuffle, the baseline; both place keys by
  PySpark's ``portable_hash``)
* ``exchange_shuffle(rdd, n, mode="blocking").count()``
* ``df.repartition(n, "k").count()`` (Spark SQL's shuffle on a cached DataFrame)
* with 2 output partitions (all tasks at once in local[2]): ``partitionBy`` again and
  ``exchange_shuffle(..., mode="pipelined")``
* mixed-type records (string keys; values holding a datetime, a nested list and a
  string), a fifth as many: ``partitionBy`` and ``exchange_shuffle`` blocking

Records cross the exchange with the default codec (exact Python values), as users run it.

The input RDD is generated once and cached, so every run starts from the same
materialized partitions. The machine may be shared and its load may change during the
run, so the repeats are interleaved: round *r* times every case once, in turn. Each figure
is the median of its ``--repeat`` runs; each ratio is given both as the ratio of the two
medians and as the median of the per-round ratios (both cases timed in the same round,
so under the same load). The last line is one JSON object with every figure, every ratio
and, next to each ratio the issue sets a target for, that target and whether it is met.

    python bench/bench_spark_shuffle.py [--records 5000000] [--repeat 3] [--quick]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any


def gen(index: int, n: int) -> Iterator[tuple[int, int]]:
    base = index * n
    for i in range(base, base + n):
        yield (i * 2654435761 % 1_000_003, i)


_EPOCH = datetime.datetime(2026, 1, 1, tzinfo=datetime.UTC)


def gen_mixed(index: int, n: int) -> Iterator[tuple[str, tuple[Any, ...]]]:
    base = index * n
    for i in range(base, base + n):
        k = i * 2654435761 % 100_003
        yield (
            f"user-{k}",
            (_EPOCH + datetime.timedelta(seconds=i), [i, [k, "click"]], f"/page/{i % 97}"),
        )


def check_count(name: str, got: int, expect: int) -> None:
    if got != expect:
        raise SystemExit(f"{name}: wrong count: {got} != {expect}")


#: ratio name -> (numerator case, denominator case, the issue's target or None)
RATIOS: dict[str, tuple[str, str, float | None]] = {
    "blocking_vs_partitionBy": ("exchange_blocking", "rdd_partitionBy", 2.5),
    "blocking_vs_df_repartition": ("exchange_blocking", "df_repartition", None),
    "pipelined_vs_partitionBy_2": ("exchange_pipelined_2", "rdd_partitionBy_2", 2.5),
    "blocking_vs_partitionBy_2": ("exchange_blocking_2", "rdd_partitionBy_2", None),
    "pipelined_vs_blocking_2": ("exchange_pipelined_2", "exchange_blocking_2", 1.0),
    "mixed_blocking_vs_partitionBy": ("exchange_blocking_mixed", "rdd_partitionBy_mixed", 2.0),
}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0] if __doc__ else None)
    ap.add_argument("--records", type=int, default=5_000_000)
    ap.add_argument("--partitions", type=int, default=8)
    ap.add_argument("--slices", type=int, default=4)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="1M records, one repetition")
    args = ap.parse_args(argv)
    if args.quick:
        args.records, args.repeat = 1_000_000, 1
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)

    from pyspark.sql import SparkSession

    from client.spark import exchange_shuffle, release_exchange, stop_embedded_daemon

    spark = (
        SparkSession.builder.master("local[2]")
        .appName("bench-spark-shuffle")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.driver.memory", "3g")
        .config("spark.sql.adaptive.enabled", "false")
        .getOrCreate()
    )
    sc = spark.sparkContext
    sc.setLogLevel("ERROR")
    n_rec, slices, parts, rep = args.records, args.slices, args.partitions, args.repeat
    per = n_rec // slices
    total = per * slices

    def make(index: int, _: Iterable[int]) -> Iterator[tuple[int, int]]:
        return gen(index, per)

    rdd = sc.parallelize(range(slices), slices).mapPartitionsWithIndex(make).cache()
    assert rdd.count() == total
    per2 = n_rec // 2

    def make2(index: int, _: Iterable[int]) -> Iterator[tuple[int, int]]:
        return gen(index, per2)

    rdd2 = sc.parallelize(range(2), 2).mapPartitionsWithIndex(make2).cache()
    assert rdd2.count() == per2 * 2 == total
    n_mixed = max(n_rec // 5 // 2, 1)

    def make_mixed(index: int, _: Iterable[int]) -> Iterator[tuple[str, tuple[Any, ...]]]:
        return gen_mixed(index, n_mixed)

    rdd_mixed = sc.parallelize(range(2), 2).mapPartitionsWithIndex(make_mixed).cache()
    total_mixed = rdd_mixed.count()
    df = spark.createDataFrame(rdd, "k long, v long").cache()
    assert df.count() == total

    def exchange(src: Any, n: int, mode: str) -> int:
        out = exchange_shuffle(src, n, mode=mode)
        try:
            return int(out.count())
        finally:
            release_exchange(out)

    cases: list[tuple[str, Callable[[], int]]] = [
        ("rdd_partitionBy", lambda: rdd.partitionBy(parts).count()),
        ("exchange_blocking", lambda: exchange(rdd, parts, "blocking")),
        ("df_repartition", lambda: df.repartition(parts, "k").count()),
        ("rdd_partitionBy_2", lambda: rdd2.partitionBy(2).count()),
        ("exchange_pipelined_2", lambda: exchange(rdd2, 2, "pipelined")),
        ("exchange_blocking_2", lambda: exchange(rdd2, 2, "blocking")),
        ("rdd_partitionBy_mixed", lambda: rdd_mixed.partitionBy(parts).count()),
        ("exchange_blocking_mixed", lambda: exchange(rdd_mixed, parts, "blocking")),
    ]
    expected = {name: total_mixed if name.endswith("_mixed") else total for name, _ in cases}
    print(
        f"{total:,} records (int, int), {total_mixed:,} mixed, {slices} input partitions, "
        f"local[2], {rep} interleaved rounds",
        flush=True,
    )
    # one warm-up pass of each path (JIT, Python worker start-up, daemon start)
    for name, fn in cases:
        if name != "df_repartition":
            check_count(name, fn(), expected[name])
    runs: dict[str, list[float]] = {name: [] for name, _ in cases}
    for r in range(rep):
        for name, fn in cases:
            t = time.perf_counter()
            got = fn()
            runs[name].append(time.perf_counter() - t)
            check_count(name, got, expected[name])
        print(
            f"  round {r + 1}: " + " ".join(f"{k}={v[-1]:.2f}s" for k, v in runs.items()),
            flush=True,
        )
    results = {name: expected[name] / statistics.median(ts) for name, ts in runs.items()}
    for name, ts in runs.items():
        med = statistics.median(ts)
        print(f"  {name:<24} {results[name]:>12,.0f} rec/s   ({med:.2f} s)", flush=True)
    ratios: dict[str, dict[str, Any]] = {}
    for key, (num, den, target) in RATIOS.items():
        # rec/s ratio = time ratio inverted (both cases move the same records)
        paired = [d / n for n, d in zip(runs[num], runs[den], strict=True)]
        ratio = results[num] / results[den]
        ratios[key] = {
            "ratio": round(ratio, 3),
            "paired_median": round(statistics.median(paired), 3),
            "per_round": [round(x, 3) for x in paired],
            "target": target,
            "met": None if target is None else statistics.median(paired) >= target,
        }
        goal = (
            ""
            if target is None
            else f"   target >= {target}x  {'met' if ratios[key]['met'] else 'MISSED'}"
        )
        print(
            f"  {key:<30} {ratio:5.2f}x (paired {statistics.median(paired):5.2f}x){goal}",
            flush=True,
        )
    spark.stop()
    stop_embedded_daemon()
    print(
        json.dumps(
            {
                "bench": "spark_shuffle",
                "records": total,
                "records_mixed": total_mixed,
                "partitions": parts,
                "repeat": rep,
                "records_per_s": {k: round(v) for k, v in results.items()},
                "seconds": {k: [round(t, 3) for t in v] for k, v in runs.items()},
                "ratios": ratios,
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
