"""The snapshot envelope: every damaged input raises CorruptSnapshotError naming its source."""

from __future__ import annotations

import contextlib
import pickle
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from exchange.state import (
    CorruptSnapshotError,
    SnapshotKind,
    decode_snapshot,
    encode_envelope,
    encode_snapshot,
)
from exchange.state.snapshot import HEADER

STATE: dict[Any, Any] = {"a": 1, "b": [1, 2, 3], ("k", 2): {"x": b"\x00" * 100}}


def test_round_trip() -> None:
    data = encode_snapshot(SnapshotKind.KEYED_STATE, STATE)
    assert decode_snapshot(data, SnapshotKind.KEYED_STATE) == STATE
    assert decode_snapshot(memoryview(data), SnapshotKind.KEYED_STATE) == STATE


@pytest.mark.parametrize("cut", [0, 1, HEADER.size - 1, HEADER.size, HEADER.size + 5])
def test_truncated(cut: int) -> None:
    data = encode_snapshot(SnapshotKind.KEYED_STATE, STATE)
    with pytest.raises(CorruptSnapshotError, match=r"chk-3/t\.state") as err:
        decode_snapshot(data[:cut], SnapshotKind.KEYED_STATE, "chk-3/t.state")
    assert err.value.source == "chk-3/t.state"


def test_trailing_bytes() -> None:
    data = encode_snapshot(SnapshotKind.KEYED_STATE, STATE)
    with pytest.raises(CorruptSnapshotError, match="trailing"):
        decode_snapshot(data + b"\0", SnapshotKind.KEYED_STATE)


def test_bad_magic_version_kind() -> None:
    data = bytearray(encode_snapshot(SnapshotKind.KEYED_STATE, STATE))
    with pytest.raises(CorruptSnapshotError, match="magic"):
        decode_snapshot(b"NOPE" + data[4:], SnapshotKind.KEYED_STATE)
    bad_version = bytes(data[:4]) + b"\x00\x09" + bytes(data[6:])
    with pytest.raises(CorruptSnapshotError, match="version 9"):
        decode_snapshot(bad_version, SnapshotKind.KEYED_STATE)
    with pytest.raises(CorruptSnapshotError, match="holds KEYED_STATE, expected OPERATOR_STATE"):
        decode_snapshot(bytes(data), SnapshotKind.OPERATOR_STATE)


def test_every_flipped_payload_byte_is_caught() -> None:
    data = encode_snapshot(SnapshotKind.OPERATOR_STATE, {"x": 1})
    for i in range(HEADER.size, len(data)):
        damaged = bytearray(data)
        damaged[i] ^= 0x40
        with pytest.raises(CorruptSnapshotError):
            decode_snapshot(bytes(damaged), SnapshotKind.OPERATOR_STATE)


def test_checksummed_payload_that_is_not_a_dict_or_not_pickle() -> None:
    with pytest.raises(CorruptSnapshotError, match="not a dict"):
        decode_snapshot(
            encode_envelope(SnapshotKind.KEYED_STATE, pickle.dumps([1, 2])),
            SnapshotKind.KEYED_STATE,
        )
    with pytest.raises(CorruptSnapshotError, match="does not unpickle"):
        decode_snapshot(
            encode_envelope(SnapshotKind.KEYED_STATE, b"garbage"), SnapshotKind.KEYED_STATE
        )


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_any_bytes_decode_or_raise_the_documented_error(data: bytes) -> None:
    with contextlib.suppress(CorruptSnapshotError):
        decode_snapshot(data, SnapshotKind.KEYED_STATE)
