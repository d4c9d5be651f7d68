"""Benchmark: one producer, one consumer, one process, one asyncio loop, end to end.

Run ``python bench/bench_local_exchange.py`` (``--quick`` for a short run, ``--profile``
to print the hot spots of one small-record run). Every figure is the median of 5 runs.
The last line printed is one JSON object with all figures.

* exchange: ``RecordWriter.emit_all`` -> pipelined ResultPartition (32 KiB segments,
  NetworkBufferPool 2048 x 32 KiB, partition pool required 1 / max 64) ->
  LocalInputChannel -> SingleInputGate -> ``RecordReader.next_batch()``; producer and
  consumer are two tasks of one loop (uvloop if importable).
* plain: ``msgpack.packb`` per record into a byte stream, fed in 32 KiB chunks to one
  streaming ``msgpack.Unpacker`` that yields the records back: the floor any
  msgpack-based exchange pays. Also measured with one reused ``msgpack.Packer`` (the
  writer's codec does that, so it is the stricter floor).

Records are built before the clock starts. MB/s counts serialized bytes.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import gc
import io
import json
import pstats
import statistics
import sys
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import msgpack

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from exchange.consumer import LocalInputChannel, RecordReader, SingleInputGate
from exchange.memory import NetworkBufferPool
from exchange.partition import (
    ResultPartition,
    ResultPartitionID,
    ResultPartitionManager,
    ResultPartitionType,
)
from exchange.writer import RecordWriter

SEGMENT = 32 * 1024
TOTAL_SEGMENTS = 2048
POOL_REQUIRED = 1
POOL_MAX = 64
RUNS = 5
TARGET_RATIO = 0.50

try:
    import uvloop

    LOOP_NAME = "uvloop"
    loop_factory: Callable[[], asyncio.AbstractEventLoop] | None = uvloop.new_event_loop
except ImportError:  # pragma: no cover - uvloop is a dependency where it builds
    LOOP_NAME = "asyncio"
    loop_factory = None


def run_async(coro: Coroutine[Any, Any, float]) -> float:
    with asyncio.Runner(loop_factory=loop_factory) as runner:
        return runner.run(coro)


# -- the exchange ---------------------------------------------------------------------------


async def exchange_once(nbp: NetworkBufferPool, records: list[Any], run: int) -> float:
    """Seconds to move ``records`` from a RecordWriter to a RecordReader."""
    manager = ResultPartitionManager()
    pid = ResultPartitionID("bench", run)
    part = ResultPartition(
        pid, ResultPartitionType.PIPELINED, 1, nbp.create_buffer_pool(POOL_REQUIRED, POOL_MAX)
    )
    manager.register_result_partition(part)
    gate = SingleInputGate("bench")
    gate.set_input_channels([LocalInputChannel(gate, 0, manager, pid, 0)])
    await gate.request_partitions()
    writer = RecordWriter(part)
    reader = RecordReader(gate)
    received = 0

    async def produce() -> None:
        await writer.emit_all(records)
        await writer.close()

    async def consume() -> None:
        nonlocal received
        next_batch = reader.next_batch
        while (batch := await next_batch()) is not None:
            received += len(batch)

    gc.disable()
    try:
        t0 = time.perf_counter()
        await asyncio.gather(produce(), consume())
        elapsed = time.perf_counter() - t0
    finally:
        gc.enable()
    reader.close()
    manager.release_all()
    if received != len(records):
        raise AssertionError(f"received {received} of {len(records)} records")
    return elapsed


def exchange_bytes(records: list[Any]) -> int:
    packer = msgpack.Packer()
    return sum(len(packer.pack(r)) for r in records)


# -- the plain msgpack baseline -------------------------------------------------------------


def plain_once(records: list[Any], *, reuse_packer: bool = False) -> float:
    """Seconds to pack every record and unpack the stream fed in 32 KiB chunks.

    ``msgpack.packb`` per record as briefed; ``reuse_packer`` uses one
    ``msgpack.Packer().pack`` instead (what the RecordWriter's codec does), the stricter
    floor. Each chunk's records come out as one list, as the reader's batches do.
    """
    pack = msgpack.Packer().pack if reuse_packer else msgpack.packb
    gc.disable()
    try:
        t0 = time.perf_counter()
        unpacker = msgpack.Unpacker(raw=False)
        stream = bytearray()
        received = 0
        for record in records:
            stream += pack(record)
            if len(stream) >= SEGMENT:
                with memoryview(stream) as view:
                    unpacker.feed(view[:SEGMENT])
                    rest = bytearray(view[SEGMENT:])
                stream = rest
                received += len(list(unpacker))
        unpacker.feed(stream)
        received += len(list(unpacker))
        elapsed = time.perf_counter() - t0
    finally:
        gc.enable()
    if received != len(records):
        raise AssertionError(f"unpacked {received} of {len(records)} records")
    return elapsed


# -- driver ---------------------------------------------------------------------------------


def median_seconds(run: Callable[[int], float]) -> float:
    times = []
    for i in range(RUNS):
        gc.collect()
        times.append(run(i))
    return statistics.median(times)


def measure(name: str, records: list[Any], nbp: NetworkBufferPool) -> dict[str, float]:
    nbytes = exchange_bytes(records)
    ex = median_seconds(lambda i: run_async(exchange_once(nbp, records, i)))
    plain = median_seconds(lambda i: plain_once(records))
    packer = median_seconds(lambda i: plain_once(records, reuse_packer=True))
    nbp.check_consistency()
    assert nbp.is_whole(), nbp.stats()
    n = len(records)
    return {
        "records": n,
        "record_bytes": round(nbytes / n, 1),
        "exchange_rec_s": round(n / ex),
        "exchange_mb_s": round(nbytes / ex / 1e6, 1),
        "plain_rec_s": round(n / plain),
        "plain_mb_s": round(nbytes / plain / 1e6, 1),
        "packer_rec_s": round(n / packer),
        "ratio": round(plain / ex, 3),
        "ratio_packer": round(packer / ex, 3),
    }


def profile(records: list[Any], nbp: NetworkBufferPool, top: int = 25) -> str:
    prof = cProfile.Profile()
    prof.enable()
    run_async(exchange_once(nbp, records, 99))
    prof.disable()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(top)
    return out.getvalue()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer records (a smoke run)")
    parser.add_argument("--profile", action="store_true", help="cProfile one small run")
    args = parser.parse_args()

    n_small = 200_000 if args.quick else 1_500_000
    n_kib = 20_000 if args.quick else 200_000
    small = [(i, "abcdefgh", 1.5) for i in range(n_small)]
    kib = [(i, "k" * 1_000) for i in range(n_kib)]

    nbp = NetworkBufferPool(TOTAL_SEGMENTS, SEGMENT)
    try:
        if args.profile:
            print(profile(small, nbp))
        results = {"small": measure("small", small, nbp), "kib": measure("kib", kib, nbp)}
    finally:
        nbp.destroy()

    print(f"local exchange, {LOOP_NAME}, median of {RUNS} runs")
    header = f"{'records':<8}{'count':>10}{'B/rec':>8}"
    header += f"{'exchange rec/s':>16}{'MB/s':>9}{'plain rec/s':>14}{'MB/s':>9}{'ratio':>8}"
    header += f"{'Packer rec/s':>15}{'ratio':>8}"
    print(header)
    for name, r in results.items():
        print(
            f"{name:<8}{r['records']:>10}{r['record_bytes']:>8}"
            f"{r['exchange_rec_s']:>16,}{r['exchange_mb_s']:>9}"
            f"{r['plain_rec_s']:>14,}{r['plain_mb_s']:>9}{r['ratio']:>8}"
            f"{r['packer_rec_s']:>15,}{r['ratio_packer']:>8}"
        )
    print("ratio = exchange rate / plain rate (plain: packb per record, as briefed);")
    print("Packer: the same baseline with one reused msgpack.Packer (a stricter floor)")
    ratio = results["small"]["ratio"]
    summary = {
        "bench": "local_exchange",
        "loop": LOOP_NAME,
        "quick": args.quick,
        "runs": RUNS,
        **{f"{name}_{k}": v for name, r in results.items() for k, v in r.items()},
        "ratio_small_vs_plain": ratio,
        "target_ratio": TARGET_RATIO,
        "target_met": ratio >= TARGET_RATIO,
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
