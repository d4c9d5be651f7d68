"""The producer path a real daemon chooses, seen from outside: with shared memory a
local producer's bytes go through its application's arena, without it (``shared_memory
= off``) over the socket, and the log says why; the same PartitionWriter and
PartitionReader either way, the records read back exactly; ``/metrics`` counts the bytes
by path; every segment and the arena come back."""

from __future__ import annotations

import re
from typing import Any

import pytest

from client.consumer import PartitionLocation, PartitionReader
from client.producer import PartitionWriter
from exchange.partition.result_partition_id import ResultPartitionID

pytestmark = pytest.mark.timeout(120)

RECORDS = [(i, f"value-{i}" * 3) for i in range(30_000)]


def bytes_by_path(d: Any, who: str = "producer") -> dict[str, float]:
    """``exchange_{who}_bytes_total`` of ``d``'s /metrics, by path."""
    text = d.http_get("/metrics").decode()
    found = re.findall(rf'^exchange_{who}_bytes_total\{{path="(\w+)"\}} (\S+)$', text, re.M)
    return {path: float(v) for path, v in found}


@pytest.mark.parametrize("shared", [True, False], ids=["shared-memory", "socket"])
def test_the_daemon_chooses_the_path_and_metrics_show_it(start_daemon: Any, shared: bool) -> None:
    d = start_daemon() if shared else start_daemon("--no-shared-memory", "--log-level", "INFO")
    pid = ResultPartitionID("path", 0, 0)
    with PartitionWriter(pid, 2, blocking=True, daemon_socket=d.local_socket) as w:
        w.emit_all(RECORDS)
    got: list[Any] = []
    for sub in (0, 1):
        loc = PartitionLocation(pid, sub, d.data_address, d.daemon_id, d.local_socket)
        with PartitionReader([loc]) as reader:
            got.extend(reader.read_all())
    assert sorted(got) == RECORDS
    by_path = bytes_by_path(d)
    written = d.stats()["local"]["bytes_received"]
    assert written > 0
    assert by_path == (
        {"shared_memory": written, "socket": 0.0}
        if shared
        else {"shared_memory": 0.0, "socket": written}
    )
    d.wait_stats(lambda s: s["local"]["shared_arenas"] == 0)  # finished: its pool went back
    d.wait_pool_whole()
    d.stop_clean()
    if not shared:
        assert "shared memory off (shared_memory = off)" in d.stderr
