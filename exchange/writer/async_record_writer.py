"""AsyncRecordWriter: the asyncio driver of the one write path.

``AsyncRecordWriter`` drives a ``RecordWriter`` from asyncio code: it emits into the
writer and moves the buffers the writer cuts to a ``BufferSink``, waiting there when the
sink cannot take more (backpressure). A background task flushes every ``buffer_timeout``
seconds (Flink's output flusher), so a producer stalled on slow input still makes its data
readable. Production's sink is the daemon connection of ``client.producer`` (producer
tasks); the tests also write into a partition of their own process
(``tests/kit/partition_writer.py``).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterable
from typing import Any, Final, Protocol

from exchange.best_effort import best_effort, cancel_and_wait
from exchange.errors import ExchangeError, PartitionError, WriterClosedError
from exchange.events.events import AbstractEvent
from exchange.writer.record_writer import (
    ALL_SUBPARTITIONS,
    OutputBuffer,
    RecordWriter,
)

__all__ = ["AsyncRecordWriter", "BufferSink", "run_output_flusher"]

log = logging.getLogger("exchange.writer")

_NO_KEY: Final[Any] = object()
#: Records taken from ``emit_all``'s iterable between two moves of the cut buffers.
_CHUNK: Final = 4096


async def run_output_flusher(
    writer: RecordWriter,
    flush_pass: Callable[[], Awaitable[object]],
    running: Callable[[], bool],
) -> None:
    """The output flusher of both writers (Flink's ``OutputFlusher``): while ``running()``,
    sleep until ``writer``'s pending output is due (``next_flush_deadline``; at most
    ``buffer_timeout``), then run ``flush_pass`` (which flushes what is due and moves it).

    The asyncio writer runs it with the sink as mover; the synchronous facade
    (``client.producer.PartitionWriter``) from its loop thread, with a pass that takes
    the writer's lock (or skips the pass while the task thread holds it: that thread
    checks the timeout itself). The deadline read without that lock may be stale: it only
    shortens or lengthens one sleep, never beyond ``buffer_timeout``."""
    interval = writer.buffer_timeout
    loop = asyncio.get_running_loop()
    while running():
        deadline = writer.next_flush_deadline
        delay = interval if deadline is None else max(0.0, deadline - loop.time())
        await asyncio.sleep(min(delay, interval))
        if running():
            await flush_pass()


class BufferSink(Protocol):
    """Where an AsyncRecordWriter's buffers go."""

    @property
    def name(self) -> str: ...

    def check_writable(self) -> None:
        """Raise the typed error that says why nothing may be written any more."""

    async def write(self, out: OutputBuffer) -> None:
        """Take one buffer or event, waiting while the sink is full (backpressure)."""

    async def finish(self) -> None:
        """Every buffer was written: end the partition (EndOfPartition everywhere)."""

    async def fail(self, cause: BaseException | None) -> None:
        """The producer failed: readers must get an error, never a short read."""


