"""The exchange daemon as a real process: shutdown, producer crashes, time to live, release,
authentication and backpressure, seen from the client API (``PartitionWriter`` /
``PartitionReader``) and the daemon's own reports (``/api/stats``, the 'stopped' line).

Every test leaves the daemon's pool whole: the ``start_daemon`` fixture stops each daemon
still running with SIGTERM and requires exit 0 and ``pool_whole: true``.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
import urllib.error
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import pytest

from client.consumer import PartitionLocation, PartitionReader
from client.local_connection import abandon_subpartition, fetch_daemon_info, release_dataset
from client.producer import PartitionWriter
from client.runtime import get_runtime
from exchange.errors import (
    AuthenticationError,
    ExchangeError,
    PartitionNotFoundError,
    PartitionReleasedError,
    ProducerFailedError,
    UsageError,
)
from exchange.partition.result_partition_id import ResultPartitionID

pytestmark = pytest.mark.timeout(90)

Daemon = Any  # tests/daemon/_daemon.py: DaemonProcess
#: Short partition-request backoff for readers of partitions that must already exist.
FAST_BACKOFF = {"backoff_initial": 0.01, "backoff_max": 0.04}


def location(d: Daemon, pid: ResultPartitionID, sub: int) -> PartitionLocation:
    return PartitionLocation(pid, sub, d.data_address, d.daemon_id, d.local_socket)


def read(
    d: Daemon,
    pid: ResultPartitionID,
    subs: Iterable[int] = (0,),
    *,
    local: bool = False,
    **kwargs: Any,
) -> list[Any]:
    """Every record of ``pid``'s subpartitions ``subs``, over TCP (or the Unix socket),
    exactly as written (the default codec)."""
    locations = [location(d, pid, s) for s in subs]
    reader = PartitionReader(locations, local_daemon_id=d.daemon_id if local else None, **kwargs)
    with reader:
        return reader.read_all()


def write_blocking(
    d: Daemon, pid: ResultPartitionID, records: Iterable[Any], n: int = 1, **kwargs: Any
) -> int:
    with PartitionWriter(
        pid, n, blocking=True, daemon_socket=d.local_socket, buffer_timeout=-1, **kwargs
    ) as w:
        return w.emit_all(records, partition_func=lambda k: k % n)


class Collector(threading.Thread):
    """Reads a PartitionReader to the end on a thread; keeps records and the error."""

    def __init__(self, make_reader: Callable[[], PartitionReader]) -> None:
        super().__init__(name="collector", daemon=True)
        self._make_reader = make_reader
        self.records: list[Any] = []
        self.error: BaseException | None = None
        self.complete = False

    def run(self) -> None:
        try:
            with self._make_reader() as reader:
                for r in reader:
                    self.records.append(r)
            self.complete = True
        except BaseException as e:
            self.error = e

    def wait_for(self, count: int, timeout: float = 20.0) -> None:
        deadline = time.monotonic() + timeout
        while len(self.records) < count:
            assert self.error is None, self.error
            assert time.monotonic() < deadline, f"only {len(self.records)} records read"
            time.sleep(0.01)

    def result(self, timeout: float = 30.0) -> None:
        self.join(timeout)
        assert not self.is_alive(), f"reader still running after {timeout}s"


class Producer(threading.Thread):
    """Writes a pipelined partition with PartitionWriter on a thread.

    The buffer timeout defaults to 0 (push after every record): the sync writer checks
    its timeout only as records come, so records emitted before the input iterator
    stalls would otherwise wait for the next one.
    """

    def __init__(
        self,
        d: Daemon,
        pid: ResultPartitionID,
        records: Iterable[Any],
        n: int = 1,
        buffer_timeout: float = 0,
    ) -> None:
        super().__init__(name="producer", daemon=True)
        self.buffer_timeout = buffer_timeout
        self.d = d
        self.pid = pid
        self.records = records
        self.n = n
        self.opened = threading.Event()
        self.error: BaseException | None = None
        self.written = 0

    def run(self) -> None:
        n = self.n
        try:
            with PartitionWriter(
                self.pid, n, daemon_socket=self.d.local_socket, buffer_timeout=self.buffer_timeout
            ) as w:
                self.opened.set()
                self.written = w.emit_all(self.records, partition_func=lambda k: k % n)
        except BaseException as e:
            self.error = e
        finally:
            self.opened.set()


def check_prefix(records: list[Any], sub: int = 0, n: int = 1) -> None:
    """Records of subpartition ``sub`` are the first ones produced, in order, no gaps."""
    keys = [r[0] for r in records]
    assert keys == list(range(sub, sub + n * len(keys), n)), keys[:20]


# -- graceful shutdown ---------------------------------------------------------------------


def test_sigterm_lets_a_pipelined_stream_finish_within_grace(start_daemon: Any) -> None:
    d = start_daemon()
    pid = ResultPartitionID("sigterm-finish", 0, 0)
    total = 1200
    release = threading.Event()

    def records() -> Iterator[tuple[int, bytes]]:
        for i in range(total):
            if i == 1000:
                assert release.wait(20)  # hold the stream open until the daemon is stopping
            yield (i, b"x" * 64)

    producer = Producer(d, pid, records())
    producer.start()
    assert producer.opened.wait(10)
    consumer = Collector(lambda: PartitionReader([location(d, pid, 0)], **FAST_BACKOFF))
    consumer.start()
    consumer.wait_for(500)

    d.proc.send_signal(15)
    # The daemon is draining: it says so on /healthz while the stream goes on.
    deadline = time.monotonic() + 10
    while True:
        try:
            d.http_get("/healthz")
        except urllib.error.HTTPError as e:
            assert e.code == 503
            break
        assert time.monotonic() < deadline, "/healthz never reported shutting down"
        time.sleep(0.02)
    assert d.running
    release.set()

    producer.join(20)
    consumer.result()
    assert producer.error is None, producer.error
    assert consumer.error is None, consumer.error
    assert consumer.complete
    assert [r[0] for r in consumer.records] == list(range(total))
    d.stop_clean()


def test_sigterms_repeated_while_a_stopped_daemon_exits_leave_exit_code_0(
    start_daemon: Any,
) -> None:
    """A supervisor that repeats its SIGTERM while the daemon is already exiting (the
    'stopped' line printed, the loop closing) must not turn the clean exit into death by
    the signal's default action (-15): seen once as a failed ``stop_clean``."""
    d = start_daemon()
    d.proc.send_signal(signal.SIGTERM)
    while (line := d._out.next_line(30)) is not None and '"stopped"' not in line:
        pass
    assert line is not None, f"no 'stopped' line: {d.stderr}"
    sent = 0
    while d.proc.poll() is None:  # into the exit, as fast as signals go
        with contextlib.suppress(ProcessLookupError):
            d.proc.send_signal(signal.SIGTERM)
            sent += 1
    assert d.proc.wait(10) == 0, f"exit {d.proc.returncode} after {sent} SIGTERMs: {d.stderr}"


