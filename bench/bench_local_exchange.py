"""Benchmark: a same-host exchange, producer and consumer tasks on one daemon's Unix socket.

Run ``python bench/bench_local_exchange.py`` (``--quick`` for a short run). What PySpark
runs when both tasks sit on one host (every task in local mode): a producer task process
writes a pipelined partition through ``client.producer.PartitionWriter`` to its daemon
(``python -m server``) over the local socket; a consumer task process reads it with
``client.consumer.PartitionReader`` over the same daemon's Unix socket (the location
names the daemon, so the reader skips TCP), decoding and checking every record
(``_common.Checker``). The clock runs from the producer's first record to the consumer's
last. (The in-process path, ``ResultPartitionWriter`` into a ``LocalInputChannel``, is
test tooling in ``tests/kit``, not what tasks run; it is not measured here.)

Baselines, in one process on the same records (``bytes`` of 100 B and 4 KiB): pack and
unpack with no exchange at all:

* pickle: ``pickle.dumps`` of per-buffer lists (protocol 5) and ``pickle.loads`` of each,
  the floor of the default codec's format;
* msgpack: ``msgpack.packb`` per record into a stream, fed in 32 KiB pieces to one
  streaming ``msgpack.Unpacker``.

Figures are M records/s and MB/s of payload, medians of the rounds (rounds interleave the
configurations); ratio = exchange / baseline. The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import gc
import pickle
import sys
import time
from pathlib import Path
from typing import Any

import msgpack

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import (
    POOL,
    SEG,
    BenchError,
    Daemon,
    json_line,
    median,
    producer_to_consumer,
    records,
)

SIZES = {"small": 100, "kib": 4096}


def exchange_once(daemon: Daemon, dataset: str, size: int, count: int) -> float:
    """Seconds for ``count`` records from a producer task to a consumer task, same host."""
    return producer_to_consumer(daemon, dataset, size, count, same_host=True)[2]


def pickle_once(recs: list[bytes], size: int) -> float:
    """Seconds to dumps buffer-sized lists and loads them back."""
    per = max(1, SEG // (size + 8))
    groups = [recs[i : i + per] for i in range(0, len(recs), per)]
    dumps, loads = pickle.dumps, pickle.loads
    gc.disable()
    try:
        t0 = time.perf_counter()
        got = sum(len(loads(dumps(group, 5))) for group in groups)
        elapsed = time.perf_counter() - t0
    finally:
        gc.enable()
    if got != len(recs):
        raise BenchError(f"pickle gave back {got} of {len(recs)} records")
    return elapsed


def msgpack_once(recs: list[bytes]) -> float:
    """Seconds to packb each record and unpack the stream fed in 32 KiB pieces."""
    packb = msgpack.packb
    gc.disable()
    try:
        t0 = time.perf_counter()
        unpacker = msgpack.Unpacker()
        stream = bytearray()
        got = 0
        for record in recs:
            stream += packb(record)
            if len(stream) >= SEG:
                with memoryview(stream) as view:
                    unpacker.feed(view[:SEG])
                    rest = bytearray(view[SEG:])
                stream = rest
                got += len(list(unpacker))
        unpacker.feed(stream)
        got += len(list(unpacker))
        elapsed = time.perf_counter() - t0
    finally:
        gc.enable()
    if got != len(recs):
        raise BenchError(f"msgpack gave back {got} of {len(recs)} records")
    return elapsed


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="smaller runs, 3 rounds")
    args = ap.parse_args()
    rounds = 3 if args.quick else 5
    total = {"small": 1_000_000 if args.quick else 4_000_000}
    total["kib"] = (128_000_000 if args.quick else 512_000_000) // SIZES["kib"]
    counts = {name: max(POOL, n // POOL * POOL) for name, n in total.items()}
    # the baselines run on a slice (the same records), scaled to rates
    base_counts = {name: min(n, 1_000_000, 64_000_000 // SIZES[name]) for name, n in counts.items()}

    seconds: dict[str, list[float]] = {}
    daemon = Daemon()
    try:
        for r in range(rounds):
            for name, size in SIZES.items():
                recs = list(records(size, base_counts[name]))
                seconds.setdefault(f"{name}_exchange", []).append(
                    exchange_once(daemon, f"local-{name}-{r}", size, counts[name])
                )
                seconds.setdefault(f"{name}_pickle", []).append(pickle_once(recs, size))
                seconds.setdefault(f"{name}_msgpack", []).append(msgpack_once(recs))
                del recs
        whole = daemon.stop()
    finally:
        daemon.close()
    if not whole:
        raise BenchError("the daemon's network pool was not whole when it stopped")

    results: dict[str, Any] = {"bench": "local_exchange", "quick": args.quick, "rounds": rounds}
    print(f"same-host exchange over the daemon's Unix socket, median of {rounds} rounds")
    print(f"{'records':<8}{'count':>10}{'M rec/s':>10}{'MB/s':>9}  baselines (M rec/s, ratio)")
    for name, size in SIZES.items():
        ex = counts[name] / median(seconds[f"{name}_exchange"])
        pk = base_counts[name] / median(seconds[f"{name}_pickle"])
        mp = base_counts[name] / median(seconds[f"{name}_msgpack"])
        results.update(
            {
                f"{name}_record_bytes": size,
                f"{name}_records": counts[name],
                f"{name}_exchange_m_recps": ex / 1e6,
                f"{name}_exchange_mb_s": ex * size / 1e6,
                f"{name}_pickle_m_recps": pk / 1e6,
                f"{name}_msgpack_m_recps": mp / 1e6,
                f"{name}_over_pickle": ex / pk,
                f"{name}_over_msgpack": ex / mp,
            }
        )
        print(
            f"{name:<8}{counts[name]:>10}{ex / 1e6:>10.2f}{ex * size / 1e6:>9.0f}  "
            f"pickle {pk / 1e6:.2f} ({ex / pk:.2f}), msgpack {mp / 1e6:.2f} ({ex / mp:.2f})"
        )
    print(json_line(results))


if __name__ == "__main__":
    main()
