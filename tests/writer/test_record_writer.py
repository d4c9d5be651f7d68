"""The sans-I/O RecordWriter: routing, batching, cutting, flush policy, events, sizes.

No partition, no loop: records go in, buffers come out, and a decoder per subpartition
must give back exactly the records routed there, in order, whatever the buffer sizes.
"""

from __future__ import annotations

import datetime
import decimal
from typing import Any

import pytest

from exchange.errors import NotAPairError, RecordTooLargeError, UsageError, WriterClosedError
from exchange.events.events import (
    AbstractEvent,
    CancelCheckpointMarker,
    CheckpointBarrier,
    EventSerializer,
)
from exchange.serialization import (
    BytesCodec,
    MsgpackCodec,
    PickleBatchCodec,
    PickleCodec,
    default_codec,
)
from exchange.writer import (
    ALL_SUBPARTITIONS,
    BroadcastSelector,
    OutputBuffer,
    RecordWriter,
    RoundRobinSelector,
    deterministic_hash,
)
from exchange.writer.record_writer import MIN_BUFFER_SIZE
from exchange.writer.routing import register_int_value_hash, register_str_hash


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def decode(outs: list[OutputBuffer], n: int, codec: Any = None) -> list[list[Any]]:
    """Per subpartition: its records and events, in order (a broadcast buffer or event
    goes to every subpartition)."""
    codec = codec or default_codec()
    decoders = [codec.new_decoder() for _ in range(n)]
    got: list[list[Any]] = [[] for _ in range(n)]
    for out in outs:
        targets = range(n) if out.target == ALL_SUBPARTITIONS else [out.target]
        if out.is_event:
            event = EventSerializer.from_bytes(out.to_bytes())
            for t in targets:
                assert not decoders[t].has_partial_record, "an event inside a record"
                got[t].append(event)
            continue
        data = out.to_bytes()
        assert len(data) == out.size
        for t in targets:
            decoders[t].feed(memoryview(data))
            got[t].extend(decoders[t].take())
    for d in decoders:
        assert not d.has_partial_record
    return got


def by_hash(records: list[Any], n: int) -> list[list[Any]]:
    want: list[list[Any]] = [[] for _ in range(n)]
    for r in records:
        want[deterministic_hash(r[0]) % n].append(r)
    return want


RECORDS = [
    (i % 53, [i, f"v{i}"], datetime.date(2026, 1, 1 + i % 28), decimal.Decimal(i))
    for i in range(5000)
]


@pytest.mark.parametrize("n", [1, 3, 16])
@pytest.mark.parametrize("size", [MIN_BUFFER_SIZE, 4096, 32 * 1024])
def test_emit_all_routes_by_key_hash_and_round_trips_exactly(n: int, size: int) -> None:
    w = RecordWriter(n, buffer_size=size, buffer_timeout=-1)
    assert w.emit_all(RECORDS) == len(RECORDS)
    outs = w.close()
    assert all(o.size <= size for o in outs)
    assert decode(outs, n) == by_hash(RECORDS, n)
    assert w.stats.records_out == len(RECORDS)


def test_one_subpartition_takes_any_record_without_a_key_in_order() -> None:
    # the single-subpartition path routes nothing: records need no [0] (ints, None, sets)
    records: list[Any] = [*range(3000), None, {1, 2}, b"", *RECORDS[:2000]]
    w = RecordWriter(1, buffer_size=4096, buffer_timeout=-1)
    assert w.emit_all(iter(records)) == len(records)
    assert w.emit_all([]) == 0
    got = decode(w.close(), 1)[0]
    assert got == records and [type(r) for r in got] == [type(r) for r in records]
    assert w.stats.records_out == len(records)
    # a key function given is still called (and its errors still reach the caller)
    k = RecordWriter(1, buffer_size=4096, buffer_timeout=-1)
    with pytest.raises(TypeError):
        k.emit_all([1, 2], key_func=lambda r: r[0])