def test_sigterm_fails_a_stalled_pipelined_stream_with_a_typed_error(start_daemon: Any) -> None:
    d = start_daemon()
    pid = ResultPartitionID("sigterm-stall", 0, 0)
    stall = threading.Event()

    def records() -> Iterator[tuple[int, bytes]]:
        for i in range(100_000):
            if i == 500:
                stall.wait(30)  # the producer hangs past the daemon's grace period
            yield (i, b"y" * 32)

    producer = Producer(d, pid, records())
    producer.start()
    assert producer.opened.wait(10)
    consumer = Collector(
        lambda: PartitionReader([location(d, pid, 0)], local_daemon_id=d.daemon_id, **FAST_BACKOFF)
    )
    consumer.start()
    consumer.wait_for(400)

    t0 = time.monotonic()
    code, stopped = d.terminate()
    took = time.monotonic() - t0
    assert code == 0, d.stderr
    assert stopped == {"event": "stopped", "pool_whole": True}, d.stderr
    assert took < 15, f"shutdown took {took:.1f}s"

    consumer.result()
    assert not consumer.complete, "a stream cut by shutdown must not look complete"
    assert isinstance(consumer.error, ProducerFailedError), repr(consumer.error)
    check_prefix(consumer.records)

    stall.set()
    producer.join(20)
    assert not producer.is_alive()
    assert isinstance(producer.error, ExchangeError), repr(producer.error)


# -- a producer process dies -------------------------------------------------------------


