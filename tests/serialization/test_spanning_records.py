"""Records spanning buffers on the one write path: RecordWriter cuts, pooled segments carry
the bytes, a RecordDeserializer puts the records back together.

What the old SpanningRecordSerializer tests covered, on the path producers run: any
record sizes against any buffer sizes (changed between records, as a debloater does),
flushes at any point, records of several MiB over the smallest buffers, every codec; each
buffer goes back to its pool as soon as the deserializer has read it.
"""

from __future__ import annotations

import datetime
import decimal
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from exchange.errors import RecordTooLargeError
from exchange.memory.local_buffer_pool import LocalBufferPool
from exchange.memory.network_buffer_pool import NetworkBufferPool
from exchange.serialization import (
    BytesCodec,
    MsgpackCodec,
    PickleBatchCodec,
    PickleCodec,
    RecordCodec,
    default_codec,
)
from exchange.writer.record_writer import MIN_BUFFER_SIZE, OutputBuffer, RecordWriter
from tests.kit.record_deserializer import RecordDeserializer

SEGMENT = 4096
MiB = 1024 * 1024


@contextmanager
def pools(total: int = 32) -> Iterator[LocalBufferPool]:
    """A LocalBufferPool of a fresh NetworkBufferPool, both checked whole at the end."""
    nbp = NetworkBufferPool(total, SEGMENT)
    local = nbp.create_buffer_pool(1, total)
    try:
        yield local
        nbp.check_consistency()
        local.destroy()
        assert nbp.is_whole(), nbp
    finally:
        local.destroy()
        nbp.destroy()


class Reader:
    """Copies each cut buffer into a pooled segment (as the in-process sink and the daemon
    do) and feeds it to a RecordDeserializer at once; the segment must be back in the pool
    the moment it was read."""

    def __init__(self, pool: LocalBufferPool, codec: RecordCodec) -> None:
        self.pool = pool
        self.deser = RecordDeserializer(codec)
        self.records: list[Any] = []
        self.buffers = 0

    def read(self, outs: Sequence[OutputBuffer]) -> None:
        for out in outs:
            assert not out.is_event
            assert out.target == 0
            buf = self.pool.request_buffer()
            assert buf is not None, "pool exhausted: a buffer was not recycled"
            data = out.to_bytes()
            buf.segment.view()[: len(data)] = data
            buf.set_size(len(data))
            self.deser.set_next_buffer(buf)
            assert buf.is_recycled
            assert self.pool.num_in_use == 0
            self.buffers += 1
            self.records += self.deser.records()

    def end(self) -> list[Any]:
        assert not self.deser.has_partial_record
        assert self.deser.buffered_bytes == 0
        return self.records


def round_trip(
    records: Sequence[Any],
    codec: RecordCodec,
    pool: LocalBufferPool,
    sizes: Sequence[int] = (SEGMENT,),
    flush_points: Sequence[bool] = (False,),
) -> tuple[list[Any], int]:
    """Write ``records`` to one subpartition, the buffer size cycling through ``sizes``
    (one per record) and a flush after record ``i`` when ``flush_points[i % len]``; read
    every buffer as soon as it is cut. Returns the records read and the buffer count."""
    writer = RecordWriter(1, buffer_size=SEGMENT, codec=codec, buffer_timeout=-1)
    reader = Reader(pool, codec)
    for i, record in enumerate(records):
        size = sizes[i % len(sizes)]
        writer.set_buffer_size(0, size)
        writer.emit_to(record, 0)
        if flush_points[i % len(flush_points)]:
            writer.flush()
        outs = writer.take_output()
        assert all(out.size <= max(size, MIN_BUFFER_SIZE) for out in outs)
        reader.read(outs)
    reader.read(writer.close())
    return reader.end(), reader.buffers


# -- strategies ---------------------------------------------------------------------------

