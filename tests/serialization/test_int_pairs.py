"""The default codec's packed frame for batches of ``(int, int)`` records
(``exchange/serialization/int_pairs.pyx``): exact round trips at the 64-bit edges, the
fallback to pickle decided by exact types, the format, and malformed frames."""

from __future__ import annotations

import enum
import gc
import pickle
import struct
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pyspark.sql import Row

from exchange.errors import CorruptRecordError, RecordTooLargeError
from exchange.serialization import BytesCodec, PickleBatchCodec
from exchange.serialization.int_pairs import HEADER_SIZE, PAIRS_TAG, encode_int_pairs
from tests.serialization.test_pickle_batch import (
    Point,
    assert_exact,
    cut,
    decode,
    encode_batches,
    frames,
)

LEN = struct.Struct(">I")
I64 = 2**63


class Color(enum.IntEnum):
    RED = 1


class MyInt(int):
    pass


EDGES = [0, -1, 1, 255, 256, -5, -6, 2**31 - 1, -(2**31), 2**31, -(2**31) - 1, I64 - 1, -I64]
#: Records the packed frame must not carry: each comes back exactly through pickle.
NOT_PACKED: list[Any] = [
    (True, 1),
    (1, False),
    (I64, 0),
    (0, -I64 - 1),
    (2**100, 1),
    (None, 1),
    (1, None),
    (1.0, 2),
    (Color.RED, 2),
    (MyInt(3), 4),
    (1, 2, 3),
    (1,),
    [1, 2],
    Point(1, 2),
    Row(k=1, v=2),
    ("1", 2),
    1,
    None,
]


def packed_frames(data: bytes) -> list[bool]:
    """For each frame of a stream, whether its payload is a packed one."""
    out = []
    pos = 0
    for n in frames(data):
        out.append(data[pos + 4] == PAIRS_TAG)
        pos += 4 + n
    return out


def packable(record: Any) -> bool:
    return (
        type(record) is tuple
        and len(record) == 2
        and all(type(x) is int and -I64 <= x < I64 for x in record)
    )


# -- round trips ---------------------------------------------------------------------------


def test_a_batch_of_int_pairs_at_the_64_bit_edges_comes_back_exactly_in_one_packed_frame() -> None:
    records = [(a, b) for a in EDGES for b in EDGES]
    codec = PickleBatchCodec()
    data = codec.new_encoder().encode_batch(records)
    assert packed_frames(data) == [True]
    for pieces in ([data], [data[i : i + 1] for i in range(len(data))]):
        got = decode(codec, pieces)
        assert_exact(got, records)
        assert all(not gc.is_tracked(r) for r in got)  # cannot be in a cycle


@pytest.mark.parametrize("odd", NOT_PACKED, ids=repr)
@pytest.mark.parametrize("where", [0, 500, 999])
def test_one_record_that_is_not_an_int_pair_makes_its_batch_a_pickle(odd: Any, where: int) -> None:
    records: list[Any] = [(i, -i) for i in range(1000)]
    records[where] = odd
    codec = PickleBatchCodec()
    data = codec.new_encoder().encode_batch(records)
    assert packed_frames(data) == [False]
    assert_exact(decode(codec, [data]), records)


item = st.sampled_from(EDGES) | st.integers(-I64, I64 - 1) | st.integers(-(2**70), 2**70)
pair = st.tuples(item, item)
record = pair | pair | pair | st.sampled_from(NOT_PACKED) | st.tuples(st.booleans(), item)


@settings(max_examples=200, deadline=None)
@given(
    records=st.lists(record, max_size=60),
    sizes=st.lists(st.integers(0, 20), max_size=8),
    points=st.lists(st.integers(0, 10**4), max_size=10),
)
def test_any_records_in_any_batches_and_cuts_come_back_exactly(
    records: list[Any], sizes: list[int], points: list[int]
) -> None:
    codec = PickleBatchCodec()
    data = encode_batches(codec, records, sizes)
    assert_exact(decode(codec, cut(data, points)), records)
    # each batch is packed exactly when all its records are exact (int, int) in 64 bits
    batches, pos = [], 0
    for size in [*sizes, len(records)]:
        if records[pos : pos + size]:
            batches.append(all(packable(r) for r in records[pos : pos + size]))
        pos += size
    assert packed_frames(data) == batches


