"""Codecs: stream encoders and decoders, fed in arbitrary pieces and fed garbage."""

from __future__ import annotations

import datetime
import decimal
import itertools
import pickle
from typing import Any

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from exchange.errors import CorruptRecordError, RecordTooLargeError, UsageError
from exchange.serialization import (
    DEFAULT_MAX_RECORD_SIZE,
    BytesCodec,
    FramedCodec,
    MsgpackCodec,
    PickleBatchCodec,
    PickleCodec,
    RecordCodec,
    default_codec,
)

scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.floats(allow_nan=False)
    | st.text(max_size=30)
    | st.binary(max_size=30)
)
records = st.recursive(
    scalars,
    lambda children: (
        st.lists(children, max_size=4)
        | st.dictionaries(st.text(max_size=5) | st.integers(-5, 5), children, max_size=4)
    ),
    max_leaves=10,
)


def encode(codec: RecordCodec, items: list[Any]) -> bytes:
    """The stream of ``items``, each encoded as a batch of its own (the chunks a writer
    that flushes after every record appends)."""
    encoder = codec.new_encoder()
    return b"".join(encoder.encode_batch([item]) for item in items)


def cut(data: bytes, points: list[int]) -> list[bytes]:
    """``data`` split at ``points`` (taken modulo its length)."""
    bounds = sorted({p % (len(data) + 1) for p in points} | {0, len(data)})
    return [data[a:b] for a, b in itertools.pairwise(bounds)]


def decode_pieces(codec: RecordCodec, pieces: list[bytes]) -> list[Any]:
    decoder = codec.new_decoder()
    out: list[Any] = []
    for piece in pieces:
        decoder.feed(memoryview(piece))
        out += decoder.take()
    assert not decoder.has_partial_record
    assert decoder.buffered_bytes == 0
    return out


# -- round trips in arbitrary pieces -------------------------------------------------------


@settings(max_examples=100, deadline=None)
@given(items=st.lists(records, max_size=20), points=st.lists(st.integers(0, 10**6)))
def test_msgpack_any_split(items: list[Any], points: list[int]) -> None:
    codec = MsgpackCodec()
    data = encode(codec, items)
    assert data == b"".join(msgpack.packb(i) for i in items)  # plain msgpack, no framing
    assert decode_pieces(codec, cut(data, points)) == items


@settings(max_examples=100, deadline=None)
@given(
    items=st.lists(records, min_size=1, max_size=10),
    points=st.lists(st.integers(0, 10**6), max_size=8),
    codec=st.sampled_from([MsgpackCodec(), BytesCodec(), PickleCodec()]),
)
def test_partial_record_is_exact_at_every_cut(
    items: list[Any], points: list[int], codec: RecordCodec
) -> None:
    if isinstance(codec, BytesCodec):
        items = [msgpack.packb(i) for i in items]
    ends = set(itertools.accumulate(len(encode(codec, [i])) for i in items)) | {0}
    decoder = codec.new_decoder()
    position = 0
    limit = max(len(encode(codec, [i])) for i in items)
    for piece in cut(encode(codec, items), points):
        decoder.feed(piece)
        position += len(piece)
        assert decoder.has_partial_record == (position not in ends)
    assert decoder.take() == items
    # The largest record is within a limit of its own size, whatever the cuts.
    exact = type(codec)(max_record_size=limit).new_decoder()  # type: ignore[call-arg]
    for piece in cut(encode(codec, items), points):
        exact.feed(piece)
    assert exact.take() == items


@settings(max_examples=40, deadline=None)
@given(items=st.lists(st.binary(max_size=300), max_size=20), points=st.lists(st.integers()))
def test_bytes_any_split(items: list[bytes], points: list[int]) -> None:
    codec = BytesCodec()
    assert decode_pieces(codec, cut(encode(codec, items), points)) == items


@settings(max_examples=30, deadline=None)
@given(items=st.lists(records, max_size=10), points=st.lists(st.integers()))
def test_pickle_any_split(items: list[Any], points: list[int]) -> None:
    codec = PickleCodec()
    assert decode_pieces(codec, cut(encode(codec, items), points)) == items


def test_user_framed_codec() -> None:
    codec = FramedCodec(lambda s: s.encode("utf-16"), lambda v: bytes(v).decode("utf-16"))
    data = encode(codec, ["a", "", "ÿ€"])
    assert decode_pieces(codec, cut(data, [3, 5, 11])) == ["a", "", "ÿ€"]


def test_feeds_larger_than_a_piece() -> None:
    items = [[i, "x" * (i % 300)] for i in range(20_000)]  # about 3 MiB in one feed
    for codec in (MsgpackCodec(), PickleCodec()):
        assert decode_pieces(codec, [encode(codec, items)]) == items


