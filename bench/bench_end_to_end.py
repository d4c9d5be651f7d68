"""Benchmark: end to end as PySpark runs it, three processes on one host.

Run ``python bench/bench_end_to_end.py`` (``--quick`` for a short run). A producer task
process writes a pipelined partition through ``client.producer.PartitionWriter`` (records
encoded in the task thread, pushed to its daemon over the local Unix socket with credit);
the daemon (``python -m server``) serves it over loopback TCP to a consumer task process
reading with ``client.consumer.PartitionReader``, which decodes and checks every record
(``_common.Checker``). The consumer attaches before the producer starts; the clock runs
from the producer's first record to the consumer's last. Each round runs the same two
once more with the consumer as a task of the daemon's own host (``*_local_*`` keys): it
reads over the Unix socket, in place in the application's shared arena.

* 4 KiB ``bytes`` records: GB/s of payload, against Arrow Flight ``DoGet`` of a binary
  column of 4 KiB values measured in the same rounds (target >= 0.8x Flight).
* 100 B ``bytes`` records: M records/s (target >= 5 M rec/s).
* CPU per 32 KiB of stream of the producer process, the daemon and the consumer process
  (``time.process_time`` deltas, the daemon's from ``/proc``, over stream bytes / 32 KiB;
  target <= 12 us for each task), split by thread: the producer's task thread routes,
  encodes and cuts ("serialize"), its loop thread frames and sends ("frame+send", with
  the credit it receives); the daemon receives pushes into segments and serves them
  ("relay"); the consumer's loop thread receives buffers into segments ("receive"), its
  task thread decodes (and iterates and checks the records: "decode"). Beside them, the
  codec alone in this process: ``RecordWriter`` emit + cut, and the decoder's feed + take,
  of the same records (what the task threads would cost with no I/O at all).
* The raw ceiling of this shape, measured in the same rounds: a producer, a relay and a
  consumer process moving 32 KiB chunks over plain uvloop sockets (Unix socket, then
  loopback TCP; ``_common.relay_ceiling``): GB/s and the relay's CPU per 32 KiB. What the
  stack adds on top of it is framing, records, credit and the copies it still makes.

Beside the CPU, the voluntary context switches of every thread of the three processes per
32 KiB (``/proc/<pid>/task/*/status``): each is a thread that blocked, most of them a
wait for the other thread of the process (a futex hand-off) or the loop's epoll.

The CPU bound: the three processes share two cores, so the stream cannot beat 2 x 32 KiB
per (producer + daemon + consumer) CPU of a buffer; the measured rate over that bound is
the share of the cores the run got (other load, waits between the processes).

Figures are medians of the rounds (rounds interleave the configurations, against load
drift). The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import (
    GB,
    POOL,
    SEG,
    BenchError,
    Daemon,
    flight_gbps,
    json_line,
    median,
    proc_cpu,
    proc_switches,
    producer_to_consumer,
    records,
    relay_ceiling,
)

BIG = 4096
SMALL = 100
TARGET_FLIGHT = 0.8
TARGET_SMALL_RECPS = 5e6
TARGET_CPU_US = 12.0


def run_once(
    daemon: Daemon, dataset: str, size: int, count: int, *, same_host: bool = False
) -> dict[str, float]:
    """One producer task -> daemon -> consumer task run; figures of the three processes.
    The consumer reads over loopback TCP, or with ``same_host`` as a task of the daemon's
    own host (the Unix socket, and the daemon's shared arena where it has one)."""
    daemon_cpu, daemon_switches = proc_cpu(daemon.pid), proc_switches(daemon.pid)
    prod, cons, seconds = producer_to_consumer(daemon, dataset, size, count, same_host=same_host)
    daemon_cpu = proc_cpu(daemon.pid) - daemon_cpu
    daemon_switches = proc_switches(daemon.pid) - daemon_switches
    per_32k = prod["bytes_written"] / SEG
    return {
        "gbps": count * size / seconds / GB,
        "recps": count / seconds,
        "producer_us": prod["cpu"] / per_32k * 1e6,
        "producer_task_us": prod["task_cpu"] / per_32k * 1e6,
        "producer_loop_us": (prod["cpu"] - prod["task_cpu"]) / per_32k * 1e6,
        "consumer_us": cons["cpu"] / per_32k * 1e6,
        "consumer_task_us": cons["task_cpu"] / per_32k * 1e6,
        "consumer_loop_us": (cons["cpu"] - cons["task_cpu"]) / per_32k * 1e6,
        "daemon_us": daemon_cpu / per_32k * 1e6,
        "producer_switches": prod["switches"] / per_32k,
        "consumer_switches": cons["switches"] / per_32k,
        "daemon_switches": daemon_switches / per_32k,
    }


def codec_alone(size: int, total_bytes: int) -> dict[str, float]:
    """The codec in this process, no I/O: emit + cut, and feed + take, us per 32 KiB.

    Records go through in slices of about 256 KiB (what the sync producer ships at a
    time), each slice's buffers decoded and dropped before the next, so memory stays warm
    as in the tasks.
    """
    from exchange.writer import RecordWriter

    count = max(POOL, total_bytes // size // POOL * POOL)
    recs = list(records(size, count))
    step = max(1, 256 * 1024 // size)
    writer = RecordWriter(1, buffer_size=SEG, buffer_timeout=-1)
    decoder = writer.codec.new_decoder()
    encode = decode = 0.0
    got = stream_bytes = 0
    clock = time.process_time
    gc.disable()
    try:
        for i in range(0, count, step):
            t0 = clock()
            writer.emit_all(recs[i : i + step])
            outs = (
                writer.take_output() if i + step < count else writer.take_output() + writer.close()
            )
            encode += clock() - t0
            stream = [b"".join(out.pieces) for out in outs if not out.is_event]
            t0 = clock()
            for piece in stream:
                decoder.feed(piece)
                got += len(decoder.take())
            decode += clock() - t0
            stream_bytes += sum(map(len, stream))
    finally:
        gc.enable()
    if got != count:
        raise BenchError(f"the codec gave back {got} of {count} records")
    per_32k = stream_bytes / SEG
    return {"serialize_us": encode / per_32k * 1e6, "decode_us": decode / per_32k * 1e6}


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="smaller runs, 3 rounds")
    args = ap.parse_args()
    rounds = 3 if args.quick else 5
    big_count = (256_000_000 if args.quick else 1_000_000_000) // BIG // POOL * POOL
    small_count = (2_000_000 if args.quick else 8_000_000) // POOL * POOL

    big: list[dict[str, float]] = []
    small: list[dict[str, float]] = []
    big_local: list[dict[str, float]] = []
    small_local: list[dict[str, float]] = []
    flight: list[float] = []
    relay: list[dict[str, float]] = []
    daemon = Daemon()
    try:
        for r in range(rounds):
            flight.append(flight_gbps(big_count * BIG, BIG))
            relay.append(relay_ceiling(big_count * BIG))
            big.append(run_once(daemon, f"e2e-big-{r}", BIG, big_count))
            small.append(run_once(daemon, f"e2e-small-{r}", SMALL, small_count))
            big_local.append(run_once(daemon, f"e2e-big-local-{r}", BIG, big_count, same_host=True))
            small_local.append(
                run_once(daemon, f"e2e-small-local-{r}", SMALL, small_count, same_host=True)
            )
        whole = daemon.stop()
    finally:
        daemon.close()
    if not whole:
        raise BenchError("the daemon's network pool was not whole when it stopped")
    alone = {SMALL: codec_alone(SMALL, 32_000_000), BIG: codec_alone(BIG, 128_000_000)}

    def med(runs: list[dict[str, float]], key: str) -> float:
        return median(r[key] for r in runs)

    fl = median(flight)
    results: dict[str, Any] = {
        "bench": "end_to_end",
        "quick": args.quick,
        "rounds": rounds,
        "flight_gbps": fl,
        "big_records": big_count,
        "big_gbps": med(big, "gbps"),
        "big_over_flight": med(big, "gbps") / fl,
        "relay_ceiling_gbps": med(relay, "gbps"),
        "relay_ceiling_relay_us_per_32k": med(relay, "relay_us"),
        "big_over_relay_ceiling": med(big, "gbps") / med(relay, "gbps"),
        "small_records": small_count,
        "small_m_recps": med(small, "recps") / 1e6,
        "small_gbps": med(small, "gbps"),
        # the consumer a task of the daemon's own host (Unix socket / shared memory)
        "big_local_gbps": med(big_local, "gbps"),
        "big_local_over_flight": med(big_local, "gbps") / fl,
        "small_local_m_recps": med(small_local, "recps") / 1e6,
    }
    for name, runs in (
        ("big", big),
        ("small", small),
        ("big_local", big_local),
        ("small_local", small_local),
    ):
        for key in (
            "producer_us",
            "producer_task_us",
            "producer_loop_us",
            "consumer_us",
            "consumer_task_us",
            "consumer_loop_us",
            "daemon_us",
            "producer_switches",
            "consumer_switches",
            "daemon_switches",
        ):
            results[f"{name}_{key}_per_32k"] = med(runs, key)
    for size, name in ((BIG, "big"), (SMALL, "small")):
        results[f"{name}_codec_alone_serialize_us_per_32k"] = alone[size]["serialize_us"]
        results[f"{name}_codec_alone_decode_us_per_32k"] = alone[size]["decode_us"]
    # What the CPU per buffer allows: the three processes share two cores, so the stream
    # cannot go faster than 2 cores' worth of seconds per (producer + daemon + consumer)
    # CPU of a 32 KiB buffer; the measured rate over this bound is the share of the two
    # cores the run actually got (other load on the machine, waits between the processes).
    for name in ("big", "small"):
        per_buffer = sum(
            results[f"{name}_{who}_us_per_32k"] for who in ("producer", "daemon", "consumer")
        )
        results[f"{name}_cpu_us_per_32k_all_processes"] = per_buffer
        results[f"{name}_cpu_bound_gbps_2_cores"] = 2 * SEG / (per_buffer * 1e-6) / GB
    results["big_over_cpu_bound"] = results["big_gbps"] / results["big_cpu_bound_gbps_2_cores"]
    worst_cpu = max(results["big_producer_us_per_32k"], results["big_consumer_us_per_32k"])
    results["target_big_over_flight"] = TARGET_FLIGHT
    results["target_small_m_recps"] = TARGET_SMALL_RECPS / 1e6
    results["target_cpu_us_per_32k"] = TARGET_CPU_US
    results["target_met"] = (
        results["big_over_flight"] >= TARGET_FLIGHT
        and results["small_m_recps"] * 1e6 >= TARGET_SMALL_RECPS
        and worst_cpu <= TARGET_CPU_US
    )

    print(f"end to end (producer task -> daemon -> consumer task over TCP), median of {rounds}")
    print(
        f"  Arrow Flight DoGet, 4 KiB values       {fl:6.2f} GB/s   {[round(v, 2) for v in flight]}"
    )
    print(
        f"  raw relay ceiling (uvloop sockets)     {results['relay_ceiling_gbps']:6.2f} GB/s   "
        f"{[round(v['gbps'], 2) for v in relay]} (relay CPU "
        f"{results['relay_ceiling_relay_us_per_32k']:.1f} us per 32 KiB)"
    )
    print(
        f"  stack, 4 KiB records                   {results['big_gbps']:6.2f} GB/s   "
        f"{[round(r['gbps'], 2) for r in big]}  = {results['big_over_flight']:.2f}x Flight "
        f"(target >= {TARGET_FLIGHT})"
    )
    print(
        f"  stack, 100 B records                   {results['small_m_recps']:6.2f} M rec/s "
        f"{[round(r['recps'] / 1e6, 2) for r in small]} (target >= {TARGET_SMALL_RECPS / 1e6:g})"
    )
    print(
        f"  same host (consumer on the daemon's Unix socket / shared arena):\n"
        f"  stack, 4 KiB records                   {results['big_local_gbps']:6.2f} GB/s   "
        f"{[round(r['gbps'], 2) for r in big_local]}  = "
        f"{results['big_local_over_flight']:.2f}x Flight\n"
        f"  stack, 100 B records                   {results['small_local_m_recps']:6.2f} M rec/s "
        f"{[round(r['recps'] / 1e6, 2) for r in small_local]}\n"
        f"  CPU us per 32 KiB, 4 KiB records: producer "
        f"{results['big_local_producer_us_per_32k']:.1f}, daemon "
        f"{results['big_local_daemon_us_per_32k']:.1f}, consumer "
        f"{results['big_local_consumer_us_per_32k']:.1f} (receive "
        f"{results['big_local_consumer_loop_us_per_32k']:.1f}, decode "
        f"{results['big_local_consumer_task_us_per_32k']:.1f})"
    )
    print(
        f"  CPU bound on 2 cores (4 KiB records)   "
        f"{results['big_cpu_bound_gbps_2_cores']:6.2f} GB/s"
        f"   ({results['big_cpu_us_per_32k_all_processes']:.0f} us of CPU per 32 KiB in the three"
        f" processes; the run got {results['big_over_cpu_bound']:.0%} of it)"
    )
    print("  CPU us per 32 KiB of stream (target <= 12 per task process):")
    for name, size in (("big", BIG), ("small", SMALL)):
        r = {k[len(name) + 1 : -len("_per_32k")]: v for k, v in results.items()
             if k.startswith(f"{name}_") and k.endswith("_per_32k")}  # fmt: skip
        print(
            f"    {size:>4} B records: producer {r['producer_us']:5.1f} (serialize "
            f"{r['producer_task_us']:.1f}, frame+send {r['producer_loop_us']:.1f}); daemon "
            f"{r['daemon_us']:5.1f}; consumer {r['consumer_us']:5.1f} (receive "
            f"{r['consumer_loop_us']:.1f}, decode {r['consumer_task_us']:.1f}); codec alone: "
            f"serialize {alone[size]['serialize_us']:.1f}, decode {alone[size]['decode_us']:.1f}"
        )
        print(
            f"           voluntary context switches per 32 KiB: producer "
            f"{r['producer_switches']:.2f}, daemon {r['daemon_switches']:.2f}, consumer "
            f"{r['consumer_switches']:.2f}"
        )
    print(json_line(results))


if __name__ == "__main__":
    main()
