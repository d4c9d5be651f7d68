"""The producer path a real daemon chooses, seen from outside: with shared memory a
local producer's bytes go through its application's arena, without it (``shared_memory
= off``) over the socket, and the log says why; the same PartitionWriter and
PartitionReader either way, the records read back exactly; ``/metrics`` counts the bytes
by path; every segment and the arena come back."""

from __future__ import annotations

import re
import threading
from typing import Any

import pytest

from client.consumer import PartitionLocation, PartitionReader
from client.producer import PartitionWriter
from exchange.partition.result_partition_id import ResultPartitionID
from tests.kit.polling import wait_for

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


def test_buffers_the_task_and_the_loop_write_into_segments_keep_the_streams_order(
    start_daemon: Any,
) -> None:
    """The task thread writes the buffers it ships into free granted segments; once none
    is free (no reader yet: credit runs out), the buffers it ships wait for the loop
    thread to write them as credit comes, and the task writes again once the loop has
    caught up. Both kinds of buffer interleave in one stream: read back exact, in order,
    with every segment back."""
    d = start_daemon()
    pid = ResultPartitionID("fills", 0, 0)
    total = 20_000  # about 20 MB: far beyond the first grants
    records = [(i, i.to_bytes(4, "big") * 250) for i in range(total)]
    w = PartitionWriter(pid, 1, daemon_socket=d.local_socket)
    writing = threading.Thread(target=w.emit_all, args=(records,), daemon=True)
    writing.start()
    # the task fills what it was granted, then (credit gone, no reader) ships on
    # without segments: it blocks once its window is full
    wait_for(
        lambda: w.segments_filled[0] > 0 and w.window_statistics().senders_waiting > 0,
        60,
        "the task blocked on its full window",
    )
    loc = PartitionLocation(pid, 0, d.data_address, d.daemon_id, d.local_socket)
    got: list[Any] = []

    def read() -> None:
        with PartitionReader([loc]) as reader:
            got.extend(reader.read_all())

    reading = threading.Thread(target=read, daemon=True)
    reading.start()
    writing.join(60)
    assert not writing.is_alive()
    w.close()
    reading.join(60)
    assert not reading.is_alive()
    assert [r[0] for r in got] == list(range(total))
    assert got == records
    by_task, by_loop = w.segments_filled
    assert by_task > 0 and by_loop > 0, (by_task, by_loop)
    assert by_task + by_loop == w.stats.buffers_out
    d.wait_stats(lambda s: s["local"]["shared_arenas"] == 0)
    d.wait_pool_whole()
