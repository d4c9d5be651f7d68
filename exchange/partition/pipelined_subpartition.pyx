# cython: language_level=3, boundscheck=False, wraparound=False
"""PipelinedSubpartition: a bounded queue of BufferConsumers streamed to one reader.

Follows Flink's rules:

* every queued buffer is complete and readable (the writer cuts whole buffers, so there
  is no unfinished tail for ``flush`` to release, unlike Flink's BufferBuilders);
* the reader is notified when the first buffer appears in an empty queue, on flush, and
  on an event, and otherwise learns from ``BufferAndBacklog.is_data_available`` whether
  to come back; so a reader is never notified for every buffer;
* the backlog is the number of data buffers queued, which the network announces to the
  receiver so it can ask for floating buffers;
* after an aligned checkpoint barrier is polled, the subpartition is *blocked* until the
  reader calls ``resume_consumption`` (exactly-once alignment on the sender side);
* a *priority* event (an unaligned checkpoint barrier, ``DataType.PRIORITIZED_EVENT_BUFFER``;
  Flink's ``addPriorityElement``) goes to the head of the queue, behind earlier priority
  events only, so it is polled before every buffer queued so far and needs no credit. The
  data buffers it overtook are still sent after it; they are also the checkpoint's
  *output channel state*: the output-channel-state listener gets a retained read-only
  slice of each, in queue order, with the checkpoint id (an empty list when it overtook
  nothing), and must release them. Only buffers still queued are overtaken: one already
  polled is on its way and reaches the consumer ahead of the barrier. A blocked
  subpartition (aligned barrier polled, no ResumeConsumption yet) holds its priority
  event back too, as Flink's does;
* it is consumed once: one view ever. A view that polled EndOfPartition and is released
  counts as consumption; a view released before that is a consumer failure (the
  subpartition is released and the partition's consumer-failure listeners are told).

Lifecycles (``states.py``): the subpartition WRITING -> FINISHED -> RELEASED, its view
READING -> CONSUMED -> RELEASED.

Compiled (``cdef class``es): every buffer the daemon relays is queued here (``add``) and
polled from here, so both run in C; the data port's view reader
(``credit_based_view_reader.pyx``) polls through ``c_poll``, which leaves the polled
buffer's availability, backlog, next type and sequence number in C fields instead of
building a ``BufferAndBacklog`` (``poll_buffer`` builds one, for Python callers).
``pipelined_subpartition.pyi`` types the module for mypy. There is no Python version of
this module.
"""

from collections import deque
from collections.abc import Callable

from exchange.buffers.buffer cimport Buffer
from exchange.buffers.buffer_consumer cimport BufferConsumer

from exchange.buffers.buffer import DataType
from exchange.errors import (
    ConsumerAlreadyAttachedError,
    CorruptRecordError,
    IllegalStateError,
    PartitionReleasedError,
    UsageError,
)
from exchange.events.events import EndOfPartitionEvent, EventSerializer
from exchange.partition.states import (
    READER_TRANSITIONS,
    SUBPARTITION_TRANSITIONS,
    ReaderState,
    SubpartitionState,
    transition,
)
from exchange.partition.subpartition_view import BufferAndBacklog, PriorityEventListener

__all__ = ["OutputChannelStateListener", "PipelinedSubpartition", "PipelinedSubpartitionView"]

#: ``(subpartition index, checkpoint id, overtaken buffers)``: takes over the buffers.
OutputChannelStateListener = Callable[[int, int, list[Buffer]], None]

cdef object WRITING = SubpartitionState.WRITING
cdef object FINISHED = SubpartitionState.FINISHED
cdef object SUB_RELEASED = SubpartitionState.RELEASED
cdef object READING = ReaderState.READING
cdef object CONSUMED = ReaderState.CONSUMED
cdef object VIEW_RELEASED = ReaderState.RELEASED
cdef object EVENT_BUFFER = DataType.EVENT_BUFFER