def test_iteration_and_take() -> None:
    decoder = MsgpackCodec().new_decoder()
    decoder.feed(b"\x01\x02\x03\xa2a")
    assert list(decoder) == [1, 2, 3]
    assert decoder.has_partial_record
    assert 1 <= decoder.buffered_bytes <= 2  # a lower bound for msgpack
    decoder.feed(b"b")
    assert decoder.take() == ["ab"]
    assert decoder.take() == []


def test_unpacker_is_renewed_after_a_large_record() -> None:
    decoder = MsgpackCodec().new_decoder()
    data = msgpack.packb(b"z" * 2_000_000)
    first = decoder._unpacker
    for piece in cut(data, list(range(0, len(data), 32 * 1024))):
        decoder.feed(piece)
    assert decoder.take() == [b"z" * 2_000_000]
    assert decoder._unpacker is not first
    decoder.feed(b"\x05")
    assert decoder.take() == [5]


# -- hostile input -------------------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(data=st.binary(max_size=200), points=st.lists(st.integers(0, 200), max_size=5))
@pytest.mark.parametrize(
    "codec",
    [
        MsgpackCodec(max_record_size=4096),
        MsgpackCodec(tuples=True, max_record_size=4096),
        BytesCodec(max_record_size=4096),
    ],
    ids=["msgpack", "msgpack-tuples", "bytes"],
)
def test_garbage_decodes_or_raises_corrupt_record(
    codec: RecordCodec, data: bytes, points: list[int]
) -> None:
    decoder = codec.new_decoder()
    try:
        for piece in cut(data, points):
            decoder.feed(piece)
            decoder.take()
        decoder.take()
    except CorruptRecordError:
        assert decoder.has_partial_record
        with pytest.raises(CorruptRecordError):
            decoder.feed(b"\x00")
        with pytest.raises(CorruptRecordError):
            decoder.take()


@pytest.mark.parametrize(
    "bad",
    [
        b"\xc1",  # never used
        b"\xa2\xff\xfe",  # invalid UTF-8
        b"\x81\x91\x01\x02",  # a list as a map key
        b"\xd7\xff" + b"\xff" * 8,  # timestamp with nanoseconds out of range
        b"\x91" * 2000 + b"\x01",  # nested too deep
    ],
)
def test_corrupt_msgpack(bad: bytes) -> None:
    decoder = MsgpackCodec().new_decoder()
    decoder.feed(b"\x01" + bad)
    assert decoder.take() == [1]
    with pytest.raises(CorruptRecordError) as info:
        decoder.take()
    assert not isinstance(info.value, RecordTooLargeError)
    assert isinstance(info.value.__cause__, Exception)
    decoder.clear()
    decoder.feed(b"\x02")
    assert decoder.take() == [2]


def test_corrupt_payload_of_a_framed_codec() -> None:
    decoder = PickleCodec().new_decoder()
    decoder.feed(b"\x00\x00\x00\x02" + pickle.dumps(1)[:2])
    with pytest.raises(CorruptRecordError) as info:
        decoder.take()
    assert isinstance(info.value.__cause__, pickle.UnpicklingError | EOFError | ValueError)


@pytest.mark.parametrize("piece", [1, 3, 100])
def test_framed_length_over_the_limit(piece: int) -> None:
    decoder = BytesCodec(max_record_size=1000).new_decoder()
    data = b"\x00\x00\x03\xe9" + b"x" * 50  # claims 1001 bytes
    for start in range(0, 4, piece):  # the header alone is enough
        decoder.feed(data[start : start + piece])
    with pytest.raises(RecordTooLargeError) as info:
        decoder.take()
    assert (info.value.size, info.value.limit, info.value.at_least) == (1001, 1000, False)


@pytest.mark.parametrize("piece", [7, 64, 4096])
@pytest.mark.parametrize(
    "record",
    [b"b" * 1001, "s" * 1001, list(range(600)), {str(i): i for i in range(300)}],
    ids=["bin", "str", "array", "map"],
)
def test_msgpack_record_over_the_limit(record: Any, piece: int) -> None:
    data = msgpack.packb(record)
    assert len(data) > 1000
    decoder = MsgpackCodec(max_record_size=1000).new_decoder()
    fed = 0
    with pytest.raises(RecordTooLargeError) as info:
        for start in range(0, len(data) + 1, piece):
            decoder.feed(data[start : start + piece])
            fed += piece
            decoder.take()
        decoder.take()
    error = info.value
    assert error.limit == 1000
    assert error.size > 1000 and error.size <= len(data) + piece
    if not error.at_least:
        assert error.size == len(data)
    assert fed <= 1000 + 2 * piece  # stopped while the record was arriving


def test_msgpack_array_header_claiming_too_much() -> None:
    decoder = MsgpackCodec(max_record_size=1 << 20).new_decoder()
    decoder.feed(b"\xdd\xff\xff\xff\xff")
    with pytest.raises(RecordTooLargeError) as info:
        decoder.take()
    assert info.value.size == 0xFFFFFFFF
    assert info.value.at_least


