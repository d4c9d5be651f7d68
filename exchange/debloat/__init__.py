"""Buffer debloating (Flink 1.14+): keep each input gate's in-flight data near a target time.

Per input gate, every ``period``: the :class:`ThroughputCalculator` says how many bytes per
second the task consumed (time counted only while data flowed), the
:class:`BufferDebloater` turns throughput x ``target`` into a buffer size over the buffers
in use, and a changed size goes upstream as NewBufferSize, so producers cut smaller
buffers and less data waits in front of a slow task (and of a checkpoint barrier).
:class:`GateDebloater` puts the pieces together for one gate; no I/O, clock injected.
"""

from __future__ import annotations

from exchange.debloat.buffer_debloater import BufferDebloater, BufferDebloaterStats, BufferSizeEMA
from exchange.debloat.config import DEFAULT_INITIAL_BUFFER_SIZE, DebloatConfig
from exchange.debloat.debloat_timer import DebloatTimer
from exchange.debloat.gate_debloater import GateDebloater, GateDebloaterState
from exchange.debloat.throughput_calculator import Clock, ThroughputCalculator

__all__ = [
    "DEFAULT_INITIAL_BUFFER_SIZE",
    "BufferDebloater",
    "BufferDebloaterStats",
    "BufferSizeEMA",
    "Clock",
    "DebloatConfig",
    "DebloatTimer",
    "GateDebloater",
    "GateDebloaterState",
    "ThroughputCalculator",
]
