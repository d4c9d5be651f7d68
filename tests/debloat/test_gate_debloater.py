"""GateDebloater: states, the period, and the pieces wired together for one gate."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest

from exchange.debloat import DebloatConfig, GateDebloater, GateDebloaterState
from exchange.errors import IllegalStateError, UsageError

if TYPE_CHECKING:
    from tests.debloat.conftest import ManualClock

ENABLED = DebloatConfig(
    enabled=True, period=0.25, samples=3, threshold_percent=25, initial_buffer_size=1024
)


def test_disabled_never_runs_and_keeps_whole_segments(clock: ManualClock) -> None:
    gate = GateDebloater(DebloatConfig(enabled=False, max_buffer_size=8192), clock)
    assert gate.state is GateDebloaterState.DISABLED
    assert gate.buffer_size == 8192
    assert gate.next_deadline is None
    for _ in range(50):
        gate.on_data(100)
        clock.advance(0.2)
        assert gate.tick(clock(), queued_buffers=4, backlog=4) is None
        assert gate.debloat(4, 4) is None
    assert gate.buffer_size == 8192
    assert gate.stats().buffer_size == 8192
    gate.close()
    assert gate.state is GateDebloaterState.CLOSED


def test_runs_once_per_period(clock: ManualClock) -> None:
    gate = GateDebloater(ENABLED, clock)
    assert gate.state is GateDebloaterState.RUNNING
    assert gate.buffer_size == 1024
    start = clock()
    assert gate.next_deadline == start + 0.25
    gate.on_data(1024)
    clock.advance(0.125)
    assert gate.tick(clock(), queued_buffers=1, backlog=1) is None  # not due yet
    clock.advance(0.125)
    # 1024 bytes in 0.25 s = 4096 B/s; x 1 s over 2 buffers = 2048 = 2 x 1024:
    # 1024 -> 1536, announced
    assert gate.tick(clock(), queued_buffers=1, backlog=1) == 1536
    assert gate.buffer_size == 1536
    assert gate.next_deadline == clock() + 0.25
    stats = gate.stats()
    assert (stats.throughput, stats.buffers_in_use, stats.buffer_size) == (4096, 2, 1536)
    assert stats.estimated_time_to_consume == pytest.approx(1536 * 2 / 4096)
    # a tick right after the run does nothing, and does not end the throughput period
    assert gate.tick(clock(), 1, 1) is None


def test_empty_gate_time_is_not_throughput(clock: ManualClock) -> None:
    gate = GateDebloater(ENABLED, clock)
    gate.on_data(512)
    clock.advance(0.125)
    gate.on_gate_empty()
    clock.advance(0.125)  # starved by the producers: not the task's slowness
    assert gate.tick(clock(), 0, 0) is not None
    assert gate.stats().throughput == 4096  # 512 bytes in 0.125 s
    gate.on_gate_non_empty()
    clock.advance(0.25)
    assert gate.tick(clock(), 0, 0) is not None
    assert gate.stats().throughput == 0  # measured 0.25 s, nothing returned


def test_buffers_in_use_sum_queued_and_backlog(clock: ManualClock) -> None:
    gate = GateDebloater(ENABLED, clock)
    gate.on_data(40_960)
    clock.advance(0.25)
    # 163840 B/s over 3 + 7 = 10 buffers = 16384, capped at 2048
    assert gate.tick(clock(), queued_buffers=3, backlog=7) == 1536
    assert gate.stats().buffers_in_use == 10
    assert gate.stats().desired_total_bytes == 163_840


def test_no_open_channel_means_no_runs(clock: ManualClock) -> None:
    gate = GateDebloater(ENABLED, clock, open_channels=0)
    assert gate.state is GateDebloaterState.IDLE
    assert gate.next_deadline is None
    clock.advance(1.0)
    assert gate.tick(clock(), 1, 1) is None
    assert gate.debloat(1, 1) is None
    gate.set_open_channels(2)
    assert gate.state is GateDebloaterState.RUNNING
    # the period starts when the gate has channels, not at construction
    assert gate.next_deadline == clock() + 0.25
    assert gate.tick(clock(), 1, 1) is None
    gate.set_open_channels(0)  # every channel finished
    assert gate.state is GateDebloaterState.IDLE
    assert gate.next_deadline is None


def test_closed_never_runs_again(clock: ManualClock) -> None:
    gate = GateDebloater(ENABLED, clock)
    gate.close()
    assert gate.state is GateDebloaterState.CLOSED
    assert gate.next_deadline is None
    clock.advance(1.0)
    assert gate.tick(clock(), 1, 1) is None
    gate.close()  # idempotent
    gate.set_open_channels(0)  # harmless
    with pytest.raises(IllegalStateError):
        gate.set_open_channels(1)


def test_debloat_runs_now_whatever_the_timer(clock: ManualClock) -> None:
    gate = GateDebloater(ENABLED, clock)
    gate.on_data(2048)
    clock.advance(0.0625)
    assert gate.debloat(queued_buffers=0, backlog=1) == 1536  # 32768 B/s, capped at 2048


def test_refuses_negative_counts(clock: ManualClock) -> None:
    gate = GateDebloater(ENABLED, clock)
    with pytest.raises(UsageError):
        gate.set_open_channels(-1)
    with pytest.raises(UsageError):
        gate.debloat(-1, 0)
    with pytest.raises(UsageError):
        gate.debloat(0, -1)
