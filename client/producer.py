"""Producers: write one ResultPartition on the local daemon.

Both APIs drive the engine's one write path, ``exchange.writer.RecordWriter`` (routing,
batching, encoding, cutting, flush policy), and push the buffers it cuts to the daemon
over the local socket, one credit each (``client.local_connection``): when the
partition's pool on the daemon is full, credit runs out and the producer waits
(backpressure).

* ``AsyncPartitionWriter``: the asyncio API (``exchange.writer.AsyncRecordWriter`` with the
  daemon connection as its sink).
* ``PartitionWriter``: the synchronous facade PySpark tasks use. Records are routed,
  batched and encoded in the calling thread (no GIL ping-pong per record); the buffers
  are handed to the process's background loop a batch at a time *without waiting*,
  through one bounded channel (``client.channel``), so encoding overlaps with sending:
  the loop's sender takes every batch queued at once and pushes them in one go. At most
  ``window`` batches are in flight (queued, or taken by the sender and not pushed yet:
  it holds their room until the daemon took them); the task waits only when they all
  are (backpressure; a wake-up when the sender makes room, none per buffer). The output
  flusher of the asyncio writer (``exchange.writer.async_record_writer.run_output_flusher``)
  runs on the loop and flushes partial buffers once they are ``buffer_timeout`` seconds
  old, even while the task waits for input.

Unaligned checkpoints (``PartitionWriter`` only): ``broadcast_barrier(..., unaligned=True)``
sends a barrier that overtakes, on the daemon, every buffer of this partition still queued
there; the daemon hands those buffers back, and ``output_channel_state(id)`` is the future
of their ``CheckpointOutputState``, which the task persists with its snapshot before it
acknowledges the checkpoint. After a restart ``restore_output_state(state)`` re-emits them,
per subpartition and in order, before any new record. (The barrier needs no credit, but it
leaves the task in order: buffers this writer has not pushed yet, at most its window, reach
the daemon first and are overtaken there.)
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import itertools
import logging
import threading
from collections.abc import Callable, Iterable
from types import TracebackType
from typing import Any, Final

from client._checks import check_count
from client.channel import (
    Channel,
    ChannelBrokenError,
    ChannelClosedError,
    ChannelStatistics,
    EndOfChannel,
)
from client.local_connection import LocalConnection, resolve_daemon_socket, secret_or_env
from client.options import WriterOptions
from client.runtime import ClientRuntime, get_runtime
from exchange.best_effort import best_effort
from exchange.buffers.buffer import DataType
from exchange.checkpointing.output_channel_state import (
    CheckpointOutputState,
    OutputChannelStateCollector,
)
from exchange.errors import (
    ExchangeError,
    IllegalStateError,
    UsageError,
    WriterClosedError,
    fresh_error,
)
from exchange.events.events import AbstractEvent, CheckpointBarrier, CheckpointOptions
from exchange.partition.result_partition_id import ResultPartitionID
from exchange.protocol.local_messages import (
    ALL_SUBPARTITIONS,
    CreatePartition,
    FailPartition,
    FinishPartition,
    OutputChannelState,
    OutputChannelStateComplete,
    PartitionCreated,
    PartitionFinished,
)
from exchange.writer.async_record_writer import AsyncRecordWriter, run_output_flusher
from exchange.writer.record_writer import OutputBuffer, RecordWriter

__all__ = ["AsyncPartitionWriter", "DaemonSink", "PartitionWriter", "WriterOptions"]

log = logging.getLogger("exchange.client.producer")

_NO_KEY: Final[Any] = object()
#: Bytes of cut buffers handed to the loop at a time (with whole-segment buffers).
#: Once debloating shrinks the buffers, every buffer is shipped on its own and only one
#: waits for credit (window 1), as Flink's writer blocks on its buffer pool: the task's
#: queue is invisible to the consumer's debloater, so it must not hold more than a buffer
#: or two for the bytes ahead of a barrier to follow the debloater (a debloated channel
#: is slow by definition: there is no throughput to lose).
_SHIP_BYTES: Final = 256 * 1024
#: Batches in flight between the task thread and the daemon at most (the window): queued
#: in the channel, or taken by the loop's sender and not pushed yet.
_WINDOW: Final = 4
#: Records taken from an iterable at a time by ``emit_all``: at most, and at first.
_CHUNK: Final = 4096
_FIRST_CHUNK: Final = 64
#: Seconds the task waits for the flush timer to end (it is cancelled while it sleeps).
_STOP_TIMER_TIMEOUT: Final = 5.0


class DaemonSink:
    """The local daemon as an AsyncRecordWriter's sink: one credit per data buffer."""

    def __init__(self, conn: LocalConnection, partition_id: ResultPartitionID) -> None:
        self.conn = conn
        self.partition_id = partition_id
        self.result: PartitionFinished | None = None

    @property
    def name(self) -> str:
        return str(self.partition_id)

    def check_writable(self) -> None:
        self.conn.check()

    async def write(self, out: OutputBuffer) -> None:
        await self.conn.push_buffer(out)

    async def write_all(self, outs: list[OutputBuffer]) -> None:
        await self.conn.push_buffers(outs)

    async def finish(self) -> None:
        reply = await self.conn.request(FinishPartition())
        await self.conn.aclose()
        assert isinstance(reply, PartitionFinished)
        self.result = reply

    async def fail(self, cause: BaseException | None) -> None:
        if self.conn.is_open:
            self.conn.send(FailPartition(str(cause) if cause is not None else "aborted"))
        await self.conn.aclose()


