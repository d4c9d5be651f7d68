# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""A deterministic key hash, compiled: the same in every process, every run, every host.

Python's ``hash`` of str/bytes is salted per process (PYTHONHASHSEED), so it can never
route records between processes. This hash is defined per key type:

* ``int`` in [-2**63, 2**63): Fibonacci hashing, the top 32 bits of
  ``(key mod 2**64) * 0x9E3779B97F4A7C15 mod 2**64`` (one multiplication: the hot path of
  integer-keyed shuffles, and well spread even for strided keys);
* otherwise CRC-32 (zlib's, the IEEE polynomial) over a canonical byte form of the key,
  finished with murmur3's 32-bit avalanche so the low bits (used for ``% n``) are well
  mixed:

  * ``bytes``/``bytearray``/``memoryview``: the bytes;
  * ``str``: its UTF-8 encoding (``surrogatepass``);
  * any other ``int``: its shortest little-endian two's complement of more than 8 bytes
    (msgpack cannot pack ints outside [-2**63, 2**64));
  * ``bool``, ``None``, ``float``, tuples, lists, ...: ``msgpack.packb(key)`` (tuples and
    lists of equal items hash equally).

The values are a format (routing and key groups must not change between versions):
``tests/writer/test_hashing.py`` pins them. The int path (``fib_hash``) is inline in
``hashing.pxd`` and ``c_hash`` is exported to the other compiled modules
(``exchange/writer/routing.pyx``). There is no Python version of this module.
"""

from cpython.bytearray cimport PyByteArray_AS_STRING, PyByteArray_GET_SIZE
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_GET_SIZE
from cpython.long cimport PyLong_AsLongLongAndOverflow
from cpython.unicode cimport PyUnicode_AsEncodedString

from exchange.writer.hashing cimport fib_hash

from zlib import crc32 as _crc32  # memoryview keys (any buffer shape): rare

import msgpack

__all__ = ["FIBONACCI_64", "deterministic_hash", "partition_for_key"]

cdef extern from "Python.h":
    bint PyUnicode_IS_ASCII(object o)
    void* PyUnicode_DATA(object o)
    Py_ssize_t PyUnicode_GET_LENGTH(object o)

#: 2**64 / golden ratio, odd: Knuth's multiplicative (Fibonacci) hashing constant.
FIBONACCI_64 = 0x9E3779B97F4A7C15
assert fib_hash(1) == FIBONACCI_64 >> 32

cdef object _packb = msgpack.packb

# CRC-32 (reflected 0xEDB88320U, zlib's), sliced by 4: the table is built once at import.
cdef unsigned int _CRC[4][256]


cdef void _crc_table() noexcept:
    cdef unsigned int c, i, j
    for i in range(256):
        c = i
        for j in range(8):
            c = (c >> 1) ^ (0xEDB88320U if c & 1 else 0)
        _CRC[0][i] = c
    for i in range(256):
        c = _CRC[0][i]
        for j in range(1, 4):
            c = _CRC[0][c & 0xFF] ^ (c >> 8)
            _CRC[j][i] = c


_crc_table()


cdef inline unsigned int _crc32_of(const unsigned char* p, Py_ssize_t n) noexcept nogil:
    cdef unsigned int c = 0xFFFFFFFFU
    while n >= 4:
        c ^= (<unsigned int>p[0]) | (<unsigned int>p[1] << 8) | (
            <unsigned int>p[2] << 16) | (<unsigned int>p[3] << 24)
        c = _CRC[3][c & 0xFF] ^ _CRC[2][(c >> 8) & 0xFF] ^ _CRC[1][(c >> 16) & 0xFF] ^ _CRC[0][c >> 24]
        p += 4
        n -= 4
    while n > 0:
        c = _CRC[0][(c ^ p[0]) & 0xFF] ^ (c >> 8)
        p += 1
        n -= 1
    return c ^ 0xFFFFFFFFU


cdef inline unsigned int _avalanche(unsigned int h) noexcept nogil:
    """murmur3's fmix32."""
    h ^= h >> 16
    h *= 0x85EBCA6BU
    h ^= h >> 13
    h *= 0xC2B2AE35U
    return h ^ (h >> 16)


cdef unsigned int c_hash(object key) except? 0xFFFFFFFFU:
    """deterministic_hash(key), as a C unsigned int."""
    cdef type t = type(key)
    cdef int overflow = 0
    cdef long long v
    cdef bytes raw
    if t is int:
        v = PyLong_AsLongLongAndOverflow(key, &overflow)
        if not overflow:
            return fib_hash(<unsigned long long>v)
        raw = key.to_bytes(key.bit_length() // 8 + 1, "little", signed=True)
    elif t is str:
        if PyUnicode_IS_ASCII(key):
            return _avalanche(_crc32_of(<const unsigned char*>PyUnicode_DATA(key),
                                        PyUnicode_GET_LENGTH(key)))
        raw = PyUnicode_AsEncodedString(key, "utf-8", "surrogatepass")
    elif t is bytes:
        raw = <bytes>key
    elif t is bytearray:
        return _avalanche(_crc32_of(<const unsigned char*>PyByteArray_AS_STRING(key),
                                    PyByteArray_GET_SIZE(key)))
    elif t is memoryview:
        return _avalanche(<unsigned int>_crc32(key))
    else:
        raw = _packb(key)
    return _avalanche(_crc32_of(<const unsigned char*>PyBytes_AS_STRING(raw),
                                PyBytes_GET_SIZE(raw)))


def deterministic_hash(key):
    """A 32-bit hash of ``key``, stable across processes, runs and platforms."""
    return c_hash(key)


def partition_for_key(key, num_partitions):
    """The subpartition a key goes to among ``num_partitions``."""
    return c_hash(key) % num_partitions
