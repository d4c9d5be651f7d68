"""In-band events."""

from __future__ import annotations

from exchange.events.events import (
    AbstractEvent,
    CancelCheckpointMarker,
    CheckpointBarrier,
    CheckpointOptions,
    CheckpointType,
    EndOfDataEvent,
    EndOfPartitionEvent,
    EventSerializer,
    register_event_type,
)

__all__ = [
    "AbstractEvent",
    "CancelCheckpointMarker",
    "CheckpointBarrier",
    "CheckpointOptions",
    "CheckpointType",
    "EndOfDataEvent",
    "EndOfPartitionEvent",
    "EventSerializer",
    "register_event_type",
]