ints = st.integers(min_value=-(2**63), max_value=2**64 - 1)
scalars = (
    st.none()
    | st.booleans()
    | ints
    | st.floats(allow_nan=False)
    | st.text(max_size=40)
    | st.binary(max_size=40)
)
keys = st.text(max_size=8) | st.integers(min_value=-(2**63), max_value=2**63 - 1)
#: Whatever msgpack carries unchanged: lists (not tuples), dicts with str or int keys.
msgpack_records = st.recursive(
    scalars,
    lambda children: st.lists(children, max_size=5) | st.dictionaries(keys, children, max_size=5),
    max_leaves=12,
)
#: Records of some KiB up to 300 KiB, which span many buffers.
sized_blobs = st.builds(lambda n, b: bytes([b]) * n, st.integers(0, 300_000), st.integers(0, 255))
sized_texts = st.builds(lambda n, c: c * n, st.integers(0, 100_000), st.sampled_from("aé€𝄞"))
buffer_sizes = st.lists(st.integers(MIN_BUFFER_SIZE, SEGMENT), min_size=1, max_size=8)
flushes = st.lists(st.booleans(), min_size=1, max_size=7)


# -- round trips ---------------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(
    records=st.lists(msgpack_records | sized_blobs | sized_texts, max_size=12),
    sizes=buffer_sizes,
    flush_points=flushes,
)
def test_msgpack_any_buffer_sizes_and_flushes(
    records: list[Any], sizes: list[int], flush_points: list[bool]
) -> None:
    with pools() as pool:
        assert round_trip(records, MsgpackCodec(), pool, sizes, flush_points)[0] == records


@settings(max_examples=60, deadline=None)
@given(
    records=st.lists(
        msgpack_records.map(lambda r: (r, {"t": (r,)}, frozenset([1, 2]))) | sized_blobs,
        max_size=20,
    ),
    sizes=buffer_sizes,
    flush_points=flushes,
    codec=st.sampled_from([PickleBatchCodec(), PickleCodec()]),
)
def test_pickle_codecs_any_buffer_sizes_and_flushes(
    records: list[Any], sizes: list[int], flush_points: list[bool], codec: RecordCodec
) -> None:
    with pools() as pool:
        got, _ = round_trip(records, codec, pool, sizes, flush_points)
    assert got == records
    assert [type(r) for r in got] == [type(r) for r in records]


@settings(max_examples=60, deadline=None)
@given(
    records=st.lists(st.binary(max_size=5000) | sized_blobs, max_size=20),
    sizes=buffer_sizes | st.sampled_from([[MIN_BUFFER_SIZE], [SEGMENT]]),
    flush_points=flushes,
)
@example(records=[b"", b"", b"x"], sizes=[MIN_BUFFER_SIZE], flush_points=[True])
def test_bytes_any_buffer_sizes_and_flushes(
    records: list[bytes], sizes: list[int], flush_points: list[bool]
) -> None:
    with pools() as pool:
        got, _ = round_trip(records, BytesCodec(), pool, sizes, flush_points)
    assert got == records
    assert all(type(r) is bytes for r in got)


def test_bytes_codec_accepts_any_bytes_like() -> None:
    records = [bytearray(b"abc"), memoryview(b"defg"), memoryview(b"\x01\x02").cast("B")]
    with pools() as pool:
        got, _ = round_trip(records, BytesCodec(), pool)
    assert got == [b"abc", b"defg", b"\x01\x02"]


