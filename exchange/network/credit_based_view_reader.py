"""CreditBasedSequenceNumberingViewReader: one remote channel's reader on the server.

It holds the receiver's credit (one credit = one free buffer at the receiver). A data
buffer costs one credit; events cost none. The reader is *available* when it has credit
and data, or when its next buffer is an event. A priority event (unaligned barrier) put
at the head of its view puts the reader at the head of the connection's queue.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from exchange.consumer.input_channel import BufferAndAvailability
from exchange.errors import IllegalStateError, UsageError
from exchange.partition.bounded_data import ReadMemory
from exchange.partition.result_partition_id import ResultPartitionID
from exchange.partition.result_partition_manager import ResultPartitionManager
from exchange.partition.subpartition_view import ResultSubpartitionView

if TYPE_CHECKING:
    from exchange.network.partition_request_queue import PartitionRequestQueue

__all__ = ["CreditBasedSequenceNumberingViewReader"]


class CreditBasedSequenceNumberingViewReader:
    """Server-side state of one PartitionRequest."""

    __slots__ = (
        "_queue",
        "_view",
        "credits",
        "initial_credit",
        "partition_id",
        "receiver_id",
        "registered_as_available",
        "subpartition_index",
    )

    def __init__(self, receiver_id: int, initial_credit: int, queue: PartitionRequestQueue):
        if initial_credit < 0:
            raise UsageError(f"initial credit must be >= 0, got {initial_credit}")
        self.receiver_id = receiver_id
        self.initial_credit = initial_credit
        self.credits = initial_credit
        self.registered_as_available = False
        self._queue = queue
        self._view: ResultSubpartitionView | None = None
        self.partition_id: ResultPartitionID | None = None
        self.subpartition_index = -1

    def request_subpartition_view(
        self,
        manager: ResultPartitionManager,
        pid: ResultPartitionID,
        index: int,
        app_id: str = "",
        read_memory: ReadMemory | None = None,
    ) -> None:
        """Open application ``app_id``'s partition ``pid`` (its ids are its own); a
        blocking one reads its data buffers into ``read_memory`` while it lends segments."""
        if self._view is not None:
            raise IllegalStateError(f"receiver {self.receiver_id} already has a view")
        self.partition_id = pid
        self.subpartition_index = index
        self._view = manager.create_subpartition_view(pid, index, self, app_id, read_memory)

    def notify_data_available(self) -> None:
        """BufferAvailabilityListener: the view has data (called by the producer side)."""
        self._queue.notify_reader_non_empty(self)

    def notify_priority_event(self) -> None:
        """PriorityEventListener: a priority event is at the head of the view."""
        self._queue.notify_reader_priority(self)

    def add_credit(self, delta: int) -> None:
        self.credits += delta

    def resume_consumption(self) -> None:
        if self._view is not None:
            if self.initial_credit == 0:
                self.credits = 0
            self._view.resume_consumption()

    def notify_new_buffer_size(self, size: int) -> None:
        if self._view is not None:
            self._view.notify_new_buffer_size(size)

    def is_available(self) -> bool:
        view = self._view
        if view is None:
            return False
        return view.get_availability_and_backlog(self.credits)[0]

    def get_next_buffer(self) -> BufferAndAvailability | None:
        view = self._view
        if view is None:
            return None
        nb = view.get_next_buffer()
        if nb is None:
            return None
        if nb.buffer.is_buffer:
            self.credits -= 1
            if self.credits < 0:
                nb.buffer.release()
                raise IllegalStateError(f"receiver {self.receiver_id}: no credit available")
        nxt = nb.next_data_type
        more = nb.is_data_available and nxt is not None and (self.credits > 0 or nxt.is_event)
        return BufferAndAvailability(nb.buffer, more, nb.buffers_in_backlog, nb.sequence_number)

    @property
    def is_released(self) -> bool:
        view = self._view
        return view is None or view.is_released

    @property
    def failure_cause(self) -> BaseException | None:
        view = self._view
        return None if view is None else view.failure_cause

    def release_all_resources(self) -> None:
        view, self._view = self._view, None
        if view is not None:
            view.release_all_resources()

    def __repr__(self) -> str:
        return (
            f"ViewReader(receiver={self.receiver_id}, {self.partition_id}"
            f"[{self.subpartition_index}], credits={self.credits})"
        )
