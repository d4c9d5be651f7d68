"""Identity of a result partition: which exchange, which producer, which attempt."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

from exchange.errors import UsageError

MAX_DATASET_ID_BYTES: Final = 255
MAX_U32: Final = 0xFFFF_FFFF
MAX_U64: Final = 0xFFFF_FFFF_FFFF_FFFF


@dataclass(frozen=True, slots=True)
class ResultPartitionID:
    """Flink's ResultPartitionID: (IntermediateResultPartitionID, ExecutionAttemptID).

    ``dataset_id`` names the exchange (one shuffle of one job), ``partition_index`` the
    producing task, and ``attempt_id`` the producer's attempt (in Spark the
    ``taskAttemptId()``, unique in the application), so a retried task never mixes with the
    partition its failed attempt wrote.
    """

    dataset_id: str
    partition_index: int
    attempt_id: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.dataset_id, str) or not self.dataset_id:
            raise UsageError(f"dataset_id must be a non-empty str, got {self.dataset_id!r}")
        if len(self.dataset_id.encode("utf-8")) > MAX_DATASET_ID_BYTES:
            raise UsageError(f"dataset_id longer than {MAX_DATASET_ID_BYTES} bytes in UTF-8")
        if (
            not isinstance(self.partition_index, int)
            or isinstance(self.partition_index, bool)
            or not 0 <= self.partition_index <= MAX_U32
        ):
            raise UsageError(
                f"partition_index must be an int in [0, 2**32), got {self.partition_index!r}"
            )
        if (
            not isinstance(self.attempt_id, int)
            or isinstance(self.attempt_id, bool)
            or not 0 <= self.attempt_id <= MAX_U64
        ):
            raise UsageError(f"attempt_id must be an int in [0, 2**64), got {self.attempt_id!r}")

    def __str__(self) -> str:
        return f"{self.dataset_id}#{self.partition_index}@{self.attempt_id}"
