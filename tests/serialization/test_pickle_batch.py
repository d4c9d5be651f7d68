"""PickleBatchCodec: exact Python values, batches per frame, fed in any pieces, fed garbage."""

from __future__ import annotations

import collections
import datetime as dt
import itertools
import math
import pickle
import struct
import threading
import zoneinfo
from decimal import Decimal
from typing import Any, NamedTuple

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pyspark.sql import Row

from exchange.errors import CorruptRecordError, RecordTooLargeError, UsageError
from exchange.serialization import PickleBatchCodec, default_codec

MiB = 1024 * 1024
LEN = struct.Struct(">I")

Point = collections.namedtuple("Point", ["x", "y"])


class Pair(NamedTuple):
    left: Any
    right: int = 0


class Money:
    """A user class with value equality."""

    def __init__(self, amount: Decimal, currency: str) -> None:
        self.amount = amount
        self.currency = currency

    def __eq__(self, other: object) -> bool:
        return (
            type(other) is Money and self.amount == other.amount and self.currency == other.currency
        )

    def __hash__(self) -> int:
        return hash((self.amount, self.currency))


BERLIN = zoneinfo.ZoneInfo("Europe/Berlin")
PLUS_5_30 = dt.timezone(dt.timedelta(hours=5, minutes=30))

SAMPLES: list[Any] = [
    (1, 2),
    [1, 2],
    (),
    [],
    "",
    b"",
    None,
    True,
    False,
    1,
    0,
    [True, 1, False, 0, 1.0],
    Row(name="Ann", age=31, tags=["a", "b"]),
    Row("x", "y")(1, [2]),  # a Row class: fields from the class
    Point(1, [2, 3]),
    Pair("l", 5),
    Pair((1,)),
    dt.datetime(2024, 3, 31, 2, 30),
    dt.datetime(2024, 3, 31, 3, 30, tzinfo=BERLIN),
    dt.datetime(2024, 10, 27, 2, 30, fold=1, tzinfo=BERLIN),
    dt.datetime(2000, 1, 1, tzinfo=dt.UTC),
    dt.datetime(2000, 1, 1, 12, tzinfo=PLUS_5_30),
    dt.date(1970, 1, 1),
    dt.time(23, 59, 59, 999_999),
    dt.time(8, 0, tzinfo=PLUS_5_30),
    dt.timedelta(days=-1, microseconds=3),
    Decimal("1.50"),
    Decimal("-0"),
    Decimal("NaN"),
    Decimal("1E+1000"),
    {1, 2, "three"},
    frozenset({(1, 2), frozenset({3})}),
    set(),
    b"\x00\xff" * 10,
    bytearray(b"mutable"),
    2**100,
    -(2**70),
    2**64,
    -(2**63) - 1,
    float("nan"),
    float("inf"),
    float("-inf"),
    -0.0,
    1e-310,
    complex(1, -2),
    {"k": [1, (2, [3, {4: {5}}])], 2: (Decimal(1), dt.date(2020, 2, 29))},
    {(1, 2): "tuple key", 1: "int key", False: "bool key", 0.5: "float key"},
    [[[[[]]]]],
    Money(Decimal("9.99"), "EUR"),
    [Money(Decimal("0"), "USD"), Row(m=Money(Decimal("1"), "JPY"))],
    "ünïcødé \U0001f600",
    range(3),
]


