"""Writing into a partition of the test's own process: the in-process write path.

Production writes through the daemon (``client.producer``); tests that exercise a
partition, a gate or a reader without a task process write with ``ResultPartitionWriter``:
the same ``AsyncRecordWriter`` over a ``ResultPartitionSink``, which copies each buffer
into a segment of the partition's LocalBufferPool and queues it with
``ResultPartition.add_buffer``, exactly as the daemon queues the buffers a task pushes.
"""

from __future__ import annotations

import time

from exchange.buffers.buffer import Buffer
from exchange.errors import PoolDestroyedError
from exchange.events.events import EventSerializer
from exchange.partition.result_partition import ResultPartition
from exchange.serialization.record_codec import RecordCodec
from exchange.writer.async_record_writer import AsyncRecordWriter
from exchange.writer.channel_selector import ChannelSelector, RoundRobinSelector
from exchange.writer.record_writer import DEFAULT_BUFFER_TIMEOUT, OutputBuffer, RecordWriter

__all__ = ["ResultPartitionSink", "ResultPartitionWriter"]


class ResultPartitionSink:
    """A partition in this process: buffers copied into its segments, then queued."""

    def __init__(self, partition: ResultPartition) -> None:
        self.partition = partition

    @property
    def name(self) -> str:
        return str(self.partition.partition_id)

    def check_writable(self) -> None:
        self.partition.check_writable()

    async def write(self, out: OutputBuffer) -> None:
        partition = self.partition
        if out.is_event:
            partition.broadcast_event(EventSerializer.from_bytes(out.pieces[0]))
            return
        buf = await self._request_buffer()
        view = buf.segment.view()
        pos = 0
        for piece in out.pieces:
            n = len(piece)
            view[pos : pos + n] = piece
            pos += n
        buf.set_size(pos)
        partition.add_buffer(out.target, buf)

    async def _request_buffer(self) -> Buffer:
        partition = self.partition
        pool = partition.buffer_pool
        while True:
            partition.check_writable()
            try:
                buf = pool.request_buffer()
            except PoolDestroyedError:
                partition.check_writable()
                raise
            if buf is not None:
                return buf
            start = time.monotonic()
            try:
                await pool.get_available_future()
            finally:
                partition.record_back_pressure(time.monotonic() - start)

    async def finish(self) -> None:
        self.partition.finish()

    async def fail(self, cause: BaseException | None) -> None:
        if not self.partition.is_released:
            self.partition.fail(cause)


class ResultPartitionWriter(AsyncRecordWriter):
    """The writer of an in-process ResultPartition. Without a selector, records go round
    robin (Flink's default for an unkeyed exchange); ``emit(record, key=...)`` and
    ``emit_to`` pick their target themselves."""

    def __init__(
        self,
        partition: ResultPartition,
        selector: ChannelSelector | None = None,
        codec: RecordCodec | None = None,
        *,
        buffer_timeout: float = DEFAULT_BUFFER_TIMEOUT,
    ) -> None:
        super().__init__(
            RecordWriter(
                partition.num_subpartitions,
                buffer_size=partition.segment_size,
                codec=codec,
                selector=selector if selector is not None else RoundRobinSelector(),
                buffer_timeout=buffer_timeout,
            ),
            ResultPartitionSink(partition),
        )
        self.partition = partition

    def _check_writable(self) -> None:
        super()._check_writable()
        self._sync_buffer_sizes()

    async def _move(self, *, quiet: bool = False) -> None:
        self._sync_buffer_sizes()
        await super()._move(quiet=quiet)

    def _sync_buffer_sizes(self) -> None:
        """A consumer's NewBufferSize lands on its subpartition: new buffers take it."""
        writer = self.writer
        for i, sub in enumerate(self.partition.subpartitions):
            size = sub.buffer_size
            if size != writer.buffer_size(i):
                writer.set_buffer_size(i, size)
