"""Debloating in a simulated pipeline: a throttled consumer, producers always backlogged.

Pure Python, no sockets, a manual clock. Each of ``CHANNELS`` channels holds a fixed number
of buffers in flight (what credit allows at the consumer plus the producer's backlog); the
producer refills a channel the moment the consumer takes a buffer from it, cutting the new
buffer at the size last announced. Buffers already in flight keep the size they were cut
at, as in the real exchange. The consumer takes whole buffers, round robin, at most
``rate`` bytes per second. Every step the gate debloater gets its tick; whatever it
announces becomes the producers' size.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING

import pytest

from exchange.debloat import DebloatConfig, GateDebloater

if TYPE_CHECKING:
    from tests.debloat.conftest import ManualClock

CHANNELS = 4
QUEUED_PER_CHANNEL = 2  # exclusive credit at the consumer
BACKLOG_PER_CHANNEL = 2  # finished buffers waiting at the producer
BUFFERS_IN_USE = CHANNELS * (QUEUED_PER_CHANNEL + BACKLOG_PER_CHANNEL)
SEGMENT = 32 * 1024
STEP = 1 / 1024  # seconds; a power of two keeps the manual clock exact


class Pipeline:
    """The simulated gate, its channels and the consumer's throttle."""

    def __init__(self, config: DebloatConfig, clock: ManualClock) -> None:
        self.clock = clock
        self.gate = GateDebloater(config, clock, open_channels=CHANNELS)
        self.producer_size = self.gate.buffer_size
        per_channel = QUEUED_PER_CHANNEL + BACKLOG_PER_CHANNEL
        self.channels = [deque([self.producer_size] * per_channel) for _ in range(CHANNELS)]
        self.in_flight = BUFFERS_IN_USE * self.producer_size
        self.announced: list[int] = []
        self._budget = 0.0
        self._next_channel = 0

    def run(self, seconds: float, rate: int) -> list[tuple[int, int]]:
        """Consume at ``rate`` B/s for ``seconds``; (in-flight bytes, size) after each step."""
        trace = []
        for _ in range(round(seconds / STEP)):
            self.clock.advance(STEP)
            self._budget += rate * STEP
            self._consume()
            size = self.gate.tick(
                self.clock(),
                queued_buffers=CHANNELS * QUEUED_PER_CHANNEL,
                backlog=CHANNELS * BACKLOG_PER_CHANNEL,
            )
            if size is not None:
                self.announced.append(size)
                self.producer_size = size
            trace.append((self.in_flight, self.producer_size))
        return trace

    def _consume(self) -> None:
        while True:
            channel = self.channels[self._next_channel]
            head = channel[0]
            if head > self._budget:
                return
            channel.popleft()
            self._budget -= head
            self.gate.on_data(head)
            # The producer is always backlogged: a new buffer at the announced size.
            channel.append(self.producer_size)
            self.in_flight += self.producer_size - head
            self._next_channel = (self._next_channel + 1) % CHANNELS


def _config(**changes: object) -> DebloatConfig:
    base: dict[str, object] = {"enabled": True, "max_buffer_size": SEGMENT}
    base.update(changes)
    return DebloatConfig(**base)  # type: ignore[arg-type]


@pytest.mark.parametrize("initial", [1024, SEGMENT], ids=["from-1KiB", "from-segment"])
def test_converges_to_the_target_and_grows_back_when_the_throttle_lifts(
    clock: ManualClock, initial: int
) -> None:
    config = _config(initial_buffer_size=initial)  # Flink's defaults otherwise
    pipeline = Pipeline(config, clock)
    rate = 64 * 1024  # 64 KiB/s: 1 s of data is 64 KiB, 4 KiB per buffer in use

    trace = pipeline.run(30.0, rate)

    target_bytes = rate * config.target
    settled = trace[-round(10.0 / STEP) :]  # the last 10 s of the throttled phase
    for in_flight, _size in settled:
        assert abs(in_flight - target_bytes) <= 0.3 * target_bytes, (in_flight, target_bytes)
    # the size really moved there, and stays within the announced bounds
    first_in_flight = trace[0][0]
    assert abs(first_in_flight - target_bytes) > 0.3 * target_bytes
    assert all(config.min_buffer_size <= s <= SEGMENT for s in pipeline.announced)
    stats = pipeline.gate.stats()
    assert stats.throughput == pytest.approx(rate, rel=0.3)
    assert stats.estimated_time_to_consume == pytest.approx(config.target, rel=0.3)

    # The throttle lifts: 16 MiB/s would want 1 MiB per buffer; the segment caps it.
    announced_before = len(pipeline.announced)
    trace = pipeline.run(15.0, 16 * 1024 * 1024)
    assert pipeline.producer_size == SEGMENT
    assert pipeline.announced[-1] == SEGMENT
    assert len(pipeline.announced) > announced_before
    assert trace[-1][0] == BUFFERS_IN_USE * SEGMENT  # every buffer in flight is whole again
    # growth is gradual (capped at 2x the average per period), never a jump to the maximum
    growth = pipeline.announced[announced_before:]
    assert len(growth) >= 3
    assert growth == sorted(growth)


def test_shrinks_again_when_the_consumer_slows_down(clock: ManualClock) -> None:
    config = _config()
    pipeline = Pipeline(config, clock)
    pipeline.run(10.0, 8 * 1024 * 1024)  # fast: whole segments
    assert pipeline.producer_size == SEGMENT
    rate = 32 * 1024  # 32 KiB/s: 2 KiB per buffer in use
    trace = pipeline.run(30.0, rate)
    in_flight, size = trace[-1]
    assert abs(in_flight - rate * config.target) <= 0.3 * rate * config.target
    assert size < SEGMENT // 8


def test_very_slow_consumer_stops_at_the_minimum_size(clock: ManualClock) -> None:
    config = _config(min_buffer_size=512)
    pipeline = Pipeline(config, clock)
    trace = pipeline.run(60.0, 1024)  # 1 KiB/s wants 64 B per buffer: below the minimum
    assert pipeline.producer_size == 512
    assert pipeline.announced[-1] == 512
    assert trace[-1][0] == BUFFERS_IN_USE * 512


def test_disabled_sizes_never_change(clock: ManualClock) -> None:
    config = _config(enabled=False)
    pipeline = Pipeline(config, clock)
    assert pipeline.producer_size == SEGMENT
    for rate in (64 * 1024, 16 * 1024 * 1024, 1024):
        trace = pipeline.run(10.0, rate)
        assert {size for _, size in trace} == {SEGMENT}
        assert {in_flight for in_flight, _ in trace} == {BUFFERS_IN_USE * SEGMENT}
    assert pipeline.announced == []
