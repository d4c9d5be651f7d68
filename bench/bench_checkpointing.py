"""Benchmark: aligned checkpoints under full backpressure, buffer debloating off vs on.

Run ``python bench/bench_checkpointing.py`` (``--seconds`` of job per configuration,
default 40; ``--parallelism`` per operator, default 1). Flink's
``CheckpointingTimeBenchmark`` shape, run by the streaming runtime on local PySpark
(``client.streaming``): an unbounded-speed generator source -> rebalance -> map
(identity) -> rebalance -> a sink that sleeps 1 ms per record, so every exchange is full
(full backpressure: the source is far faster than the sink), 500-byte records, the
runtime's default buffer timeout of 10 ms (``--buffer-timeout``; Flink's default 100 ms
measured longer checkpoints with debloating here). Exactly-once (aligned)
checkpoints every second with a ``min_pause`` of 1 s, so the exchanges fill up again
between two checkpoints.

Two configurations in the same run, each with its own daemon (``python -m server``; the
tasks find it through ``StreamEnvironment(daemon=...)``): debloating off (default
settings: 32 KiB buffers) and on (``--debloat --debloat-target=300ms``: each exchange
aims at 300 ms of in-flight data, so a barrier crossing the two exchanges needs about
600 ms: the design time). The figure is the median duration (trigger -> last
acknowledgement, the driver's ``CheckpointCoordinator`` history in ``JobResult``) of the
checkpoints after the first ``WARMUP`` ones (backpressure building up, the debloater
converging), the final checkpoint left out (the input is bounded: ``count`` records).

Targets (issue 10): debloating on <= 1.5x the design time, and >= 5x shorter than off.

Mode unaligned (issue 22; ``--no-unaligned`` skips it): the same pipeline, each daemon
again, debloating off and on, with ``mode="unaligned"``: the sources' barriers are
priority barriers that overtake the backlog queued in the daemon and in the writers
(its copies are the producers' output channel state), and every reading task triggers at
its first barrier. Keys ``unaligned_ms`` (debloating on), ``unaligned_ms_debloat_off``,
``unaligned_over_aligned_debloat`` (against ``median_ms_debloat_on`` of the same run),
``unaligned_persisted_bytes_debloat_{on,off}`` (median in-flight bytes persisted per
checkpoint, all tasks). Targets: <= 100 ms median, >= 10x shorter than aligned with
debloating.

Then the exactly-once alignment modes (issue 22, ``StreamEnvironment(alignment=)``), in
the same run and pipeline, debloating on (without it a checkpoint takes 7-9 s here and a
run of 20 s completes two), at ``--alignment-parallelism`` (default 2: a
gate must have two channels for alignment to hold anything back) for
``--alignment-seconds`` each: ``block_upstream`` (the baseline), ``buffer`` (parked in the
task's memory) and ``spill`` (parked in private spill files). Per mode: the median
checkpoint duration, the median alignment (first to last barrier, the longest task) and
the median bytes processed (block_upstream) or parked (buffer, spill) while aligning, per
checkpoint, all tasks. ``--alignments=`` (empty) skips them.

First, the throughput cost of unaligned checkpoints (issue 22): the same pipeline with a
sink that does nothing (no backpressure: the job runs at its max rate, so a cost cannot
hide behind a slow sink), on one daemon of default settings, ``--throughput-rounds``
(default 4) alternated rounds of ``--throughput-records`` (default 1,000,000) each:
no checkpoints (an interval longer than the run), then unaligned checkpoints every second
(no ``min_pause``). Each sink writes the monotonic times of its record ``n/4`` and
``9n/10`` (n: its share) to a file: the rate over the middle of the run, the job's start
and end left out. Keys ``records_per_s_no_checkpoints``,
``records_per_s_unaligned_every_1s`` (medians), ``unaligned_throughput_cost``
(``1 - unaligned/none``; negative: within the noise) and ``target_unaligned_cost_met``
(<= 0.10). ``--only throughput`` runs only these; ``--throughput-rounds=0`` skips them.
The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import functools
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import ROOT, BenchError, Daemon, json_line, median

RECORD = 500  # bytes per record
SINK_DELAY = 0.001  # seconds the sink spends per record
TARGET_MS = 300  # debloat target per exchange
EXCHANGES = 2
DESIGN_MS = TARGET_MS * EXCHANGES
WARMUP = 2  # checkpoints left out at the start
#: the runtime's default (``--buffer-timeout=100ms`` is Flink's)
BUFFER_TIMEOUT = "10ms"
TARGET_VS_DESIGN = 1.5
TARGET_RATIO = 5.0
#: mode unaligned (issue 22): median under full backpressure, and how much shorter than
#: aligned with debloating
TARGET_UNALIGNED_MS = 100.0
TARGET_UNALIGNED_RATIO = 10.0
#: throughput at max rate (no slow sink): unaligned checkpoints every second vs none,
#: alternated rounds, medians; the cost target
THROUGHPUT_ROUNDS = 4
THROUGHPUT_RECORDS = 1_000_000
TARGET_UNALIGNED_COST = 0.10
#: the exactly-once alignment modes measured after the debloating pair
ALIGNMENTS = ("block_upstream", "buffer", "spill")


def make_record(size: int, i: int) -> bytes:
    return i.to_bytes(8, "big") + b"x" * (size - 8)


def identity(r: bytes) -> bytes:
    return r


def slow_sink_factory() -> Any:
    from client.streaming.functions import Collector, Operator

    class SlowSink(Operator):
        """Spends SINK_DELAY per record (Flink's benchmark: a sink that sleeps)."""

        def process(self, record: Any, out: Collector) -> None:
            time.sleep(SINK_DELAY)

    return SlowSink()


def rate_sink_factory(path: str, first: int, last: int) -> Any:
    """A sink that does nothing per record (the pipeline runs at its max rate) and writes
    to ``path`` (one file per subtask) the monotonic times at which it took its ``first``
    and ``last`` record: the steady-state rate, without the job's start and end."""
    from client.streaming.functions import Collector, Operator

    class RateSink(Operator):
        n = 0
        t_first = 0.0

        def process(self, record: Any, out: Collector) -> None:
            self.n += 1
            if self.n == first:
                self.t_first = time.monotonic()
            elif self.n == last:
                elapsed = time.monotonic() - self.t_first
                Path(path, f"sink-{self.ctx.subtask_index}").write_text(f"{last - first} {elapsed}")

    return RateSink()


def run_throughput(
    spark: Any, daemon: Daemon, count: int, args: argparse.Namespace, *, mode: str | None
) -> float:
    """Records per second of the pipeline with a sink that does nothing (max rate), over
    the middle of the run (the sinks' records ``count/p/4`` to ``count/p*9/10``): ``mode``
    ``"unaligned"`` checkpoints every second (no ``min_pause``), None none (an interval
    longer than the run: only the final checkpoint, after the window)."""
    from client.streaming.environment import StreamEnvironment

    p = args.parallelism
    share = count // p
    first, last = share // 4, share * 9 // 10
    ckpt = tempfile.mkdtemp(prefix="xbench-ckpt-")
    marks = tempfile.mkdtemp(prefix="xbench-rate-")
    try:
        env = StreamEnvironment(
            spark,
            checkpoint_dir=ckpt,
            checkpoint_interval=1.0 if mode else 86400.0,
            mode=mode or "exactly_once",
            daemon=daemon.socket_path,
            buffer_timeout=args.buffer_timeout,
        )
        (
            env.from_generator(
                functools.partial(make_record, args.record_bytes), count=count, parallelism=p
            )
            .rebalance()
            .map(identity, parallelism=p)
            .rebalance()
            .sink_to(functools.partial(rate_sink_factory, marks, first, last), parallelism=p)
        )
        result = env.execute(restart_attempts=0)
        files = list(Path(marks).iterdir())
        if len(files) != p:
            raise BenchError(f"throughput: {len(files)} of {p} sinks reported their window")
        rate = 0.0
        for f in files:
            n, elapsed = f.read_text().split()
            rate += int(n) / float(elapsed)
    finally:
        shutil.rmtree(ckpt, ignore_errors=True)
        shutil.rmtree(marks, ignore_errors=True)
    done = [c for c in result.checkpoints if not c.is_final]
    if mode and len(done) < 2:
        raise BenchError(
            f"throughput: only {len(done)} checkpoints in {result.duration:.1f} s: more "
            f"--throughput-records"
        )
    return rate


def run_job(
    spark: Any,
    daemon: Daemon,
    count: int,
    args: argparse.Namespace,
    *,
    parallelism: int | None = None,
    alignment: str = "block_upstream",
    mode: str = "exactly_once",
) -> dict[str, Any]:
    parallelism = args.parallelism if parallelism is None else parallelism
    warmup = args.warmup_checkpoints
    from client.streaming.environment import StreamEnvironment

    ckpt = tempfile.mkdtemp(prefix="xbench-ckpt-")
    try:
        env = StreamEnvironment(
            spark,
            checkpoint_dir=ckpt,
            checkpoint_interval=1.0,
            min_pause=1.0,
            mode=mode,
            daemon=daemon.socket_path,
            buffer_timeout=args.buffer_timeout,
            **({"alignment": alignment} if mode == "exactly_once" else {}),
        )
        (
            env.from_generator(
                functools.partial(make_record, args.record_bytes),
                count=count,
                parallelism=parallelism,
            )
            .rebalance()
            .map(identity, parallelism=parallelism)
            .rebalance()
            .sink_to(slow_sink_factory, parallelism=parallelism)
        )
        result = env.execute(restart_attempts=0)
    finally:
        shutil.rmtree(ckpt, ignore_errors=True)
    done = [c for c in result.checkpoints if not c.is_final]  # completed ones
    if len(done) <= warmup:
        raise BenchError(
            f"only {len(done)} checkpoints completed in {result.duration:.1f} s: run longer "
            f"(--seconds); history {result.checkpoints}"
        )
    durations = [1000 * c.duration for c in done[warmup:]]
    return {
        "alignment_ms": median([1000 * c.alignment for c in done[warmup:]]),
        "aligned_bytes": median([float(c.aligned_bytes) for c in done[warmup:]]),
        "durations_ms": durations,
        "median_ms": median(durations),
        "checkpoints": len(durations),
        "aborted": len(result.aborted_checkpoints),
        "unaligned": sum(1 for c in done[warmup:] if c.unaligned),
        # in-flight bytes persisted per checkpoint, all tasks (mode unaligned: input
        # channel state, heads of cut records, output channel state)
        "persisted_bytes": median([float(sum(c.persisted_bytes.values())) for c in done[warmup:]]),
        "records_per_s": count / result.duration,
        "seconds": result.duration,
    }


def run_on_daemon(
    flags: tuple[str, ...], label: str, spark: Any, count: int, args: argparse.Namespace, **kw: Any
) -> dict[str, Any]:
    """``run_job`` on a daemon of its own started with ``flags``; its pool whole at stop."""
    with Daemon(*flags) as daemon:
        r = run_job(spark, daemon, count, args, **kw)
        if not daemon.stop():
            raise BenchError(f"{label}: the daemon's pool was not whole at stop")
    return r


def session(parallelism: int) -> Any:
    os.environ["PYSPARK_PYTHON"] = sys.executable
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]
    )
    from pyspark.sql import SparkSession

    spark = (
        SparkSession.builder.master(f"local[{3 * parallelism}]")
        .appName("bench-checkpointing")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.driver.host", "127.0.0.1")
        .config("spark.driver.bindAddress", "127.0.0.1")
        .config("spark.python.worker.reuse", "true")
        .getOrCreate()
    )
    spark.sparkContext.setLogLevel("ERROR")
    return spark


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seconds", type=float, default=40.0, help="job length per configuration")
    ap.add_argument("--parallelism", type=int, default=1)
    ap.add_argument("--record-bytes", type=int, default=RECORD)
    ap.add_argument(
        "--buffer-timeout", default=BUFFER_TIMEOUT, help="a task's output buffer timeout"
    )
    ap.add_argument("--warmup-checkpoints", type=int, default=WARMUP, help="left out at the start")
    ap.add_argument(
        "--only",
        choices=("off", "on", "throughput"),
        help="run one configuration (no ratio), or only the throughput rounds",
    )
    ap.add_argument(
        "--throughput-rounds",
        type=int,
        default=THROUGHPUT_ROUNDS,
        help="rounds of (no checkpoints, unaligned every 1 s) at max rate; 0: none",
    )
    ap.add_argument(
        "--throughput-records",
        type=int,
        default=THROUGHPUT_RECORDS,
        help="records per throughput run (all sources)",
    )
    ap.add_argument(
        "--alignments",
        default=",".join(ALIGNMENTS),
        help="alignment modes to measure after the debloating pair (comma separated; empty: none)",
    )
    ap.add_argument(
        "--no-unaligned",
        action="store_true",
        help="skip mode unaligned (priority barriers), debloating off and on",
    )
    ap.add_argument("--alignment-parallelism", type=int, default=2)
    ap.add_argument("--alignment-seconds", type=float, default=25.0)
    args = ap.parse_args()
    p = args.parallelism
    alignments = [a for a in args.alignments.split(",") if a]
    for a in alignments:
        if a not in ALIGNMENTS:
            ap.error(f"--alignments: {a!r} is not one of {', '.join(ALIGNMENTS)}")
    if alignments and "block_upstream" not in alignments:
        alignments.insert(0, "block_upstream")  # the baseline of the same run
    ap_ = args.alignment_parallelism
    # the sink's rate bounds the job: p sinks at ~1 record per SINK_DELAY
    count = int(args.seconds * p / SINK_DELAY)
    spark = session(max(p, ap_ if alignments and not args.only else 1))
    aligned: dict[str, dict[str, Any]] = {}
    results: dict[str, dict[str, Any]] = {}
    unaligned: dict[str, dict[str, Any]] = {}
    throughput: dict[str, list[float]] = {}
    try:
        if args.throughput_rounds > 0 and args.only in (None, "throughput"):
            throughput = run_throughput_rounds(spark, args)
        for name, flags in (
            ("off", ()),
            ("on", ("--debloat", f"--debloat-target={TARGET_MS}ms")),
        ):
            if args.only is not None and args.only != name:
                continue
            r = results[name] = run_on_daemon(flags, f"debloat {name}", spark, count, args)
            print(
                f"debloating {name:3}: median checkpoint {r['median_ms']:7.0f} ms over "
                f"{r['checkpoints']} checkpoints ({r['aborted']} aborted), "
                f"{r['records_per_s']:.0f} records/s, all (ms): "
                + " ".join(f"{d:.0f}" for d in r["durations_ms"]),
                flush=True,
            )
            if args.no_unaligned:
                continue
            # the same pipeline, unaligned checkpoints (priority barriers)
            r = unaligned[name] = run_on_daemon(
                flags, f"unaligned {name}", spark, count, args, mode="unaligned"
            )
            print(
                f"unaligned, debloating {name:3}: median checkpoint {r['median_ms']:7.1f} ms "
                f"over {r['checkpoints']} checkpoints ({r['unaligned']} unaligned, "
                f"{r['aborted']} aborted), {r['persisted_bytes']:.0f} bytes persisted per "
                f"checkpoint, {r['records_per_s']:.0f} records/s, all (ms): "
                + " ".join(f"{d:.0f}" for d in r["durations_ms"]),
                flush=True,
            )
        for mode in [] if args.only else alignments:
            with Daemon("--debloat", f"--debloat-target={TARGET_MS}ms") as daemon:
                aligned[mode] = run_job(
                    spark,
                    daemon,
                    int(args.alignment_seconds * ap_ / SINK_DELAY),
                    args,
                    parallelism=ap_,
                    alignment=mode,
                )
                if not daemon.stop():
                    raise BenchError(f"alignment {mode}: the daemon's pool was not whole at stop")
            r = aligned[mode]
            print(
                f"alignment {mode:14}: median checkpoint {r['median_ms']:7.0f} ms, alignment "
                f"{r['alignment_ms']:6.0f} ms, {r['aligned_bytes']:9.0f} bytes "
                f"{'processed' if mode == 'block_upstream' else 'parked'} while aligning, "
                f"over {r['checkpoints']} checkpoints ({r['aborted']} aborted), "
                f"{r['records_per_s']:.0f} records/s",
                flush=True,
            )
    finally:
        spark.stop()
    if args.only == "throughput":
        print(json_line({"bench": "checkpointing", **_throughput_keys(throughput)}))
        return
    if args.only:
        return
    off, on = results["off"]["median_ms"], results["on"]["median_ms"]
    ratio = off / on
    vs_design = on / DESIGN_MS
    print(
        f"off/on {ratio:.2f}x (target >= {TARGET_RATIO}x); on vs design {DESIGN_MS} ms: "
        f"{vs_design:.2f}x (target <= {TARGET_VS_DESIGN}x)"
    )
    print(
        json_line(
            {
                "bench": "checkpointing",
                "parallelism": p,
                "record_bytes": args.record_bytes,
                "buffer_timeout": str(args.buffer_timeout),
                "design_ms": DESIGN_MS,
                "median_ms_debloat_off": off,
                "median_ms_debloat_on": on,
                "checkpoints_off": results["off"]["checkpoints"],
                "checkpoints_on": results["on"]["checkpoints"],
                "records_per_s_off": results["off"]["records_per_s"],
                "records_per_s_on": results["on"]["records_per_s"],
                "ratio_off_on": ratio,
                "on_vs_design": vs_design,
                "target_ratio_met": ratio >= TARGET_RATIO,
                "target_design_met": vs_design <= TARGET_VS_DESIGN,
                **_alignment_keys(aligned, ap_),
                **_unaligned_keys(unaligned, results),
                **_throughput_keys(throughput),
            }
        )
    )


