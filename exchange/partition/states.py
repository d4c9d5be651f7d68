"""The lifecycles of partitions, subpartitions and their readers, as tables.

Every lifecycle is one enum and one table of the transitions it allows (h11's
``_state.py``); objects move only through ``transition``, which raises IllegalStateError
for anything the table does not list. Repeating a terminal call (``release`` twice) is
not a transition: the objects treat it as a no-op before asking the table.

ResultPartition::

    WRITING ──finish──> FINISHED ──(consumed / release)──> RELEASED
       │                   │
       ├──release──────────┼──────────────────────────────> RELEASED
       └──fail─────────────┴──fail────────────────────────> FAILED

``FAILED`` is ``RELEASED`` with a ProducerFailedError as its cause: every reader that has
not read EndOfPartition gets that error. As in Flink (``ResultPartition.fail`` releases
the partition with the cause, finished or not), a pipelined partition failed after
``finish`` drops its unread data and fails its readers. The first end wins: a partition
released before ``fail`` stays RELEASED (its readers were told already).

Subpartitions (pipelined and blocking)::

    WRITING ──finish──> FINISHED ──release──> RELEASED
       └──────────────release───────────────> RELEASED

Readers (a pipelined subpartition's single view, a blocking subpartition's readers)::

    READING ──polled EndOfPartition──> CONSUMED ──release──> RELEASED
       └──────────────release (early: a consumer failure)──> RELEASED
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import Enum
from typing import Final, TypeVar

from exchange.errors import IllegalStateError

__all__ = [
    "PARTITION_TRANSITIONS",
    "READER_TRANSITIONS",
    "SUBPARTITION_TRANSITIONS",
    "ReaderState",
    "ResultPartitionState",
    "SubpartitionState",
    "transition",
]


class ResultPartitionState(Enum):
    """Where a ResultPartition is in its life."""

    WRITING = "writing"
    FINISHED = "finished"
    FAILED = "failed"
    RELEASED = "released"

    @property
    def is_released(self) -> bool:
        """Resources gone (released or failed)."""
        return self is ResultPartitionState.RELEASED or self is ResultPartitionState.FAILED


class SubpartitionState(Enum):
    """Where a (pipelined or blocking) subpartition is in its life."""

    WRITING = "writing"
    FINISHED = "finished"
    RELEASED = "released"


class ReaderState(Enum):
    """Where a subpartition view or reader is in its life."""

    READING = "reading"
    CONSUMED = "consumed"
    RELEASED = "released"


_P = ResultPartitionState
_S = SubpartitionState
_R = ReaderState

PARTITION_TRANSITIONS: Final[Mapping[ResultPartitionState, frozenset[ResultPartitionState]]] = {
    _P.WRITING: frozenset({_P.FINISHED, _P.FAILED, _P.RELEASED}),
    _P.FINISHED: frozenset({_P.FAILED, _P.RELEASED}),
    _P.FAILED: frozenset(),
    _P.RELEASED: frozenset(),
}

SUBPARTITION_TRANSITIONS: Final[Mapping[SubpartitionState, frozenset[SubpartitionState]]] = {
    _S.WRITING: frozenset({_S.FINISHED, _S.RELEASED}),
    _S.FINISHED: frozenset({_S.RELEASED}),
    _S.RELEASED: frozenset(),
}

READER_TRANSITIONS: Final[Mapping[ReaderState, frozenset[ReaderState]]] = {
    _R.READING: frozenset({_R.CONSUMED, _R.RELEASED}),
    _R.CONSUMED: frozenset({_R.RELEASED}),
    _R.RELEASED: frozenset(),
}

_E = TypeVar("_E", bound=Enum)


def transition(table: Mapping[_E, frozenset[_E]], current: _E, to: _E, what: object) -> _E:
    """``to`` if ``table`` allows ``current -> to``; else IllegalStateError naming ``what``."""
    if to not in table[current]:
        raise IllegalStateError(f"{what}: illegal transition {current.value} -> {to.value}")
    return to
