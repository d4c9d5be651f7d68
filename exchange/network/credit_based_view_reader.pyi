# Types of the compiled view reader (exchange/network/credit_based_view_reader.pyx), for
# mypy --strict.
from typing import TYPE_CHECKING

from exchange.consumer.input_channel import BufferAndAvailability
from exchange.partition.bounded_data import ReadMemory
from exchange.partition.result_partition_id import ResultPartitionID
from exchange.partition.result_partition_manager import ResultPartitionManager

if TYPE_CHECKING:
    from exchange.network.partition_request_queue import PartitionRequestQueue

__all__ = ["CreditBasedSequenceNumberingViewReader"]

class CreditBasedSequenceNumberingViewReader:
    """Server-side state of one PartitionRequest."""

    receiver_id: int
    initial_credit: int
    credits: int
    registered_as_available: bool
    partition_id: ResultPartitionID | None
    subpartition_index: int
    @property
    def more_available(self) -> bool: ...
    @property
    def backlog(self) -> int: ...
    @property
    def sequence_number(self) -> int: ...
    def __init__(
        self, receiver_id: int, initial_credit: int, queue: PartitionRequestQueue
    ) -> None: ...
    def request_subpartition_view(
        self,
        manager: ResultPartitionManager,
        pid: ResultPartitionID,
        index: int,
        app_id: str = "",
        read_memory: ReadMemory | None = None,
    ) -> None: ...
    def notify_data_available(self) -> None: ...
    def notify_priority_event(self) -> None: ...
    def add_credit(self, delta: int) -> None: ...
    def resume_consumption(self) -> None: ...
    def notify_new_buffer_size(self, size: int) -> None: ...
    def is_available(self) -> bool: ...
    def get_next_buffer(self) -> BufferAndAvailability | None: ...
    @property
    def is_released(self) -> bool: ...
    @property
    def failure_cause(self) -> BaseException | None: ...
    def release_all_resources(self) -> None: ...