def test_msgpack_limit_is_exact_for_whole_records() -> None:
    ok = msgpack.packb(["x" * 996])  # exactly 1000 bytes
    assert len(ok) == 1000
    for pieces in ([ok + ok], [ok[:500], ok[500:] + ok[:1], ok[1:]], [ok[:1], ok[1:] + ok]):
        decoder = MsgpackCodec(max_record_size=1000).new_decoder()
        for piece in pieces:
            decoder.feed(piece)
        assert decoder.take() == [["x" * 996]] * 2
        assert not decoder.has_partial_record
    decoder = MsgpackCodec(max_record_size=999).new_decoder()
    decoder.feed(ok)
    with pytest.raises(RecordTooLargeError) as info:
        decoder.take()
    assert (info.value.size, info.value.at_least) == (1000, False)


# -- encode_batch: the writer's path, on every codec ----------------------------------------


def all_codecs(limit: int = DEFAULT_MAX_RECORD_SIZE) -> list[RecordCodec]:
    return [
        MsgpackCodec(max_record_size=limit),
        MsgpackCodec(tuples=True, max_record_size=limit),
        PickleCodec(max_record_size=limit),
        BytesCodec(max_record_size=limit),
        PickleBatchCodec(max_record_size=limit),
    ]


@settings(max_examples=40, deadline=None)
@given(
    items=st.lists(records, max_size=30),
    sizes=st.lists(st.integers(0, 8), max_size=6),
    points=st.lists(st.integers(0, 10**6), max_size=8),
)
def test_encode_batch_chunks_decode_in_order_at_any_cut(
    items: list[Any], sizes: list[int], points: list[int]
) -> None:
    for codec in all_codecs():
        records_in = [msgpack.packb(i) for i in items] if isinstance(codec, BytesCodec) else items
        encoder = codec.new_encoder()
        chunks = []
        pos = 0
        for size in [*sizes, len(records_in)]:
            chunk = encoder.encode_batch(records_in[pos : pos + size])
            assert isinstance(chunk, bytes | bytearray)
            chunks.append(bytes(chunk))
            pos += size
        data = b"".join(chunks)
        expected = decode_pieces(codec, [encode(codec, records_in)])
        assert decode_pieces(codec, cut(data, points)) == expected, codec


@pytest.mark.parametrize(
    ("codec", "bad", "name"),
    [
        (MsgpackCodec(), datetime.datetime(2020, 1, 1), "datetime.datetime"),
        (MsgpackCodec(), decimal.Decimal("1.5"), "decimal.Decimal"),
        (MsgpackCodec(), {1, 2}, "set"),
        (MsgpackCodec(), 2**64, "int"),
        (MsgpackCodec(), -(2**63) - 1, "int"),
        (MsgpackCodec(), (1, [object()]), "tuple"),
        (PickleCodec(), lambda: None, "function"),
        (BytesCodec(), "not bytes", "str"),
        (BytesCodec(), 12, "int"),
        (PickleBatchCodec(), lambda: None, "function"),
    ],
)
def test_encode_batch_refuses_with_a_typed_error_naming_the_type(
    codec: RecordCodec, bad: Any, name: str
) -> None:
    encoder = codec.new_encoder()
    with pytest.raises(UsageError) as info:
        encoder.encode_batch([b"ok", bad, b"ok2"])
    assert not isinstance(info.value, TypeError)
    assert f"record of type {name} with" in str(info.value)
    assert isinstance(info.value.__cause__, Exception)
    # The encoder is still usable and appends nothing of the failed batch.
    assert decode_pieces(codec, [bytes(encoder.encode_batch([b"next"]))]) == [b"next"]


@pytest.mark.parametrize("codec", all_codecs(limit=1000), ids=repr)
def test_encode_batch_refuses_a_record_over_the_limit(codec: RecordCodec) -> None:
    encoder = codec.new_encoder()
    batch = [b"s%d" % i for i in range(200)]  # together over the limit: fine
    data = bytes(encoder.encode_batch(batch))
    assert len(data) > 1000
    assert decode_pieces(codec, cut(data, [999, 1500])) == batch
    big = b"b" * 1200
    with pytest.raises(RecordTooLargeError) as info:
        encoder.encode_batch([b"a", big, b"c"])
    assert info.value.size > 1000 and info.value.limit == 1000 and not info.value.at_least
    assert decode_pieces(codec, [bytes(encoder.encode_batch([b"d"]))]) == [b"d"]


def test_msgpack_changes_values_as_documented() -> None:
    from pyspark.sql import Row

    items = [(1, [2]), Row(a=1), bytearray(b"x")]
    for codec, want in [
        (MsgpackCodec(), [[1, [2]], [1], b"x"]),
        (MsgpackCodec(tuples=True), [(1, (2,)), (1,), b"x"]),
    ]:
        got = decode_pieces(codec, [codec.new_encoder().encode_batch(items)])
        assert got == want
        assert [type(g) for g in got] == [type(w) for w in want]


def test_default_codec() -> None:
    assert isinstance(default_codec(), PickleBatchCodec)
