"""In-band events: EndOfData, EndOfPartition, CheckpointBarrier, CancelCheckpointMarker, user
events.

Events travel as buffers of ``DataType.EVENT_BUFFER`` between data buffers, never inside
one, so a record never straddles an event. Wire form: ``u8 tag | body``. Tags below 128
are the engine's; 128..255 are for user events registered with ``register_event_type``,
whose bodies are msgpack.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from dataclasses import dataclass
from enum import IntEnum
from typing import Any, ClassVar, Final

import msgpack

from exchange.buffers.buffer import Buffer, DataType
from exchange.buffers.buffer_consumer import BufferConsumer
from exchange.errors import CorruptRecordError, UsageError

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

USER_TAG_MIN: Final = 128


class AbstractEvent:
    """Base of every event."""

    __slots__ = ()


@dataclass(frozen=True, slots=True)
class EndOfPartitionEvent(AbstractEvent):
    """The producer finished this subpartition; the last event of every stream."""

    INSTANCE: ClassVar[EndOfPartitionEvent]


EndOfPartitionEvent.INSTANCE = EndOfPartitionEvent()


@dataclass(frozen=True, slots=True)
class EndOfDataEvent(AbstractEvent):
    """The producer emitted its last record (Flink's ``EndOfData``, FLIP-147).

    A streaming task sends it once its input ended and its operators' ``end_input`` ran,
    so everything ``end_input`` emitted is ahead of it. Checkpoint barriers may still
    follow (the final checkpoint's); EndOfPartition comes last. A record after it on the
    same channel is a protocol error.
    """

    INSTANCE: ClassVar[EndOfDataEvent]


EndOfDataEvent.INSTANCE = EndOfDataEvent()


class CheckpointType(IntEnum):
    CHECKPOINT = 0
    SAVEPOINT = 1


@dataclass(frozen=True, slots=True)
class CheckpointOptions:
    """How a checkpoint is taken. ``exactly_once`` selects alignment (else at least once).

    ``unaligned`` (exactly-once checkpoints only, never savepoints, as in Flink): the
    barrier is a priority event that overtakes the buffers queued ahead of it; those
    buffers become the checkpoint's channel state instead of being waited for.
    """

    checkpoint_type: CheckpointType = CheckpointType.CHECKPOINT
    exactly_once: bool = True
    unaligned: bool = False

    def __post_init__(self) -> None:
        if self.unaligned and not self.exactly_once:
            raise UsageError("an unaligned checkpoint must be exactly-once")
        if self.unaligned and self.checkpoint_type is CheckpointType.SAVEPOINT:
            raise UsageError("a savepoint is always aligned")


@dataclass(frozen=True, slots=True)
class CheckpointBarrier(AbstractEvent):
    """Marks the point in a stream where checkpoint ``checkpoint_id`` is taken."""

    checkpoint_id: int
    timestamp: int
    options: CheckpointOptions = CheckpointOptions()

    def __post_init__(self) -> None:
        if not 0 <= self.checkpoint_id < 2**63:
            raise UsageError(f"checkpoint id {self.checkpoint_id} outside [0, 2**63)")


@dataclass(frozen=True, slots=True)
class CancelCheckpointMarker(AbstractEvent):
    """Tells downstream tasks that checkpoint ``checkpoint_id`` was aborted."""

    checkpoint_id: int


class _Tag(IntEnum):
    END_OF_PARTITION = 0
    CHECKPOINT_BARRIER = 1
    CANCEL_CHECKPOINT_MARKER = 2
    END_OF_DATA = 3


#: tag | checkpoint id | timestamp | checkpoint type | flags (bit 0 exactly-once, bit 1
#: unaligned: an aligned barrier's bytes are what they were before the flag existed)
_BARRIER: Final = struct.Struct(">BQqBB")
_FLAG_EXACTLY_ONCE: Final = 1
_FLAG_UNALIGNED: Final = 2
_CANCEL: Final = struct.Struct(">BQ")

_user_by_tag: dict[int, tuple[type[AbstractEvent], Callable[[Any], Any], Callable[[Any], Any]]] = {}
_user_by_type: dict[type[AbstractEvent], int] = {}


def register_event_type(
    tag: int,
    cls: type[AbstractEvent],
    to_plain: Callable[[Any], Any],
    from_plain: Callable[[Any], Any],
) -> None:
    """Register a user event: ``to_plain(event)`` must give a msgpack-able value."""
    if not USER_TAG_MIN <= tag <= 255:
        raise UsageError(f"user event tags are {USER_TAG_MIN}..255, got {tag}")
    if tag in _user_by_tag and _user_by_tag[tag][0] is not cls:
        raise UsageError(f"event tag {tag} already registered for {_user_by_tag[tag][0]}")
    _user_by_tag[tag] = (cls, to_plain, from_plain)
    _user_by_type[cls] = tag


class EventSerializer:
    """Events to bytes and buffers, and back."""

    @staticmethod
    def to_bytes(event: AbstractEvent) -> bytes:
        match event:
            case EndOfPartitionEvent():
                return bytes((_Tag.END_OF_PARTITION,))
            case EndOfDataEvent():
                return bytes((_Tag.END_OF_DATA,))
            case CheckpointBarrier(checkpoint_id=cid, timestamp=ts, options=opts):
                flags = (_FLAG_EXACTLY_ONCE if opts.exactly_once else 0) | (
                    _FLAG_UNALIGNED if opts.unaligned else 0
                )
                return _BARRIER.pack(_Tag.CHECKPOINT_BARRIER, cid, ts, opts.checkpoint_type, flags)
            case CancelCheckpointMarker(checkpoint_id=cid):
                return _CANCEL.pack(_Tag.CANCEL_CHECKPOINT_MARKER, cid)
        tag = _user_by_type.get(type(event))
        if tag is None:
            raise UsageError(f"unregistered event type {type(event).__name__}")
        body: bytes = msgpack.packb(_user_by_tag[tag][1](event))
        return bytes((tag,)) + body

    @staticmethod
    def from_bytes(data: bytes | memoryview) -> AbstractEvent:
        """Decode an event; CorruptRecordError on anything malformed."""
        if len(data) == 0:
            raise CorruptRecordError("empty event buffer")
        tag = data[0]
        try:
            if tag == _Tag.END_OF_PARTITION and len(data) == 1:
                return EndOfPartitionEvent.INSTANCE
            if tag == _Tag.END_OF_DATA and len(data) == 1:
                return EndOfDataEvent.INSTANCE
            if tag == _Tag.CHECKPOINT_BARRIER and len(data) == _BARRIER.size:
                _, cid, ts, ctype, flags = _BARRIER.unpack(data)
                if flags & ~(_FLAG_EXACTLY_ONCE | _FLAG_UNALIGNED):
                    raise ValueError(f"bad barrier flags {flags:#x}")
                options = CheckpointOptions(
                    CheckpointType(ctype),
                    bool(flags & _FLAG_EXACTLY_ONCE),
                    bool(flags & _FLAG_UNALIGNED),
                )
                return CheckpointBarrier(cid, ts, options)
            if tag == _Tag.CANCEL_CHECKPOINT_MARKER and len(data) == _CANCEL.size:
                return CancelCheckpointMarker(_CANCEL.unpack(data)[1])
            if tag >= USER_TAG_MIN and tag in _user_by_tag:
                _, _, from_plain = _user_by_tag[tag]
                event: AbstractEvent = from_plain(msgpack.unpackb(data[1:]))
                return event
        except (ValueError, TypeError, struct.error, msgpack.UnpackException, UsageError) as e:
            raise CorruptRecordError(f"malformed event with tag {tag}: {e}") from e
        raise CorruptRecordError(f"unknown or malformed event (tag {tag}, {len(data)} bytes)")

    @staticmethod
    def to_buffer_data_type(event: AbstractEvent) -> DataType:
        """The buffer data type an event travels as (aligned barriers block upstream,
        unaligned ones overtake queued buffers)."""
        if isinstance(event, CheckpointBarrier) and event.options.exactly_once:
            if event.options.unaligned:
                return DataType.PRIORITIZED_EVENT_BUFFER
            return DataType.ALIGNED_CHECKPOINT_BARRIER
        return DataType.EVENT_BUFFER

    @staticmethod
    def to_buffer(event: AbstractEvent) -> Buffer:
        data_type = EventSerializer.to_buffer_data_type(event)
        return Buffer.wrap(EventSerializer.to_bytes(event), data_type)

    @staticmethod
    def to_buffer_consumer(event: AbstractEvent) -> BufferConsumer:
        return BufferConsumer.of_buffer(EventSerializer.to_buffer(event))

    @staticmethod
    def is_end_of_partition(buffer: Buffer) -> bool:
        """True if the event buffer holds EndOfPartition (without decoding it)."""
        return buffer.size == 1 and buffer.memoryview()[0] == _Tag.END_OF_PARTITION

    @staticmethod
    def checkpoint_id_of_priority_barrier(buffer: Buffer) -> int:
        """The checkpoint id of a priority (unaligned) barrier buffer, decoded from its
        fixed header; CorruptRecordError if the buffer is not such a barrier."""
        event = EventSerializer.from_buffer(buffer)
        if not isinstance(event, CheckpointBarrier) or not event.options.unaligned:
            raise CorruptRecordError(f"priority event {event!r} is not an unaligned barrier")
        return event.checkpoint_id

    @staticmethod
    def from_buffer(buffer: Buffer) -> AbstractEvent:
        """Decode the event in ``buffer`` (the caller still owns and releases the buffer)."""
        return EventSerializer.from_bytes(buffer.memoryview())
