"""One input gate's debloating: throughput, period and buffer size behind one object.

The gate (or the reader driving it) reports what it returns and when it runs empty; the
asyncio code wakes up at ``next_deadline`` and calls ``tick``; a returned size goes to every
open channel as NewBufferSize. Flink's ``SingleInputGate.triggerDebloating`` plus the
``StreamTask`` timer that calls it. States (the table ``_TRANSITIONS`` has them all)::

    enabled ─▶ IDLE ──channels open──▶ RUNNING ──no channel open──▶ IDLE
    disabled ─▶ DISABLED                     any ──close──▶ CLOSED (for good)
"""

from __future__ import annotations

import dataclasses
from enum import Enum
from typing import Final

from exchange.debloat.buffer_debloater import BufferDebloater, BufferDebloaterStats
from exchange.debloat.config import DebloatConfig
from exchange.debloat.debloat_timer import DebloatTimer
from exchange.debloat.throughput_calculator import Clock, ThroughputCalculator
from exchange.errors import IllegalStateError, UsageError

__all__ = ["GateDebloater", "GateDebloaterState"]


class GateDebloaterState(Enum):
    """Whether the gate's debloater runs."""

    DISABLED = "disabled"  # debloating is off: never runs, producers cut whole segments
    IDLE = "idle"  # enabled, but the gate has no open channel to announce to
    RUNNING = "running"  # enabled with open channels: runs every period
    CLOSED = "closed"  # the gate finished or closed: never runs again


class _Event(Enum):
    CHANNELS_OPEN = "channels_open"
    NO_CHANNEL_OPEN = "no_channel_open"
    CLOSE = "close"


_S = GateDebloaterState
_TRANSITIONS: Final[dict[tuple[GateDebloaterState, _Event], GateDebloaterState]] = {
    (_S.DISABLED, _Event.CHANNELS_OPEN): _S.DISABLED,
    (_S.DISABLED, _Event.NO_CHANNEL_OPEN): _S.DISABLED,
    (_S.DISABLED, _Event.CLOSE): _S.CLOSED,
    (_S.IDLE, _Event.CHANNELS_OPEN): _S.RUNNING,
    (_S.IDLE, _Event.NO_CHANNEL_OPEN): _S.IDLE,
    (_S.IDLE, _Event.CLOSE): _S.CLOSED,
    (_S.RUNNING, _Event.CHANNELS_OPEN): _S.RUNNING,
    (_S.RUNNING, _Event.NO_CHANNEL_OPEN): _S.IDLE,
    (_S.RUNNING, _Event.CLOSE): _S.CLOSED,
    (_S.CLOSED, _Event.NO_CHANNEL_OPEN): _S.CLOSED,
    (_S.CLOSED, _Event.CLOSE): _S.CLOSED,
    # (CLOSED, CHANNELS_OPEN) is missing on purpose: a closed gate opens no channel.
}


class GateDebloater:
    """Debloating of one input gate: feed it the gate's data, tick it every period.

    ``clock`` measures the throughput; ``tick``'s ``now`` must come from the same clock
    (``loop.time()`` and ``time.monotonic()`` agree on asyncio's default loop).
    """

    __slots__ = ("_calculator", "_clock", "_config", "_debloater", "_state", "_timer")

    def __init__(self, config: DebloatConfig, clock: Clock, *, open_channels: int = 1) -> None:
        self._config = config
        self._clock = clock
        self._calculator = ThroughputCalculator(clock)
        self._timer = DebloatTimer(config.period, clock())
        if config.enabled:
            self._debloater = BufferDebloater(config)
            self._state = GateDebloaterState.IDLE
        else:
            # Off means whole segments, whatever the starting size says.
            full = dataclasses.replace(config, initial_buffer_size=config.max_buffer_size)
            self._debloater = BufferDebloater(full)
            self._state = GateDebloaterState.DISABLED
        self.set_open_channels(open_channels)

    @property
    def state(self) -> GateDebloaterState:
        return self._state

    @property
    def config(self) -> DebloatConfig:
        return self._config

    @property
    def buffer_size(self) -> int:
        """The size producers should cut: the last announced one, or the segment size if off."""
        return self._debloater.buffer_size

    @property
    def next_deadline(self) -> float | None:
        """When ``tick`` has work next; None while the debloater does not run."""
        if self._state is GateDebloaterState.RUNNING:
            return self._timer.next_deadline
        return None

    def _handle(self, event: _Event) -> None:
        try:
            new_state = _TRANSITIONS[(self._state, event)]
        except KeyError:
            raise IllegalStateError(
                f"gate debloater: {event.value} not allowed in state {self._state.value}"
            ) from None
        if new_state is GateDebloaterState.RUNNING and self._state is not new_state:
            # Periods start when there is something to run for, not at construction.
            self._timer.restart(self._clock())
        self._state = new_state

    def set_open_channels(self, count: int) -> None:
        """The number of the gate's channels that can still receive NewBufferSize."""
        if count < 0:
            raise UsageError(f"open channel count must not be negative, got {count}")
        self._handle(_Event.CHANNELS_OPEN if count > 0 else _Event.NO_CHANNEL_OPEN)

    def close(self) -> None:
        """The gate finished or closed: the debloater never runs again."""
        self._handle(_Event.CLOSE)

    def on_data(self, nbytes: int) -> None:
        """The gate returned a buffer or event of ``nbytes`` to its task."""
        self._calculator.on_data(nbytes)

    def on_gate_empty(self) -> None:
        """The gate has nothing to return: time stops counting towards throughput."""
        self._calculator.pause_measurement()

    def on_gate_non_empty(self) -> None:
        """The gate has data to return again."""
        self._calculator.resume_measurement()

    def tick(self, now: float, queued_buffers: int, backlog: int) -> int | None:
        """Run the debloater if its period is due: the size to announce, or None.

        ``queued_buffers`` and ``backlog`` are summed over the gate's channels: buffers
        received and not yet consumed, and buffers the producers announced as backlog.
        """
        if self._state is not GateDebloaterState.RUNNING or not self._timer.due(now):
            return None
        return self.debloat(queued_buffers, backlog)

    def debloat(self, queued_buffers: int, backlog: int) -> int | None:
        """Recalculate now, whatever the timer says (Flink's ``triggerDebloating``)."""
        if queued_buffers < 0 or backlog < 0:
            raise UsageError(
                f"queued buffers and backlog must not be negative, got {queued_buffers}, {backlog}"
            )
        if self._state is not GateDebloaterState.RUNNING:
            return None
        throughput = self._calculator.calculate_throughput()
        return self._debloater.recalculate(throughput, queued_buffers + backlog)

    def stats(self) -> BufferDebloaterStats:
        """The last recalculation's figures (the gate's debloating metrics)."""
        return self._debloater.stats()
