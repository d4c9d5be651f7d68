"""Unaligned barriers through a real daemon: the producer side of unaligned checkpoints.

A producer task (``PartitionWriter``, the real local socket) fills a pipelined partition;
a consumer on loopback TCP (raw frames, so the test controls credit exactly) takes one
buffer and then gives no credit. An unaligned barrier then overtakes the backlog: it
arrives with zero credit, before the buffers queued ahead of it, which the daemon hands
back to the producer task as the checkpoint's output channel state (byte for byte what
the consumer receives after the barrier) and counts in ``/metrics``. A restored writer
re-emits that state before its new records, and a reader gets them in order.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
from collections.abc import Callable
from typing import Any

import pytest

from client.consumer import PartitionLocation, PartitionReader
from client.producer import PartitionWriter
from exchange.addresses import parse_address
from exchange.buffers.buffer import DataType
from exchange.errors import IllegalStateError, UsageError
from exchange.events.events import (
    CheckpointBarrier,
    CheckpointOptions,
    EndOfPartitionEvent,
    EventSerializer,
)
from exchange.partition.result_partition_id import ResultPartitionID
from exchange.protocol.codec import InPlaceFrameDecoder, encode
from exchange.protocol.handshake import ClientHandshake
from exchange.protocol.messages import (
    AddCredit,
    BufferResponse,
    Message,
    PartitionRequest,
    Ping,
    Pong,
)
from tests.kit.polling import wait_for

pytestmark = pytest.mark.timeout(120)

SEGMENT = 4096
RECORD = b"r" * 3000  # one record per 4 KiB buffer (flushed after each)
N = 6
POOL_MAX = 16  # the daemon's pool of a one-subpartition partition (max(2 n + 8, 16))


class RawConsumer:
    """A data-port client on loopback TCP that sends exactly the credit it is told to."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.decoder = InPlaceFrameDecoder()
        self.pending: list[Message] = []

    @classmethod
    async def connect(cls, address: str) -> RawConsumer:
        host, port = parse_address(address)
        reader, writer = await asyncio.open_connection(host, port)
        self = cls(reader, writer)
        hs = ClientHandshake(None)
        for m in hs.start():
            writer.write(b"".join(encode(m)))
        async with asyncio.timeout(30):
            while not hs.is_established:
                for m in await self._read():
                    if hs.is_established:
                        self.pending.append(m)
                    else:
                        assert hs.receive(m) == []
        return self

    async def _read(self) -> list[Message]:
        data = await self.reader.read(65536)
        assert data, "the daemon closed the connection"
        return self.decoder.feed(data)

    def send(self, m: Message) -> None:
        self.writer.write(b"".join(encode(m)))

    async def next_buffer(self, timeout: float = 30) -> BufferResponse:
        """The next BufferResponse (a keepalive Ping on the way is answered)."""
        async with asyncio.timeout(timeout):
            while True:
                while not self.pending:
                    self.pending.extend(await self._read())
                m = self.pending.pop(0)
                if not isinstance(m, Ping):
                    break
                self.send(Pong())
        assert isinstance(m, BufferResponse), m
        # the decoder's payload views the read chunk: keep a copy
        return BufferResponse(
            m.receiver_id, m.sequence_number, m.backlog, m.data_type, m.compressed, bytes(m.payload)
        )

    async def nothing_within(self, seconds: float) -> bool:
        with contextlib.suppress(TimeoutError):
            await self.next_buffer(seconds)
            return False
        return True

    async def close(self) -> None:
        self.writer.close()
        with contextlib.suppress(OSError):
            await self.writer.wait_closed()


def _metric(d: Any, name: str) -> float:
    return d.metric(name)  # type: ignore[no-any-return]


