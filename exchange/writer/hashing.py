"""A deterministic key hash: the same in every process, every run, every host.

Python's ``hash`` of str/bytes is salted per process (PYTHONHASHSEED), so it can never
route records between processes. This hash is defined per key type:

* ``int`` in [-2**63, 2**63): Fibonacci hashing, the top 32 bits of
  ``(key mod 2**64) * 0x9E3779B97F4A7C15 mod 2**64`` (one multiplication: the hot path of
  integer-keyed shuffles, and well spread even for strided keys);
* otherwise CRC-32 over a canonical byte form of the key, finished with murmur3's 32-bit
  avalanche so the low bits (used for ``% n``) are well mixed:

  * ``bytes``/``bytearray``/``memoryview``: the bytes;
  * ``str``: its UTF-8 encoding;
  * any other ``int``: its shortest little-endian two's complement of more than 8 bytes
    (msgpack cannot pack ints outside [-2**63, 2**64));
  * ``bool``, ``None``, ``float``, tuples, lists, ...: ``msgpack.packb(key)`` (tuples and
    lists of equal items hash equally).
"""

from __future__ import annotations

from typing import Any, Final
from zlib import crc32

import msgpack

__all__ = ["FIBONACCI_64", "deterministic_hash", "partition_for_key"]

_M32: Final = 0xFFFFFFFF
_M64: Final = 0xFFFFFFFFFFFFFFFF
#: 2**64 / golden ratio, odd: Knuth's multiplicative (Fibonacci) hashing constant.
FIBONACCI_64: Final = 0x9E3779B97F4A7C15
_packb = msgpack.packb


def deterministic_hash(key: Any) -> int:
    """A 32-bit hash of ``key``, stable across processes, runs and platforms."""
    t = type(key)
    if t is int and -(2**63) <= key < 2**63:
        k: int = key
        return (((k & _M64) * FIBONACCI_64) & _M64) >> 32
    if t is str:
        h = crc32(key.encode("utf-8", "surrogatepass"))
    elif t is bytes or t is bytearray or t is memoryview:
        h = crc32(key)
    elif t is int:
        h = crc32(key.to_bytes(key.bit_length() // 8 + 1, "little", signed=True))
    else:
        h = crc32(_packb(key))
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & _M32
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & _M32
    return h ^ (h >> 16)


def partition_for_key(key: Any, num_partitions: int) -> int:
    """The subpartition a key goes to among ``num_partitions``."""
    return deterministic_hash(key) % num_partitions
