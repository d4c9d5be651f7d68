"""``PartitionWriter(overdraft=)`` through a real daemon: nobody reads the partition, so
the daemon's credit runs out and the writer's window stays full. With an overdraft an
emit that ships nothing never waits, also when batches shipped beyond the window (an
event, the flush timer) fill it past its bound: the task finishes its step and waits for
``available()`` between steps (a streaming task's mailbox). An emit that ships waits once
more than ``window + overdraft`` batches are in flight. Without an overdraft (the
default) an emit waits whenever the window is over its bound."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest

from client.producer import PartitionWriter
from exchange.errors import ExchangeError
from exchange.partition.result_partition_id import ResultPartitionID
from tests.kit.polling import wait_for

pytestmark = pytest.mark.timeout(120)


def record(i: int) -> tuple[int, bytes]:
    """3 kB, a new object each (pickle would memoize one object emitted twice)."""
    return (i, b"r" * 2996 + i.to_bytes(4, "big"))


def _emit_in_thread(w: PartitionWriter, count: int) -> tuple[threading.Thread, list[Any]]:
    """``count`` emits on a thread of their own; what ends them goes to the list."""
    out: list[Any] = []

    def body() -> None:
        try:
            for i in range(count):
                w.emit(record(i))
            out.append("done")
        except ExchangeError as e:  # the writer failed under it (the test's cleanup)
            out.append(e)

    t = threading.Thread(target=body, name="emitter", daemon=True)
    t.start()
    return t, out


def test_an_emit_that_ships_nothing_does_not_wait_for_an_overfull_window(
    start_daemon: Callable[..., Any],
) -> None:
    d = start_daemon("--segment-size", "4kb")
    pid = ResultPartitionID("overdraft", 0, 0)
    # no buffer timeout: a batch ships when 256 KiB are cut (87 records), never by a timer
    w = PartitionWriter(
        pid, 1, daemon_socket=d.local_socket, buffer_timeout=-1, window=1, overdraft=1
    )
    emitter: threading.Thread | None = None
    try:
        while w.available() is None:  # until a batch waits for credit that never comes
            w.emit(record(0))
        # an event ships beyond the window (events are not back-pressured): 2 of 1 now
        w.broadcast_barrier(1, 1)
        assert w.window_statistics().items_queued + w.window_statistics().items_held == 2
        # emits that only fill the current buffer return at once
        emitter, out = _emit_in_thread(w, 10)
        emitter.join(60)
        assert out == ["done"]
        # the emit that ships a third batch waits (window 1 + overdraft 1 exceeded); the
        # waiters are it and the room notification available() armed
        emitter, out = _emit_in_thread(w, 200)
        wait_for(lambda: w.window_statistics().senders_waiting == 2, 60, "an emit waiting for room")
        assert emitter.is_alive() and out == []
    finally:
        w.fail("test over")
        if emitter is not None:
            emitter.join(60)
            assert not emitter.is_alive()
    d.wait_pool_whole()