def run_throughput_rounds(spark: Any, args: argparse.Namespace) -> dict[str, list[float]]:
    """Alternated rounds on one daemon (default settings): no checkpoints, then unaligned
    checkpoints every second; records/s of each run."""
    rates: dict[str, list[float]] = {"none": [], "unaligned": []}
    with Daemon() as daemon:
        for i in range(args.throughput_rounds):
            for key, mode in (("none", None), ("unaligned", "unaligned")):
                rates[key].append(
                    run_throughput(spark, daemon, args.throughput_records, args, mode=mode)
                )
            print(
                f"throughput round {i + 1}: no checkpoints {rates['none'][-1]:.0f} records/s, "
                f"unaligned every 1 s {rates['unaligned'][-1]:.0f} records/s",
                flush=True,
            )
        if not daemon.stop():
            raise BenchError("throughput: the daemon's pool was not whole at stop")
    return rates


def _throughput_keys(rates: dict[str, list[float]]) -> dict[str, Any]:
    """The JSON keys of the throughput rounds (none when skipped). Target (issue 22): the
    medians of unaligned checkpoints every second cost <= 10 % of none's."""
    if not rates:
        return {}
    none, unaligned = median(rates["none"]), median(rates["unaligned"])
    cost = 1 - unaligned / none
    return {
        "throughput_rounds": len(rates["none"]),
        "records_per_s_no_checkpoints": none,
        "records_per_s_unaligned_every_1s": unaligned,
        "unaligned_throughput_cost": cost,
        "target_unaligned_cost_met": cost <= TARGET_UNALIGNED_COST,
    }