def assert_exact(got: Any, want: Any, path: str = "record") -> None:
    """``got`` equals ``want`` and has its type, recursively (NaN equals NaN)."""
    assert type(got) is type(want), f"{path}: {type(got).__name__} != {type(want).__name__}"
    if isinstance(want, float) and math.isnan(want):
        assert math.isnan(got), f"{path}: {got!r} is not NaN"
        return
    if isinstance(want, float):
        assert got == want and math.copysign(1, got) == math.copysign(1, want), path
        return
    if isinstance(want, Decimal):
        assert got.as_tuple() == want.as_tuple(), f"{path}: {got} != {want}"
        return
    if isinstance(want, dt.datetime | dt.time):
        # Aware datetimes compare as instants: check the wall time, zone and fold too.
        assert got.replace(tzinfo=None) == want.replace(tzinfo=None), path
        assert got.tzinfo == want.tzinfo and got.fold == want.fold, path
        assert got.utcoffset() == want.utcoffset(), path
        return
    if isinstance(want, tuple | list):
        assert len(got) == len(want), f"{path}: length {len(got)} != {len(want)}"
        if isinstance(want, Row):
            fields = getattr(want, "__fields__", None)
            assert getattr(got, "__fields__", None) == fields, f"{path}: Row fields"
        if hasattr(want, "_fields"):
            assert got._fields == want._fields, f"{path}: namedtuple fields"
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            assert_exact(g, w, f"{path}[{i}]")
        return
    if isinstance(want, dict):
        assert len(got) == len(want), path
        for (gk, gv), (wk, wv) in zip(got.items(), want.items(), strict=True):
            assert_exact(gk, wk, f"{path} key {wk!r}")
            assert_exact(gv, wv, f"{path}[{wk!r}]")
        return
    if isinstance(want, set | frozenset):
        assert got == want, path
        for w in want:
            (g,) = [g for g in got if g == w]
            assert_exact(g, w, f"{path} element {w!r}")
        return
    if isinstance(want, Money):
        assert_exact(got.amount, want.amount, f"{path}.amount")
    assert got == want, f"{path}: {got!r} != {want!r}"


def test_assert_exact_can_fail() -> None:
    for got, want in [
        ([1, 2], (1, 2)),
        ((1, 2), Row(a=1, b=2)),
        (Row(a=1, b=2), Row(b=1, a=2)),
        (Point(1, 2), (1, 2)),
        (1, True),
        ([1.0], [1]),
        (Decimal("1.5"), Decimal("1.50")),
        (dt.datetime(2000, 1, 1, 1, tzinfo=PLUS_5_30), dt.datetime(2000, 1, 1, 1)),
        (dt.datetime(2000, 1, 1, 1, tzinfo=dt.UTC), dt.datetime(2000, 1, 1, 1, tzinfo=BERLIN)),
        (0.0, -0.0),
        (bytearray(b"x"), b"x"),
        ({1: (1,)}, {1: [1]}),
        (frozenset({(1,)}), frozenset({(True,)})),
        ([float("nan")], [0.0]),
    ]:
        with pytest.raises(AssertionError):
            assert_exact(got, want)


def cut(data: bytes, points: list[int]) -> list[bytes]:
    """``data`` split at ``points`` (taken modulo its length + 1)."""
    bounds = sorted({p % (len(data) + 1) for p in points} | {0, len(data)})
    return [data[a:b] for a, b in itertools.pairwise(bounds)]


def encode_batches(codec: PickleBatchCodec, records: list[Any], sizes: list[int]) -> bytes:
    """``records`` encoded in consecutive batches of ``sizes`` (then the rest)."""
    encoder = codec.new_encoder()
    chunks = []
    pos = 0
    for size in [*sizes, len(records)]:
        chunks.append(encoder.encode_batch(records[pos : pos + size]))
        pos += size
    return b"".join(chunks)


def decode(codec: PickleBatchCodec, pieces: list[bytes]) -> list[Any]:
    decoder = codec.new_decoder()
    out: list[Any] = []
    for piece in pieces:
        buf = bytearray(piece)
        decoder.feed(memoryview(buf))
        buf[:] = b"\xee" * len(buf)  # the caller recycles the memory right away
        buf.clear()  # BufferError if the decoder kept a view of it
        out += decoder.take()
    assert not decoder.has_partial_record
    assert decoder.buffered_bytes == 0
    return out


def frames(data: bytes) -> list[int]:
    """The payload sizes of the frames in a stream."""
    sizes = []
    pos = 0
    while pos < len(data):
        (n,) = LEN.unpack_from(data, pos)
        sizes.append(n)
        pos += 4 + n
    assert pos == len(data)
    return sizes


