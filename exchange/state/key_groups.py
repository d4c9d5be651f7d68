"""Key groups: the unit of keyed state that moves when a job's parallelism changes.

Flink's ``KeyGroupRangeAssignment``: a key belongs to key group
``deterministic_hash(key) % max_parallelism`` (the project's hash, the same in every process);
subtask ``i`` of ``p`` owns the contiguous range of key groups computed below, so a key's
subtask is ``key_group * p // max_parallelism``. State snapshotted per key group can be
restored into any parallelism up to ``max_parallelism``. The keyed exchange must route with
``subtask_for_key`` (not ``hash % p``) for a subtask to receive exactly its key groups.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Final

from exchange.errors import ConfigError, UsageError
from exchange.writer.hashing import deterministic_hash

__all__ = [
    "DEFAULT_MAX_PARALLELISM",
    "MAX_MAX_PARALLELISM",
    "KeyGroupRange",
    "key_group_for_key",
    "key_group_range_for_subtask",
    "subtask_for_key",
    "subtask_for_key_group",
]

#: Flink's default lower bound of the max parallelism.
DEFAULT_MAX_PARALLELISM: Final = 128
#: Flink's upper bound (2**15).
MAX_MAX_PARALLELISM: Final = 32768


@dataclass(frozen=True, slots=True)
class KeyGroupRange:
    """Key groups ``start`` .. ``end``, both included (empty when ``end < start``)."""

    start: int
    end: int

    def __contains__(self, key_group: object) -> bool:
        return isinstance(key_group, int) and self.start <= key_group <= self.end

    def __len__(self) -> int:
        return max(0, self.end - self.start + 1)

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.start, self.end + 1))

    @classmethod
    def of_all(cls, max_parallelism: int) -> KeyGroupRange:
        check_max_parallelism(max_parallelism)
        return cls(0, max_parallelism - 1)


def check_max_parallelism(max_parallelism: int) -> None:
    if type(max_parallelism) is not int or not 1 <= max_parallelism <= MAX_MAX_PARALLELISM:
        raise ConfigError(
            "max_parallelism",
            f"must be an int in [1, {MAX_MAX_PARALLELISM}], got {max_parallelism!r}",
        )


def _check_parallelism(max_parallelism: int, parallelism: int) -> None:
    check_max_parallelism(max_parallelism)
    if type(parallelism) is not int or not 1 <= parallelism <= max_parallelism:
        raise ConfigError(
            "parallelism",
            f"must be an int in [1, max_parallelism={max_parallelism}], got {parallelism!r}",
        )


def key_group_for_key(key: Any, max_parallelism: int) -> int:
    """The key group of ``key``."""
    return deterministic_hash(key) % max_parallelism


def key_group_range_for_subtask(
    max_parallelism: int, parallelism: int, subtask_index: int
) -> KeyGroupRange:
    """The key groups subtask ``subtask_index`` of ``parallelism`` owns."""
    _check_parallelism(max_parallelism, parallelism)
    if not 0 <= subtask_index < parallelism:
        raise UsageError(f"subtask index {subtask_index} outside [0, {parallelism})")
    start = (subtask_index * max_parallelism + parallelism - 1) // parallelism
    end = ((subtask_index + 1) * max_parallelism - 1) // parallelism
    return KeyGroupRange(start, end)


def subtask_for_key_group(max_parallelism: int, parallelism: int, key_group: int) -> int:
    """The subtask of ``parallelism`` that owns ``key_group``."""
    return key_group * parallelism // max_parallelism


def subtask_for_key(key: Any, max_parallelism: int, parallelism: int) -> int:
    """The subtask a keyed exchange must send ``key`` to."""
    return deterministic_hash(key) % max_parallelism * parallelism // max_parallelism
