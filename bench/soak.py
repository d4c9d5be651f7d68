"""Soak: 100 channels over 4 daemons for a given time, consumers slowing down and speeding up.

Run ``python bench/soak.py`` (default 10 minutes; ``--seconds 30`` for a short run). Four
daemons (``python -m server``, 64 MiB of network memory each) each serve one producer task
process (``client.producer.PartitionWriter``) that writes a pipelined partition of
``SUBPARTITIONS`` (25) subpartitions per round. Four consumer task processes
(``client.consumer.PartitionReader``) each read a quarter of every partition: consumer ``c``
reads subpartitions ``s`` with ``s % 4 == c`` of all four producers, so 100 input channels
in all, those of its own daemon over the Unix socket and the rest over TCP. Every
consumer changes pace at random every 0.2-2 s: fast (no pause), slow (a pause every few
records) or stalled (nothing read for a while), so producers run into backpressure and
out of it again.

Each round writes ``--records`` records per channel, ``(producer, subpartition, seq,
pad)`` with a pad whose length and byte follow from ``seq``. Consumers check every channel
gets ``seq`` 0, 1, ... exactly once, in order, with the right pad, and the round's totals are
compared with what the producers wrote. Between rounds every daemon must come back to
zero partitions and a whole network pool; its RSS (``/proc/<pid>/smaps``: outside the
network pool's arena, and the arena's own, which fills as segments are first used and
is bounded by the network memory), open file descriptors
(``/proc/<pid>/fd``) and asyncio tasks (``exchange_asyncio_tasks`` on ``/metrics``) are
sampled then, and a sampler prints the same figures every ``--interval`` seconds while
rounds run, with the daemons' throughput (``exchange_bytes_out_total``).

Exit status 1 when a record is lost, duplicated, reordered or corrupted, a round hangs, a
pool is not whole, or a daemon's RSS (outside the arena), fds or asyncio tasks grow without
bound: the median of the last third of the between-rounds samples exceeds that of the first
third (after the first round) by more than the allowance (``GROWTH_ALLOWANCE``). The last
line is one JSON object.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import re
import sys
import threading
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import READY_TIMEOUT, BenchError, Child, Daemon, json_line, median

DAEMONS = 4
SUBPARTITIONS = 25  # per producer: 4 x 25 = 100 channels
MB = 1_000_000
ROUND_TIMEOUT = 300.0
SETTLE_TIMEOUT = 30.0
#: name -> (absolute, relative) growth allowed between the first and last third.
GROWTH_ALLOWANCE: dict[str, tuple[float, float]] = {
    "rss": (16 * 2**20, 0.2),  # outside the pool's arena
    "fds": (8, 0.0),
    "tasks": (8, 0.0),
}


def pad_for(seq: int) -> bytes:
    """The pad of record ``seq``: 16..527 bytes of one byte value, both from ``seq``."""
    return bytes([seq % 251]) * (16 + (seq * 37) % 512)


# -- the tasks --------------------------------------------------------------------------------


def producer_task(conn: Connection, index: int, socket_path: str) -> None:
    """Per round: write ``count`` records to each of the partition's subpartitions."""
    from client.producer import PartitionWriter
    from exchange.partition.result_partition_id import ResultPartitionID

    conn.send("ready")
    while (msg := conn.recv()) is not None:
        _, rnd, count = msg
        pid = ResultPartitionID(f"soak-{rnd}", index, 0)
        payload = 0
        with PartitionWriter(pid, SUBPARTITIONS, daemon_socket=socket_path) as w:
            for seq in range(count):
                pad = pad_for(seq)
                payload += SUBPARTITIONS * len(pad)
                for sub in range(SUBPARTITIONS):
                    w.emit_to((index, sub, seq, pad), sub)
        conn.send({"records": count * SUBPARTITIONS, "payload": payload})


@dataclass
class Pace:
    """A consumer's pace: changes at random every 0.2-2 s between fast, slow and stalled."""

    rng: random.Random
    mode: str = "fast"
    until: float = 0.0
    changes: int = 0

    def step(self, now: float) -> float:
        """Seconds to pause after the current chunk."""
        if now >= self.until:
            self.mode = self.rng.choices(["fast", "slow", "stalled"], [5, 3, 1])[0]
            self.until = now + self.rng.uniform(0.2, 2.0)
            self.changes += 1
            if self.mode == "stalled":
                return self.until - now
        return 0.004 if self.mode == "slow" else 0.0


