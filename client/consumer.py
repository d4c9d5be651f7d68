"""Consumers: read subpartitions of partitions on any daemon.

``AsyncPartitionReader`` builds a SingleInputGate with one RemoteInputChannel per location:
over TCP to a remote daemon's data port, or over the Unix socket when the partition lives
on this host's daemon (same protocol, no TCP). It owns a small NetworkBufferPool (exclusive
buffers per channel + floating buffers per gate), which must be whole when it closes.

``PartitionReader`` is the synchronous facade over the same gate and the same decode path
(``RecordStream``): the background loop hands the received Buffers themselves (no copy)
to the task thread in batches; the task thread decodes each buffer's memoryview and gives
the batch's buffers back to the loop thread in one ``call_soon_threadsafe`` (pools and
credit are loop-thread only), so credit returns as soon as a batch is decoded. At most
``window`` batches wait in between (bounded memory). Events reach ``event_handler`` in
the task thread, in order with the records; ``resume_consumption(channel)`` may be called
from any thread. ``close()`` from another thread ends a blocked ``records()`` at once with
an IllegalStateError.

Given ``metrics_socket`` and ``task_name``, a reader whose gate debloats or handles
checkpoint barriers reports those figures to the local daemon (``TaskMetrics``) every
second and once more at close, on a connection of its own; a failed report is logged
at debug level and ends the reporting, never the read.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import logging
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Final

from client._checks import check_count, check_metrics_target, check_optional
from client.channel import (
    Channel,
    ChannelBrokenError,
    ChannelClosedError,
    ChannelStatistics,
    EndOfChannel,
)
from client.local_connection import LocalConnection, secret_or_env
from client.network import ConnectionManager
from client.options import ReaderOptions
from client.runtime import ClientRuntime, get_runtime
from exchange.addresses import UNIX_PREFIX
from exchange.best_effort import cancel_and_wait, wait_quietly
from exchange.buffers.buffer import Buffer
from exchange.checkpointing import (
    AlignedBarrierHandler,
    AlignmentMode,
    AlignmentStrategy,
    BarrierHandlerStats,
    CheckpointBarrierHandler,
    CheckpointingMode,
    CheckpointListener,
    UnalignedBarrierHandler,
    create_barrier_handler,
)
from exchange.checkpointing.barrier_handler import CheckpointFailureReason
from exchange.consumer.record_reader import EventHandler, RecordReader, RecordStream
from exchange.consumer.remote_input_channel import RemoteInputChannel
from exchange.consumer.single_input_gate import BufferOrEvent, SingleInputGate
from exchange.debloat.buffer_debloater import BufferDebloaterStats
from exchange.debloat.config import DebloatConfig
from exchange.debloat.gate_debloater import GateDebloater
from exchange.errors import ConfigError, IllegalStateError, UsageError
from exchange.events.events import CancelCheckpointMarker, CheckpointBarrier, CheckpointOptions
from exchange.memory.network_buffer_pool import NetworkBufferPool
from exchange.partition.result_partition_id import ResultPartitionID
from exchange.protocol.local_messages import TASK_METRIC_NAMES, TaskMetrics
from exchange.serialization.framing import ITEM_DATA, ITEM_DRAINED, ITEM_OVERTAKEN
from exchange.serialization.record_codec import RecordCodec, default_codec

__all__ = ["AsyncPartitionReader", "PartitionLocation", "PartitionReader", "ReaderOptions"]

log = logging.getLogger("exchange.client.consumer")

_BATCH_BUFFERS: Final = 64
#: The give-back channel's bound: never reached (it holds buffers handed over, at most).
_UNBOUNDED: Final = 1 << 30
_CLOSED_WHILE_READING: Final = "the PartitionReader was closed while reading"
#: Seconds between two TaskMetrics reports of a reader.
METRICS_INTERVAL: Final = 1.0
#: How long a reader's last report and the close of its connection may take.
_METRICS_CLOSE_TIMEOUT: Final = 2.0
#: How long close() waits for buffers the task thread is still decoding.
_GIVE_BACK_TIMEOUT: Final = 30.0


@dataclass(frozen=True, slots=True)
class PartitionLocation:
    """Where one input of a consumer lives.

    ``data_address`` is the daemon's data port (``host:port``); ``local_socket`` and
    ``daemon_id`` let a reader on the same host use the Unix socket instead.
    """

    partition_id: ResultPartitionID
    subpartition_index: int
    data_address: str
    daemon_id: str | None = None
    local_socket: str | None = None

    def address_for(self, local_daemon_id: str | None) -> str:
        if self.local_socket and local_daemon_id is not None and local_daemon_id == self.daemon_id:
            return UNIX_PREFIX + self.local_socket
        return self.data_address


def _barrier_handler(
    listener: CheckpointListener,
    options: ReaderOptions,
    num_channels: int,
    resume: Callable[[int], None],
) -> CheckpointBarrierHandler:
    """The barrier handler of a reader's (validated) checkpoint options."""
    return create_barrier_handler(
        CheckpointingMode(options.checkpointing_mode),
        max(num_channels, 1),
        listener,
        time.monotonic,
        resume,
        max_aligned_bytes=options.checkpoint_alignment_limit or None,
        aligned_checkpoint_timeout=options.aligned_checkpoint_timeout,
        alignment=AlignmentMode.parse(options.alignment),
        spill_dir=options.alignment_spill_dir,
        page_size=options.segment_size,
    )


def _task_metrics(
    debloat: BufferDebloaterStats | None, barriers: BarrierHandlerStats | None
) -> dict[str, int | float]:
    """The TaskMetrics map of a gate's figures (what is None is left out)."""
    out: dict[str, int | float] = {}
    for stats in (debloat, barriers):
        if stats is not None:
            for name, value in stats._asdict().items():
                if name in TASK_METRIC_NAMES and value is not None:
                    out[name] = value
    return out


