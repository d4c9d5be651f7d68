"""RecordReader: records out of a SingleInputGate, one deserializer per channel.

Data buffers are fed to their channel's deserializer (which copies the bytes out and
releases the buffer at once) and come out as batches of whole records; a record may span
any number of buffers. Events go to an optional handler. A channel that ends inside a
record is a CorruptRecordError, never a silently dropped tail.

Aligned checkpoint barriers block their subpartition until consumption is resumed; with
no handler taking charge of alignment (``handler`` returns True), the reader resumes
at once, which makes barriers harmless for plain record readers.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

from exchange.consumer.single_input_gate import SingleInputGate
from exchange.errors import CorruptRecordError
from exchange.events.events import AbstractEvent, CheckpointBarrier, EndOfPartitionEvent
from exchange.serialization.codec import RecordCodec, default_codec
from exchange.serialization.record_deserializer import RecordDeserializer

__all__ = ["EventHandler", "RecordReader"]

#: ``handler(event, channel_index) -> bool``: True means "I resume consumption myself".
EventHandler = Callable[[AbstractEvent, int], bool | None]


class RecordReader:
    """Iterate records (``async for``) or batches (``next_batch``) from a gate."""

    def __init__(
        self,
        gate: SingleInputGate,
        codec: RecordCodec | None = None,
        event_handler: EventHandler | None = None,
    ) -> None:
        self.gate = gate
        self.codec: RecordCodec = codec if codec is not None else default_codec()
        self._deserializers = [RecordDeserializer(self.codec) for _ in gate.channels]
        self._handler = event_handler
        self.records_in = 0

    async def next_batch(self) -> list[Any] | None:
        """The records available next (never empty), or None at the end of input."""
        gate = self.gate
        desers = self._deserializers
        while True:
            boe = gate.poll_next()
            if boe is None:
                boe = await gate.get_next()
                if boe is None:
                    return None
            buf = boe.buffer
            if buf is not None:
                deser = desers[boe.channel_index]
                deser.set_next_buffer(buf)
                records = deser.records()
                if records:
                    self.records_in += len(records)
                    return records
                continue
            event = boe.event
            assert event is not None
            self._on_event(event, boe.channel_index)

    def _on_event(self, event: AbstractEvent, channel: int) -> None:
        if isinstance(event, EndOfPartitionEvent):
            deser = self._deserializers[channel]
            if deser.has_partial_record:
                raise CorruptRecordError(
                    f"channel {channel} ended inside a record "
                    f"({deser.buffered_bytes} bytes of an incomplete record)"
                )
        handled = self._handler(event, channel) if self._handler is not None else None
        if isinstance(event, CheckpointBarrier) and event.options.exactly_once and not handled:
            self.gate.resume_consumption(channel)

    async def __aiter__(self) -> AsyncIterator[Any]:
        while True:
            batch = await self.next_batch()
            if batch is None:
                return
            for record in batch:
                yield record

    async def read_all(self) -> list[Any]:
        out: list[Any] = []
        while True:
            batch = await self.next_batch()
            if batch is None:
                return out
            out.extend(batch)

    def close(self) -> None:
        for d in self._deserializers:
            d.clear()
        self.gate.close()
