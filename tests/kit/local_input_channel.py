"""LocalInputChannel: reads a subpartition of the same process; no network, no copies.

Test tooling: production reads go through the daemon (RemoteInputChannel, also over the
Unix socket on one host). Tests use this channel to read a partition of their own process.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from exchange.consumer.input_channel import (
    DEFAULT_BACKOFF_INITIAL,
    DEFAULT_BACKOFF_MAX,
    BufferAndAvailability,
    InputChannel,
    backoff_delays,
)
from exchange.errors import (
    IllegalStateError,
    PartitionNotFoundError,
    PartitionReleasedError,
    fresh_error,
)
from exchange.partition.result_partition_id import ResultPartitionID
from exchange.partition.result_partition_manager import ResultPartitionManager
from exchange.partition.subpartition_view import ResultSubpartitionView

if TYPE_CHECKING:
    from exchange.consumer.single_input_gate import SingleInputGate

__all__ = ["LocalInputChannel"]


class LocalInputChannel(InputChannel):
    """Polls a ResultSubpartitionView directly; the view's listener is this channel."""

    def __init__(
        self,
        gate: SingleInputGate,
        channel_index: int,
        partition_manager: ResultPartitionManager,
        partition_id: ResultPartitionID,
        subpartition_index: int,
        *,
        backoff_initial: float = DEFAULT_BACKOFF_INITIAL,
        backoff_max: float = DEFAULT_BACKOFF_MAX,
    ) -> None:
        super().__init__(
            gate,
            channel_index,
            partition_id,
            subpartition_index,
            backoff_initial=backoff_initial,
            backoff_max=backoff_max,
        )
        self._manager = partition_manager
        self._view: ResultSubpartitionView | None = None
        self._backlog = 0

    async def request_subpartition(self) -> None:
        if self._view is not None:
            return
        delays = backoff_delays(self.backoff_initial, self.backoff_max)
        while True:
            if self._released:
                raise IllegalStateError(f"{self!r} was released")
            try:
                self._view = self._manager.create_subpartition_view(
                    self.partition_id, self.subpartition_index, self
                )
                return
            except PartitionNotFoundError:
                delay = next(delays, None)
                if delay is None:
                    raise
                await asyncio.sleep(delay)

    def notify_data_available(self) -> None:
        """BufferAvailabilityListener: the view has data again."""
        self.gate.notify_channel_non_empty(self)

    def get_next_buffer(self) -> BufferAndAvailability | None:
        self.check_error()
        view = self._view
        if view is None:
            if self._released:
                return None
            raise IllegalStateError(f"{self!r}: subpartition not requested yet")
        nb = view.get_next_buffer()
        if nb is None:
            if view.is_released and not self._released:
                cause = view.failure_cause
                if cause is not None:
                    raise fresh_error(cause)
                raise PartitionReleasedError(
                    f"consumed subpartition {self.subpartition_index} was released",
                    self.partition_id,
                )
            return None
        buf = nb.buffer
        self._backlog = nb.buffers_in_backlog
        self.bytes_in += buf.size
        self.buffers_in += 1
        return BufferAndAvailability(
            buf, nb.is_data_available, nb.buffers_in_backlog, nb.sequence_number
        )

    @property
    def announced_backlog(self) -> int:
        return self._backlog

    def resume_consumption(self) -> None:
        if self._view is not None:
            self._view.resume_consumption()

    def notify_new_buffer_size(self, size: int) -> None:
        if self._view is not None:
            self._view.notify_new_buffer_size(size)

    def release_all_resources(self) -> None:
        if self._released:
            return
        self._released = True
        view, self._view = self._view, None
        if view is not None:
            view.release_all_resources()