# -- exact round trips ---------------------------------------------------------------------


def test_default_codec_is_pickle_batch() -> None:
    codec = default_codec()
    assert isinstance(codec, PickleBatchCodec)
    assert codec.new_encoder().max_record_size == codec.max_record_size


def test_every_sample_comes_back_exactly_in_one_piece_and_byte_by_byte() -> None:
    codec = PickleBatchCodec()
    data = encode_batches(codec, SAMPLES, [3, 1, 10])
    assert_exact(decode(codec, [data]), SAMPLES)
    assert_exact(decode(codec, [data[i : i + 1] for i in range(len(data))]), SAMPLES)


@settings(max_examples=60, deadline=None)
@given(
    order=st.permutations(range(len(SAMPLES))),
    sizes=st.lists(st.integers(0, 12), max_size=8),
    points=st.lists(st.integers(0, 10**6), max_size=12),
)
def test_samples_at_random_batches_and_cuts(
    order: list[int], sizes: list[int], points: list[int]
) -> None:
    codec = PickleBatchCodec()
    records = [SAMPLES[i] for i in order]
    data = encode_batches(codec, records, sizes)
    assert_exact(decode(codec, cut(data, points)), records)


def test_the_same_object_twice_in_a_batch() -> None:
    shared = [1, 2]
    codec = PickleBatchCodec()
    (got_a, got_b) = decode(codec, [codec.new_encoder().encode_batch([shared, shared])])
    assert_exact([got_a, got_b], [shared, shared])
    got_a.append(3)  # each record is independent for the reader: mutation is local
    assert got_b in ([1, 2], [1, 2, 3])


def test_records_from_empty_to_3_mib() -> None:
    sizes = [0, 1, 100, 4095, 32 * 1024 + 7, MiB, 3 * MiB]
    records: list[Any] = [bytes([i % 251]) * n for i, n in enumerate(sizes)]
    records += ["s" * n for n in sizes]
    records += [[bytearray(n), n] for n in sizes]
    codec = PickleBatchCodec()
    data = encode_batches(codec, records, [1, 5, 2])
    for piece in (32 * 1024, 7_777, len(data)):
        pieces = [data[i : i + piece] for i in range(0, len(data), piece)]
        assert_exact(decode(codec, pieces), records)


def test_empty_batch_appends_nothing() -> None:
    assert PickleBatchCodec().new_encoder().encode_batch([]) == b""


def test_frame_format() -> None:
    records = [(1, "a"), [2.5]]
    data = PickleBatchCodec().new_encoder().encode_batch(records)
    assert data[:4] == LEN.pack(len(data) - 4)
    assert data[4:6] == pickle.PROTO + bytes([5])  # a protocol 5 pickle of the list
    assert_exact(pickle.loads(data[4:]), records)


def payload_size(records: list[Any]) -> int:
    """The frame payload size a new encoder writes for ``records`` (one frame)."""
    data = PickleBatchCodec().new_encoder().encode_batch(records)
    assert frames(data) == [len(data) - 4]
    return len(data) - 4


# -- fast mode or the memo -----------------------------------------------------------------


def test_records_sharing_nothing_are_pickled_without_the_memo() -> None:
    encoder = PickleBatchCodec().new_encoder()
    for i in range(100):  # across probes
        records = [(i * 1000 + j, f"v{j}") for j in range(200)]
        data = encoder.encode_batch(records)
        # one MEMOIZE opcode less per tuple and string: the memo was not used
        assert len(data) - 4 < len(pickle.dumps(records, protocol=5)) - 200
        assert_exact(pickle.loads(data[4:]), records)


