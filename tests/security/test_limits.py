"""Limits per application, with real daemons (the per-connection limit on open requests
is tested sans-I/O in tests/network/test_server_connection.py).

Whoever exceeds a limit gets a ``LimitExceededError`` naming it; everyone else goes on
(another application), and nothing is left behind.
"""

from __future__ import annotations

from typing import Any

import pytest

from client.consumer import PartitionLocation, PartitionReader
from client.local_connection import release_dataset
from client.producer import PartitionWriter
from client.runtime import get_runtime
from exchange.errors import LimitExceededError
from exchange.partition.result_partition_id import ResultPartitionID
from exchange.protocol.handshake import format_app_credential

pytestmark = pytest.mark.timeout(120)

Daemon = Any
SECRET = b"the-daemons-secret"
FAST: dict[str, Any] = {"backoff_initial": 0.01, "backoff_max": 0.04}
RECORDS = [(i, b"r" * 64) for i in range(200)]
A = format_app_credential(SECRET, "app-a")
B = format_app_credential(SECRET, "app-b")


def write(
    d: Daemon, pid: ResultPartitionID, secret: bytes | None = None, recs: list[Any] = RECORDS
) -> None:
    with PartitionWriter(
        pid, 1, blocking=True, daemon_socket=d.local_socket, secret=secret, buffer_timeout=-1
    ) as w:
        w.emit_all(recs, partition_func=lambda k: 0)


def read(d: Daemon, pids: list[ResultPartitionID], secret: bytes | None = None) -> list[Any]:
    locs = [PartitionLocation(pid, 0, d.data_address, d.daemon_id, None) for pid in pids]
    with PartitionReader(locs, secret=secret, **FAST) as reader:
        return list(reader)


def release(d: Daemon, dataset: str, secret: bytes | None = None) -> int:
    return get_runtime().run(release_dataset(d.local_socket, dataset, secret=secret))  # type: ignore[no-any-return]


def test_partitions_per_application(start_daemon: Any, secret_file: str) -> None:
    d = start_daemon("--secret-file", secret_file, "--max-partitions-per-app=2")
    for i in range(2):
        write(d, ResultPartitionID("a", i, 0), A)
    before = d.wait_stats(lambda s: s["local"]["producers"] == 0)["network"]
    with pytest.raises(LimitExceededError, match="max_partitions_per_app"):
        write(d, ResultPartitionID("a", 2, 0), A)
    after = d.wait_stats(lambda s: s["local"]["producers"] == 0)["network"]
    assert after["local_pools"] == before["local_pools"]  # the refusal left no pool behind
    assert after["available_segments"] == before["available_segments"]
    for i in range(2):  # another application is not concerned
        write(d, ResultPartitionID("b", i, 0), B)
    d.wait_stats(lambda s: s["partitions"]["count"] == 4)
    assert read(d, [ResultPartitionID("a", 1, 0)], A) == RECORDS
    assert release(d, "a", A) == 2
    write(d, ResultPartitionID("a", 2, 0), A)  # room again
    assert release(d, "a", A) == 1 and release(d, "b", B) == 2


def test_pinned_segments_per_application(start_daemon: Any, secret_file: str) -> None:
    # a one-subpartition partition's pool may pin 16 segments: two fit in 40, three do not
    d = start_daemon("--secret-file", secret_file, "--max-pinned-segments-per-app=40")

    def open_writer(pid: ResultPartitionID, secret: bytes) -> PartitionWriter:
        return PartitionWriter(pid, 1, blocking=True, daemon_socket=d.local_socket, secret=secret)

    w0 = open_writer(ResultPartitionID("a", 0, 0), A)
    w1 = open_writer(ResultPartitionID("a", 1, 0), A)
    with pytest.raises(LimitExceededError, match="max_pinned_segments_per_app"):
        write(d, ResultPartitionID("a", 2, 0), A)
    write(d, ResultPartitionID("b", 0, 0), B)  # another application is not concerned
    write(d, ResultPartitionID("b", 1, 0), B)
    w0.emit_all(RECORDS, partition_func=lambda k: 0)
    w0.close()  # a finished blocking partition gave its pool back: it pins nothing
    write(d, ResultPartitionID("a", 2, 0), A)
    w1.close()
    assert read(d, [ResultPartitionID("a", 0, 0)], A) == RECORDS
    assert read(d, [ResultPartitionID("b", 1, 0)], B) == RECORDS
    assert release(d, "a", A) == 3 and release(d, "b", B) == 2
    d.wait_stats(lambda s: s["partitions"]["count"] == 0 and s["network"]["local_pools"] == 0)


def test_by_default_one_application_cannot_starve_another(
    start_daemon: Any, secret_file: str
) -> None:
    # default limits (64 MiB = 2048 segments): a pipelined partition of 2048 subpartitions
    # took every segment; now the width is capped, and one application's pools may claim
    # 1.5 x the pool in maxima: a second 1000-wide partition of A is refused, B's fits
    d = start_daemon("--secret-file", secret_file)

    def open_writer(pid: ResultPartitionID, n: int, secret: bytes) -> PartitionWriter:
        return PartitionWriter(pid, n, daemon_socket=d.local_socket, secret=secret)

    with pytest.raises(LimitExceededError, match="max_subpartitions_per_partition=1024"):
        open_writer(ResultPartitionID("a", 0, 0), 2048, A)
    a0 = open_writer(ResultPartitionID("a", 1, 0), 1000, A)
    with pytest.raises(LimitExceededError, match="max_pinned_segments_per_app=3072"):
        open_writer(ResultPartitionID("a", 2, 0), 1000, A)
    b0 = open_writer(ResultPartitionID("b", 0, 0), 1000, B)  # 1000 more required segments
    st = d.stats()["network"]
    assert st["required_segments"] == 2000 and st["local_pools"] == 2
    a0.fail(RuntimeError("done"))
    b0.fail(RuntimeError("done"))
    d.wait_stats(lambda s: s["partitions"]["count"] == 0 and s["network"]["local_pools"] == 0)