class _TaskMetricsReporter:
    """Sends a reader's gate figures to the local daemon (loop thread).

    It connects, reports at once and then every ``interval`` seconds; ``close`` sends a
    last report and closes the connection. Any failure (no daemon, a lost connection, a
    refused report) is logged at debug level and stops the reporting: the read goes on.
    """

    def __init__(
        self,
        socket_path: str,
        task: str,
        gate: str,
        collect: Callable[[], dict[str, int | float]],
        *,
        secret: bytes | None,
        interval: float = METRICS_INTERVAL,
    ) -> None:
        self.socket_path = socket_path
        self.task = task
        self.gate = gate
        self.collect = collect
        self.secret = secret
        self.interval = interval
        self.reports_sent = 0
        self._conn: LocalConnection | None = None
        self._task: asyncio.Task[None] | None = None
        #: True once a report failed (no more are sent)
        self.failed = False

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    def _send(self, conn: LocalConnection) -> None:
        conn.check()
        conn.send(TaskMetrics(self.task, self.gate, self.collect()))
        self.reports_sent += 1

    async def _run(self) -> None:
        try:
            conn = self._conn = await LocalConnection.connect(self.socket_path, secret=self.secret)
            # Python 3.11's asyncio.wait_for (in connect) returns the result and drops a
            # cancel that arrives as the connection completes: ``close`` would wait for
            # this loop forever. The cancel request is still counted: honour it.
            current = asyncio.current_task()
            if current is not None and current.cancelling():
                raise asyncio.CancelledError
            while True:
                self._send(conn)
                await asyncio.sleep(self.interval)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            log.debug("task %s stops reporting metrics to %s: %r", self.task, self.socket_path, e)
            self.failed = True
            conn_, self._conn = self._conn, None
            if conn_ is not None:
                conn_.close()

    async def close(self) -> None:
        """Send the last report (if still reporting), then close the connection."""
        task, self._task = self._task, None
        await cancel_and_wait(task, log, f"metrics reporter of task {self.task}")
        conn, self._conn = self._conn, None
        if conn is None:
            return
        try:
            self._send(conn)
            await asyncio.wait_for(conn.aclose(), _METRICS_CLOSE_TIMEOUT)
        except Exception as e:  # the last report is best effort too
            log.debug("task %s: last metrics report failed: %r", self.task, e)
            self.failed = True
            conn.close()


def _check_locations(locations: Any) -> None:
    """The locations of a reader, checked before it takes a segment or connects."""
    if isinstance(locations, str | bytes) or not isinstance(locations, Sequence):
        raise UsageError(f"locations must be a sequence of PartitionLocation, got {locations!r}")
    for loc in locations:
        if not isinstance(loc, PartitionLocation):
            raise UsageError(f"expected PartitionLocation, got {loc!r}")
        if not isinstance(loc.partition_id, ResultPartitionID):
            raise UsageError(f"{loc!r}: partition_id must be a ResultPartitionID")
        check_count("subpartition_index", loc.subpartition_index, 0)
        if not isinstance(loc.data_address, str):
            raise UsageError(f"{loc!r}: data_address must be a 'host:port' string")
        check_optional("daemon_id", loc.daemon_id, str)
        check_optional("local_socket", loc.local_socket, str)