def test_records_sharing_objects_are_pickled_with_the_memo() -> None:
    encoder = PickleBatchCodec().new_encoder()
    zone = dt.timezone(dt.timedelta(hours=2))
    for i in range(100):
        records = [
            (j, dt.datetime(2026, 1, 1, i % 24, tzinfo=zone), Row(a=i, b=j)) for j in range(50)
        ]
        data = encoder.encode_batch(records)
        assert data[4:] == pickle.dumps(records, protocol=5)  # each shared object once
        assert_exact(decode(PickleBatchCodec(), [data]), records)


def test_records_that_start_sharing_objects_go_back_to_the_memo_at_once() -> None:
    encoder = PickleBatchCodec().new_encoder()
    for i in range(300):  # fast mode, and the probes far apart
        encoder.encode_batch([(i, j) for j in range(100)])
    zone = dt.timezone(dt.timedelta(hours=2))
    rows = [
        [Row(a=i, b=dt.datetime(2026, 1, 1, tzinfo=zone)) for _ in range(100)] for i in range(3)
    ]
    encoder.encode_batch(rows[0])  # fast mode still: each Row repeats its class and fields
    for batch in rows[1:]:  # that batch's size made this one a probe: the memo from now on
        assert encoder.encode_batch(batch)[4:] == pickle.dumps(batch, protocol=5)


def test_a_cycle_is_pickled_with_the_memo_even_in_fast_mode() -> None:
    codec = PickleBatchCodec()
    encoder = codec.new_encoder()
    for i in range(20):  # fast mode from the first probe on
        encoder.encode_batch([(i, j) for j in range(100)])
    ring: list[Any] = [1]
    ring.append(ring)
    shared = [2]
    (got_ring, got_pair, got_after) = decode(
        codec, [encoder.encode_batch([ring, (shared, shared)]), encoder.encode_batch([(3, 4)])]
    )
    assert got_ring[0] == 1 and got_ring[1] is got_ring
    assert got_pair == ([2], [2]) and got_pair[0] is got_pair[1]  # that batch had the memo
    assert got_after == (3, 4)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("warm", [False, True], ids=["first-batch-probe", "in-fast-mode"])
def test_a_record_sharing_one_object_along_2_to_the_40_paths_is_pickled_once(
    warm: bool,
) -> None:
    """Fast mode writes a shared object once per reference: a DAG of shared lists 40
    levels deep would take 2**40 writes. Its dump is cut short soon after its limit and
    the batch pickled with the memo, both in a probe and in fast mode."""
    codec = PickleBatchCodec()
    encoder = codec.new_encoder()
    if warm:
        for i in range(300):  # fast mode, and the probes far apart
            encoder.encode_batch([(i, j) for j in range(100)])
    dag: list[Any] = [1.5]
    for _ in range(40):
        dag = [dag, dag]
    data = encoder.encode_batch([dag])
    assert len(data) - 4 == len(pickle.dumps([dag], protocol=5))
    (got,) = decode(codec, [data])
    for _ in range(40):
        assert got[0] is got[1]
        got = got[0]
    assert got == [1.5]


# -- the record size limit -----------------------------------------------------------------


def test_a_batch_over_the_limit_is_split_into_frames_within_it() -> None:
    limit = 10_000
    codec = PickleBatchCodec(max_record_size=limit)
    records = [bytes([i]) * (1000 + 97 * i) for i in range(40)]
    data = codec.new_encoder().encode_batch(records)
    sizes = frames(data)
    assert len(sizes) > 1
    assert max(sizes) <= limit
    assert_exact(decode(codec, [data]), records)
    assert_exact(decode(codec, cut(data, list(range(0, len(data), 999)))), records)


def record_of_frame_size(size: int) -> bytes:
    """A bytes record whose own frame payload is exactly ``size`` bytes."""
    overhead = payload_size([b""])
    for n in range(size - overhead - 16, size - overhead + 1):
        record = b"r" * n
        if payload_size([record]) == size:
            return record
    raise AssertionError(size)


