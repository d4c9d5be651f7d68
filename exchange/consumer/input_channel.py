"""InputChannel: one (partition, subpartition) a consumer reads, as seen by its gate."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator
from typing import TYPE_CHECKING, Final, NamedTuple

from exchange.buffers.buffer import Buffer
from exchange.errors import UsageError, fresh_error
from exchange.partition.result_partition_id import ResultPartitionID

if TYPE_CHECKING:
    from exchange.consumer.single_input_gate import SingleInputGate

__all__ = [
    "BATCH_FLOATING_BUFFERS",
    "DEFAULT_BACKOFF_INITIAL",
    "DEFAULT_BACKOFF_MAX",
    "STREAMING_FLOATING_BUFFERS",
    "BufferAndAvailability",
    "InputChannel",
    "backoff_delays",
]

DEFAULT_BACKOFF_INITIAL: Final = 0.1
DEFAULT_BACKOFF_MAX: Final = 10.0
#: Floating buffers per gate of a streaming reader (one with a checkpoint listener): Flink's
#: default. How a checkpoint aligns depends on the data in flight: the window stays Flink's.
STREAMING_FLOATING_BUFFERS: Final = 8
#: Floating buffers per gate of a batch reader: a larger credit window, so the stream
#: arrives in larger bursts (fewer reads, AddCredit writes and hand-off wake-ups per
#: buffer: docs/architecture.md, "The consumer's CPU per 32 KiB").
BATCH_FLOATING_BUFFERS: Final = 32


def backoff_delays(initial: float, maximum: float) -> Iterator[float]:
    """Flink's partition request backoff: initial, doubling, capped at max, then stop."""
    delay = initial
    while True:
        yield delay
        if delay >= maximum:
            return
        delay = min(delay * 2, maximum)


class BufferAndAvailability(NamedTuple):
    """``overtaken_by``: ids of the unaligned checkpoints whose priority barrier overtook
    this data buffer in the channel (it is input channel state of each; empty for most)."""

    buffer: Buffer
    more_available: bool
    buffers_in_backlog: int
    sequence_number: int
    overtaken_by: tuple[int, ...] = ()


class InputChannel(ABC):
    """Base of RemoteInputChannel (and of the test kit's in-process LocalInputChannel).

    Partition requests back off exponentially (``backoff_initial`` doubling up to
    ``backoff_max``) while the producer's partition is not registered yet, then fail.
    An error found asynchronously (from the network) is stored and the gate is told the
    channel has "data": the next ``get_next_buffer`` raises it.
    """

    def __init__(
        self,
        gate: SingleInputGate,
        channel_index: int,
        partition_id: ResultPartitionID,
        subpartition_index: int,
        *,
        backoff_initial: float = DEFAULT_BACKOFF_INITIAL,
        backoff_max: float = DEFAULT_BACKOFF_MAX,
    ) -> None:
        if not isinstance(subpartition_index, int) or subpartition_index < 0:
            raise UsageError(f"subpartition_index must be an int >= 0, got {subpartition_index!r}")
        if backoff_initial <= 0 or backoff_max < backoff_initial:
            raise UsageError(
                f"need 0 < backoff_initial <= backoff_max, got {backoff_initial}, {backoff_max}"
            )
        self.gate = gate
        self.channel_index = channel_index
        self.partition_id = partition_id
        self.subpartition_index = subpartition_index
        self.backoff_initial = backoff_initial
        self.backoff_max = backoff_max
        self._error: BaseException | None = None
        self._released = False
        self.queued = False  # managed by the gate: in its channels-with-data queue
        self.queued_with_priority = False  # managed by the gate: in its priority prefix
        self.finished = False  # EndOfPartition seen
        self.bytes_in = 0
        self.buffers_in = 0

    @abstractmethod
    async def request_subpartition(self) -> None:
        """Ask the producer's side for the subpartition (with backoff)."""

    @abstractmethod
    def get_next_buffer(self) -> BufferAndAvailability | None:
        """The next buffer, or None; raises the channel's error if it failed."""

    def take_data_buffers(self, limit: int) -> tuple[list[Buffer], bool]:
        """Up to ``limit`` data buffers from the head of what was received, taken at once,
        and whether anything is left after them: the gate's batch path (``poll_data``).
        Takes none when the head is an event or when anything received needs the
        one-by-one path of ``get_next_buffer`` (priority events, overtaken buffers); this
        base takes none: its channels go one by one."""
        return [], True

    @abstractmethod
    def resume_consumption(self) -> None:
        """Unblock the subpartition after an aligned checkpoint barrier."""

    @abstractmethod
    def release_all_resources(self) -> None:
        """Give back every buffer and the subpartition view or request. Idempotent."""

    def notify_new_buffer_size(self, size: int) -> None:  # noqa: B027 - optional hook
        """Debloating: the producer should use buffers of ``size`` bytes."""

    @property
    def num_queued_buffers(self) -> int:
        """Buffers received and not yet taken by the gate (debloating counts them in use)."""
        return 0

    @property
    def has_priority_event(self) -> bool:
        """A priority event (unaligned barrier) is next to be taken."""
        return False

    @property
    def announced_backlog(self) -> int:
        """The producer's backlog as last announced (buffers not sent yet)."""
        return 0

    @property
    def is_released(self) -> bool:
        return self._released

    def set_error(self, error: BaseException) -> None:
        """Record an asynchronous failure and wake the gate so the reader sees it."""
        if self._error is None:
            self._error = error
        self.gate.notify_channel_non_empty(self)

    def check_error(self) -> None:
        if self._error is not None:
            raise fresh_error(self._error)

    def notify_channel_non_empty(self) -> None:
        self.gate.notify_channel_non_empty(self)

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(#{self.channel_index}, {self.partition_id}"
            f"[{self.subpartition_index}])"
        )
