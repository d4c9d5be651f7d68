"""KeyedStateBackend: value and map state per key, snapshots, restore into another parallelism."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from exchange.state import (
    CorruptSnapshotError,
    KeyedStateBackend,
    KeyGroupOutOfRangeError,
    KeyGroupRange,
    OperatorStateBackend,
    StateError,
    key_group_range_for_subtask,
    subtask_for_key,
)

MAX_P = 16
KEYS = [f"user-{i}" for i in range(200)] + list(range(100))


def fill(backend: KeyedStateBackend, keys: Sequence[object]) -> None:
    count = backend.value_state("totals", "count", 0)
    seen = backend.map_state("totals", "seen")
    for k in keys:
        backend.set_current_key(k)
        count.update(count.value() + 1)
        seen.put(f"page-{k}", k)
        seen.put("last", 1)


def test_value_and_map_state_per_key() -> None:
    b = KeyedStateBackend(MAX_P)
    total = b.value_state("op", "total", default=0)
    m = b.map_state("op", "m")
    with pytest.raises(StateError, match="no current key"):
        total.value()
    b.set_current_key("a")
    assert total.value() == 0 and m.is_empty() and m.get("x") is None
    total.update(5)
    m.put("x", 1)
    m.put_all({"y": 2, "z": 3})
    b.set_current_key("b")
    assert total.value() == 0 and m.keys() == []
    total.update(7)
    b.set_current_key("a")
    assert total.value() == 5 and m.contains("x") and m.get("y") == 2
    assert sorted(m.items()) == [("x", 1), ("y", 2), ("z", 3)] and sorted(m.values()) == [1, 2, 3]
    m.remove("x")
    m.remove("missing")
    assert not m.contains("x")
    m.clear()
    assert m.is_empty()
    total.clear()
    assert total.value() == 0
    assert b.current_key == "a"
    assert sorted(b.keys("op", "total")) == ["b"]
    assert b.num_entries() == 1


def test_a_name_is_one_kind_of_state() -> None:
    b = KeyedStateBackend(MAX_P)
    b.value_state("op", "s")
    with pytest.raises(StateError, match="is a value state"):
        b.map_state("op", "s")
    b.map_state("other-op", "s")  # another operator may use the name


def test_snapshot_restore_round_trip_and_isolation() -> None:
    b = KeyedStateBackend(MAX_P)
    fill(b, KEYS)
    data = b.snapshot()
    b.set_current_key("user-1")
    b.value_state("totals", "count").update(999)  # after the snapshot: not in it
    r = KeyedStateBackend(MAX_P)
    count = r.value_state("totals", "count", 0)  # a handle taken before the restore
    r.restore([data])
    seen = r.map_state("totals", "seen")
    for k in KEYS:
        r.set_current_key(k)
        assert count.value() == 1
        assert seen.get(f"page-{k}") == k
    assert r.num_entries() == b.num_entries()


@pytest.mark.parametrize(("old_p", "new_p"), [(1, 3), (3, 1), (2, 5), (4, 4), (5, 2)])
def test_restore_into_another_parallelism(old_p: int, new_p: int) -> None:
    olds = []
    for i in range(old_p):
        b = KeyedStateBackend(MAX_P, key_group_range_for_subtask(MAX_P, old_p, i))
        fill(b, [k for k in KEYS if subtask_for_key(k, MAX_P, old_p) == i])
        olds.append((f"old-{i}", b.snapshot()))
    total = 0
    for j in range(new_p):
        n = KeyedStateBackend(MAX_P, key_group_range_for_subtask(MAX_P, new_p, j))
        n.restore(olds)
        mine = [k for k in KEYS if subtask_for_key(k, MAX_P, new_p) == j]
        count = n.value_state("totals", "count", 0)
        for k in mine:
            n.set_current_key(k)
            assert count.value() == 1
        assert sorted(map(str, n.keys("totals", "count"))) == sorted(map(str, mine))
        total += len(mine)
    assert total == len(KEYS)


def test_a_key_outside_the_backends_groups_is_a_routing_error() -> None:
    r = key_group_range_for_subtask(MAX_P, 2, 0)
    b = KeyedStateBackend(MAX_P, r)
    foreign = next(k for k in KEYS if subtask_for_key(k, MAX_P, 2) == 1)
    with pytest.raises(KeyGroupOutOfRangeError, match="wrong subtask"):
        b.set_current_key(foreign)
    with pytest.raises(StateError):
        KeyedStateBackend(MAX_P, KeyGroupRange(0, MAX_P))


def test_restore_refuses_mismatched_and_corrupt_snapshots() -> None:
    b = KeyedStateBackend(MAX_P)
    fill(b, KEYS[:10])
    data = b.snapshot()
    with pytest.raises(CorruptSnapshotError, match="max_parallelism 16"):
        KeyedStateBackend(32).restore([("chk-1/a.state", data)])
    with pytest.raises(CorruptSnapshotError, match=r"chk-1/a\.state.*truncated"):
        KeyedStateBackend(MAX_P).restore([("chk-1/a.state", data[:-3])])
    with pytest.raises(CorruptSnapshotError, match="OPERATOR_STATE"):
        KeyedStateBackend(MAX_P).restore([OperatorStateBackend().snapshot()])
    with pytest.raises(CorruptSnapshotError, match="in two snapshots"):
        KeyedStateBackend(MAX_P).restore([data, data])
    other = KeyedStateBackend(MAX_P)
    other.map_state("totals", "count")
    with pytest.raises(StateError, match="restored as a value state"):
        other.restore([data])


def test_restore_replaces_earlier_state() -> None:
    b = KeyedStateBackend(MAX_P)
    empty = b.snapshot()
    fill(b, KEYS[:5])
    b.restore([empty])
    assert b.num_entries() == 0
