"""RemoteInputChannel: credit-based reading of a subpartition on another daemon.

The logic of Flink's RemoteInputChannel and BufferManager, with the I/O behind the
``PartitionRequestClient`` interface (implemented in ``client``):

* ``num_exclusive`` buffers are taken from the NetworkBufferPool at setup; they are the
  initial credit and come back to this channel when released.
* The sender announces its backlog with every buffer; the channel then asks the gate's
  LocalBufferPool for *floating* buffers until it holds ``backlog + num_exclusive`` free
  buffers, registering as a BufferListener when the pool is empty.
* Every buffer gained is *unannounced credit*. A channel holding fewer than
  ``HALVES_FROM`` free buffers has the client send AddCredit (which takes all unannounced
  credit at once) as soon as it has any, as Flink does when its unannounced credit goes
  from 0 to positive. A larger window (more floating buffers than Flink's 8 per gate)
  announces in halves: once the sender holds no more credit than is unannounced
  (``free buffers <= 2 * unannounced``), checked when credit is gained and when a buffer
  arrives, so one AddCredit write (and one wake-up of the daemon) per half window instead
  of one per give-back. While the sender holds credit it sends, and every buffer it sends
  brings the check again, so credit never waits with the sender idle. With buffer
  debloating the credit goes out at once (the debloater counts what is in flight buffer
  by buffer).
* AvailableBufferQueue hands out floating buffers first, and gives one back to the pool
  when a returning exclusive buffer makes the channel hold more than it needs.
* Sequence numbers are checked: a gap or repeat fails the channel.
* A priority event (an unaligned checkpoint barrier, Flink's ``addPriorityElement`` on
  ``receivedBuffers``) goes ahead of every buffer received and not yet taken, behind
  earlier priority events only, and the gate is told (``notify_priority_event``). The
  data buffers it overtook are still handed out after it, in order, each flagged with
  ``overtaken_by`` (the checkpoint ids whose barrier overtook it): the task processes
  them and persists them as input channel state of those checkpoints.
"""

from __future__ import annotations

import asyncio
import itertools
from collections import deque
from typing import TYPE_CHECKING, Final, Protocol

from exchange.buffers.buffer import Buffer, DataType
from exchange.consumer.input_channel import (
    DEFAULT_BACKOFF_INITIAL,
    DEFAULT_BACKOFF_MAX,
    BufferAndAvailability,
    InputChannel,
    backoff_delays,
)
from exchange.errors import (
    CorruptRecordError,
    ExchangeError,
    IllegalStateError,
    PartitionNotFoundError,
    SequenceNumberError,
    UsageError,
)
from exchange.events.events import EventSerializer
from exchange.memory.buffer_listener import NotificationResult
from exchange.memory.memory_segment import MemorySegment
from exchange.memory.network_buffer_pool import NetworkBufferPool
from exchange.partition.result_partition_id import ResultPartitionID

if TYPE_CHECKING:
    from exchange.consumer.single_input_gate import SingleInputGate

__all__ = [
    "HALVES_FROM",
    "AvailableBufferQueue",
    "ConnectionProvider",
    "PartitionRequestClient",
    "RemoteInputChannel",
]


#: Free buffers from which a channel announces its credit in halves (see the docstring):
#: more than Flink's defaults give a channel (2 exclusive + 8 floating per gate).
HALVES_FROM: Final = 16


class PartitionRequestClient(Protocol):
    """What a RemoteInputChannel needs from its connection (implemented in ``client``)."""

    @property
    def address(self) -> str: ...

    def request_subpartition(self, channel: RemoteInputChannel) -> None: ...

    def notify_credit_available(self, channel: RemoteInputChannel) -> None: ...

    def resume_consumption(self, channel: RemoteInputChannel) -> None: ...

    def notify_new_buffer_size(self, channel: RemoteInputChannel, size: int) -> None: ...

    def cancel_request(self, channel: RemoteInputChannel) -> None: ...