def test_a_record_exactly_at_the_limit_passes() -> None:
    limit = 5000
    record = record_of_frame_size(limit)
    codec = PickleBatchCodec(max_record_size=limit)
    data = codec.new_encoder().encode_batch([b"a", record, b"b"])
    assert frames(data) == [payload_size([b"a"]), limit, frames(data)[2]]
    assert decode(codec, [data]) == [b"a", record, b"b"]


def test_a_single_record_over_the_limit_is_refused() -> None:
    limit = 5000
    big = record_of_frame_size(limit + 1)
    encoder = PickleBatchCodec(max_record_size=limit).new_encoder()
    for batch in ([big], [b"a", big], [b"x"] * 100 + [big] + [b"y"] * 3):
        with pytest.raises(RecordTooLargeError) as info:
            encoder.encode_batch(batch)
        assert (info.value.size, info.value.limit, info.value.at_least) == (limit + 1, limit, False)
    data = encoder.encode_batch([b"ok"])  # the encoder goes on
    assert len(frames(data)) == 1
    assert decode(PickleBatchCodec(), [data]) == [b"ok"]


def test_three_mib_record_against_a_one_mib_limit() -> None:
    encoder = PickleBatchCodec(max_record_size=MiB).new_encoder()
    with pytest.raises(RecordTooLargeError) as info:
        encoder.encode_batch([b"small", "z" * (3 * MiB)])
    assert info.value.size > 3 * MiB


def test_unpicklable_record_raises_a_typed_error_naming_its_type() -> None:
    encoder = PickleBatchCodec().new_encoder()

    def local() -> None: ...

    class Local:
        pass

    for bad, name in [
        (lambda: None, "function"),
        (local, "function"),
        (Local(), f"{__name__}.{Local.__qualname__}"),
        ((1, (x for x in range(0))), "tuple"),
        ([threading.Lock()], "list"),
    ]:
        with pytest.raises(UsageError) as info:
            encoder.encode_batch([1, "x", bad, 2])
        assert f"record of type {name} with pickle" in str(info.value)
        assert isinstance(info.value.__cause__, Exception)
    assert decode(PickleBatchCodec(), [encoder.encode_batch([1])]) == [1]


# -- hostile input -------------------------------------------------------------------------


def feed_all(decoder: Any, pieces: list[bytes]) -> list[Any]:
    out: list[Any] = []
    for piece in pieces:
        decoder.feed(piece)
        out += decoder.take()
    out += decoder.take()  # raises a deferred error once the records before it are taken
    return out


@pytest.mark.parametrize("piece", [1, 2, 3, 4, 100])
def test_a_huge_length_is_refused_from_the_header_alone(piece: int) -> None:
    decoder = PickleBatchCodec(max_record_size=MiB).new_decoder()
    good = PickleBatchCodec().new_encoder().encode_batch([1, 2])
    data = good + b"\xff\xff\xff\xff"
    with pytest.raises(RecordTooLargeError) as info:
        feed_all(decoder, [data[i : i + piece] for i in range(0, len(data), piece)])
    assert (info.value.size, info.value.limit) == (0xFFFFFFFF, MiB)
    assert decoder.has_partial_record
    assert decoder.buffered_bytes < 8  # nothing allocated for the claimed frame


def test_records_before_a_corrupt_frame_are_delivered_first() -> None:
    good = PickleBatchCodec().new_encoder().encode_batch([1, (2, 3)])
    for bad in [
        LEN.pack(3) + b"\x80\x05.",  # unpickles to nothing: an empty stack
        LEN.pack(0),  # empty payload
        LEN.pack(5) + b"garba",
        LEN.pack(len(pickle.dumps(5))) + pickle.dumps(5),  # not a list
        LEN.pack(len(pickle.dumps((1,)))) + pickle.dumps((1,)),  # a tuple is not a list
        LEN.pack(6) + pickle.dumps([1, 2], protocol=5)[:6],  # truncated inside the frame
    ]:
        for pieces in ([good + bad], [good[:5], good[5:] + bad[:2], bad[2:]]):
            decoder = PickleBatchCodec().new_decoder()
            for piece in pieces:
                decoder.feed(piece)
            assert decoder.take() == [1, (2, 3)]
            with pytest.raises(CorruptRecordError) as info:
                decoder.take()
            assert not isinstance(info.value, RecordTooLargeError)
            assert decoder.has_partial_record
            with pytest.raises(CorruptRecordError):
                decoder.feed(good)
            decoder.clear()
            assert not decoder.has_partial_record
            decoder.feed(good)
            assert decoder.take() == [1, (2, 3)]


