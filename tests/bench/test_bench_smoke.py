"""The streaming benchmarks run end to end at a tiny size and end with their JSON line.

Each script runs in its own process (as ``make bench`` runs it), with its own local
SparkSession; the figures at this size mean nothing, but every run checks its own output
(the totals per key, nothing lost or twice, the daemons' pools whole) and fails otherwise.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.spark, pytest.mark.timeout(180)]

BENCH = Path(__file__).resolve().parents[2] / "bench"


def run_bench(script: str, *args: str) -> dict[str, Any]:
    pytest.importorskip("pyspark")
    proc = subprocess.run(
        [sys.executable, str(BENCH / script), *args],
        capture_output=True,
        text=True,
        timeout=170,
        cwd=BENCH.parent,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    lines = proc.stdout.strip().splitlines()
    assert lines, proc.stderr[-4000:]
    result: dict[str, Any] = json.loads(lines[-1])
    return result


def test_checkpointing_bench_smoke() -> None:
    r = run_bench(
        "bench_checkpointing.py",
        "--seconds=2",
        "--record-bytes=16000",
        "--warmup-checkpoints=0",
        "--alignments=spill",
        "--alignment-seconds=3",
        "--throughput-rounds=0",  # test_checkpointing_throughput_smoke
    )
    assert r["bench"] == "checkpointing"
    assert r["checkpoints_off"] >= 1 and r["checkpoints_on"] >= 1
    assert r["median_ms_debloat_off"] > 0 and r["median_ms_debloat_on"] > 0
    assert r["ratio_off_on"] == pytest.approx(
        r["median_ms_debloat_off"] / r["median_ms_debloat_on"], rel=1e-3
    )
    # the alignment modes: spill, and block_upstream as its same-run baseline
    assert r["alignment_parallelism"] == 2
    for mode in ("block_upstream", "spill"):
        assert r[f"checkpoints_align_{mode}"] >= 1 and r[f"median_ms_align_{mode}"] > 0
        assert r[f"aligned_bytes_{mode}"] >= 0
    assert r["ratio_align_spill_vs_block_upstream"] == pytest.approx(
        r["median_ms_align_spill"] / r["median_ms_align_block_upstream"], rel=1e-3
    )


def test_checkpointing_throughput_smoke() -> None:
    """The throughput cost of unaligned checkpoints every second, against none (one round)."""
    r = run_bench(
        "bench_checkpointing.py",
        "--only=throughput",
        "--throughput-rounds=1",
        "--throughput-records=400000",
    )
    assert r["throughput_rounds"] == 1
    none, unaligned = r["records_per_s_no_checkpoints"], r["records_per_s_unaligned_every_1s"]
    assert none > 0 and unaligned > 0
    assert r["unaligned_throughput_cost"] == pytest.approx(1 - unaligned / none, abs=1e-3)


def test_vs_structured_streaming_bench_smoke() -> None:
    r = run_bench(
        "bench_vs_structured_streaming.py",
        "--rate=200",
        "--seconds=3",
        "--warmup=0",  # the max-rate run can end within any warm-up at this size
        "--max-batch=5000",
        "--max-count=100000",
    )
    assert r["bench"] == "vs_structured_streaming"
    for name in ("spark_p50_ms", "spark_p99_ms", "ours_p50_ms", "ours_p99_ms"):
        assert r[name] > 0, name
    assert r["spark_p50_ms"] <= r["spark_p99_ms"] and r["ours_p50_ms"] <= r["ours_p99_ms"]
    assert r["spark_max_rows_per_s"] > 0 and r["ours_max_rows_per_s"] > 0


def test_frame_parser_bench_smoke() -> None:
    """Every frame is checked as it lands (a wrong one ends the run with BenchError)."""
    r = run_bench("bench_frame_parser.py", "--quick")
    assert r["bench"] == "frame_parser" and r["frames_per_run"] == 2048
    for read_ahead in ("1k", "64k", "256k"):
        assert r[f"receive_cpu_us_per_32k_read_ahead_{read_ahead}"] > 0


def test_record_writer_bench_smoke() -> None:
    """The routed records are checked against their keys' hash in the first round."""
    r = run_bench("bench_record_writer.py", "--quick")
    assert r["bench"] == "record_writer" and r["records"] == 250_000
    for mix in ("int", "mixed"):
        assert r[f"writer_{mix}_ns_per_rec"] > 0 and r[f"spark_partition_{mix}_ns_per_rec"] > 0