@pytest.mark.parametrize("shared", [True, False], ids=["shared-memory", "socket"])
def test_sigkilled_producer_fails_its_consumer_and_frees_the_pool(
    start_daemon: Any, start_producer: Any, shared: bool
) -> None:
    """Killed mid-stream, through the shared arena or the socket alike: the consumer gets
    ProducerFailedError after whole records only (a segment counts once committed), and
    every segment the task was granted comes back (the arena itself goes)."""
    d = start_daemon("--shared-memory" if shared else "--no-shared-memory")
    pid = ResultPartitionID("killed", 0, 0)
    child = start_producer(d.local_socket, "killed", 0, 2)
    child.wait_writing()
    consumer = Collector(
        lambda: PartitionReader([location(d, pid, 0), location(d, pid, 1)], **FAST_BACKOFF)
    )
    consumer.start()
    consumer.wait_for(2000)
    local = d.stats()["local"]
    assert local["producers"] == 1
    by_path = {"bytes_shared_memory": shared, "bytes_socket": not shared}
    assert {k: local[k] > 0 for k in by_path} == by_path, local
    assert local["shared_arenas"] == int(shared)

    assert child.sigkill() == -9
    consumer.result(timeout=20)
    assert isinstance(consumer.error, ProducerFailedError), repr(consumer.error)
    assert not consumer.complete
    for sub in (0, 1):
        check_prefix([r for r in consumer.records if r[1] == sub], sub, 2)

    st = d.wait_stats(
        lambda s: (
            s["network"]["available_segments"] == s["network"]["total_segments"]
            and s["partitions"]["count"] == 0
            and s["local"]["producers"] == 0
        )
    )
    assert st["local"]["producer_failures"] == 1
    assert st["network"]["local_pools"] == 0
    d.wait_stats(
        lambda s: s["local"]["shared_arenas"] == 0 and s["local"]["shared_segments_in_use"] == 0
    )
    # The daemon goes on serving other streams.
    other = ResultPartitionID("after-kill", 0, 0)
    write_blocking(d, other, [(i, i) for i in range(10)])
    assert read(d, other) == [(i, i) for i in range(10)]
    assert read(d, other) == [(i, i) for i in range(10)]  # blocking: readable twice
    d.stop_clean()


# -- blocking partitions: time to live and release -------------------------------------


def test_finished_blocking_partition_expires_after_its_ttl(start_daemon: Any) -> None:
    d = start_daemon("--blocking-partition-ttl", "0.5s")
    pid = ResultPartitionID("ttl", 0, 0)
    records = [(i, f"v{i}") for i in range(200)]
    write_blocking(d, pid, records)
    assert read(d, pid) == records

    d.wait_stats(lambda s: s["partitions"]["count"] == 0, timeout=10)
    with pytest.raises((PartitionReleasedError, PartitionNotFoundError)):
        read(d, pid, **FAST_BACKOFF)
    d.wait_pool_whole()


def test_ttl_does_not_release_a_partition_while_it_is_read(start_daemon: Any) -> None:
    d = start_daemon("--blocking-partition-ttl", "0.5s")
    pid = ResultPartitionID("ttl-reading", 0, 0)
    pad = b"z" * 4000
    total = 3000  # 12 MB: more than the reader's window holds, so its view stays open
    write_blocking(d, pid, ((i, pad) for i in range(total)))

    reader = PartitionReader([location(d, pid, 0)], window=1)
    with reader:
        it = iter(reader)
        assert next(it)[0] == 0
        time.sleep(1.5)  # three times the time to live
        rest = [r[0] for r in it]
    assert rest == list(range(1, total))
    d.wait_stats(lambda s: s["partitions"]["count"] == 0, timeout=10)
    d.wait_pool_whole()


