"""The consumer side of the shared-memory local path, on a real daemon: a reader on the
daemon's own host reads its application's arena in place (descriptors over the Unix
socket, segments given back by index), the daemon counts the bytes by path, a reader that
dies holding segments gives them back by dying, and a reader maps only the arena of its
own application."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import threading
from typing import Any

import pytest

from client.consumer import AsyncPartitionReader, PartitionLocation, PartitionReader
from client.producer import PartitionWriter
from exchange.partition.result_partition_id import ResultPartitionID
from tests.daemon._daemon import READY_TIMEOUT, child_env

pytestmark = pytest.mark.timeout(180)

RECORDS = [(i, f"value-{i}" * 3) for i in range(30_000)]


def consumer_bytes(d: Any) -> dict[str, float]:
    text = d.http_get("/metrics").decode()
    found = re.findall(r'^exchange_consumer_bytes_total\{path="(\w+)"\} (\S+)$', text, re.M)
    return {path: float(v) for path, v in found}


def location(d: Any, pid: ResultPartitionID, sub: int) -> PartitionLocation:
    return PartitionLocation(pid, sub, d.data_address, d.daemon_id, d.local_socket)


def exchange(
    d: Any, pid: ResultPartitionID, n: int, records: list[Any], *, local: bool = True
) -> list[Any]:
    """Write ``records`` to a pipelined partition of ``n`` subpartitions of ``d`` while a
    reader per subpartition (opened once the partition, and so its application's arena,
    exists) reads it; everything read."""
    got: list[list[Any]] = [[] for _ in range(n)]
    with PartitionWriter(pid, n, blocking=False, daemon_socket=d.local_socket) as w:
        readers = [
            PartitionReader(
                [location(d, pid, sub)], local_daemon_id=d.daemon_id if local else None
            )
            for sub in range(n)
        ]
        threads = [
            threading.Thread(target=lambda r=r, out=out: out.extend(r.read_all()))
            for r, out in zip(readers, got, strict=True)
        ]
        for t in threads:
            t.start()
        w.emit_all(records)
    for t, r in zip(threads, readers, strict=True):
        t.join(120)
        r.close()
    return [rec for part in got for rec in part]


def test_a_local_reader_reads_the_arena_in_place_and_the_metrics_say_so(start_daemon: Any) -> None:
    d = start_daemon()
    pid = ResultPartitionID("in-place", 0, 0)
    assert sorted(exchange(d, pid, 2, RECORDS)) == RECORDS
    data = d.stats()["local"]["bytes_shared_memory"]  # data buffers committed in the arena
    assert data == d.stats()["local"]["bytes_received"] > 0
    local = d.wait_stats(lambda s: s["local"]["connections"] == 0)["local"]
    # every data buffer went as a descriptor; only events crossed the socket
    assert local["consumer_bytes_shared_memory"] == data
    assert 0 < local["consumer_bytes_socket"] < 1024
    assert local["consumer_segments_held"] == 0
    by_path = consumer_bytes(d)
    assert by_path["shared_memory"] == data
    assert by_path["socket"] == local["consumer_bytes_socket"]
    d.wait_stats(lambda s: s["local"]["shared_arenas"] == 0)  # the arena went once whole
    d.wait_pool_whole()
    d.stop_clean()


def test_a_reader_over_tcp_and_a_daemon_without_shared_memory_use_the_socket(
    start_daemon: Any,
) -> None:
    d = start_daemon()
    pid = ResultPartitionID("tcp", 0, 0)
    assert sorted(exchange(d, pid, 1, RECORDS, local=False)) == RECORDS  # the data port
    assert d.stats()["local"]["consumer_bytes_shared_memory"] == 0
    d.stop_clean()

    off = start_daemon("--no-shared-memory", "--log-level", "INFO")
    assert sorted(exchange(off, pid, 1, RECORDS)) == RECORDS
    local = off.stats()["local"]
    assert local["consumer_bytes_shared_memory"] == 0
    assert local["consumer_bytes_socket"] > local["bytes_received"]
    off.stop_clean()
    assert "reads over the socket for now: shared_memory = off" in off.stderr