class AsyncPartitionReader:
    """Reads records from a list of partition locations (asyncio API).

    With a ``checkpoint_listener`` a barrier handler (``exchange.checkpointing``) sits
    between the gate and the records; with an enabled ``debloat`` config the gate's
    debloater runs every period and announces buffer sizes to the producers.
    """

    def __init__(
        self,
        gate: SingleInputGate,
        pool: NetworkBufferPool,
        connections: ConnectionManager,
        codec: RecordCodec,
        event_handler: EventHandler | None,
        *,
        auto_resume_barriers: bool = True,
        barrier_handler: CheckpointBarrierHandler | None = None,
    ) -> None:
        self.gate = gate
        self.pool = pool
        self.connections = connections
        self.codec = codec
        self.reader = RecordReader(
            gate,
            codec,
            event_handler,
            auto_resume_barriers=auto_resume_barriers,
            barrier_handler=barrier_handler,
        )
        #: Buffers the gate returned that the task has not consumed yet (debloating).
        self.in_flight: Callable[[], int] = lambda: 0
        self._debloat_task: asyncio.Task[None] | None = None
        self._reporter: _TaskMetricsReporter | None = None
        self._closed = False

    @classmethod
    async def open(
        cls,
        locations: Sequence[PartitionLocation],
        options: ReaderOptions | None = None,
        **overrides: Any,
    ) -> AsyncPartitionReader:
        """Open channels to every location and request their subpartitions.

        ``options`` (a ``ReaderOptions``; the defaults when None), with ``overrides``
        (option names as keywords) applied, say how: see ``client.options``.
        """
        opts = ReaderOptions.of(options, overrides)
        _check_locations(locations)
        secret = secret_or_env(opts.secret)
        n = len(locations)
        num_floating = opts.floating_buffers
        pool = NetworkBufferPool(max(n * opts.num_exclusive + num_floating, 1), opts.segment_size)
        connections = ConnectionManager(secret=secret, segment_size=opts.segment_size)
        gate = SingleInputGate(
            "reader", pool.create_buffer_pool(0, max(num_floating, 1)) if num_floating else None
        )
        # Each channel keeps its share of the floating buffers free whatever the backlog:
        # a stream its producer limits (a small backlog) keeps a credit window announced in
        # halves, not one AddCredit per give-back. Not with debloating (its credit goes out
        # buffer by buffer, and the in-flight data it measures would grow).
        debloating = opts.debloat is not None and opts.debloat.enabled
        share = 0 if debloating or n == 0 else num_floating // n
        channels = [
            RemoteInputChannel(
                gate,
                i,
                loc.partition_id,
                loc.subpartition_index,
                loc.address_for(opts.local_daemon_id),
                connections,
                pool,
                num_exclusive=opts.num_exclusive,
                backoff_initial=opts.backoff_initial,
                backoff_max=opts.backoff_max,
                floating_share=share,
            )
            for i, loc in enumerate(locations)
        ]
        gate.set_input_channels(channels)
        handler = None
        if opts.checkpoint_listener is not None:
            handler = _barrier_handler(opts.checkpoint_listener, opts, n, gate.resume_consumption)
        self = cls(
            gate,
            pool,
            connections,
            opts.codec or default_codec(),
            opts.event_handler,
            auto_resume_barriers=opts.auto_resume_barriers,
            barrier_handler=handler,
        )
        try:
            await gate.request_partitions()
            if opts.debloat is not None and opts.debloat.enabled:
                self._start_debloating(opts.debloat)
            if opts.metrics_socket is not None and opts.task_name is not None:
                self.start_reporting(opts.metrics_socket, opts.task_name, secret=secret)
        except BaseException:
            await self.close()
            raise
        return self

    # -- debloating ----------------------------------------------------------------------

    def _start_debloating(self, config: DebloatConfig) -> None:
        """Announce the starting size to every channel, then recalculate every period."""
        gate = self.gate
        debloater = GateDebloater(config, time.monotonic, open_channels=gate.num_channels)
        gate.set_debloater(debloater)
        start = debloater.buffer_size
        for ch in gate.channels:
            if not ch.finished:
                ch.notify_new_buffer_size(start)
        self._debloat_task = asyncio.get_running_loop().create_task(self._debloat_loop())

    async def _debloat_loop(self) -> None:
        gate = self.gate
        debloater = gate.debloater
        assert debloater is not None
        period = debloater.config.period
        while not gate.is_closed:
            deadline = debloater.next_deadline
            delay = period if deadline is None else max(0.0, deadline - time.monotonic())
            await asyncio.sleep(delay)
            if gate.is_closed:
                return
            gate.trigger_debloating(time.monotonic(), self.in_flight())

    @property
    def debloat_stats(self) -> BufferDebloaterStats | None:
        """The gate's debloating figures (None when debloating is off)."""
        d = self.gate.debloater
        return d.stats() if d is not None else None

    # -- metrics ------------------------------------------------------------------------

    def start_reporting(
        self,
        metrics_socket: str,
        task_name: str,
        *,
        secret: bytes | None = None,
        collect: Callable[[], dict[str, int | float]] | None = None,
    ) -> bool:
        """Loop thread: report ``collect()`` (default: this reader's debloating and barrier
        figures) to the daemon at ``metrics_socket`` every second and at close, as
        ``task_name``. False (and nothing started) when there is nothing to report."""
        check_metrics_target(metrics_socket, task_name)
        if self._reporter is not None or self._closed:
            raise IllegalStateError("this reader already reports, or is closed")
        if collect is None:

            def collect() -> dict[str, int | float]:
                return _task_metrics(self.debloat_stats, self.barrier_stats)

        if not collect():
            return False
        self._reporter = _TaskMetricsReporter(
            metrics_socket, task_name, self.gate.name, collect, secret=secret
        )
        self._reporter.start()
        return True

    @property
    def metrics_reports_sent(self) -> int:
        """TaskMetrics reports sent so far (0 when not reporting)."""
        return self._reporter.reports_sent if self._reporter is not None else 0

    @property
    def barrier_stats(self) -> BarrierHandlerStats | None:
        h = self.reader.barrier_handler
        return h.stats() if h is not None else None

    def resume_consumption(self, channel_index: int) -> None:
        """Unblock a channel after its aligned checkpoint barrier."""
        if not self.gate.is_closed:
            self.gate.resume_consumption(channel_index)

    async def next_batch(self) -> list[Any] | None:
        return await self.reader.next_batch()

    async def __aiter__(self) -> AsyncIterator[Any]:
        while True:
            batch = await self.reader.next_batch()
            if batch is None:
                return
            for r in batch:
                yield r

    async def read_all(self) -> list[Any]:
        return await self.reader.read_all()

    async def close(self) -> None:
        """Release every channel and connection; the reader's pool must be whole."""
        if self._closed:
            return
        self._closed = True
        reporter, self._reporter = self._reporter, None
        if reporter is not None:  # the last report, while the figures are still there
            await reporter.close()
        task, self._debloat_task = self._debloat_task, None
        await cancel_and_wait(task, log, "buffer debloater")
        self.reader.close()
        await self.connections.close()
        self.pool.check_consistency()
        whole = self.pool.is_whole()
        self.pool.destroy()
        if not whole:  # pragma: no cover - a leak is a bug; make it loud
            raise IllegalStateError("reader's network buffer pool is not whole after close")

    async def __aenter__(self) -> AsyncPartitionReader:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


# -- the synchronous facade ------------------------------------------------------------

_DATA: Final = ITEM_DATA  # 0: the kinds framing.feed_batch reads are its own
_EVENT: Final = 1
_END: Final = 2
_ERROR: Final = 3
_TRIGGER: Final = 4  # the task's trigger_checkpoint(*args), in order with the records
_ABORT: Final = 5  # the task's abort_checkpoint(*args)
_PERSIST: Final = 6  # the task's persist_records(checkpoint, channel, records, nbytes)
_STATE_COMPLETE: Final = 7  # the task's input_state_complete(checkpoint)
#: a data buffer a priority barrier overtook: (Buffer, overtaken_by) (loop -> task thread)
_OVERTAKEN: Final = ITEM_OVERTAKEN  # 8
#: the task's persist_partial_record(checkpoint, channel, bytes) (unaligned)
_PARTIAL: Final = 9
#: the gate had nothing more after a priority barrier: every buffer it overtook is in
_DRAINED: Final = ITEM_DRAINED  # 10
#: the place in the hand-off of a priority barrier that jumped it (unaligned, see _jump)
_JUMPED: Final = 11
#: kinds the task thread runs at once when it decodes ahead (the listener's calls)
_CALLS: Final = frozenset((_TRIGGER, _ABORT, _PERSIST, _STATE_COMPLETE, _PARTIAL))
#: events that meet the handler in order with the records (decoding ahead stops at them)
_IN_ORDER_EVENTS: Final = (CheckpointBarrier, CancelCheckpointMarker)
#: what a PartitionReader's listener needs in unaligned mode
_UNALIGNED_METHODS: Final = ("persist_records", "persist_partial_record", "input_state_complete")

_Item = tuple[int, int, Any]  # (kind, channel, Buffer | (Buffer, ids) | event | error)


def _buffers_of(batch: list[_Item]) -> list[Buffer]:
    """The data buffers of a hand-off batch (plain and overtaken ones)."""
    return [
        item if kind == _DATA else item[0] for kind, _, item in batch if kind in (_DATA, _OVERTAKEN)
    ]


