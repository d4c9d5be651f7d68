"""Benchmark: the daemon's memory with a stalled consumer while a producer pushes 2 GB.

Run ``python bench/bench_memory.py`` (``--quick`` for a shorter time bound). A daemon
(``python -m server``, default settings: 64 MiB of network memory) gets a pipelined
partition from a producer task process (``client.producer.PartitionWriter``, 4 KiB
records) and one consumer task process attached to it (``client.consumer.PartitionReader``
opened) that never reads, once with 1 subpartition and once with ``WIDE`` subpartitions (the
consumer attached to the first; records go round the subpartitions, so the partition's pool
fills nearly all network memory). The producer pushes until 2 GB were attempted, or until it is
blocked (nothing more handed to the writer for ``STALL_SECONDS``: backpressure reached
the task), or the time bound passes. The daemon's RSS (``VmRSS`` of ``/proc/<pid>/status``)
is sampled every 50 ms throughout (the producer task's too, for reference); its peak is
compared with its network memory
(target: peak RSS <= network memory + 100 MB). The producer and consumer are then killed
and the daemon must stop with its network pool whole.

The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time
from multiprocessing.connection import Connection
from multiprocessing.sharedctypes import Synchronized
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import READY_TIMEOUT, BenchError, Child, Daemon, json_line, proc_rss, record_pool

RECORD = 4096
ATTEMPT_BYTES = 2_000_000_000
SAMPLE_SECONDS = 0.05
STALL_SECONDS = 2.0
MB = 1_000_000
TARGET_OVER_NETWORK = 100 * MB
#: Subpartitions of the wide run: its partition's pool may take 2 * WIDE + 8 = 2008 of the
#: 2048 segments of the default network memory.
WIDE = 1000


def push(
    conn: Connection,
    socket_path: str,
    dataset: str,
    num_subpartitions: int,
    attempted: Synchronized[int],
) -> None:
    """A producer task pushing up to ATTEMPT_BYTES; ``attempted`` counts records taken.

    Record k goes to subpartition k % num_subpartitions.
    """
    from client.producer import PartitionWriter
    from exchange.partition.result_partition_id import ResultPartitionID

    pool = record_pool(RECORD)
    count = ATTEMPT_BYTES // RECORD

    def source() -> Any:
        for i, record in enumerate(itertools.islice(itertools.cycle(pool), count)):
            if i % 64 == 0:
                attempted.value = i
            yield record
        attempted.value = count

    n = num_subpartitions
    writer = PartitionWriter(ResultPartitionID(dataset, 0), n, daemon_socket=socket_path)
    conn.send("ready")
    conn.recv()
    writer.emit_all(source(), partition_func=lambda k: k % n, key_func=_index)
    writer.close()  # only with a consumer that reads; the driver kills this process
    conn.send("done")


def _index(record: bytes) -> int:
    return int.from_bytes(record[:8], "big")


def stall(conn: Connection, dataset: str, data_address: str) -> None:
    """A consumer task attached to the partition that never reads a record."""
    from client.consumer import PartitionLocation, PartitionReader
    from exchange.partition.result_partition_id import ResultPartitionID

    reader = PartitionReader([PartitionLocation(ResultPartitionID(dataset, 0), 0, data_address)])
    conn.send("ready")
    conn.recv()  # the driver kills this process
    reader.close()


def scenario(num_subpartitions: int, bound: float) -> dict[str, Any]:
    """One daemon, one producer of ``num_subpartitions``, a stalled consumer of the first."""
    import multiprocessing as mp

    attempted = mp.get_context("spawn").Value("q", 0)
    daemon = Daemon()
    producer: Child | None = None
    consumer: Child | None = None
    samples: list[int] = []
    producer_samples: list[int] = []
    blocked = False
    try:
        idle_rss = daemon.rss()
        producer = Child(push, daemon.socket_path, "mem", num_subpartitions, attempted)
        if producer.recv(READY_TIMEOUT) != "ready":
            raise BenchError("producer did not open its partition")
        consumer = Child(stall, "mem", daemon.data_address)
        if consumer.recv(READY_TIMEOUT) != "ready":
            raise BenchError("consumer did not attach")
        producer.send("go")
        t0 = time.monotonic()
        last_value, last_change = 0, t0
        limit = ATTEMPT_BYTES // RECORD
        while True:
            samples.append(daemon.rss())
            producer_samples.append(proc_rss(producer.pid))
            now = time.monotonic()
            value = attempted.value
            if value != last_value:
                last_value, last_change = value, now
            if value >= limit or now - t0 > bound:
                break
            if value > 0 and now - last_change >= STALL_SECONDS:
                blocked = True
                break
            time.sleep(SAMPLE_SECONDS)
        elapsed = time.monotonic() - t0
        stats = daemon.stats()
        producer.kill()
        consumer.kill()
        producer = consumer = None
        whole = daemon.stop()
    finally:
        for child in (producer, consumer):
            if child is not None:
                child.kill()
        daemon.close()
    network = daemon.network_memory
    peak = max(samples)
    return {
        "subpartitions": num_subpartitions,
        "attempted_bytes": attempted.value * RECORD,
        "producer_blocked": blocked,
        "seconds": elapsed,
        "daemon_bytes_received": stats["local"]["bytes_received"],
        "daemon_segments_in_use": stats["network"]["used_segments"],
        "network_memory_bytes": network,
        "idle_rss_bytes": idle_rss,
        "peak_rss_bytes": peak,
        "peak_rss_over_network_memory_bytes": peak - network,
        "samples": len(samples),
        "producer_peak_rss_bytes": max(producer_samples),
        "pool_whole_after_stop": whole,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="a 10 s time bound instead of 40 s")
    args = ap.parse_args()
    bound = 10.0 if args.quick else 40.0
    # 1 subpartition: the partition's pool (16 segments) bounds it. WIDE subpartitions:
    # the partition's pool may take 2 * WIDE + 8 segments, nearly all network memory.
    runs = {"one": scenario(1, bound), "wide": scenario(WIDE, bound)}
    results: dict[str, Any] = {"bench": "memory", "quick": args.quick, "record_bytes": RECORD}
    print("daemon RSS with a stalled consumer (sampled every 50 ms)")
    for name, r in runs.items():
        results.update({f"{name}_{k}": v for k, v in r.items()})
        print(
            f"  {r['subpartitions']:>4} subpartition(s): attempted "
            f"{r['attempted_bytes'] / MB:.0f} MB in {r['seconds']:.1f}s, "
            f"{'blocked' if r['producer_blocked'] else 'NOT blocked'}; the daemon received "
            f"{r['daemon_bytes_received'] / MB:.0f} MB, holds {r['daemon_segments_in_use']} "
            f"segments; RSS idle {r['idle_rss_bytes'] / MB:.0f} MB, peak "
            f"{r['peak_rss_bytes'] / MB:.0f} MB (network memory "
            f"{r['network_memory_bytes'] / MB:.0f} MB); producer task peak RSS "
            f"{r['producer_peak_rss_bytes'] / MB:.0f} MB"
        )
    network = max(r["network_memory_bytes"] for r in runs.values())
    peak = max(r["peak_rss_bytes"] for r in runs.values())
    whole = all(r["pool_whole_after_stop"] for r in runs.values())
    results["peak_rss_bytes"] = peak
    results["target_peak_rss_bytes"] = network + TARGET_OVER_NETWORK
    results["target_met"] = peak <= network + TARGET_OVER_NETWORK
    print(f"  peak {peak / MB:.0f} MB; target <= {(network + TARGET_OVER_NETWORK) / MB:.0f} MB")
    print(json_line(results))
    if not whole:
        raise BenchError("a daemon's network pool was not whole when it stopped")


if __name__ == "__main__":
    main()