cdef class PipelinedSubpartition:
    """One pipelined subpartition of a ResultPartition."""

    def __init__(self, index, parent):
        self.index = index
        self._parent = parent
        self._buffers = deque()  # of BufferConsumers
        self._backlog = 0
        self._num_priority = 0  # priority events at the head of ``_buffers``
        self._channel_state_listener = None
        self.state = WRITING
        self._failure = None
        self._flush_requested = False
        self._blocked = False
        # The one view this subpartition ever has: kept after its release, so a consumed
        # subpartition cannot be opened again.
        self._view = None
        self._sequence_number = 0
        self.buffer_size = parent.segment_size
        # Debloating: who cuts this subpartition's buffers hears of a new size (the
        # daemon's producer session forwards it to the producer task).
        self._buffer_size_listeners = []
        self.total_bytes = 0
        self.total_buffers = 0
        self.polled_available = False
        self.polled_backlog = 0
        self.polled_next_type = None
        self.polled_sequence_number = 0

    # -- writer side ---------------------------------------------------------------------

    def _transition(self, to):
        self.state = transition(SUBPARTITION_TRANSITIONS, self.state, to, self)

    @property
    def is_finished(self):
        return self.state is FINISHED

    @property
    def is_released(self):
        return self.state is SUB_RELEASED

    @property
    def failure_cause(self):
        return self._failure

    def add(self, BufferConsumer consumer not None):
        """Queue a buffer; False (and the consumer closed) when finished or released."""
        if self.state is not WRITING:
            consumer.close()
            return False
        data_type = consumer._buffer._data_type
        if data_type.has_priority:
            self._add_priority(consumer)
            return True
        buffers = self._buffers
        was_empty = not buffers
        buffers.append(consumer)
        if data_type.is_buffer:
            self._backlog += 1
        if was_empty and not self._flush_requested and not self._blocked:
            self._notify()
        return True

    def _add_priority(self, consumer):
        """Put an unaligned barrier ahead of every non-priority element; hand the data
        buffers it overtook to the output-channel-state listener."""
        listener = self._channel_state_listener
        checkpoint_id = -1
        if listener is not None:
            # decode first: a malformed priority event must not be queued
            head = consumer.retained_slice()
            try:
                checkpoint_id = EventSerializer.checkpoint_id_of_priority_barrier(head)
            except CorruptRecordError:
                consumer.close()
                raise
            finally:
                head.release()
        self._buffers.insert(self._num_priority, consumer)
        self._num_priority += 1
        if listener is not None:
            overtaken = [
                c.retained_slice()
                for i, c in enumerate(self._buffers)
                if i >= self._num_priority and c.is_buffer and c.is_data_available
            ]
            listener(self.index, checkpoint_id, overtaken)
        if self._num_priority == 1 and not self._blocked:
            self._notify_priority()

    def set_output_channel_state_listener(self, listener):
        """Who receives the buffers each unaligned barrier overtakes (one listener)."""
        if listener is not None and self._channel_state_listener is not None:
            raise IllegalStateError(
                f"subpartition {self.index} already has an output channel state listener"
            )
        self._channel_state_listener = listener

    def flush(self):
        """Flink's flush: every queued buffer is complete here, so this only notifies the
        reader of a lone buffer again and holds back notifications until it is polled."""
        buffers = self._buffers
        if self.state is SUB_RELEASED or not buffers or self._flush_requested:
            return
        last_has_data = len(buffers) == 1 and buffers[-1].is_data_available
        self._flush_requested = len(buffers) > 1 or last_has_data
        if last_has_data and not self._blocked:
            self._notify()

    def finish(self):
        """Append EndOfPartition; nothing may be added afterwards."""
        if self.state is FINISHED:
            return
        if self.state is SUB_RELEASED:
            raise PartitionReleasedError(
                f"subpartition {self.index} was released", self._parent.partition_id
            )
        self._buffers.append(EventSerializer.to_buffer_consumer(EndOfPartitionEvent.INSTANCE))
        self._transition(FINISHED)
        self._flush_requested = True
        if not self._blocked:
            self._notify()

    def release(self, cause=None):
        """Drop every queued buffer; a reader learns ``cause`` (or a plain release)."""
        if self.state is SUB_RELEASED:
            return
        self._transition(SUB_RELEASED)
        if self._failure is None:
            self._failure = cause
        while self._buffers:
            self._buffers.popleft().close()
        self._backlog = 0
        self._num_priority = 0
        if self._view is not None and self._view.state is READING:
            self._view._listener.notify_data_available()

    # -- reader side ---------------------------------------------------------------------

    def create_read_view(self, listener):
        if self._view is not None:
            raise ConsumerAlreadyAttachedError(
                f"subpartition {self.index} already has or had its reader; a pipelined "
                "subpartition is consumed once",
                self._parent.partition_id,
            )
        if self.state is SUB_RELEASED:
            raise PartitionReleasedError(
                f"subpartition {self.index} was released", self._parent.partition_id
            )
        view = PipelinedSubpartitionView(self, listener)
        self._view = view
        if self._is_data_available():
            listener.notify_data_available()
        return view

    cdef int _notify(self) except -1:
        view = self._view
        if view is not None and view.state is not VIEW_RELEASED:
            view._listener.notify_data_available()
        return 0

    cdef int _notify_priority(self) except -1:
        view = self._view
        if view is not None and view.state is not VIEW_RELEASED:
            listener = view._listener
            if isinstance(listener, PriorityEventListener):
                listener.notify_priority_event()
            else:
                listener.notify_data_available()
        return 0

    cdef bint _is_data_available(self):
        return not self._blocked and (self._flush_requested or bool(self._buffers))

    cdef object _next_data_type(self):
        if self._buffers:
            return self._buffers[0].data_type
        return None

    cdef Py_ssize_t _backlog_now(self):
        """Data buffers queued (none while blocked: the reader cannot poll them yet)."""
        if self._blocked or not self._buffers:
            return 0
        return self._backlog

    cdef Buffer c_poll(self):
        """The next readable buffer, or None (Flink's ``pollBuffer``); what a
        ``BufferAndBacklog`` carries besides the buffer is left in the ``polled_*``
        fields."""
        cdef Buffer buffer = None
        cdef BufferConsumer consumer
        if self._blocked or self.state is SUB_RELEASED:
            return None
        buffers = self._buffers
        if not buffers:
            self._flush_requested = False
        while buffers:
            consumer = buffers.popleft()
            if not buffers:
                self._flush_requested = False
            buffer = consumer.build()
            consumer.close()
            data_type = buffer._data_type
            if data_type.is_buffer:
                self._backlog -= 1
            elif self._num_priority and data_type.has_priority:
                self._num_priority -= 1
            if buffer._size > 0:
                break
            buffer.release()  # an empty buffer: nothing to send
            buffer = None
        if buffer is None:
            return None
        data_type = buffer._data_type
        if data_type.is_blocking_upstream:
            self._blocked = True
        elif (
            data_type is EVENT_BUFFER
            and not buffers
            and self.state is FINISHED
            and self._view is not None
        ):
            self._view._transition(CONSUMED)  # polled EndOfPartition
        self.total_bytes += buffer._size
        self.total_buffers += 1
        seq = self._sequence_number
        self._sequence_number = seq + 1
        available = self._is_data_available()
        self.polled_available = available
        self.polled_backlog = self._backlog_now()
        self.polled_next_type = self._next_data_type() if available else None
        self.polled_sequence_number = seq
        return buffer

    def poll_buffer(self):
        """The next readable buffer, or None (Flink's ``pollBuffer``)."""
        buffer = self.c_poll()
        if buffer is None:
            return None
        return BufferAndBacklog(
            buffer,
            self.polled_available,
            self.polled_backlog,
            self.polled_next_type,
            self.polled_sequence_number,
        )

    def availability_and_backlog(self, Py_ssize_t num_credits):
        if num_credits > 0:
            available = self._is_data_available()
        else:
            nxt = self._next_data_type()
            available = (
                not self._blocked
                and nxt is not None
                and nxt.is_event
                and (self._flush_requested or bool(self._buffers))
            )
        return available, self._backlog_now()

    def resume_consumption(self):
        if not self._blocked:
            raise IllegalStateError(f"subpartition {self.index} is not blocked")
        self._blocked = False
        if self._is_data_available():
            self._notify()

    def set_buffer_size(self, size):
        """NewBufferSize from the consumer: new buffers are cut at ``size`` (at most a
        segment); each listener is called ``(index, size)`` when the size changes."""
        if size <= 0:
            raise UsageError(f"buffer size must be positive, got {size}")
        size = min(size, self._parent.segment_size)
        if size == self.buffer_size:
            return
        self.buffer_size = size
        for listener in list(self._buffer_size_listeners):
            listener(self.index, size)

    def add_buffer_size_listener(self, listener):
        """Call ``listener(index, size)`` whenever the consumer announces a new size."""
        self._buffer_size_listeners.append(listener)

    def _on_view_released(self, consumed):
        """The view was released: after EndOfPartition (consumed) or early (a failure)."""
        if not consumed and self.state is not SUB_RELEASED:
            # The reader left before the end: a consumer failure the producer must see.
            cause = PartitionReleasedError(
                f"subpartition {self.index} was released by its consumer before the end",
                self._parent.partition_id,
            )
            self.release(cause)
            self._parent._on_consumer_failure(cause)
        self._parent._on_subpartition_done(self.index)

    def abandon(self):
        """Its consumer is gone without ever having asked for it (it left before the
        partition existed, or before its request came): released exactly as a reader
        leaving before the end releases it. False (nothing done) once it has or had its
        reader (that reader's release says what happened) or is released already."""
        if self._view is not None or self.state is SUB_RELEASED:
            return False
        self._on_view_released(False)
        return True

    @property
    def buffers_in_backlog(self):
        return self._backlog_now()

    @property
    def num_queued_buffers(self):
        return len(self._buffers)

    def __repr__(self):
        return (
            f"PipelinedSubpartition(#{self.index}, {self.state.value}, "
            f"queued={len(self._buffers)}, backlog={self._backlog})"
        )


