"""Channel selectors: round robin, key hash, user partitioner, broadcast."""

from __future__ import annotations

from typing import Any

import pytest

from exchange.errors import UsageError
from exchange.writer import (
    BroadcastSelector,
    KeyHashSelector,
    PartitionerSelector,
    RoundRobinSelector,
    deterministic_hash,
)


def test_round_robin_cycles_from_zero() -> None:
    sel = RoundRobinSelector()
    sel.setup(3)
    assert [sel.select_channel(object()) for _ in range(7)] == [0, 1, 2, 0, 1, 2, 0]
    assert not sel.is_broadcast


def test_round_robin_single_channel() -> None:
    sel = RoundRobinSelector()
    sel.setup(1)
    assert {sel.select_channel(None) for _ in range(5)} == {0}


def test_key_hash_uses_first_field_by_default() -> None:
    sel = KeyHashSelector()
    sel.setup(16)
    for key in ("a", 7, b"x", (1, 2)):
        assert sel.select_channel((key, "payload")) == deterministic_hash(key) % 16


def test_key_hash_with_key_function() -> None:
    sel = KeyHashSelector(key_fn=lambda r: r["k"])
    sel.setup(5)
    assert sel.select_channel({"k": "z"}) == deterministic_hash("z") % 5


def test_partitioner_selector_takes_result_mod_n() -> None:
    sel = PartitionerSelector(lambda key: key * 10)
    sel.setup(4)
    assert [sel.select_channel((k,)) for k in range(4)] == [0, 2, 0, 2]
    assert sel.select_channel((-1,)) == (-10) % 4


def test_partitioner_returning_a_non_int_is_a_usage_error() -> None:
    # the caller's partitioner is at fault (API misuse), not a peer: a UsageError
    sel = PartitionerSelector(lambda key: "nope")  # type: ignore[arg-type, return-value]
    sel.setup(2)
    with pytest.raises(UsageError, match="partitioner returned"):
        sel.select_channel((1,))


@pytest.mark.parametrize(
    "make", [RoundRobinSelector, KeyHashSelector, lambda: PartitionerSelector(int)]
)
@pytest.mark.parametrize("n", [0, -1])
def test_setup_rejects_no_channels(make: Any, n: int) -> None:
    with pytest.raises(UsageError, match="num_channels"):
        make().setup(n)


def test_broadcast_selector_selects_every_channel_only() -> None:
    sel = BroadcastSelector()
    sel.setup(3)
    assert sel.is_broadcast
    with pytest.raises(UsageError):
        sel.select_channel("r")