def test_release_dataset_over_tcp_and_over_the_local_socket(start_daemon: Any) -> None:
    d = start_daemon()
    rt = get_runtime()
    data = {(ds, i): [(k, ds, i) for k in range(50)] for ds in ("rel-a", "rel-b") for i in (0, 1)}
    for (ds, i), recs in data.items():
        write_blocking(d, ResultPartitionID(ds, i, 7), recs)
    assert d.stats()["partitions"]["count"] == 4

    assert rt.run(release_dataset(d.data_address, "rel-a")) == 2  # TCP, data port
    for i in (0, 1):
        with pytest.raises(PartitionReleasedError):
            read(d, ResultPartitionID("rel-a", i, 7), **FAST_BACKOFF)
        # the other exchange is untouched, over TCP and over the Unix socket
        assert read(d, ResultPartitionID("rel-b", i, 7)) == data[("rel-b", i)]
        assert read(d, ResultPartitionID("rel-b", i, 7), local=True) == data[("rel-b", i)]

    assert rt.run(release_dataset(d.local_socket, "rel-b")) == 2  # Unix socket
    with pytest.raises(PartitionReleasedError):
        read(d, ResultPartitionID("rel-b", 0, 7), local=True, **FAST_BACKOFF)
    assert rt.run(release_dataset("unix:" + d.local_socket, "rel-b")) == 0
    assert rt.run(release_dataset(d.data_address, "never-written")) == 0

    st = d.wait_pool_whole()
    assert st["partitions"]["count"] == 0
    assert st["totals"]["partitions_released"] == 4


# -- authentication ----------------------------------------------------------------------


def test_wrong_secret_is_refused_with_authentication_error(
    start_daemon: Any, tmp_path: Path
) -> None:
    secret_file = tmp_path / "secret"
    secret_file.write_bytes(b"the-right-secret\n")
    os.chmod(secret_file, 0o600)
    d = start_daemon("--secret-file", str(secret_file))
    rt = get_runtime()
    pid = ResultPartitionID("auth", 0, 0)

    for wrong in (b"another-secret", None):
        with pytest.raises(AuthenticationError):
            PartitionWriter(pid, 1, blocking=True, daemon_socket=d.local_socket, secret=wrong)
        with pytest.raises(AuthenticationError):
            rt.run(fetch_daemon_info(d.local_socket, secret=wrong))
        with pytest.raises(AuthenticationError):
            rt.run(release_dataset(d.data_address, "auth", secret=wrong))
    assert d.stats()["partitions"]["count"] == 0  # nothing was created

    right = b"the-right-secret"
    assert rt.run(fetch_daemon_info(d.local_socket, secret=right)).daemon_id == d.daemon_id
    records = [(i, "ok") for i in range(100)]
    write_blocking(d, pid, records, secret=right)
    assert read(d, pid, secret=right) == records
    assert read(d, pid, local=True, secret=right) == records
    for wrong in (b"another-secret", None):
        with pytest.raises(AuthenticationError):
            read(d, pid, secret=wrong, **FAST_BACKOFF)
    assert rt.run(release_dataset(d.data_address, "auth", secret=right)) == 1
    d.wait_pool_whole()


# -- backpressure across the local endpoint ----------------------------------------------


def test_records_before_a_stalled_input_reach_the_reader_within_the_buffer_timeout(
    start_daemon: Any,
) -> None:
    """The flush timer takes what emit_all gathered while the input iterator blocks."""
    d = start_daemon()
    pid = ResultPartitionID("stalled-input", 0, 0)
    go_on = threading.Event()

    def records() -> Iterator[tuple[int, int]]:
        yield from ((i, i) for i in range(10))
        assert go_on.wait(30)  # the input stalls after 10 records (a chunk holds 64)
        yield from ((i, i) for i in range(10, 20))

    producer = Producer(d, pid, records(), buffer_timeout=0.05)
    producer.start()
    assert producer.opened.wait(10)
    collector = Collector(lambda: PartitionReader([location(d, pid, 0)], **FAST_BACKOFF))
    collector.start()
    try:
        collector.wait_for(10)
        assert collector.records == [(i, i) for i in range(10)]
    finally:
        go_on.set()
    collector.join(30)
    producer.join(30)
    assert producer.error is None and collector.error is None
    assert collector.records == [(i, i) for i in range(20)]
    d.wait_pool_whole()


