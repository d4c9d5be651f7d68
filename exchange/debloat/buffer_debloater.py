"""Flink's BufferDebloater and BufferSizeEMA: the buffer size that keeps in-flight data short.

Each period the gate's throughput T and its buffers in use B (queued at the consumer plus
the backlog its producers announced) go in. The in-flight data should take ``target``
seconds to consume, so the gate wants T * target bytes in flight, that is
T * target / B bytes per buffer. That instant value jumps with every throughput sample, so
the size moves towards it as an exponential moving average with alpha = 2 / (samples + 1),
the instant value capped at twice the current average (growth as fast as shrinking: without
the cap, one huge sample would jump from the minimum to the maximum at once), and clamped
to [min, max]. A size is announced upstream only when it differs from the last announced one
by at least the threshold percentage, or when it reaches the minimum or the maximum.
"""

from __future__ import annotations

import math
from typing import Final, NamedTuple

from exchange.debloat.config import DebloatConfig
from exchange.errors import UsageError

__all__ = ["BufferDebloater", "BufferDebloaterStats", "BufferSizeEMA"]

_MICROS_PER_SECOND: Final = 1_000_000


class BufferSizeEMA:
    """Exponential moving average of the buffer size, growth capped at 2x, clamped."""

    __slots__ = ("_alpha", "_last", "_max", "_min")

    def __init__(self, starting_size: int, max_size: int, min_size: int, samples: int) -> None:
        if not 0 < min_size <= starting_size <= max_size:
            raise UsageError(
                f"need 0 < min_size <= starting_size <= max_size, got {min_size}, "
                f"{starting_size}, {max_size}"
            )
        if samples < 1:
            raise UsageError(f"samples must be at least 1, got {samples}")
        self._min = min_size
        self._max = max_size
        self._alpha = 2.0 / (samples + 1)
        self._last = float(starting_size)

    @property
    def value(self) -> float:
        """The current (unrounded) average."""
        return self._last

    def calculate_buffer_size(self, total_bytes: int, total_buffers: int) -> int:
        """Move the average towards ``total_bytes / total_buffers``; return it rounded."""
        if total_bytes < 0:
            raise UsageError(f"total size must not be negative, got {total_bytes}")
        if total_buffers <= 0:
            raise UsageError(f"number of buffers must be positive, got {total_buffers}")
        desired = min(total_bytes / total_buffers, 2.0 * self._last)
        self._last += self._alpha * (desired - self._last)
        self._last = max(float(self._min), min(self._last, float(self._max)))
        # Round half up, as Java's Math.round (Python's round() rounds half to even).
        return math.floor(self._last + 0.5)


class BufferDebloaterStats(NamedTuple):
    """What the debloater's last recalculation saw and decided; ready to export as metrics.

    ``buffer_size`` is the announced size producers cut (Flink's ``debloatedBufferSize``),
    ``computed_buffer_size`` the average's latest value, announced or not.
    """

    buffer_size: int
    computed_buffer_size: int
    throughput: int
    buffers_in_use: int
    desired_total_bytes: int
    estimated_time_to_consume: float


class BufferDebloater:
    """Computes one input gate's buffer size from its throughput and buffers in use."""

    __slots__ = (
        "_buffers_in_use",
        "_computed_size",
        "_config",
        "_desired_total",
        "_ema",
        "_estimated_time",
        "_last_buffer_size",
        "_target_us",
        "_throughput",
    )

    def __init__(self, config: DebloatConfig) -> None:
        self._config = config
        self._target_us = max(1, round(config.target * _MICROS_PER_SECOND))
        start = config.starting_buffer_size
        self._ema = BufferSizeEMA(
            start, config.max_buffer_size, config.min_buffer_size, config.samples
        )
        self._last_buffer_size = start
        self._computed_size = start
        self._throughput = 0
        self._buffers_in_use = 0
        self._desired_total = 0
        self._estimated_time = 0.0

    @property
    def config(self) -> DebloatConfig:
        return self._config

    @property
    def buffer_size(self) -> int:
        """The last announced size (the starting size before the first announcement)."""
        return self._last_buffer_size

    @property
    def estimated_time_to_consume(self) -> float:
        """Seconds the task needs to consume the in-flight buffers at the last throughput."""
        return self._estimated_time

    def recalculate(self, throughput: int, buffers_in_use: int) -> int | None:
        """One period: the new size to announce, or None when it is not worth announcing.

        ``throughput`` in bytes per second; ``buffers_in_use`` over all channels of the gate
        (0 counts as 1: an idle gate still has room for one buffer).
        """
        if throughput < 0:
            raise UsageError(f"throughput must not be negative, got {throughput}")
        if buffers_in_use < 0:
            raise UsageError(f"buffers in use must not be negative, got {buffers_in_use}")
        buffers = max(1, buffers_in_use)
        # Integer arithmetic, as Flink's (which counts the target in whole milliseconds):
        # 0.3 s as a float times 100 B/s would come to 29.999... bytes.
        desired_total = throughput * self._target_us // _MICROS_PER_SECOND
        new_size = self._ema.calculate_buffer_size(desired_total, buffers)
        self._throughput = throughput
        self._buffers_in_use = buffers_in_use
        self._desired_total = desired_total
        self._computed_size = new_size
        # A gate with no throughput would take forever; as Flink, divide by at least 1 B/s.
        self._estimated_time = new_size * buffers / max(1, throughput)
        if self._skip_update(new_size):
            return None
        self._last_buffer_size = new_size
        return new_size

    def _skip_update(self, new_size: int) -> bool:
        last = self._last_buffer_size
        if new_size == last:
            return True
        # Reaching a bound is always announced, even by a small step: the producer would
        # otherwise stay just short of the minimum (or maximum) for good.
        if new_size <= self._config.min_buffer_size or new_size >= self._config.max_buffer_size:
            return False
        # Integer percent of an integer size: exact, where Flink's float factor may round.
        delta = last * self._config.threshold_percent // 100
        return abs(new_size - last) < delta

    def stats(self) -> BufferDebloaterStats:
        return BufferDebloaterStats(
            buffer_size=self._last_buffer_size,
            computed_buffer_size=self._computed_size,
            throughput=self._throughput,
            buffers_in_use=self._buffers_in_use,
            desired_total_bytes=self._desired_total,
            estimated_time_to_consume=self._estimated_time,
        )
