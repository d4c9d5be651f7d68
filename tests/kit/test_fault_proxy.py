"""The fault-injecting proxy itself, in front of real TCP servers on loopback.

Targets: an echo server and a source that sends a fixed pattern on every connection.
Each fault is checked from the client's side: what arrives, when, and how it ends.
"""

from __future__ import annotations

import socket
import socketserver
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.kit.modules import load_module

pytestmark = pytest.mark.timeout(60)


fp: Any = load_module("exchange_tests_kit_fault_proxy", Path(__file__).with_name("fault_proxy.py"))
UP, DOWN = fp.UPSTREAM, fp.DOWNSTREAM

PATTERN = bytes(range(256)) * 4096  # 1 MiB, every offset recognisable


class _Echo(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        try:
            while data := self.request.recv(65536):
                self.request.sendall(data)
        except OSError:
            pass


class _Source(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        try:
            self.request.sendall(PATTERN)
            self.request.shutdown(socket.SHUT_WR)
            while self.request.recv(65536):
                pass
        except OSError:
            pass


class _Server(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True


@pytest.fixture
def server_factory() -> Iterator[Any]:
    servers: list[_Server] = []

    def start(handler: type[socketserver.BaseRequestHandler]) -> tuple[str, int]:
        srv = _Server(("127.0.0.1", 0), handler)
        threading.Thread(target=srv.serve_forever, daemon=True).start()
        servers.append(srv)
        host, port = srv.server_address[:2]
        return str(host), int(port)

    yield start
    for srv in servers:
        srv.shutdown()
        srv.server_close()


@pytest.fixture
def echo_proxy(server_factory: Any) -> Iterator[Any]:
    with fp.FaultProxy(*server_factory(_Echo)) as proxy:
        yield proxy


@pytest.fixture
def source_proxy(server_factory: Any) -> Iterator[Any]:
    with fp.FaultProxy(*server_factory(_Source)) as proxy:
        yield proxy


def connect(proxy: Any, timeout: float = 10.0) -> socket.socket:
    return socket.create_connection((proxy.host, proxy.port), timeout=timeout)


def recv_exactly(sock: socket.socket, n: int) -> bytes:
    out = bytearray()
    while len(out) < n:
        chunk = sock.recv(min(65536, n - len(out)))
        if not chunk:
            break
        out += chunk
    return bytes(out)


def recv_until_end(sock: socket.socket) -> tuple[bytes, BaseException | None]:
    """Everything until EOF, and the error that ended it instead (if any)."""
    out = bytearray()
    try:
        while chunk := sock.recv(65536):
            out += chunk
    except OSError as e:
        return bytes(out), e
    return bytes(out), None


def test_forwards_both_ways_unchanged_and_counts(echo_proxy: Any) -> None:
    with connect(echo_proxy) as s:
        s.sendall(PATTERN)
        assert recv_exactly(s, len(PATTERN)) == PATTERN
    st = echo_proxy.wait_for(lambda st: st.open == 0)
    assert st.accepted == 1
    assert st.bytes_up == st.bytes_down == len(PATTERN)
    assert st.cuts == st.resets == 0


def test_source_eof_is_passed_on(source_proxy: Any) -> None:
    with connect(source_proxy) as s:
        data, err = recv_until_end(s)
    assert err is None
    assert data == PATTERN


def test_delay_holds_every_chunk_for_the_delay(echo_proxy: Any) -> None:
    with connect(echo_proxy) as s:
        s.sendall(b"x")  # warm up the connection to the target
        assert recv_exactly(s, 1) == b"x"
        echo_proxy.set_faults(delay_ms=150)
        start = time.monotonic()
        s.sendall(b"ping")
        assert recv_exactly(s, 4) == b"ping"
        elapsed = time.monotonic() - start
    assert elapsed >= 0.29, elapsed  # 150 ms each way
    assert elapsed < 5, elapsed


def test_delay_is_latency_not_a_pause_per_chunk(echo_proxy: Any) -> None:
    echo_proxy.set_fault(UP, delay_ms=200)
    with connect(echo_proxy) as s:
        start = time.monotonic()
        for _ in range(60):  # 60 writes: with a pause per chunk this would take 12 s
            s.sendall(b"y" * 1000)
        assert recv_exactly(s, 60_000) == b"y" * 60_000
        elapsed = time.monotonic() - start
    assert 0.19 <= elapsed < 8.0, elapsed  # room for a loaded machine, under 12 s


def test_throttle_bounds_the_rate_and_keeps_the_bytes(source_proxy: Any) -> None:
    source_proxy.set_fault(DOWN, throttle_bps=1_000_000)
    with connect(source_proxy) as s:
        start = time.monotonic()
        data, err = recv_until_end(s)
        elapsed = time.monotonic() - start
    assert err is None and data == PATTERN
    assert elapsed >= 0.8, f"1 MiB at 1 MB/s took {elapsed:.2f}s"


def test_cut_after_ends_cleanly_after_exactly_n_bytes(source_proxy: Any) -> None:
    source_proxy.set_fault(DOWN, cut_after=100_003)
    with connect(source_proxy) as s:
        data, err = recv_until_end(s)
    assert err is None, err
    assert data == PATTERN[:100_003]
    st = source_proxy.wait_for(lambda st: st.open == 0)
    assert st.cuts == 1 and st.resets == 0
    assert st.bytes_down == 100_003


def test_reset_after_resets_after_exactly_n_bytes(source_proxy: Any) -> None:
    tries = 0
    while tries < 3:
        tries += 1
        source_proxy.set_fault(DOWN, reset_after=70_001)
        try:
            s = connect(source_proxy)
        except ConnectionResetError:
            # under load the proxy can send and reset before this thread wakes from
            # connect(): the kernel reports the reset there and the bytes are gone
            source_proxy.wait_for(lambda st: st.open == 0)
            continue
        with s:
            data, err = recv_until_end(s)
        break
    assert isinstance(err, ConnectionResetError), repr(err)
    assert data == PATTERN[:70_001]
    st = source_proxy.wait_for(lambda st: st.open == 0)
    assert st.resets == tries and st.cuts == 0


def test_upstream_reset_reaches_the_target_and_the_client(echo_proxy: Any) -> None:
    echo_proxy.set_fault(UP, reset_after=10)
    with connect(echo_proxy) as s:
        s.sendall(b"0123456789abcdef")
        data, err = recv_until_end(s)
    assert isinstance(err, ConnectionResetError), repr(err)
    assert b"0123456789".startswith(data)
    assert echo_proxy.wait_for(lambda st: st.open == 0).bytes_up == 10


def test_spent_budget_ends_later_connections_until_cleared(source_proxy: Any) -> None:
    source_proxy.set_fault(DOWN, cut_after=10)
    with connect(source_proxy) as s:
        assert recv_until_end(s) == (PATTERN[:10], None)
    with connect(source_proxy) as s:
        assert recv_until_end(s) == (b"", None)
    source_proxy.clear()
    with connect(source_proxy) as s:
        assert recv_until_end(s) == (PATTERN, None)


def test_cut_set_while_streaming_counts_from_then(echo_proxy: Any) -> None:
    with connect(echo_proxy) as s:
        s.sendall(b"a" * 5000)
        assert recv_exactly(s, 5000) == b"a" * 5000
        echo_proxy.set_fault(DOWN, cut_after=1234)
        s.sendall(b"b" * 5000)
        data, err = recv_until_end(s)
    assert err is None
    assert data == b"b" * 1234


def test_stall_forwards_nothing_until_lifted(echo_proxy: Any) -> None:
    with connect(echo_proxy) as s:
        s.sendall(b"warm")
        assert recv_exactly(s, 4) == b"warm"
        echo_proxy.set_fault(DOWN, stall=True)
        s.sendall(b"held")
        echo_proxy.wait_for(lambda st: st.bytes_up == 8)  # reached the echo server
        s.settimeout(0.3)
        with pytest.raises(TimeoutError):
            s.recv(10)  # stalled: nothing comes back
        assert echo_proxy.stats().bytes_down == 4
        s.settimeout(10)
        echo_proxy.clear()
        assert recv_exactly(s, 4) == b"held"


def test_stall_applies_backpressure_to_the_sender(source_proxy: Any) -> None:
    source_proxy.set_fault(DOWN, stall=True)
    with connect(source_proxy) as s:
        # The proxy stops reading once its queue is full: the source's 1 MiB stays behind.
        assert source_proxy.stats().bytes_down == 0
        source_proxy.clear()
        assert recv_until_end(s) == (PATTERN, None)


def test_cut_all_ends_open_connections(echo_proxy: Any) -> None:
    socks = [connect(echo_proxy) for _ in range(3)]
    try:
        for s in socks:
            s.sendall(b"hi")
            assert recv_exactly(s, 2) == b"hi"
        assert echo_proxy.cut_all(reset=True) == 3
        for s in socks:
            _, err = recv_until_end(s)
            assert isinstance(err, ConnectionResetError), repr(err)
    finally:
        for s in socks:
            s.close()
    st = echo_proxy.wait_for(lambda st: st.open == 0)
    assert st.resets == 3


def test_unreachable_target_closes_the_client() -> None:
    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    free_port = probe.getsockname()[1]
    probe.close()  # nothing listens there now
    with fp.FaultProxy("127.0.0.1", free_port) as proxy:
        try:
            s = connect(proxy)
        except ConnectionResetError:
            return  # the proxy's reset overtook the handshake: closed before connected
        with s:
            data, err = recv_until_end(s)
        assert data == b""
        assert err is None or isinstance(err, ConnectionResetError)


def test_invalid_faults_are_refused(echo_proxy: Any) -> None:
    with pytest.raises(ValueError, match="delay_ms"):
        echo_proxy.set_fault(UP, delay_ms=-1)
    with pytest.raises(ValueError, match="throttle_bps"):
        echo_proxy.set_fault(UP, throttle_bps=0)
    with pytest.raises(ValueError, match="exclusive"):
        echo_proxy.set_fault(UP, cut_after=1, reset_after=1)
    with pytest.raises(ValueError, match="cut_after"):
        echo_proxy.set_fault(DOWN, cut_after=-5)
    assert echo_proxy.fault(UP) == fp.Fault()


def test_close_is_idempotent_and_stops_the_thread(server_factory: Any) -> None:
    proxy = fp.FaultProxy(*server_factory(_Echo))
    s = connect(proxy)
    s.sendall(b"x")
    assert recv_exactly(s, 1) == b"x"
    proxy.close()
    proxy.close()
    assert not proxy._thread.is_alive()
    assert recv_until_end(s)[0] == b""
    s.close()
