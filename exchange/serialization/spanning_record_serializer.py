"""SpanningRecordSerializer: records into an intermediate buffer, then into BufferBuilders.

Records are encoded once, appended to one intermediate ``bytearray``, and copied from
there into as many BufferBuilders as they need (records span buffers freely). The buffer
may hold several records: a writer serializes small records until ``pending_bytes``
reaches its builder's ``writable_bytes`` (or it flushes), then copies. Pending bytes
belong to one channel, so a writer that holds records back keeps one serializer per
channel. ``serialize_until`` is the batch path: it fills the buffer from an iterator with
one call (and, for msgpack, without a bytes object per record).

The bytes between the read position and the end are *pending*. Copying moves the read
position through memoryview slices (no concatenation). Once everything is copied, the
batch is set aside and the next record starts a new, empty one; until then ``reset()``
can bring the batch back to copy the same bytes into another builder (the
BroadcastRecordWriter serializes a record once and copies it to every channel).
``prune()`` drops the set-aside batch and shrinks a buffer grown by a large record.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable, Iterator
from enum import Enum
from typing import Any, Final

from exchange.buffers.buffer_builder import BufferBuilder
from exchange.errors import RecordTooLargeError, UsageError
from exchange.serialization.codec import BytesLike, MsgpackCodec, RecordCodec

__all__ = ["DEFAULT_INITIAL_CAPACITY", "SerializationResult", "SpanningRecordSerializer"]

#: What ``prune()`` shrinks the intermediate buffer back to.
DEFAULT_INITIAL_CAPACITY: Final = 32 * 1024


class SerializationResult(Enum):
    """What ``copy_to_buffer_builder`` achieved (Flink's names).

    "Full record" means every pending byte was copied.
    """

    FULL_RECORD = (True, False)
    FULL_RECORD_MEMORY_SEGMENT_FULL = (True, True)
    PARTIAL_RECORD_MEMORY_SEGMENT_FULL = (False, True)

    def __init__(self, full_record: bool, full_buffer: bool) -> None:
        # Plain attributes, not properties: writers test them once per buffer.
        #: All pending bytes were copied.
        self.is_full_record = full_record
        #: The builder is full: finish it and take a new one.
        self.is_full_buffer = full_buffer


_FULL_RECORD: Final = SerializationResult.FULL_RECORD
_FULL_RECORD_SEGMENT_FULL: Final = SerializationResult.FULL_RECORD_MEMORY_SEGMENT_FULL
_PARTIAL_RECORD: Final = SerializationResult.PARTIAL_RECORD_MEMORY_SEGMENT_FULL


class SpanningRecordSerializer:
    """Serializes records once and copies them into BufferBuilders, spanning buffers."""

    __slots__ = (
        "_buf",
        "_encode",
        "_encode_into",
        "_encode_until",
        "_initial_capacity",
        "_last",
        "_limit",
        "_read",
        "codec",
    )

    def __init__(
        self,
        codec: RecordCodec | None = None,
        initial_capacity: int = DEFAULT_INITIAL_CAPACITY,
    ) -> None:
        if (
            not isinstance(initial_capacity, int)
            or isinstance(initial_capacity, bool)
            or initial_capacity <= 0
        ):
            raise UsageError(f"initial_capacity must be a positive int, got {initial_capacity!r}")
        self.codec: RecordCodec = MsgpackCodec() if codec is None else codec
        encoder = self.codec.new_encoder()
        self._encode: Callable[[Any], BytesLike] | None = encoder.encode
        self._encode_into = encoder.encode_into
        self._encode_until = encoder.encode_until
        self._limit = encoder.max_record_size
        self._initial_capacity = initial_capacity
        self._buf = bytearray()  # the current batch
        self._read = 0  # bytes of the batch already copied
        self._last: bytearray | None = None  # the previous, fully copied batch, for reset()

    # -- state ---------------------------------------------------------------------------

    @property
    def pending_bytes(self) -> int:
        """Serialized bytes not yet copied to a builder."""
        return len(self._buf) - self._read

    @property
    def has_serialized_data(self) -> bool:
        return self._read < len(self._buf)

    @property
    def capacity(self) -> int:
        """Bytes the intermediate buffers have allocated."""
        last = self._last
        return self._buf.__alloc__() + (0 if last is None else last.__alloc__())

    @property
    def initial_capacity(self) -> int:
        return self._initial_capacity

    # -- serializing ---------------------------------------------------------------------

    def serialize_record(self, record: Any) -> int:
        """Append one record; returns ``pending_bytes``."""
        buf = self._buf
        encode = self._encode
        if encode is None:
            self._encode_into(record, buf)
            return len(buf) - self._read
        data = encode(record)
        buf += data
        pending = len(buf) - self._read
        if pending > self._limit and len(data) > self._limit:
            self._reject(data)
        return pending

    def serialize_until(self, records: Iterator[Any], pending_limit: int) -> int:
        """Serialize from ``records`` until ``pending_bytes >= pending_limit``.

        The fast path for a writer that fills builders from a batch: pass the builder's
        ``writable_bytes``, copy, repeat with the same iterator. Returns
        ``pending_bytes``; a result below ``pending_limit`` means ``records`` is
        exhausted. If a record fails to encode, the other records taken from the
        iterator stay serialized (see ``RecordEncoder.encode_until``).
        """
        read = self._read
        self._encode_until(records, self._buf, read + pending_limit)
        return len(self._buf) - read

    def serialize_records(self, records: Iterable[Any]) -> int:
        """Serialize every record; returns ``pending_bytes``."""
        return self.serialize_until(iter(records), sys.maxsize)

    def _reject(self, data: BytesLike) -> None:
        n = len(data)
        del self._buf[len(self._buf) - n :]
        raise RecordTooLargeError(n, self._limit)

    # -- copying -------------------------------------------------------------------------

    def copy_to_buffer_builder(self, builder: BufferBuilder) -> SerializationResult:
        """Copy as many pending bytes as fit into ``builder``."""
        buf = self._buf
        read = self._read
        end = len(buf)
        if read < end:
            view = memoryview(buf)
            try:
                read += builder.append(view[read:end])
            finally:
                view.release()
            if read < end:
                self._read = read
                return _PARTIAL_RECORD
            # All copied: start a new batch, keeping this one for reset().
            self._last = buf
            self._buf = bytearray()
            self._read = 0
        return _FULL_RECORD_SEGMENT_FULL if builder.is_full else _FULL_RECORD

    def reset(self) -> None:
        """Rewind to the first byte of the current batch, to copy it into another builder.

        The batch is everything serialized since the serializer was last fully copied;
        right after a full copy (before anything new is serialized), that last batch.
        """
        last = self._last
        self._last = None
        if last is not None and not self._buf:
            self._buf = last
        self._read = 0

    def prune(self) -> None:
        """Drop copied bytes and shrink a buffer that grew for a large record.

        Afterwards ``capacity`` is at most ``max(initial_capacity, pending_bytes) + 1``;
        ``reset()`` can no longer rewind to the dropped bytes.
        """
        self._last = None
        buf = self._buf
        read = self._read
        if read == len(buf):
            self._buf = bytearray()
        elif read or buf.__alloc__() > self._initial_capacity + 1:
            # A fresh, exactly sized copy: del buf[:read] could keep the allocation.
            self._buf = bytearray(memoryview(buf)[read:])
        self._read = 0

    def clear(self) -> None:
        """Drop all serialized bytes, copied or not."""
        self._buf = bytearray()
        self._last = None
        self._read = 0

    def __repr__(self) -> str:
        return (
            f"SpanningRecordSerializer({self.codec!r}, pending={self.pending_bytes}, "
            f"capacity={self.capacity})"
        )
