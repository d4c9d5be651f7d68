"""What a reader of a subpartition sees: views, availability listeners, BufferAndBacklog."""

from __future__ import annotations

from typing import NamedTuple, Protocol, runtime_checkable

from exchange.buffers.buffer import Buffer, DataType

__all__ = [
    "BufferAndBacklog",
    "BufferAvailabilityListener",
    "PriorityEventListener",
    "ResultSubpartitionView",
]


class BufferAndBacklog(NamedTuple):
    """One polled buffer plus what the reader needs to decide on credit and re-queueing.

    ``is_data_available``: another buffer can be polled right away.
    ``buffers_in_backlog``: finished data buffers still queued (the sender's backlog).
    ``next_data_type``: the type of the next buffer if one is available, else None.
    """

    buffer: Buffer
    is_data_available: bool
    buffers_in_backlog: int
    next_data_type: DataType | None
    sequence_number: int


class BufferAvailabilityListener(Protocol):
    """Told when a view goes from nothing to read to something to read."""

    def notify_data_available(self) -> None: ...


@runtime_checkable
class PriorityEventListener(Protocol):
    """A listener that also wants to hear of a priority event put at the head of its view
    (Flink's ``notifyPriorityEvent``): the data port sends it ahead of other readers."""

    def notify_data_available(self) -> None: ...

    def notify_priority_event(self) -> None: ...


class ResultSubpartitionView(Protocol):
    """A reader's handle on one subpartition."""

    def get_next_buffer(self) -> BufferAndBacklog | None: ...

    def get_availability_and_backlog(self, num_credits: int) -> tuple[bool, int]:
        """(can a buffer be sent with this much credit, current backlog)."""
        ...

    def resume_consumption(self) -> None: ...

    def notify_new_buffer_size(self, size: int) -> None: ...

    def release_all_resources(self) -> None: ...

    @property
    def is_released(self) -> bool: ...

    @property
    def failure_cause(self) -> BaseException | None: ...
