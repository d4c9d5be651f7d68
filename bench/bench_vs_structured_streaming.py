"""Benchmark: the same stateful per-key job on Spark Structured Streaming and on the
streaming runtime (``client.streaming``), in one run on one local SparkSession.

Run ``python bench/bench_vs_structured_streaming.py`` (``--rate`` events per second for
the latency runs, default 1000; ``--seconds`` per run, default 30; ``--warmup`` seconds
left out at the start of every run, default 10). ``docs/streaming.md`` ("Against Spark
Structured Streaming") explains what makes the comparison fair; in short:

* **The same logic**: ``step(total, value)``, a running total per key, in Python, called
  once per event by both: in ``applyInPandasWithState`` (Spark, state in a
  ``GroupState``; output mode ``update``) and in a keyed process function (ours, state in
  keyed ``ValueState``). Both emit one ``(key, total, created_ms)`` row per event.
* **The same input**: event ``i`` has ``value = i``, ``key = i % KEYS`` and its creation
  time in milliseconds. Spark reads its ``rate`` source (``rowsPerSecond``; each row's
  ``timestamp`` is when the source created it); ours reads the generator source
  (``from_generator(rate=...)``), whose function stamps ``time.time()`` when it creates
  the event. The same rate for both, and both run on the same ``local[2]`` session (two
  task slots: Spark's two state partitions, our two tasks).
* **The same sink side**: latency = the wall-clock time (``time.time()``, one host) when
  the row reaches the sink's Python code minus its creation time: Spark's
  ``foreachBatch`` after collecting the micro-batch, our sink operator's ``process``.
  Neither waits for a transactional commit (Spark's micro-batch commit to its offset log
  comes after ``foreachBatch``; our exactly-once file sink would add up to a checkpoint
  interval).
* **Triggers**: Spark's default trigger (the next micro-batch as soon as the last one
  ended: its lowest latency), its checkpoint (offsets, state) every micro-batch; ours
  checkpoints every second, exactly-once (aligned).
* **Sustained rate**: the most rows per second each gets through, for ``--seconds`` after
  its first output: Spark reads the ``rate-micro-batch`` source (``--max-batch`` rows per
  micro-batch, default 200000: the next batch starts when the last one ended, so its rate
  is Spark's own, not its input's) and ours the generator without a limit (backpressure
  slows it), stopped cleanly (``env.cancel()``) ``--seconds`` after its first checkpoint
  (``--max-count``, if given, ends it earlier); the max-rate runs note every 100th event at
  the sink, and the figure is the rows reaching the sink per second after the warm-up.

Latency p50/p99 over every event created after the warm-up; every run checks the sink
saw each event exactly once (Spark: every event of the batches it ran) and that the
totals are right (``total`` of event ``i`` = the sum of the values of its key up to ``i``).

Targets (issue 10): our p99 >= 10x lower, our sustained rate >= 1x Spark's. The last line
printed is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import ROOT, BenchError, json_line

KEYS = 100
#: The max-rate runs note every this many events at the sink (``value % n == 0``).
MAX_RUN_SAMPLE = 100
TARGET_P99_RATIO = 10.0
TARGET_RATE_RATIO = 1.0


def step(total: int, value: int) -> int:
    """The per-key logic both systems run, once per event: a running total."""
    return total + value


def percentile(values: list[float], q: float) -> float:
    s = sorted(values)
    if not s:
        raise BenchError("no latency samples")
    return s[min(len(s) - 1, int(q * len(s)))]


def check_totals(rows: list[tuple[int, int, int]], complete: bool) -> None:
    """Every ``(value, total)`` row: ``total`` is the sum of ``value``s of its key up to it
    (values of a key are ``key, key + KEYS, ...``: a closed form), each value at most once;
    with ``complete`` every value 0..n-1 exactly once."""
    seen: set[int] = set()
    for value, total, _ in rows:
        k, m = value % KEYS, value // KEYS
        if total != (m + 1) * k + KEYS * m * (m + 1) // 2:
            raise BenchError(f"event {value}: total {total} is wrong")
        if value in seen:
            raise BenchError(f"event {value} reached the sink twice")
        seen.add(value)
    if complete and seen != set(range(len(rows))):
        raise BenchError(f"the sink saw {len(seen)} distinct events, not 0..{len(rows) - 1}")


def summarize(
    name: str,
    arrivals: list[tuple[float, int, int, int]],
    created_from: float,
    seen_from: float,
    latency: bool,
    every: int = 1,
) -> dict[str, Any]:
    """``arrivals``: (seen at, value, total, created ms) per row at the sink. Latency over
    the events created from ``created_from`` on; the rate over the rows seen after the
    first arrival from ``seen_from`` on, per second from that arrival to the last one
    (``arrivals`` has every ``every``-th event). Counting from an arrival, not from
    ``seen_from``, matters for micro-batches: the first batch after the warm-up was mostly
    processed before it, and counting its rows over the time since the warm-up would
    inflate the rate by up to a batch."""
    steady = sorted(seen for seen, _, _, _ in arrivals if seen >= seen_from)
    span = steady[-1] - steady[0] if steady else 0.0
    if span <= 0:
        raise BenchError(
            f"{name}: fewer than two arrivals at the sink after the warm-up: run longer"
        )
    after = sum(1 for seen in steady if seen > steady[0])
    out: dict[str, Any] = {"sink_rows_per_s": every * after / span}
    text = f"{out['sink_rows_per_s']:.0f} rows/s at the sink"
    if latency:
        lat = [
            1000 * seen - created
            for seen, _, _, created in arrivals
            if created >= 1000 * created_from
        ]
        out.update(p50_ms=percentile(lat, 0.50), p99_ms=percentile(lat, 0.99), samples=len(lat))
        text = (
            f"p50 {out['p50_ms']:.0f} ms, p99 {out['p99_ms']:.0f} ms over {len(lat)} events, "
            + text
        )
    print(f"{name}: {text}", flush=True)
    return out


# -- Spark Structured Streaming ----------------------------------------------------------------


def wait_until(cond: Any, timeout: float, query: Any) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if query.exception() is not None:
            raise BenchError(f"the Spark query failed: {query.exception()}")
        if time.monotonic() > deadline:
            raise BenchError(f"the Spark query produced nothing in {timeout:.0f} s")
        time.sleep(0.05)


def run_spark(
    spark: Any, rate: int, seconds: float, warmup: float, name: str, latency: bool
) -> dict[str, Any]:
    """``latency``: the ``rate`` source at ``rate`` rows/s; otherwise the
    ``rate-micro-batch`` source with ``rate`` rows per micro-batch (its most rows/s)."""
    import pandas as pd
    from pyspark.sql import functions as F
    from pyspark.sql.streaming.state import GroupStateTimeout

    def update(key: Any, pdfs: Any, state: Any) -> Any:
        total = int(state.get[0]) if state.exists else 0
        for pdf in pdfs:
            totals = []
            for v in pdf["value"].tolist():
                total = step(total, v)
                totals.append(total)
            yield pd.DataFrame({"value": pdf["value"], "total": totals, "ts_ms": pdf["ts_ms"]})
        state.update((total,))

    arrivals: list[tuple[float, int, int, int]] = []
    newest = [0]  # the latest creation time (ms) seen at the sink
    batches: list[float] = []  # when each micro-batch reached the sink
    lock = threading.Lock()

    every = 1 if latency else MAX_RUN_SAMPLE

    def sink(df: Any, batch_id: int) -> None:
        if every == 1:
            rows = df.collect()
        else:  # one action: the sampled rows (a micro-batch of the max run is large)
            sample = F.when(F.col("value") % every == 0, F.struct("value", "total", "ts_ms"))
            rows = df.agg(F.collect_list(sample).alias("rows")).collect()[0].rows
        now = time.time()
        with lock:
            arrivals.extend((now, r.value, r.total, r.ts_ms) for r in rows)
            newest[0] = max([newest[0], *(r.ts_ms for r in rows)])
            batches.append(now)

    ckpt = tempfile.mkdtemp(prefix="xbench-ss-")
    try:
        if latency:
            source = spark.readStream.format("rate").option("rowsPerSecond", rate)
        else:  # fixed micro-batches, each as soon as the last ended: no input bound, and
            # no backlog that makes every batch larger than the last
            source = spark.readStream.format("rate-micro-batch").option("rowsPerBatch", rate)
        events = (
            source.option("numPartitions", 1)
            .load()
            .select(
                (F.col("value") % KEYS).alias("key"),
                F.col("value"),
                F.unix_millis(F.col("timestamp")).alias("ts_ms"),
            )
        )
        query = (
            events.groupBy("key")
            .applyInPandasWithState(
                update,
                "value long, total long, ts_ms long",
                "total long",
                "update",
                GroupStateTimeout.NoTimeout,
            )
            .writeStream.outputMode("update")
            .foreachBatch(sink)
            .option("checkpointLocation", ckpt)
            .start()
        )
        try:
            # from the first micro-batch on (the query's start-up is not a latency)
            wait_until(lambda: bool(arrivals), 180.0, query)
            t0 = time.time()
            if latency:  # until an event created ``seconds`` after that reached the sink
                wait_until(lambda: newest[0] >= 1000 * (t0 + seconds), seconds + 120.0, query)
            else:  # fixed batches: until two at least reached the sink after the warm-up
                wait_until(
                    lambda: (
                        time.time() >= t0 + seconds and sum(b > t0 + warmup for b in batches) >= 2
                    ),
                    seconds + 120.0,
                    query,
                )
        finally:
            query.stop()
    finally:
        shutil.rmtree(ckpt, ignore_errors=True)
    with lock:
        rows = list(arrivals)
    check_totals([(v, t, c) for _, v, t, c in rows], complete=False)
    # every event up to the last one seen, none missing (a micro-batch is all or nothing)
    if rows and len(rows) != max(v for _, v, _, _ in rows) // every + 1:
        raise BenchError(f"Spark: {len(rows)} rows, not every event up to the last")
    return summarize(name, rows, t0 + warmup, t0 + warmup, latency, every)


# -- the streaming runtime ---------------------------------------------------------------------


class RunningTotal:
    """The keyed process function: ``step`` on the key's ValueState."""

    def open(self, rctx: Any) -> None:
        self.total = rctx.value_state("total", 0)

    def process_element(self, event: Any, ctx: Any, out: Any) -> None:
        total = step(self.total.value(), event[1])
        self.total.update(total)
        out.collect((event[1], total, event[2]))