def test_emit_and_emit_all_agree_and_keys_of_equal_value_hash_apart() -> None:
    # ints at and beyond the inlined int hash's range [-2**63, 2**63), negative ones too
    edges = [-1, -7, -(2**63), -(2**63) - 1, 2**63 - 1, 2**63, 2**64, -(2**64)]
    keys: list[Any] = [1, True, 1.0, 0, False, 0.0, (1, 2), (True, 2), "1", b"1", 2**70, *edges]
    records = [(k, i) for i in range(5) for k in keys]
    a = RecordWriter(4, buffer_size=1024, buffer_timeout=-1)
    a.emit_all(records)
    b = RecordWriter(4, buffer_size=1024, buffer_timeout=-1)
    for r in records:
        b.emit(r)
    got_a, got_b = decode(a.close(), 4), decode(b.close(), 4)
    assert got_a == got_b == by_hash(records, 4)
    assert [[type(r[0]) for r in p] for p in got_a] == [[type(r[0]) for r in p] for p in got_b]


def test_partition_func_key_func_and_explicit_targets() -> None:
    w = RecordWriter(5, buffer_size=1024, buffer_timeout=-1)
    w.emit_all(
        [{"id": i} for i in range(50)], partition_func=lambda k: k * 2, key_func=lambda r: r["id"]
    )
    w.emit_to(("direct",), 4)
    w.emit(("keyed", 1), key="k")
    got = decode(w.close(), 5)
    for t in range(5):
        want: list[Any] = [{"id": i} for i in range(50) if (i * 2) % 5 == t]
        if t == 4:
            want.append(("direct",))
        if deterministic_hash("k") % 5 == t:
            want.append(("keyed", 1))
        assert got[t] == want


def test_remembered_targets_follow_the_partition_function_of_each_call() -> None:
    # the writer remembers key -> target across emit_all calls, per partition function
    keys: list[Any] = ["a", "b", b"c", 7, 2**70, "x" * 100]
    w = RecordWriter(3, buffer_size=1024, buffer_timeout=-1)
    w.emit_all([(k, 0) for k in keys])
    w.emit_all([(k, 1) for k in keys], partition_func=lambda k: 0)
    w.emit_all([(k, 2) for k in keys])
    w.emit_all([(k, 3) for k in keys], partition_func=lambda k: 2)
    got = decode(w.close(), 3)
    by_key = [deterministic_hash(k) % 3 for k in keys]
    for t in range(3):
        want = [(k, 0) for k, h in zip(keys, by_key, strict=True) if h == t]
        want += [(k, 1) for k in keys] if t == 0 else []
        want += [(k, 2) for k, h in zip(keys, by_key, strict=True) if h == t]
        want += [(k, 3) for k in keys] if t == 2 else []
        assert got[t] == want


def test_bad_routing_is_a_usage_error_and_the_writer_goes_on() -> None:
    w = RecordWriter(2, buffer_size=1024, buffer_timeout=-1)
    with pytest.raises(UsageError, match="not an int"):
        w.emit_all([("a", 1)], partition_func=lambda k: "zero")  # type: ignore[arg-type,return-value]
    for bad in (-1, 2, True, "0"):
        with pytest.raises(UsageError, match="out of range"):
            w.emit_to(("x",), bad)  # type: ignore[arg-type]
    w.emit_to(("ok",), 1)
    assert decode(w.close(), 2) == [[], [("ok",)]]


# -- the compiled routing loop (exchange/writer/routing.pyx) ----------------------------------

MIXED_KEYS: list[Any] = [
    *range(-3, 40),
    2**63 - 1,
    -(2**63),
    2**63,
    -(2**63) - 1,
    2**64 + 5,
    -(2**90),  # inline / cached / big
    True,
    False,
    1.0,
    0.0,
    None,
    (1, "a"),
    (),
    [1],  # equal to ints in Python, not here
    "",
    "a",
    "é€",
    "k" * 64,
    "k" * 65,
    "\ud800",  # cached up to 64 characters
    b"",
    b"a",
    b"b" * 64,
    b"b" * 65,
    bytearray(b"ab"),
]


def mixed_records(count: int) -> list[Any]:
    return [(MIXED_KEYS[i % len(MIXED_KEYS)], i) for i in range(count)]