@pytest.mark.parametrize(
    ("codec", "records"),
    [
        (MsgpackCodec(), [1, b"\xab" * (3 * MiB), "x", "é" * (MiB // 2 + 7), None]),
        (PickleCodec(), [(1, 2), b"\xcd" * (2 * MiB), {"k": [1.5]}]),
        (BytesCodec(), [b"a", bytes(range(256)) * (8 * 1024 + 1), b""]),
        (default_codec(), [(1, "a"), (2, b"\xef" * (3 * MiB)), (3, decimal.Decimal("1.5"))]),
    ],
    ids=["msgpack", "pickle", "bytes", "default"],
)
def test_multi_mib_records_span_the_smallest_buffers(codec: Any, records: list[Any]) -> None:
    with pools() as pool:
        got, buffers = round_trip(records, codec, pool, [MIN_BUFFER_SIZE])
    assert got == records
    assert buffers > 2 * MiB // MIN_BUFFER_SIZE


def test_msgpack_gives_lists_unless_asked_for_tuples() -> None:
    records = [(1, (2, 3)), [4, [5]]]
    with pools() as pool:
        assert round_trip(records, MsgpackCodec(), pool)[0] == [[1, [2, 3]], [4, [5]]]
        tuples = round_trip(records, MsgpackCodec(tuples=True), pool)[0]
    assert tuples == [(1, (2, 3)), (4, (5,))]


def test_the_default_codec_gives_values_back_exactly() -> None:
    records = [
        (1, [1, 2], (3,)),
        (2, {1, 2}, frozenset("ab")),
        (3, datetime.datetime(2026, 1, 2, 3, 4, 5), decimal.Decimal("2.50")),
        (4, 2**70, -(2**80)),
    ]
    with pools() as pool:
        got, _ = round_trip(records, default_codec(), pool, [MIN_BUFFER_SIZE], [True, False])
    assert got == records
    assert [[type(v) for v in r] for r in got] == [[type(v) for v in r] for r in records]


# -- limits --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("codec", "big"),
    [
        (MsgpackCodec(max_record_size=100), "x" * 100),  # 102 bytes encoded
        (BytesCodec(max_record_size=100), b"x" * 101),
        (PickleBatchCodec(max_record_size=100), b"x" * 100),
    ],
    ids=["msgpack", "bytes", "pickle-batch"],
)
def test_a_record_over_the_limit_is_refused_typed(codec: Any, big: Any) -> None:
    writer = RecordWriter(1, buffer_size=SEGMENT, codec=codec, buffer_timeout=0)
    writer.emit_to(b"ok", 0)
    with pytest.raises(RecordTooLargeError) as info:
        writer.emit_to(big, 0)
    assert info.value.limit == 100
    assert info.value.size > 100
    assert not info.value.at_least
    writer.emit_to(b"ok2", 0)
    with pools() as pool:
        reader = Reader(pool, codec)
        reader.read(writer.close())
        assert reader.end() == [b"ok", b"ok2"]


@pytest.mark.parametrize(
    "codec",
    [
        MsgpackCodec(max_record_size=100),
        BytesCodec(max_record_size=100),
        PickleBatchCodec(max_record_size=100),
    ],
    ids=["msgpack", "bytes", "pickle-batch"],
)
def test_a_record_over_the_limit_loses_no_other_record(codec: Any) -> None:
    writer = RecordWriter(1, buffer_size=SEGMENT, codec=codec, buffer_timeout=-1)
    refused: list[RecordTooLargeError] = []
    for record in [b"a", b"b", b"x" * 200, b"c"]:
        try:
            writer.emit_to(record, 0)  # the error surfaces when its batch is encoded
        except RecordTooLargeError as exc:
            refused.append(exc)
    try:
        writer.flush()
    except RecordTooLargeError as exc:
        refused.append(exc)
    assert len(refused) == 1
    assert refused[0].limit == 100
    assert refused[0].size > 100
    writer.emit_to(b"d", 0)
    with pools() as pool:
        reader = Reader(pool, codec)
        reader.read(writer.close())
        # every record but the refused one, in order
        assert reader.end() == [b"a", b"b", b"c", b"d"]


def test_a_record_over_the_limit_on_the_reading_side_stops_at_its_header() -> None:
    writer = RecordWriter(1, buffer_size=SEGMENT, codec=MsgpackCodec(), buffer_timeout=-1)
    writer.set_buffer_size(0, MIN_BUFFER_SIZE)
    for record in ["a", list(range(2000)), "b"]:
        writer.emit_to(record, 0)
    outs = writer.close()
    with pools() as pool:
        reader = Reader(pool, MsgpackCodec(max_record_size=1000))  # a peer with a smaller limit
        fed = 0
        with pytest.raises(RecordTooLargeError) as info:
            for out in outs:
                fed += 1
                reader.read([out])
            reader.deser.records()
    assert reader.records == ["a"]
    assert info.value.at_least
    assert info.value.size == 2000  # the array header claims 2000 elements
    assert fed <= 2  # stopped at the header (in the first buffer; raised at the next)
