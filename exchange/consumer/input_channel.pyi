# Types of the compiled InputChannel (exchange/consumer/input_channel.pyx), for mypy --strict.
from abc import abstractmethod
from collections.abc import Iterator
from typing import TYPE_CHECKING, Final, NamedTuple

from exchange.buffers.buffer import Buffer
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

DEFAULT_BACKOFF_INITIAL: Final[float]
DEFAULT_BACKOFF_MAX: Final[float]
STREAMING_FLOATING_BUFFERS: Final[int]
BATCH_FLOATING_BUFFERS: Final[int]

def backoff_delays(initial: float, maximum: float) -> Iterator[float]: ...

class BufferAndAvailability(NamedTuple):
    buffer: Buffer
    more_available: bool
    buffers_in_backlog: int
    sequence_number: int
    overtaken_by: tuple[int, ...] = ()

class InputChannel:
    """Abstract (instantiating the base raises TypeError); subclasses implement the
    ``abstractmethod``s."""

    gate: SingleInputGate
    channel_index: int
    partition_id: ResultPartitionID
    subpartition_index: int
    backoff_initial: float
    backoff_max: float
    _error: BaseException | None
    _released: bool
    queued: bool
    queued_with_priority: bool
    finished: bool
    bytes_in: int
    buffers_in: int
    def __init__(
        self,
        gate: SingleInputGate,
        channel_index: int,
        partition_id: ResultPartitionID,
        subpartition_index: int,
        *,
        backoff_initial: float = ...,
        backoff_max: float = ...,
    ) -> None: ...
    @abstractmethod
    async def request_subpartition(self) -> None: ...
    @abstractmethod
    def get_next_buffer(self) -> BufferAndAvailability | None: ...
    def take_data_buffers(self, limit: int) -> tuple[list[Buffer], bool]: ...
    @abstractmethod
    def resume_consumption(self) -> None: ...
    @abstractmethod
    def release_all_resources(self) -> None: ...
    def notify_new_buffer_size(self, size: int) -> None: ...
    @property
    def num_queued_buffers(self) -> int: ...
    @property
    def has_priority_event(self) -> bool: ...
    @property
    def announced_backlog(self) -> int: ...
    @property
    def is_released(self) -> bool: ...
    def set_error(self, error: BaseException) -> None: ...
    def check_error(self) -> None: ...
    def notify_channel_non_empty(self) -> None: ...