@pytest.mark.parametrize("n", [2, 7])
def test_emit_all_routes_every_key_form_as_the_hash_says_over_several_slices(n: int) -> None:
    records = mixed_records(7000)  # > 3 slices of 2048, keys seen again (cache hits)
    w = RecordWriter(n, buffer_size=1024, buffer_timeout=-1)
    assert w.emit_all(records[:10]) == 10  # a first call fills the cache
    assert w.emit_all(iter(records[10:])) == len(records) - 10
    assert w.stats.records_out == len(records)
    assert decode(w.close(), n) == by_hash(records, n)


def test_emit_all_takes_any_record_with_an_item_0_and_any_key_func() -> None:
    lists = [[k, "v"] for k in MIXED_KEYS]
    dicts = [{"id": k} for k in MIXED_KEYS]
    w = RecordWriter(5, buffer_size=1024, buffer_timeout=-1)
    w.emit_all(lists)
    w.emit_all(dicts, key_func=lambda r: r["id"])
    got = decode(w.close(), 5)
    for t in range(5):
        assert got[t] == [r for r in lists if deterministic_hash(r[0]) % 5 == t] + [
            r for r in dicts if deterministic_hash(r["id"]) % 5 == t
        ]


def test_a_partition_functions_result_is_taken_modulo_n_as_python_does() -> None:
    values = [-1, -8, 7, 2**70, -(2**70) - 3]
    records = [(k, i) for i, k in enumerate(MIXED_KEYS * 3)]
    w = RecordWriter(3, buffer_size=1024, buffer_timeout=-1)
    w.emit_all(records, partition_func=lambda k: values[MIXED_KEYS.index(k) % len(values)])
    got = decode(w.close(), 3)
    want: list[list[Any]] = [[], [], []]
    for r in records:
        want[values[MIXED_KEYS.index(r[0]) % len(values)] % 3].append(r)
    assert got == want


def test_the_key_cache_stays_bounded_and_routes_right_after_it_was_cleared() -> None:
    from exchange.writer.routing import KEY_CACHE

    calls = 0

    def partition(k: int) -> int:
        nonlocal calls
        calls += 1
        return k

    w = RecordWriter(4, buffer_size=32 * 1024, buffer_timeout=-1)
    keys = range(KEY_CACHE + 100)
    w.emit_all(((k,) for k in keys), partition_func=partition)
    assert calls == len(keys)
    w.emit_all([(k,) for k in keys[-50:]], partition_func=partition)
    assert calls == len(keys)  # remembered since the cache was cleared
    got = decode(w.close(), 4)
    assert [len(p) for p in got] == [
        sum(1 for k in keys if k % 4 == t) + sum(1 for k in keys[-50:] if k % 4 == t)
        for t in range(4)
    ]


def _raising_source(records: list[Any], at: int) -> Any:
    yield from records[:at]
    raise RuntimeError("the input failed")


# A bad record at index 3000 (the second slice): (records, emit_all kwargs, error, message)
BAD_ROUTING: dict[str, tuple[Any, dict[str, Any], type[BaseException], str]] = {
    "no-item-0": ([42], {}, NotAPairError, str(NotAPairError.for_record(42))),
    "empty-tuple": ([()], {}, NotAPairError, str(NotAPairError.for_record(()))),
    "unhashable-key": ([(object(),)], {}, TypeError, "can not serialize 'object' object"),
    "key-func-raises": (
        [("boom",)],
        {"key_func": lambda r: r[0] if r[0] != "boom" else int(r[0])},
        ValueError,
        "invalid literal for int() with base 10: 'boom'",
    ),
    "partition-str": (
        [("x",)],
        {"partition_func": lambda k: k if isinstance(k, int) else "zero"},
        UsageError,
        "partition function returned 'zero', not an int",
    ),
    "partition-bool": (
        [("x",)],
        {"partition_func": lambda k: k if isinstance(k, int) else True},
        UsageError,
        "partition function returned True, not an int",
    ),
}


