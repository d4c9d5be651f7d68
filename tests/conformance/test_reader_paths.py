"""Conformance of the reader paths: one producer's output reads the same through each.

The producer writes exact-typed Python records (``SAMPLES`` of the codec tests: tuples and
lists, sets, datetimes with zones, Decimals, big ints, NaN, user classes, Rows...) and one
record over three segments, into four subpartitions of which one stays empty. Each path
reads every subpartition of that partition:

* ``in-process``: LocalInputChannels on the daemon's partition manager, a RecordReader;
* ``tcp-async`` / ``tcp-sync``: ``AsyncPartitionReader`` / ``PartitionReader`` over the
  daemon's data port;
* ``unix-async`` / ``unix-sync``: the same clients on the same host, which reach the
  daemon over its local Unix socket (the location names the daemon they run beside).

Every path must give each subpartition's records exactly (value and type) and in order,
then one EndOfPartition per subpartition, and leave every pool whole (the reader's, checked
by its close and the autouse fixture; the daemon's, once the partition is gone).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from client.consumer import AsyncPartitionReader, PartitionLocation, PartitionReader
from exchange.consumer import RecordReader, SingleInputGate
from exchange.events import AbstractEvent, EndOfPartitionEvent
from exchange.partition import ResultPartitionID, ResultPartitionType
from server.daemon import ExchangeDaemon
from tests.conformance.conftest import daemon_pool_whole
from tests.kit.local_input_channel import LocalInputChannel
from tests.kit.partition_writer import ResultPartitionWriter
from tests.kit.polling import wait_until
from tests.serialization.test_pickle_batch import SAMPLES, assert_exact

pytestmark = pytest.mark.timeout(60)

N = 4
EMPTY = 2  # no record goes to this subpartition
BACKOFF: dict[str, Any] = {"backoff_initial": 0.01, "backoff_max": 0.05}

Events = list[tuple[int, AbstractEvent]]
ReadResult = tuple[list[Any], Events]
ReaderPath = Callable[[ExchangeDaemon, ResultPartitionID], Awaitable[ReadResult]]


def producer_records(segment_size: int) -> list[tuple[int, Any]]:
    """``(target, record)`` pairs; each record is ``(target, seq, value)``."""
    big = bytes(range(256)) * (3 * segment_size // 256) + b"over three segments"
    targets = [t for t in range(N) if t != EMPTY]
    out: list[tuple[int, Any]] = []
    seq = 0
    for round_ in range(3):
        for value in SAMPLES:
            t = targets[seq % len(targets)]
            out.append((t, (t, seq, value)))
            seq += 1
        if round_ == 1:
            out.append((1, (1, seq, big)))
            seq += 1
    return out


def per_subpartition(records: list[Any]) -> list[list[Any]]:
    out: list[list[Any]] = [[] for _ in range(N)]
    for record in records:
        out[record[0]].append(record)
    return out


async def produce(
    daemon: ExchangeDaemon, pid: ResultPartitionID, ptype: ResultPartitionType
) -> None:
    """The one producer: a ResultPartitionWriter into a partition of the daemon."""
    part = daemon.create_partition(pid, ptype, N)
    writer = ResultPartitionWriter(part, buffer_timeout=-1)
    try:
        for target, record in producer_records(daemon.segment_size):
            await writer.emit_to(record, target)
    except BaseException:
        await writer.fail(None)
        raise
    await writer.close()


# -- the reader paths ----------------------------------------------------------------------


def _recorder() -> tuple[Events, Callable[[AbstractEvent, int], None]]:
    events: Events = []

    def handler(event: AbstractEvent, channel: int) -> None:
        events.append((channel, event))

    return events, handler


async def read_in_process(daemon: ExchangeDaemon, pid: ResultPartitionID) -> ReadResult:
    gate = SingleInputGate("conformance")
    gate.set_input_channels(
        [LocalInputChannel(gate, i, daemon.manager, pid, i, **BACKOFF) for i in range(N)]
    )
    events, handler = _recorder()
    reader = RecordReader(gate, event_handler=handler)
    try:
        await gate.request_partitions()
        records = await reader.read_all()
    finally:
        reader.close()
    return records, events


def _locations(daemon: ExchangeDaemon, pid: ResultPartitionID) -> list[PartitionLocation]:
    return [
        PartitionLocation(pid, i, daemon.data_address, daemon.daemon_id, daemon.local_socket)
        for i in range(N)
    ]


def _async_reader(*, unix: bool) -> ReaderPath:
    async def read(daemon: ExchangeDaemon, pid: ResultPartitionID) -> ReadResult:
        events, handler = _recorder()
        reader = await AsyncPartitionReader.open(
            _locations(daemon, pid),
            local_daemon_id=daemon.daemon_id if unix else None,
            segment_size=daemon.segment_size,
            event_handler=handler,
            **BACKOFF,
        )
        async with reader:
            addresses = {ch.address for ch in reader.gate.channels}  # type: ignore[attr-defined]
            assert all(a.startswith("unix:") == unix for a in addresses), addresses
            return await reader.read_all(), events

    return read


def _sync_reader(*, unix: bool) -> ReaderPath:
    async def read(daemon: ExchangeDaemon, pid: ResultPartitionID) -> ReadResult:
        events, handler = _recorder()
        locations = _locations(daemon, pid)
        local_id = daemon.daemon_id if unix else None

        def run() -> list[Any]:
            with PartitionReader(
                locations,
                local_daemon_id=local_id,
                segment_size=daemon.segment_size,
                event_handler=handler,
                **BACKOFF,
            ) as reader:
                return reader.read_all()

        # blocking calls, and the daemon runs on this loop: read on a worker thread
        return await asyncio.to_thread(run), events

    return read


READER_PATHS: dict[str, ReaderPath] = {
    "in-process": read_in_process,
    "tcp-async": _async_reader(unix=False),
    "tcp-sync": _sync_reader(unix=False),
    "unix-async": _async_reader(unix=True),
    "unix-sync": _sync_reader(unix=True),
}


# -- the suite -----------------------------------------------------------------------------


@pytest.mark.asyncio
@pytest.mark.parametrize(
    "ptype", [ResultPartitionType.PIPELINED, ResultPartitionType.BLOCKING], ids=lambda t: t.value
)
@pytest.mark.parametrize("path", list(READER_PATHS))
async def test_every_reader_path_reads_the_same_records(
    daemon: ExchangeDaemon, path: str, ptype: ResultPartitionType
) -> None:
    pid = ResultPartitionID(f"reader-{path}-{ptype.value}", 0)
    read = READER_PATHS[path]
    if ptype.is_pipelined:  # read while it is written: the pool holds only part of it
        _, (records, events) = await asyncio.gather(produce(daemon, pid, ptype), read(daemon, pid))
    else:
        await produce(daemon, pid, ptype)
        records, events = await read(daemon, pid)

    want = per_subpartition([r for _, r in producer_records(daemon.segment_size)])
    assert want[EMPTY] == [] and all(want[t] for t in range(N) if t != EMPTY)
    got = per_subpartition(records)
    for t in range(N):
        assert len(got[t]) == len(want[t]), f"subpartition {t}"
        assert_exact(got[t], want[t], f"subpartition {t}")
    assert sorted(ch for ch, _ in events) == list(range(N))
    assert all(e == EndOfPartitionEvent.INSTANCE for _, e in events), events

    if ptype.is_blocking:
        assert daemon.release_dataset(pid.dataset_id) == 1
    await wait_until(lambda: daemon_pool_whole(daemon), what="daemon pool whole")
    assert not daemon.manager.partitions


@pytest.mark.asyncio
async def test_a_blocking_partition_reads_the_same_through_every_path_in_turn(
    daemon: ExchangeDaemon,
) -> None:
    """One partition, read again and again: every path gives the same result as the first
    (not only the same as the expectation)."""
    pid = ResultPartitionID("reader-all-paths", 0)
    await produce(daemon, pid, ResultPartitionType.BLOCKING)
    results = {path: await read(daemon, pid) for path, read in READER_PATHS.items()}
    first_records, _ = results["in-process"]
    for path, (records, events) in results.items():
        got, want = per_subpartition(records), per_subpartition(first_records)
        for t in range(N):
            assert_exact(got[t], want[t], f"{path} subpartition {t}")
        assert sorted(ch for ch, _ in events) == list(range(N)), path
    assert daemon.release_dataset(pid.dataset_id) == 1
    await wait_until(lambda: daemon_pool_whole(daemon), what="daemon pool whole")
