"""Availability before authentication, attacked against real daemons on loopback.

Silent sockets (no byte sent, with or without TLS) and idle HTTP connections are what an
attacker who reaches a port but holds no secret can do. Each test opens them from other
loopback addresses (127.0.0.2...: the peer address the daemon's per-peer caps count), then
checks that honest work from 127.0.0.1 goes on (a reader reads everything, ``/healthz``
answers), and that once the attackers are gone the daemon holds no connection, no
descriptor more than before, and its pool is whole.
"""

from __future__ import annotations

import contextlib
import os
import re
import resource
import socket
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from client.consumer import PartitionLocation, PartitionReader
from client.producer import PartitionWriter
from exchange.partition.result_partition_id import ResultPartitionID
from tests.kit.sockets import closed_by_peer

pytestmark = pytest.mark.timeout(180)

Daemon = Any
SECRET = b"the-daemons-secret-of-this-test"
FAST: dict[str, Any] = {"backoff_initial": 0.01, "backoff_max": 0.04}
RECORDS = [(i, b"r" * 64) for i in range(2000)]


def write(d: Daemon, pid: ResultPartitionID) -> None:
    with PartitionWriter(
        pid, 1, blocking=True, daemon_socket=d.local_socket, secret=SECRET, buffer_timeout=-1
    ) as w:
        w.emit_all(RECORDS, partition_func=lambda k: 0)


def read(d: Daemon, pid: ResultPartitionID) -> list[Any]:
    loc = PartitionLocation(pid, 0, d.data_address, d.daemon_id, None)  # TCP
    with PartitionReader([loc], secret=SECRET, **FAST) as reader:
        return list(reader)


def open_fds(d: Daemon) -> int:
    return len(os.listdir(f"/proc/{d.proc.pid}/fd"))