class ConnectionProvider(Protocol):
    async def create_partition_request_client(self, address: str) -> PartitionRequestClient: ...


class AvailableBufferQueue:
    """Free buffers of one channel: floating ones (given back first) and exclusive ones."""

    __slots__ = ("exclusive", "floating")

    def __init__(self) -> None:
        self.floating: deque[Buffer] = deque()
        self.exclusive: deque[Buffer] = deque()

    def add_exclusive(self, buffer: Buffer, num_required: int) -> int:
        """Add a returning exclusive buffer; returns the net number of buffers gained."""
        self.exclusive.append(buffer)
        if len(self.floating) + len(self.exclusive) > num_required and self.floating:
            self.floating.popleft().release()
            return 0
        return 1

    def add_floating(self, buffer: Buffer) -> None:
        self.floating.append(buffer)

    def take(self) -> Buffer | None:
        if self.floating:
            return self.floating.popleft()
        if self.exclusive:
            return self.exclusive.popleft()
        return None

    def __len__(self) -> int:
        return len(self.floating) + len(self.exclusive)


class RemoteInputChannel(InputChannel):
    """Reads one remote subpartition with credit-based flow control."""

    def __init__(
        self,
        gate: SingleInputGate,
        channel_index: int,
        partition_id: ResultPartitionID,
        subpartition_index: int,
        address: str,
        connection_provider: ConnectionProvider,
        network_pool: NetworkBufferPool,
        *,
        num_exclusive: int = 2,
        backoff_initial: float = DEFAULT_BACKOFF_INITIAL,
        backoff_max: float = DEFAULT_BACKOFF_MAX,
        buffer_request_timeout: float | None = None,
    ) -> None:
        super().__init__(
            gate,
            channel_index,
            partition_id,
            subpartition_index,
            backoff_initial=backoff_initial,
            backoff_max=backoff_max,
        )
        if num_exclusive < 1:
            # Flink's zero-exclusive mode needs backlog announcements without data; the
            # protocol has no such message, so every remote channel owns >= 1 buffer.
            raise UsageError(f"num_exclusive must be >= 1, got {num_exclusive}")
        self.address = address
        self._provider = connection_provider
        self._network_pool = network_pool
        self.initial_credit = num_exclusive
        self._buffer_request_timeout = buffer_request_timeout
        self._client: PartitionRequestClient | None = None
        self._received: deque[Buffer] = deque()
        self._num_priority = 0  # priority events at the head of ``_received``
        # [checkpoint id, data buffers at the head of the data section still overtaken]
        self._overtaken: deque[list[int]] = deque()
        self._expected_sequence = 0
        self._unannounced_credit = 0
        self._credit_notified = False  # the client was told to take the unannounced credit
        self._queue = AvailableBufferQueue()
        self._num_required = num_exclusive
        self._waiting_for_floating = False
        self._exclusive_segments = 0  # exclusive segments this channel owns (any state)
        self._delays = backoff_delays(backoff_initial, backoff_max)
        self.receiver_id = -1  # assigned by the client
        self.sender_backlog = 0
        # the last size announced (debloating); sent again with every repeated request
        self._buffer_size: int | None = None

    # -- setup and partition request -----------------------------------------------------

    async def request_subpartition(self) -> None:
        if self._client is not None:
            return
        if self._released:
            raise IllegalStateError(f"{self!r} was released")
        client = await self._provider.create_partition_request_client(self.address)
        if self.initial_credit and self._exclusive_segments == 0:
            segments = await self._network_pool.request_memory_segments(
                self.initial_credit, self._buffer_request_timeout
            )
            if self._released:
                self._network_pool.recycle_memory_segments(segments)
                raise IllegalStateError(f"{self!r} was released")
            self._exclusive_segments = len(segments)
            for seg in segments:
                self._queue.exclusive.append(Buffer(seg, self))
        self._client = client
        client.request_subpartition(self)

    def on_partition_not_found(self) -> bool:
        """The producer is not there yet; retry after the next backoff delay.

        Returns False (and fails the channel) once the backoff is exhausted.
        """
        delay = next(self._delays, None)
        if delay is None or self._released:
            self.set_error(
                PartitionNotFoundError("partition not found", self.partition_id, self.address)
            )
            return False
        client = self._client
        if client is not None:
            asyncio.get_running_loop().call_later(delay, self._retrigger)
        return True

    def _retrigger(self) -> None:
        client = self._client
        if self._released or client is None:
            return
        try:
            client.request_subpartition(self)
            if self._buffer_size is not None:  # the first went to a partition not there yet
                client.notify_new_buffer_size(self, self._buffer_size)
        except ExchangeError as e:  # the connection died during the backoff
            self.set_error(e)

    # -- receiving -----------------------------------------------------------------------

    def request_buffer(self) -> Buffer | None:
        """A free buffer to receive the next data buffer into (None: no credit was due)."""
        return self._queue.take()

    def on_buffer(self, buffer: Buffer, sequence_number: int, backlog: int) -> None:
        """A BufferResponse arrived (the buffer is this channel's to hand on)."""
        if self._released:
            buffer.release()
            return
        if sequence_number != self._expected_sequence:
            buffer.release()
            self.set_error(
                SequenceNumberError(
                    sequence_number,
                    self._expected_sequence,
                    self.receiver_id,
                    self.partition_id,
                    self.address,
                )
            )
            return
        self._expected_sequence = sequence_number + 1
        if self._unannounced_credit and not self._credit_notified:
            self._maybe_announce()  # the sender has one credit less
        self.bytes_in += buffer.size
        self.buffers_in += 1
        if buffer.data_type.has_priority:
            self._on_priority_event(buffer)
        else:
            was_empty = not self._received
            self._received.append(buffer)
            if was_empty:
                self.notify_channel_non_empty()
        if backlog >= 0:
            self.on_sender_backlog(backlog)

    def _on_priority_event(self, buffer: Buffer) -> None:
        try:
            checkpoint_id = EventSerializer.checkpoint_id_of_priority_barrier(buffer)
        except CorruptRecordError as e:
            buffer.release()
            self.set_error(e)
            return
        received = self._received
        overtaken = sum(
            1 for b in itertools.islice(received, self._num_priority, None) if b.is_buffer
        )
        received.insert(self._num_priority, buffer)
        self._num_priority += 1
        if overtaken:
            self._overtaken.append([checkpoint_id, overtaken])
        self.gate.notify_priority_event(self)

    def on_sender_backlog(self, backlog: int) -> None:
        self.sender_backlog = backlog
        added = self._request_floating_buffers(backlog + self.initial_credit)
        if added > 0:
            self._add_credit(added)

    def _request_floating_buffers(self, num_required: int) -> int:
        self._num_required = num_required
        pool = self.gate.buffer_pool
        added = 0
        if pool is None or self._waiting_for_floating:
            return 0
        queue = self._queue
        have = len(queue.floating) + len(queue.exclusive)  # once per buffer received
        while have + added < num_required:
            buf = pool.request_buffer()
            if buf is None:
                if pool.add_buffer_listener(self):
                    self._waiting_for_floating = True
                break
            queue.add_floating(buf)
            added += 1
        return added

    def _add_credit(self, n: int) -> None:
        self._unannounced_credit += n
        if not self._credit_notified:
            self._maybe_announce()

    def _maybe_announce(self) -> None:
        """Have the client announce the unannounced credit: at once in a small window or
        with debloating, else once the sender holds no more than that (module docstring)."""
        free = len(self._queue)
        if (
            (
                free < HALVES_FROM
                or free <= 2 * self._unannounced_credit
                or self.gate.debloater is not None
            )
            and self._client is not None
            and not self._released
        ):
            self._credit_notified = True
            self._client.notify_credit_available(self)

    def get_and_reset_unannounced_credit(self) -> int:
        n = self._unannounced_credit
        self._unannounced_credit = 0
        self._credit_notified = False
        return n

    @property
    def unannounced_credit(self) -> int:
        return self._unannounced_credit

    @property
    def num_available_buffers(self) -> int:
        return len(self._queue)

    @property
    def num_queued_buffers(self) -> int:
        return len(self._received)

    @property
    def announced_backlog(self) -> int:
        return self.sender_backlog

    # -- BufferListener (floating buffers) -----------------------------------------------

    def notify_buffer_available(self, buffer: Buffer) -> NotificationResult:
        queue = self._queue
        have = len(queue.floating) + len(queue.exclusive)  # (runs per recycled buffer)
        if self._released or have >= self._num_required:
            self._waiting_for_floating = False
            return NotificationResult.BUFFER_NOT_USED
        queue.floating.append(buffer)
        if have + 1 >= self._num_required:
            self._waiting_for_floating = False
            result = NotificationResult.BUFFER_USED_NO_NEED_MORE
        else:
            result = NotificationResult.BUFFER_USED_NEED_MORE
        self._add_credit(1)
        return result

    def notify_buffer_destroyed(self) -> None:
        self._waiting_for_floating = False

    # -- BufferRecycler (exclusive buffers) ----------------------------------------------

    def recycle(self, segment: MemorySegment) -> None:
        if self._released:
            self._exclusive_segments -= 1
            self._network_pool.recycle_memory_segments([segment])
            return
        gained = self._queue.add_exclusive(Buffer(segment, self), self._num_required)
        if gained:
            self._add_credit(gained)

    # -- reading -------------------------------------------------------------------------

    def get_next_buffer(self) -> BufferAndAvailability | None:
        self.check_error()
        if not self._received:
            return None
        buf = self._received.popleft()
        overtaken_by: tuple[int, ...] = ()
        if self._num_priority and buf.data_type.has_priority:
            self._num_priority -= 1
        elif self._overtaken and buf.is_buffer:
            overtaken_by = tuple(window[0] for window in self._overtaken)
            for window in self._overtaken:
                window[1] -= 1
            while self._overtaken and self._overtaken[0][1] == 0:
                self._overtaken.popleft()
        return BufferAndAvailability(
            buf,
            bool(self._received),
            self.sender_backlog,
            self._expected_sequence - 1,
            overtaken_by,
        )

    def take_data_buffers(self, limit: int) -> tuple[list[Buffer], bool]:
        self.check_error()
        received = self._received
        if self._num_priority or self._overtaken or not received:
            return [], bool(received)
        n = min(limit, len(received))
        taken: list[Buffer] = []
        append, popleft = taken.append, received.popleft
        for _ in range(n):
            if not received[0].is_buffer:
                break
            append(popleft())
        return taken, bool(received)

    @property
    def has_priority_event(self) -> bool:
        return self._num_priority > 0

    def resume_consumption(self) -> None:
        if self._released:
            raise IllegalStateError(f"{self!r} was released")
        if self._client is not None:
            self._client.resume_consumption(self)

    def notify_new_buffer_size(self, size: int) -> None:
        self._buffer_size = size
        if self._client is not None and not self._released:
            self._client.notify_new_buffer_size(self, size)

    def release_all_resources(self) -> None:
        if self._released:
            return
        self._released = True
        while self._received:
            self._received.popleft().release()
        self._num_priority = 0
        self._overtaken.clear()
        exclusive = [b.segment for b in self._queue.exclusive]
        self._queue.exclusive.clear()
        while self._queue.floating:
            self._queue.floating.popleft().release()
        if exclusive:
            self._exclusive_segments -= len(exclusive)
            self._network_pool.recycle_memory_segments(exclusive)
        client, self._client = self._client, None
        if client is not None:
            client.cancel_request(self)

    def receive_event(self, payload: bytes | memoryview, data_type: DataType) -> Buffer:
        """An unpooled buffer for an event (events need no credit)."""
        return Buffer.wrap(payload, data_type)