def test_producer_blocks_while_its_consumer_does_not_read(start_daemon: Any) -> None:
    d = start_daemon()
    pid = ResultPartitionID("backpressure", 0, 0)
    total = 1500
    pad = b"b" * 32_000  # ~1 segment per record: 48 MB, far beyond what may be buffered
    generated = [0]

    def records() -> Iterator[tuple[int, bytes]]:
        for i in range(total):
            generated[0] = i + 1
            yield (i, pad + i.to_bytes(4, "big"))  # a new object: pickle stores each

    producer = Producer(d, pid, records(), buffer_timeout=-1)
    producer.start()
    assert producer.opened.wait(10)
    # A consumer that is attached but whose task does not read.
    reader = PartitionReader([location(d, pid, 0)], window=1, **FAST_BACKOFF)
    try:
        # The producer stalls: its thread stays in emit_all and makes no progress.
        last, stable_since = -1, time.monotonic()
        deadline = time.monotonic() + 20
        while time.monotonic() - stable_since < 1.0:
            assert time.monotonic() < deadline, f"producer never blocked ({generated[0]})"
            if generated[0] != last:
                last, stable_since = generated[0], time.monotonic()
            time.sleep(0.05)
        assert producer.is_alive() and producer.error is None, (producer.error, generated)
        assert generated[0] < total // 2, generated[0]
        st = d.stats()
        # bounded by the partition's local pool (max(2 n + 8, 16) segments) and the
        # overdraft it may take to end a record (5 by default), not by the data
        assert st["network"]["overdraft_segments"] <= 5, st["network"]
        assert st["network"]["used_segments"] <= 16 + 5, st["network"]
        # the daemon's 2048 and the producer's application's shared arena (a quarter)
        assert st["network"]["total_segments"] == 2048 + 512 * st["local"]["shared_arenas"]

        # The consumer reads: the producer resumes and every record arrives, in order.
        keys = [r[0] for r in reader]
    finally:
        reader.close()
    producer.join(30)
    assert not producer.is_alive()
    assert producer.error is None, producer.error
    assert producer.written == total
    assert keys == list(range(total))
    d.wait_pool_whole()


# -- a consumer vanishes --------------------------------------------------------------------


def test_consumer_that_vanishes_fails_its_producer_not_hangs_it(start_daemon: Any) -> None:
    d = start_daemon()
    pid = ResultPartitionID("vanish", 0, 0)
    producer = Producer(d, pid, ((i, b"v" * 1000) for i in range(200_000)), n=2, buffer_timeout=-1)
    producer.start()
    assert producer.opened.wait(10)
    reader = PartitionReader([location(d, pid, 0), location(d, pid, 1)], **FAST_BACKOFF)
    it = iter(reader)
    for _ in range(1000):
        next(it)
    reader.close()  # the consumer task goes away before the end

    producer.join(20)
    assert not producer.is_alive(), "producer hangs after its consumer left"
    assert isinstance(producer.error, PartitionReleasedError), repr(producer.error)
    assert "released by its consumer" in str(producer.error)
    st = d.wait_stats(
        lambda s: (
            s["network"]["available_segments"] == s["network"]["total_segments"]
            and s["partitions"]["count"] == 0
        )
    )
    assert st["network"]["local_pools"] == 0


def test_a_subpartition_abandoned_before_its_partition_exists_never_holds_its_producer(
    start_daemon: Any,
) -> None:
    """The Spark race: a consumer reads a record of one partition and leaves while its
    request for another producer's partition is still being retried (that partition does
    not exist yet). It abandons its subpartition; the partition created later gets it
    released at once, so its producer ends (told why) instead of waiting for a reader that
    never comes, and the daemon ends whole with no partition left."""
    d = start_daemon()
    rt = get_runtime()
    first = ResultPartitionID("abandon-race", 0, 1)
    late = ResultPartitionID("abandon-race", 1, 2)
    early = Producer(d, first, ((i, b"e") for i in range(10)), n=1)
    early.start()
    reader = PartitionReader([location(d, first, 0), location(d, late, 0)], **FAST_BACKOFF)
    it = iter(reader)
    assert next(it)[1] == b"e"  # one record, then the consumer stops
    reader.close()
    early.join(30)
    assert not early.is_alive()
    # the subpartition of the partition it read had its reader: that reader's release
    # said what happened; nothing of the late partition exists yet
    assert rt.run(abandon_subpartition(d.data_address, "abandon-race", 0)) == 0

    # 200 MB through a pool of a few MiB: without the abandon, the producer would wait
    # for subpartition 0's reader for ever
    producer = Producer(d, late, ((i, b"v" * 1000) for i in range(200_000)), n=2, buffer_timeout=-1)
    other = Collector(lambda: PartitionReader([location(d, late, 1)], **FAST_BACKOFF))
    producer.start()
    other.start()
    producer.join(60)
    assert not producer.is_alive(), "the producer waits for a reader that left"
    assert isinstance(producer.error, PartitionReleasedError), repr(producer.error)
    assert "released by its consumer before the end" in str(producer.error)
    other.result()
    assert isinstance(other.error, ProducerFailedError), repr(other.error)
    st = d.wait_stats(
        lambda s: (
            s["network"]["available_segments"] == s["network"]["total_segments"]
            and s["partitions"]["count"] == 0
        )
    )
    assert st["network"]["local_pools"] == 0

    # released, the dataset is forgotten: a new partition of it is read whole again
    assert rt.run(release_dataset(d.local_socket, "abandon-race")) == 0
    again = ResultPartitionID("abandon-race", 2, 3)
    records = [(i, i) for i in range(2000)]
    after = Producer(d, again, iter(records), n=1)
    after.start()
    assert read(d, again) == records
    after.join(30)
    assert after.error is None, after.error
    d.wait_pool_whole()