def wait_for(predicate: Callable[[], bool], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "not reached in time"
        time.sleep(0.05)


@contextlib.contextmanager
def silent_sockets(address: str, per_source: int, sources: int) -> Iterator[list[socket.socket]]:
    """``per_source`` connected sockets from each of 127.0.0.2 .. 127.0.0.<sources + 1>
    that never send a byte."""
    host, port = address.rsplit(":", 1)
    socks: list[socket.socket] = []
    try:
        for i in range(sources):
            for _ in range(per_source):
                s = socket.socket()
                s.bind((f"127.0.0.{2 + i}", 0))
                s.connect((host, int(port)))
                socks.append(s)
        yield socks
    finally:
        for s in socks:
            s.close()


def test_silent_sockets_do_not_lock_out_a_reader(start_daemon: Any, secret_file: str) -> None:
    # 1024 silent sockets made a reader fail with TOO_MANY_CONNECTIONS; here 160 sockets
    # from 8 addresses against max_connections 64 (16 may authenticate at once, 4 per peer)
    d = start_daemon(
        "--secret-file",
        secret_file,
        "--max-connections=64",
        "--max-unauthenticated-per-peer=4",
        "--handshake-timeout=60s",  # the attackers stay for the whole test
    )
    pid = ResultPartitionID("avail", 0, 0)
    write(d, pid)
    fds = open_fds(d)
    with silent_sockets(d.data_address, per_source=20, sources=8):
        # at most 4 per address are admitted; beyond 16 the oldest of the busiest address
        # is dropped for a newcomer from an address holding fewer; the others are refused
        # with TOO_MANY_CONNECTIONS
        st = d.wait_stats(
            lambda s: (
                s["data_port"]["unauthenticated_connections"] == 16
                and s["data_port"]["rejected_connections"] + s["data_port"]["evicted_connections"]
                == 160 - 16
            )
        )
        assert st["data_port"]["evicted_connections"] > 0
        assert st["data_port"]["connections"] <= 64
        assert read(d, pid) == RECORDS  # admitted, authenticated, served
        assert read(d, pid) == RECORDS
        metrics = d.http_get("/metrics").decode()
        waiting = re.search(r"\nexchange_connections_unauthenticated (\S+)\n", metrics)
        assert waiting is not None and 0 < float(waiting[1]) <= 16  # the reader took one
        evicted = re.search(r"\nexchange_connections_evicted_total (\S+)\n", metrics)
        assert evicted is not None and float(evicted[1]) >= st["data_port"]["evicted_connections"]
        st = d.stats()["data_port"]
        assert st["unauthenticated_connections"] <= 16 and st["connections"] <= 64
    d.wait_stats(lambda s: s["data_port"]["connections"] == 0, timeout=30)
    d.wait_pool_whole()
    wait_for(lambda: open_fds(d) <= fds)


def test_tls_sockets_that_never_start_tls_are_counted_and_dropped(
    start_daemon: Any, secret_file: str, pki: Any
) -> None:
    # they were not counted at all and lived 60 s (asyncio's default TLS handshake timeout)
    d = start_daemon(
        "--tls-cert-file",
        str(pki.server_cert),
        "--tls-key-file",
        str(pki.server_key),
        "--secret-file",
        secret_file,
        "--handshake-timeout=2s",
    )
    fds = open_fds(d)
    with silent_sockets(d.data_address, per_source=3, sources=2) as socks:
        st = d.wait_stats(lambda s: s["data_port"]["connections"] == 6)
        assert st["data_port"]["unauthenticated_connections"] == 6
        t0 = time.monotonic()
        for s in socks:
            assert closed_by_peer(s, timeout=30)
        assert time.monotonic() - t0 < 30  # dropped after the handshake timeout, not 60 s
    d.wait_stats(lambda s: s["data_port"]["connections"] == 0)
    wait_for(lambda: open_fds(d) <= fds)


def healthz(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=10) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as e:
        return int(e.code)


def test_idle_http_connections_do_not_fail_the_liveness_probe(start_daemon: Any) -> None:
    # 80 idle connections held /healthz at 0 of 20 probes (64 slots, 5 s each)
    d = start_daemon()
    base = f"http://{d.info['http']}"
    host, port = d.info["http"].rsplit(":", 1)
    idle: list[socket.socket] = []
    try:
        for i in range(12):  # 12 addresses x 8 = 96 connections held
            for _ in range(8):
                s = socket.socket()
                s.bind((f"127.0.0.{2 + i}", 0))
                s.connect((host, int(port)))
                idle.append(s)
        # a ninth from one address is closed unanswered: one address holds 8 at most
        extra = socket.socket()
        extra.bind(("127.0.0.2", 0))
        extra.connect((host, int(port)))
        idle.append(extra)
        assert closed_by_peer(extra, timeout=10)
        codes = [healthz(base + "/healthz") for _ in range(20)]
        assert codes == [200] * 20
        # what is not /healthz is refused while every slot is taken
        assert healthz(base + "/api/stats") == 503
    finally:
        for s in idle:
            s.close()
    wait_for(lambda: healthz(base + "/api/stats") == 200)


def test_http_port_binds_loopback_unless_told(start_daemon: Any) -> None:
    d = start_daemon("--host", "127.0.0.1")
    assert d.info["http"].startswith("127.0.0.1:")
    d2 = start_daemon("--http-host", "127.0.0.3")
    assert d2.info["http"].startswith("127.0.0.3:")
    assert d2.info["data"].startswith("127.0.0.1:")


def test_fd_limit_is_raised_to_what_the_limits_need(start_daemon: Any) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 4096:
        pytest.skip(f"the hard RLIMIT_NOFILE is {hard}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))  # inherited by the daemon
    try:
        d = start_daemon("--max-connections=1024")
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    limits = Path(f"/proc/{d.proc.pid}/limits").read_text()
    line = next(li for li in limits.splitlines() if li.startswith("Max open files"))
    assert int(line.split()[3]) >= 2 * 1024


def test_fd_limit_too_low_refuses_to_start(run_daemon_cli: Any, tmp_path: Path) -> None:
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if hard != resource.RLIM_INFINITY and hard < 1024:
        pytest.skip(f"the hard RLIMIT_NOFILE is {hard}")

    def low() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (512, 512))

    res = run_daemon_cli(["--spill-dir", str(tmp_path), "--max-connections=1024"], preexec_fn=low)
    assert res.returncode == 2, res.stderr
    assert "max_connections" in res.stderr and "RLIMIT_NOFILE" in res.stderr, res.stderr


def test_non_loopback_without_secret_or_tls_warns(start_daemon: Any, secret_file: str) -> None:
    addr = _non_loopback_address()
    d = start_daemon("--host", addr)
    wait_for(lambda: "neither a secret nor TLS" in d.stderr)
    d2 = start_daemon("--host", addr, "--secret-file", secret_file)
    d3 = start_daemon("--host", "127.0.0.1")
    d2.stop_clean()
    d3.stop_clean()
    assert "neither a secret nor TLS" not in d2.stderr + d3.stderr


def _non_loopback_address() -> str:
    """An address of this host that is not loopback (a daemon only binds it here)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))  # no packet is sent: this only picks a route
        except OSError:
            pytest.skip("this host has no route off loopback")
        addr = str(s.getsockname()[0])
    if addr.startswith("127."):
        pytest.skip("this host has no address off loopback")
    return addr
