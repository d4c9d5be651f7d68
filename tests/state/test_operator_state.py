"""OperatorStateBackend: list state, split and union redistribution."""

from __future__ import annotations

import pytest

from exchange.errors import UsageError
from exchange.state import (
    CorruptSnapshotError,
    Distribution,
    KeyedStateBackend,
    OperatorStateBackend,
    StateError,
)


def snapshots(p: int, per_subtask: int) -> list[bytes]:
    out = []
    for i in range(p):
        b = OperatorStateBackend(i, p)
        offsets = b.list_state("source", "offsets")
        offsets.add_all((f"file-{i}-{j}", j) for j in range(per_subtask))
        b.union_list_state("sink", "txns").add(f"txn-{i}")
        out.append(b.snapshot())
    return out


def test_round_trip_same_parallelism() -> None:
    snaps = snapshots(2, 3)
    for i in range(2):
        b = OperatorStateBackend(i, 2)
        b.restore(snaps)
        assert b.list_state("source", "offsets").get() == [(f"file-{i}-{j}", j) for j in range(3)]
        assert b.union_list_state("sink", "txns").get() == ["txn-0", "txn-1"]


@pytest.mark.parametrize(("old_p", "new_p"), [(1, 3), (3, 2), (2, 5), (4, 1)])
def test_split_redistribution_keeps_every_item_once(old_p: int, new_p: int) -> None:
    snaps = snapshots(old_p, 5)
    got: list[object] = []
    for i in range(new_p):
        b = OperatorStateBackend(i, new_p)
        b.restore(snaps)
        share = b.list_state("source", "offsets").get()
        assert abs(len(share) - old_p * 5 / new_p) < 1
        got += share
        assert len(b.union_list_state("sink", "txns")) == old_p
    assert got == [(f"file-{i}-{j}", j) for i in range(old_p) for j in range(5)]


def test_list_state_operations() -> None:
    s = OperatorStateBackend().list_state("op", "l")
    s.add(1)
    s.update([2, 3])
    assert list(s) == [2, 3] and s.get() == [2, 3]
    s.get().append(4)  # a copy
    assert len(s) == 2
    s.clear()
    assert s.get() == []


def test_misuse_and_corruption() -> None:
    b = OperatorStateBackend()
    b.list_state("op", "l")
    with pytest.raises(StateError):
        b.union_list_state("op", "l")
    with pytest.raises(UsageError):
        OperatorStateBackend(2, 2)
    snaps = snapshots(2, 1)
    with pytest.raises(CorruptSnapshotError, match="subtask 0 given after subtask 1"):
        OperatorStateBackend().restore([snaps[1], snaps[0]])
    with pytest.raises(CorruptSnapshotError, match="subtask 0 given after subtask 0"):
        OperatorStateBackend().restore([snaps[0], snaps[0]])
    with pytest.raises(CorruptSnapshotError, match="checksum"):
        OperatorStateBackend().restore([("x.state", snaps[0][:-1] + b"\xff")])
    with pytest.raises(CorruptSnapshotError, match="KEYED_STATE"):
        OperatorStateBackend().restore([KeyedStateBackend().snapshot()])
    assert Distribution.SPLIT.value == "split"
