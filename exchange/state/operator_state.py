"""Operator state: lists of items per operator (sources' offsets, sinks' pending transactions).

Flink's ``OperatorStateBackend`` with list state. How a list is redistributed when the
parallelism changes is chosen when the state is declared (Flink's two modes):

* ``SPLIT`` (``getListState``): the items of every old subtask, in subtask order, are cut
  into ``parallelism`` contiguous, nearly equal runs; subtask ``i`` gets run ``i``.
  Same parallelism, same lists.
* ``UNION`` (``getUnionListState``): every subtask gets every item.

Restoring needs the snapshots of the old subtasks in subtask order: all of them, but for
subtasks that had finished (bounded input) and so wrote none.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from enum import Enum
from typing import Any

from exchange.errors import UsageError
from exchange.state.errors import CorruptSnapshotError, StateError
from exchange.state.snapshot import SnapshotKind, decode_snapshot, encode_snapshot

__all__ = ["Distribution", "OperatorListState", "OperatorStateBackend"]


class Distribution(Enum):
    SPLIT = "split"
    UNION = "union"


class OperatorListState:
    """A list of picklable items (Flink's ``ListState`` of operator state)."""

    __slots__ = ("_items", "distribution", "name")

    def __init__(self, name: str, distribution: Distribution) -> None:
        self.name = name
        self.distribution = distribution
        self._items: list[Any] = []

    def get(self) -> list[Any]:
        """A copy of the items."""
        return list(self._items)

    def __iter__(self) -> Iterator[Any]:
        return iter(list(self._items))

    def __len__(self) -> int:
        return len(self._items)

    def add(self, item: Any) -> None:
        self._items.append(item)

    def add_all(self, items: Iterable[Any]) -> None:
        self._items.extend(items)

    def update(self, items: Iterable[Any]) -> None:
        self._items = list(items)

    def clear(self) -> None:
        self._items.clear()


class OperatorStateBackend:
    """The operator state of one subtask (``subtask_index`` of ``parallelism``)."""

    def __init__(self, subtask_index: int = 0, parallelism: int = 1) -> None:
        if type(parallelism) is not int or parallelism < 1:
            raise UsageError(f"parallelism must be an int >= 1, got {parallelism!r}")
        if type(subtask_index) is not int or not 0 <= subtask_index < parallelism:
            raise UsageError(f"subtask index {subtask_index!r} outside [0, {parallelism})")
        self.subtask_index = subtask_index
        self.parallelism = parallelism
        self._states: dict[tuple[str, str], OperatorListState] = {}

    def list_state(
        self, operator: str, name: str, distribution: Distribution = Distribution.SPLIT
    ) -> OperatorListState:
        """The list state ``name`` of ``operator`` (created on first use)."""
        sid = (operator, name)
        state = self._states.get(sid)
        if state is None:
            state = self._states[sid] = OperatorListState(name, distribution)
        elif state.distribution is not distribution:
            raise StateError(
                f"list state {name!r} of operator {operator!r} is {state.distribution.value}, "
                f"not {distribution.value}"
            )
        return state

    def union_list_state(self, operator: str, name: str) -> OperatorListState:
        return self.list_state(operator, name, Distribution.UNION)

    def snapshot(self) -> bytes:
        return encode_snapshot(
            SnapshotKind.OPERATOR_STATE,
            {
                "subtask_index": self.subtask_index,
                "parallelism": self.parallelism,
                "states": {
                    sid: {"distribution": s.distribution.value, "items": list(s._items)}
                    for sid, s in self._states.items()
                },
            },
        )

    def restore(self, snapshots: Sequence[bytes | tuple[str, bytes]]) -> None:
        """Replace every list by this subtask's share of ``snapshots`` (the old subtasks'
        snapshots, in subtask order)."""
        gathered: dict[tuple[str, str], tuple[Distribution, list[Any]]] = {}
        last = -1
        for i, item in enumerate(snapshots):
            source, data = item if isinstance(item, tuple) else (f"<operator snapshot {i}>", item)
            snap = decode_snapshot(data, SnapshotKind.OPERATOR_STATE, source)
            try:
                old_index = snap["subtask_index"]
                states = {
                    sid: (Distribution(s["distribution"]), list(s["items"]))
                    for sid, s in snap["states"].items()
                }
            except (KeyError, TypeError, ValueError, AttributeError) as exc:
                raise CorruptSnapshotError(
                    source, f"not an operator state snapshot: {exc!r}"
                ) from exc
            if type(old_index) is not int or old_index <= last:
                raise CorruptSnapshotError(
                    source, f"snapshot of subtask {old_index!r} given after subtask {last}"
                )
            last = old_index
            for sid, (dist, items) in states.items():
                have = gathered.setdefault(sid, (dist, []))
                if have[0] is not dist:
                    raise CorruptSnapshotError(source, f"state {sid} is {dist.value} here only")
                have[1].extend(items)
        for sid, (dist, items) in gathered.items():
            state = self.list_state(sid[0], sid[1], dist)
            if dist is Distribution.UNION:
                state.update(items)
            else:
                n, p, i = len(items), self.parallelism, self.subtask_index
                state.update(items[i * n // p : (i + 1) * n // p])
        for sid, state in self._states.items():
            if sid not in gathered:
                state.clear()