class ChannelChecker:
    """Each channel ``(producer, subpartition)`` gets seq 0, 1, ... once each, in order."""

    def __init__(self, channels: Sequence[tuple[int, int]]) -> None:
        self.next_seq = dict.fromkeys(channels, 0)
        self.records = 0
        self.payload = 0

    def add(self, record: Any) -> None:
        producer, sub, seq, pad = record
        key = (producer, sub)
        want = self.next_seq.get(key)
        if want is None:
            raise BenchError(f"record of channel {key}, which this consumer does not read")
        if seq != want:
            what = "duplicated or reordered" if seq < want else "lost"
            raise BenchError(f"channel {key}: seq {seq} where {want} was due ({what})")
        if pad != pad_for(seq):
            raise BenchError(f"channel {key}: record {seq} is corrupted")
        self.next_seq[key] = seq + 1
        self.records += 1
        self.payload += len(pad)

    def verify(self, count: int) -> None:
        short = {k: n for k, n in self.next_seq.items() if n != count}
        if short:
            raise BenchError(
                f"channels ended early (records lost): {dict(list(short.items())[:5])}"
            )


def consumer_task(
    conn: Connection, index: int, daemons: list[tuple[str, str, str]], seed: int
) -> None:
    """Per round: read every channel ``(p, s)`` with ``s % DAEMONS == index``; check them."""
    from client.consumer import PartitionLocation, PartitionReader
    from exchange.partition.result_partition_id import ResultPartitionID

    pace = Pace(random.Random(seed))
    own_daemon = daemons[index][1]
    channels = [
        (p, s) for p in range(DAEMONS) for s in range(SUBPARTITIONS) if s % DAEMONS == index
    ]
    conn.send("ready")
    while (msg := conn.recv()) is not None:
        _, rnd, count = msg
        locations = [
            PartitionLocation(ResultPartitionID(f"soak-{rnd}", p, 0), s, *daemons[p])
            for p, s in channels
        ]
        checker = ChannelChecker(channels)
        stalled, changes = 0.0, pace.changes
        with PartitionReader(locations, local_daemon_id=own_daemon) as reader:
            it = reader.records()
            while chunk := list(itertools.islice(it, 64)):
                for record in chunk:
                    checker.add(record)
                pause = pace.step(time.monotonic())
                if pause:
                    stalled += pause
                    time.sleep(pause)
        checker.verify(count)
        conn.send(
            {
                "records": checker.records,
                "payload": checker.payload,
                "paused": stalled,
                "pace_changes": pace.changes - changes,
            }
        )


# -- watching the daemons ---------------------------------------------------------------------


def rss_split(pid: int, arena_bytes: int) -> tuple[int, int]:
    """(RSS outside the network pool's arena, RSS of the arena) from ``/proc/<pid>/smaps``.

    The arena (one shared anonymous mmap of exactly the network memory) fills up as its
    segments are first handed out (the pool hands them out in turn), which is growth
    bounded by design; what is left must stay flat."""
    total = arena = 0
    in_arena, header = False, ""
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            if _MAPPING.match(line):
                in_arena = False
                header = line
            elif line.startswith("Size:"):
                in_arena = int(line.split()[1]) * 1024 == arena_bytes and "/dev/zero" in header
            elif line.startswith("Rss:"):
                kb = int(line.split()[1]) * 1024
                total += kb
                if in_arena:
                    arena += kb
    return total - arena, arena


