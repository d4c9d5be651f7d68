"""ThroughputCalculator with a manual clock: only time while data flows counts."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest

from exchange.debloat import ThroughputCalculator
from exchange.errors import UsageError

if TYPE_CHECKING:
    from tests.debloat.conftest import ManualClock


def test_bytes_over_measured_time(clock: ManualClock) -> None:
    calc = ThroughputCalculator(clock)
    calc.on_data(1000)
    clock.advance(0.5)
    calc.on_data(500)
    assert calc.calculate_throughput() == 3000  # 1500 bytes in 0.5 s
    assert calc.throughput == 3000


def test_each_call_starts_a_new_period(clock: ManualClock) -> None:
    calc = ThroughputCalculator(clock)
    calc.on_data(1000)
    clock.advance(1.0)
    assert calc.calculate_throughput() == 1000
    # still measuring: the next period starts at the call, not at the next data
    clock.advance(0.5)
    calc.on_data(4000)
    clock.advance(0.5)
    assert calc.calculate_throughput() == 4000


def test_paused_time_is_excluded(clock: ManualClock) -> None:
    calc = ThroughputCalculator(clock)
    calc.on_data(1000)
    clock.advance(0.25)
    calc.pause_measurement()
    assert not calc.is_measuring
    clock.advance(10.0)  # the gate had nothing: producers were slow, not the task
    calc.resume_measurement()
    clock.advance(0.25)
    calc.on_data(1000)
    assert calc.calculate_throughput() == 4000  # 2000 bytes in 0.5 s measured


def test_data_resumes_a_paused_measurement(clock: ManualClock) -> None:
    calc = ThroughputCalculator(clock)
    calc.pause_measurement()  # pausing what never started is harmless
    clock.advance(5.0)
    calc.on_data(300)
    assert calc.is_measuring
    clock.advance(0.1)
    assert calc.calculate_throughput() == 3000


def test_pause_and_resume_are_idempotent(clock: ManualClock) -> None:
    calc = ThroughputCalculator(clock)
    calc.resume_measurement()
    clock.advance(0.5)
    calc.resume_measurement()  # must not restart the measurement
    calc.on_data(1000)
    clock.advance(0.5)
    calc.pause_measurement()
    clock.advance(1.0)
    calc.pause_measurement()  # must not count the paused second
    assert calc.calculate_throughput() == 1000


def test_a_period_without_measured_time_keeps_the_previous_value(clock: ManualClock) -> None:
    calc = ThroughputCalculator(clock)
    assert calc.calculate_throughput() == 0  # nothing measured ever: 0
    calc.on_data(2000)
    clock.advance(1.0)
    calc.pause_measurement()
    assert calc.calculate_throughput() == 2000
    clock.advance(3.0)  # paused for the whole period
    assert calc.calculate_throughput() == 2000
    assert not calc.is_measuring  # calculating does not resume a paused measurement
    # a zero-length period while measuring keeps the value too
    calc.resume_measurement()
    assert calc.calculate_throughput() == 2000


def test_a_measured_period_without_data_is_zero(clock: ManualClock) -> None:
    calc = ThroughputCalculator(clock)
    calc.on_data(1000)
    clock.advance(1.0)
    assert calc.calculate_throughput() == 1000
    clock.advance(1.0)  # measuring, but the task got nothing
    assert calc.calculate_throughput() == 0


def test_zero_byte_data_counts_time(clock: ManualClock) -> None:
    calc = ThroughputCalculator(clock)
    calc.on_data(0)
    clock.advance(2.0)
    calc.on_data(1000)
    assert calc.calculate_throughput() == 500


def test_negative_size_is_refused(clock: ManualClock) -> None:
    calc = ThroughputCalculator(clock)
    with pytest.raises(UsageError):
        calc.on_data(-1)
    assert not calc.is_measuring