def _unaligned_keys(
    unaligned: dict[str, dict[str, Any]], aligned: dict[str, dict[str, Any]]
) -> dict[str, Any]:
    """The JSON keys of mode unaligned, beside the aligned figures of the same run (none
    when skipped). Targets (issue 22): <= 100 ms median, >= 10x shorter than aligned with
    debloating."""
    if not unaligned:
        return {}
    on, off = unaligned["on"], unaligned["off"]
    ratio = on["median_ms"] / aligned["on"]["median_ms"]
    return {
        "unaligned_ms": on["median_ms"],
        "unaligned_ms_debloat_off": off["median_ms"],
        "unaligned_over_aligned_debloat": ratio,
        "unaligned_over_aligned_no_debloat": off["median_ms"] / aligned["off"]["median_ms"],
        "unaligned_persisted_bytes_debloat_on": on["persisted_bytes"],
        "unaligned_persisted_bytes_debloat_off": off["persisted_bytes"],
        "unaligned_checkpoints": on["checkpoints"],
        "unaligned_checkpoints_debloat_off": off["checkpoints"],
        "records_per_s_unaligned_on": on["records_per_s"],
        "records_per_s_unaligned_off": off["records_per_s"],
        "target_unaligned_ms_met": on["median_ms"] <= TARGET_UNALIGNED_MS,
        "target_unaligned_ratio_met": ratio <= 1 / TARGET_UNALIGNED_RATIO,
    }


def _alignment_keys(aligned: dict[str, dict[str, Any]], parallelism: int) -> dict[str, Any]:
    """The JSON keys of the alignment modes measured (none when skipped)."""
    if not aligned:
        return {}
    base = aligned["block_upstream"]["median_ms"]
    out: dict[str, Any] = {"alignment_parallelism": parallelism}
    for mode, r in aligned.items():
        out[f"median_ms_align_{mode}"] = r["median_ms"]
        out[f"alignment_ms_{mode}"] = r["alignment_ms"]
        out[f"aligned_bytes_{mode}"] = r["aligned_bytes"]
        out[f"checkpoints_align_{mode}"] = r["checkpoints"]
        out[f"records_per_s_align_{mode}"] = r["records_per_s"]
        out[f"ratio_align_{mode}_vs_block_upstream"] = r["median_ms"] / base
    return out


if __name__ == "__main__":
    main()
