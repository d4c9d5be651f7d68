"""Key groups: ranges cover every group once, and keys route to the subtask owning them."""

from __future__ import annotations

from typing import Any

import pytest

from exchange.errors import ConfigError, UsageError
from exchange.state import (
    KeyGroupRange,
    key_group_for_key,
    key_group_range_for_subtask,
    subtask_for_key,
    subtask_for_key_group,
)


@pytest.mark.parametrize(("max_p", "p"), [(1, 1), (128, 1), (128, 3), (128, 128), (10, 7)])
def test_ranges_partition_the_key_groups(max_p: int, p: int) -> None:
    seen: list[int] = []
    for i in range(p):
        r = key_group_range_for_subtask(max_p, p, i)
        assert len(r) >= 1
        for kg in r:
            assert subtask_for_key_group(max_p, p, kg) == i
        seen.extend(r)
    assert seen == list(range(max_p))


def test_keys_route_to_the_owner_of_their_key_group() -> None:
    for key in [*range(-50, 500), "user-1", b"x", ("a", 1), None, 2**70]:
        kg = key_group_for_key(key, 128)
        i = subtask_for_key(key, 128, 3)
        assert kg in key_group_range_for_subtask(128, 3, i)


# Literal key groups recorded as released: a checkpoint's keyed state is stored by key
# group, so a key must land in the same group in the version that restores it.
PINNED_KEY_GROUPS: list[tuple[Any, int, int]] = [
    # key, key group of 128, key group of 32768 (the largest max parallelism)
    (0, 0, 0),
    (1, 57, 31161),
    (-1, 70, 1606),
    (2**64 + 5, 76, 28748),
    ("a", 55, 12727),
    ("key-1", 25, 29209),
    ("äöü€", 45, 2989),
    (b"\x00\xff", 124, 19196),
    ((1, "a"), 109, 23277),
    (("nested", (1, 2.5, None)), 21, 149),
    (1.5, 98, 32098),
    (-0.0, 118, 18294),
    (None, 55, 9783),
    (True, 12, 5516),
    (False, 74, 25162),
]


@pytest.mark.parametrize(
    ("key", "of_128", "of_32768"), PINNED_KEY_GROUPS, ids=[repr(k) for k, *_ in PINNED_KEY_GROUPS]
)
def test_the_assignment_is_pinned(key: Any, of_128: int, of_32768: int) -> None:
    assert key_group_for_key(key, 128) == of_128
    assert key_group_for_key(key, 32768) == of_32768


@pytest.mark.parametrize(("max_p", "p", "i"), [(0, 1, 0), (40000, 1, 0), (8, 9, 0), (8, 0, 0)])
def test_bad_parallelism_is_a_config_error(max_p: int, p: int, i: int) -> None:
    with pytest.raises(ConfigError):
        key_group_range_for_subtask(max_p, p, i)


def test_bad_subtask_index() -> None:
    with pytest.raises(UsageError):
        key_group_range_for_subtask(8, 2, 2)


def test_range_membership() -> None:
    r = KeyGroupRange(3, 5)
    assert 3 in r and 5 in r and 6 not in r and "3" not in r
    assert len(KeyGroupRange(5, 4)) == 0
