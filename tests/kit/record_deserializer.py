"""RecordDeserializer: one input channel's records, rebuilt from the data buffers it receives.

Test tooling: production's RecordReader feeds each channel's codec decoder itself; tests
that hold Buffers (a subpartition's queue, a RecordWriter's output) decode them with this.

Flink's SpillingAdaptiveSpanningRecordDeserializer without the spilling: each buffer's
bytes are handed to the codec's stream decoder (which copies what it keeps) and the
buffer is released at once, so its segment goes back to its pool as soon as it is read.
A record spanning many buffers waits in the decoder until its last byte arrives.

Corrupt bytes: the records before them are returned first; the next call
(``records()``, iteration or ``set_next_buffer``) raises the CorruptRecordError, and
``has_partial_record`` stays true, so an end-of-partition check catches a corrupt tail.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from exchange.buffers.buffer import Buffer
from exchange.errors import UsageError
from exchange.serialization.record_codec import RecordCodec, default_codec

__all__ = ["RecordDeserializer"]


class RecordDeserializer:
    """Feeds a channel's data buffers to a stream decoder and hands out whole records."""

    __slots__ = ("_decoder", "_feed", "codec")

    def __init__(self, codec: RecordCodec | None = None) -> None:
        self.codec: RecordCodec = default_codec() if codec is None else codec
        self._decoder = self.codec.new_decoder()
        self._feed = self._decoder.feed

    def set_next_buffer(self, buffer: Buffer) -> None:
        """Decode the buffer's bytes and release the buffer (always, even on error).

        Raises the channel's CorruptRecordError if earlier bytes were corrupt; corrupt
        bytes in this buffer surface from ``records()`` once the good records are taken.
        """
        try:
            if not buffer.is_buffer:
                raise UsageError(f"events are not records: {buffer!r}")
            view = buffer.memoryview()
            try:
                self._feed(view)
            finally:
                view.release()
        finally:
            buffer.release()

    def records(self) -> list[Any]:
        """Every whole record received and not yet returned, in order (maybe none)."""
        return self._decoder.take()

    def __iter__(self) -> Iterator[Any]:
        return iter(self._decoder)

    @property
    def has_partial_record(self) -> bool:
        """True while part of a record waits for the next buffer (or the stream failed)."""
        return self._decoder.has_partial_record

    @property
    def buffered_bytes(self) -> int:
        """Bytes of the partial record held (copied out of released buffers)."""
        return self._decoder.buffered_bytes

    def clear(self) -> None:
        """Forget the partial record and undelivered records (channel released)."""
        self._decoder.clear()

    def __repr__(self) -> str:
        return f"RecordDeserializer({self.codec!r}, buffered={self.buffered_bytes})"
