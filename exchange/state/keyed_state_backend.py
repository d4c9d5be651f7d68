"""KeyedStateBackend: ValueState and MapState per (operator, state name, key), on the heap.

Flink's ``HeapKeyedStateBackend`` in small. The runtime sets the current key before each
record (``set_current_key``); a state handle reads and writes the entry of that key. Entries
live per key group, so a snapshot can be split by key group and restored into another
parallelism: ``restore`` takes the snapshots of any number of old subtasks and keeps the key
groups this backend owns. Values are held by reference (a mutated list is in the next
snapshot without ``update``), as in Flink's heap backend. Not thread-safe: the task thread
owns it.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from enum import Enum
from typing import Any, Generic, TypeVar

from exchange.state.errors import CorruptSnapshotError, KeyGroupOutOfRangeError, StateError
from exchange.state.key_groups import (
    DEFAULT_MAX_PARALLELISM,
    KeyGroupRange,
    check_max_parallelism,
    key_group_for_key,
)
from exchange.state.snapshot import SnapshotKind, decode_snapshot, encode_snapshot

__all__ = ["KeyedStateBackend", "MapState", "StateKind", "ValueState"]

K = TypeVar("K")
V = TypeVar("V")
StateId = tuple[str, str]
#: key group -> key -> value (a ValueState's value, or a MapState's dict)
_Table = dict[int, dict[Any, Any]]
_NO_KEY: Any = object()


class StateKind(Enum):
    VALUE = "value"
    MAP = "map"


class KeyedStateBackend:
    """Keyed state of the subtask that owns ``key_groups`` (all of them by default)."""

    def __init__(
        self,
        max_parallelism: int = DEFAULT_MAX_PARALLELISM,
        key_groups: KeyGroupRange | None = None,
    ) -> None:
        check_max_parallelism(max_parallelism)
        self._max_parallelism = max_parallelism
        self._range = KeyGroupRange.of_all(max_parallelism) if key_groups is None else key_groups
        if self._range.start < 0 or self._range.end >= max_parallelism:
            raise StateError(f"key groups {self._range} outside [0, {max_parallelism})")
        self._tables: dict[StateId, _Table] = {}
        self._kinds: dict[StateId, StateKind] = {}
        self._key: Any = _NO_KEY
        self._key_group = -1

    @property
    def max_parallelism(self) -> int:
        return self._max_parallelism

    @property
    def key_groups(self) -> KeyGroupRange:
        return self._range

    @property
    def current_key(self) -> Any:
        if self._key is _NO_KEY:
            raise StateError("no current key: the runtime sets it before each record")
        return self._key

    def set_current_key(self, key: Any) -> None:
        """Keyed state reads and writes ``key``'s entries from now on."""
        key_group = key_group_for_key(key, self._max_parallelism)
        if key_group not in self._range:
            raise KeyGroupOutOfRangeError(key, key_group, self._range.start, self._range.end)
        self._key = key
        self._key_group = key_group

    def value_state(self, operator: str, name: str, default: Any = None) -> ValueState[Any]:
        """The ValueState ``name`` of ``operator`` (created on first use)."""
        return ValueState(self, self._table(operator, name, StateKind.VALUE), default)

    def map_state(self, operator: str, name: str) -> MapState[Any, Any]:
        """The MapState ``name`` of ``operator`` (created on first use)."""
        return MapState(self, self._table(operator, name, StateKind.MAP))

    def states(self) -> dict[StateId, StateKind]:
        return dict(self._kinds)

    def keys(self, operator: str, name: str) -> Iterator[Any]:
        """Every key with an entry in that state."""
        for entries in self._tables.get((operator, name), {}).values():
            yield from entries

    def num_entries(self) -> int:
        return sum(len(e) for t in self._tables.values() for e in t.values())

    def _table(self, operator: str, name: str, kind: StateKind) -> _Table:
        sid = (operator, name)
        have = self._kinds.get(sid)
        if have is None:
            self._kinds[sid] = kind
            self._tables[sid] = {}
        elif have is not kind:
            raise StateError(
                f"state {name!r} of operator {operator!r} is a {have.value} state, "
                f"not a {kind.value} state"
            )
        return self._tables[sid]

    def _entries(self, table: _Table, create: bool) -> dict[Any, Any] | None:
        if self._key is _NO_KEY:
            raise StateError("no current key: the runtime sets it before each record")
        entries = table.get(self._key_group)
        if entries is None and create:
            entries = table[self._key_group] = {}
        return entries

    # -- snapshots --------------------------------------------------------------------------

    def snapshot(self) -> bytes:
        """Every entry, by state and key group, as snapshot bytes (pickled now: later writes
        do not change them)."""
        states = {
            sid: {
                "kind": self._kinds[sid].value,
                "groups": {kg: entries for kg, entries in table.items() if entries},
            }
            for sid, table in self._tables.items()
        }
        return encode_snapshot(
            SnapshotKind.KEYED_STATE,
            {
                "max_parallelism": self._max_parallelism,
                "key_groups": (self._range.start, self._range.end),
                "states": states,
            },
        )

    def restore(self, snapshots: Iterable[bytes | tuple[str, bytes]]) -> None:
        """Replace all state by the key groups this backend owns out of ``snapshots`` (each
        bytes or ``(source name, bytes)``, from one or many subtasks of any parallelism)."""
        tables: dict[StateId, _Table] = {}
        kinds: dict[StateId, StateKind] = {}
        for i, item in enumerate(snapshots):
            source, data = item if isinstance(item, tuple) else (f"<keyed snapshot {i}>", item)
            snap = decode_snapshot(data, SnapshotKind.KEYED_STATE, source)
            try:
                max_p = snap["max_parallelism"]
                states = snap["states"]
                parsed = [
                    (sid, StateKind(s["kind"]), dict(s["groups"])) for sid, s in states.items()
                ]
            except (KeyError, TypeError, ValueError, AttributeError) as exc:
                raise CorruptSnapshotError(source, f"not a keyed state snapshot: {exc!r}") from exc
            if max_p != self._max_parallelism:
                raise CorruptSnapshotError(
                    source,
                    f"written with max_parallelism {max_p}, this backend has "
                    f"{self._max_parallelism}: key groups cannot be mapped",
                )
            for sid, kind, groups in parsed:
                other = kinds.setdefault(sid, kind)
                if other is not kind:
                    raise CorruptSnapshotError(
                        source, f"state {sid} is a {kind.value} state here, a {other.value} before"
                    )
                table = tables.setdefault(sid, {})
                for kg, entries in groups.items():
                    if kg not in self._range:
                        continue
                    if kg in table:
                        raise CorruptSnapshotError(
                            source, f"key group {kg} of state {sid} is in two snapshots"
                        )
                    table[kg] = entries
        for sid, kind in self._kinds.items():
            if kinds.setdefault(sid, kind) is not kind:
                raise StateError(
                    f"state {sid} is used as a {kind.value} state, restored as a "
                    f"{kinds[sid].value} state"
                )
        # in place: state handles taken before the restore see the restored entries
        for sid, kind in kinds.items():
            table = self._tables.setdefault(sid, {})
            table.clear()
            table.update(tables.get(sid, {}))
            self._kinds[sid] = kind