# -- the format ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("records", "layout", "fmt"),
    [
        ([(1, -2), (2**31 - 1, -(2**31))], 0, "<ii"),
        ([(2**31, 0), (-1, 7)], 1, "<qi"),
        ([(0, -(2**31) - 1)], 2, "<iq"),
        ([(I64 - 1, -I64), (0, 0)], 3, "<qq"),
    ],
)
def test_the_frame_format(records: list[Any], layout: int, fmt: str) -> None:
    """``u32 BE length | 0xB1 | layout | u32 LE count | records``; a column is 4 bytes
    wide when all of its values fit in 32 bits."""
    data = PickleBatchCodec().new_encoder().encode_batch(records)
    body = b"".join(struct.pack(fmt, *r) for r in records)
    payload = bytes([PAIRS_TAG, layout]) + struct.pack("<I", len(records)) + body
    assert data == LEN.pack(len(payload)) + payload
    assert HEADER_SIZE == 6
    assert PAIRS_TAG == 0xB1
    with pytest.raises(pickle.UnpicklingError):  # never mistaken for a pickle
        pickle.loads(payload)


def test_a_batch_packed_over_the_limit_is_pickled_and_split_within_it() -> None:
    records = [(i, i) for i in range(100)]
    assert encode_int_pairs(records, HEADER_SIZE + 8 * 100) is not None
    assert encode_int_pairs(records, HEADER_SIZE + 8 * 100 - 1) is None
    assert encode_int_pairs(tuple(records), 1 << 20) is None  # only a list is packed
    codec = PickleBatchCodec(max_record_size=300)
    data = codec.new_encoder().encode_batch(records)
    assert len(frames(data)) > 1 and max(frames(data)) <= 300
    assert_exact(decode(codec, [data]), records)


def test_other_framed_codecs_never_take_a_payload_for_a_packed_frame() -> None:
    payload = bytes([PAIRS_TAG, 0]) + struct.pack("<I", 1) + struct.pack("<ii", 1, 2)
    codec = BytesCodec()
    data = codec.new_encoder().encode_batch([payload, payload[:3]])
    decoder = codec.new_decoder()
    decoder.feed(data)
    assert decoder.take() == [payload, payload[:3]]


# -- malformed frames ----------------------------------------------------------------------


def frame(payload: bytes) -> bytes:
    return LEN.pack(len(payload)) + payload


def header(layout: int, count: int) -> bytes:
    return bytes([PAIRS_TAG, layout]) + struct.pack("<I", count)


MALFORMED = {
    "tag only": bytes([PAIRS_TAG]),
    "header cut": header(0, 1)[:5],
    "unknown layout": header(4, 1) + bytes(8),
    "layout 255": header(255, 0),
    "one record short": header(0, 2) + bytes(8),
    "one byte short": header(3, 1) + bytes(15),
    "one byte over": header(0, 1) + bytes(9),
    "count zero, a record": header(1, 0) + bytes(12),
    "count 2**32-1": header(3, 0xFFFFFFFF) + bytes(16),
}


@pytest.mark.parametrize("name", list(MALFORMED))
def test_a_malformed_packed_frame_is_a_corrupt_record_after_the_records_before_it(
    name: str,
) -> None:
    codec = PickleBatchCodec()
    good = codec.new_encoder().encode_batch([(1, 2), (3, 4)])
    bad = frame(MALFORMED[name])
    data = good + bad
    for pieces in ([data], [data[i : i + 1] for i in range(len(data))]):
        decoder = codec.new_decoder()
        for piece in pieces:
            decoder.feed(piece)
        assert decoder.take() == [(1, 2), (3, 4)]
        with pytest.raises(CorruptRecordError) as info:
            decoder.take()
        assert not isinstance(info.value, RecordTooLargeError)
        assert "packed frame" in str(info.value)
        assert decoder.has_partial_record
        with pytest.raises(CorruptRecordError):  # poisoned until cleared
            decoder.feed(good)
        decoder.clear()
        decoder.feed(good)
        assert decoder.take() == [(1, 2), (3, 4)]


def test_an_empty_packed_frame_holds_no_record() -> None:
    decoder = PickleBatchCodec().new_decoder()
    decoder.feed(frame(header(2, 0)) + PickleBatchCodec().new_encoder().encode_batch([(5, 6)]))
    assert decoder.take() == [(5, 6)]


def test_a_packed_stream_cut_inside_a_frame_is_a_partial_record() -> None:
    data = PickleBatchCodec().new_encoder().encode_batch([(1, 2), (I64 - 1, 3)])
    for end in range(1, len(data)):
        decoder = PickleBatchCodec().new_decoder()
        decoder.feed(data[:end])
        assert decoder.take() == []
        assert decoder.has_partial_record
        assert decoder.unconsumed_bytes() == data[:end]
        decoder.feed(data[end:])
        assert decoder.take() == [(1, 2), (I64 - 1, 3)]
        assert not decoder.has_partial_record