@pytest.mark.parametrize("case", [*BAD_ROUTING, "input-raises"])
def test_a_bad_record_fails_with_its_error_after_counting_and_flushing_the_ones_before(
    case: str,
) -> None:
    clock = Clock()
    w = RecordWriter(3, buffer_size=1024, buffer_timeout=0.05, clock=clock)
    good = [(i, "v") for i in range(3000)]
    w.emit_to((-1, "first"), 0)
    clock.now += 1  # the flush is due: the failing call must still flush what it routed
    source: Any
    kwargs: dict[str, Any]
    error: type[BaseException]
    if case == "input-raises":
        source = _raising_source(good, 3000)
        kwargs, error, message = {}, RuntimeError, "the input failed"
    else:
        bad, kwargs, error, message = BAD_ROUTING[case]
        source = [*good, *bad, (5000, "never")]
    with pytest.raises(error) as info:
        w.emit_all(source, **kwargs)
    assert str(info.value) == message
    assert w.stats.records_out == 1 + len(good)
    assert not w.pending_records and w.next_flush_deadline is None  # flushed, by the timer
    got = decode(w.take_output(), 3)
    want = [[(-1, "first")], [], []]
    for r in good:
        target = (
            kwargs["partition_func"](r[0]) % 3
            if "partition_func" in kwargs
            else (deterministic_hash(r[0]) % 3)
        )
        want[target].append(r)
    assert got == want
    w.emit_all([(7, "after")])  # the writer goes on
    assert decode(w.close(), 3)[deterministic_hash(7) % 3] == [(7, "after")]


def test_a_hash_that_is_the_int_itself_routes_ints_inline_to_the_same_place() -> None:
    # Python's hash is registered: ints in [0, 2**61 - 1) go inline to key % n, the rest
    # through the function; each lands where hash(key) % n says (negative: -1 hashes to -2)
    edges = [0, 1, 6, -1, -2, -7, 2**61 - 2, 2**61 - 1, 2**61, 2**64 + 3, -(2**61), 10**15]
    records: list[Any] = [(k, i) for i in range(3) for k in [*edges, *range(200)]] + [("s", 0)]
    w = RecordWriter(7, buffer_size=1024, buffer_timeout=-1)
    w.emit_all(records, partition_func=hash)
    want: list[list[Any]] = [[] for _ in range(7)]
    for r in records:
        want[hash(r[0]) % 7].append(r)
    assert decode(w.close(), 7) == want

    calls: list[Any] = []

    def doubling(k: Any) -> int:
        calls.append(k)
        return 2 * k if isinstance(k, int) else 0

    w = RecordWriter(3, buffer_size=1024, buffer_timeout=-1)
    w.emit_all([(1, "a")], partition_func=doubling)  # not registered: called
    assert calls == [1] and decode(w.close(), 3) == [[], [], [(1, "a")]]
    with pytest.raises(UsageError):
        register_int_value_hash(3)  # type: ignore[arg-type]


@pytest.mark.parametrize("size", [MIN_BUFFER_SIZE, 32 * 1024])
def test_int_pairs_leave_as_packed_frames_and_come_back_exactly(size: int) -> None:
    """Batches of ``(int, int)`` go as the codec's packed frames (8 bytes a record when
    both fit in 32 bits), a batch holding any other record as a pickle; either way each
    subpartition gets back exactly its records, in order."""
    records: list[Any] = [(i * 2654435761 % 1_000_003, i) for i in range(20_000)]
    records[15_000:15_000] = [(True, 1), (2**63, 2), (1, None), (-(2**63), 2**63 - 1)]
    w = RecordWriter(8, buffer_size=size, buffer_timeout=-1)
    assert w.emit_all(records, partition_func=hash) == len(records)
    outs = w.close()
    want: list[list[Any]] = [[] for _ in range(8)]
    for r in records:
        want[hash(r[0]) % 8].append(r)
    got = decode(outs, 8)
    assert got == want
    assert [[type(x) for r in sub for x in r] for sub in got] == [
        [type(x) for r in sub for x in r] for sub in want
    ]
    assert w.mean_record_size == 8


@pytest.mark.parametrize("timeout", [-1, 0])
@pytest.mark.parametrize("bad", [7, None, (), "", {"a": 1}])
def test_a_record_without_a_key_is_a_not_a_pair_error_naming_it(timeout: int, bad: Any) -> None:
    w = RecordWriter(3, buffer_size=1024, buffer_timeout=timeout)
    good = [(i, i) for i in range(100)]
    with pytest.raises(NotAPairError) as excinfo:
        w.emit_all([*good, bad, (1, 1)])
    assert f"record {bad!r} of type {type(bad).__name__} is not a (key, value) pair" in str(
        excinfo.value
    )
    assert isinstance(excinfo.value, TypeError)  # what unpacking it would raise
    with pytest.raises(NotAPairError):
        w.emit(bad)
    # the records before it were taken; the writer goes on
    w.emit_all([(5, 5)])
    assert sorted(r for p in decode(w.close(), 3) for r in p) == sorted([*good, (5, 5)])


