# cython: language_level=3, boundscheck=False, wraparound=False
"""PartitionRequestQueue: which reader of a connection sends next, and when.

Flink's rules, without Netty: readers with something to send wait in a queue (each at
most once). ``write_and_flush_next`` sends one BufferResponse from the first available
reader while the channel is writable, re-queueing a reader that has more; a channel that
turns unwritable (high watermark) stops the loop, and becoming writable again (low
watermark) resumes it. New data, new credit and ResumeConsumption re-queue a reader.
A reader whose view got a priority event (an unaligned checkpoint barrier) goes to the
head of the queue, or moves there if it was waiting: the barrier leaves before the
other readers' buffers, and with no credit (events need none).

Producer-side notifications are deferred through ``schedule`` (the event loop's
``call_soon``) so a producer's ``add`` never re-enters the send loop.

Errors: whatever a reader's view raises (a truncated spill file, an I/O error, a bug in a
view) fails *that* channel: an ``ErrorResponse`` with its receiver id, the reader released,
the other readers served on. Anything else (the channel failing to send) propagates to the
caller; the caller that runs ``schedule``'s callbacks must treat it as fatal for the
connection (the server connection closes with an ``ErrorResponse``), since an exception
escaping an event-loop callback is only logged and would leave every channel stalled.

Compiled (``cdef class``es, with ``credit_based_view_reader.pyx``): ``write_and_flush_next``
runs once per buffer the data port sends, its readers polled through their C ``poll``
(no ``BufferAndAvailability`` per buffer) and the buffer's size and type read from the
compiled ``Buffer``'s fields. ``partition_request_queue.pyi`` types it for mypy. There is
no Python version of this module.
"""

import contextlib
import functools
import logging
from collections import deque
from typing import Protocol

from exchange.buffers.buffer cimport Buffer
from exchange.network.credit_based_view_reader cimport (
    CreditBasedSequenceNumberingViewReader as Reader,
)

from exchange.buffers.buffer import DataType
from exchange.errors import PartitionReleasedError, ProducerFailedError
from exchange.events.events import EventSerializer
from exchange.protocol.messages import ErrorCode, ErrorResponse, error_response_for

__all__ = ["OutboundChannel", "PartitionRequestQueue"]

log = logging.getLogger("exchange.network.queue")


class OutboundChannel(Protocol):
    """The connection as the queue sees it (typed in partition_request_queue.pyi)."""

    @property
    def is_writable(self): ...

    def send_buffer(self, receiver_id, sequence_number, backlog, buf):
        """Write one BufferResponse; takes over ``buf`` (recycled once written out)."""
        ...

    def send(self, message): ...


cdef object DATA_BUFFER = DataType.DATA_BUFFER


