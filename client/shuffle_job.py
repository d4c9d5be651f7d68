"""The batch shuffle job: a skewed clickstream exchanged by user through the daemons, checked.

Generates click events with Zipf-distributed users, moves ``(user, (duration, bytes))``
pairs through ``exchange_shuffle`` (an embedded daemon in local mode), aggregates per user
(events, total duration, total bytes), and checks the result against the same aggregation
done by Spark's own DataFrame API. Exit status 0 only if every user's figures agree.

    python -m client.main_job --job shuffle [--events 1000000] [--partitions 8] [--mode blocking]
"""

from __future__ import annotations

import argparse
import bisect
import os
import random
import sys
import threading
import time
from collections.abc import Iterable, Iterator
from typing import Any

EVENT_TYPES = ("view", "click", "scroll", "add_to_cart", "purchase", "share")


def _log(t0: float, msg: str) -> None:
    print(f"[{time.monotonic() - t0:6.1f}s] {msg}", flush=True)


def generate_events(
    slice_index: int, num_events: int, num_users: int, skew: float, seed: int
) -> Iterator[tuple[int, int, str, int, int, int]]:
    """``num_events`` clicks: (user, timestamp_ms, type, page, duration_ms, bytes)."""
    rng = random.Random(seed * 1_000_003 + slice_index)
    weights = [1.0 / (rank**skew) for rank in range(1, num_users + 1)]
    cdf: list[float] = []
    acc = 0.0
    for w in weights:
        acc += w
        cdf.append(acc)
    total = acc
    # a fixed random permutation so the heavy users are not simply the smallest ids
    perm = list(range(num_users))
    random.Random(seed).shuffle(perm)
    ts = 1_700_000_000_000 + slice_index * 10_000_000
    rand = rng.random
    for _ in range(num_events):
        rank = bisect.bisect_left(cdf, rand() * total)
        user = perm[min(rank, num_users - 1)]
        ts += int(rand() * 20)
        kind = EVENT_TYPES[int(rand() * rand() * len(EVENT_TYPES))]
        yield (user, ts, kind, int(rand() * 5000), 50 + int(rand() * 30_000), int(rand() * 4096))


Row = tuple[int, int, int, int]


def aggregate(
    records: Iterable[tuple[int, tuple[int, int]]],
) -> Iterator[tuple[int, int, int, int]]:
    """Per user: (user, events, total duration, total bytes)."""
    acc: dict[int, list[int]] = {}
    for user, (duration, nbytes) in records:
        a = acc.get(user)
        if a is None:
            acc[user] = [1, duration, nbytes]
        else:
            a[0] += 1
            a[1] += duration
            a[2] += nbytes
    for user, (n, d, b) in acc.items():
        yield (user, n, d, b)


