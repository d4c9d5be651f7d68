"""Two hosts on one machine (network namespaces joined by a veth pair, a daemon in each):
exchanges across the link in both directions at once, on a clean link, with 20 ms of delay
(``tc netem``) and with 1 % packet loss (``tc netem``, or nftables where the kernel has no
netem). Each consumer task runs in the other namespace and stalls first: meanwhile its
producer must be held back by credit, the daemon's network memory in use staying within
the partition's pool however much is written. Then every record arrives, once, in order,
and the throughput is reported.
"""

from __future__ import annotations

import contextlib
import json
import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from client.producer import PartitionWriter
from exchange.partition.result_partition_id import ResultPartitionID

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
RECORDS = 20_000
PAYLOAD = 1000  # bytes per record: 20 MB per direction, ~620 segments of 32 KiB
#: A one-subpartition pipelined partition's pool holds at most max(2 n + 8, 16) segments,
#: plus the overdraft (5 by default) a producer may take to end a record that spans
#: buffers: what a producer held back by credit can have in its daemon, however much it
#: writes.
POOL_BOUND = 16 + 5

Host = Any  # conftest.Host
Daemon = Any  # tests/daemon/_daemon.py: DaemonProcess


class Producer(threading.Thread):
    """Writes ``(seq, payload)`` records into a pipelined partition through the daemon's
    Unix socket (a path: reachable from any namespace); counts what it generated."""

    def __init__(self, d: Daemon, pid: ResultPartitionID) -> None:
        super().__init__(name=f"producer-{pid.dataset_id}", daemon=True)
        self.d, self.pid = d, pid
        self.generated = 0
        self.error: BaseException | None = None

    def records(self) -> Iterator[tuple[int, bytes]]:
        for seq in range(RECORDS):
            self.generated = seq + 1
            yield (seq, bytes([seq % 251]) * PAYLOAD)

    def run(self) -> None:
        try:
            with PartitionWriter(self.pid, 1, daemon_socket=self.d.local_socket) as w:
                w.emit_all(self.records(), partition_func=lambda k: 0)
        except BaseException as e:
            self.error = e