class AsyncRecordWriter:
    """Writes records through a RecordWriter into a BufferSink. One task at a time."""

    def __init__(self, writer: RecordWriter, sink: BufferSink) -> None:
        self.writer = writer
        self.sink = sink
        self.codec = writer.codec
        self.num_channels = writer.num_subpartitions
        self._flusher: asyncio.Task[None] | None = None
        self._move_lock = asyncio.Lock()
        self._failed: dict[int, PartitionError] = {}  # subpartitions whose reader left
        self._closed = False

    @property
    def records_out(self) -> int:
        return self.writer.stats.records_out

    # -- emitting ------------------------------------------------------------------------

    async def emit(self, record: Any, key: Any = _NO_KEY) -> None:
        """Emit to the subpartition the selector (or ``key``'s hash) picks."""
        self._check_writable()
        if key is _NO_KEY:
            self.writer.emit(record)
        else:
            self.writer.emit(record, key)
        await self._move()

    async def emit_to(self, record: Any, target: int) -> None:
        self._check_writable()
        self.writer.emit_to(record, target)
        await self._move()

    async def emit_all(self, records: Iterable[Any], **routing: Any) -> int:
        """Emit many records (routed as ``RecordWriter.emit_all``); returns how many."""
        self._check_writable()
        writer = self.writer
        it = iter(records)
        n = 0
        while True:
            chunk = [r for _, r in zip(range(_CHUNK), it, strict=False)]
            if not chunk:
                return n
            n += writer.emit_all(chunk, **routing)
            await self._move()

    async def broadcast_emit(self, record: Any) -> None:
        """Emit one record to every subpartition (encoded once)."""
        self._check_writable()
        self.writer.broadcast(record)
        await self._move()

    async def broadcast_event(self, event: AbstractEvent) -> None:
        """Send ``event`` to every subpartition after every record emitted so far."""
        self._check_writable()
        self.writer.broadcast_event(event)
        await self._move()

    async def broadcast_barrier(
        self, checkpoint_id: int, timestamp: int, *, aligned: bool = True
    ) -> None:
        self._check_writable()
        self.writer.broadcast_barrier(checkpoint_id, timestamp, aligned=aligned)
        await self._move()

    async def broadcast_cancel(self, checkpoint_id: int) -> None:
        self._check_writable()
        self.writer.broadcast_cancel(checkpoint_id)
        await self._move()

    async def flush(self) -> None:
        """Make everything emitted so far readable (may wait for the sink)."""
        self._check_writable()
        self.writer.flush()
        await self._move()
        self._raise_failed()

    def set_buffer_size(self, target: int, size: int) -> None:
        self.writer.set_buffer_size(target, size)

    # -- moving buffers ------------------------------------------------------------------

    async def _move(self, *, quiet: bool = False) -> None:
        """Move the cut buffers to the sink, in order.

        A subpartition whose reader left refuses its buffers with a PartitionError: the
        task hears it (at once, or at its next write into that subpartition, flush or
        close when the flusher met it, ``quiet``); the other subpartitions go on.
        """
        if self._flusher is None and self.writer.buffer_timeout > 0 and not self._closed:
            self._flusher = asyncio.get_running_loop().create_task(
                self._run_flusher(), name=f"output-flusher[{self.sink.name}]"
            )
        # One mover at a time (the task or the flusher), in order; the task waits for the
        # flusher's move, so backpressure still reaches it.
        async with self._move_lock:
            writer = self.writer
            write = self.sink.write
            failed = self._failed
            while writer.has_output:
                for out in writer.take_output():
                    target = out.target
                    if target in failed:
                        if quiet:
                            continue
                        raise failed[target]
                    try:
                        await write(out)
                    except PartitionError as e:
                        if out.is_event or target == ALL_SUBPARTITIONS:
                            raise
                        failed[target] = e
                        if not quiet:
                            raise

    def _raise_failed(self) -> None:
        if self._failed:
            raise next(iter(self._failed.values()))

    async def _run_flusher(self) -> None:
        await run_output_flusher(self.writer, self._flush_pass, self._flusher_running)

    def _flusher_running(self) -> bool:
        if self._closed:
            return False
        try:
            self.sink.check_writable()
        except ExchangeError:
            return False  # released under the writer: the next emit reports why
        return True

    async def _flush_pass(self) -> None:
        if self._move_lock.locked():
            return  # the task is moving: it flushes what is due itself
        if self.writer.flush_if_due():
            # an error (e.g. the partition released) surfaces at the next emit
            with best_effort(log, f"the output flusher's move of {self.sink.name}"):
                await self._move(quiet=True)

    # -- closing -------------------------------------------------------------------------

    def _check_writable(self) -> None:
        if self._closed:
            raise WriterClosedError(f"the writer of {self.sink.name} is closed")
        self.sink.check_writable()

    async def close(self) -> None:
        """Flush, finish the partition (EndOfPartition everywhere), stop the flusher.

        If the last buffers cannot be written the partition is failed, never left
        unfinished: its readers get the error instead of waiting forever.
        """
        if self._closed:
            return
        try:
            self.writer.flush()
            await self._move()
            self._raise_failed()
            self.writer.close()
            self._closed = True
            await self._stop_flusher()
            await self.sink.finish()
        except BaseException as e:
            self._closed = True
            self.writer.discard()
            await self._stop_flusher()
            with best_effort(log, f"failing {self.sink.name} after {e!r}", logging.WARNING):
                await self.sink.fail(e)
            raise

    async def fail(self, cause: BaseException | None = None) -> None:
        """Abort: the partition is failed and its readers get a ProducerFailedError."""
        self._closed = True
        self.writer.discard()
        await self._stop_flusher()
        await self.sink.fail(cause)

    async def _stop_flusher(self) -> None:
        task, self._flusher = self._flusher, None
        if task is not None and task is not asyncio.current_task():
            # the writer's own cancellation (the task closing it was cancelled) propagates
            await cancel_and_wait(task, log, f"the output flusher of {self.sink.name}")

    @property
    def is_closed(self) -> bool:
        return self._closed

    async def __aenter__(self) -> AsyncRecordWriter:
        return self

    async def __aexit__(self, exc_type: object, exc: BaseException | None, tb: object) -> None:
        if exc is None:
            await self.close()
        else:
            await self.fail(exc)