class _Progress(threading.Thread):
    """Prints the running Spark stages' task progress every few seconds."""

    def __init__(self, sc: Any, t0: float, every: float = 3.0) -> None:
        super().__init__(daemon=True, name="progress")
        self.sc = sc
        self.t0 = t0
        self.every = every
        self.stop_event = threading.Event()

    def run(self) -> None:
        tracker = self.sc.statusTracker()
        while not self.stop_event.wait(self.every):
            parts = []
            for sid in tracker.getActiveStageIds():
                info = tracker.getStageInfo(sid)
                if info is not None:
                    parts.append(f"stage {sid}: {info.numCompletedTasks}/{info.numTasks} tasks")
            if parts:
                _log(self.t0, "  " + "; ".join(parts))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m client.main_job --job shuffle", description=__doc__.split("\n")[0]
    )
    p.add_argument("--events", type=int, default=1_000_000, help="number of click events")
    p.add_argument("--users", type=int, default=100_000, help="number of distinct users")
    p.add_argument("--skew", type=float, default=1.1, help="Zipf exponent of user activity")
    p.add_argument("--partitions", type=int, default=8, help="output partitions of the exchange")
    p.add_argument("--slices", type=int, default=4, help="input partitions (generator tasks)")
    p.add_argument("--mode", choices=("blocking", "pipelined"), default="blocking")
    p.add_argument("--master", default="local[2]", help="Spark master (default local[2])")
    p.add_argument("--seed", type=int, default=7)
    args = p.parse_args(argv)
    for name in ("events", "users", "partitions", "slices"):
        if getattr(args, name) <= 0:
            p.error(f"--{name} must be positive")
    if args.skew <= 0:
        p.error("--skew must be positive")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    t0 = time.monotonic()
    _log(t0, f"starting Spark ({args.master}) and the embedded exchange daemon")
    from pyspark.rdd import portable_hash
    from pyspark.sql import SparkSession
    from pyspark.sql import functions as F

    from client.spark import (
        exchange_shuffle,
        get_embedded_daemon,
        release_exchange,
        stop_embedded_daemon,
    )

    spark = (
        SparkSession.builder.master(args.master)
        .appName("exchange-main-job")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.sql.shuffle.partitions", str(args.partitions))
        .config("spark.driver.memory", "2g")
        .getOrCreate()
    )
    sc = spark.sparkContext
    sc.setLogLevel("ERROR")
    daemon = get_embedded_daemon() if args.master.startswith("local") else None
    if daemon is not None:
        _log(
            t0, f"exchange daemon up: data {daemon.data_address}, dashboard {daemon.dashboard_url}"
        )
    progress = _Progress(sc, t0)
    progress.start()
    ok = False
    try:
        per_slice = [args.events // args.slices] * args.slices
        per_slice[-1] += args.events - sum(per_slice)
        users, skew, seed = args.users, args.skew, args.seed

        def gen(index: int, _: Iterable[int]) -> Iterator[tuple[int, int, str, int, int, int]]:
            return generate_events(index, per_slice[index], users, skew, seed)

        _log(t0, f"generating {args.events:,} click events over {args.users:,} Zipf({skew}) users")
        events = sc.parallelize(range(args.slices), args.slices).mapPartitionsWithIndex(gen)
        events.cache()
        n_events = events.count()
        _log(t0, f"generated {n_events:,} events")

        _log(
            t0,
            f"exchanging by user through the daemons ({args.mode}, {args.partitions} partitions)",
        )
        t_ex = time.monotonic()
        pairs = events.map(lambda e: (e[0], (e[4], e[5])))
        shuffled = exchange_shuffle(pairs, args.partitions, mode=args.mode)
        nparts = args.partitions

        def agg_checked(index: int, recs: Iterable[Any]) -> Iterator[Row]:
            for row in aggregate(recs):
                if portable_hash(row[0]) % nparts != index:
                    raise AssertionError(f"user {row[0]} landed in the wrong partition {index}")
                yield row

        ours = shuffled.mapPartitionsWithIndex(agg_checked).collect()
        dt = time.monotonic() - t_ex
        rate = n_events / dt if dt > 0 else float("inf")
        _log(
            t0, f"exchanged and aggregated {n_events:,} events in {dt:.2f}s ({rate:,.0f} records/s)"
        )
        release_exchange(shuffled)

        _log(t0, "checking against Spark's DataFrame aggregation")
        df = spark.createDataFrame(
            events, schema="user long, ts long, type string, page int, duration long, bytes long"
        )
        ref = df.groupBy("user").agg(
            F.count("*").alias("n"), F.sum("duration").alias("d"), F.sum("bytes").alias("b")
        )
        expected = {r["user"]: (r["n"], r["d"], r["b"]) for r in ref.collect()}
        got = {u: (n, d, b) for u, n, d, b in ours}
        mismatched = [u for u in expected.keys() | got.keys() if expected.get(u) != got.get(u)]
        total_events = sum(v[0] for v in got.values())
        top = sorted(got.items(), key=lambda kv: -kv[1][0])[:5]

        print()
        print("=" * 72)
        print(f"events exchanged       {n_events:,}  ({args.mode}, {args.partitions} partitions)")
        print(f"distinct users         {len(got):,}")
        print("busiest users          " + ", ".join(f"{u}:{v[0]:,}" for u, v in top))
        print(f"exchange + aggregate   {dt:.2f} s, {rate:,.0f} records/s")
        if not mismatched and total_events == n_events:
            ok = True
            print(
                f"check                  PASSED: all {len(expected):,} users' counts and sums "
                "equal Spark's DataFrame groupBy"
            )
        else:
            print(
                f"check                  FAILED: {len(mismatched):,} users differ, "
                f"{total_events:,} of {n_events:,} events accounted for"
            )
            for u in mismatched[:5]:
                print(f"    user {u}: ours {got.get(u)}  spark {expected.get(u)}")
        if daemon is not None:
            print(f"metrics                {daemon.metrics_url}")
            print(f"dashboard              {daemon.dashboard_url}")
        print("=" * 72)
    finally:
        progress.stop_event.set()
        events_unpersist = locals().get("events")
        if events_unpersist is not None:
            events_unpersist.unpersist()
        spark.stop()
        whole = stop_embedded_daemon()
        _log(t0, f"daemon stopped; network buffer pool whole: {whole}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
