"""A deterministic key hash: the same in every process, every run, every host.

Python's ``hash`` of str/bytes is salted per process (PYTHONHASHSEED), so it can never
route records between processes. This hash is CRC-32 over a canonical byte form of the
key, finished with murmur3's 32-bit avalanche so that the low bits (used for ``% n``) are
well mixed even for sequential integers:

* ``bytes``/``bytearray``/``memoryview``: the bytes;
* ``str``: its UTF-8 encoding;
* ``int`` in [-2**63, 2**63): 8 bytes little-endian two's complement; any other ``int``:
  its shortest little-endian two's complement of more than 8 bytes (msgpack cannot pack
  ints outside [-2**63, 2**64));
* ``bool``, ``None``, ``float``, tuples, lists, ...: ``msgpack.packb(key)``
  (tuples and lists of equal items hash equally).
"""

from __future__ import annotations

from typing import Any, Final
from zlib import crc32

import msgpack

__all__ = ["deterministic_hash", "partition_for_key"]

_M32: Final = 0xFFFFFFFF
_packb = msgpack.packb


def deterministic_hash(key: Any) -> int:
    """A 32-bit hash of ``key``, stable across processes, runs and platforms."""
    t = type(key)
    if t is str:
        h = crc32(key.encode("utf-8", "surrogatepass"))
    elif t is bytes or t is bytearray or t is memoryview:
        h = crc32(key)
    elif t is int:
        if -(2**63) <= key < 2**63:
            h = crc32(key.to_bytes(8, "little", signed=True))
        else:
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