def test_a_type_error_of_the_input_or_the_partition_function_stays_what_it_was() -> None:
    def failing_input() -> Any:
        yield (1, 1)
        raise TypeError("the input's own")

    w = RecordWriter(3, buffer_size=1024, buffer_timeout=-1)
    with pytest.raises(TypeError, match="the input's own") as excinfo:
        w.emit_all(failing_input())
    assert not isinstance(excinfo.value, NotAPairError)
    with pytest.raises(TypeError, match="unhashable") as excinfo:
        w.emit_all([([1], 1)], partition_func=hash)
    assert not isinstance(excinfo.value, NotAPairError)
    w.close()


@pytest.mark.parametrize(
    "kwargs",
    [
        {"num_subpartitions": 0},
        {"num_subpartitions": True},
        {"buffer_size": MIN_BUFFER_SIZE - 1},
        {"buffer_timeout": -2},
        {"buffer_timeout": "1"},
    ],
)
def test_constructor_refuses_bad_values(kwargs: dict[str, Any]) -> None:
    args: dict[str, Any] = {"num_subpartitions": 2, "buffer_size": 1024} | kwargs
    n = args.pop("num_subpartitions")
    with pytest.raises(UsageError):
        RecordWriter(n, **args)


def test_records_larger_than_a_buffer_span_several_and_leave_at_once() -> None:
    w = RecordWriter(2, buffer_size=1024, buffer_timeout=-1)
    big = (0, b"\x07" * 100_000)
    w.emit_to(big, 0)
    w.emit_to((1, "small"), 0)
    w.flush()
    outs = w.take_output()
    assert sum(o.size for o in outs) > 100_000
    assert all(o.size <= 1024 for o in outs)
    assert decode(outs, 2) == [[big, (1, "small")], []]


def test_a_record_above_the_codec_limit_is_refused_typed() -> None:
    w = RecordWriter(1, buffer_size=1024, codec=MsgpackCodec(max_record_size=1000))
    with pytest.raises(RecordTooLargeError):
        w.emit_to((0, b"x" * 2000), 0)
        w.flush()


def emit_each(w: RecordWriter, records: list[Any], target: int | None = None) -> int:
    """Emit ``records`` one at a time (by key, or to ``target``, or broadcast when
    ``target`` is ALL_SUBPARTITIONS); returns how many RecordTooLargeErrors surfaced."""
    errors = 0
    for r in records:
        try:
            if target is None:
                w.emit(r)
            elif target == ALL_SUBPARTITIONS:
                w.broadcast(r)
            else:
                w.emit_to(r, target)
        except RecordTooLargeError:
            errors += 1
    return errors


LIMITED = [
    pytest.param(MsgpackCodec(tuples=True, max_record_size=300), id="msgpack"),
    pytest.param(PickleBatchCodec(max_record_size=300), id="pickle-batch"),
    pytest.param(PickleCodec(max_record_size=300), id="pickle"),
]
BIG = (0, "x" * 400)


@pytest.mark.parametrize("codec", LIMITED)
def test_records_over_the_limit_are_refused_alone_and_the_batch_keeps_the_others(
    codec: Any,
) -> None:
    w = RecordWriter(1, buffer_size=1024, codec=codec, buffer_timeout=-1)
    records = [(i, f"r{i}") for i in range(30)]
    emitted = [*records[:7], BIG, *records[7:20], BIG, BIG, *records[20:]]
    errors = emit_each(w, emitted, 0)
    try:
        w.flush()
    except RecordTooLargeError:
        errors += 1
    assert errors >= 1  # one per batch that held any
    w.emit_to((99, "after"), 0)
    assert decode(w.close(), 1, codec) == [[*records, (99, "after")]]
    assert w.stats.records_out == w.stats.encoded_records == len(records) + 1


