"""Benchmark: buffer debloating, 8 channels through a daemon to a throttled consumer.

Run ``python bench/bench_debloat.py`` (``--seconds`` per configuration, default 12). Three
processes per configuration: a daemon (``python -m server``; debloating on with
``--debloat --debloat-target=200ms --debloat-period=100ms``, off without them), a producer
task process running ``CHANNELS`` ``client.producer.PartitionWriter``s (one thread and one
pipelined partition of one subpartition each, ~1 KiB ``bytes`` records, every one
distinct: channel and sequence number in its first 10 bytes; ``buffer_timeout`` 10 ms)
that broadcast an aligned checkpoint barrier every second, stamped with its scheduled
wall-clock time (``time.time()`` ms), and a consumer task process reading the 8 channels
over loopback TCP with one ``client.consumer.PartitionReader`` (settings from the daemon:
``ReaderOptions.from_daemon(fetch_daemon_info(...), checkpoint_listener=...)``), throttled to
``THROTTLE`` bytes of records per second, with a checkpoint listener recording trigger
time minus barrier timestamp.

Both task processes report their cumulative record bytes (produced, consumed) with a
``time.monotonic`` stamp (one clock for every process on Linux) every 100 ms, the
consumer also the gate's announced buffer size (``reader.debloat_stats.buffer_size``).

* In flight per gate: produced minus consumed bytes, both interpolated on a 100 ms grid
  over the steady state (after ``--warmup`` seconds, until the producers are stopped);
  the median.
* Barrier time: the median trigger latency of the checkpoints scheduled in the steady
  state (and triggered before the producers were stopped).
* Convergence (debloating on): the first time from which the announced size stays within
  25 % of its final value; and a short list of (seconds, size) samples.

Targets (issue 9): in flight and barrier time both at least 5x lower with debloating on,
and the barrier time within 1.5x of the debloat target. At the end the producers stop and
close their partitions, the consumer reads the rest unthrottled, and the run checks every
channel's sequence numbers (nothing lost, duplicated or reordered; the consumer read
exactly what was emitted) and that the daemon stopped with its network pool whole.

The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import bisect
import sys
import threading
import time
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import READY_TIMEOUT, BenchError, Child, Daemon, json_line, median

CHANNELS = 8
RECORD = 1024
HEADER = 10  # channel (2 bytes) + sequence number (8 bytes), big endian
THROTTLE = 10_000_000  # bytes of records per second
TARGET_MS = 200
PERIOD_MS = 100
DEBLOAT_FLAGS = ("--debloat", f"--debloat-target={TARGET_MS}ms", f"--debloat-period={PERIOD_MS}ms")
BUFFER_TIMEOUT = 0.01
SAMPLE = 0.1
BARRIER_INTERVAL = 1.0
#: The consumer checks its pace every this many records.
PACE_EVERY = 8
CONVERGED_WITHIN = 0.25
TARGET_RATIO = 5.0
TARGET_VS_DEBLOAT = 1.5
MB = 1_000_000
#: Seconds after the stop for the producers to close and the consumer to drain.
FINISH_TIMEOUT = 60.0


# -- the producer task process ----------------------------------------------------------------


def produce(conn: Connection, socket_path: str, dataset: str, channels: int) -> None:
    """CHANNELS writers, a thread each; cumulative bytes every SAMPLE until "stop"."""
    from client.producer import PartitionWriter
    from exchange.partition.result_partition_id import ResultPartitionID

    writers = [
        PartitionWriter(
            ResultPartitionID(dataset, i),
            1,
            daemon_socket=socket_path,
            buffer_timeout=BUFFER_TIMEOUT,
        )
        for i in range(channels)
    ]
    emitted = [0] * channels
    barriers = [0] * channels
    errors: list[str] = []
    stop = threading.Event()
    conn.send("ready")
    start_wall = float(conn.recv())

    def run(i: int) -> None:
        writer = writers[i]
        head = i.to_bytes(2, "big")
        pad = b"x" * (RECORD - HEADER)
        emit = writer.emit_to
        seq = 0
        checkpoint = 0
        next_barrier = start_wall + BARRIER_INTERVAL
        try:
            while not stop.is_set():
                for _ in range(16):
                    # a new bytes object per record: distinct payloads (pickle memoizes)
                    emit(head + seq.to_bytes(8, "big") + pad, 0)
                    seq += 1
                    emitted[i] = seq
                if time.time() >= next_barrier:
                    checkpoint += 1
                    writer.broadcast_barrier(checkpoint, int(next_barrier * 1000))
                    barriers[i] = checkpoint
                    next_barrier += BARRIER_INTERVAL
            writer.close()
        except BaseException as e:
            errors.append(f"channel {i}: {e!r}")
            writer.fail(e)

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(channels)]
    for t in threads:
        t.start()
    while not conn.poll(SAMPLE):
        conn.send(("sample", time.monotonic(), sum(emitted) * RECORD))
    conn.recv()  # "stop"
    stop.set()
    for t in threads:
        t.join()
    conn.send({"emitted": emitted, "barriers": barriers, "errors": errors})


# -- the consumer task process ----------------------------------------------------------------


class _Listener:
    """Trigger latencies: (checkpoint id, ms from the barrier's timestamp, monotonic time)."""

    def __init__(self) -> None:
        self.triggered: list[tuple[int, float, float]] = []
        self.aborted: list[tuple[int, str]] = []

    def trigger_checkpoint(self, checkpoint_id: int, timestamp: int, options: Any) -> None:
        self.triggered.append((checkpoint_id, time.time() * 1000 - timestamp, time.monotonic()))

    def abort_checkpoint(self, checkpoint_id: int, reason: Any) -> None:
        self.aborted.append((checkpoint_id, str(reason)))


def consume(
    conn: Connection, socket_path: str, data_address: str, dataset: str, channels: int
) -> None:
    """One reader on the CHANNELS partitions, throttled until "drain", then to the end."""
    from client.consumer import PartitionLocation, PartitionReader
    from client.local_connection import fetch_daemon_info
    from client.options import ReaderOptions
    from client.runtime import get_runtime
    from exchange.partition.result_partition_id import ResultPartitionID

    info = get_runtime().run(fetch_daemon_info(socket_path))
    locations = [
        PartitionLocation(ResultPartitionID(dataset, i), 0, data_address) for i in range(channels)
    ]
    listener = _Listener()
    options = ReaderOptions.from_daemon(info, checkpoint_listener=listener)
    reader = PartitionReader(locations, options)
    conn.send(("ready", options.debloat is not None))
    conn.recv()  # "go"
    drain = threading.Event()
    send_lock = threading.Lock()  # the reporter thread and this one share the pipe
    count = 0  # records read (the reporter reads it from its thread)

    def report() -> None:
        while not conn.poll(SAMPLE):
            stats = reader.debloat_stats
            size = stats.buffer_size if stats is not None else None
            with send_lock:
                conn.send(("sample", time.monotonic(), count * RECORD, size))
        conn.recv()  # "drain"
        drain.set()

    reporter = threading.Thread(target=report, daemon=True)
    t0 = time.monotonic()
    reporter.start()
    expect = [0] * channels
    try:
        for record in reader.records():
            if len(record) != RECORD:
                raise BenchError(f"a record of {len(record)} bytes, {RECORD} were written")
            ch = int.from_bytes(record[:2], "big")
            seq = int.from_bytes(record[2:HEADER], "big")
            if seq != expect[ch]:
                raise BenchError(f"channel {ch}: record {seq} where {expect[ch]} was due")
            expect[ch] = seq + 1
            count += 1
            if count % PACE_EVERY == 0 and not drain.is_set():
                ahead = count * RECORD / THROTTLE - (time.monotonic() - t0)
                if ahead > 0:
                    time.sleep(ahead)
    except BaseException as e:  # tell the driver now, not by its timeout
        with send_lock:
            conn.send({"error": repr(e)})
        raise
    reporter.join()
    conn.send({"read": expect, "triggered": listener.triggered, "aborted": listener.aborted})


# -- the driver -------------------------------------------------------------------------------


def _interp(series: list[tuple[float, float]], t: float) -> float:
    """``series`` (sorted by time) at ``t``, linear between samples, flat beyond."""
    times = [s[0] for s in series]
    i = bisect.bisect_left(times, t)
    if i == 0:
        return series[0][1]
    if i == len(series):
        return series[-1][1]
    (ta, va), (tb, vb) = series[i - 1], series[i]
    return va + (vb - va) * (t - ta) / (tb - ta) if tb > ta else vb


def _final(child: Child, samples: list[Any], timeout: float) -> dict[str, Any]:
    """Read ``child``'s remaining samples until its final report (a dict)."""
    deadline = time.monotonic() + timeout
    while True:
        msg = child.recv(max(0.1, deadline - time.monotonic()))
        if isinstance(msg, dict):
            if "error" in msg:
                raise BenchError(f"{child.name} failed: {msg['error']}")
            return msg
        samples.append(msg)


def _convergence(sizes: list[tuple[float, int]]) -> float | None:
    """The first time from which every size stays within CONVERGED_WITHIN of the last."""
    if not sizes:
        return None
    final = sizes[-1][1]
    since = sizes[-1][0]
    for t, size in reversed(sizes):
        if abs(size - final) > CONVERGED_WITHIN * final:
            break
        since = t
    return since


def _size_path(sizes: list[tuple[float, int]], seconds: float) -> list[tuple[float, int]]:
    """A short list of (seconds, announced size): the samples nearest a few times."""
    marks = [0.2, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, *range(6, int(seconds) + 1, 2)]
    path: list[tuple[float, int]] = []
    for m in marks:
        if not sizes or m > sizes[-1][0] + SAMPLE:
            break
        t, size = min(sizes, key=lambda s: abs(s[0] - m))
        if not path or path[-1][0] != round(t, 1):
            path.append((round(t, 1), size))
    return path


def run_config(debloat: bool, seconds: float, warmup: float) -> dict[str, Any]:
    """One configuration on its own daemon: the figures, after checking the data."""
    name = "on" if debloat else "off"
    dataset = f"debloat-{name}"
    daemon = Daemon(*(DEBLOAT_FLAGS if debloat else ()))
    producer: Child | None = None
    consumer: Child | None = None
    try:
        producer = Child(produce, daemon.socket_path, dataset, CHANNELS)
        if producer.recv(READY_TIMEOUT) != "ready":
            raise BenchError("the producer did not open its partitions")
        consumer = Child(consume, daemon.socket_path, daemon.data_address, dataset, CHANNELS)
        ready, reader_debloats = consumer.recv(READY_TIMEOUT)
        if ready != "ready" or reader_debloats != debloat:
            raise BenchError(f"the consumer's debloating is {reader_debloats}, wanted {debloat}")
        start, start_wall = time.monotonic(), time.time()
        producer.send(start_wall)
        consumer.send("go")
        produced: list[Any] = []
        consumed: list[Any] = []
        by_conn = {producer.conn: produced, consumer.conn: consumed}
        end = start + seconds
        while (left := end - time.monotonic()) > 0:
            for c in wait(list(by_conn), left):
                assert isinstance(c, Connection)
                try:
                    msg = c.recv()
                except EOFError:
                    raise BenchError("a task process died (see its traceback)") from None
                if isinstance(msg, dict):
                    raise BenchError(f"debloat {name}: a task process failed or ended: {msg}")
                by_conn[c].append(msg)
        stop = time.monotonic()
        producer.send("stop")
        consumer.send("drain")
        prod = _final(producer, produced, FINISH_TIMEOUT)
        cons = _final(consumer, consumed, FINISH_TIMEOUT)
        whole = daemon.stop()
    finally:
        for child in (consumer, producer):
            if child is not None:
                child.close()
        daemon.close()

    # -- checks
    if prod["errors"]:
        raise BenchError(f"debloat {name}: producer failed: {prod['errors']}")
    if cons["read"] != prod["emitted"]:
        raise BenchError(
            f"debloat {name}: read {cons['read']} records per channel, "
            f"{prod['emitted']} were emitted"
        )
    if not whole:
        raise BenchError(f"debloat {name}: the daemon's network pool was not whole at stop")

    # -- in flight: produced minus consumed on a grid over the steady state
    prod_series = [(t - start, float(b)) for _, t, b in produced]
    cons_series = [(t - start, float(b)) for _, t, b, _ in consumed]
    grid = [warmup + k * SAMPLE for k in range(int((stop - start - warmup) / SAMPLE) + 1)]
    if not grid:
        raise BenchError(f"--seconds {seconds} leaves no steady state after --warmup {warmup}")
    inflight = [_interp(prod_series, t) - _interp(cons_series, t) for t in grid]
    t_a, t_b = grid[0], grid[-1]
    rate = (_interp(cons_series, t_b) - _interp(cons_series, t_a)) / max(t_b - t_a, SAMPLE)

    # -- barriers scheduled in the steady state, triggered before the stop
    steady = [
        (cid, ms)
        for cid, ms, at in cons["triggered"]
        if cid * BARRIER_INTERVAL >= warmup and at < stop
    ]
    if not steady:
        raise BenchError(f"debloat {name}: no checkpoint triggered in the steady state")

    sizes = [(t - start, s) for _, t, _, s in consumed if s is not None]
    return {
        "inflight_mb": median(inflight) / MB,
        "inflight_mb_max": max(inflight) / MB,
        "barrier_ms": median(ms for _, ms in steady),
        "barrier_ms_all": [round(ms) for _, ms in steady],
        "checkpoints": len(cons["triggered"]),
        "aborted": len(cons["aborted"]),
        "throughput_mb_s": rate / MB,
        "records": sum(prod["emitted"]),
        "convergence_s": _convergence(sizes) if debloat else None,
        "final_size": sizes[-1][1] if sizes else None,
        "size_path": _size_path(sizes, seconds),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=12.0, help="per configuration")
    ap.add_argument("--warmup", type=float, default=4.0, help="seconds skipped (convergence)")
    args = ap.parse_args()
    if not 0 < args.warmup < args.seconds - 1:
        raise SystemExit("--warmup must be positive and leave at least 1 s of --seconds")

    off = run_config(False, args.seconds, args.warmup)
    on = run_config(True, args.seconds, args.warmup)
    inflight_ratio = off["inflight_mb"] / on["inflight_mb"]
    barrier_ratio = off["barrier_ms"] / on["barrier_ms"]
    vs_target = on["barrier_ms"] / TARGET_MS
    conv = on["convergence_s"]

    print(
        f"buffer debloating: {CHANNELS} channels, consumer at {THROTTLE / MB:g} MB/s, "
        f"target {TARGET_MS} ms, {args.seconds:g} s each, steady state after {args.warmup:g} s"
    )
    for name, r in (("off", off), ("on", on)):
        print(
            f"  debloat {name:3}: in flight {r['inflight_mb']:6.2f} MB (max "
            f"{r['inflight_mb_max']:.2f}), barrier {r['barrier_ms']:7.0f} ms "
            f"{r['barrier_ms_all']}, consumer {r['throughput_mb_s']:.2f} MB/s, "
            f"{r['records']} records, {r['checkpoints']} checkpoints ({r['aborted']} aborted)"
        )
    print(
        f"  ratios off/on: in flight {inflight_ratio:.1f}x, barrier {barrier_ratio:.1f}x "
        f"(target >= {TARGET_RATIO:g}x); barrier on / debloat target {vs_target:.2f} "
        f"(target <= {TARGET_VS_DEBLOAT})"
    )
    print(
        f"  announced size converged after {conv if conv is None else round(conv, 1)} s "
        f"to {on['final_size']} B: {on['size_path']}"
    )
    if conv is None or conv > args.warmup:
        print(f"  WARNING: the size had not converged by the end of the warmup ({args.warmup} s)")

    results: dict[str, Any] = {
        "bench": "debloat",
        "seconds": args.seconds,
        "warmup_s": args.warmup,
        "channels": CHANNELS,
        "inflight_mb_off": off["inflight_mb"],
        "inflight_mb_on": on["inflight_mb"],
        "inflight_ratio": inflight_ratio,
        "barrier_ms_off": off["barrier_ms"],
        "barrier_ms_on": on["barrier_ms"],
        "barrier_ratio": barrier_ratio,
        "barrier_vs_target": vs_target,
        "convergence_s": conv,
        "final_buffer_size": on["final_size"],
        "size_path": on["size_path"],
        "throughput_mb_s_off": off["throughput_mb_s"],
        "throughput_mb_s_on": on["throughput_mb_s"],
        "target_ms": TARGET_MS,
        "throttle_mb_s": THROTTLE / MB,
        "target_met": inflight_ratio >= TARGET_RATIO
        and barrier_ratio >= TARGET_RATIO
        and vs_target <= TARGET_VS_DEBLOAT,
    }
    print(json_line(results))


if __name__ == "__main__":
    main()