cdef class PartitionRequestQueue:
    """Per-connection scheduling of view readers."""

    def __init__(self, channel, schedule):
        self._channel = channel
        self._schedule = schedule
        self._available = deque()
        self._readers = {}
        self._released = False
        self.buffers_sent = 0
        self.bytes_sent = 0

    # -- readers -------------------------------------------------------------------------

    def add_reader(self, Reader reader not None):
        self._readers[reader.receiver_id] = reader

    def get_reader(self, receiver_id):
        return self._readers.get(receiver_id)

    @property
    def readers(self):
        return list(self._readers.values())

    def notify_reader_non_empty(self, Reader reader not None):
        self._schedule(functools.partial(self.enqueue_available_reader, reader))

    def notify_reader_priority(self, Reader reader not None):
        self._schedule(functools.partial(self.enqueue_available_reader, reader, priority=True))

    def enqueue_available_reader(self, Reader reader not None, *, bint priority=False):
        self._enqueue(reader, priority)

    cdef int _enqueue(self, Reader reader, bint priority) except -1:
        available = self._available
        if self._released:
            return 0
        if reader.registered_as_available:
            if priority and available and available[0] is not reader:
                available.remove(reader)  # registered: it is in the queue
                available.appendleft(reader)
            return 0
        if self._readers.get(reader.receiver_id) is not reader:
            return 0
        try:
            if not reader.is_available():
                if reader.is_released:
                    self._send_release_error(reader)
                return 0
        except Exception as exc:
            self._fail_reader(reader, exc)
            return 0
        trigger = not available
        reader.registered_as_available = True
        if priority:
            available.appendleft(reader)
        else:
            available.append(reader)
        if trigger:
            self.write_and_flush_next()
        return 0

    def add_credit(self, receiver_id, Py_ssize_t credit):
        cdef Reader reader = self._readers.get(receiver_id)
        if reader is not None:
            reader.credits += credit
            self._enqueue(reader, False)

    def resume_consumption(self, receiver_id):
        cdef Reader reader = self._readers.get(receiver_id)
        if reader is not None:
            try:
                reader.resume_consumption()
            except Exception as exc:
                self._fail_reader(reader, exc)
                return
            self._enqueue(reader, False)

    def notify_new_buffer_size(self, receiver_id, size):
        cdef Reader reader = self._readers.get(receiver_id)
        if reader is not None:
            try:
                reader.notify_new_buffer_size(size)
            except Exception as exc:
                self._fail_reader(reader, exc)

    def cancel(self, receiver_id):
        """The receiver is gone: release its view (consumption failure if not done)."""
        cdef Reader reader = self._readers.pop(receiver_id, None)
        if reader is not None:
            self._drop(reader)

    def fail_reader(self, receiver_id, cause):
        """Fail one channel for an error raised on its behalf outside the queue (e.g. by
        the view's memory callback when a sent buffer was recycled)."""
        cdef Reader reader = self._readers.get(receiver_id)
        if reader is not None:
            self._fail_reader(reader, cause)

    cdef int _fail_reader(self, Reader reader, cause) except -1:
        """The reader's view raised: end that channel with an error, release its view."""
        if self._readers.get(reader.receiver_id) is not reader:
            return 0  # already dropped
        del self._readers[reader.receiver_id]
        log.warning("%r failed: %s: %s", reader, type(cause).__name__, cause)
        self._drop(reader)
        self._channel.send(error_response_for(cause, reader.receiver_id))
        return 0

    cdef int _drop(self, Reader reader) except -1:
        if reader.registered_as_available:
            reader.registered_as_available = False
            with contextlib.suppress(ValueError):
                self._available.remove(reader)
        _release_reader(reader)
        return 0

    # -- sending -------------------------------------------------------------------------

    def write_and_flush_next(self):
        """Send buffers while the channel is writable and a reader has something."""
        cdef Reader reader
        cdef Buffer buf
        channel = self._channel
        available = self._available
        while not self._released and channel.is_writable and available:
            reader = available.popleft()
            reader.registered_as_available = False
            try:
                buf = reader.poll()
                if buf is None:
                    if reader.is_released:
                        self._send_release_error(reader)
                    continue
            except Exception as exc:
                self._fail_reader(reader, exc)
                continue
            if reader.more_available:
                reader.registered_as_available = True
                available.append(reader)
            end_of_partition = (
                buf._data_type is not DATA_BUFFER and EventSerializer.is_end_of_partition(buf)
            )
            self.buffers_sent += 1
            self.bytes_sent += buf._size
            channel.send_buffer(reader.receiver_id, reader.sequence_number, reader.backlog, buf)
            if end_of_partition:
                # Fully consumed: free the view now; the receiver's cancel is then a no-op.
                self._readers.pop(reader.receiver_id, None)
                self._drop(reader)

    cdef int _send_release_error(self, Reader reader) except -1:
        if self._readers.pop(reader.receiver_id, None) is None:
            return 0
        cause = reader.failure_cause
        if isinstance(cause, ProducerFailedError):
            code, text = ErrorCode.PRODUCER_FAILED, str(cause)
        else:
            if cause is None:
                cause = PartitionReleasedError("partition was released", reader.partition_id)
            code, text = ErrorCode.PARTITION_RELEASED, str(cause)
        self._drop(reader)
        self._channel.send(ErrorResponse(code, text, reader.receiver_id))
        return 0

    # -- lifecycle -----------------------------------------------------------------------

    def release_all(self):
        """The connection is gone: release every view (pools whole again)."""
        cdef Reader reader
        self._released = True
        readers = list(self._readers.values())
        self._readers.clear()
        self._available.clear()
        for reader in readers:
            reader.registered_as_available = False
            _release_reader(reader)

    @property
    def num_readers(self):
        return len(self._readers)


cdef int _release_reader(Reader reader) except -1:
    """Release a reader's view; an error doing so is logged (the reader is dropped anyway,
    and nobody is left to tell)."""
    try:
        reader.release_all_resources()
    except Exception:
        log.exception("releasing %r failed", reader)
    return 0