def _poll_data_into(gate: SingleInputGate, batch: list[_Item]) -> None:
    """The data buffers a channel holds, up to the batch's room, into the hand-off batch
    at once (``poll_data``: no BufferOrEvent each); events stay for ``poll_next``."""
    data = gate.poll_data(_BATCH_BUFFERS - len(batch))
    if data is not None:
        ch_index, buffers = data
        batch.extend([(_DATA, ch_index, buf) for buf in buffers])


class _CallsInOrder:
    """The barrier handler's listener in the synchronous reader: the handler runs while a
    batch is decoded, before the batch's records reach the task, so its callbacks are
    queued in the batch's output and made in ``records()`` at their place."""

    __slots__ = ("out", "persisting", "stream")

    def __init__(self) -> None:
        self.out: list[_Item] = []
        #: the reader's decoders (set once built): a channel's cut takes its partial record
        self.stream: RecordStream | None = None
        #: (checkpoint, bytes) when the buffer being processed is input channel state
        self.persisting: tuple[int, int] | None = None

    def trigger_checkpoint(
        self, checkpoint_id: int, timestamp: int, options: CheckpointOptions
    ) -> None:
        self.out.append((_TRIGGER, 0, (checkpoint_id, timestamp, options)))

    def abort_checkpoint(self, checkpoint_id: int, reason: CheckpointFailureReason) -> None:
        self.out.append((_ABORT, 0, (checkpoint_id, reason)))

    def persist_input(self, checkpoint_id: int, channel_index: int, buffer: Buffer) -> None:
        # the records decoded from this buffer are what gets persisted (see _decode)
        self.persisting = (checkpoint_id, buffer.size)

    def input_state_complete(self, checkpoint_id: int) -> None:
        self.out.append((_STATE_COMPLETE, 0, checkpoint_id))

    def input_channel_cut(self, checkpoint_id: int, channel_index: int) -> None:
        # the channel's decoder has consumed exactly the bytes before the cut (the buffer
        # that ends it is not fed yet): its incomplete record's head is channel state
        assert self.stream is not None
        partial = self.stream.unconsumed_bytes(channel_index)
        if partial:
            self.out.append((_PARTIAL, channel_index, (checkpoint_id, channel_index, partial)))


