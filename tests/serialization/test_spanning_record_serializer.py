"""SpanningRecordSerializer: records through real pools and builders, and back."""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from exchange.buffers.buffer import FreeingRecycler
from exchange.buffers.buffer_builder import BufferBuilder, BufferConsumer
from exchange.errors import RecordTooLargeError, UsageError
from exchange.memory.local_buffer_pool import LocalBufferPool
from exchange.memory.memory_segment import MemorySegment
from exchange.memory.network_buffer_pool import NetworkBufferPool
from exchange.serialization import (
    BytesCodec,
    MsgpackCodec,
    PickleCodec,
    RecordCodec,
    RecordDeserializer,
    SerializationResult,
    SpanningRecordSerializer,
)

SEGMENT = 4096


@contextmanager
def pools(
    total: int = 32, required: int = 1, max_segments: int = 32
) -> Iterator[tuple[NetworkBufferPool, LocalBufferPool]]:
    """A NetworkBufferPool with one LocalBufferPool; checks both are whole at the end."""
    nbp = NetworkBufferPool(total, SEGMENT)
    local = nbp.create_buffer_pool(required, max_segments)
    yield nbp, local
    nbp.check_consistency()
    local.destroy()
    nbp.check_consistency()
    assert nbp.is_whole(), nbp
    nbp.destroy()


def round_trip(
    records: Sequence[Any],
    codec: RecordCodec,
    pool: LocalBufferPool,
    capacities: Sequence[int] = (SEGMENT,),
    flush_points: Sequence[bool] = (False,),
    *,
    batched: bool = False,
) -> list[Any]:
    """Write ``records`` into builders of ``capacities`` (cycled) and read them back.

    Like a RecordWriter: serialize, copy once the pending bytes fill the builder, and at
    the ``flush_points`` (cycled, one per record) copy and hand out what the builder
    holds without finishing it. Every buffer goes to the deserializer at once and must
    come back to the pool as it is consumed.
    """
    ser = SpanningRecordSerializer(codec)
    deser = RecordDeserializer(codec)
    caps = itertools.cycle(capacities)
    out: list[Any] = []

    def new_builder() -> tuple[BufferBuilder, BufferConsumer]:
        builder = pool.request_buffer_builder(next(caps))
        assert builder is not None, "pool exhausted: a buffer was not recycled"
        return builder, builder.create_buffer_consumer()

    def hand_out(builder: BufferBuilder, consumer: BufferConsumer, *, finished: bool) -> None:
        buffer = consumer.build()
        if finished:
            builder.finish()
            builder.close()
            consumer.close()
        deser.set_next_buffer(buffer)
        assert buffer.is_recycled
        # Consumed means recycled: only the open builder's segment is still out.
        assert pool.num_in_use == (0 if finished else 1)
        out.extend(deser.records())

    builder, consumer = new_builder()

    def copy_all() -> None:
        nonlocal builder, consumer
        result = ser.copy_to_buffer_builder(builder)
        while result.is_full_buffer:
            hand_out(builder, consumer, finished=True)
            builder, consumer = new_builder()
            if result.is_full_record:
                break
            result = ser.copy_to_buffer_builder(builder)
        assert not ser.has_serialized_data

    flushes = itertools.cycle(flush_points)
    if batched:
        it = iter(records)
        while ser.serialize_until(it, builder.writable_bytes) >= builder.writable_bytes:
            copy_all()
    else:
        for record in records:
            pending = ser.serialize_record(record)
            flush = next(flushes)
            if pending >= builder.writable_bytes or flush:
                copy_all()
            if flush:
                hand_out(builder, consumer, finished=False)
    copy_all()
    hand_out(builder, consumer, finished=True)
    assert not deser.has_partial_record
    assert deser.buffered_bytes == 0
    assert deser.records() == []
    return out


# -- strategies ---------------------------------------------------------------------------

