"""Client readers and writers failing under a real daemon leave nothing behind.

* A reader one of whose channels fails (a subpartition index out of range, a partition
  that never appears) while its other channels stream: the error reaches the task
  mid-stream (the synchronous reader's: ahead of the buffers queued in its hand-off), the
  records before it are each partition's first, and ``close()`` finds every segment back
  in the reader's pool,
  whatever the order in which the failure meets the buffers on their way to the task
  (the scenario is repeated: that order is decided by the network).
* A writer whose daemon dies: its flush timer ends with the connection, so no task is
  left pending (a producer process exits without "Task was destroyed but it is pending").
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

from client.consumer import AsyncPartitionReader, PartitionLocation, PartitionReader
from client.producer import PartitionWriter
from client.runtime import get_runtime
from exchange.errors import (
    ExchangeError,
    PartitionError,
    PartitionNotFoundError,
    WriterClosedError,
)
from exchange.partition.result_partition_id import ResultPartitionID

pytestmark = pytest.mark.timeout(120)

Daemon = Any  # tests/daemon/_daemon.py: DaemonProcess
RECORDS = 100_000  # per partition: about 20 MB, read for longer than the failure takes
PAD = b"x" * 200
#: Fast retries.
FAST_BACKOFF = {"backoff_initial": 0.01, "backoff_max": 0.04}
#: Floating buffers per gate: Flink's 8, and the batch readers' 32. The blocking partitions'
#: buffers are compressed (their padding): 36 buffers hold nearly all 200k records, so with
#: 32 the whole stream sat in the reader's hand-off when the error came, and before the
#: error overtook what the hand-off holds the task saw it only after every record.
WINDOWS = [8, 32]
#: Reads per case; before the fix about half of them leaked a segment.
REPEATS = 16


def location(d: Daemon, pid: ResultPartitionID, sub: int = 0) -> PartitionLocation:
    return PartitionLocation(pid, sub, d.data_address, d.daemon_id, d.local_socket)


@pytest.fixture(scope="module")
def big(request: pytest.FixtureRequest) -> Any:
    """One daemon holding two large finished blocking partitions: ``(daemon, [pid, pid])``
    whose records are ``(partition index, seq, pad)``."""
    from exchange_tests_daemon_helpers import started_daemons  # loaded by conftest

    for start in started_daemons():
        d = start()
        pids = [ResultPartitionID("big", i, 0) for i in range(2)]
        for pid in pids:
            with PartitionWriter(
                pid, 1, blocking=True, daemon_socket=d.local_socket, buffer_timeout=-1
            ) as w:
                w.emit_all(((pid.partition_index, i, PAD) for i in range(RECORDS)), lambda k: 0)
        yield d, pids


def check_prefixes(records: list[Any]) -> None:
    """What was read before the failure is each partition's first records, in order."""
    seen = [0, 0]
    for p, seq, pad in records:
        assert seq == seen[p] and pad == PAD
        seen[p] += 1


BAD_LOCATIONS: dict[str, tuple[Callable[[Daemon, list[ResultPartitionID]], Any], type]] = {
    # refused at once, often before the first buffers of the others arrive
    "subpartition-out-of-range": (lambda d, pids: location(d, pids[0], 5), PartitionError),
    # refused after the request backoff, while the others stream
    "unknown-partition": (
        lambda d, pids: location(d, ResultPartitionID("never-written", 0, 0)),
        PartitionNotFoundError,
    ),
}


@pytest.mark.parametrize("floating", WINDOWS)
@pytest.mark.parametrize("bad", BAD_LOCATIONS)
def test_a_failing_channel_leaves_the_reader_whole(big: Any, bad: str, floating: int) -> None:
    d, pids = big
    make_bad, error = BAD_LOCATIONS[bad]
    for _ in range(REPEATS):
        reader = PartitionReader(
            [location(d, pids[0]), location(d, pids[1]), make_bad(d, pids)],
            **FAST_BACKOFF,
            num_floating=floating,
        )
        records: list[Any] = []
        with pytest.raises(error):
            for n, r in enumerate(reader, 1):
                records.append(r)
                if n % 1000 == 0:
                    time.sleep(0.002)  # a task slower than the network: buffers queue up
        reader.close()  # closed already: raised "pool is not whole" when a segment leaked
        check_prefixes(records)
        assert len(records) < 2 * RECORDS
    d.wait_stats(lambda s: s["data_port"]["readers"] == 0)
    d.wait_pool_whole()


