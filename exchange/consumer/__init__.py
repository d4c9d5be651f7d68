"""Reading: input channels, the input gate, the record reader (network-free logic)."""

from __future__ import annotations

from exchange.consumer.input_channel import BufferAndAvailability, InputChannel
from exchange.consumer.record_reader import EventHandler, RecordReader, RecordStream
from exchange.consumer.single_input_gate import BufferOrEvent, SingleInputGate

__all__ = [
    "BufferAndAvailability",
    "BufferOrEvent",
    "EventHandler",
    "InputChannel",
    "RecordReader",
    "RecordStream",
    "SingleInputGate",
]