@pytest.mark.parametrize("codec", LIMITED)
def test_a_refused_record_in_emit_all_keeps_every_other_record_of_every_subpartition(
    codec: Any,
) -> None:
    w = RecordWriter(3, buffer_size=MIN_BUFFER_SIZE, codec=codec, buffer_timeout=-1)
    records = [(i, f"{i:020d}") for i in range(200)]
    with pytest.raises(RecordTooLargeError) as info:
        w.emit_all([*records[:100], BIG, *records[100:]])
    assert info.value.limit == 300 < info.value.size
    # the error surfaced mid-call: the records routed so far are pending, counted and
    # flushed by the next flush; the call's remaining records are the caller's to emit
    routed = w.stats.records_out
    assert 100 <= routed <= 200
    got = decode(w.close(), 3, codec)
    assert sorted(r for p in got for r in p) == records[:routed]
    assert got == by_hash(records[:routed], 3)


@pytest.mark.parametrize("codec", LIMITED)
def test_a_refused_broadcast_record_keeps_the_others_on_every_subpartition(codec: Any) -> None:
    w = RecordWriter(2, buffer_size=1024, codec=codec, buffer_timeout=-1)
    records = [(i, "all") for i in range(10)]
    errors = emit_each(w, [*records[:3], BIG, *records[3:]], ALL_SUBPARTITIONS)
    w.emit_to((0, "one"), 1)  # ends the broadcast: encodes what is pending
    assert errors == 1
    assert decode(w.close(), 2, codec) == [records, [*records, (0, "one")]]