def make_event(i: int) -> tuple[int, int, int]:
    return (i % KEYS, i, time.time_ns() // 1_000_000)


def latency_sink_factory(directory: str, every: int) -> Any:
    from client.streaming.functions import Collector, Operator

    class LatencySink(Operator):
        """Notes when rows reached it (every ``every``-th event: the max-rate runs move
        millions); writes the notes and its row count at the end of its input."""

        def open(self, ctx: Any) -> None:
            super().open(ctx)
            self.rows: list[tuple[float, int, int, int]] = []
            self.count = 0

        def process(self, record: Any, out: Collector) -> None:
            self.count += 1
            if record[0] % every == 0:
                self.rows.append((time.time(), record[0], record[1], record[2]))

        def end_input(self, out: Collector) -> None:
            path = os.path.join(directory, f"sink-{self.ctx.subtask_index}.json")
            with open(path, "w") as f:
                json.dump({"count": self.count, "rows": self.rows}, f)

    return LatencySink()


def stop_after(env: Any, seconds: float, timeout: float) -> threading.Thread:
    """Stop ``env``'s job cleanly ``seconds`` after its first completed checkpoint (its
    tasks run and records flow by then)."""

    def run() -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            status = env.status
            if status is not None and status.snapshot().checkpoints_completed >= 1:
                time.sleep(seconds)
                break
            time.sleep(0.05)
        env.cancel()  # a clean stop: a final checkpoint, the sink's end_input

    thread = threading.Thread(target=run, name="bench-stop", daemon=True)
    thread.start()
    return thread


def run_ours(
    spark: Any,
    rate: int | None,
    count: int | None,
    warmup: float,
    name: str,
    latency: bool,
    seconds: float | None = None,
) -> dict[str, Any]:
    """``count`` events (None: unbounded); ``seconds``: stop the job cleanly that long
    after its first checkpoint."""
    from client.streaming import StreamEnvironment

    work = tempfile.mkdtemp(prefix="xbench-ours-")
    try:
        every = 1 if latency else MAX_RUN_SAMPLE
        env = StreamEnvironment(
            spark,
            checkpoint_dir=os.path.join(work, "ckpt"),
            checkpoint_interval=1.0,
            mode="exactly_once",
        )
        (
            env.from_generator(make_event, count=count, rate=rate, parallelism=1)
            .key_by(lambda e: e[0])
            .process(RunningTotal(), parallelism=1)
            .sink_to(lambda: latency_sink_factory(work, every), parallelism=1)
        )
        stopper = None if seconds is None else stop_after(env, seconds, seconds + 300.0)
        result = env.execute(restart_attempts=0)
        if stopper is not None:
            stopper.join()
        with open(os.path.join(work, "sink-0.json")) as f:
            got = json.load(f)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    rows = [tuple(r) for r in got["rows"]]
    generated = sum(n for task, n in result.records.items() if task.startswith("v0-"))
    if got["count"] != generated or (
        count is not None and not result.stopped and generated != count
    ):
        raise BenchError(f"ours: the sink saw {got['count']} rows, {generated} were generated")
    check_totals([(v, t, c) for _, v, t, c in rows], complete=every == 1)
    first_created = min(created for _, _, _, created in rows) / 1000
    first_seen = min(seen for seen, _, _, _ in rows)
    out = summarize(name, rows, first_created + warmup, first_seen + warmup, latency, every)
    out["events"] = generated
    return out


def session() -> Any:
    os.environ["PYSPARK_PYTHON"] = sys.executable
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]
    )
    from pyspark.sql import SparkSession

    spark = (
        SparkSession.builder.master("local[2]")
        .appName("bench-vs-structured-streaming")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.driver.host", "127.0.0.1")
        .config("spark.driver.bindAddress", "127.0.0.1")
        .config("spark.python.worker.reuse", "true")
        .config("spark.sql.shuffle.partitions", "2")
        # stopping the max-rate query mid-batch overflowed the stream thread's stack in a
        # regex (java.util.regex recursion) with the default thread stack
        .config("spark.driver.extraJavaOptions", "-Xss64m")
        .getOrCreate()
    )
    spark.sparkContext.setLogLevel("ERROR")
    return spark


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rate", type=int, default=1000, help="events/s of the latency runs")
    ap.add_argument("--seconds", type=float, default=30.0, help="length of every run")
    ap.add_argument("--warmup", type=float, default=10.0)
    ap.add_argument(
        "--max-batch", type=int, default=200_000, help="rows per micro-batch, Spark's max run"
    )
    ap.add_argument(
        "--max-count", type=int, default=None, help="at most these events in our max run"
    )
    args = ap.parse_args()
    if args.seconds <= args.warmup:
        ap.error("--seconds must be longer than --warmup (the rates are after the warm-up)")
    load_start = os.getloadavg()[0]
    spark = session()
    try:
        from client import spark as xs

        w = args.warmup
        ss = run_spark(spark, args.rate, args.seconds, w, "spark latency", True)
        ours = run_ours(spark, args.rate, int(args.rate * args.seconds), w, "ours  latency", True)
        ss_max = run_spark(spark, args.max_batch, args.seconds, w, "spark max rate", False)
        ours_max = run_ours(
            spark, None, args.max_count, w, "ours  max rate", False, seconds=args.seconds
        )
    finally:
        spark.stop()
        xs.stop_embedded_daemon()
    p99_ratio = ss["p99_ms"] / ours["p99_ms"]
    rate_ratio = ours_max["sink_rows_per_s"] / ss_max["sink_rows_per_s"]
    print(
        f"p99 spark/ours {p99_ratio:.1f}x (target >= {TARGET_P99_RATIO}x); sustained rate "
        f"ours/spark {rate_ratio:.2f}x (target >= {TARGET_RATE_RATIO}x)"
    )
    print(
        json_line(
            {
                "bench": "vs_structured_streaming",
                "rate": args.rate,
                "keys": KEYS,
                "spark_p50_ms": ss["p50_ms"],
                "spark_p99_ms": ss["p99_ms"],
                "ours_p50_ms": ours["p50_ms"],
                "ours_p99_ms": ours["p99_ms"],
                "p50_ratio": ss["p50_ms"] / ours["p50_ms"],
                "p99_ratio": p99_ratio,
                "spark_max_rows_per_s": ss_max["sink_rows_per_s"],
                "ours_max_rows_per_s": ours_max["sink_rows_per_s"],
                "rate_ratio": rate_ratio,
                "target_p99_met": p99_ratio >= TARGET_P99_RATIO,
                "target_rate_met": rate_ratio >= TARGET_RATE_RATIO,
                "seconds": args.seconds,
                "warmup_s": w,
                "spark_max_batch_rows": args.max_batch,
                "ours_max_events": ours_max["events"],
                "spark_latency_samples": ss["samples"],
                "ours_latency_samples": ours["samples"],
                "load_avg_start": load_start,
                "load_avg_end": os.getloadavg()[0],
            }
        )
    )


if __name__ == "__main__":
    main()