class PartitionReader:
    """Iterate the records of a set of partition locations from synchronous code.

    ``checkpoint_listener``'s ``trigger_checkpoint`` / ``abort_checkpoint`` run in the
    thread iterating ``records()``, between the records before and after each barrier;
    aligned channels are resumed by the barrier handler, never behind the task's back.
    """

    def __init__(
        self,
        locations: Sequence[PartitionLocation],
        options: ReaderOptions | None = None,
        *,
        runtime: ClientRuntime | None = None,
        window: int = 4,
        **overrides: Any,
    ) -> None:
        """``options`` with ``overrides`` as in ``AsyncPartitionReader.open``; at most
        ``window`` batches wait between the loop thread and the task thread."""
        opts = ReaderOptions.of(options, overrides)
        _check_locations(locations)
        check_count("window", window, 1)
        secret = secret_or_env(opts.secret)  # read once: the reporter connects with it too
        self._rt = runtime if runtime is not None else get_runtime()
        self.codec: RecordCodec = opts.codec if opts.codec is not None else default_codec()
        self._listener = opts.checkpoint_listener
        self._calls = _CallsInOrder()
        self._handler: CheckpointBarrierHandler | None = None
        if opts.checkpointing_mode is CheckpointingMode.UNALIGNED and opts.checkpoint_listener:
            for method in _UNALIGNED_METHODS:
                if not callable(getattr(opts.checkpoint_listener, method, None)):
                    raise ConfigError(
                        "checkpoint_listener",
                        f"unaligned checkpoints need a {method}() method, "
                        f"got {opts.checkpoint_listener!r}",
                    )
        if opts.checkpoint_listener is not None:  # the handler itself calls the queue
            self._handler = _barrier_handler(
                self._calls, opts, len(locations), self.resume_consumption
            )
        #: the handler parks input (``buffer`` / ``spill`` alignment) and replays it
        self._parking = (
            isinstance(self._handler, AlignedBarrierHandler)
            and self._handler.strategy is AlignmentStrategy.PARKING
        )
        # Unaligned: a priority barrier jumps the hand-off (Flink's priority events reach
        # the mailbox at once). The pump puts it here and leaves _JUMPED at its place; the
        # task thread takes it at its next record boundary (_jump): the items of its
        # channel still before that place are buffers it overtook (channel state).
        self._jumping = isinstance(self._handler, UnalignedBarrierHandler)
        self._priority: deque[tuple[int, CheckpointBarrier]] = deque()  # loop -> task
        self._on_priority: Callable[[], None] | None = None
        # task thread only: channel -> checkpoints whose barrier jumped its items in the
        # hand-off; items received not decoded yet; decoded items not dispatched yet
        self._jumped: dict[int, list[int]] = {}
        self._undecoded: deque[_Item] = deque()
        self._held: deque[_Item] = deque()  # debloating: decoded, records not processed yet
        self._ready: deque[_Item] = deque()
        self._ahead = False  # decoding ahead until the jumped checkpoint's state is complete
        self._closed = False
        # Loop thread -> task thread: buffers and events, every one queued taken at once
        # (one wake-up per batch, and only when the task waits for it).
        self._handoff: Channel[_Item] = Channel(window * _BATCH_BUFFERS, "reader hand-off")
        # Task thread -> loop thread: the decoded buffers, to release (their credit).
        self._back: Channel[Buffer] = Channel(_UNBOUNDED, "reader give-back")
        self._left: list[_Item] = []  # what the hand-off held when it closed
        # The one decode path, run in the task thread; resuming goes to the loop thread.
        # Built before the core opens: nothing is acquired yet if it refuses an argument.
        self._stream = RecordStream(
            self.codec,
            len(locations),
            self.resume_consumption,
            opts.event_handler,
            auto_resume_barriers=opts.auto_resume_barriers,
        )
        self._calls.stream = self._stream
        # The core reads the gate; events, barriers and reports are this facade's (they
        # run in the task thread, or report what it saw).
        core_options = opts.replace(
            codec=self.codec,
            secret=secret,
            event_handler=None,
            checkpoint_listener=None,
            num_floating=opts.floating_buffers,  # decided by the listener taken off here
            metrics_socket=None,
            task_name=None,
        )
        try:
            self._core = self._rt.run(AsyncPartitionReader.open(locations, core_options))
        except BaseException:
            if self._handler is not None:
                self._handler.close()  # a private spill directory goes with it
            raise
        self._core.in_flight = lambda: self._in_flight
        debloater = self._core.gate.debloater
        if debloater is not None:  # the task is idle when the hand-off is empty
            self._core.gate.reports_idle = False
            loop = self._rt.loop

            def starved() -> None:  # task thread: the loop decides (a put may be on its way)
                loop.call_soon_threadsafe(self._report_idle)

            self._handoff.on_starved = starved
        self._on_busy = debloater.on_gate_non_empty if debloater is not None else None
        # Debloating: a buffer goes back only once the task processed its records (Flink
        # recycles a buffer when its deserializer leaves it), not once decoded: records
        # decoded ahead are in-flight data the debloater must count (they hold their
        # buffers, so ``in_flight`` counts them), and credit comes back one buffer at a
        # time, so the producer's backlog arrives with every buffer rather than with the
        # last of a burst (when the daemon's queue is at its lowest).
        self._hold_until_processed = debloater is not None
        self._in_flight = 0  # buffers handed to the task thread, not yet given back
        #: a batch reader's (no checkpoint listener): set by the pump (loop thread) when a
        #: channel failed; the task raises it at its next record list, ahead of the record
        #: lists still queued in the hand-off (see ``_pump``)
        self._failure: BaseException | None = None
        self._error_overtakes = self._listener is None
        self._all_back: asyncio.Event | None = None
        self._rt.call_soon(self._recycle)  # arms the give-back's first notification
        self._pump_future = self._rt.submit(self._pump())
        self._done = False
        # The handler runs in the task thread: its figures are taken there after each batch
        # (handler.stats() is not safe from the loop thread), the reporter reads the last.
        self._barrier_snapshot: BarrierHandlerStats | None = None
        metrics_socket, task_name = opts.metrics_socket, opts.task_name
        if metrics_socket is not None and task_name is not None:
            if self._handler is not None:
                self._barrier_snapshot = self._handler.stats()

            def collect() -> dict[str, int | float]:
                return _task_metrics(self._core.debloat_stats, self._barrier_snapshot)

            start = functools.partial(
                self._core.start_reporting,
                metrics_socket,
                task_name,
                secret=secret,
                collect=collect,
            )
            self._rt.call_soon(start)

    @property
    def records_read(self) -> int:
        return self._stream.records_in

    @property
    def metrics_reports_sent(self) -> int:
        """TaskMetrics reports sent so far (0 when not reporting)."""
        return self._core.metrics_reports_sent

    def handoff_statistics(self) -> tuple[ChannelStatistics, ChannelStatistics]:
        """The figures of the two channels between the loop thread and the task thread:
        the hand-off (buffers and events in) and the give-back (decoded buffers out)."""
        return self._handoff.statistics(), self._back.statistics()

    @property
    def barrier_stats(self) -> BarrierHandlerStats | None:
        """The barrier handler's figures (None without a checkpoint listener)."""
        return self._handler.stats() if self._handler is not None else None

    @property
    def debloat_stats(self) -> BufferDebloaterStats | None:
        """The gate's debloating figures (None when debloating is off)."""
        return self._core.debloat_stats

    async def _pump(self) -> None:
        """Loop thread: move buffers (themselves) and events to the task thread.

        The end of the input, or the gate's error (a channel that failed), is the last item
        of the last batch, after the buffers polled before it. The end comes after their
        records, and so does the error of a streaming reader (a checkpoint listener: its
        window is Flink's 8 floating buffers, what waits ahead of the error is bounded by
        it, and a task cancelled with its job sees its own cancel before an upstream's
        failure the same cancel caused). In a batch reader the error overtakes them
        (``_failure``): the task raises it at its next record list, as Flink's gate throws
        a failed channel's error at that channel's turn rather than after the data other
        channels queued (with 32 floating buffers that can be the whole stream). The
        buffers it overtakes still go back to their channels (pools whole)."""
        gate = self._core.gate
        send = self._handoff.asend
        on_busy = self._on_busy
        last = False
        priority = False  # a priority barrier went by since the gate was last empty
        while not last:
            batch: list[_Item] = []
            try:
                _poll_data_into(gate, batch)
                boe = gate.poll_next() if len(batch) < _BATCH_BUFFERS else None
                if boe is None and not batch:
                    if priority:  # everything it overtook is handed over: say so
                        priority = False
                        with contextlib.suppress(ChannelBrokenError):  # closed: ends next
                            await send([(_DRAINED, 0, None)])
                    boe = await gate.get_next()
                    if boe is None:
                        batch.append((_END, 0, None))
                        last = True
                while boe is not None:
                    if boe.buffer is not None and boe.overtaken_by:
                        item = (boe.buffer, boe.overtaken_by)
                        batch.append((_OVERTAKEN, boe.channel_index, item))
                    elif boe.buffer is not None:
                        batch.append((_DATA, boe.channel_index, boe.buffer))
                    else:
                        event = boe.event
                        kind = _EVENT
                        if isinstance(event, CheckpointBarrier) and event.options.unaligned:
                            priority = True
                            if self._jumping:  # ahead of what the hand-off holds
                                self._priority.append((boe.channel_index, event))
                                kind = _JUMPED
                                notify = self._on_priority
                                if notify is not None:
                                    notify()
                        batch.append((kind, boe.channel_index, event))
                    if len(batch) >= _BATCH_BUFFERS:
                        break
                    _poll_data_into(gate, batch)
                    if len(batch) >= _BATCH_BUFFERS:
                        break
                    boe = gate.poll_next()
            except asyncio.CancelledError:
                raise  # only get_next() waits: the batch is empty
            except BaseException as e:  # a channel failed, maybe after others' buffers
                batch.append((_ERROR, 0, e))
                if self._error_overtakes:
                    self._failure = e  # before the send: raised ahead of what is queued
                last = True
            buffers = _buffers_of(batch)
            self._in_flight += len(buffers)
            try:
                fed = await send(batch)
            except asyncio.CancelledError:
                self._give_back(buffers)  # closed while waiting for room
                raise
            except ChannelBrokenError:  # the reader closed: nobody will decode them
                self._give_back(buffers)
                return
            if fed and on_busy is not None:  # input reached a task that waited for it
                on_busy()

    def _report_idle(self) -> None:
        """Loop thread: the task found no input; idle unless input reached it meanwhile."""
        debloater = self._core.gate.debloater
        if debloater is not None and self._handoff.receiver_starved:
            debloater.on_gate_empty()

    def _recycle(self) -> None:
        """Loop thread: release what the task thread decoded, everything queued at once,
        then arm the next call: a send of the task thread schedules it (one thread-safe
        call per batch, and only after this found nothing: none while batches queue up)."""
        back = self._back
        while True:
            try:
                buffers = back.poll(self._recycle_soon)
            except (ChannelClosedError, EndOfChannel):
                return
            if buffers is None:
                return
            self._give_back(buffers)

    def _recycle_soon(self) -> None:
        """Any thread: the give-back has buffers (or closed): recycle on the loop."""
        self._rt.call_soon(self._recycle)

    def _give_back(self, buffers: list[Buffer]) -> None:
        """Loop thread: release buffers the task thread has decoded (returns credit).

        A buffer already recycled is one the barrier handler released when it refused it
        (input on a channel blocked upstream: the reader fails with that error)."""
        self._in_flight -= len(buffers)
        for buf in buffers:
            if not buf.is_recycled:
                buf.release()
        if self._in_flight == 0 and self._all_back is not None:
            self._all_back.set()

    def resume_consumption(self, channel_index: int) -> None:
        """Unblock a channel after its aligned barrier (any thread)."""
        if not self._closed:
            self._rt.loop.call_soon_threadsafe(self._core.resume_consumption, channel_index)

    def __iter__(self) -> Iterator[Any]:
        return self.records()

    def records(self) -> Iterator[Any]:
        """Every record, in order per channel; raises the stream's error if it fails.

        A reader closed before the end (an early ``break`` closes it, and so does
        ``close()`` from another thread, even while this waits) raises IllegalStateError:
        nothing would ever arrive, and an empty read would pass for a short one.

        The records of each decoded buffer come as a list, chained (``itertools.chain``):
        the iterator's ``next`` walks a list in C, this method's frame runs once per
        buffer, not once per record.
        """
        return itertools.chain.from_iterable(self._record_lists())

    def record_lists(
        self, *, on_available: Callable[[], None] | None = None
    ) -> Iterator[list[Any]]:
        """The records of ``records()``, one list per decoded buffer, for a caller that
        chains them itself (the same ends: closed at the end, on an error, when dropped).

        With ``on_available`` it never blocks, for a task thread that waits for its input
        and for other work in one place (Flink's mailbox): when nothing was handed over
        yet it yields an empty list, and ``on_available()`` is called once, from the loop
        thread (or the thread closing the reader), as soon as something is. Wait for that,
        then ask again. A wake-up may find nothing new (a batch that only held a barrier):
        the next empty list arms it again."""
        return self._record_lists(on_available)

    def restore_unconsumed(self, channel_index: int, data: bytes) -> None:
        """Before reading: the restored head of channel ``channel_index``'s incomplete
        record at an unaligned checkpoint's cut, fed ahead of the channel's first buffer
        (whose producer replays the record's tail from its output channel state)."""
        self._stream.restore_unconsumed(channel_index, data)

    @property
    def last_unaligned(self) -> bool:
        """True when the last checkpoint triggered here triggered unaligned."""
        h = self._handler
        return isinstance(h, UnalignedBarrierHandler) and h.last_unaligned

    def barrier_deadline(self) -> float | None:
        """``time.monotonic()`` at which an aligned-first checkpoint turns unaligned
        (``aligned_checkpoint_timeout``): a task thread waiting for input waits no longer,
        then calls ``check_barrier_timeout``. None: no deadline."""
        h = self._handler
        return h.next_deadline() if isinstance(h, UnalignedBarrierHandler) else None

    def check_barrier_timeout(self) -> None:
        """Turn the pending checkpoint unaligned if its deadline passed (the iterating
        thread, between two record lists): its callbacks run now."""
        h = self._handler
        if not isinstance(h, UnalignedBarrierHandler) or h.next_deadline() is None:
            return
        out: list[_Item] = []
        self._calls.out = out
        h.poll_next()
        self._run_calls(out)

    @property
    def end_of_data(self) -> bool:
        """True once every input channel delivered EndOfData (in the iterating thread:
        from the event handler on, the records of every producer are in)."""
        return self._stream.end_of_data

    def set_priority_notify(self, notify: Callable[[], None]) -> None:
        """Unaligned: ``notify()`` is called (loop thread) when a priority barrier jumped
        the hand-off, and when input comes while the reader decodes ahead for a jumped
        checkpoint; the task thread then calls ``take_priority()`` (a task whose output is
        blocked waits for this as well as for room)."""
        self._on_priority = notify
        if self._priority:
            notify()

    def take_priority(self) -> None:
        """The iterating thread, at a record boundary (between two record lists): handle
        the priority barriers that jumped the hand-off, and decode ahead what their
        checkpoint still needs as channel state (a task whose output is blocked calls this
        while it waits: Flink's mailbox takes the barrier while the output is unavailable)."""
        if not self._jumping or self._closed or self._done:
            return
        if self._priority and all(kind == _DATA for kind, _, _ in self._ready):
            self._jump()
        if self._ahead:
            self._decode_ahead()

    def _jump(self) -> None:
        """The barriers in the priority slot overtake everything received and not processed
        yet: the handler triggers now; the items of each barrier's channel up to its
        ``_JUMPED`` place are flagged as overtaken by it when decoded (channel state).
        Record lists decoded before and not processed yet (``_ready``: only record lists,
        or no jump) were before the cut for the handler but are in no state: they are
        persisted as channel state of each checkpoint triggered now, first of their
        channel's, and processed after the trigger (Flink persists the unconsumed part of
        the buffer the task is in). ``nbytes`` 0: the task counts their pickled size."""
        out: list[_Item] = []
        self._calls.out = out
        self._take_priority_into()
        listener = self._listener
        assert listener is not None
        for call in out:
            self._run_calls([call])
            if call[0] == _TRIGGER:  # before anything else of the checkpoint
                for _, ch, records in self._ready:
                    listener.persist_records(call[2][0], ch, records, 0)  # type: ignore[attr-defined]
        self._ahead = True

    def _take_priority_into(self) -> None:
        handler = self._handler
        assert handler is not None
        while self._priority:
            ch, barrier = self._priority.popleft()
            self._jumped.setdefault(ch, []).append(barrier.checkpoint_id)
            handler.process(BufferOrEvent(None, barrier, ch, False))

    def _decode_ahead(self) -> None:
        """After a jump, until the checkpoint's channel state is complete: decode what was
        handed over at once (the buffers are persisted, Flink's ChannelStateWriter takes
        them when the barrier comes) and keep the records for the task in order, rather
        than making the checkpoint wait until the task processed them. Stops before what
        must meet the handler in order with the records: an in-order barrier or marker,
        the place of a barrier not jumped yet, the end."""
        handler = self._handler
        assert isinstance(handler, UnalignedBarrierHandler)
        while handler.collecting_unaligned:
            if not self._undecoded:
                notify = self._on_priority
                if notify is not None:
                    got = self._handoff.poll(notify)  # input while collecting wakes the task
                else:
                    got = self._handoff.receive_nowait() or None
                if got is None:
                    return
                self._undecoded.extend(got)
            kind, _, item = self._undecoded[0]
            if (
                (kind == _JUMPED and self._priority)
                or (kind == _EVENT and isinstance(item, _IN_ORDER_EVENTS))
                or kind in (_END, _ERROR)
            ):
                return
            for got_item in self._decode([self._undecoded.popleft()]):
                if got_item[0] in _CALLS:
                    self._run_calls([got_item])
                else:
                    self._ready.append(got_item)
        self._ahead = False

    def _run_calls(self, out: list[_Item]) -> None:
        """Make the listener's calls of ``out`` (no records among them)."""
        listener = self._listener
        assert listener is not None
        for kind, _, item in out:
            if kind == _TRIGGER:
                listener.trigger_checkpoint(*item)
            elif kind == _ABORT:
                listener.abort_checkpoint(*item)
            elif kind == _PERSIST:
                listener.persist_records(*item)  # type: ignore[attr-defined]
            elif kind == _STATE_COMPLETE:
                listener.input_state_complete(item)  # type: ignore[attr-defined]
            elif kind == _PARTIAL:
                listener.persist_partial_record(*item)  # type: ignore[attr-defined]
            else:
                raise IllegalStateError(f"reader: item {kind} where a listener call was due")

    def _record_lists(self, on_available: Callable[[], None] | None = None) -> Iterator[list[Any]]:
        if self._closed and not self._done:
            raise IllegalStateError("the PartitionReader was closed before the end of its input")
        if self._jumping:
            yield from self._jumping_lists(on_available)
        else:
            yield from self._batch_lists(on_available)

    def _jumping_lists(self, on_available: Callable[[], None] | None) -> Iterator[list[Any]]:
        """``_batch_lists`` for an unaligned reader: one item decoded at a time, so that a
        priority barrier taken between two record lists overtakes the rest."""
        ready, undecoded = self._ready, self._undecoded
        try:
            while not self._done:
                self.take_priority()
                if ready:
                    yield from self._dispatch([ready.popleft()])
                elif undecoded:
                    ready.extend(self._decode([undecoded.popleft()]))
                else:
                    batch = self._take_batch(on_available)
                    if batch is None:
                        yield []  # nothing yet: on_available() will be called
                        continue
                    undecoded.extend(batch)
                if self._closed and not self._done:
                    raise IllegalStateError(_CLOSED_WHILE_READING)
        finally:
            self._return_undecoded()
            self.close()

    def _return_undecoded(self) -> None:
        """Give back the buffers received and not decoded, and a held one (any thread:
        pops one by one)."""
        buffers: list[Buffer] = []
        for items in (self._undecoded, self._held):
            while True:
                try:
                    buffers.extend(_buffers_of([items.popleft()]))
                except IndexError:
                    break
        if buffers:
            try:
                self._back.send_nowait(buffers, force=True)
            except ChannelBrokenError:  # closed while this thread decoded (timed out)
                self._rt.call_soon(self._give_back, buffers)

    def _dispatch(self, out: list[_Item]) -> Iterator[list[Any]]:
        """Yield the records of ``out``, run its events and listener calls in order."""
        for kind, ch, item in out:
            if kind == _DATA:
                failure = self._failure
                if failure is not None:  # a channel failed: not after what is queued
                    self._done = True
                    raise failure
                yield item
            elif kind == _EVENT:
                self._stream.on_event(item, ch)
            elif kind == _END:
                self._done = True
            elif kind == _ERROR:
                self._done = True
                raise item
            else:
                self._run_calls([(kind, ch, item)])

    def _take_batch(self, on_available: Callable[[], None] | None) -> list[_Item] | None:
        """The next hand-off batch: waits for it without ``on_available``; with it, None
        when nothing was handed over yet (``on_available()`` is armed)."""
        try:
            if on_available is None:
                return self._handoff.receive()
            return self._handoff.poll(on_available)
        except ChannelClosedError:
            raise IllegalStateError("the PartitionReader was closed while reading") from None

    def _batch_lists(self, on_available: Callable[[], None] | None) -> Iterator[list[Any]]:
        try:
            while not self._done:
                batch = self._take_batch(on_available)
                if batch is None:
                    yield []  # nothing yet: on_available() will be called
                    continue
                if self._hold_until_processed:
                    yield from self._held_lists(batch)
                else:
                    yield from self._dispatch(self._decode(batch))
                if self._closed and not self._done:
                    raise IllegalStateError(_CLOSED_WHILE_READING)
        finally:
            self.close()

    def _held_lists(self, batch: list[_Item]) -> Iterator[list[Any]]:
        """``_dispatch(_decode(batch))`` one item at a time, each item's buffer given back
        once its records were processed (the caller asked for the next list): see
        ``_hold_until_processed``. The rest of the batch waits in ``_undecoded`` and the
        item being processed in ``_held``, where ``close()`` from any thread finds them
        (both pop one by one); the held item also goes back on any way out of here."""
        undecoded, held = self._undecoded, self._held
        undecoded.extend(batch)
        try:
            while True:
                try:
                    item = undecoded.popleft()
                except IndexError:
                    return
                try:
                    out = self._decode([item], give_back=False)
                except BaseException:
                    self._give_back_decoded([item])
                    raise
                held.append(item)  # decoded: close() may give it back from now on
                yield from self._dispatch(out)
                self._give_back_held()
        finally:
            self._give_back_held()

    def _give_back_held(self) -> None:
        """Give back the item whose records were processed (any thread; once)."""
        try:
            item = self._held.popleft()
        except IndexError:
            return
        self._give_back_decoded([item])

    def _decode(self, batch: list[_Item], *, give_back: bool = True) -> list[_Item]:
        """Decode a batch's buffers, then give them all back in one send to the loop
        thread (also when decoding fails: the buffers not reached yet go back too);
        ``give_back`` False: the caller gives them back."""
        out: list[_Item] = []
        handler = self._handler
        if handler is None and not self._jumped:
            return self._decode_plain(batch, out, give_back)
        parking = self._parking
        self._calls.out = out
        try:
            for kind, ch, item in batch:
                if kind in (_DATA, _OVERTAKEN):
                    overtaken_by: tuple[int, ...] = ()
                    if kind == _OVERTAKEN:
                        # a priority barrier overtook it (unaligned mode: nothing parks)
                        item, overtaken_by = item
                    jumped = self._jumped.get(ch)
                    if jumped:  # before the place of barriers that jumped the hand-off
                        overtaken_by = tuple(sorted({*overtaken_by, *jumped}))
                    if parking:
                        assert handler is not None
                        # the handler may park the buffer (keep it, or spill and release
                        # it): it gets a reference of its own, the batch keeps its one
                        item.retain()
                        if handler.process(BufferOrEvent(item, None, ch, False)) is None:
                            self._replay_parked(out)  # a limit may have ended the alignment
                            continue
                        item.release()
                    elif handler is not None:
                        # blocking upstream, tracking or unaligned: never parks a buffer
                        handler.process(BufferOrEvent(item, None, ch, False, overtaken_by))
                    self._feed(out, ch, item)
                elif kind == _DRAINED:
                    # not while items a jumped barrier overtook are still to come: its
                    # own _DRAINED follows its place
                    if isinstance(handler, UnalignedBarrierHandler) and not self._jumped:
                        handler.input_drained()
                elif kind == _JUMPED:
                    # the barrier's own place: taken now if not yet (in order, then); the
                    # items of its channel from here on are not overtaken by it
                    if self._priority:
                        self._take_priority_into()
                    ids = self._jumped[ch]
                    ids.remove(item.checkpoint_id)
                    if not ids:
                        del self._jumped[ch]
                elif kind == _EVENT and handler is not None:
                    if handler.process(BufferOrEvent(None, item, ch, False)) is not None:
                        out.append((kind, ch, item))
                    if parking:
                        self._replay_parked(out)  # the alignment ended: parked input first
                else:
                    out.append((kind, ch, item))
            if handler is not None and self._barrier_snapshot is not None:
                self._barrier_snapshot = handler.stats()
        finally:
            if give_back:
                self._give_back_decoded(batch)
        return out

    def _decode_plain(self, batch: list[_Item], out: list[_Item], give_back: bool) -> list[_Item]:
        """``_decode`` with no barrier handler (nothing parks, jumps or is persisted):
        each buffer's records straight into ``out``, in one compiled loop over the batch
        (``RecordStream.feed_batch``); the buffers go back the same way."""
        try:
            self._stream.feed_batch(batch, out)
        finally:
            if give_back:
                self._give_back_decoded(batch)
        return out

    def _give_back_decoded(self, batch: list[_Item]) -> None:
        """Task thread: the batch's buffers back to the loop thread in one send."""
        buffers = _buffers_of(batch)
        if buffers:
            try:
                self._back.send_nowait(buffers, force=True)
            except ChannelBrokenError:  # closed while this thread decoded (timed out)
                self._rt.call_soon(self._give_back, buffers)

    def _feed(self, out: list[_Item], ch: int, buf: Buffer) -> None:
        view = buf.memoryview()
        try:
            records = self._stream.feed(ch, view)
        finally:
            view.release()
        persisting = self._calls.persisting
        if persisting is not None:
            # input channel state (unaligned): the records this buffer completes, a record
            # begun before the trigger included (it is processed after it); the head of a
            # record still incomplete when a channel's cut ends is persisted apart
            # (input_channel_cut); the bytes are the buffer's
            self._calls.persisting = None
            out.append((_PERSIST, ch, (persisting[0], ch, records, persisting[1])))
        if records:
            out.append((_DATA, ch, records))

    def _replay_parked(self, out: list[_Item]) -> None:
        """Input the handler parked during an alignment that just ended, in arrival order
        and before anything newer (``buffer`` and ``spill`` alignment)."""
        assert self._handler is not None
        while (boe := self._handler.poll_next()) is not None:
            if boe.buffer is not None:
                try:
                    self._feed(out, boe.channel_index, boe.buffer)
                finally:
                    boe.buffer.release()
            else:
                out.append((_EVENT, boe.channel_index, boe.event))

    def read_all(self) -> list[Any]:
        return list(self.records())

    def close(self) -> None:
        """Stop reading and release everything (idempotent; any thread; after an early stop
        a ``records()`` still waiting raises IllegalStateError)."""
        if self._closed:
            return
        self._closed = True
        self._left = self._handoff.close_receiver()  # wakes a records() waiting
        self._return_undecoded()
        self._pump_future.cancel()
        self._rt.run(self._close_async())
        if self._handler is not None:
            self._handler.close()

    async def _close_async(self) -> None:
        await wait_quietly(asyncio.wrap_future(self._pump_future), log, "reader pump")
        left, self._left = self._left, []
        self._give_back(_buffers_of(left))
        if self._in_flight:  # the task thread is decoding a batch: wait for its buffers
            self._all_back = asyncio.Event()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._all_back.wait(), _GIVE_BACK_TIMEOUT)
        self._give_back(self._back.close_receiver())
        await self._core.close()

    def __enter__(self) -> PartitionReader:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
