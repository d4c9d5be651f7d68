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
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections import deque
from collections.abc import Callable
from typing import Protocol

from exchange.buffers.buffer import Buffer
from exchange.errors import PartitionReleasedError, ProducerFailedError
from exchange.events.events import EventSerializer
from exchange.network.credit_based_view_reader import CreditBasedSequenceNumberingViewReader
from exchange.protocol.messages import ErrorCode, ErrorResponse, Message, error_response_for

__all__ = ["OutboundChannel", "PartitionRequestQueue"]

log = logging.getLogger("exchange.network.queue")


class OutboundChannel(Protocol):
    """The connection as the queue sees it."""

    @property
    def is_writable(self) -> bool: ...

    def send_buffer(
        self, receiver_id: int, sequence_number: int, backlog: int, buf: Buffer
    ) -> None:
        """Write one BufferResponse; takes over ``buf`` (recycled once written out)."""
        ...

    def send(self, message: Message) -> None: ...


class PartitionRequestQueue:
    """Per-connection scheduling of view readers."""

    def __init__(self, channel: OutboundChannel, schedule: Callable[[Callable[[], None]], object]):
        self._channel = channel
        self._schedule = schedule
        self._available: deque[CreditBasedSequenceNumberingViewReader] = deque()
        self._readers: dict[int, CreditBasedSequenceNumberingViewReader] = {}
        self._released = False
        self.buffers_sent = 0
        self.bytes_sent = 0

    # -- readers -------------------------------------------------------------------------

    def add_reader(self, reader: CreditBasedSequenceNumberingViewReader) -> None:
        self._readers[reader.receiver_id] = reader

    def get_reader(self, receiver_id: int) -> CreditBasedSequenceNumberingViewReader | None:
        return self._readers.get(receiver_id)

    @property
    def readers(self) -> list[CreditBasedSequenceNumberingViewReader]:
        return list(self._readers.values())

    def notify_reader_non_empty(self, reader: CreditBasedSequenceNumberingViewReader) -> None:
        self._schedule(functools.partial(self.enqueue_available_reader, reader))

    def notify_reader_priority(self, reader: CreditBasedSequenceNumberingViewReader) -> None:
        self._schedule(functools.partial(self.enqueue_available_reader, reader, priority=True))

    def enqueue_available_reader(
        self, reader: CreditBasedSequenceNumberingViewReader, *, priority: bool = False
    ) -> None:
        if self._released:
            return
        if reader.registered_as_available:
            if priority and self._available and self._available[0] is not reader:
                self._available.remove(reader)  # registered: it is in the queue
                self._available.appendleft(reader)
            return
        if self._readers.get(reader.receiver_id) is not reader:
            return
        try:
            if not reader.is_available():
                if reader.is_released:
                    self._send_release_error(reader)
                return
        except Exception as exc:
            self._fail_reader(reader, exc)
            return
        trigger = not self._available
        reader.registered_as_available = True
        if priority:
            self._available.appendleft(reader)
        else:
            self._available.append(reader)
        if trigger:
            self.write_and_flush_next()

    def add_credit(self, receiver_id: int, credit: int) -> None:
        reader = self._readers.get(receiver_id)
        if reader is not None:
            reader.add_credit(credit)
            self.enqueue_available_reader(reader)

    def resume_consumption(self, receiver_id: int) -> None:
        reader = self._readers.get(receiver_id)
        if reader is not None:
            try:
                reader.resume_consumption()
            except Exception as exc:
                self._fail_reader(reader, exc)
                return
            self.enqueue_available_reader(reader)

    def notify_new_buffer_size(self, receiver_id: int, size: int) -> None:
        reader = self._readers.get(receiver_id)
        if reader is not None:
            try:
                reader.notify_new_buffer_size(size)
            except Exception as exc:
                self._fail_reader(reader, exc)

    def cancel(self, receiver_id: int) -> None:
        """The receiver is gone: release its view (consumption failure if not done)."""
        reader = self._readers.pop(receiver_id, None)
        if reader is not None:
            self._drop(reader)

    def fail_reader(self, receiver_id: int, cause: BaseException) -> None:
        """Fail one channel for an error raised on its behalf outside the queue (e.g. by
        the view's memory callback when a sent buffer was recycled)."""
        reader = self._readers.get(receiver_id)
        if reader is not None:
            self._fail_reader(reader, cause)

    def _fail_reader(
        self, reader: CreditBasedSequenceNumberingViewReader, cause: BaseException
    ) -> None:
        """The reader's view raised: end that channel with an error, release its view."""
        if self._readers.get(reader.receiver_id) is not reader:
            return  # already dropped
        del self._readers[reader.receiver_id]
        log.warning("%r failed: %s: %s", reader, type(cause).__name__, cause)
        self._drop(reader)
        self._channel.send(error_response_for(cause, reader.receiver_id))

    def _drop(self, reader: CreditBasedSequenceNumberingViewReader) -> None:
        if reader.registered_as_available:
            reader.registered_as_available = False
            with contextlib.suppress(ValueError):
                self._available.remove(reader)
        _release_reader(reader)

    # -- sending -------------------------------------------------------------------------

    def write_and_flush_next(self) -> None:
        """Send buffers while the channel is writable and a reader has something."""
        channel = self._channel
        available = self._available
        while not self._released and channel.is_writable and available:
            reader = available.popleft()
            reader.registered_as_available = False
            try:
                nxt = reader.get_next_buffer()
                if nxt is None:
                    if reader.is_released:
                        self._send_release_error(reader)
                    continue
            except Exception as exc:
                self._fail_reader(reader, exc)
                continue
            if nxt.more_available:
                reader.registered_as_available = True
                available.append(reader)
            buf = nxt.buffer
            end_of_partition = not buf.is_buffer and EventSerializer.is_end_of_partition(buf)
            self.buffers_sent += 1
            self.bytes_sent += buf.size
            channel.send_buffer(
                reader.receiver_id, nxt.sequence_number, nxt.buffers_in_backlog, buf
            )
            if end_of_partition:
                # Fully consumed: free the view now; the receiver's cancel is then a no-op.
                self._readers.pop(reader.receiver_id, None)
                self._drop(reader)

    def _send_release_error(self, reader: CreditBasedSequenceNumberingViewReader) -> None:
        if self._readers.pop(reader.receiver_id, None) is None:
            return
        cause = reader.failure_cause
        if isinstance(cause, ProducerFailedError):
            code, text = ErrorCode.PRODUCER_FAILED, str(cause)
        else:
            if cause is None:
                cause = PartitionReleasedError("partition was released", reader.partition_id)
            code, text = ErrorCode.PARTITION_RELEASED, str(cause)
        self._drop(reader)
        self._channel.send(ErrorResponse(code, text, reader.receiver_id))

    # -- lifecycle -----------------------------------------------------------------------

    def release_all(self) -> None:
        """The connection is gone: release every view (pools whole again)."""
        self._released = True
        readers = list(self._readers.values())
        self._readers.clear()
        self._available.clear()
        for reader in readers:
            reader.registered_as_available = False
            _release_reader(reader)

    @property
    def num_readers(self) -> int:
        return len(self._readers)


def _release_reader(reader: CreditBasedSequenceNumberingViewReader) -> None:
    """Release a reader's view; an error doing so is logged (the reader is dropped anyway,
    and nobody is left to tell)."""
    try:
        reader.release_all_resources()
    except Exception:
        log.exception("releasing %r failed", reader)