def test_abandon_subpartition_checks_its_arguments(start_daemon: Any) -> None:
    d = start_daemon()
    rt = get_runtime()
    for ds, sub in (("", 0), ("x" * 256, 0), ("ok", -1), ("ok", 2**32 - 1), ("ok", True)):
        with pytest.raises(UsageError):
            rt.run(abandon_subpartition(d.local_socket, ds, sub))  # type: ignore[arg-type]
    assert rt.run(abandon_subpartition("unix:" + d.local_socket, "never-written", 3)) == 0


# -- one daemon per local socket ---------------------------------------------------------


def test_second_daemon_on_a_live_local_socket_is_refused(
    start_daemon: Any, dm: Any, tmp_path: Path
) -> None:
    sock = str(tmp_path / "d.sock")
    a = start_daemon("--local-socket", sock)
    b = dm.DaemonProcess("--local-socket", sock, start=False)
    try:
        code = b.proc.wait(30)
    finally:
        b.cleanup()
    assert code == 1, b.stderr
    assert "cannot start" in b.stderr and sock in b.stderr and "in use" in b.stderr, b.stderr
    # the running daemon keeps its socket
    assert get_runtime().run(fetch_daemon_info(sock)).daemon_id == a.daemon_id
    a.stop_clean()
    assert not os.path.exists(sock)


def test_restart_after_a_crash_reuses_the_socket_and_tasks_find_the_new_daemon(
    start_daemon: Any, tmp_path: Path
) -> None:
    from client import spark as xs

    sock = str(tmp_path / "d.sock")
    a = start_daemon("--local-socket", sock)
    _, info = xs._local_daemon(xs._DaemonSpec(sock, None))  # what a reused PySpark worker remembers
    assert info.daemon_id == a.daemon_id
    a.kill()  # a crash leaves the socket file behind
    assert os.path.exists(sock)

    b = start_daemon("--local-socket", sock)
    _, info = xs._local_daemon(xs._DaemonSpec(sock, None))
    assert (info.daemon_id, info.data_address) == (b.daemon_id, b.data_address)
    pid = ResultPartitionID("restarted", 0, 0)
    write_blocking(b, pid, [(1, "x")])
    assert read(b, pid) == [(1, "x")]
    assert get_runtime().run(release_dataset(b.data_address, "restarted")) == 1


def test_partition_needing_more_buffers_than_the_daemon_has_is_refused(
    start_daemon: Any,
) -> None:
    d = start_daemon("--network-memory", "1mb")  # 32 segments of 32 KiB
    with pytest.raises(ExchangeError, match="network_memory"):
        PartitionWriter(ResultPartitionID("too-wide", 0, 0), 40, daemon_socket=d.local_socket)
    pid = ResultPartitionID("fits", 0, 0)
    write_blocking(d, pid, [(i, i) for i in range(100)], n=4)
    assert sorted(read(d, pid, subs=range(4))) == [(i, i) for i in range(100)]
    get_runtime().run(release_dataset(d.local_socket, "fits"))
    d.wait_pool_whole()


def test_bytes_sent_counter_keeps_traffic_of_closed_connections(start_daemon: Any) -> None:
    d = start_daemon()
    pid = ResultPartitionID("counted", 0, 0)
    # distinct payloads: pickle would store one shared object once
    write_blocking(d, pid, ((i, b"c" * 96 + i.to_bytes(4, "big")) for i in range(10_000)))
    assert len(read(d, pid)) == 10_000  # over TCP; the reader closes its connection
    st = d.stats()
    assert st["data_port"]["total_connections"] == 1
    assert st["data_port"]["bytes_sent_total"] > 1_000_000, st["data_port"]


