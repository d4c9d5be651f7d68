# cython: language_level=3, boundscheck=False, wraparound=False
"""CreditBasedSequenceNumberingViewReader: one remote channel's reader on the server.

It holds the receiver's credit (one credit = one free buffer at the receiver). A data
buffer costs one credit; events cost none. The reader is *available* when it has credit
and data, or when its next buffer is an event. A priority event (unaligned barrier) put
at the head of its view puts the reader at the head of the connection's queue.

Compiled (a ``cdef class``): the data port's send loop (``partition_request_queue.pyx``)
polls a reader once per buffer sent, through ``poll``, a C call that leaves the polled
buffer's backlog, sequence number and "more to send" in the reader's C fields instead of
building a ``BufferAndAvailability`` per buffer (a pipelined view's and a blocking
subpartition reader's poll are C calls too; other views are polled through their
``get_next_buffer``). ``get_next_buffer`` is the same poll as a
Python API. ``credit_based_view_reader.pyi`` types it for mypy. There is no Python version
of this module.
"""

from exchange.buffers.buffer cimport Buffer
from exchange.partition.bounded_blocking_reader cimport BoundedBlockingSubpartitionReader
from exchange.partition.pipelined_subpartition cimport (
    PipelinedSubpartition,
    PipelinedSubpartitionView,
)

from exchange.buffers.buffer import DataType
from exchange.consumer.input_channel import BufferAndAvailability
from exchange.errors import IllegalStateError, UsageError
from exchange.partition.states import ReaderState

__all__ = ["CreditBasedSequenceNumberingViewReader"]

cdef object DATA_BUFFER = DataType.DATA_BUFFER
cdef object VIEW_RELEASED = ReaderState.RELEASED


cdef class CreditBasedSequenceNumberingViewReader:
    """Server-side state of one PartitionRequest."""

    def __init__(self, receiver_id, Py_ssize_t initial_credit, queue):
        if initial_credit < 0:
            raise UsageError(f"initial credit must be >= 0, got {initial_credit}")
        self.receiver_id = receiver_id
        self.initial_credit = initial_credit
        self.credits = initial_credit
        self.registered_as_available = False
        self._queue = queue
        self._view = None
        self.partition_id = None
        self.subpartition_index = -1
        self.more_available = False
        self.backlog = 0
        self.sequence_number = 0

    def request_subpartition_view(self, manager, pid, index, app_id="", read_memory=None):
        """Open application ``app_id``'s partition ``pid`` (its ids are its own); a
        blocking one reads its data buffers into ``read_memory`` while it lends segments."""
        if self._view is not None:
            raise IllegalStateError(f"receiver {self.receiver_id} already has a view")
        self.partition_id = pid
        self.subpartition_index = index
        self._view = manager.create_subpartition_view(pid, index, self, app_id, read_memory)

    def notify_data_available(self):
        """BufferAvailabilityListener: the view has data (called by the producer side)."""
        self._queue.notify_reader_non_empty(self)

    def notify_priority_event(self):
        """PriorityEventListener: a priority event is at the head of the view."""
        self._queue.notify_reader_priority(self)

    def add_credit(self, Py_ssize_t delta):
        self.credits += delta

    def resume_consumption(self):
        if self._view is not None:
            if self.initial_credit == 0:
                self.credits = 0
            self._view.resume_consumption()

    def notify_new_buffer_size(self, size):
        if self._view is not None:
            self._view.notify_new_buffer_size(size)

    cpdef bint is_available(self) except -1:
        view = self._view
        if view is None:
            return False
        return view.get_availability_and_backlog(self.credits)[0]

    cdef Buffer poll(self):
        """The view's next buffer (None if none), taking a credit for a data buffer; its
        backlog, sequence number and whether more can be sent now are left in
        ``backlog``, ``sequence_number`` and ``more_available``."""
        cdef Buffer buf
        cdef PipelinedSubpartition sub
        cdef BoundedBlockingSubpartitionReader blocking
        view = self._view
        if view is None:
            return None
        if type(view) is PipelinedSubpartitionView:  # the relay's case: all in C
            if (<PipelinedSubpartitionView>view).state is VIEW_RELEASED:
                return None
            sub = (<PipelinedSubpartitionView>view)._subpartition
            buf = sub.c_poll()
            if buf is None:
                return None
            more = sub.polled_available
            backlog = sub.polled_backlog
            nxt = sub.polled_next_type
            seq = sub.polled_sequence_number
        elif type(view) is BoundedBlockingSubpartitionReader:  # a blocking partition's
            blocking = <BoundedBlockingSubpartitionReader>view
            buf = blocking.c_poll()
            if buf is None:
                return None
            more = blocking.polled_available
            backlog = blocking.polled_backlog
            nxt = blocking.polled_next_type
            seq = blocking.polled_sequence_number
        else:
            nb = view.get_next_buffer()
            if nb is None:
                return None
            buf, more, backlog, nxt, seq = nb
        if buf._data_type is DATA_BUFFER:
            self.credits -= 1
            if self.credits < 0:
                buf.release()
                raise IllegalStateError(f"receiver {self.receiver_id}: no credit available")
        self.more_available = bool(more) and nxt is not None and (self.credits > 0 or nxt.is_event)
        self.backlog = backlog
        self.sequence_number = seq
        return buf

    def get_next_buffer(self):
        buf = self.poll()
        if buf is None:
            return None
        return BufferAndAvailability(buf, self.more_available, self.backlog, self.sequence_number)

    @property
    def is_released(self):
        view = self._view
        return view is None or view.is_released

    @property
    def failure_cause(self):
        view = self._view
        return None if view is None else view.failure_cause

    def release_all_resources(self):
        view, self._view = self._view, None
        if view is not None:
            view.release_all_resources()

    def __repr__(self):
        return (
            f"ViewReader(receiver={self.receiver_id}, {self.partition_id}"
            f"[{self.subpartition_index}], credits={self.credits})"
        )
