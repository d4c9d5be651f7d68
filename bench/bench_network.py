"""Benchmark: the data port alone, against a raw uvloop socket and Arrow Flight, on loopback.

Run ``python bench/bench_network.py`` (``--quick`` for a short run). A real daemon
(``python -m server``) holds two FILLED blocking partitions of 4 KiB ``bytes`` records,
written beforehand by a producer task process through ``client.producer.PartitionWriter``
(default codec: pickle batches per subpartition): one with 1 subpartition, one with 8.
Each run, a fresh consumer task process reads one of them over loopback TCP with
``client.consumer.PartitionReader`` (opening the reader is inside the clock) and decodes
and checks every record (count, bytes, each record's two ends, the sum of indices;
``_common.Checker``): with 1 channel, and with 8 channels over one connection.
A second daemon, started with ``--blocking-shuffle-type mmap`` (the default is ``file``:
docs/deploy.md says why), holds the same 1-subpartition partition, read the same way in
each round: what that setting buys (``stack_1ch_mmap_*``, ``*_1ch_mmap`` keys).

Baselines, each run in the same round (rounds interleave the configurations, against
load drift):

* raw: a uvloop ``asyncio.Protocol`` sender writes 32 KiB chunks (respecting
  ``pause_writing``/``resume_writing``) to a ``Protocol`` receiver that counts bytes
  (two processes).
* flight: Arrow Flight ``DoGet`` of one binary column of 4 KiB values (two processes).

Figures are GB/s of record payload, medians of the rounds; the consumer's CPU per 32 KiB
of stream (and the share of its task thread, which decodes), and the daemon's (its threads'
schedstat around each read; the daemon serves only that reader then). Ratios stack/flight (target
>= 1.0) and stack/raw (target >= 0.45). The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import (
    GB,
    SEG,
    BenchError,
    Daemon,
    fill_partition,
    flight_gbps,
    json_line,
    median,
    read_partition,
    run_pair,
    threads_cpu,
)

CHUNK = 32 * 1024
RECORD = 4096
TARGET_FLIGHT = 1.0
TARGET_RAW = 0.45


# -- (a) raw socket -----------------------------------------------------------------------


def raw_receiver(conn: Connection, total: int) -> None:
    import uvloop

    class Receiver(asyncio.Protocol):
        def __init__(self, done: asyncio.Future[float]) -> None:
            self.done = done
            self.n = 0
            self.t0 = 0.0

        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            self.t0 = time.perf_counter()

        def data_received(self, data: bytes) -> None:
            self.n += len(data)
            if self.n >= total and not self.done.done():
                self.done.set_result(time.perf_counter() - self.t0)

    async def main() -> None:
        loop = asyncio.get_running_loop()
        done: asyncio.Future[float] = loop.create_future()
        server = await loop.create_server(lambda: Receiver(done), "127.0.0.1", 0)
        conn.send(server.sockets[0].getsockname()[1])
        elapsed = await done
        conn.send({"seconds": elapsed, "bytes": total})
        server.close()

    uvloop.run(main())


def raw_sender(conn: Connection, port: int, total: int) -> None:
    import uvloop

    class Sender(asyncio.Protocol):
        def __init__(self, done: asyncio.Future[None]) -> None:
            self.done = done
            self.chunk = bytes(CHUNK)
            self.sent = 0
            self.paused = False
            self.transport: asyncio.Transport | None = None

        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            self.transport = transport  # type: ignore[assignment]
            self.write()

        def write(self) -> None:
            transport = self.transport
            assert transport is not None
            chunk = self.chunk
            while not self.paused and self.sent < total:
                transport.write(chunk)
                self.sent += CHUNK
            if self.sent >= total and not self.done.done():
                transport.close()

        def pause_writing(self) -> None:
            self.paused = True

        def resume_writing(self) -> None:
            self.paused = False
            self.write()

        def connection_lost(self, exc: Exception | None) -> None:
            if not self.done.done():
                self.done.set_result(None)

    async def main() -> None:
        loop = asyncio.get_running_loop()
        done: asyncio.Future[None] = loop.create_future()
        await loop.create_connection(lambda: Sender(done), "127.0.0.1", port)
        await done

    uvloop.run(main())
    conn.send({})


# -- the stack ------------------------------------------------------------------------------


def read_once(daemon: Daemon, dataset: str, subpartitions: int, count: int) -> dict[str, float]:
    """A consumer task reads the filled partition over TCP: GB/s, its CPU per 32 KiB and the
    daemon's (its threads' schedstat around the whole read: it serves only this reader)."""
    daemon_cpu = threads_cpu(daemon.pid)
    res = read_partition(daemon, dataset, subpartitions, RECORD, count)
    daemon_cpu = threads_cpu(daemon.pid) - daemon_cpu
    seconds = res["t1"] - res["t0"]
    stream_buffers = count * RECORD / SEG
    return {
        "gbps": count * RECORD / seconds / GB,
        "cpu_us": res["cpu"] / stream_buffers * 1e6,
        "task_cpu_us": res["task_cpu"] / stream_buffers * 1e6,
        "daemon_cpu_us": daemon_cpu / stream_buffers * 1e6,
    }


def raw_gbps(total: int) -> float:
    _, res = run_pair(raw_receiver, (total,), raw_sender, (total,), stop_server=False)
    return float(res["bytes"]) / float(res["seconds"]) / GB


# -- driver ---------------------------------------------------------------------------------


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="256 MB per run, 3 rounds")
    args = ap.parse_args()
    rounds = 3 if args.quick else 5
    total = 256_000_000 if args.quick else 1_000_000_000
    count = total // RECORD // 4096 * 4096  # whole turns of the record pool
    payload = count * RECORD

    runs: dict[str, list[float]] = {k: [] for k in ("raw", "flight", "s1", "s8", "m1")}
    cpu: dict[str, list[float]] = {
        k: []
        for k in ("s1", "s1_task", "s1_daemon", "s8", "s8_task", "s8_daemon", "m1", "m1_daemon")
    }
    # the same 1-channel partition also on a daemon with --blocking-shuffle-type mmap (not
    # the default: docs/deploy.md), to show what the setting buys in the same rounds
    with Daemon() as daemon, Daemon("--blocking-shuffle-type", "mmap") as mapped:
        t = time.monotonic()
        fills = {n: fill_partition(daemon, f"net{n}", n, RECORD, count) for n in (1, 8)}
        fill_s = time.monotonic() - t
        fill_partition(mapped, "net1", 1, RECORD, count)
        for _ in range(rounds):
            runs["raw"].append(raw_gbps(payload))
            runs["flight"].append(flight_gbps(payload, RECORD))
            for n in (1, 8):
                r = read_once(daemon, f"net{n}", n, count)
                runs[f"s{n}"].append(r["gbps"])
                cpu[f"s{n}"].append(r["cpu_us"])
                cpu[f"s{n}_task"].append(r["task_cpu_us"])
                cpu[f"s{n}_daemon"].append(r["daemon_cpu_us"])
            r = read_once(mapped, "net1", 1, count)
            runs["m1"].append(r["gbps"])
            cpu["m1"].append(r["cpu_us"])
            cpu["m1_daemon"].append(r["daemon_cpu_us"])
        whole = all([daemon.stop(), mapped.stop()])
    if not whole:
        raise BenchError("a daemon's network pool was not whole when it stopped")

    m = {k: median(v) for k, v in runs.items()}
    results: dict[str, Any] = {
        "bench": "network",
        "quick": args.quick,
        "rounds": rounds,
        "payload_bytes_per_run": payload,
        "record_bytes": RECORD,
        "raw_gbps": m["raw"],
        "flight_gbps": m["flight"],
        "stack_1ch_gbps": m["s1"],
        "stack_8ch_gbps": m["s8"],
        "stack_1ch_over_flight": m["s1"] / m["flight"],
        "stack_8ch_over_flight": m["s8"] / m["flight"],
        "stack_1ch_over_raw": m["s1"] / m["raw"],
        "stack_8ch_over_raw": m["s8"] / m["raw"],
        "consumer_cpu_us_per_32k_1ch": median(cpu["s1"]),
        "consumer_task_thread_cpu_us_per_32k_1ch": median(cpu["s1_task"]),
        "consumer_cpu_us_per_32k_8ch": median(cpu["s8"]),
        "consumer_task_thread_cpu_us_per_32k_8ch": median(cpu["s8_task"]),
        "daemon_cpu_us_per_32k_1ch": median(cpu["s1_daemon"]),
        "daemon_cpu_us_per_32k_8ch": median(cpu["s8_daemon"]),
        "stack_1ch_mmap_gbps": m["m1"],
        "stack_1ch_mmap_over_flight": m["m1"] / m["flight"],
        "consumer_cpu_us_per_32k_1ch_mmap": median(cpu["m1"]),
        "daemon_cpu_us_per_32k_1ch_mmap": median(cpu["m1_daemon"]),
        "fill_seconds_both_partitions": fill_s,
        "stream_bytes_per_partition": fills[1]["bytes_written"],
        "target_over_flight": TARGET_FLIGHT,
        "target_over_raw": TARGET_RAW,
        "target_met": min(m["s1"], m["s8"]) / m["flight"] >= TARGET_FLIGHT
        and min(m["s1"], m["s8"]) / m["raw"] >= TARGET_RAW,
    }

    print(f"data port alone, loopback, {payload / 1e6:.0f} MB per run, median of {rounds} rounds")
    rows = [
        ("raw uvloop Protocol, 32 KiB chunks", m["raw"], runs["raw"]),
        ("Arrow Flight DoGet, 4 KiB binary values", m["flight"], runs["flight"]),
        ("stack, 4 KiB records, 1 channel", m["s1"], runs["s1"]),
        ("stack, 4 KiB records, 8 channels", m["s8"], runs["s8"]),
        ("stack, 1 channel, mmap storage", m["m1"], runs["m1"]),
    ]
    for name, value, all_runs in rows:
        print(f"  {name:<42}{value:>7.2f} GB/s   runs {[round(v, 2) for v in all_runs]}")
    print(
        f"  stack/flight {results['stack_1ch_over_flight']:.2f} (1 ch) "
        f"{results['stack_8ch_over_flight']:.2f} (8 ch), target >= {TARGET_FLIGHT}; "
        f"stack/raw {results['stack_1ch_over_raw']:.2f} / {results['stack_8ch_over_raw']:.2f}, "
        f"target >= {TARGET_RAW}"
    )
    print(
        f"  consumer CPU per 32 KiB: {results['consumer_cpu_us_per_32k_1ch']:.1f} us (1 ch; "
        f"task thread {results['consumer_task_thread_cpu_us_per_32k_1ch']:.1f}), "
        f"{results['consumer_cpu_us_per_32k_8ch']:.1f} us (8 ch); daemon "
        f"{results['daemon_cpu_us_per_32k_1ch']:.1f} / "
        f"{results['daemon_cpu_us_per_32k_8ch']:.1f} us; with mmap storage (1 ch) consumer "
        f"{results['consumer_cpu_us_per_32k_1ch_mmap']:.1f}, daemon "
        f"{results['daemon_cpu_us_per_32k_1ch_mmap']:.1f} us"
    )
    print(json_line(results))


if __name__ == "__main__":
    main()