class ValueState(Generic[V]):
    """One value per key (Flink's ``ValueState``)."""

    __slots__ = ("_backend", "_default", "_table")

    def __init__(self, backend: KeyedStateBackend, table: _Table, default: V) -> None:
        self._backend = backend
        self._table = table
        self._default = default

    def value(self) -> V:
        entries = self._backend._entries(self._table, False)
        if entries is None:
            return self._default
        return entries.get(self._backend._key, self._default)  # type: ignore[no-any-return]

    def update(self, value: V) -> None:
        entries = self._backend._entries(self._table, True)
        assert entries is not None
        entries[self._backend._key] = value

    def clear(self) -> None:
        entries = self._backend._entries(self._table, False)
        if entries is not None:
            entries.pop(self._backend._key, None)


class MapState(Generic[K, V]):
    """A map per key (Flink's ``MapState``)."""

    __slots__ = ("_backend", "_table")

    def __init__(self, backend: KeyedStateBackend, table: _Table) -> None:
        self._backend = backend
        self._table = table

    def _map(self, create: bool) -> dict[K, V] | None:
        entries = self._backend._entries(self._table, create)
        if entries is None:
            return None
        m: dict[K, V] | None = entries.get(self._backend._key)
        if m is None and create:
            m = entries[self._backend._key] = {}
        return m

    def get(self, key: K, default: V | None = None) -> V | None:
        m = self._map(False)
        return default if m is None else m.get(key, default)

    def put(self, key: K, value: V) -> None:
        m = self._map(True)
        assert m is not None
        m[key] = value

    def put_all(self, items: dict[K, V]) -> None:
        m = self._map(True)
        assert m is not None
        m.update(items)

    def contains(self, key: K) -> bool:
        m = self._map(False)
        return m is not None and key in m

    def remove(self, key: K) -> None:
        m = self._map(False)
        if m is not None:
            m.pop(key, None)
            if not m:
                self.clear()

    def keys(self) -> list[K]:
        m = self._map(False)
        return [] if m is None else list(m)

    def values(self) -> list[V]:
        m = self._map(False)
        return [] if m is None else list(m.values())

    def items(self) -> list[tuple[K, V]]:
        m = self._map(False)
        return [] if m is None else list(m.items())

    def is_empty(self) -> bool:
        m = self._map(False)
        return not m

    def clear(self) -> None:
        entries = self._backend._entries(self._table, False)
        if entries is not None:
            entries.pop(self._backend._key, None)
