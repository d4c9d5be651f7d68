"""BufferListener: how a LocalBufferPool offers a recycled buffer to whoever waits for one."""

from __future__ import annotations

from enum import Enum
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from exchange.buffers.buffer import Buffer

__all__ = ["BufferListener", "NotificationResult"]


class NotificationResult(Enum):
    """Flink's BufferListener.NotificationResult: (buffer used?, needs more buffers?)."""

    BUFFER_NOT_USED = (False, False)
    BUFFER_USED_NO_NEED_MORE = (True, False)
    BUFFER_USED_NEED_MORE = (True, True)

    # Plain attributes of each member, set once: a pool reads them for every recycled
    # buffer it offers (``self.value[i]`` behind a property costs three Python calls).
    is_buffer_used: bool
    needs_more_buffers: bool

    def __init__(self, used: bool, needs_more: bool) -> None:
        self.is_buffer_used = used
        self.needs_more_buffers = needs_more


class BufferListener(Protocol):
    """Registered on an empty LocalBufferPool; told when a buffer frees up or the pool dies."""

    def notify_buffer_available(self, buffer: Buffer) -> NotificationResult:
        """Take ``buffer`` (or not). A listener that does not use it must not release it."""
        ...

    def notify_buffer_destroyed(self) -> None: ...