def test_unaligned_barrier_overtakes_a_backlog_under_zero_credit(
    start_daemon: Callable[..., Any],
) -> None:
    d = start_daemon("--segment-size", "4kb")
    pid = ResultPartitionID("unaligned-out", 0, 0)
    assert _metric(d, "exchange_output_channel_state_bytes_total") == 0
    w = PartitionWriter(pid, 1, blocking=False, daemon_socket=d.local_socket, buffer_timeout=0)
    for i in range(N):
        w.emit((i, RECORD))
        w.flush()  # on the daemon now: one buffer per record

    async def consume() -> tuple[list[BufferResponse], list[BufferResponse], BufferResponse]:
        loop = asyncio.get_running_loop()
        c = await RawConsumer.connect(d.data_address)
        try:
            c.send(PartitionRequest(pid, 0, 1, 1))  # one credit
            first = await c.next_buffer()
            assert first.data_type is DataType.DATA_BUFFER and first.backlog == N - 1
            # no credit left: the backlog stays on the daemon
            assert await c.nothing_within(0.3)
            await loop.run_in_executor(None, lambda: w.broadcast_barrier(7, 1, unaligned=True))
            barrier = await c.next_buffer()  # still no credit given
            after = []
            c.send(AddCredit(1, N))
            for _ in range(N - 1):
                after.append(await c.next_buffer())
            await loop.run_in_executor(None, w.close)
            end = await c.next_buffer()
            return [first, barrier], after, end
        finally:
            await c.close()

    try:
        (first, barrier), after, end = asyncio.run(consume())
        state = w.output_channel_state(7).result(timeout=60)
        with pytest.raises(UsageError, match="taken already"):
            w.output_channel_state(7)
    finally:
        w.fail("test over")  # no-op once closed
    assert EventSerializer.from_bytes(end.payload) == EndOfPartitionEvent.INSTANCE
    assert barrier.data_type is DataType.PRIORITIZED_EVENT_BUFFER
    assert EventSerializer.from_bytes(barrier.payload) == CheckpointBarrier(
        7, 1, CheckpointOptions(unaligned=True)
    )
    assert barrier.sequence_number == 1  # right after the one buffer sent with credit
    assert [b.data_type for b in after] == [DataType.DATA_BUFFER] * (N - 1)
    assert [b.sequence_number for b in after] == list(range(2, N + 1))
    # the state is exactly what the barrier overtook, in order; the first buffer was sent
    assert state.checkpoint_id == 7
    assert list(state.buffers) == [0]
    assert list(state.buffers[0]) == [b.payload for b in after]
    assert first.payload not in state.buffers[0]
    total = sum(len(b.payload) for b in after)
    assert state.num_bytes == total and state.num_buffers == N - 1
    wait_for(
        lambda: _metric(d, "exchange_output_channel_state_bytes_total") == total,
        30,
        "the output channel state in /metrics",
    )
    assert _metric(d, "exchange_output_channel_state_buffers_total") == N - 1
    d.wait_pool_whole()


def test_restored_output_state_comes_before_new_records(start_daemon: Callable[..., Any]) -> None:
    d = start_daemon("--segment-size", "4kb")
    dataset = "unaligned-restore"
    first = ResultPartitionID(dataset, 0, 0)
    # attempt 0: nobody reads; the barrier overtakes everything, which comes back as state
    w = PartitionWriter(first, 2, blocking=False, daemon_socket=d.local_socket)
    try:
        for i in range(4):
            w.emit_to((i, RECORD), i % 2)
        w.broadcast_barrier(3, 0, unaligned=True)
        state = w.output_channel_state(3).result(timeout=60)
    finally:
        w.fail("the task fails after its checkpoint")
    assert sorted(state.buffers) == [0, 1] and state.num_buffers >= 2
    # attempt 1: restore, then new records; the reader sees the old ones first, in order
    second = ResultPartitionID(dataset, 0, 1)
    got: list[Any] = []
    with PartitionWriter(second, 2, blocking=False, daemon_socket=d.local_socket) as w2:
        w2.restore_output_state(state)
        with pytest.raises(IllegalStateError, match="before any record"):
            w2.restore_output_state(state)
        for i in range(4, 6):
            w2.emit_to((i, RECORD), i % 2)
    for sub in (0, 1):
        loc = PartitionLocation(second, sub, d.data_address, d.daemon_id, d.local_socket)
        with PartitionReader([loc]) as r:
            got.append([rec[0] for rec in r.records()])
    assert got == [[0, 2, 4], [1, 3, 5]]
    d.wait_pool_whole()