class Consumer:
    """``_consumer.py`` started on ``host``'s thread, so the process is in its namespace."""

    def __init__(self, host: Host, d: Daemon, pid: ResultPartitionID) -> None:
        spec = {
            "locations": [[pid.dataset_id, pid.partition_index, 0, d.data_address, d.daemon_id]],
            "expect": RECORDS,
        }
        self.proc: subprocess.Popen[str] = host.run(
            lambda: subprocess.Popen(
                [sys.executable, str(HERE / "_consumer.py"), json.dumps(spec)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                cwd=ROOT,
            )
        )

    def attached(self) -> None:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert json.loads(line or "{}").get("event") == "attached", self.finish_error()

    def go(self) -> None:
        """End the stall: the consumer starts reading."""
        assert self.proc.stdin is not None
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()

    def result(self, timeout: float = 180.0) -> dict[str, Any]:
        try:
            out, err = self.proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            out, err = self.proc.communicate()
            raise AssertionError(f"consumer did not finish in {timeout}s: {err[-2000:]}") from None
        assert self.proc.returncode == 0, err[-3000:]
        result: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
        return result

    def stop(self) -> None:
        """Kill the consumer process (a failed test) and reap it."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.communicate()

    def finish_error(self) -> str:
        self.proc.kill()
        _, err = self.proc.communicate()
        return err[-3000:]


def _held_back(producer: Producer, timeout: float = 30.0) -> None:
    """Wait until the producer stops making progress (no credit); fail if it never does."""
    last, since = -1, time.monotonic()
    deadline = time.monotonic() + timeout
    while time.monotonic() - since < 0.5:
        assert producer.error is None, producer.error
        assert time.monotonic() < deadline, f"producer never held back ({producer.generated})"
        if producer.generated != last:
            last, since = producer.generated, time.monotonic()
        time.sleep(0.05)


def exchange_both_ways(
    a: Host, b: Host, start_daemon: Callable[..., Daemon], label: str
) -> dict[str, Any]:
    """A -> B and B -> A at once; returns both consumers' figures."""
    da = a.run(start_daemon, "--host", a.address)
    db = b.run(start_daemon, "--host", b.address)
    assert da.data_address.startswith(a.address + ":"), da.info
    flows = []
    for (src_host, src), dst_host in (((a, da), b), ((b, db), a)):
        pid = ResultPartitionID(f"{label}-{src_host.netns}", 0, 0)
        producer = Producer(src, pid)
        producer.start()
        consumer = Consumer(dst_host, src, pid)
        flows.append((src_host, src, producer, consumer))
    try:
        for _, _, _, consumer in flows:
            consumer.attached()
        # Both consumers stall: the producers run out of credit, their daemons' memory in use
        # stays within one partition pool though each producer has far more to write.
        for src_host, src, producer, _ in flows:
            _held_back(producer)
            used = src_host.run(src.stats)["network"]["used_segments"]
            assert used <= POOL_BOUND, (label, used)
            assert producer.generated * PAYLOAD < RECORDS * PAYLOAD // 2, producer.generated
        for _, _, _, consumer in flows:
            consumer.go()
        results = {}
        for src_host, src, producer, consumer in flows:
            results[src_host.netns] = consumer.result()
            producer.join(60)
            assert not producer.is_alive() and producer.error is None, producer.error
            assert results[src_host.netns]["records"] == RECORDS
            src_host.run(src.wait_pool_whole, 30.0)
    except BaseException:
        for _, _, _, consumer in flows:  # none left waiting on its stdin for ever
            consumer.stop()
        raise
    for src_host, _, _, _ in flows:
        r = results[src_host.netns]
        mb_s, secs = r["mb_per_s"], r["seconds"]
        print(f"{label}: {src_host.netns} -> other: {mb_s:.2f} MB/s over {secs:.2f} s")
    return results


def test_exchanges_across_a_clean_link(
    two_hosts: tuple[Host, Host], start_daemon: Callable[..., Daemon], record_property: Any
) -> None:
    a, b = two_hosts
    results = exchange_both_ways(a, b, start_daemon, "clean")
    for netns, r in results.items():
        record_property(f"clean_mb_per_s_{netns}", round(r["mb_per_s"], 2))


def _netem(host: Host, *args: str) -> subprocess.CompletedProcess[str]:
    return host.sh("tc", "qdisc", "add", "dev", host.device, "root", "netem", *args)


def test_exchanges_with_20ms_delay(
    two_hosts: tuple[Host, Host], start_daemon: Callable[..., Daemon], record_property: Any
) -> None:
    a, b = two_hosts
    for host in (a, b):
        out = _netem(host, "delay", "20ms")
        if out.returncode != 0:
            pytest.skip(
                "tc netem is not available (the kernel lacks sch_netem: "
                f"{out.stderr.strip()!r}); nftables can drop packets but not delay them"
            )
    # the delay is real: a TCP connect across the link takes a round trip, 2 x 20 ms
    rtt = a.run(_connect_seconds, b.address)
    assert rtt >= 0.035, rtt
    results = exchange_both_ways(a, b, start_daemon, "delay20ms")
    for netns, r in results.items():
        record_property(f"delay_mb_per_s_{netns}", round(r["mb_per_s"], 2))


def _connect_seconds(address: str) -> float:
    """Seconds a refused TCP connect to ``address`` takes (SYN -> RST: one round trip)."""
    import socket

    t = time.monotonic()
    with contextlib.suppress(OSError):
        socket.create_connection((address, 9), timeout=5).close()
    return time.monotonic() - t


def _nft_loss(host: Host, percent: int) -> subprocess.CompletedProcess[str]:
    rules = (
        "table inet xloss {\n"
        "  chain input {\n"
        "    type filter hook input priority 0; policy accept;\n"
        f"    meta l4proto tcp numgen random mod 100 < {percent} counter drop\n"
        "  }\n"
        "}\n"
    )
    return subprocess.run(
        ["ip", "netns", "exec", host.netns, "nft", "-f", "-"],
        input=rules,
        capture_output=True,
        text=True,
        timeout=30,
    )


def _nft_dropped(host: Host) -> int:
    out = host.sh("nft", "list", "chain", "inet", "xloss", "input")
    assert out.returncode == 0, out.stderr
    return sum(int(n) for n in re.findall(r"counter packets (\d+)", out.stdout))


def test_exchanges_with_1_percent_loss(
    two_hosts: tuple[Host, Host], start_daemon: Callable[..., Daemon], record_property: Any
) -> None:
    a, b = two_hosts
    how = "netem"
    for host in (a, b):
        if _netem(host, "loss", "1%").returncode != 0:
            how = "nftables"
            out = _nft_loss(host, 1)
            if out.returncode != 0:
                pytest.skip(
                    "neither tc netem nor nftables can drop packets here: "
                    f"{out.stderr.strip()!r} (.ci/run installs nftables when it runs as root)"
                )
    results = exchange_both_ways(a, b, start_daemon, "loss1pct")
    if how == "nftables":  # packets were really dropped, and TCP recovered
        dropped = _nft_dropped(a) + _nft_dropped(b)
        assert dropped > 0, dropped
        print(f"loss1pct: nftables dropped {dropped} packets")
        record_property("loss_packets_dropped", dropped)
    record_property("loss_by", how)
    for netns, r in results.items():
        record_property(f"loss_mb_per_s_{netns}", round(r["mb_per_s"], 2))
