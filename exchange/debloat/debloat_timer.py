"""The debloater's period, sans I/O: the asyncio code asks when to wake up and whether to run.

Flink registers the next run ``period`` after the previous one *ran* (a fixed delay, not a
fixed rate): a task that fell behind runs once and then waits a whole period, instead of
catching up with a burst of runs on stale measurements. This timer does the same.
"""

from __future__ import annotations

from exchange.errors import UsageError

__all__ = ["DebloatTimer"]


class DebloatTimer:
    """Fires every ``period`` seconds with a fixed delay; times come from the caller."""

    __slots__ = ("_next_deadline", "_period")

    def __init__(self, period: float, now: float) -> None:
        if not period > 0:
            raise UsageError(f"period must be positive, got {period!r}")
        self._period = period
        self._next_deadline = now + period

    @property
    def period(self) -> float:
        return self._period

    @property
    def next_deadline(self) -> float:
        """When the next run is due (same clock as ``now``)."""
        return self._next_deadline

    def due(self, now: float) -> bool:
        """True when the deadline passed; then the next one is ``now + period``."""
        if now < self._next_deadline:
            return False
        self._next_deadline = now + self._period
        return True

    def restart(self, now: float) -> None:
        """Start a fresh period at ``now`` (after an idle stretch)."""
        self._next_deadline = now + self._period
