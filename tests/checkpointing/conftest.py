"""Helpers for the barrier handler tests: a fake clock, a recording task, input builders."""

from __future__ import annotations

import struct
from collections.abc import Iterable, Iterator
from typing import Any

import pytest

from exchange.buffers.buffer import Buffer, DataType
from exchange.checkpointing import CheckpointBarrierHandler, CheckpointFailureReason
from exchange.consumer.single_input_gate import BufferOrEvent
from exchange.events.events import (
    AbstractEvent,
    CancelCheckpointMarker,
    CheckpointBarrier,
    CheckpointOptions,
    EndOfPartitionEvent,
)
from exchange.memory import NetworkBufferPool

REC: struct.Struct = struct.Struct(">i")


class FakeClock:
    """Monotonic seconds that move only when told."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class Task:
    """Listener and resume seam at once; logs callbacks and what the task saw, in order.

    Log entries: ("rec", channel, payload), ("eop", channel), ("event", channel, event),
    ("trigger", id), ("abort", id, reason), ("resume", channel).
    """

    def __init__(self) -> None:
        self.log: list[tuple[Any, ...]] = []

    def trigger_checkpoint(self, checkpoint_id: int, timestamp: int, options: Any) -> None:
        self.log.append(("trigger", checkpoint_id))

    def abort_checkpoint(self, checkpoint_id: int, reason: CheckpointFailureReason) -> None:
        self.log.append(("abort", checkpoint_id, reason))

    def resume(self, channel_index: int) -> None:
        self.log.append(("resume", channel_index))

    def deliver(self, boe: BufferOrEvent) -> None:
        if boe.buffer is not None:
            self.log.append(("rec", boe.channel_index, boe.buffer.to_bytes()))
            boe.buffer.release()
        elif isinstance(boe.event, EndOfPartitionEvent):
            self.log.append(("eop", boe.channel_index))
        else:
            self.log.append(("event", boe.channel_index, boe.event))

    def callbacks(self) -> list[tuple[Any, ...]]:
        return [e for e in self.log if e[0] in ("trigger", "abort")]

    def clear(self) -> None:
        self.log.clear()


def data(channel: int, payload: bytes, pool: NetworkBufferPool | None = None) -> BufferOrEvent:
    """A data buffer holding ``payload`` (from ``pool`` if given, else unpooled)."""
    if pool is None:
        return BufferOrEvent(Buffer.wrap(payload, DataType.DATA_BUFFER), None, channel, False)
    seg = pool.request_memory_segment()
    assert seg is not None, "test pool exhausted"
    seg.put(0, payload)
    return BufferOrEvent(Buffer(seg, pool, len(payload)), None, channel, False)


def event(channel: int, ev: AbstractEvent) -> BufferOrEvent:
    return BufferOrEvent(None, ev, channel, False)


def barrier(channel: int, checkpoint_id: int, aligned: bool = True) -> BufferOrEvent:
    opts = CheckpointOptions(exactly_once=aligned)
    return event(channel, CheckpointBarrier(checkpoint_id, 1000 + checkpoint_id, opts))


def cancel(channel: int, checkpoint_id: int) -> BufferOrEvent:
    return event(channel, CancelCheckpointMarker(checkpoint_id))


def eop(channel: int) -> BufferOrEvent:
    return event(channel, EndOfPartitionEvent.INSTANCE)


def feed(handler: CheckpointBarrierHandler, task: Task, items: Iterable[BufferOrEvent]) -> None:
    """Feed items as a reader would: replay drained before each new item and at the end."""
    for boe in items:
        drain(handler, task)
        out = handler.process(boe)
        if out is not None:
            task.deliver(out)
    drain(handler, task)


def drain(handler: CheckpointBarrierHandler, task: Task) -> None:
    while (out := handler.poll_next()) is not None:
        task.deliver(out)


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def task() -> Task:
    return Task()


@pytest.fixture
def pool() -> Iterator[NetworkBufferPool]:
    """A small pool that must be whole when the test ends."""
    p = NetworkBufferPool(128, 4096)
    try:
        yield p
        p.check_consistency()
        assert p.is_whole(), p.stats()
    finally:
        p.destroy()