# -- routing -----------------------------------------------------------------------------


def test_emit_all_routes_every_key_by_its_own_hash(start_daemon: Any) -> None:
    """Keys Python finds equal (1 == True == 1.0) but the hash tells apart each go to the
    subpartition of their own hash, whatever came first (no shared cache entry)."""
    from exchange.writer.hashing import deterministic_hash

    d = start_daemon()
    n = 4
    keys: list[Any] = [1, True, 1.0, 0, False, 0.0, (1, 2), (True, 2), [1], [True], "1", b"1"]
    records = [(k, i) for i in range(3) for k in keys + keys[::-1]]
    pid = ResultPartitionID("routing", 0, 0)
    with PartitionWriter(
        pid, n, blocking=True, daemon_socket=d.local_socket, buffer_timeout=-1
    ) as w:
        assert w.emit_all(records) == len(records)
    for sub in range(n):
        got = read(d, pid, [sub])
        want = [r for r in records if deterministic_hash(r[0]) % n == sub]
        # records come back exactly: 1, True and 1.0 (and [1] vs (1,)) stay apart
        assert sorted(map(repr, got)) == sorted(map(repr, want)), sub
        assert sorted((repr(k), type(k).__name__, v) for k, v in got) == sorted(
            (repr(k), type(k).__name__, v) for k, v in want
        ), sub
    get_runtime().run(release_dataset(d.local_socket, "routing"))


def test_reader_closed_before_the_end_raises_instead_of_hanging(start_daemon: Any) -> None:
    from exchange.errors import IllegalStateError

    d = start_daemon()
    pid = ResultPartitionID("reiterate", 0, 0)
    write_blocking(d, pid, ((i, b"r" * 1000) for i in range(20_000)))

    def in_thread(fn: Callable[[], Any]) -> Any:
        result: list[Any] = []
        t = threading.Thread(target=lambda: result.append(_outcome(fn)), daemon=True)
        t.start()
        t.join(10)
        assert not t.is_alive(), "hangs"
        return result[0]

    early = PartitionReader([location(d, pid, 0)])
    for i, _ in enumerate(early):
        if i == 10:
            break  # the generator's close closes the reader
    assert isinstance(in_thread(early.read_all), IllegalStateError)
    closed = PartitionReader([location(d, pid, 0)])
    closed.close()
    assert isinstance(in_thread(closed.read_all), IllegalStateError)
    done = PartitionReader([location(d, pid, 0)])
    assert len(done.read_all()) == 20_000
    assert done.read_all() == []  # exhausted, like any iterator
    get_runtime().run(release_dataset(d.local_socket, "reiterate"))
    d.wait_pool_whole()


def _outcome(fn: Callable[[], Any]) -> Any:
    try:
        return fn()
    except BaseException as e:
        return e


def test_producer_waiting_for_credit_fails_when_its_consumer_leaves(start_daemon: Any) -> None:
    """The producer is stalled with zero credit (its pool is full and nobody reads) when
    its consumer attaches and leaves without reading: the daemon must tell the producer,
    which would otherwise wait for credit forever."""
    d = start_daemon()
    pid = ResultPartitionID("stalled", 0, 0)
    generated = [0]

    def records() -> Iterator[tuple[int, bytes]]:
        for i in range(200_000):
            generated[0] = i
            yield (i, b"s" * 1000)

    producer = Producer(d, pid, records(), n=1, buffer_timeout=-1)
    producer.start()
    assert producer.opened.wait(10)
    last, stable_since = -1, time.monotonic()
    deadline = time.monotonic() + 20
    while time.monotonic() - stable_since < 0.5:  # stalled on backpressure
        assert time.monotonic() < deadline, "producer never stalled"
        if generated[0] != last:
            last, stable_since = generated[0], time.monotonic()
        time.sleep(0.05)
    assert producer.is_alive()

    reader = PartitionReader([location(d, pid, 0)], **FAST_BACKOFF)
    reader.close()  # attached, then gone without reading a record

    producer.join(20)
    assert not producer.is_alive(), "producer waits for credit forever after its consumer left"
    assert isinstance(producer.error, PartitionReleasedError), repr(producer.error)
    d.wait_pool_whole()
