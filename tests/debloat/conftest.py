"""A manual clock for the debloating tests: time moves only when a test says so."""

from __future__ import annotations

import pytest


class ManualClock:
    """Monotonic seconds that only ``advance`` moves."""

    def __init__(self, start: float = 100.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        assert seconds >= 0
        self.now += seconds


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()