def test_a_truncated_stream_is_a_partial_record() -> None:
    data = PickleBatchCodec().new_encoder().encode_batch(["x" * 100])
    for end in range(1, len(data)):
        decoder = PickleBatchCodec().new_decoder()
        decoder.feed(data[:end])
        assert decoder.take() == []
        assert decoder.has_partial_record
        assert decoder.buffered_bytes == end
        decoder.feed(data[end:])
        assert decoder.take() == ["x" * 100]
        assert not decoder.has_partial_record


def test_non_byte_memoryviews_are_fed_as_bytes() -> None:
    data = PickleBatchCodec().new_encoder().encode_batch([1, "two"])
    data += b"\x00" * (-len(data) % 8)
    decoder = PickleBatchCodec().new_decoder()
    decoder.feed(memoryview(data).cast("Q"))
    assert decoder.take() == [1, "two"]


# Garbage payloads leave out the memo-store opcodes PUT (p) and LONG_BINPUT (r): a random
# 4-byte memo index makes CPython's unpickler allocate and clear up to 64 GB, a denial of
# service that an authenticated peer could cause on purpose (docs/serialization.md).
garbage = st.binary(max_size=120).map(lambda b: b.replace(b"r", b"s").replace(b"p", b"q"))


@settings(max_examples=300, deadline=None)
@given(
    prefix=st.lists(st.integers(-3, 3), max_size=3),
    payload=garbage,
    claimed=st.integers(0, 200) | st.just(0xFFFFFFFF),
    raw=st.booleans(),
    points=st.lists(st.integers(0, 300), max_size=5),
)
def test_garbage_decodes_or_raises_corrupt_record(
    prefix: list[int], payload: bytes, claimed: int, raw: bool, points: list[int]
) -> None:
    good = PickleBatchCodec().new_encoder().encode_batch(prefix)
    data = good + (payload if raw else LEN.pack(claimed) + payload)
    decoder = PickleBatchCodec(max_record_size=4096).new_decoder()
    got: list[Any] = []
    try:
        for piece in cut(data, points):
            decoder.feed(piece)
            got += decoder.take()
        got += decoder.take()
    except CorruptRecordError:
        assert got[: len(prefix)] == prefix
        assert decoder.has_partial_record
        with pytest.raises(CorruptRecordError):
            decoder.feed(b"\x00")
        with pytest.raises(CorruptRecordError):
            decoder.take()
    else:
        assert got[: len(prefix)] == prefix


@pytest.mark.parametrize("bad", [0, -1, 2**32, True, 1.5])
def test_max_record_size_is_checked(bad: Any) -> None:
    with pytest.raises(UsageError):
        PickleBatchCodec(max_record_size=bad)


def test_a_large_cut_frame_is_not_kept_after_decoding() -> None:
    codec = PickleBatchCodec()
    record = b"L" * (3 * MiB)
    data = codec.new_encoder().encode_batch([record, b"small"])
    small = codec.new_encoder().encode_batch([b"s" * 40_000])
    decoder = codec.new_decoder()
    for i in range(0, len(data), 32 * 1024):
        decoder.feed(data[i : i + 32 * 1024])
    assert decoder.take() == [record, b"small"]
    decoder.feed(small[:100])  # a cut frame of a usual size goes to the scratch buffer
    decoder.feed(small[100:])
    assert decoder.take() == [b"s" * 40_000]
    assert decoder._frame is None
    assert len(decoder._scratch) <= 256 * 1024  # the 3 MiB frame's buffer was dropped