@pytest.mark.parametrize("floating", WINDOWS)
@pytest.mark.parametrize("bad", BAD_LOCATIONS)
def test_a_failing_channel_leaves_the_async_reader_whole(big: Any, bad: str, floating: int) -> None:
    d, pids = big
    make_bad, error = BAD_LOCATIONS[bad]

    async def read() -> list[Any]:
        reader = await AsyncPartitionReader.open(
            [location(d, pids[0]), location(d, pids[1]), make_bad(d, pids)],
            **FAST_BACKOFF,
            num_floating=floating,
        )
        records: list[Any] = []
        try:
            while (batch := await reader.next_batch()) is not None:
                records.extend(batch)
                await asyncio.sleep(0.001)
        finally:
            await reader.close()  # raises if a segment is not back
        return records

    for _ in range(REPEATS // 2):
        with pytest.raises(error):
            get_runtime().run(read())
    d.wait_stats(lambda s: s["data_port"]["readers"] == 0)
    d.wait_pool_whole()


# -- writers -----------------------------------------------------------------------------


def flush_timers(writer: PartitionWriter) -> list[asyncio.Task[Any]]:
    """The runtime's tasks running ``writer``'s flush timer (not done)."""

    async def find() -> list[asyncio.Task[Any]]:
        out = []
        for task in asyncio.all_tasks():
            coro: Any = task.get_coro()
            frame = getattr(coro, "cr_frame", None)
            if (
                not task.done()
                and getattr(coro, "__qualname__", "") == "PartitionWriter._flush_timer"
                and frame is not None
                and frame.f_locals.get("self") is writer
            ):
                out.append(task)
        return out

    return get_runtime().run(find())


def test_writer_that_loses_its_daemon_leaves_no_flush_timer(start_daemon: Any) -> None:
    """The task hears of the lost daemon at an emit: by then the timer has ended."""
    d = start_daemon()
    w = PartitionWriter(
        ResultPartitionID("lost", 0, 0), 2, daemon_socket=d.local_socket, buffer_timeout=0.01
    )
    w.emit_all([(i, PAD) for i in range(1000)], lambda k: k % 2)
    assert flush_timers(w)
    d.kill()
    deadline = time.monotonic() + 30
    with pytest.raises(ExchangeError):
        while True:
            assert time.monotonic() < deadline, "the writer never noticed its daemon died"
            w.emit_all([(i, PAD) for i in range(100)], lambda k: k % 2)
    assert flush_timers(w) == []
    w.fail("daemon gone")


def test_idle_writer_that_loses_its_daemon_ends_its_flush_timer(start_daemon: Any) -> None:
    """No emit after the daemon died: the lost connection ends the timer by itself."""
    d = start_daemon()
    w = PartitionWriter(
        ResultPartitionID("idle", 0, 0), 1, daemon_socket=d.local_socket, buffer_timeout=0.01
    )
    w.emit_to((0, PAD), 0)
    assert flush_timers(w)
    d.kill()
    deadline = time.monotonic() + 30
    while flush_timers(w):
        assert time.monotonic() < deadline, "the flush timer outlived the connection"
        time.sleep(0.01)
    w.fail("daemon gone")


def test_producer_process_that_loses_its_daemon_exits_without_pending_tasks(
    start_daemon: Any, start_producer: Any
) -> None:
    d = start_daemon()
    p = start_producer(d.local_socket, "orphan", 0, 2)
    p.wait_writing()
    d.wait_stats(lambda s: s["partitions"]["count"] == 1)
    d.kill()
    assert p.proc.wait(30) == 1  # emit_all raised the lost connection's error
    p.sigkill()  # reaps it and reads its output to the end
    err = p.stderr
    assert "TransportError" in err, err
    assert "Task was destroyed" not in err, err


def test_a_writer_blocked_on_credit_is_cancelled_from_another_thread(start_daemon: Any) -> None:
    """Nobody reads the partition: the writer's thread waits for credit that never comes.
    ``cancel`` from another thread ends that wait with WriterClosedError, the daemon fails
    the partition with the reason, and every segment goes back. (A pipelined exchange task
    that leaves its input early cancels its writer so: before, it joined a writer blocked
    on a consumer that had given up before ever asking for that partition, forever.)"""
    d = start_daemon("--network-memory", "4m")
    pid = ResultPartitionID("cancelled", 0, 0)
    w = PartitionWriter(pid, 2, daemon_socket=d.local_socket)
    failure: list[BaseException] = []

    def write() -> None:
        try:
            w.emit_all(((i, PAD * 50) for i in range(1_000_000)), lambda k: k % 2)
            w.close()
        except BaseException as e:
            failure.append(e)
            w.fail(e)

    writer = threading.Thread(target=write)
    writer.start()
    # its partition's pool full, nobody reading: the writer waits for credit
    d.wait_stats(
        lambda s: (
            bool(s["partitions"]["items"]) and s["partitions"]["items"][0]["out_pool_usage"] == 1
        )
    )
    assert writer.is_alive() and not failure
    w.cancel("its consumer left early")
    writer.join(30)
    assert not writer.is_alive(), "cancel did not end the writer's wait for credit"
    assert len(failure) == 1 and isinstance(failure[0], WriterClosedError), failure
    assert "its consumer left early" in str(failure[0])
    d.wait_stats(
        lambda s: (
            s["totals"]["partitions_failed"] == 1
            and s["network"]["available_segments"] == s["network"]["total_segments"]
        )
    )
