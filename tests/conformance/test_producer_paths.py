"""Conformance of the producer paths: the same writes give the same subpartitions.

Every producer path writes one pipelined partition on the daemon with the same calls:

* ``sync``: ``client.producer.PartitionWriter``, the facade PySpark tasks use (on a worker
  thread: it blocks, and the daemon runs on this loop), over the daemon's Unix socket;
* ``async``: ``client.producer.AsyncPartitionWriter`` over the same socket;
* ``in-process``: ``tests.kit.partition_writer.ResultPartitionWriter`` into the daemon's partition.

Scenarios: routing by key hash, round robin, broadcast mixed with keyed records, and a
flush timeout (records must become readable with no flush and no close). Each subpartition
is read in process while it is written; every path must give exactly the records the
routing sends there (value and type), in order, whatever the path.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest

from client.producer import AsyncPartitionWriter, PartitionWriter
from exchange.consumer import RecordReader, SingleInputGate
from exchange.events import AbstractEvent, EndOfPartitionEvent
from exchange.partition import ResultPartitionID, ResultPartitionType
from exchange.writer import ChannelSelector, RoundRobinSelector
from exchange.writer.hashing import deterministic_hash
from server.daemon import ExchangeDaemon
from tests.conformance.conftest import daemon_pool_whole
from tests.kit.local_input_channel import LocalInputChannel
from tests.kit.partition_writer import ResultPartitionWriter
from tests.kit.polling import wait_until
from tests.serialization.test_pickle_batch import SAMPLES, assert_exact

pytestmark = pytest.mark.timeout(60)

N = 3
WAIT_TIMEOUT = 10.0

# -- scenarios: the same calls for every path ------------------------------------------------


@dataclass(frozen=True)
class Emit:
    record: Any
    key: Any = None  # None: the selector (or the default routing) decides


@dataclass(frozen=True)
class Broadcast:
    record: Any


@dataclass(frozen=True)
class WaitRead:
    """Wait until the readers have this many records in all (no flush, no close)."""

    count: int


Op = Emit | Broadcast | WaitRead


@dataclass(frozen=True)
class Scenario:
    ops: list[Op]
    expected: list[list[Any]]  # per subpartition
    selector: Callable[[], ChannelSelector | None] = lambda: None
    buffer_timeout: float = -1


def _values(segment_size: int) -> list[Any]:
    big = bytes(range(256)) * (2 * segment_size // 256) + b"over two segments"
    return [*SAMPLES, big, *SAMPLES[:10]]


def hash_scenario(segment_size: int) -> Scenario:
    ops: list[Op] = []
    want: list[list[Any]] = [[] for _ in range(N)]
    for seq, value in enumerate(_values(segment_size)):
        key = [seq % 7, f"k{seq % 5}", (seq % 3, "t")][seq % 3]
        record = (key, seq, value)
        ops.append(Emit(record, key))
        want[deterministic_hash(key) % N].append(record)
    return Scenario(ops, want)


def round_robin_scenario(segment_size: int) -> Scenario:
    ops: list[Op] = []
    want: list[list[Any]] = [[] for _ in range(N)]
    for seq, value in enumerate(_values(segment_size)):
        record = (seq, value)
        ops.append(Emit(record))
        want[seq % N].append(record)
    return Scenario(ops, want, RoundRobinSelector)


def broadcast_scenario(segment_size: int) -> Scenario:
    ops: list[Op] = []
    want: list[list[Any]] = [[] for _ in range(N)]
    for seq, value in enumerate(_values(segment_size)):
        record: tuple[Any, ...]
        if seq % 4 in (1, 2):  # runs of two broadcasts between keyed records
            record = ("all", seq, value)
            ops.append(Broadcast(record))
            for w in want:
                w.append(record)
        else:
            record = (seq, seq, value)
            ops.append(Emit(record, seq))
            want[deterministic_hash(seq) % N].append(record)
    return Scenario(ops, want)


def flush_timeout_scenario(segment_size: int) -> Scenario:
    values = _values(segment_size)
    ops: list[Op] = []
    want: list[list[Any]] = [[] for _ in range(N)]
    seq = 0
    for part in (values[:5], values[5:6], values[6:9]):  # the middle one: the big record
        for value in part:
            record = (seq, value)
            ops.append(Emit(record))
            want[seq % N].append(record)
            seq += 1
        ops.append(WaitRead(seq))  # readable by the flush timeout alone
    return Scenario(ops, want, RoundRobinSelector, buffer_timeout=0.02)


SCENARIOS: dict[str, Callable[[int], Scenario]] = {
    "hash": hash_scenario,
    "round-robin": round_robin_scenario,
    "broadcast": broadcast_scenario,
    "flush-timeout": flush_timeout_scenario,
}


# -- reading back ----------------------------------------------------------------------------


class Readers:
    """One in-process reader per subpartition, reading while the producer writes."""

    def __init__(self, daemon: ExchangeDaemon, pid: ResultPartitionID) -> None:
        self.daemon = daemon
        self.pid = pid
        self.got: list[list[Any]] = [[] for _ in range(N)]
        self.events: list[list[AbstractEvent]] = [[] for _ in range(N)]

    def total(self) -> int:
        return sum(len(g) for g in self.got)  # read from a producer thread too: len is atomic

    async def read_all(self) -> None:
        await asyncio.gather(*(self._read(i) for i in range(N)))

    async def _read(self, index: int) -> None:
        gate = SingleInputGate(f"conformance-{index}")
        channel = LocalInputChannel(
            gate, 0, self.daemon.manager, self.pid, index, backoff_initial=0.01, backoff_max=2.56
        )
        gate.set_input_channels([channel])

        def on_event(event: AbstractEvent, _channel: int) -> None:
            self.events[index].append(event)

        reader = RecordReader(gate, event_handler=on_event)
        try:
            await gate.request_partitions()
            while (batch := await reader.next_batch()) is not None:
                self.got[index].extend(batch)
        finally:
            reader.close()


# -- the producer paths ----------------------------------------------------------------------


async def produce_in_process(
    daemon: ExchangeDaemon, pid: ResultPartitionID, sc: Scenario, readers: Readers
) -> None:
    part = daemon.create_partition(pid, ResultPartitionType.PIPELINED, N)
    writer = ResultPartitionWriter(part, selector=sc.selector(), buffer_timeout=sc.buffer_timeout)
    async with writer:
        await _run_async(writer, sc, readers)


async def produce_async(
    daemon: ExchangeDaemon, pid: ResultPartitionID, sc: Scenario, readers: Readers
) -> None:
    writer = await AsyncPartitionWriter.open(
        pid,
        N,
        daemon_socket=daemon.local_socket,
        selector=sc.selector(),
        buffer_timeout=sc.buffer_timeout,
    )
    async with writer:
        await _run_async(writer, sc, readers)


async def _run_async(
    writer: ResultPartitionWriter | AsyncPartitionWriter, sc: Scenario, readers: Readers
) -> None:
    for op in sc.ops:
        match op:
            case Emit(record, None):
                await writer.emit(record)
            case Emit(record, key):
                await writer.emit(record, key)
            case Broadcast(record):
                await writer.broadcast_emit(record)
            case WaitRead(count):
                await wait_until(
                    lambda count=count: readers.total() >= count,  # type: ignore[misc]
                    WAIT_TIMEOUT,
                    f"{count} records readable without a flush",
                )


async def produce_sync(
    daemon: ExchangeDaemon, pid: ResultPartitionID, sc: Scenario, readers: Readers
) -> None:
    def run() -> None:
        assert threading.current_thread() is not threading.main_thread()
        with PartitionWriter(
            pid,
            N,
            daemon_socket=daemon.local_socket,
            selector=sc.selector(),
            buffer_timeout=sc.buffer_timeout,
        ) as writer:
            for op in sc.ops:
                match op:
                    case Emit(record, None):
                        writer.emit(record)
                    case Emit(record, key):
                        writer.emit(record, key)
                    case Broadcast(record):
                        writer.broadcast(record)
                    case WaitRead(count):
                        deadline = time.monotonic() + WAIT_TIMEOUT
                        while readers.total() < count:  # the readers run on the loop
                            assert time.monotonic() < deadline, (
                                f"{count} records not readable without a flush"
                            )
                            time.sleep(0.005)

    await asyncio.to_thread(run)


PRODUCER_PATHS = {
    "sync": produce_sync,
    "async": produce_async,
    "in-process": produce_in_process,
}


# -- the suite -------------------------------------------------------------------------------


@pytest.mark.asyncio
@pytest.mark.parametrize("scenario", list(SCENARIOS))
@pytest.mark.parametrize("path", list(PRODUCER_PATHS))
async def test_every_producer_path_writes_the_same_subpartitions(
    daemon: ExchangeDaemon, path: str, scenario: str
) -> None:
    sc = SCENARIOS[scenario](daemon.segment_size)
    pid = ResultPartitionID(f"producer-{path}-{scenario}", 0)
    readers = Readers(daemon, pid)
    await asyncio.gather(PRODUCER_PATHS[path](daemon, pid, sc, readers), readers.read_all())

    assert all(sc.expected), "every subpartition gets records in every scenario"
    for i in range(N):
        assert len(readers.got[i]) == len(sc.expected[i]), f"subpartition {i}"
        assert_exact(readers.got[i], sc.expected[i], f"subpartition {i}")
        assert readers.events[i] == [EndOfPartitionEvent.INSTANCE], i
    await wait_until(lambda: daemon_pool_whole(daemon), what="daemon pool whole")
    assert not daemon.manager.partitions


@pytest.mark.asyncio
async def test_sync_writer_ships_what_the_tasks_own_flush_cut(daemon: ExchangeDaemon) -> None:
    """A task that keeps emitting flushes by itself once ``buffer_timeout`` passed (the
    flush timer then finds nothing due): what that flush cut must leave at once, not wait
    for a full shipment. The timer is stopped here, so only the task's own flush can ship:
    before the fix the records stayed in the writer until more data or ``close``."""
    pid = ResultPartitionID("producer-own-flush", 0)
    readers = Readers(daemon, pid)
    timeout = 0.05

    def run() -> None:
        with PartitionWriter(
            pid, N, daemon_socket=daemon.local_socket, buffer_timeout=timeout
        ) as writer:
            writer._stop_timer()
            start = time.monotonic()
            writer.emit_to("first", 0)
            while time.monotonic() < start + 2 * timeout:  # the timeout passes
                time.sleep(timeout / 5)
            writer.emit_to("second", 0)  # the task's emit flushes both
            deadline = time.monotonic() + WAIT_TIMEOUT
            while readers.total() < 2:
                assert time.monotonic() < deadline, "the task's flush was not shipped"
                time.sleep(0.005)

    await asyncio.gather(asyncio.to_thread(run), readers.read_all())
    assert readers.got[0] == ["first", "second"]
    await wait_until(lambda: daemon_pool_whole(daemon), what="daemon pool whole")
