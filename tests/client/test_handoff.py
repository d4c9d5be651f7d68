"""The task thread <-> loop thread hand-offs of the synchronous writer and reader, on a real
daemon: the writer's window (``PartitionWriter.available``) fills under back pressure and
frees once a reader takes the data (the window bounds the batches in flight: queued, or
taken by the loop's sender and not yet pushed), every record arrives, and neither channel
wakes the other thread more than once per batch."""

from __future__ import annotations

import threading
import time
from typing import Any

from client.consumer import PartitionLocation, PartitionReader
from client.producer import PartitionWriter
from exchange.partition.result_partition_id import ResultPartitionID
from tests.kit.polling import wait_for

RECORD = b"x" * 4000  # 64 of them: one shipment of the writer (256 KiB)
SHIPMENT = 64
DEADLINE = 60.0


def test_window_fills_under_back_pressure_frees_once_read_one_wake_up_per_batch(
    start_daemon: Any,
) -> None:
    d = start_daemon("--network-memory", "4m")
    pid = ResultPartitionID("handoff", 0, 0)
    loc = PartitionLocation(pid, 0, d.data_address, d.daemon_id, d.local_socket)
    writer = PartitionWriter(pid, 1, daemon_socket=d.local_socket, buffer_timeout=-1)
    n = 0
    deadline = time.monotonic() + DEADLINE
    fut = writer.available()
    while fut is None:  # nobody reads: the daemon's pool fills, credit stops, the window
        assert time.monotonic() < deadline, "the writer's window never filled"
        writer.emit_all((i, RECORD) for i in range(n, n + SHIPMENT))
        n += SHIPMENT
        fut = writer.available()
    # full: the sender took batches and waits for credit to push them; they stay in the
    # window (held) until pushed: the task may not queue a whole window on top of them
    wait_for(lambda: writer.window_statistics().items_held >= 1, DEADLINE, "sender takes")
    stats = writer.window_statistics()
    assert stats.items_queued + stats.items_held == stats.capacity
    assert not fut.done()

    got: list[Any] = []
    reader = PartitionReader([loc])
    thread = threading.Thread(target=lambda: got.extend(reader.records()))
    thread.start()
    fut.result(DEADLINE)  # the reader took data: credit came back, the sender made room
    writer.emit_all((i, RECORD) for i in range(n, n + 10 * SHIPMENT))
    n += 10 * SHIPMENT
    writer.close()
    thread.join(DEADLINE)
    assert not thread.is_alive()
    assert [r[0] for r in got] == list(range(n)) and all(r[1] == RECORD for r in got)

    w = writer.window_statistics()
    assert not w.sender_open and w.items_sent == w.items_received
    assert w.batches_received <= w.items_sent  # the sender takes what is queued at once
    assert w.wakeups <= w.batches_sent + w.batches_received  # one per batch at most
    hand, back = reader.handoff_statistics()
    assert hand.items_received == hand.items_sent and back.items_sent == back.items_received
    assert hand.wakeups <= hand.batches_sent + hand.batches_received
    assert back.wakeups <= back.batches_sent + 1  # and the close, which wakes it too
    d.wait_stats(lambda s: s["network"]["available_segments"] == s["network"]["total_segments"])