def _check_partition(partition_id: Any, num_subpartitions: Any) -> None:
    """The partition a writer creates, checked before it connects (UsageError)."""
    if not isinstance(partition_id, ResultPartitionID):
        raise UsageError(f"partition_id must be a ResultPartitionID, got {partition_id!r}")
    check_count("num_subpartitions", num_subpartitions, 1)


async def _open_partition(
    partition_id: ResultPartitionID, num_subpartitions: int, options: WriterOptions
) -> tuple[LocalConnection, PartitionCreated]:
    conn = await LocalConnection.connect(
        resolve_daemon_socket(options.daemon_socket), secret=secret_or_env(options.secret)
    )
    try:
        reply = await conn.create_partition(
            CreatePartition(partition_id, options.blocking, num_subpartitions)
        )
    except BaseException:
        await conn.aclose()
        raise
    assert isinstance(reply, PartitionCreated)
    return conn, reply


def _record_writer(
    num_subpartitions: int, created: PartitionCreated, options: WriterOptions
) -> RecordWriter:
    """The engine's write path for a partition the daemon created."""
    return RecordWriter(
        num_subpartitions,
        buffer_size=created.segment_size,
        codec=options.codec,
        selector=options.selector,
        buffer_timeout=options.buffer_timeout,
    )


class AsyncPartitionWriter(AsyncRecordWriter):
    """Writes one partition on the local daemon, from asyncio code."""

    def __init__(
        self,
        writer: RecordWriter,
        sink: DaemonSink,
        segment_size: int,
    ) -> None:
        super().__init__(writer, sink)
        self.daemon_sink = sink
        # debloating: the consumer's NewBufferSize, forwarded by the daemon (same thread)
        sink.conn.buffer_size_listener = writer.set_buffer_size
        self.partition_id = sink.partition_id
        self.num_subpartitions = writer.num_subpartitions
        self.segment_size = segment_size

    @classmethod
    async def open(
        cls,
        partition_id: ResultPartitionID,
        num_subpartitions: int,
        options: WriterOptions | None = None,
        **overrides: Any,
    ) -> AsyncPartitionWriter:
        """Create the partition on the local daemon; ``options`` (a ``WriterOptions``; the
        defaults when None) with ``overrides`` applied say how (``client.options``)."""
        opts = WriterOptions.of(options, overrides)
        _check_partition(partition_id, num_subpartitions)
        conn, created = await _open_partition(partition_id, num_subpartitions, opts)
        try:
            writer = _record_writer(num_subpartitions, created, opts)
        except BaseException:
            await conn.aclose()
            raise
        return cls(writer, DaemonSink(conn, partition_id), created.segment_size)

    @property
    def result(self) -> PartitionFinished | None:
        return self.daemon_sink.result

    async def broadcast_event(self, event: AbstractEvent) -> None:
        if isinstance(event, CheckpointBarrier) and event.options.unaligned:
            raise UsageError("unaligned barriers need the PartitionWriter (its channel state)")
        await super().broadcast_event(event)

    async def close(self) -> PartitionFinished:  # type: ignore[override]
        """Flush, finish the partition (EndOfPartition everywhere), wait for the daemon."""
        if self.is_closed:
            raise WriterClosedError(f"writer of {self.partition_id} is closed")
        await super().close()
        assert self.daemon_sink.result is not None
        return self.daemon_sink.result


