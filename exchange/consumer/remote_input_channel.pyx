# cython: language_level=3
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
* ``floating_share`` (0: Flink's rule): the floating buffers the channel asks for whatever
  the backlog, so it always holds ``num_exclusive + floating_share`` free buffers when the
  pool has them. A reader gives each channel its share of the gate's floating pool
  (``client.consumer``, not with debloating): a producer-bound stream (a small backlog)
  then still has a credit window large enough to be announced in halves, rather than one
  AddCredit per give-back of the task (each a write that wakes the daemon).
* Sequence numbers are checked: a gap or repeat fails the channel.
* A priority event (an unaligned checkpoint barrier, Flink's ``addPriorityElement`` on
  ``receivedBuffers``) goes ahead of every buffer received and not yet taken, behind
  earlier priority events only, and the gate is told (``notify_priority_event``). The
  data buffers it overtook are still handed out after it, in order, each flagged with
  ``overtaken_by`` (the checkpoint ids whose barrier overtook it): the task processes
  them and persists them as input channel state of those checkpoints.

Compiled (``cdef class``es, fields in ``remote_input_channel.pxd``): a buffer's arrival,
the credit accounting and the free-buffer queue are C calls; the connection calls
``request_buffer`` and ``on_buffer`` once per buffer. ``remote_input_channel.pyi`` types
the module for mypy. There is no Python version of it.
"""

import asyncio
import itertools
from collections import deque

from exchange.buffers.buffer cimport Buffer
from exchange.consumer.input_channel cimport InputChannel

from exchange.buffers.buffer import DataType
from exchange.consumer.input_channel import (
    DEFAULT_BACKOFF_INITIAL,
    DEFAULT_BACKOFF_MAX,
    BufferAndAvailability,
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

# (``PartitionRequestClient`` and ``ConnectionProvider``, what a channel needs from its
# connection, are Protocols of remote_input_channel.pyi: types only.)
__all__ = ["HALVES_FROM", "AvailableBufferQueue", "RemoteInputChannel"]

cdef object _DATA_BUFFER = DataType.DATA_BUFFER
cdef object _PRIORITIZED = DataType.PRIORITIZED_EVENT_BUFFER
cdef object _NOT_USED = NotificationResult.BUFFER_NOT_USED
cdef object _USED_NO_NEED_MORE = NotificationResult.BUFFER_USED_NO_NEED_MORE
cdef object _USED_NEED_MORE = NotificationResult.BUFFER_USED_NEED_MORE

#: Free buffers from which a channel announces its credit in halves (see the docstring):
#: more than Flink's defaults give a channel (2 exclusive + 8 floating per gate).
HALVES_FROM = 16
cdef Py_ssize_t _HALVES_FROM = HALVES_FROM


cdef class AvailableBufferQueue:
    """Free buffers of one channel: floating ones (given back first) and exclusive ones."""

    def __init__(self):
        self.floating = deque()
        self.exclusive = deque()

    cdef Py_ssize_t size(self):
        return len(self.floating) + len(self.exclusive)

    cpdef Py_ssize_t add_exclusive(self, Buffer buffer, Py_ssize_t num_required) except -1:
        """Add a returning exclusive buffer; returns the net number of buffers gained."""
        self.exclusive.append(buffer)
        if self.floating and len(self.floating) + len(self.exclusive) > num_required:
            (<Buffer>self.floating.popleft()).release()
            return 0
        return 1

    def add_floating(self, Buffer buffer):
        self.floating.append(buffer)

    cpdef Buffer take(self):
        if self.floating:
            return <Buffer>self.floating.popleft()
        if self.exclusive:
            return <Buffer>self.exclusive.popleft()
        return None

    def __len__(self):
        return len(self.floating) + len(self.exclusive)


cdef class RemoteInputChannel(InputChannel):
    """Reads one remote subpartition with credit-based flow control."""

    def __init__(
        self,
        gate,
        channel_index,
        partition_id,
        subpartition_index,
        address,
        connection_provider,
        network_pool,
        *,
        num_exclusive=2,
        backoff_initial=DEFAULT_BACKOFF_INITIAL,
        backoff_max=DEFAULT_BACKOFF_MAX,
        buffer_request_timeout=None,
        floating_share=0,
    ):
        InputChannel.__init__(
            self,
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
        self._client = None
        self._received = deque()
        self._num_priority = 0  # priority events at the head of ``_received``
        # [checkpoint id, data buffers at the head of the data section still overtaken]
        self._overtaken = deque()
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
        self._buffer_size = None
        if floating_share < 0:
            raise UsageError(f"floating_share must be >= 0, got {floating_share}")
        self.floating_share = floating_share
        # the free buffers asked for whatever the backlog (Flink's rule: backlog + exclusive)
        self._floor = num_exclusive + floating_share if floating_share else 0

    # -- setup and partition request -----------------------------------------------------

    async def request_subpartition(self):
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

    def on_partition_not_found(self):
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

    def _retrigger(self):
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

    cpdef Buffer request_buffer(self):
        """A free buffer to receive the next data buffer into (None: no credit was due)."""
        return self._queue.take()

    cpdef void on_buffer(
        self, Buffer buffer, unsigned long long sequence_number, long long backlog
    ) except *:
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
        self.bytes_in += buffer._size
        self.buffers_in += 1
        if buffer._data_type is _PRIORITIZED:
            self._on_priority_event(buffer)
        else:
            was_empty = not self._received
            self._received.append(buffer)
            if was_empty:
                self.gate.notify_channel_non_empty(self)
        if backlog >= 0:
            self.on_sender_backlog(backlog)

    cdef void _on_priority_event(self, Buffer buffer) except *:
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

    cpdef void on_sender_backlog(self, Py_ssize_t backlog) except *:
        self.sender_backlog = backlog
        cdef Py_ssize_t required = backlog + self.initial_credit
        if self._floor > required:  # its share of the floating pool (module docstring)
            required = self._floor
        cdef Py_ssize_t added = self._request_floating_buffers(required)
        if added > 0:
            self._add_credit(added)

    cdef Py_ssize_t _request_floating_buffers(self, Py_ssize_t num_required) except -1:
        self._num_required = num_required
        if self._waiting_for_floating:
            return 0
        cdef AvailableBufferQueue queue = self._queue
        cdef Py_ssize_t have = queue.size()  # once per buffer received
        if have >= num_required:
            return 0
        pool = self.gate.buffer_pool
        if pool is None:
            return 0
        cdef Py_ssize_t added = 0
        while have + added < num_required:
            buf = pool.request_buffer()
            if buf is None:
                if pool.add_buffer_listener(self):
                    self._waiting_for_floating = True
                break
            queue.floating.append(buf)
            added += 1
        return added

    cdef void _add_credit(self, Py_ssize_t n) except *:
        self._unannounced_credit += n
        if not self._credit_notified:
            self._maybe_announce()

    cdef void _maybe_announce(self) except *:
        """Have the client announce the unannounced credit: at once in a small window or
        with debloating, else once the sender holds no more than that (module docstring)."""
        cdef Py_ssize_t free = self._queue.size()
        if (
            (
                free < _HALVES_FROM
                or free <= 2 * self._unannounced_credit
                or self.gate.debloater is not None
            )
            and self._client is not None
            and not self._released
        ):
            self._credit_notified = True
            self._client.notify_credit_available(self)

    def get_and_reset_unannounced_credit(self):
        n = self._unannounced_credit
        self._unannounced_credit = 0
        self._credit_notified = False
        return n

    @property
    def unannounced_credit(self):
        return self._unannounced_credit

    @property
    def num_available_buffers(self):
        return self._queue.size()

    @property
    def num_queued_buffers(self):
        return len(self._received)

    @property
    def announced_backlog(self):
        return self.sender_backlog

    # -- BufferListener (floating buffers) -----------------------------------------------

    def notify_buffer_available(self, Buffer buffer):
        cdef AvailableBufferQueue queue = self._queue
        cdef Py_ssize_t have = queue.size()  # (runs per recycled buffer)
        if self._released or have >= self._num_required:
            self._waiting_for_floating = False
            return _NOT_USED
        queue.floating.append(buffer)
        if have + 1 >= self._num_required:
            self._waiting_for_floating = False
            result = _USED_NO_NEED_MORE
        else:
            result = _USED_NEED_MORE
        self._add_credit(1)
        return result

    def notify_buffer_destroyed(self):
        self._waiting_for_floating = False

    # -- BufferRecycler (exclusive buffers) ----------------------------------------------

    def recycle(self, segment):
        if self._released:
            self._exclusive_segments -= 1
            self._network_pool.recycle_memory_segments([segment])
            return
        cdef Py_ssize_t gained = self._queue.add_exclusive(Buffer(segment, self), self._num_required)
        if gained:
            self._add_credit(gained)

    # -- reading -------------------------------------------------------------------------

    def get_next_buffer(self):
        if self._error is not None:
            self.check_error()
        if not self._received:
            return None
        cdef Buffer buf = <Buffer>self._received.popleft()
        overtaken_by = ()
        if self._num_priority and buf._data_type is _PRIORITIZED:
            self._num_priority -= 1
        elif self._overtaken and buf._data_type is _DATA_BUFFER:
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

    def take_data_buffers(self, Py_ssize_t limit):
        if self._error is not None:
            self.check_error()
        received = self._received
        if self._num_priority or self._overtaken or not received:
            return [], bool(received)
        cdef Py_ssize_t n = min(limit, len(received)), i
        cdef list taken = []
        for i in range(n):
            if (<Buffer>received[0])._data_type is not _DATA_BUFFER:
                break
            taken.append(received.popleft())
        return taken, bool(received)

    @property
    def has_priority_event(self):
        return self._num_priority > 0

    def resume_consumption(self):
        if self._released:
            raise IllegalStateError(f"{self!r} was released")
        if self._client is not None:
            self._client.resume_consumption(self)

    def notify_new_buffer_size(self, size):
        self._buffer_size = size
        if self._client is not None and not self._released:
            self._client.notify_new_buffer_size(self, size)

    def release_all_resources(self):
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

    def receive_event(self, payload, data_type):
        """An unpooled buffer for an event (events need no credit)."""
        return Buffer.wrap(payload, data_type)
