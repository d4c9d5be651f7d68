"""Flink's ThroughputCalculator: bytes per second an input gate hands to its task.

Time counts only while data flows. A gate that has nothing to return is idle because its
producers are slow, not because its task is; counting that time would make a starved gate
look like a slow consumer and shrink its buffers for nothing. So the gate pauses the
measurement when it runs empty and resumes it when data is there again (receiving data
resumes it too, as Flink's ``incomingDataSize`` does).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeAlias

from exchange.errors import UsageError

__all__ = ["Clock", "ThroughputCalculator"]

#: Monotonic seconds (``time.monotonic``, ``loop.time``, or a test's fake clock).
Clock: TypeAlias = Callable[[], float]


class ThroughputCalculator:
    """Measures the throughput of one input gate over each period, clock injected.

    ``calculate_throughput`` ends a period: it returns bytes per second over the measured
    time since its previous call and starts the next period. A period without measured
    time keeps the previous value (Flink's ``currentThroughput``); the first is 0.
    """

    __slots__ = ("_accumulated_bytes", "_clock", "_measured_time", "_started_at", "_throughput")

    def __init__(self, clock: Clock) -> None:
        self._clock = clock
        self._accumulated_bytes = 0
        self._measured_time = 0.0
        # When the running measurement started; None while paused (Flink's NOT_TRACKED).
        self._started_at: float | None = None
        self._throughput = 0

    @property
    def is_measuring(self) -> bool:
        """True unless the measurement is paused."""
        return self._started_at is not None

    @property
    def throughput(self) -> int:
        """The value the last ``calculate_throughput`` returned, bytes per second."""
        return self._throughput

    def on_data(self, nbytes: int) -> None:
        """Count a buffer or event of ``nbytes`` the gate returned; resumes the measurement."""
        if nbytes < 0:
            raise UsageError(f"data size must not be negative, got {nbytes}")
        self.resume_measurement()
        self._accumulated_bytes += nbytes

    def pause_measurement(self) -> None:
        """The gate has nothing to return: stop counting time."""
        if self._started_at is not None:
            self._measured_time += self._clock() - self._started_at
            self._started_at = None

    def resume_measurement(self) -> None:
        """The gate has data again: count time from now."""
        if self._started_at is None:
            self._started_at = self._clock()

    def calculate_throughput(self) -> int:
        """Bytes per second over the measured time since the last call; starts a new period."""
        if self._started_at is not None:
            now = self._clock()
            self._measured_time += now - self._started_at
            self._started_at = now
        if self._measured_time > 0:
            self._throughput = int(self._accumulated_bytes / self._measured_time)
        self._accumulated_bytes = 0
        self._measured_time = 0.0
        return self._throughput
