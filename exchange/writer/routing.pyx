# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""The record writer's routing loop, compiled: records into per-subpartition lists by key.

``RecordWriter.emit_all`` (exchange/writer/record_writer.py) hands ``route`` an iterator
and the subpartitions' pending lists a slice at a time; ``route`` takes up to ``limit``
records, each to ``lists[target]``, and the writer encodes full batches between slices.
Per record: the key (``record[0]``, or ``key_func(record)``), then

* with the deterministic hash (no ``partition_func``), an ``int`` key in [-2**63, 2**63)
  is hashed inline (one multiplication, ``hashing.pxd``'s ``fib_hash``);
* with a partition function registered by ``register_int_value_hash`` (Python's ``hash``,
  PySpark's ``portable_hash``: the int itself), an ``int`` key in [0, 2**61 - 1) goes
  to ``key % n`` inline, with no call;
* with a partition function registered by ``register_str_hash`` (PySpark's
  ``portable_hash``: Python's ``hash`` of a ``str`` or ``bytes`` when ``PYTHONHASHSEED``
  is set), a ``str``/``bytes`` key missing from the cache is hashed in C, with no call
  (without the variable set, the function is called: it raises its own error);
* any other key of exactly type ``int``, or ``str``/``bytes`` of at most ``KEY_CACHE_LEN``
  items, is looked up in the writer's key -> target cache (a dict, cleared when it holds
  ``KEY_CACHE`` keys), filled from ``hashing.c_hash(key) % n`` or
  ``partition_func(key) % n``; other keys (floats, tuples, bools, ...) are not cached:
  keys Python finds equal but the hash tells apart (1, True, 1.0) must not share an entry.

Errors are the project's ``NotAPairError`` for a record without ``[0]`` (naming it: a
tuple's item is taken directly, so only other records pay for the check), its
``UsageError`` for a partition function returning something else than an int, or the
interpreter's (a raising ``key_func`` or ``partition_func``, a key the hash cannot pack); the records routed before the failing one stay in the lists
(the writer counts them by the lists' growth). There is no Python version of this module.
"""

from cpython.dict cimport PyDict_Clear, PyDict_SetItem, PyDict_Size
from cpython.list cimport PyList_Append, PyList_GET_ITEM
from cpython.long cimport PyLong_AsLongLongAndOverflow, PyLong_AsSsize_t
from cpython.object cimport PyObject, PyObject_GetItem, PyObject_Hash
from cpython.tuple cimport PyTuple_GET_ITEM, PyTuple_GET_SIZE

from exchange.writer.hashing cimport c_hash, fib_hash

import os

from exchange.errors import NotAPairError, UsageError

__all__ = [
    "KEY_CACHE",
    "KEY_CACHE_LEN",
    "partition_of",
    "register_int_value_hash",
    "register_str_hash",
    "route",
]

cdef extern from "Python.h":
    PyObject* PyDict_GetItemWithError(object d, object k) except? NULL
    Py_ssize_t PyUnicode_GET_LENGTH(object o)

#: Keys a writer remembers across ``emit_all`` calls (the cache is cleared when full): a
#: str key's hash costs more than a dict lookup, and PySpark producers call ``emit_all``
#: per chunk of records.
KEY_CACHE = 1 << 17
#: Longest str/bytes key remembered.
KEY_CACHE_LEN = 64

cdef Py_ssize_t _KEY_CACHE = KEY_CACHE
cdef Py_ssize_t _KEY_CACHE_LEN = KEY_CACHE_LEN
cdef object _ZERO = 0
#: Python's hash of an int in [0, 2**61 - 1) is the int itself (the modulus is 2**61 - 1).
cdef long long _VALUE_BELOW = (1LL << 61) - 1
#: Partition functions known to return ``key`` itself for an int ``key`` in [0, 2**61 - 1).
cdef set _INT_VALUE_HASHES = {hash}
#: Partition function -> the environment variable that must be set for it to equal
#: Python's ``hash`` on ``str`` and ``bytes`` keys (None: always).
cdef dict _STR_HASHES = {hash: None}


def register_int_value_hash(func):
    """Declare that ``func(k) == k`` for every int ``k`` in [0, 2**61 - 1) (as Python's
    ``hash`` and PySpark's ``portable_hash`` are), so ``route`` sends those keys to
    ``k % n`` inline. Other keys still go through ``func``."""
    if not callable(func):
        raise UsageError(f"expected a partition function, got {func!r}")
    _INT_VALUE_HASHES.add(func)


def register_str_hash(func, str requires_env=None):
    """Declare that ``func(k) == hash(k)`` for every ``str`` and ``bytes`` key ``k`` (as
    PySpark's ``portable_hash`` is when ``PYTHONHASHSEED`` is set), provided the
    environment variable ``requires_env`` is set when ``route`` runs (None: always), so
    ``route`` hashes such keys in C on a cache miss. Other keys still go through
    ``func``."""
    if not callable(func):
        raise UsageError(f"expected a partition function, got {func!r}")
    _STR_HASHES[func] = requires_env


cdef object key_of(object record):
    """``record[0]``; a record without it is a ``NotAPairError`` naming it."""
    try:
        return PyObject_GetItem(record, _ZERO)
    except (TypeError, IndexError, KeyError) as e:
        raise NotAPairError.for_record(record) from e


cdef Py_ssize_t c_partition(object key, object partition_func, Py_ssize_t n) except -1:
    """``partition_func(key) % n``, the result checked to be an int (not a bool)."""
    p = partition_func(key)
    if not isinstance(p, int) or isinstance(p, bool):
        raise UsageError(f"partition function returned {p!r}, not an int")
    return PyLong_AsSsize_t(p % n)


def partition_of(key, partition_func, Py_ssize_t n):
    """The target of ``key`` among ``n``: ``partition_func(key) % n`` (checked), or the
    deterministic hash's when ``partition_func`` is None."""
    if partition_func is None:
        return <Py_ssize_t>(c_hash(key) % <unsigned long long>n)
    return c_partition(key, partition_func, n)


def route(it, list lists, object partition_func, object key_func, dict cache, Py_ssize_t limit):
    """Append up to ``limit`` records of the iterator ``it`` to ``lists[target]``; returns
    how many (fewer than ``limit``: ``it`` is exhausted)."""
    cdef Py_ssize_t n = len(lists)
    cdef Py_ssize_t taken = 0
    cdef Py_ssize_t target
    cdef bint hash_ints = partition_func is None
    cdef bint value_ints = not hash_ints and partition_func in _INT_VALUE_HASHES
    cdef bint cacheable
    cdef bint str_hash = False
    cdef Py_hash_t h
    cdef int overflow
    cdef long long v
    cdef type t
    cdef PyObject* cached
    cdef object record, key
    if n <= 0:
        raise UsageError("no subpartition to route to")
    if limit <= 0:
        return 0
    if not hash_ints and partition_func in _STR_HASHES:
        env = _STR_HASHES[partition_func]
        str_hash = env is None or env in os.environ
    for record in it:
        if key_func is None:
            if type(record) is tuple and PyTuple_GET_SIZE(record) > 0:
                key = <object>PyTuple_GET_ITEM(record, 0)
            else:
                key = key_of(record)
        else:
            key = key_func(record)
        t = type(key)
        if t is int and hash_ints:
            overflow = 0
            v = PyLong_AsLongLongAndOverflow(key, &overflow)
            if not overflow:
                target = <Py_ssize_t>(fib_hash(<unsigned long long>v) % <unsigned long long>n)
                PyList_Append(<object>PyList_GET_ITEM(lists, target), record)
                taken += 1
                if taken >= limit:
                    break
                continue
        elif t is int and value_ints:
            overflow = 0
            v = PyLong_AsLongLongAndOverflow(key, &overflow)
            if not overflow and 0 <= v < _VALUE_BELOW:
                PyList_Append(<object>PyList_GET_ITEM(lists, <Py_ssize_t>(v % n)), record)
                taken += 1
                if taken >= limit:
                    break
                continue
        if t is int:
            cacheable = True
        elif t is str:
            cacheable = PyUnicode_GET_LENGTH(key) <= _KEY_CACHE_LEN
        elif t is bytes:
            cacheable = len(<bytes>key) <= _KEY_CACHE_LEN
        else:
            cacheable = False
        cached = PyDict_GetItemWithError(cache, key) if cacheable else NULL
        if cached != NULL:
            target = PyLong_AsSsize_t(<object>cached)
        else:
            if hash_ints:
                target = <Py_ssize_t>(c_hash(key) % <unsigned long long>n)
            elif str_hash and (t is str or t is bytes):
                h = PyObject_Hash(key)
                target = <Py_ssize_t>(h % n)
                if target < 0:
                    target += n
            else:
                target = c_partition(key, partition_func, n)
            if cacheable:
                if PyDict_Size(cache) >= _KEY_CACHE:
                    PyDict_Clear(cache)
                PyDict_SetItem(cache, key, target)
        PyList_Append(<object>PyList_GET_ITEM(lists, target), record)
        taken += 1
        if taken >= limit:
            break
    return taken