def test_restore_refuses_state_that_does_not_fit(start_daemon: Callable[..., Any]) -> None:
    from exchange.checkpointing.output_channel_state import CheckpointOutputState

    d = start_daemon("--segment-size", "4kb")
    pid = ResultPartitionID("unaligned-bad", 0, 0)
    w = PartitionWriter(pid, 1, blocking=False, daemon_socket=d.local_socket)
    try:
        with pytest.raises(UsageError, match="subpartition 1"):
            w.restore_output_state(CheckpointOutputState(1, {1: (b"x",)}))
        with pytest.raises(UsageError, match="segment size"):
            w.restore_output_state(CheckpointOutputState(1, {0: (b"x" * (SEGMENT + 1),)}))
        with pytest.raises(UsageError, match="exactly-once"):
            w.broadcast_barrier(1, 0, aligned=False, unaligned=True)
        with pytest.raises(UsageError, match="no unaligned barrier 5"):
            w.output_channel_state(5)
        w.broadcast_barrier(2, 0, unaligned=True)
        with pytest.raises(UsageError, match="must increase"):
            w.broadcast_barrier(2, 0, unaligned=True)
        assert w.output_channel_state(2).result(timeout=60).num_buffers == 0
    finally:
        w.fail("nobody reads this partition")
    d.wait_pool_whole()


def test_under_full_backpressure_the_barrier_also_overtakes_what_the_task_holds(
    start_daemon: Callable[..., Any],
) -> None:
    """The partition's pool on the daemon is full and the writer holds buffers it cannot
    push (no producer credit): the barrier still reaches the consumer next, and the state
    is every buffer the consumer receives after it: the daemon's queue, then the task's."""
    d = start_daemon("--segment-size", "4kb")
    pid = ResultPartitionID("unaligned-full", 0, 0)
    w = PartitionWriter(pid, 1, blocking=False, daemon_socket=d.local_socket, buffer_timeout=0)

    async def consume() -> tuple[int, BufferResponse, list[BufferResponse]]:
        loop = asyncio.get_running_loop()
        c = await RawConsumer.connect(d.data_address)
        try:
            c.send(PartitionRequest(pid, 0, 1, 1))

            def fill() -> int:
                """The task's mailbox loop: emit while the output has room. Up to one
                buffer sent plus a full pool on the daemon (17) the writer must get room
                again; after that a second without room is the back pressure."""
                n = 0
                while True:
                    room = w.available()
                    if room is not None:
                        try:
                            room.result(timeout=None if n <= 1 + POOL_MAX else 1.0)
                        except concurrent.futures.TimeoutError:
                            return n
                    assert n < 2000, "the writer never felt the back pressure"
                    w.emit((n, RECORD))
                    n += 1

            emitted = await loop.run_in_executor(None, fill)
            first = await c.next_buffer()
            assert first.data_type is DataType.DATA_BUFFER
            await loop.run_in_executor(None, lambda: w.broadcast_barrier(9, 1, unaligned=True))
            barrier = await c.next_buffer()  # no credit was given after the first buffer
            c.send(AddCredit(1, 10_000))
            closing = loop.run_in_executor(None, w.close)
            after = []
            while (b := await c.next_buffer()).data_type is DataType.DATA_BUFFER:
                after.append(b)
            assert EventSerializer.from_bytes(b.payload) == EndOfPartitionEvent.INSTANCE
            await closing
            assert 1 + len(after) == emitted  # one record per buffer, nothing lost
            return emitted, barrier, after
        finally:
            await c.close()

    try:
        _, barrier, after = asyncio.run(consume())
        state = w.output_channel_state(9).result(timeout=60)
    finally:
        w.fail("test over")
    assert barrier.data_type is DataType.PRIORITIZED_EVENT_BUFFER and barrier.sequence_number == 1
    # more than the daemon's queue could hold: the task's own unsent buffers are in it
    assert len(after) > POOL_MAX
    assert list(state.buffers[0]) == [b.payload for b in after]
    daemon_part = _metric(d, "exchange_output_channel_state_buffers_total")
    assert 0 < daemon_part < len(after)
    d.wait_pool_whole()
