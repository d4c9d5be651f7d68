"""RecordReader: records out of a SingleInputGate, one decoder per channel.

``RecordStream`` is the one decode and event path every reader shares (this async
``RecordReader`` and the synchronous ``client.consumer.PartitionReader``, which runs it in
the task thread): a data buffer's bytes go to its channel's stream decoder (which copies
what it keeps, so the buffer can be released right after), whole records come out in
order; a record may span any number of buffers. Events go to an optional handler, in
order with the records. A channel that ends inside a record is a CorruptRecordError,
never a silently dropped tail.

End of data (FLIP-147): ``end_of_data`` turns True once every channel delivered its
EndOfData event (the producers' last records are in; barriers and EndOfPartition may still
follow). A channel's record after its EndOfData, or a second EndOfData, is a ProtocolError.

Checkpoints: with a ``CheckpointBarrierHandler`` (``exchange.checkpointing``) the handler
sits between the gate and the decoder: it takes every buffer and event first, consumes
barriers and cancellation markers (calling the task's ``trigger_checkpoint`` at the exact
point between the records before and after the barrier), resumes aligned channels itself,
and may park input and replay it. Without one, aligned checkpoint barriers reach the event
handler, which takes charge of resuming by returning True; otherwise, with
``auto_resume_barriers`` (the default for plain record readers) the reader resumes at
once after the handler ran; with ``auto_resume_barriers=False`` a barrier nobody resumes
stalls its channel.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

from exchange.consumer.single_input_gate import BufferOrEvent, SingleInputGate
from exchange.errors import CorruptRecordError, IllegalStateError, ProtocolError
from exchange.events.events import (
    AbstractEvent,
    CheckpointBarrier,
    EndOfDataEvent,
    EndOfPartitionEvent,
)
from exchange.serialization.framing import feed_batch
from exchange.serialization.record_codec import RecordCodec, default_codec

if TYPE_CHECKING:
    from exchange.checkpointing.barrier_handler import CheckpointBarrierHandler

__all__ = ["EventHandler", "RecordReader", "RecordStream"]

#: ``handler(event, channel_index) -> bool``: True means "I resume consumption myself".
EventHandler = Callable[[AbstractEvent, int], bool | None]


class RecordStream:
    """Decoding and event dispatch for a set of channels; no I/O, no buffers kept."""

    __slots__ = (
        "_auto_resume",
        "_decoders",
        "_ended_data",
        "_handler",
        "_resume",
        "codec",
        "records_in",
    )

    def __init__(
        self,
        codec: RecordCodec,
        num_channels: int,
        resume: Callable[[int], None],
        event_handler: EventHandler | None = None,
        *,
        auto_resume_barriers: bool = True,
    ) -> None:
        self.codec = codec
        self._decoders = [codec.new_decoder() for _ in range(num_channels)]
        self._resume = resume
        self._handler = event_handler
        self._auto_resume = auto_resume_barriers
        self._ended_data: set[int] = set()  # channels that delivered EndOfData
        self.records_in = 0

    @property
    def end_of_data(self) -> bool:
        """True once every channel delivered EndOfData (its producer's last record)."""
        return len(self._ended_data) == len(self._decoders)

    def feed(self, channel: int, data: memoryview) -> list[Any]:
        """The records completed by ``data`` (copied as needed; the caller may release)."""
        if self._ended_data and channel in self._ended_data:
            raise ProtocolError(f"channel {channel} sent data after its EndOfData")
        dec = self._decoders[channel]
        dec.feed(data)
        records = dec.take()
        self.records_in += len(records)
        return records

    def feed_batch(self, batch: list[tuple[int, int, Any]], out: list[Any]) -> None:
        """``feed`` of every data buffer of a reader's hand-off batch, in one compiled loop
        (``framing.feed_batch``): ``(kind, channel, records)`` into ``out`` per buffer that
        completed records, other items as they are."""
        self.records_in += feed_batch(self._decoders, self._ended_data, batch, out)

    def unconsumed_bytes(self, channel: int) -> bytes:
        """The bytes of ``channel``'s incomplete record, as fed (b"" at a boundary)."""
        return self._decoders[channel].unconsumed_bytes()

    def restore_unconsumed(self, channel: int, data: bytes) -> None:
        """Feed ``channel``'s persisted incomplete record to its decoder, before any
        buffer of it (unaligned restore): it must complete no record."""
        if self._decoders[channel].has_partial_record:
            raise IllegalStateError(f"channel {channel} already holds part of a record")
        if data:
            records = self.feed(channel, memoryview(data))
            if records:
                raise CorruptRecordError(
                    f"the persisted incomplete record of channel {channel} holds "
                    f"{len(records)} whole records"
                )

    def on_event(self, event: AbstractEvent, channel: int) -> None:
        """Check the channel's stream at its end, run the handler, resume if due."""
        if isinstance(event, EndOfPartitionEvent):
            dec = self._decoders[channel]
            if dec.has_partial_record:
                raise CorruptRecordError(
                    f"channel {channel} ended inside a record "
                    f"({dec.buffered_bytes} bytes of an incomplete record)"
                )
        elif isinstance(event, EndOfDataEvent):
            if channel in self._ended_data:
                raise ProtocolError(f"channel {channel} sent EndOfData twice")
            dec = self._decoders[channel]
            if dec.has_partial_record:
                raise CorruptRecordError(
                    f"channel {channel} ended its data inside a record "
                    f"({dec.buffered_bytes} bytes of an incomplete record)"
                )
            self._ended_data.add(channel)
        handled = self._handler(event, channel) if self._handler is not None else None
        if (
            self._auto_resume
            and not handled
            and isinstance(event, CheckpointBarrier)
            and event.options.exactly_once
        ):
            self._resume(channel)

    def clear(self) -> None:
        for d in self._decoders:
            d.clear()


class RecordReader:
    """Iterate records (``async for``) or batches (``next_batch``) from a gate."""

    def __init__(
        self,
        gate: SingleInputGate,
        codec: RecordCodec | None = None,
        event_handler: EventHandler | None = None,
        *,
        auto_resume_barriers: bool = True,
        barrier_handler: CheckpointBarrierHandler | None = None,
    ) -> None:
        self.gate = gate
        self.barrier_handler = barrier_handler
        self.codec: RecordCodec = codec if codec is not None else default_codec()
        self.stream = RecordStream(
            self.codec,
            len(gate.channels),
            gate.resume_consumption,
            event_handler,
            auto_resume_barriers=auto_resume_barriers,
        )

    @property
    def records_in(self) -> int:
        return self.stream.records_in

    def resume_consumption(self, channel_index: int) -> None:
        """Unblock a channel after its aligned barrier."""
        self.gate.resume_consumption(channel_index)

    async def next_batch(self) -> list[Any] | None:
        """The records available next (never empty), or None at the end of input."""
        gate = self.gate
        stream = self.stream
        handler = self.barrier_handler
        while True:
            boe: BufferOrEvent | None = None
            if handler is not None:
                boe = handler.poll_next()  # parked input is replayed before newer input
            if boe is None:
                boe = gate.poll_next()
                if boe is None:
                    boe = await gate.get_next()
                    if boe is None:
                        return None
                if handler is not None:
                    boe = handler.process(boe)
                    if boe is None:
                        continue  # a barrier or marker was consumed, or input parked
            buf = boe.buffer
            if buf is not None:
                try:
                    view = buf.memoryview()
                    try:
                        records = stream.feed(boe.channel_index, view)
                    finally:
                        view.release()
                finally:
                    buf.release()
                if records:
                    return records
                continue
            event = boe.event
            assert event is not None
            stream.on_event(event, boe.channel_index)

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
        self.stream.clear()
        if self.barrier_handler is not None:
            self.barrier_handler.close()
        self.gate.close()
