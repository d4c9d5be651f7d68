"""DebloatTimer: a fixed delay, as Flink re-registers the timer after each run."""

from __future__ import annotations

import pytest

from exchange.debloat import DebloatTimer
from exchange.errors import UsageError


def test_due_once_the_period_passed() -> None:
    timer = DebloatTimer(0.2, now=10.0)
    assert timer.next_deadline == pytest.approx(10.2)
    assert not timer.due(10.1)
    assert timer.next_deadline == pytest.approx(10.2)
    assert timer.due(10.2)
    assert timer.next_deadline == pytest.approx(10.4)
    assert not timer.due(10.3)


def test_fixed_delay_after_a_late_run() -> None:
    timer = DebloatTimer(0.2, now=0.0)
    assert timer.due(1.0)  # five periods late: runs once ...
    assert not timer.due(1.1)  # ... and the next is a whole period after it ran
    assert timer.next_deadline == pytest.approx(1.2)


def test_restart() -> None:
    timer = DebloatTimer(1.0, now=0.0)
    timer.restart(5.5)
    assert not timer.due(6.0)
    assert timer.due(6.5)
    assert timer.period == 1.0


@pytest.mark.parametrize("period", [0.0, -1.0, float("nan")])
def test_period_must_be_positive(period: float) -> None:
    with pytest.raises(UsageError):
        DebloatTimer(period, now=0.0)