class _BatchLimitedEncoder:
    """A codec whose batches have a limit of their own (a user's codec): no single record
    is over it, only the whole batch."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.max_record_size = inner.max_record_size

    def encode_batch(self, records: list[Any]) -> bytes | bytearray:
        if len(records) > 2:
            raise RecordTooLargeError(len(records), 2)
        chunk: bytes | bytearray = self._inner.encode_batch(records)
        return chunk


class _BatchLimitedCodec(BytesCodec):
    def new_encoder(self) -> Any:
        return _BatchLimitedEncoder(super().new_encoder())


def test_a_batch_over_a_codecs_batch_limit_loses_no_record_and_refuses_none() -> None:
    codec = _BatchLimitedCodec()
    w = RecordWriter(1, buffer_size=1024, codec=codec, buffer_timeout=-1)
    records = [b"r%d" % i for i in range(10)]
    assert emit_each(w, records, 0) == 0
    assert decode(w.close(), 1, codec) == [records]


def test_cut_buffers_are_slices_of_the_encoded_chunks_not_copies() -> None:
    w = RecordWriter(1, buffer_size=MIN_BUFFER_SIZE, buffer_timeout=-1)
    w.emit_all([(i, f"{i:040d}") for i in range(100)])
    outs = w.close()
    pieces = [p for o in outs for p in o.pieces]
    assert pieces and all(isinstance(p, memoryview) for p in pieces)
    bases = {id(p.obj) for p in pieces if isinstance(p, memoryview)}
    assert len(bases) < len(pieces)  # several buffers cut from one encoded batch


# -- flushing -----------------------------------------------------------------------------


def test_buffer_timeout_minus_one_cuts_only_full_buffers() -> None:
    w = RecordWriter(1, buffer_size=1024, buffer_timeout=-1)
    w.emit(("lone", 0))
    assert not w.has_output and w.next_flush_deadline is None
    assert not w.flush_if_due(10**9)
    w.emit_all([("r", i, f"{i:0100d}") for i in range(100)])  # ~12 KiB
    full = w.take_output()
    assert full and all(o.size == 1024 for o in full)
    w.flush()
    assert 0 < sum(o.size for o in w.take_output()) < 1024 * 2


def test_buffer_timeout_zero_flushes_every_record() -> None:
    w = RecordWriter(3, buffer_size=1024, buffer_timeout=0)
    for i in range(5):
        w.emit_to((i,), i % 3)
        outs = w.take_output()
        assert [o.target for o in outs] == [i % 3]
        assert decode(outs, 3)[i % 3] == [(i,)]


def test_buffer_timeout_flushes_when_due_by_the_injected_clock() -> None:
    clock = Clock()
    w = RecordWriter(2, buffer_size=1024, buffer_timeout=0.05, clock=clock)
    w.emit_to(("a",), 0)
    assert not w.has_output
    assert w.next_flush_deadline == pytest.approx(100.05)
    assert not w.flush_if_due(100.04)
    assert w.flush_if_due(100.05)
    assert decode(w.take_output(), 2) == [[("a",)], []]
    assert not w.flush_if_due(200.0)  # nothing pending: no empty flush
    clock.now = 100.2
    w.emit_to(("b",), 1)  # late: the record itself triggers the flush as it arrives
    assert decode(w.take_output(), 2) == [[], [("b",)]]


# -- broadcast and events -------------------------------------------------------------------


def test_broadcast_is_encoded_once_into_shared_buffers_in_order() -> None:
    w = RecordWriter(3, buffer_size=1024, buffer_timeout=-1)
    w.emit_to(("before", 0), 0)
    w.emit_to(("before", 2), 2)
    w.broadcast(("all", {1, 2}))
    w.emit_to(("after", 1), 1)
    outs = w.close()
    shared = [o for o in outs if o.target == ALL_SUBPARTITIONS and not o.is_event]
    assert len(shared) == 1
    assert decode(outs, 3) == [
        [("before", 0), ("all", {1, 2})],
        [("all", {1, 2}), ("after", 1)],
        [("before", 2), ("all", {1, 2})],
    ]


def test_broadcast_selector_sends_every_record_to_every_subpartition() -> None:
    w = RecordWriter(4, buffer_size=512, selector=BroadcastSelector(), buffer_timeout=-1)
    records = [(i, f"{i:0100d}") for i in range(40)]
    w.emit_all(records)
    outs = w.close()
    assert all(o.target == ALL_SUBPARTITIONS for o in outs)
    assert decode(outs, 4) == [records] * 4


def test_round_robin_selector() -> None:
    w = RecordWriter(3, buffer_size=1024, selector=RoundRobinSelector(), buffer_timeout=-1)
    w.emit_all([(i,) for i in range(9)])
    got = decode(w.close(), 3)
    assert sorted(len(p) for p in got) == [3, 3, 3]
    assert sorted(r for p in got for r in p) == [(i,) for i in range(9)]


def test_events_leave_after_every_record_before_them_on_every_subpartition() -> None:
    w = RecordWriter(2, buffer_size=4096, buffer_timeout=-1)
    w.emit_all([(i, i) for i in range(10)])
    barrier = w.broadcast_barrier(7, 1234, aligned=True)
    w.emit_all([(i, -i) for i in range(10)])
    w.broadcast_cancel(7)
    got = decode(w.close(), 2)
    for t in range(2):
        before = [r for r in by_hash([(i, i) for i in range(10)], 2)[t]]
        after = [r for r in by_hash([(i, -i) for i in range(10)], 2)[t]]
        assert got[t] == [*before, barrier, *after, CancelCheckpointMarker(7)]
    assert isinstance(barrier, CheckpointBarrier) and barrier.options.exactly_once


def test_an_aligned_barrier_travels_as_the_blocking_data_type() -> None:
    w = RecordWriter(1, buffer_size=1024, buffer_timeout=-1)
    w.broadcast_barrier(1, 0, aligned=True)
    w.broadcast_barrier(2, 0, aligned=False)
    aligned, unaligned = w.take_output()
    assert aligned.data_type.is_blocking_upstream
    assert not unaligned.data_type.is_blocking_upstream


# -- buffer sizes (debloating) --------------------------------------------------------------


def test_new_buffer_size_applies_to_new_buffers_and_is_clamped() -> None:
    w = RecordWriter(2, buffer_size=4096, buffer_timeout=-1)
    w.set_buffer_size(0, 1000)
    w.set_buffer_size(1, 10)  # below the minimum
    assert w.buffer_size(0) == 1000 and w.buffer_size(1) == MIN_BUFFER_SIZE
    w.set_buffer_size(0, 10**9)
    assert w.buffer_size(0) == 4096
    w.set_buffer_size(0, 1000)
    records = [(i, f"{i:0200d}") for i in range(200)]
    w.emit_all(records)
    outs = w.close()
    for o in outs:
        assert o.size <= (1000 if o.target == 0 else MIN_BUFFER_SIZE)
    assert decode(outs, 2) == by_hash(records, 2)
    with pytest.raises(UsageError):
        w.set_buffer_size(0, 0)


def test_broadcast_buffers_use_the_smallest_subpartition_size() -> None:
    w = RecordWriter(3, buffer_size=4096, buffer_timeout=-1)
    w.set_buffer_size(1, 600)
    w.emit_all([(i, f"{i:0300d}") for i in range(50)], key_func=lambda r: 0)
    for i in range(20):
        w.broadcast((i, f"{i:0300d}"))
    outs = w.close()
    assert all(o.size <= 600 for o in outs if o.target == ALL_SUBPARTITIONS)


# -- closing ---------------------------------------------------------------------------------


def test_close_returns_the_last_buffers_and_everything_after_is_refused() -> None:
    w = RecordWriter(1, buffer_size=1024)
    w.emit(("x", 1))
    assert decode(w.close(), 1) == [[("x", 1)]]
    assert w.is_closed
    for call in (
        lambda: w.emit(("y",)),
        lambda: w.emit_all([("y",)]),
        lambda: w.broadcast(("y",)),
        lambda: w.broadcast_event(CancelCheckpointMarker(1)),
        w.close,
    ):
        with pytest.raises(WriterClosedError):
            call()


def test_discard_drops_everything_pending() -> None:
    w = RecordWriter(2, buffer_size=1024, buffer_timeout=-1)
    w.emit_all([(i, i) for i in range(1000)])
    w.broadcast(("b",))
    w.discard()
    assert w.is_closed and not w.has_output
    assert w.pending_bytes == 0 and w.pending_records == 0


def test_user_event_types_pass_through() -> None:
    from dataclasses import dataclass

    from exchange.events.events import register_event_type

    @dataclass(frozen=True)
    class Watermark(AbstractEvent):
        ts: int

    register_event_type(200, Watermark, lambda e: e.ts, lambda v: Watermark(v))
    w = RecordWriter(2, buffer_size=1024, buffer_timeout=-1)
    w.emit_to((1,), 0)
    w.broadcast_event(Watermark(5))
    assert decode(w.close(), 2) == [[(1,), Watermark(5)], [Watermark(5)]]


def test_a_hash_that_is_python_s_on_strings_hashes_them_in_c_only_with_its_variable_set(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # a function registered as Python's hash on str/bytes keys (PySpark's portable_hash
    # with PYTHONHASHSEED set) is not called for them while its variable is set, and each
    # key lands where hash(key) % n says (negative hashes included); without the variable
    # it is called for every key it is asked about (portable_hash raises its own error)
    calls: list[Any] = []

    def str_hash(k: Any) -> int:
        calls.append(k)
        return hash(k)

    register_str_hash(str_hash, "EXCHANGE_TEST_STR_HASH")
    keys: list[Any] = [f"user-{i}" for i in range(300)] + [b"k%d" % i for i in range(100)]
    assert any(hash(k) < 0 for k in keys)
    records = [(k, i) for i, k in enumerate([*keys, 12, 2.5, None, ("t", 1)])]
    want: list[list[Any]] = [[] for _ in range(7)]
    for r in records:
        want[hash(r[0]) % 7].append(r)

    monkeypatch.setenv("EXCHANGE_TEST_STR_HASH", "0")
    w = RecordWriter(7, buffer_size=1024, buffer_timeout=-1)
    w.emit_all(records, partition_func=str_hash)
    assert decode(w.close(), 7) == want
    assert calls == [12, 2.5, None, ("t", 1)]  # the other keys still call it

    calls.clear()
    monkeypatch.delenv("EXCHANGE_TEST_STR_HASH")
    w = RecordWriter(7, buffer_size=1024, buffer_timeout=-1)
    w.emit_all(records, partition_func=str_hash)
    assert decode(w.close(), 7) == want
    assert calls == [r[0] for r in records]
    with pytest.raises(UsageError):
        register_str_hash("not a function")  # type: ignore[arg-type]