class PartitionWriter:
    """Synchronous facade for PySpark task code (see the module docstring).

    Use as a context manager: leaving it normally closes the partition; leaving it with an
    exception fails the partition, so readers never mistake a crash for the end.
    """

    def __init__(
        self,
        partition_id: ResultPartitionID,
        num_subpartitions: int,
        options: WriterOptions | None = None,
        *,
        runtime: ClientRuntime | None = None,
        window: int = _WINDOW,
        overdraft: int = 0,
        **overrides: Any,
    ) -> None:
        """``options`` with ``overrides`` as in ``AsyncPartitionWriter.open``; at most
        ``window`` batches of buffers are in flight to the loop.

        ``overdraft`` (batches, default 0): with 0 an emit waits whenever more than
        ``window`` batches are in flight (the flush timer's batches, which it ships
        beyond the window, included). With more, an emit waits only after it shipped a
        batch itself, and only while more than ``window + overdraft`` are in flight: for
        a task that waits for ``available()`` between its steps (a streaming task), so a
        step under back pressure ends and the task gets back to its mailbox (a priority
        barrier, a trigger) rather than waiting inside the step (Flink's overdraft
        buffers: a record is finished beyond the pool)."""
        opts = WriterOptions.of(options, overrides)
        _check_partition(partition_id, num_subpartitions)
        check_count("window", window, 1)
        check_count("overdraft", overdraft, 0)
        self._rt = runtime if runtime is not None else get_runtime()
        conn, created = self._rt.run(_open_partition(partition_id, num_subpartitions, opts))
        self._sink = DaemonSink(conn, partition_id)
        try:
            self._writer = _record_writer(num_subpartitions, created, opts)
        except BaseException:
            self._rt.run(conn.aclose())
            raise
        self.partition_id = partition_id
        self.num_subpartitions = num_subpartitions
        self.segment_size = created.segment_size
        self.codec = self._writer.codec
        self._timeout = float(opts.buffer_timeout)
        self._window = window
        self._overdraft = overdraft
        # Task thread (and the flush timer) -> the loop's sender: batches of cut buffers.
        self._out: Channel[list[OutputBuffer]] = Channel(window, f"writer[{partition_id}]")
        # batches the sender pushed to the daemon; a flush waits for them (loop thread)
        self._pushed = 0
        self._pushed_cond = threading.Condition()
        self._flush_waits = False
        self._flushes_shipped = 0  # the writer's flush count when output last shipped
        self._aborted = False
        # emit_all's records gathered but not yet routed (the flush timer may take them)
        self._gather: list[Any] | None = None
        self._gather_taken = 0
        self._gather_routing: tuple[Any, Any] = (None, None)
        # Serializes the task thread and the loop's flush timer on the RecordWriter.
        self._lock = threading.Lock()
        self._error: BaseException | None = None
        self._closed = False
        # debloating: sizes the daemon forwarded (loop thread), applied under the lock
        self._new_sizes: dict[int, int] = {}
        conn.buffer_size_listener = self._new_sizes.__setitem__
        # unaligned checkpoints: the daemon's output channel state, per checkpoint (the
        # collector is fed on the loop thread, futures are made on the task thread)
        self._state_lock = threading.Lock()
        self._state = OutputChannelStateCollector(num_subpartitions, created.segment_size)
        # futures not taken yet by output_channel_state / not resolved yet
        self._state_futures: dict[int, concurrent.futures.Future[CheckpointOutputState]] = {}
        self._state_arriving: dict[int, concurrent.futures.Future[CheckpointOutputState]] = {}
        conn.channel_state_listener = self._on_channel_state
        conn.closed.add_done_callback(self._on_connection_closed)
        # The flush timer, a task of the loop: it ends with the daemon connection (nothing
        # to flush to) and is cancelled and awaited on every way out of the writer.
        self._timer: asyncio.Task[None] | None = None  # loop thread only
        self._timer_started = self._timeout > 0
        if self._timer_started:
            self._rt.call_soon(self._start_timer)
        self._sender = self._rt.submit(self._send_loop())

    @property
    def records_written(self) -> int:
        return self._writer.stats.records_out

    def buffer_size(self, index: int) -> int:
        """The size new buffers of subpartition ``index`` are cut at (debloating)."""
        with self._lock:
            if self._new_sizes:
                self._apply_new_sizes()
            return self._writer.buffer_size(index)

    @property
    def stats(self) -> Any:
        return self._writer.stats

    def window_statistics(self) -> ChannelStatistics:
        """The figures of the channel to the loop's sender (items are batches of buffers;
        ``batches_received`` counts the sender's takes, ``wakeups`` the cross-thread
        wake-ups either side made)."""
        return self._out.statistics()

    # -- shipping (task thread) ------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise WriterClosedError(f"writer of {self.partition_id} is closed")
        if self._error is not None:
            raise fresh_error(self._error)

    def _raise_failed(self) -> None:
        """The sender stopped (the channel is broken): raise why."""
        if self._error is not None:
            raise fresh_error(self._error)
        raise WriterClosedError(f"writer of {self.partition_id} is closed")

    def _ship(self, force: bool = False) -> bool:
        """Hand the cut buffers to the loop (True when it did); called with the lock
        held, so batches are queued in the order they were cut, whichever thread cut
        them. Never waits (the room is waited for after the lock is released:
        ``_wait_room``)."""
        writer = self._writer
        if self._new_sizes:
            self._apply_new_sizes()
        # a flush (the buffer timeout passed while the task emitted) ships at once: what
        # it cut must not wait for a full shipment, nor for the flush timer's next pass
        flushed = writer.stats.flushes != self._flushes_shipped
        if writer.has_output and (force or flushed or writer.output_bytes >= self._ship_bytes()):
            self._flushes_shipped = writer.stats.flushes
            self._hand(writer.take_output())
            return True
        return False

    def _hand(self, outs: list[OutputBuffer]) -> None:
        """Queue one batch for the sender, beyond the window if need be (lock held)."""
        try:
            self._out.send_nowait((outs,), force=True)
        except (ChannelBrokenError, ChannelClosedError):
            self._raise_failed()

    def _apply_new_sizes(self) -> None:
        """With the lock held: cut new buffers at the sizes the consumers announced."""
        sizes = self._new_sizes
        while sizes:
            index, size = sizes.popitem()  # atomic: the loop thread may add meanwhile
            self._writer.set_buffer_size(index, size)

    async def _send_loop(self) -> None:
        """Loop thread: push what the channel holds, every batch queued in one go, in
        order. A failure is kept for the task and breaks the channel (its waits end)."""
        out = self._out
        write_all = self._sink.write_all
        cond = self._pushed_cond
        try:
            while True:
                try:
                    # held: the window counts these batches until they reached the
                    # daemon (while write_all waits for credit, the task may queue only
                    # what is left of the window, as Flink's in-flight bound)
                    batches = await out.areceive(hold=True)
                except (EndOfChannel, ChannelClosedError):
                    return
                outs = batches[0] if len(batches) == 1 else [o for b in batches for o in b]
                await write_all(outs)
                with cond:
                    self._pushed += len(batches)
                    if self._flush_waits:
                        self._flush_waits = False
                        cond.notify_all()
                out.release(len(batches))
        except Exception as e:
            if self._error is None:
                self._error = e
            out.close_receiver()
        finally:
            with cond:
                cond.notify_all()

    def _wait_room(self) -> None:
        """Task thread: wait while the window is full (back pressure)."""
        out = self._out
        window = self._window_now()
        if out.capacity != window:
            out.set_capacity(window)
        try:
            out.wait_room(-self._overdraft)  # at most window + overdraft in flight
        except (ChannelBrokenError, ChannelClosedError):
            self._raise_failed()

    def _wait_pushed(self) -> None:
        """Task thread: wait until every batch queued so far reached the daemon."""
        target = self._out.statistics().items_sent
        cond = self._pushed_cond
        with cond:
            while self._pushed < target:
                if self._error is not None or self._sender.done():
                    self._raise_failed()
                self._flush_waits = True
                cond.wait()

    def _after(self, force: bool = False) -> None:
        with self._lock:
            shipped = self._ship(force or self._timeout == 0)
        if shipped or not self._overdraft:
            self._wait_room()

    def _after_event(self) -> None:
        """Ship an event, and what was emitted before it, without waiting for room in the
        window: events are not back-pressured (Flink writes them into buffers outside the
        pool), so a task whose output is blocked can still put a barrier or a cancellation
        behind its data. The window is one batch over until the next record waits."""
        with self._lock:
            self._ship(True)
        if self._error is not None:
            self._raise_failed()

    # -- the flush timer (loop thread) -----------------------------------------------------

    def _start_timer(self) -> None:
        timer = self._timer = self._rt.loop.create_task(
            self._flush_timer(), name=f"flush-timer[{self.partition_id}]"
        )
        # a lost connection ends it at once, even while the task waits for its input
        self._sink.conn.closed.add_done_callback(lambda _: timer.cancel())

    async def _end_timer(self) -> None:
        timer, self._timer = self._timer, None
        if timer is not None:
            timer.cancel()
            await asyncio.wait((timer,))

    async def _flush_timer(self) -> None:
        await run_output_flusher(self._writer, self._timer_pass, self._timer_running)

    def _timer_running(self) -> bool:
        return not self._closed and self._error is None

    async def _timer_pass(self) -> None:
        """One pass of the output flusher (loop thread): flush what is due and ship it."""
        if not self._lock.acquire(blocking=False):
            return  # the task thread is writing: it checks the timeout itself
        writer = self._writer
        try:
            if self._closed:
                return
            if self._new_sizes:
                self._apply_new_sizes()
            gathered = self._gather
            if gathered is not None and len(gathered) > self._gather_taken:
                # records the task gathered before its input stalled
                end = len(gathered)
                writer.emit_all(gathered[self._gather_taken : end], *self._gather_routing)
                self._gather_taken = end
            writer.flush_if_due()
            # also when emit_all flushed (the timeout had passed): what it cut goes now
            if writer.stats.flushes == self._flushes_shipped or not writer.has_output:
                return
            self._flushes_shipped = writer.stats.flushes
            # not part of the task's window: errors reach the task through _error
            self._out.send_nowait((writer.take_output(),), force=True)
        except (ChannelBrokenError, ChannelClosedError):
            pass  # the sender stopped: its error is kept already, or the writer aborted
        except Exception as e:  # a user's partitioner failed: the task hears of it
            self._error = e
        finally:
            self._lock.release()

    # -- API -------------------------------------------------------------------------------

    def emit(self, record: Any, key: Any = _NO_KEY) -> None:
        """Emit to the subpartition of ``key`` (default: the selector, else ``record[0]``)."""
        self._check_open()
        with self._lock:
            if key is _NO_KEY:
                self._writer.emit(record)
            else:
                self._writer.emit(record, key)
        self._after()

    def emit_to(self, record: Any, index: int) -> None:
        self._check_open()
        with self._lock:
            self._writer.emit_to(record, index)
        self._after()

    def emit_all(
        self,
        records: Iterable[Any],
        partition_func: Callable[[Any], int] | None = None,
        key_func: Callable[[Any], Any] | None = None,
    ) -> int:
        """Emit many records; each goes to ``partition_func(key) % n`` (default: the
        deterministic hash of the key), the key being ``key_func(record)`` or ``record[0]``.

        Records are gathered from ``records`` a chunk at a time outside the lock, then
        routed and encoded under it. The iterable may block on slow input: meanwhile the
        flush timer takes the records gathered so far and flushes them, so a stalled
        input never holds back what came before it. Without a flush timer (a blocking
        partition) they are routed straight from ``records``, a chunk at a time.
        """
        self._check_open()
        writer = self._writer
        it = iter(records)
        islice = itertools.islice
        total = 0
        if not self._timer_started and self._timeout != 0:
            # no flush timer (a blocking partition): nothing takes records while the
            # input stalls, so they are routed straight from the input, with no copy
            while True:
                chunk_size = self._chunk_size()
                with self._lock:
                    taken = writer.emit_all(islice(it, chunk_size), partition_func, key_func)
                    self._ship(False)
                total += taken
                self._wait_room()
                if taken < chunk_size:
                    return total
        self._gather_routing = (partition_func, key_func)
        try:
            while True:
                chunk_size = self._chunk_size()
                gathered: list[Any] = []
                with self._lock:
                    self._gather, self._gather_taken = gathered, 0
                # extend appends one record at a time (in C): the timer sees each one
                gathered.extend(islice(it, chunk_size))
                with self._lock:
                    self._gather = None
                    rest = gathered[self._gather_taken :] if self._gather_taken else gathered
                    if rest:
                        writer.emit_all(rest, partition_func, key_func)
                    self._ship(self._timeout == 0)
                total += len(gathered)
                self._wait_room()
                if len(gathered) < chunk_size:
                    return total
        finally:
            self._gather = None

    def records_per_shipment(self) -> int:
        """About how many records one shipment holds (one debloated buffer, else
        ``_SHIP_BYTES``) at the buffer sizes the consumers announced so far, from the
        mean record size so far (``_FIRST_CHUNK`` before the first batch); 1 with a
        buffer timeout of 0. Emitting this many after ``available()`` said there is room
        waits for the daemon once at most (unless a new size comes meanwhile), so a task
        that emits in bounded steps (a source's poll) gets back to its mailbox about once
        per buffer the consumer frees."""
        with self._lock:
            if self._new_sizes:
                self._apply_new_sizes()
        return self._chunk_size()

    def _chunk_size(self) -> int:
        """Records to gather at a time: about one shipment's worth of bytes (a few large
        records, thousands of small ones), one with a buffer timeout of 0."""
        if self._timeout == 0:
            return 1
        mean = self._writer.mean_record_size
        if mean is None:
            return _FIRST_CHUNK
        return max(1, min(_CHUNK, self._ship_bytes() // max(mean, 1)))

    def _ship_bytes(self) -> int:
        size = self._writer.smallest_buffer_size
        return _SHIP_BYTES if size >= self.segment_size else size

    def _window_now(self) -> int:
        return self._window if self._writer.smallest_buffer_size >= self.segment_size else 1

    def available(self) -> concurrent.futures.Future[None] | None:
        """None when what is emitted now will not wait for the daemon; otherwise a future
        done once it may (Flink's ``RecordWriter.getAvailableFuture``).

        Unavailable means the window of batches in flight is full: the daemon's credit
        for this partition ran out (back pressure). A task with other work meanwhile (a
        streaming task's control messages) waits on this future rather than inside
        ``emit``. Raises the error of a batch that failed. Task thread only.
        """
        self._check_open()
        fut: concurrent.futures.Future[None] = concurrent.futures.Future()

        def room() -> None:  # any thread, once
            if not fut.done():
                fut.set_result(None)

        out = self._out
        window = self._window_now()
        if out.capacity != window:
            out.set_capacity(window)
        try:
            if out.poll_room(1, room):
                return None
        except (ChannelBrokenError, ChannelClosedError):
            self._raise_failed()
        return fut

    def broadcast(self, record: Any) -> None:
        """Emit one record to every subpartition (encoded once)."""
        self._check_open()
        with self._lock:
            self._writer.broadcast(record)
        self._after()

    def broadcast_event(self, event: AbstractEvent) -> None:
        """Send ``event`` to every subpartition after every record emitted so far (an
        unaligned barrier overtakes them: see ``broadcast_barrier``)."""
        self._check_open()
        if isinstance(event, CheckpointBarrier) and event.options.unaligned:
            self._broadcast_unaligned(event)
            return
        with self._lock:
            self._writer.broadcast_event(event)
        self._after_event()

    def _broadcast_unaligned(self, barrier: CheckpointBarrier) -> None:
        """Task thread: the buffers cut so far go out as usual; the barrier is written on
        the loop at once, ahead of those still waiting for credit, which become state."""
        with self._lock:
            self._expect_output_state(barrier.checkpoint_id)
            self._writer.broadcast_event(barrier)
            outs = self._writer.take_output()
            event = outs.pop()
            if outs:
                self._hand(outs)
            self._rt.call_soon(self._push_priority, barrier.checkpoint_id, event)
        if self._error is not None:  # a batch failed: the task hears of it now
            self._raise_failed()

    def _push_priority(self, checkpoint_id: int, event: OutputBuffer) -> None:
        """Loop thread: what is cut and not written yet is overtaken (copied to the state,
        still sent after the barrier); then the barrier goes out."""
        conn = self._sink.conn
        unsent = list(conn.unsent_buffers())  # the sender's current push
        for outs in self._out.queued():  # and what waits for the sender
            unsent.extend(outs)
        local: dict[int, list[bytes]] = {}
        for out in unsent:
            if out.is_event:
                continue
            data = out.to_bytes()
            targets = (
                range(self.num_subpartitions) if out.target == ALL_SUBPARTITIONS else (out.target,)
            )
            for t in targets:
                local.setdefault(t, []).append(data)
        try:
            with self._state_lock:
                self._state.add_local(checkpoint_id, local)
            conn.push_event_now(event)
        except ExchangeError as e:
            with self._state_lock:
                failed = self._state_arriving.pop(checkpoint_id, None)
            if failed is not None and not failed.done():
                failed.set_exception(e)

    def broadcast_barrier(
        self,
        checkpoint_id: int,
        timestamp: int,
        *,
        aligned: bool = True,
        unaligned: bool = False,
    ) -> None:
        """CheckpointBarrier on every subpartition, after every record emitted before it.

        ``aligned``: exactly-once (False: at least once). ``unaligned`` (exactly-once
        only): a priority barrier that overtakes this partition's buffers queued on the
        daemon; their copies come back as ``output_channel_state(checkpoint_id)``."""
        options = CheckpointOptions(exactly_once=aligned, unaligned=unaligned)
        self.broadcast_event(CheckpointBarrier(checkpoint_id, timestamp, options))

    def output_channel_state(
        self, checkpoint_id: int
    ) -> concurrent.futures.Future[CheckpointOutputState]:
        """The output channel state of unaligned checkpoint ``checkpoint_id`` (its barrier
        was broadcast by this writer): a future, done once every subpartition reported,
        failed if the daemon connection is lost first. Taken once (the writer forgets it)."""
        with self._state_lock:
            fut = self._state_futures.pop(checkpoint_id, None)
        if fut is None:
            raise UsageError(
                f"no unaligned barrier {checkpoint_id} was broadcast by this writer "
                "(or its state was taken already)"
            )
        return fut

    def restore_output_state(self, state: CheckpointOutputState) -> None:
        """Re-emit a restored checkpoint's output channel state, per subpartition in
        order, before any new record (call it first, once, after opening the writer)."""
        self._check_open()
        outs: list[OutputBuffer] = []
        for index, payloads in sorted(state.buffers.items()):
            if not 0 <= index < self.num_subpartitions:
                raise UsageError(
                    f"output state of subpartition {index}, the partition has "
                    f"{self.num_subpartitions}"
                )
            for payload in payloads:
                if not 0 < len(payload) <= self.segment_size:
                    raise UsageError(
                        f"output state buffer of {len(payload)} bytes: not in "
                        f"(0, {self.segment_size}] (the daemon's segment size)"
                    )
                outs.append(OutputBuffer(index, DataType.DATA_BUFFER, len(payload), [payload]))
        with self._lock:
            st = self._writer.stats
            if st.records_out or st.events_out or self._out.statistics().items_sent:
                raise IllegalStateError(
                    "restore_output_state must come before any record or event is written"
                )
            if outs:
                self._hand(outs)
        self._wait_room()

    def _expect_output_state(self, checkpoint_id: int) -> None:
        """Task thread: register the future before the barrier can leave."""
        with self._state_lock:
            self._state.expect(checkpoint_id)
            fut: concurrent.futures.Future[CheckpointOutputState] = concurrent.futures.Future()
            self._state_futures[checkpoint_id] = self._state_arriving[checkpoint_id] = fut

    def _on_channel_state(self, msg: OutputChannelState | OutputChannelStateComplete) -> None:
        """Loop thread: a message of the daemon's output channel state."""
        with self._state_lock:
            if isinstance(msg, OutputChannelState):
                self._state.on_buffer(msg)
                return
            state = self._state.on_complete(msg)
            if state is None:
                return
            fut = self._state_arriving.pop(msg.checkpoint_id)
        if not fut.done():
            fut.set_result(state)

    def _on_connection_closed(self, _: object) -> None:
        """Loop thread: states still arriving never will."""
        try:
            self._sink.conn.check()
            err: ExchangeError = WriterClosedError(f"writer of {self.partition_id} closed")
        except ExchangeError as e:
            err = e
        with self._state_lock:
            futs = list(self._state_arriving.values())
            self._state_arriving.clear()
        for fut in futs:
            if not fut.done():
                fut.set_exception(fresh_error(err))

    def broadcast_cancel(self, checkpoint_id: int) -> None:
        self._check_open()
        with self._lock:
            self._writer.broadcast_cancel(checkpoint_id)
        self._after_event()

    def set_buffer_size(self, index: int, size: int) -> None:
        """Cut the new buffers of subpartition ``index`` at ``size`` bytes."""
        with self._lock:
            self._writer.set_buffer_size(index, size)

    def flush(self) -> None:
        """Make everything emitted so far readable (waits until it reached the daemon)."""
        self._check_open()
        with self._lock:
            self._writer.flush()
            self._ship(force=True)
        self._wait_pushed()

    def close(self) -> PartitionFinished:
        """Flush, finish the partition, wait for the daemon's acknowledgement."""
        self._check_open()
        try:
            with self._lock:
                last = self._writer.close()  # flushes: the last buffers
                self._closed = True
                if last:
                    self._hand(last)
                self._out.close_sender()  # the sender ends once it pushed everything
            self._stop_timer()
            self._sender.result()
            if self._error is not None:
                self._raise_failed()
            self._rt.run(self._sink.finish())
        except BaseException as e:
            self._abort(e)
            raise
        assert self._sink.result is not None
        return self._sink.result

    def fail(self, cause: BaseException | str | None = None) -> None:
        """Abort: the daemon fails the partition, its readers get ProducerFailedError."""
        self._abort(cause)

    def cancel(self, reason: str) -> None:
        """Fail this writer from another thread (the one writing may be blocked waiting
        for credit that will never come): the daemon fails the partition with ``reason``,
        and the writing thread's next or pending call raises ``WriterClosedError``."""
        self._rt.call_soon(self._cancel_on_loop, reason)

    def _cancel_on_loop(self, reason: str) -> None:
        conn = self._sink.conn
        if self._sink.result is not None or not conn.is_open:
            return
        conn.send(FailPartition(reason))
        conn.fail(WriterClosedError(f"the writer of {self.partition_id} was cancelled: {reason}"))

    def _abort(self, cause: BaseException | str | None) -> None:
        if self._sink.result is not None or self._aborted:
            return
        self._aborted = True
        self._closed = True
        with self._lock:
            self._writer.discard()
        self._stop_timer()
        self._out.close_receiver()  # what was never pushed is dropped with the partition
        self._sender.cancel()
        with best_effort(log, f"failing the partition after {cause!r}", logging.WARNING):
            self._rt.run(self._sink.fail(cause if not isinstance(cause, str) else _Failure(cause)))

    def _stop_timer(self) -> None:
        """Task thread: cancel the flush timer and wait until it has ended."""
        if self._timer_started:
            self._timer_started = False
            with contextlib.suppress(TimeoutError):
                self._rt.run(self._end_timer(), _STOP_TIMER_TIMEOUT)

    def __enter__(self) -> PartitionWriter:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc is None:
            self.close()
        else:
            self.fail(exc)


class _Failure(Exception):
    """A failure given as text."""