cdef class PipelinedSubpartitionView:
    """The single reader's view of a PipelinedSubpartition."""

    def __init__(self, PipelinedSubpartition subpartition not None, listener):
        self._subpartition = subpartition
        self._listener = listener
        self.state = READING

    def _transition(self, to):
        self.state = transition(READER_TRANSITIONS, self.state, to, self)

    def get_next_buffer(self):
        if self.state is VIEW_RELEASED:
            return None
        return self._subpartition.poll_buffer()

    def get_availability_and_backlog(self, num_credits):
        if self.state is VIEW_RELEASED:
            return False, 0
        return self._subpartition.availability_and_backlog(num_credits)

    def resume_consumption(self):
        self._subpartition.resume_consumption()

    def notify_new_buffer_size(self, size):
        self._subpartition.set_buffer_size(size)

    def release_all_resources(self):
        if self.state is VIEW_RELEASED:
            return
        consumed = self.state is CONSUMED
        self._transition(VIEW_RELEASED)
        self._subpartition._on_view_released(consumed)

    @property
    def is_released(self):
        return self.state is VIEW_RELEASED or self._subpartition.state is SUB_RELEASED

    @property
    def failure_cause(self):
        return self._subpartition._failure

    def __repr__(self):
        return f"PipelinedSubpartitionView({self._subpartition!r})"
