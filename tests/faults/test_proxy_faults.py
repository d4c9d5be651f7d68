"""A real daemon serving partitions to a consumer through the fault-injecting proxy.

The consumer (``PartitionReader``) reaches the daemon's data port only through a
``FaultProxy``; the producer writes over the daemon's local socket, untouched. What must
hold whatever the network does:

* a connection cut (FIN) or reset (RST) in the middle of a frame fails the reader with a
  ``TransportError`` within a bounded time, after a prefix of the records (possibly empty:
  the error overtakes buffers received but not yet read; never a short read that looks
  complete); both sides release everything: the reader's pool is whole
  (``PartitionReader.close`` and the autouse fixture check it), the daemon's connections
  and readers drop to zero and its pool goes back to what the partitions hold;
* a blocking partition cut mid-stream can be requested again and is read exactly once,
  from the start (the choice this project makes: no resume from the last acknowledged
  buffer; a re-request starts a fresh view);
* a pipelined partition whose reader is cut fails its producer with a typed error, and the
  daemon releases the partition and its pool;
* delay and throttle change the timing, never the records.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Iterator
from typing import Any

import pytest

from client.consumer import PartitionLocation, PartitionReader
from client.local_connection import release_dataset
from client.producer import PartitionWriter
from client.runtime import get_runtime
from exchange.errors import (
    ExchangeError,
    IllegalStateError,
    PartitionReleasedError,
    TransportError,
)
from exchange.partition.result_partition_id import ResultPartitionID

pytestmark = pytest.mark.timeout(120)

Daemon = Any  # tests/daemon/_daemon.py: DaemonProcess
Proxy = Any  # tests/kit/fault_proxy.py: FaultProxy
FAST_BACKOFF: dict[str, Any] = {"backoff_initial": 0.01, "backoff_max": 0.04}
#: A cut or reset must reach the reader within this many seconds.
FAIL_WITHIN = 10.0
#: Bytes forwarded before a cut: not a multiple of anything, so it lands inside a frame.
MID_FRAME = 300_007


def records(n: int, pad: int = 200) -> list[tuple[int, bytes]]:
    return [(i, bytes([i % 251]) * pad) for i in range(n)]


def via(proxy: Proxy, d: Daemon, pid: ResultPartitionID, sub: int = 0) -> PartitionLocation:
    """The partition's location with the proxy as its data port (no local socket, so the
    reader goes over TCP through the proxy)."""
    return PartitionLocation(pid, sub, proxy.address, d.daemon_id, None)


def write_blocking(d: Daemon, pid: ResultPartitionID, recs: Iterable[Any]) -> int:
    with PartitionWriter(
        pid, 1, blocking=True, daemon_socket=d.local_socket, buffer_timeout=-1
    ) as w:
        return w.emit_all(recs, partition_func=lambda k: 0)


def read_through(
    proxy: Proxy, d: Daemon, pid: ResultPartitionID
) -> tuple[list[Any], BaseException | None, float]:
    """Records read through the proxy, the error that ended the read, and how long it took."""
    got: list[Any] = []
    t0 = time.monotonic()
    try:
        with PartitionReader([via(proxy, d, pid)], **FAST_BACKOFF) as reader:
            for r in reader:
                got.append(r)
    except ExchangeError as e:
        return got, e, time.monotonic() - t0
    return got, None, time.monotonic() - t0


def daemon_idle(d: Daemon, available: int | None = None) -> dict[str, Any]:
    """Wait until the daemon has no data connection and no reader (and, when given, this
    many free segments)."""
    stats: dict[str, Any] = d.wait_stats(
        lambda s: (
            s["data_port"]["connections"] == 0
            and s["data_port"]["readers"] == 0
            and (available is None or s["network"]["available_segments"] == available)
        ),
        timeout=FAIL_WITHIN,
    )
    return stats


class Producer(threading.Thread):
    """Writes a pipelined partition on a thread; keeps its error."""

    def __init__(self, d: Daemon, pid: ResultPartitionID, recs: Iterable[Any]) -> None:
        super().__init__(name="producer", daemon=True)
        self.d, self.pid, self.recs = d, pid, recs
        self.opened = threading.Event()
        self.error: BaseException | None = None
        self.written = 0

    def run(self) -> None:
        try:
            with PartitionWriter(
                self.pid, 1, daemon_socket=self.d.local_socket, buffer_timeout=0.005
            ) as w:
                self.opened.set()
                self.written = w.emit_all(self.recs, partition_func=lambda k: 0)
        except BaseException as e:
            self.error = e
        finally:
            self.opened.set()


# -- a cut or reset in the middle of a frame ---------------------------------------------


@pytest.mark.parametrize("fault", ["cut_after", "reset_after"])
def test_blocking_stream_cut_mid_frame_fails_typed_and_reads_again_from_the_start(
    start_daemon: Any, proxy_for: Any, fp: Any, fault: str
) -> None:
    d = start_daemon()
    proxy = proxy_for(d)
    pid = ResultPartitionID(f"cut-{fault}", 0, 0)
    expected = records(20_000)
    assert write_blocking(d, pid, expected) == len(expected)
    baseline = daemon_idle(d)["network"]["available_segments"]

    proxy.set_fault(fp.DOWNSTREAM, **{fault: MID_FRAME})
    got, error, took = read_through(proxy, d, pid)
    assert isinstance(error, TransportError), repr(error)
    assert took < FAIL_WITHIN, f"the reader took {took:.1f}s to notice"
    # Fail fast (Flink's checkError before the queue): buffers that arrived before the cut
    # may be dropped with the error, so the reader may see none of them; never a gap.
    assert len(got) < len(expected)
    assert got == expected[: len(got)], "the records before the cut are a prefix, in order"

    st = proxy.wait_for(lambda s: s.open == 0)
    assert (st.cuts, st.resets) == ((1, 0) if fault == "cut_after" else (0, 1))
    assert st.bytes_down == MID_FRAME
    daemon_idle(d, available=baseline)  # the daemon let go of the view and its buffers

    proxy.clear()
    again, error, _ = read_through(proxy, d, pid)
    assert error is None, repr(error)
    assert again == expected  # from the start, every record exactly once

    assert get_runtime().run(release_dataset(d.local_socket, pid.dataset_id)) == 1
    st = d.wait_pool_whole()
    assert st["partitions"]["count"] == 0


def test_connection_reset_while_requesting_fails_typed_and_leaves_nothing(
    start_daemon: Any, proxy_for: Any, fp: Any
) -> None:
    """The handshake or the request itself is reset (nothing downstream ever arrives)."""
    d = start_daemon()
    proxy = proxy_for(d)
    pid = ResultPartitionID("reset-early", 0, 0)
    write_blocking(d, pid, records(100))
    baseline = daemon_idle(d)["network"]["available_segments"]
    proxy.set_fault(fp.UPSTREAM, reset_after=3)
    got, error, took = read_through(proxy, d, pid)
    assert got == []
    assert isinstance(error, TransportError), repr(error)
    assert took < FAIL_WITHIN
    daemon_idle(d, available=baseline)
    proxy.clear()
    assert read_through(proxy, d, pid)[:2] == (records(100), None)


@pytest.mark.parametrize("fault", ["cut_after", "reset_after"])
def test_pipelined_stream_cut_fails_reader_and_producer_and_frees_the_daemon(
    start_daemon: Any, proxy_for: Any, fp: Any, fault: str
) -> None:
    d = start_daemon()
    proxy = proxy_for(d)
    pid = ResultPartitionID(f"pipe-{fault}", 0, 0)

    def endless() -> Iterator[tuple[int, bytes]]:
        for i in range(10_000_000):
            yield (i, b"p" * 300)

    producer = Producer(d, pid, endless())
    producer.start()
    assert producer.opened.wait(10)
    proxy.set_fault(fp.DOWNSTREAM, **{fault: MID_FRAME})
    got, error, took = read_through(proxy, d, pid)
    assert isinstance(error, TransportError), repr(error)
    assert took < FAIL_WITHIN + 5
    assert [r[0] for r in got] == list(range(len(got)))  # a prefix (see the module doc)
    assert proxy.wait_for(lambda s: s.open == 0).bytes_down == MID_FRAME

    producer.join(FAIL_WITHIN)
    assert not producer.is_alive(), "the producer hangs after its reader was cut"
    assert isinstance(producer.error, PartitionReleasedError), repr(producer.error)
    st = d.wait_stats(
        lambda s: (
            s["network"]["available_segments"] == s["network"]["total_segments"]
            and s["partitions"]["count"] == 0
            and s["data_port"]["connections"] == 0
            and s["local"]["producers"] == 0
        ),
        timeout=FAIL_WITHIN,
    )
    assert st["network"]["local_pools"] == 0


# -- delay and throttle ------------------------------------------------------------------


def test_delay_and_throttle_keep_a_blocking_read_exact(
    start_daemon: Any, proxy_for: Any, fp: Any
) -> None:
    d = start_daemon()
    proxy = proxy_for(d)
    pid = ResultPartitionID("slow-net", 0, 0)
    expected = records(5_000)
    write_blocking(d, pid, expected)
    proxy.set_faults(delay_ms=20)
    proxy.set_fault(fp.DOWNSTREAM, delay_ms=20, throttle_bps=2_000_000)
    got, error, took = read_through(proxy, d, pid)
    assert error is None, repr(error)
    assert got == expected
    size = proxy.stats().bytes_down
    assert size > 5_000 * 200
    assert took >= 0.8 * size / 2_000_000, f"{size} bytes at 2 MB/s in {took:.2f}s"
    assert get_runtime().run(release_dataset(d.local_socket, pid.dataset_id)) == 1
    d.wait_pool_whole()


def test_delay_and_throttle_keep_a_pipelined_stream_exact_and_in_order(
    start_daemon: Any, proxy_for: Any, fp: Any
) -> None:
    d = start_daemon()
    proxy = proxy_for(d)
    pid = ResultPartitionID("slow-pipe", 0, 0)
    expected = records(8_000, pad=100)
    proxy.set_faults(delay_ms=15)
    proxy.set_fault(fp.DOWNSTREAM, delay_ms=15, throttle_bps=1_500_000)
    producer = Producer(d, pid, iter(expected))
    producer.start()
    assert producer.opened.wait(10)
    got, error, _ = read_through(proxy, d, pid)
    producer.join(FAIL_WITHIN)
    assert producer.error is None, repr(producer.error)
    assert error is None, repr(error)
    assert got == expected
    st = d.wait_pool_whole(timeout=FAIL_WITHIN)
    assert st["partitions"]["count"] == 0


# -- a network that goes silent ----------------------------------------------------------


def _stalled_reader(
    proxy: Proxy, d: Daemon, pid: ResultPartitionID, fp: Any
) -> tuple[PartitionReader, threading.Thread, list[Any], list[BaseException]]:
    """A reader on a thread whose downstream stalls once it has read something."""
    reader = PartitionReader([via(proxy, d, pid)], **FAST_BACKOFF)
    got: list[Any] = []
    errors: list[BaseException] = []

    def run() -> None:
        try:
            for r in reader:
                got.append(r)
        except BaseException as e:
            errors.append(e)

    # Throttled until the stall, so the stall lands mid-stream however fast the data path
    # is (unthrottled, a quiet machine moved the whole partition before the poll saw
    # 100 kB, and the reader ended cleanly).
    proxy.set_fault(fp.DOWNSTREAM, throttle_bps=2_000_000)
    thread = threading.Thread(target=run, name="stalled-reader", daemon=True)
    thread.start()
    proxy.wait_for(lambda s: s.bytes_down > 100_000)
    proxy.set_fault(fp.DOWNSTREAM, stall=True)
    return reader, thread, got, errors


#: The peer timeouts the tests below set (seconds): short, but far above a loaded
#: machine's scheduling hiccups.
PEER_TIMEOUT = 2.0


def test_reader_of_a_silent_connection_fails_typed_within_a_bound(
    start_daemon: Any, proxy_for: Any, fp: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The client's read_timeout: credit out and nothing arriving fails the reader."""
    monkeypatch.setenv("EXCHANGE_READ_TIMEOUT", str(PEER_TIMEOUT))
    d = start_daemon()
    proxy = proxy_for(d)
    pid = ResultPartitionID("silent", 0, 0)
    write_blocking(d, pid, records(20_000))
    reader, thread, _, errors = _stalled_reader(proxy, d, pid, fp)
    try:
        thread.join(FAIL_WITHIN)
        assert not thread.is_alive(), f"reader still blocked {FAIL_WITHIN}s after the stall"
        assert errors and isinstance(errors[0], TransportError), errors
    finally:
        reader.close()  # ends a blocked records() with IllegalStateError
        thread.join(FAIL_WITHIN)
        assert not thread.is_alive()
        assert not errors or isinstance(errors[0], (TransportError, IllegalStateError))
        proxy.clear()
        daemon_idle(d)


def test_daemon_times_out_a_consumer_that_never_reads(
    start_daemon: Any, proxy_for: Any, fp: Any
) -> None:
    """The daemon's peer_timeout: a consumer that stopped reading (its keepalive Ping is
    never answered) is dropped and its reader and buffers are released."""
    d = start_daemon(f"--peer-timeout={PEER_TIMEOUT}s")
    proxy = proxy_for(d)
    pid = ResultPartitionID("never-reads", 0, 0)
    write_blocking(d, pid, records(20_000))
    baseline = daemon_idle(d)["network"]["available_segments"]
    reader, thread, _, _ = _stalled_reader(proxy, d, pid, fp)
    try:
        # the daemon drops the silent peer by itself
        stats = daemon_idle(d, available=baseline)
        assert stats["data_port"]["timed_out_connections"] == 1
    finally:
        reader.close()
        thread.join(FAIL_WITHIN)
        proxy.clear()
        daemon_idle(d)
