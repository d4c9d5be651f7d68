"""deterministic_hash: stable across processes and hash seeds, well spread modulo n."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from exchange.writer import deterministic_hash, partition_for_key

ROOT = Path(__file__).resolve().parents[2]

# Keys of every canonical form the hash knows; JSON-free so that the child rebuilds them.
KEYS_SOURCE = (
    "['', 'a', 'key-1', 'äöü€', 'x' * 1000, b'', b'\\x00\\xff', bytearray(b'ab'), 0, 1, -1, "
    "2**63 - 1, -(2**63), 2**63, 2**64 + 5, -(2**70), True, False, None, 1.5, -0.0, "
    "(1, 'a'), [1, 'a'], (), ('nested', (1, 2.5, None))]"
)

CHILD = (
    "import json\n"
    "from exchange.writer import deterministic_hash\n"
    f"keys = {KEYS_SOURCE}\n"
    "print(json.dumps([deterministic_hash(k) for k in keys] + [hash('salted?')]))\n"
)


def _hashes_in_child(seed: str) -> list[int]:
    env = dict(os.environ, PYTHONHASHSEED=seed, PYTHONPATH=str(ROOT))
    out = subprocess.run(
        [sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, check=True
    )
    values: list[int] = json.loads(out.stdout)
    return values


def test_same_values_in_two_processes_with_different_hash_seeds() -> None:
    first = _hashes_in_child("1")
    second = _hashes_in_child("4242")
    # the children really had different seeds: Python's own str hash differs
    assert first[-1] != second[-1]
    assert first[:-1] == second[:-1]
    keys: list[Any] = eval(KEYS_SOURCE)  # same literal as in the children
    assert first[:-1] == [deterministic_hash(k) for k in keys]


# Literal values recorded from the hash as released: routing (record -> subpartition) and
# key -> key group must not change between versions (a checkpoint written by one version
# is restored by the next; producers and consumers of two versions meet on one daemon).
# A change here is a format change: a conscious decision, never a side effect.
PINNED: list[tuple[Any, int, int]] = [
    # key, deterministic_hash(key), partition_for_key(key, 7)
    (0, 0, 0),
    (1, 2654435769, 6),
    (-1, 1640531526, 4),
    (2**63 - 1, 3788015174, 6),
    (-(2**63), 2147483648, 2),
    (2**64 + 5, 3181211724, 5),
    ("", 0, 0),
    ("a", 3320656311, 0),
    ("key-1", 3535270425, 1),
    ("äöü€", 918096813, 4),
    (b"", 0, 0),
    (b"\x00\xff", 2478230268, 3),
    (b"a", 3320656311, 0),
    ((), 3162064679, 4),
    ((1, "a"), 697850605, 4),
    (("nested", (1, 2.5, None)), 3921477781, 4),
    (1.5, 3365764450, 6),
    (-0.0, 2074920822, 2),
    (0.0, 3548277718, 6),
    (float("inf"), 2497837556, 4),
    (None, 1099703863, 6),
    (True, 2804848012, 1),
    (False, 2623431242, 5),
]


@pytest.mark.parametrize(("key", "hashed", "partition"), PINNED, ids=[repr(k) for k, *_ in PINNED])
def test_known_values_do_not_drift(key: Any, hashed: int, partition: int) -> None:
    assert deterministic_hash(key) == hashed
    assert partition_for_key(key, 7) == partition


def test_equal_keys_hash_equally() -> None:
    assert deterministic_hash((1, "a")) == deterministic_hash([1, "a"])
    assert deterministic_hash(b"xy") == deterministic_hash(bytearray(b"xy"))
    assert deterministic_hash(b"xy") == deterministic_hash(memoryview(b"xy"))
    assert deterministic_hash("xy") == deterministic_hash(b"xy")


@pytest.mark.parametrize(
    "keys",
    [range(100_000), [str(i) for i in range(100_000)]],
    ids=["ints", "strings"],
)
def test_uniform_modulo_8(keys: Any) -> None:
    counts = Counter(deterministic_hash(k) % 8 for k in keys)
    mean = 100_000 / 8
    assert sorted(counts) == list(range(8))
    for bucket, count in counts.items():
        assert abs(count - mean) <= 0.10 * mean, (bucket, count, counts)


def test_partition_for_key_is_hash_mod_n() -> None:
    for key in ("k", 7, (1, 2)):
        for n in (1, 3, 16):
            assert partition_for_key(key, n) == deterministic_hash(key) % n


@pytest.mark.parametrize("key", [2**63, 2**64 - 1, 2**64, 2**200, -(2**63) - 1, -(2**100)])
def test_ints_outside_64_bits_hash(key: int) -> None:
    # msgpack cannot pack ints outside [-2**63, 2**64): the hash must not depend on it
    h = deterministic_hash(key)
    assert 0 <= h < 2**32
    assert h == deterministic_hash(key)
    assert h != deterministic_hash(key + 1)


def _spec_hash(key: Any) -> int:
    """The hash as the module docstring defines it, written out in Python: the oracle the
    compiled ``deterministic_hash`` (exchange/writer/hashing.pyx) is checked against."""
    import zlib

    import msgpack

    t = type(key)
    if t is int and -(2**63) <= key < 2**63:
        return int((key % 2**64) * 0x9E3779B97F4A7C15 % 2**64) >> 32
    if t is str:
        h = zlib.crc32(key.encode("utf-8", "surrogatepass"))
    elif t in (bytes, bytearray, memoryview):
        h = zlib.crc32(key)
    elif t is int:
        h = zlib.crc32(key.to_bytes(key.bit_length() // 8 + 1, "little", signed=True))
    else:
        h = zlib.crc32(msgpack.packb(key))
    h ^= h >> 16
    h = h * 0x85EBCA6B & 0xFFFFFFFF
    h ^= h >> 13
    h = h * 0xC2B2AE35 & 0xFFFFFFFF
    return h ^ (h >> 16)


def _spec_keys() -> list[Any]:
    import random

    rng = random.Random(20)
    keys: list[Any] = []
    for bound in (2**63, 2**64):
        keys += [bound - 2, bound - 1, bound, bound + 1, -bound - 1, -bound, -bound + 1]
    keys += [rng.randrange(-(2**70), 2**70) for _ in range(2000)]
    keys += [rng.randrange(-(2**31), 2**31) for _ in range(2000)]
    # every length 0..100: the CRC's 4-byte steps and its tail
    for n in range(101):
        raw = rng.randbytes(n)
        keys += [raw, bytearray(raw), memoryview(raw), raw.decode("latin-1")]
        keys.append(
            "".join(
                chr(rng.choice([rng.randrange(32, 127), rng.randrange(0x80, 0x10FFFF)]))
                for _ in range(n)
            ).replace("\ud800", "x")
        )
    keys += ["\ud800", "a\udfffb", "é" * 70, "x" * 10_000, b"y" * 10_000]  # lone surrogates
    keys += [True, False, None, 0.1, -0.0, (1, "a"), [b"z", 2**63], {"k": 1}, ()]
    return keys


def test_the_compiled_hash_gives_the_defined_values_for_every_key_form() -> None:
    for key in _spec_keys():
        assert deterministic_hash(key) == _spec_hash(key), key


def test_bad_keys_raise_what_the_definition_raises() -> None:
    # a key msgpack cannot pack: its TypeError, unchanged
    with pytest.raises(TypeError, match="can not serialize 'object' object"):
        deterministic_hash(object())
    with pytest.raises(ZeroDivisionError):
        partition_for_key("k", 0)