ints = st.integers(min_value=-(2**63), max_value=2**64 - 1)
int_edges = st.sampled_from(
    [0, 1, -1, 127, 128, -32, -33, 255, 256, 2**16, 2**31 - 1, -(2**31), 2**32,
     2**63 - 1, -(2**63), 2**63, 2**64 - 1]
)  # fmt: skip
scalars = (
    st.none()
    | st.booleans()
    | ints
    | int_edges
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
#: A few records of some KiB up to 300 KiB, which span many small buffers.
sized_blobs = st.builds(lambda n, b: bytes([b]) * n, st.integers(0, 300_000), st.integers(0, 255))
sized_texts = st.builds(lambda n, c: c * n, st.integers(0, 100_000), st.sampled_from("aé€𝄞"))
capacities = st.lists(st.integers(1, SEGMENT), min_size=1, max_size=8)


FIXED_CAPACITIES = [64, 100, SEGMENT]
MiB = 1024 * 1024


def unpooled_builder(capacity: int) -> BufferBuilder:
    return BufferBuilder(MemorySegment.allocate_unpooled(SEGMENT), FreeingRecycler, capacity)


# -- round trips ---------------------------------------------------------------------------


@settings(max_examples=80, deadline=None)
@given(
    records=st.lists(msgpack_records, max_size=40),
    capacity=st.sampled_from(FIXED_CAPACITIES),
    flush_points=st.lists(st.booleans(), min_size=1, max_size=7),
)
def test_msgpack_round_trip_fixed_capacities(
    records: list[Any], capacity: int, flush_points: list[bool]
) -> None:
    with pools() as (_, pool):
        assert round_trip(records, MsgpackCodec(), pool, [capacity], flush_points) == records


@settings(max_examples=80, deadline=None)
@given(
    records=st.lists(msgpack_records | sized_blobs | sized_texts, max_size=12),
    caps=capacities.map(lambda cs: [max(c, 48) for c in cs]),
    flush_points=st.lists(st.booleans(), min_size=1, max_size=7),
    batched=st.booleans(),
)
def test_msgpack_round_trip_any_split(
    records: list[Any], caps: list[int], flush_points: list[bool], batched: bool
) -> None:
    with pools() as (_, pool):
        got = round_trip(records, MsgpackCodec(), pool, caps, flush_points, batched=batched)
        assert got == records


@settings(max_examples=25, deadline=None)
@given(records=st.lists(msgpack_records, min_size=1, max_size=5), caps=capacities)
def test_tiny_builders(records: list[Any], caps: list[int]) -> None:
    caps = [1 + c % 7 for c in caps]  # builders of 1 to 7 bytes
    with pools() as (_, pool):
        assert round_trip(records, MsgpackCodec(), pool, caps) == records


@settings(max_examples=50, deadline=None)
@given(
    records=st.lists(
        msgpack_records.map(lambda r: (r, {"t": (r,)}, frozenset([1, 2]))), max_size=20
    ),
    caps=capacities.map(lambda cs: [max(c, 48) for c in cs]),
    flush_points=st.lists(st.booleans(), min_size=1, max_size=7),
)
def test_pickle_round_trip(records: list[Any], caps: list[int], flush_points: list[bool]) -> None:
    with pools() as (_, pool):
        assert round_trip(records, PickleCodec(), pool, caps, flush_points) == records


@settings(max_examples=60, deadline=None)
@given(
    records=st.lists(st.binary(max_size=5000) | sized_blobs, max_size=20),
    caps=capacities.map(lambda cs: [max(c, 48) for c in cs])
    | st.sampled_from([[c] for c in FIXED_CAPACITIES]),
    flush_points=st.lists(st.booleans(), min_size=1, max_size=7),
    batched=st.booleans(),
)
@example(records=[b"", b"", b"x"], caps=[64], flush_points=[True], batched=False)
def test_bytes_round_trip(
    records: list[bytes], caps: list[int], flush_points: list[bool], batched: bool
) -> None:
    with pools() as (_, pool):
        got = round_trip(records, BytesCodec(), pool, caps, flush_points, batched=batched)
        assert got == records
        assert all(type(r) is bytes for r in got)


def test_bytes_codec_accepts_any_bytes_like() -> None:
    records = [bytearray(b"abc"), memoryview(b"defg"), memoryview(b"\x01\x02").cast("B")]
    with pools() as (_, pool):
        assert round_trip(records, BytesCodec(), pool, [64]) == [b"abc", b"defg", b"\x01\x02"]


@pytest.mark.parametrize(
    ("codec", "records"),
    [
        (MsgpackCodec(), [1, b"\xab" * (3 * MiB), "x", "é" * (MiB // 2 + 7), None]),
        (PickleCodec(), [(1, 2), b"\xcd" * (2 * MiB), {"k": [1.5]}]),
        (BytesCodec(), [b"a", bytes(range(256)) * (8 * 1024 + 1), b""]),
    ],
    ids=["msgpack", "pickle", "bytes"],
)
def test_multi_mib_records_span_tiny_buffers(codec: Any, records: list[Any]) -> None:
    with pools() as (_, pool):
        got = round_trip(records, codec, pool, [64, 100])
    expected = [list(r) if isinstance(r, tuple) and isinstance(codec, MsgpackCodec) else r
                for r in records]  # fmt: skip
    assert got == expected


def test_tuples_come_back_as_lists_unless_asked() -> None:
    records = [(1, (2, 3)), [4, [5]]]
    with pools() as (_, pool):
        assert round_trip(records, MsgpackCodec(), pool) == [[1, [2, 3]], [4, [5]]]
        tuples = round_trip(records, MsgpackCodec(tuples=True), pool)
        assert tuples == [(1, (2, 3)), (4, (5,))]


# -- serialization results and copying -----------------------------------------------------


def test_serialization_results() -> None:
    ser = SpanningRecordSerializer(BytesCodec())
    assert ser.serialize_record(b"x" * 6) == 10  # 4-byte length + 6
    assert ser.has_serialized_data
    builder = unpooled_builder(4)
    result = ser.copy_to_buffer_builder(builder)
    assert result is SerializationResult.PARTIAL_RECORD_MEMORY_SEGMENT_FULL
    assert (result.is_full_record, result.is_full_buffer) == (False, True)
    assert ser.pending_bytes == 6
    builder = unpooled_builder(6)
    result = ser.copy_to_buffer_builder(builder)
    assert result is SerializationResult.FULL_RECORD_MEMORY_SEGMENT_FULL
    assert (result.is_full_record, result.is_full_buffer) == (True, True)
    assert not ser.has_serialized_data
    builder = unpooled_builder(64)
    ser.serialize_record(b"")
    result = ser.copy_to_buffer_builder(builder)
    assert result is SerializationResult.FULL_RECORD
    assert (result.is_full_record, result.is_full_buffer) == (True, False)
    # Nothing pending: still a full record, and the builder is untouched.
    assert ser.copy_to_buffer_builder(builder) is SerializationResult.FULL_RECORD
    assert builder.committed_bytes == 4


def test_pending_bytes_accumulate_and_serialize_once() -> None:
    codec = MsgpackCodec()
    ser = SpanningRecordSerializer(codec)
    assert ser.serialize_record(1) == 1
    assert ser.serialize_record("ab") == 4
    assert ser.serialize_records([None, [1]]) == 7
    assert ser.pending_bytes == 7
    builder = unpooled_builder(64)
    assert ser.copy_to_buffer_builder(builder) is SerializationResult.FULL_RECORD
    assert bytes(builder.create_buffer_consumer_from_beginning().build().memoryview()) == (
        b"\x01\xa2ab\xc0\x91\x01"
    )


@pytest.mark.parametrize("codec", [MsgpackCodec(), BytesCodec()], ids=["msgpack", "bytes"])
def test_broadcast_copies_the_same_bytes_to_every_builder(codec: Any) -> None:
    """Serialize once, ``reset()``, copy to every channel (BroadcastRecordWriter)."""
    record = b"\x07" * 150
    with pools() as (_, pool):
        ser = SpanningRecordSerializer(codec)
        outputs = []
        for _round in range(2):
            ser.serialize_record(record)
            ser.serialize_record(b"tail")
            for _channel in range(3):
                ser.reset()
                deser = RecordDeserializer(codec)
                while True:
                    builder = pool.request_buffer_builder(64)
                    assert builder is not None
                    consumer = builder.create_buffer_consumer()
                    result = ser.copy_to_buffer_builder(builder)
                    builder.close()
                    deser.set_next_buffer(consumer.build())
                    consumer.close()
                    if result.is_full_record:
                        break
                outputs.append(deser.records())
        assert outputs == [[record, b"tail"]] * 6


def test_reset_rewinds_only_the_current_batch() -> None:
    ser = SpanningRecordSerializer(BytesCodec())
    ser.serialize_record(b"old")
    ser.copy_to_buffer_builder(unpooled_builder(64))
    ser.serialize_record(b"new")
    ser.reset()
    assert ser.pending_bytes == 7


def test_prune_shrinks_after_a_huge_record() -> None:
    with pools() as (_, pool):
        ser = SpanningRecordSerializer(initial_capacity=1024)
        ser.serialize_record(b"\x00" * (5 * MiB))
        assert ser.capacity >= 5 * MiB
        while True:
            builder = pool.request_buffer_builder()
            assert builder is not None
            result = ser.copy_to_buffer_builder(builder)
            builder.close()
            if result.is_full_record:
                break
        ser.prune()
        assert ser.capacity <= 1024 + 1
        assert not ser.has_serialized_data
        # Still usable, and reset() has nothing left to rewind to.
        ser.reset()
        assert ser.pending_bytes == 0
        assert ser.serialize_record(1) == 1


def test_prune_keeps_pending_bytes() -> None:
    ser = SpanningRecordSerializer(BytesCodec(), initial_capacity=16)
    ser.serialize_record(b"a" * 100_000)
    ser.serialize_record(b"b" * 10)
    builder = unpooled_builder(SEGMENT)
    ser.copy_to_buffer_builder(builder)
    pending = ser.pending_bytes
    ser.prune()
    assert ser.pending_bytes == pending
    assert ser.capacity <= pending + 1
    deser = RecordDeserializer(BytesCodec())
    deser.set_next_buffer(builder.create_buffer_consumer_from_beginning().build())
    while ser.has_serialized_data:
        builder = unpooled_builder(SEGMENT)
        ser.copy_to_buffer_builder(builder)
        deser.set_next_buffer(builder.create_buffer_consumer_from_beginning().build())
    assert deser.records() == [b"a" * 100_000, b"b" * 10]


def test_clear_drops_everything() -> None:
    ser = SpanningRecordSerializer()
    ser.serialize_record([1, 2, 3])
    ser.clear()
    assert ser.pending_bytes == 0
    ser.reset()
    assert ser.pending_bytes == 0


def test_serialize_until_stops_at_the_limit_and_keeps_the_iterator() -> None:
    ser = SpanningRecordSerializer(BytesCodec())
    it = iter([b"x" * 6] * 5)  # 10 bytes each, framed
    assert ser.serialize_until(it, 25) == 30
    assert ser.serialize_until(it, 1000) == 50  # below the limit: exhausted
    assert next(it, None) is None


# -- limits and misuse ---------------------------------------------------------------------


@pytest.mark.parametrize("bad", [0, -1, -4096, 1.5, True, None])
def test_bad_initial_capacity(bad: Any) -> None:
    with pytest.raises(UsageError):
        SpanningRecordSerializer(initial_capacity=bad)


@pytest.mark.parametrize("bad", [0, -1, 2**40, True])
@pytest.mark.parametrize("codec_type", [MsgpackCodec, PickleCodec, BytesCodec])
def test_bad_max_record_size(codec_type: Any, bad: Any) -> None:
    with pytest.raises(UsageError):
        codec_type(max_record_size=bad)


@pytest.mark.parametrize("bad", [0, -1, SEGMENT + 1])
def test_bad_builder_capacity(bad: int) -> None:
    with pools() as (_, pool):
        with pytest.raises(UsageError):
            pool.request_buffer_builder(bad)
        with pytest.raises(UsageError):
            unpooled_builder(bad)


@pytest.mark.parametrize("batch", [False, True], ids=["record", "batch"])
@pytest.mark.parametrize(
    ("codec", "big", "small"),
    [
        (MsgpackCodec(max_record_size=100), "x" * 100, "x" * 90),  # 102 bytes encoded
        (BytesCodec(max_record_size=100), b"x" * 101, b"x" * 100),
        (PickleCodec(max_record_size=100), b"x" * 100, b"x" * 10),
    ],
    ids=["msgpack", "bytes", "pickle"],
)
def test_record_too_large_to_serialize(codec: Any, big: Any, small: Any, batch: bool) -> None:
    ser = SpanningRecordSerializer(codec)
    ser.serialize_record(small)
    before = ser.pending_bytes
    with pytest.raises(RecordTooLargeError) as info:
        if batch:
            ser.serialize_records([small, big, small])
        else:
            ser.serialize_record(big)
    assert info.value.limit == 100
    assert info.value.size > 100
    assert not info.value.at_least
    # The stream is intact: the rejected record left no bytes behind.
    expected = [small, small] if batch else [small]
    assert ser.pending_bytes == before * len(expected)
    builder = unpooled_builder(SEGMENT)
    ser.copy_to_buffer_builder(builder)
    deser = RecordDeserializer(codec)
    deser.set_next_buffer(builder.create_buffer_consumer_from_beginning().build())
    assert deser.records() == expected


@pytest.mark.parametrize(
    ("codec", "bad"),
    [
        (MsgpackCodec(), object()),
        (MsgpackCodec(), 2**64),
        (PickleCodec(), lambda: None),
        (BytesCodec(), "not bytes"),
        (BytesCodec(), 12),
    ],
)
def test_unencodable_record_leaves_the_stream_intact(codec: Any, bad: Any) -> None:
    ser = SpanningRecordSerializer(codec)
    ser.serialize_record(b"ok")
    with pytest.raises((TypeError, OverflowError, AttributeError, pickle_error())):
        ser.serialize_record(bad)
    ser.serialize_record(b"ok2")
    builder = unpooled_builder(SEGMENT)
    ser.copy_to_buffer_builder(builder)
    deser = RecordDeserializer(codec)
    deser.set_next_buffer(builder.create_buffer_consumer_from_beginning().build())
    assert deser.records() == [b"ok", b"ok2"]


def pickle_error() -> type[Exception]:
    import pickle

    return pickle.PicklingError


def decode_pending(ser: SpanningRecordSerializer, codec: Any) -> list[Any]:
    deser = RecordDeserializer(codec)
    while ser.has_serialized_data:
        builder = unpooled_builder(SEGMENT)
        ser.copy_to_buffer_builder(builder)
        deser.set_next_buffer(builder.create_buffer_consumer_from_beginning().build())
        builder.close()
    return deser.records()


def test_batch_path_keeps_the_records_before_an_unencodable_one() -> None:
    ser = SpanningRecordSerializer()
    records = iter([1, "two", [3], object(), 5])
    with pytest.raises(TypeError):
        ser.serialize_records(records)
    assert next(records) == 5  # the iterator was not consumed past the failure
    assert decode_pending(ser, MsgpackCodec()) == [1, "two", [3]]


def test_batch_path_leaves_out_a_record_over_the_limit() -> None:
    codec = MsgpackCodec(max_record_size=4 * MiB)
    ser = SpanningRecordSerializer(codec)
    big = b"x" * (4 * MiB)  # 4 MiB + 5 bytes encoded
    with pytest.raises(RecordTooLargeError) as info:
        ser.serialize_records([b"a", big, b"b"])
    assert info.value.size == 4 * MiB + 5
    got = decode_pending(ser, codec)
    assert got[0] == b"a"
    assert big not in got
    ser.serialize_records([b"c"])
    assert decode_pending(ser, codec)[-1:] == [b"c"]


@settings(max_examples=20, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 70_000), max_size=60),
    room=st.integers(1, 100_000),
)
def test_batch_path_stops_at_the_room(sizes: list[int], room: int) -> None:
    records = [b"r" * n for n in sizes]
    ser = SpanningRecordSerializer()
    it = iter(records)
    got: list[Any] = []
    while True:
        pending = ser.serialize_until(it, room)
        if pending < room:
            break
        got += decode_pending(ser, MsgpackCodec())
    got += decode_pending(ser, MsgpackCodec())
    assert got == records


def test_batch_path_finds_a_record_over_the_limit_among_many() -> None:
    codec = MsgpackCodec(max_record_size=4 * MiB)
    ser = SpanningRecordSerializer(codec)
    records = [b"s%d" % i for i in range(100)]
    records[50] = b"x" * (4 * MiB)
    with pytest.raises(RecordTooLargeError):
        ser.serialize_records(records)
    got = decode_pending(ser, codec)
    # Every record taken from the list except the big one, once each, in order.
    assert got == [r for r in records[: len(got) + 1] if r is not records[50]]
    assert len(got) >= 50
