"""A daemon restarted on the same spill directory (real processes, real sockets).

* a finished blocking partition whose files are intact is served again, after a SIGKILL
  and after a clean stop (an upgrade), with the same records, any number of times;
* one whose spill file is missing, truncated or corrupt is refused: its readers get a
  PartitionReleasedError (PartitionDataLostError on the daemon) naming the file and what
  is wrong, and the damaged files are deleted;
* a pipelined partition, and a blocking one that was still being written, died with the
  daemon: their readers get a ProducerFailedError at once (not a not-found they would
  retry), a reader streaming when the daemon died gets a TransportError in bounded time,
  and the producer task gets a typed error;
* a damaged manifest and orphan spill files are deleted at startup; a partition older
  than the new daemon's time to live is not served again.

Every restarted daemon stops cleanly with its pool whole (the ``start_daemon`` fixture).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from client.consumer import PartitionLocation, PartitionReader
from client.local_connection import release_dataset
from client.producer import PartitionWriter
from client.runtime import get_runtime
from exchange.errors import (
    ExchangeError,
    PartitionReleasedError,
    ProducerFailedError,
    TransportError,
)
from exchange.partition.partition_manifest import read_manifest
from exchange.partition.result_partition_id import ResultPartitionID

pytestmark = pytest.mark.timeout(120)

Daemon = Any  # tests/daemon/_daemon.py: DaemonProcess
FAST_BACKOFF: dict[str, Any] = {"backoff_initial": 0.01, "backoff_max": 0.04}
#: Where a daemon keeps its partitions under its spill directory (server/spill_dir.py).
PARTS = "partitions"
#: Everything a dead daemon leaves must reach its readers within this many seconds.
FAIL_WITHIN = 10.0


@pytest.fixture
def spill_dir() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="xr-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def daemon_on(spill_dir: Path) -> Iterator[Callable[..., Daemon]]:
    """``daemon_on(*flags)``: a daemon on the test's spill directory (the fixture stops the
    running ones cleanly; the killed ones are reaped)."""
    helpers: Any = __import__("exchange_tests_daemon_helpers")
    started: list[Daemon] = []

    def start(*flags: str) -> Daemon:
        d = helpers.DaemonProcess(*flags, spill_dir=str(spill_dir))
        started.append(d)
        return d

    yield start
    try:
        for d in started:
            if d.running:
                d.stop_clean()
    finally:
        for d in started:
            d.cleanup()


def records(n: int) -> list[tuple[int, bytes]]:
    return [(i, bytes([i % 251]) * 100) for i in range(n)]


def write_blocking(d: Daemon, pid: ResultPartitionID, recs: list[Any], n: int = 2) -> None:
    with PartitionWriter(
        pid, n, blocking=True, daemon_socket=d.local_socket, buffer_timeout=-1
    ) as w:
        w.emit_all(recs, partition_func=lambda k: k % n)


def read(d: Daemon, pid: ResultPartitionID, sub: int) -> list[Any]:
    loc = PartitionLocation(pid, sub, d.data_address, d.daemon_id, None)
    with PartitionReader([loc], **FAST_BACKOFF) as reader:
        return list(reader)


def read_error(d: Daemon, pid: ResultPartitionID, sub: int = 0) -> tuple[ExchangeError, float]:
    t0 = time.monotonic()
    with pytest.raises(ExchangeError) as info:
        read(d, pid, sub)
    return info.value, time.monotonic() - t0


def expected(recs: list[tuple[int, bytes]], sub: int, n: int = 2) -> list[tuple[int, bytes]]:
    return [r for r in recs if r[0] % n == sub]


def spill_files(spill: Path) -> list[str]:
    return sorted(p.name for p in spill.iterdir() if p.suffix in (".bin", ".manifest"))


@pytest.mark.parametrize("how", ["sigkill", "sigterm"])
def test_finished_blocking_partition_served_again(
    daemon_on: Callable[..., Daemon], spill_dir: Path, how: str
) -> None:
    d1 = daemon_on()
    pid = ResultPartitionID("restart-ok", 0, 7)
    recs = records(5000)
    write_blocking(d1, pid, recs)
    assert read(d1, pid, 1) == expected(recs, 1)  # read once before the restart, too
    if how == "sigkill":
        d1.kill()
    else:
        d1.stop_clean()  # a clean stop keeps finished blocking partitions for the next one
    assert len([n for n in spill_files(spill_dir / PARTS) if n.endswith(".bin")]) == 2

    d2 = daemon_on()
    assert d2.info["recovered"] == {"restored": 1, "refused": 0, "failed": 0, "expired": 0}
    for _ in range(2):  # read twice: the same records each time
        for sub in (0, 1):
            assert read(d2, pid, sub) == expected(recs, sub)
    assert get_runtime().run(release_dataset(d2.local_socket, "restart-ok")) == 1
    assert spill_files(spill_dir / PARTS) == []  # released: manifest and files gone
    d2.wait_pool_whole()


@pytest.mark.parametrize(("written", "restarted"), [("file", "mmap"), ("mmap", "file")])
def test_a_restored_partition_keeps_the_storage_it_was_written_with(
    daemon_on: Callable[..., Daemon], spill_dir: Path, written: str, restarted: str
) -> None:
    d1 = daemon_on(f"--blocking-shuffle-type={written}")
    pid = ResultPartitionID("restart-kind", 0, 1)
    recs = records(3000)
    write_blocking(d1, pid, recs)
    d1.stop_clean()
    (manifest,) = (spill_dir / PARTS).glob("restart-kind-*.manifest")
    assert read_manifest(manifest).bounded_data_kind == written

    d2 = daemon_on(f"--blocking-shuffle-type={restarted}")
    assert d2.info["recovered"]["restored"] == 1
    for sub in (0, 1):
        assert read(d2, pid, sub) == expected(recs, sub)
    # mmap storage maps its files (until released); file storage never does
    with open(f"/proc/{d2.proc.pid}/maps") as f:
        mapped = {line.split()[-1] for line in f if line.rstrip().endswith(".bin")}
    assert len(mapped) == (2 if written == "mmap" else 0), mapped
    assert get_runtime().run(release_dataset(d2.local_socket, "restart-kind")) == 1
    assert spill_files(spill_dir / PARTS) == []
    d2.wait_pool_whole()


def _truncate(path: Path) -> None:
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size // 2)


def _flip_a_byte(path: Path) -> None:
    with open(path, "r+b") as f:
        f.seek(path.stat().st_size // 2)
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 0xFF]))


@pytest.mark.parametrize(
    ("damage", "words"),
    [(Path.unlink, "missing"), (_truncate, "truncated"), (_flip_a_byte, "corrupt")],
    ids=["missing", "truncated", "corrupt"],
)
def test_damaged_blocking_partition_refused(
    daemon_on: Callable[..., Daemon],
    spill_dir: Path,
    damage: Callable[[Path], None],
    words: str,
) -> None:
    d1 = daemon_on()
    bad, good = ResultPartitionID("restart-bad", 0, 1), ResultPartitionID("restart-good", 0, 1)
    recs = records(3000)
    write_blocking(d1, bad, recs)
    write_blocking(d1, good, recs)
    d1.kill()
    victim = sorted((spill_dir / PARTS).glob("restart-bad-*.1.bin"))
    assert len(victim) == 1
    damage(victim[0])

    d2 = daemon_on()
    assert d2.info["recovered"]["restored"] == 1
    assert d2.info["recovered"]["refused"] == 1
    for sub in (0, 1):  # the whole partition is refused, not only the damaged file
        err, took = read_error(d2, bad, sub)
        assert isinstance(err, PartitionReleasedError), repr(err)
        assert words in str(err) and victim[0].name in str(err), str(err)
        assert took < FAIL_WITHIN
    assert not list((spill_dir / PARTS).glob("restart-bad-*"))  # the damaged partition is deleted
    assert read(d2, good, 0) == expected(recs, 0)  # its neighbour is untouched


class _Streaming(threading.Thread):
    """Reads a pipelined subpartition until its end or an error."""

    def __init__(self, loc: PartitionLocation) -> None:
        super().__init__(name="reader", daemon=True)
        self.loc = loc
        self.count = 0
        self.started_reading = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            with PartitionReader([self.loc], **FAST_BACKOFF) as reader:
                for _ in reader:
                    self.count += 1
                    self.started_reading.set()
        except BaseException as e:
            self.error = e
        finally:
            self.started_reading.set()


def test_partitions_of_the_dead_daemon_fail_their_readers(
    daemon_on: Callable[..., Daemon], spill_dir: Path
) -> None:
    helpers: Any = __import__("exchange_tests_daemon_helpers")
    d1 = daemon_on()
    # a pipelined partition streaming to a reader, from a producer task of its own
    producer = helpers.ChildProducer(d1.local_socket, "restart-pipe", 0, 1)
    try:
        producer.wait_writing()
        pipe = ResultPartitionID("restart-pipe", 0, 0)
        reader = _Streaming(PartitionLocation(pipe, 0, d1.data_address, d1.daemon_id, None))
        reader.start()
        assert reader.started_reading.wait(FAIL_WITHIN)
        # a blocking partition still being written
        unfinished = ResultPartitionID("restart-unfinished", 0, 0)
        writer = PartitionWriter(
            unfinished, 1, blocking=True, daemon_socket=d1.local_socket, buffer_timeout=0
        )
        writer.emit_to((1, b"x"), 0)
        writer.flush()
        d1.wait_stats(lambda s: s["partitions"]["count"] == 2)

        t_kill = time.monotonic()
        d1.kill()
        reader.join(FAIL_WITHIN)
        assert not reader.is_alive(), "the reader hangs after its daemon died"
        assert isinstance(reader.error, TransportError), repr(reader.error)
        assert reader.count > 0
        # the producer task hears of it too (typed), and exits
        assert producer.proc.wait(FAIL_WITHIN) != 0
        assert "exchange.errors.TransportError: connection to daemon" in "".join(producer._err.all)
        with pytest.raises(ExchangeError):
            writer.emit_all((i, b"y") for i in range(100_000))
        with pytest.raises(ExchangeError):
            writer.close()
        assert time.monotonic() - t_kill < 2 * FAIL_WITHIN
    finally:
        producer.cleanup()

    d2 = daemon_on()
    assert d2.info["recovered"] == {"restored": 0, "refused": 0, "failed": 2, "expired": 0}
    for pid in (pipe, unfinished):
        err, took = read_error(d2, pid)
        assert isinstance(err, ProducerFailedError), repr(err)
        assert "died with its exchange daemon" in str(err)
        assert took < FAIL_WITHIN  # at once, not after retrying a not-found
    assert spill_files(spill_dir / PARTS) == []


def test_damaged_manifest_and_orphans_deleted_at_startup(
    daemon_on: Callable[..., Daemon], spill_dir: Path
) -> None:
    d1 = daemon_on()
    pid = ResultPartitionID("restart-manifest", 0, 0)  # its id becomes unreadable
    write_blocking(d1, pid, records(100))
    d1.kill()
    (manifest,) = (spill_dir / PARTS).glob("*.manifest")
    manifest.write_bytes(manifest.read_bytes().replace(b"restart", b"rEstart"))
    orphan = spill_dir / PARTS / "lost-3-0-0123abcd.0.bin"
    orphan.write_bytes(b"left by a crash between manifest and file deletion")
    (spill_dir / PARTS / "x.manifest.tmp").write_bytes(b"{half")

    d2 = daemon_on()
    assert d2.info["recovered"]["refused"] == 1
    assert spill_files(spill_dir / PARTS) == []
    assert not (spill_dir / PARTS / "x.manifest.tmp").exists()


def test_expired_blocking_partition_not_served_again(
    daemon_on: Callable[..., Daemon], spill_dir: Path
) -> None:
    d1 = daemon_on("--blocking-partition-ttl", "0")  # the first daemon keeps it forever
    pid = ResultPartitionID("restart-old", 0, 0)
    write_blocking(d1, pid, records(100))
    d1.stop_clean()
    # starting a daemon takes far longer than 10 ms: the partition is older than its TTL
    d2 = daemon_on("--blocking-partition-ttl", "10ms")
    assert d2.info["recovered"]["expired"] == 1
    err, _ = read_error(d2, pid)
    assert isinstance(err, PartitionReleasedError) and "time to live" in str(err), str(err)
    assert spill_files(spill_dir / PARTS) == []


def test_restored_with_less_network_memory(
    daemon_on: Callable[..., Daemon], spill_dir: Path
) -> None:
    """A finished blocking partition holds no segment: a daemon restarted with fewer
    segments than it has subpartitions still serves it."""
    d1 = daemon_on()
    pid = ResultPartitionID("restart-small", 0, 0)
    recs = records(2000)
    write_blocking(d1, pid, recs, n=40)
    d1.kill()
    d2 = daemon_on("--network-memory", "512kb")  # 16 segments < 40 subpartitions
    assert d2.info["recovered"]["restored"] == 1
    for sub in (0, 39):
        assert read(d2, pid, sub) == expected(recs, sub, n=40)
