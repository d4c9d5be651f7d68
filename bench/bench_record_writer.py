"""Benchmark: the standalone RecordWriter (no daemon, no I/O), CPU per record.

Run ``python bench/bench_record_writer.py`` (``--quick`` for a short run). One process
emits 1.25 M records into a ``RecordWriter`` of 8 subpartitions (32 KiB buffers, no
timer) by ``emit_all`` in chunks of 10,000 (as a PySpark producer does), taking the cut
buffers after each chunk: routing (``exchange/writer/routing.pyx``), batching, encoding
(one pickle per batch) and cutting. Two record mixes: ``(int, int)`` (every key hashed
inline) and mixed keys (a quarter each: ints, str and bytes keys of 50,000 distinct
values through the key cache, negative ints). The routed records are checked: every
subpartition decodes back to exactly the records its keys hash to. Baseline, in the same
run: the map side of PySpark's ``partitionBy`` in Python (``portable_hash`` per key into
per-partition lists, each pickled per 1,024 records), the work a Spark shuffle's Python
worker does for the same records. Figure: this process's CPU (``time.process_time``) per
record, median of the rounds. The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import os
import pickle
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import BenchError, json_line, median

from exchange.writer import RecordWriter, deterministic_hash

N_SUB = 8
CHUNK = 10_000


def int_records(count: int) -> list[tuple[int, int]]:
    return [(i, i) for i in range(count)]


def mixed_records(count: int) -> list[tuple[Any, Any]]:
    out: list[tuple[Any, Any]] = []
    for i in range(count):
        kind = i % 4
        if kind == 0:
            out.append((i * 7919, "v"))
        elif kind == 1:
            out.append((f"user-{i % 50_000}", i))
        elif kind == 2:
            out.append((f"user-{i % 50_000}".encode(), i))
        else:
            out.append((-i, 1.5))
    return out


def run(records: list[Any], check: bool) -> float:
    """CPU seconds to emit ``records`` and close the writer."""
    writer = RecordWriter(N_SUB, buffer_size=32 * 1024, buffer_timeout=-1)
    outs = []
    cpu0 = time.process_time()
    for i in range(0, len(records), CHUNK):
        writer.emit_all(records[i : i + CHUNK])
        outs += writer.take_output()
    outs += writer.close()
    cpu = time.process_time() - cpu0
    if check:
        decoders = [writer.codec.new_decoder() for _ in range(N_SUB)]
        got: list[list[Any]] = [[] for _ in range(N_SUB)]
        for out in outs:
            decoders[out.target].feed(memoryview(out.to_bytes()))
            got[out.target].extend(decoders[out.target].take())
        want: list[list[Any]] = [[] for _ in range(N_SUB)]
        for record in records:
            want[deterministic_hash(record[0]) % N_SUB].append(record)
        if got != want:
            raise BenchError("a subpartition did not get exactly the records its keys hash to")
    return cpu


def spark_baseline(records: list[Any]) -> float:
    """CPU seconds PySpark's partitionBy map side takes for ``records`` (see the module)."""
    os.environ.setdefault("PYTHONHASHSEED", "0")  # portable_hash refuses salted str hashes
    from pyspark.rdd import portable_hash

    buckets: list[list[Any]] = [[] for _ in range(N_SUB)]
    size = 0
    cpu0 = time.process_time()
    for k, v in records:
        bucket = buckets[portable_hash(k) % N_SUB]
        bucket.append((k, v))
        if len(bucket) >= 1024:
            size += len(pickle.dumps(bucket, 5))
            bucket.clear()
    for bucket in buckets:
        size += len(pickle.dumps(bucket, 5))
    cpu = time.process_time() - cpu0
    if size <= 0:
        raise BenchError("the baseline pickled nothing")
    return cpu


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="250,000 records, 3 rounds")
    args = ap.parse_args()
    count = 250_000 if args.quick else 1_250_000
    rounds = 3 if args.quick else 5
    mixes = {"int": int_records(count), "mixed": mixed_records(count)}
    cpu: dict[str, list[float]] = {name: [] for name in mixes}
    base: dict[str, list[float]] = {name: [] for name in mixes}
    for r in range(rounds):  # the mixes and both sides interleaved, against load drift
        for name, records in mixes.items():
            cpu[name].append(run(records, check=r == 0))
            base[name].append(spark_baseline(records))
    results: dict[str, Any] = {
        "bench": "record_writer",
        "records": count,
        "subpartitions": N_SUB,
        "quick": args.quick,
    }
    for name in mixes:
        ours = results[f"writer_{name}_ns_per_rec"] = median(cpu[name]) / count * 1e9
        theirs = results[f"spark_partition_{name}_ns_per_rec"] = median(base[name]) / count * 1e9
        results[f"{name}_speedup_over_spark"] = theirs / ours
        print(
            f"  {name:5} records: {ours:6.1f} ns CPU per record "
            f"{[round(c / count * 1e9, 1) for c in cpu[name]]}; PySpark's partitionBy map "
            f"side {theirs:6.1f} ns ({theirs / ours:.2f}x)"
        )
    print(json_line(results))


if __name__ == "__main__":
    main()
