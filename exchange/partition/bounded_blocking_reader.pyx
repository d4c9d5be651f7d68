"""BoundedBlockingSubpartitionReader: one reader's pass over a blocking subpartition.

Compiled (a ``cdef class``): the data port's send loop (``credit_based_view_reader.pyx``)
polls it through ``c_poll``, at C speed and with no ``BufferAndBacklog`` per buffer;
``get_next_buffer`` is the same poll as a Python call (tests, other callers). It reads
one buffer ahead from its ``BoundedDataReader`` (the buffer after the one it hands out),
so it can tell the backlog and the next buffer's type, as Flink's reader does. The
subpartition itself (``bounded_blocking_subpartition.py``) stays Python: it is touched per
reader, not per buffer.

Lifecycle (``states.py``): READING -> CONSUMED (returned EndOfPartition) -> RELEASED.
"""

from exchange.buffers.buffer cimport Buffer

from exchange.buffers.buffer import DataType
from exchange.events.events import EventSerializer
from exchange.partition.states import READER_TRANSITIONS, ReaderState, SubpartitionState, transition
from exchange.partition.subpartition_view import BufferAndBacklog

__all__ = ["BoundedBlockingSubpartitionReader"]

cdef object DATA_BUFFER = DataType.DATA_BUFFER
cdef object READING = ReaderState.READING
cdef object CONSUMED = ReaderState.CONSUMED
cdef object READER_RELEASED = ReaderState.RELEASED
cdef object SUBPARTITION_RELEASED = SubpartitionState.RELEASED
cdef object is_end_of_partition = EventSerializer.is_end_of_partition


cdef class BoundedBlockingSubpartitionReader:
    """One reader's pass over a blocking subpartition; it prefetches one buffer ahead."""

    def __init__(self, subpartition, data_reader, listener):
        self._subpartition = subpartition
        self._reader = data_reader
        self._listener = listener
        self.state = READING
        self._next = None
        self.memory = 0  # counted against the application's reader budget
        self._data_backlog = subpartition.num_data_buffers
        self._sequence_number = 0
        data_reader.set_on_memory_available(self._on_memory_available)
        self._next = data_reader.next_buffer()

    def _on_memory_available(self):
        if self._next is None and self.state is not READER_RELEASED:
            self._next = self._reader.next_buffer()
            if self._next is not None:
                self._listener.notify_data_available()

    def notify_listener(self):
        """Tell the reader's listener to poll (its subpartition was released)."""
        self._listener.notify_data_available()

    cdef bint _readable(self):
        return self.state is READING and self._subpartition.state is not SUBPARTITION_RELEASED

    cdef Buffer c_poll(self):
        """The next buffer (None if none now); its availability, backlog, next type and
        sequence number are left in the ``polled_*`` fields."""
        cdef Buffer current
        cdef Buffer nxt
        if not self._readable():
            return None
        current = self._next
        if current is None:
            current = self._reader.next_buffer()
            if current is None:
                return None
        if current._data_type is DATA_BUFFER:
            self._data_backlog -= 1
        elif is_end_of_partition(current):  # always the last buffer
            self.state = transition(READER_TRANSITIONS, self.state, CONSUMED, self)
            self._next = None
            self.polled_available = False
            self.polled_backlog = 0
            self.polled_next_type = None
            self.polled_sequence_number = self._sequence_number
            self._sequence_number += 1
            return current
        self._next = nxt = self._reader.next_buffer()
        self.polled_available = nxt is not None
        self.polled_backlog = self._data_backlog
        self.polled_next_type = nxt._data_type if nxt is not None else None
        self.polled_sequence_number = self._sequence_number
        self._sequence_number += 1
        return current

    def get_next_buffer(self):
        buf = self.c_poll()
        if buf is None:
            return None
        return BufferAndBacklog(
            buf,
            self.polled_available,
            self.polled_backlog,
            self.polled_next_type,
            self.polled_sequence_number,
        )

    def get_availability_and_backlog(self, Py_ssize_t num_credits):
        if not self._readable():
            return False, 0
        nxt = self._next
        if nxt is None:
            return False, self._data_backlog
        available = num_credits > 0 or nxt._data_type is not DATA_BUFFER
        return available, self._data_backlog

    def resume_consumption(self):
        """Nothing to resume: a blocking subpartition never blocks on a barrier, but a
        consumer cannot tell and resumes after every aligned barrier it reads."""

    def notify_new_buffer_size(self, size):
        pass  # data was already written with its buffer sizes

    def release_all_resources(self):
        if self.state is READER_RELEASED:
            return
        self.state = transition(READER_TRANSITIONS, self.state, READER_RELEASED, self)
        nxt, self._next = self._next, None
        if nxt is not None:
            nxt.release()
        self._reader.close()
        self._subpartition._on_reader_released(self)

    @property
    def is_released(self):
        return self.state is READER_RELEASED or self._subpartition.is_released

    @property
    def failure_cause(self):
        return self._subpartition.failure_cause

    def __repr__(self):
        return f"BoundedBlockingSubpartitionReader({self._subpartition!r})"
