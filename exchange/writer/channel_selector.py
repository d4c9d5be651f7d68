"""ChannelSelectors: which subpartition(s) a record goes to."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from exchange.errors import UsageError
from exchange.writer.hashing import deterministic_hash

__all__ = [
    "BroadcastSelector",
    "ChannelSelector",
    "KeyHashSelector",
    "PartitionerSelector",
    "RoundRobinSelector",
]


class ChannelSelector(Protocol):
    """Chooses the target subpartition of a record."""

    @property
    def is_broadcast(self) -> bool: ...

    def setup(self, num_channels: int) -> None: ...

    def select_channel(self, record: Any) -> int: ...


def _first(record: Any) -> Any:
    return record[0]


class KeyHashSelector:
    """``deterministic_hash(key_fn(record)) % n``; by default the key is ``record[0]``."""

    is_broadcast = False

    def __init__(self, key_fn: Callable[[Any], Any] = _first) -> None:
        self._key_fn = key_fn
        self._n = 0

    def setup(self, num_channels: int) -> None:
        if num_channels <= 0:
            raise UsageError(f"num_channels must be positive, got {num_channels}")
        self._n = num_channels

    def select_channel(self, record: Any) -> int:
        return deterministic_hash(self._key_fn(record)) % self._n


class RoundRobinSelector:
    """Each record to the next subpartition in turn."""

    is_broadcast = False

    def __init__(self) -> None:
        self._n = 0
        self._next = -1

    def setup(self, num_channels: int) -> None:
        if num_channels <= 0:
            raise UsageError(f"num_channels must be positive, got {num_channels}")
        self._n = num_channels

    def select_channel(self, record: Any) -> int:
        nxt = self._next + 1
        if nxt >= self._n:
            nxt = 0
        self._next = nxt
        return nxt


class PartitionerSelector:
    """A user partitioner ``f(key) -> int`` (like Spark's ``partitionFunc``), taken mod n.

    ``key_fn`` picks the key from the record (``record[0]`` by default).
    """

    is_broadcast = False

    def __init__(
        self, partitioner: Callable[[Any], int], key_fn: Callable[[Any], Any] = _first
    ) -> None:
        self._partitioner = partitioner
        self._key_fn = key_fn
        self._n = 0

    def setup(self, num_channels: int) -> None:
        if num_channels <= 0:
            raise UsageError(f"num_channels must be positive, got {num_channels}")
        self._n = num_channels

    def select_channel(self, record: Any) -> int:
        p = self._partitioner(self._key_fn(record))
        if not isinstance(p, int):
            raise UsageError(f"partitioner returned {p!r}, not an int")
        return p % self._n


class BroadcastSelector:
    """Every record to every subpartition (a writer with it broadcasts each record, encoded
    and copied once)."""

    is_broadcast = True

    def setup(self, num_channels: int) -> None:
        pass

    def select_channel(self, record: Any) -> int:
        raise UsageError("a broadcast selector selects every channel")