_MAPPING = re.compile(r"^[0-9a-f]+-[0-9a-f]+ ")


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def asyncio_tasks(d: Daemon) -> int:
    with urllib.request.urlopen(f"http://{d.info['http']}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    m = re.search(r"^exchange_asyncio_tasks (\S+)$", text, re.M)
    if m is None:
        raise BenchError("the daemon exports no exchange_asyncio_tasks")
    return int(float(m.group(1)))


def sample(d: Daemon) -> dict[str, Any]:
    st = d.stats()
    net = st["network"]
    rss, arena = rss_split(d.pid, d.network_memory)
    if arena > d.network_memory:
        raise BenchError(f"the pool's arena holds {arena} bytes of {d.network_memory}")
    return {
        "rss": rss,
        "arena_rss": arena,
        "fds": open_fds(d.pid),
        "tasks": asyncio_tasks(d),
        "used_segments": net["used_segments"],
        "available_segments": net["available_segments"],
        "total_segments": net["total_segments"],
        "partitions": st["partitions"]["count"],
        "bytes_out": st["totals"].get("bytes_out", 0),
    }


def settle(daemons: list[Daemon], timeout: float = SETTLE_TIMEOUT) -> list[dict[str, Any]]:
    """Wait until every daemon holds no partition and has its pool whole; their samples."""
    deadline = time.monotonic() + timeout
    while True:
        samples = [sample(d) for d in daemons]
        if all(
            s["partitions"] == 0 and s["available_segments"] == s["total_segments"] for s in samples
        ):
            return samples
        if time.monotonic() > deadline:
            raise BenchError(f"daemons did not settle in {timeout}s (pool not whole): {samples}")
        time.sleep(0.05)


def growth_failures(series: dict[str, list[list[float]]]) -> list[str]:
    """What grew without bound: ``series[name][daemon]`` are between-rounds samples; the
    median of the last third against the first third, beyond ``GROWTH_ALLOWANCE``."""
    failures = []
    for name, per_daemon in series.items():
        absolute, relative = GROWTH_ALLOWANCE[name]
        for i, values in enumerate(per_daemon):
            third = len(values) // 3
            if third < 1:
                continue
            first, last = median(values[:third]), median(values[-third:])
            allowed = first + max(absolute, relative * first)
            if last > allowed:
                failures.append(
                    f"daemon {i} {name}: {first:.0f} -> {last:.0f} (allowed up to {allowed:.0f})"
                )
    return failures


@dataclass
class Timeline:
    """The sampler thread's lines while rounds run."""

    daemons: list[Daemon]
    interval: float
    t0: float
    stop: threading.Event = field(default_factory=threading.Event)
    lines: list[dict[str, Any]] = field(default_factory=list)
    error: BaseException | None = None

    def run(self) -> None:
        last_bytes, last_t = None, None
        try:
            while not self.stop.wait(self.interval):
                now = time.monotonic()
                samples = [sample(d) for d in self.daemons]
                total = sum(s["bytes_out"] for s in samples)
                rate = (
                    (total - last_bytes) / (now - last_t) / MB
                    if last_bytes is not None and last_t is not None
                    else 0.0
                )
                last_bytes, last_t = total, now
                line = {
                    "t": round(now - self.t0, 1),
                    "mb_per_s": round(rate, 2),
                    "daemons": samples,
                }
                self.lines.append(line)
                print(format_line(line), flush=True)
        except BaseException as e:  # reported by the main thread
            self.error = e


def format_line(line: dict[str, Any]) -> str:
    cells = [
        f"d{i}: rss {s['rss'] / 2**20:.0f}M+{s['arena_rss'] / 2**20:.0f}M "
        f"fds {s['fds']} tasks {s['tasks']} "
        f"pool {s['used_segments']}/{s['total_segments']} parts {s['partitions']}"
        for i, s in enumerate(line["daemons"])
    ]
    return f"[{line['t']:7.1f}s] {line['mb_per_s']:7.2f} MB/s | " + " | ".join(cells)


# -- the run ----------------------------------------------------------------------------------


def run(seconds: float, records: int, interval: float, seed: int) -> dict[str, Any]:
    daemons: list[Daemon] = []
    producers: list[Child] = []
    consumers: list[Child] = []
    try:
        for _ in range(DAEMONS):
            daemons.append(Daemon("--network-memory", "64mb"))
        where = [(d.data_address, d.daemon_id, d.socket_path) for d in daemons]
        for i, d in enumerate(daemons):
            producers.append(Child(producer_task, i, d.socket_path))
            consumers.append(Child(consumer_task, i, where, seed + i))
        for c in producers + consumers:
            if c.recv(READY_TIMEOUT) != "ready":
                raise BenchError(f"{c.name} did not start")
        print(
            f"soak: {DAEMONS} daemons, {DAEMONS * SUBPARTITIONS} channels, {records} records "
            f"per channel and round, {seconds:.0f} s",
            flush=True,
        )
        t0 = time.monotonic()
        timeline = Timeline(daemons, interval, t0)
        sampler = threading.Thread(target=timeline.run, name="sampler", daemon=True)
        sampler.start()
        between: dict[str, list[list[float]]] = {k: [[] for _ in daemons] for k in GROWTH_ALLOWANCE}
        rounds: list[dict[str, Any]] = []
        try:
            for rnd in itertools.count():
                if rnd > 0 and time.monotonic() - t0 >= seconds:
                    break
                rounds.append(one_round(rnd, records, producers, consumers))
                for i, s in enumerate(settle(daemons)):
                    if rnd > 0:  # the first round warms up (imports, first connections)
                        for name in GROWTH_ALLOWANCE:
                            between[name][i].append(float(s[name]))
                if timeline.error is not None:
                    raise BenchError(f"sampler failed: {timeline.error!r}")
        finally:
            timeline.stop.set()
            sampler.join(30)
        elapsed = time.monotonic() - t0
        for c in producers + consumers:
            c.send(None)
        final = [sample(d) for d in daemons]
        whole = [d.stop() for d in daemons]
        if not all(whole):
            raise BenchError(f"daemons stopped without their pool whole: {whole}")
        failures = growth_failures(between)
        moved = sum(r["records"] for r in rounds)
        payload = sum(r["payload"] for r in rounds)
        round_rates = [r["payload"] / r["seconds"] / MB for r in rounds]
        result = {
            "seconds": round(elapsed, 1),
            "rounds": len(rounds),
            "channels": DAEMONS * SUBPARTITIONS,
            "records": moved,
            "payload_mb": round(payload / MB, 1),
            "throughput_mb_per_s": payload / elapsed / MB,
            "round_mb_per_s_median": median(round_rates),
            "round_mb_per_s_min": min(round_rates),
            # the same, first and last third of the rounds: throughput that does not decay
            "round_mb_per_s_first_third": median(round_rates[: max(1, len(rounds) // 3)]),
            "round_mb_per_s_last_third": median(round_rates[-max(1, len(rounds) // 3) :]),
            "consumer_pace_changes": sum(r["pace_changes"] for r in rounds),
            "consumer_paused_s": round(sum(r["paused"] for r in rounds), 1),
            "rss_mb_first_last": [
                [round(v[0] / 2**20, 1), round(v[-1] / 2**20, 1)] if v else []
                for v in between["rss"]
            ],
            "arena_mb_final": [round(s["arena_rss"] / 2**20, 1) for s in final],
            "fds_first_last": [[v[0], v[-1]] if v else [] for v in between["fds"]],
            "tasks_first_last": [[v[0], v[-1]] if v else [] for v in between["tasks"]],
            "tasks_during_max": [
                max((ln["daemons"][i]["tasks"] for ln in timeline.lines), default=0)
                for i in range(DAEMONS)
            ],
            "final_partitions": [s["partitions"] for s in final],
            "pools_whole_at_stop": all(whole),
            "growth_failures": failures,
        }
        return result
    finally:
        for c in producers + consumers:
            c.close()
        for d in daemons:
            d.close()


def one_round(
    rnd: int, records: int, producers: list[Child], consumers: list[Child]
) -> dict[str, Any]:
    t = time.monotonic()
    for c in consumers + producers:
        c.send(("round", rnd, records))
    wrote = [p.recv(ROUND_TIMEOUT) for p in producers]
    read = [c.recv(ROUND_TIMEOUT) for c in consumers]
    seconds = time.monotonic() - t
    written, got = sum(w["records"] for w in wrote), sum(r["records"] for r in read)
    if written != got or written != records * DAEMONS * SUBPARTITIONS:
        raise BenchError(f"round {rnd}: {written} records written, {got} read")
    if sum(w["payload"] for w in wrote) != sum(r["payload"] for r in read):
        raise BenchError(f"round {rnd}: payload bytes written and read differ")
    return {
        "records": got,
        "payload": sum(r["payload"] for r in read),
        "seconds": seconds,
        "paused": sum(r["paused"] for r in read),
        "pace_changes": sum(r["pace_changes"] for r in read),
    }


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seconds", type=float, default=600.0, help="how long to run (default 600)")
    p.add_argument("--records", type=int, default=400, help="records per channel and round")
    p.add_argument("--interval", type=float, default=10.0, help="seconds between samples")
    p.add_argument("--seed", type=int, default=11)
    args = p.parse_args(argv)
    if args.seconds <= 0 or args.records <= 0 or args.interval <= 0:
        p.error("--seconds, --records and --interval must be positive")
    try:
        result = run(args.seconds, args.records, args.interval, args.seed)
    except BenchError as e:
        print(f"soak: FAILED: {e}", flush=True)
        print(json.dumps({"ok": False, "error": str(e)}), flush=True)
        return 1
    ok = not result["growth_failures"]
    for failure in result["growth_failures"]:
        print(f"soak: FAILED: grows without bound: {failure}", flush=True)
    print(
        f"soak: {'ok' if ok else 'FAILED'}: {result['records']} records in {result['rounds']} "
        f"rounds, none lost or duplicated; {result['throughput_mb_per_s']:.2f} MB/s",
        flush=True,
    )
    print(json_line({"ok": ok, **result}), flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
