"""BufferBuilder / BufferConsumer: appending, splitting, trimming, consumers, recycling."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from exchange.buffers import Buffer, BufferBuilder, BufferConsumer, DataType
from exchange.errors import IllegalStateError, SegmentFreedError, UsageError
from exchange.memory import MemorySegment, NetworkBufferPool


class CountingRecycler:
    def __init__(self) -> None:
        self.recycled: list[MemorySegment] = []

    def recycle(self, segment: MemorySegment) -> None:
        self.recycled.append(segment)


def make(size: int = 64, capacity: int | None = None) -> tuple[BufferBuilder, CountingRecycler]:
    rec = CountingRecycler()
    return BufferBuilder(MemorySegment.allocate_unpooled(size), rec, capacity), rec


# -- the builder ----------------------------------------------------------------------------


def test_fresh_builder() -> None:
    builder, rec = make(64)
    assert builder.capacity == 64
    assert builder.committed_bytes == 0
    assert builder.writable_bytes == 64
    assert not builder.is_full
    assert not builder.is_finished
    assert repr(builder) == "BufferBuilder(0/64, finished=False)"
    builder.close()
    assert len(rec.recycled) == 1


@pytest.mark.parametrize("capacity", [0, -1, 65])
def test_capacity_must_fit_the_segment(capacity: int) -> None:
    with pytest.raises(UsageError, match="capacity"):
        make(64, capacity)


def test_append_splits_at_capacity() -> None:
    builder, _ = make(64, capacity=10)
    assert builder.append(b"abcdef") == 6
    assert builder.writable_bytes == 4
    assert builder.append(b"ghijkl") == 4  # only "ghij" fits
    assert builder.is_full
    assert builder.committed_bytes == 10
    assert builder.append(b"more") == 0
    assert builder.append(b"") == 0
    consumer = builder.create_buffer_consumer_from_beginning()
    assert consumer.build().to_bytes() == b"abcdefghij"


@given(
    capacity=st.integers(1, 64),
    chunks=st.lists(st.binary(max_size=40), max_size=8),
)
@settings(max_examples=60, deadline=None)
def test_records_split_over_builders_reassemble(capacity: int, chunks: list[bytes]) -> None:
    """Appending the remainder to a fresh builder until done loses and repeats nothing."""
    out = []
    rec = CountingRecycler()
    builder = BufferBuilder(MemorySegment.allocate_unpooled(64), rec, capacity)
    consumer = builder.create_buffer_consumer()
    for chunk in chunks:
        view = memoryview(chunk)
        while True:
            n = builder.append(view)
            assert n == min(len(view), capacity - (builder.committed_bytes - n))
            view = view[n:]
            if not view.nbytes:
                break
            assert builder.is_full
            builder.finish()
            builder.close()
            piece = consumer.build()
            out.append(piece.to_bytes())
            piece.release()
            consumer.close()
            builder = BufferBuilder(MemorySegment.allocate_unpooled(64), rec, capacity)
            consumer = builder.create_buffer_consumer()
    builder.close()
    piece = consumer.build()
    out.append(piece.to_bytes())
    piece.release()
    consumer.close()
    assert b"".join(out) == b"".join(chunks)
    assert all(len(p) <= capacity for p in out)
    assert len(rec.recycled) == len(out)


def test_append_accepts_bytes_bytearray_and_memoryview() -> None:
    builder, _ = make(16)
    builder.append(b"ab")
    builder.append(bytearray(b"cd"))
    builder.append(memoryview(b"efgh")[1:3])
    consumer = builder.create_buffer_consumer_from_beginning()
    assert consumer.build().to_bytes() == b"abcdfg"


def test_trim_lowers_capacity_but_never_below_what_is_written() -> None:
    builder, _ = make(64, capacity=50)
    builder.append(b"x" * 30)
    builder.trim(40)
    assert builder.capacity == 40
    builder.trim(60)
    assert builder.capacity == 40  # trim never raises it
    builder.trim(10)
    assert builder.capacity == 30
    assert builder.is_full
    assert builder.append(b"y") == 0
    with pytest.raises(UsageError, match="positive"):
        builder.trim(0)
    with pytest.raises(UsageError, match="positive"):
        builder.trim(-5)
    assert builder.capacity == 30


def test_finish_returns_the_size_and_stops_appends() -> None:
    builder, rec = make(64)
    consumer = builder.create_buffer_consumer()
    builder.append(b"hello")
    assert not consumer.is_finished
    assert builder.finish() == 5
    assert builder.is_finished
    assert consumer.is_finished
    with pytest.raises(IllegalStateError, match="finished"):
        builder.append(b"x")
    assert builder.finish() == 5
    # a finished (not closed) builder still hands out consumers
    late = builder.create_buffer_consumer_from_beginning()
    piece = late.build()
    assert piece.to_bytes() == b"hello"
    piece.release()
    builder.close()
    consumer.close()
    late.close()
    assert len(rec.recycled) == 1


def test_close_is_idempotent_and_refuses_new_consumers() -> None:
    builder, rec = make(64)
    builder.close()
    builder.close()
    assert builder.is_finished
    assert len(rec.recycled) == 1
    with pytest.raises(IllegalStateError, match="closed"):
        builder.create_buffer_consumer()
    with pytest.raises(IllegalStateError, match="closed"):
        builder.create_buffer_consumer_from_beginning()
    with pytest.raises(IllegalStateError):
        builder.append(b"x")
    assert len(rec.recycled) == 1


# -- consumers ------------------------------------------------------------------------------


def test_consumer_at_position_sees_only_later_appends() -> None:
    builder, _ = make(64)
    builder.append(b"abc")
    at_pos = builder.create_buffer_consumer()
    from_start = builder.create_buffer_consumer_from_beginning()
    assert at_pos.unread_bytes == 0
    assert not at_pos.is_data_available
    assert from_start.unread_bytes == 3
    builder.append(b"def")
    assert at_pos.written_bytes == 6
    assert at_pos.unread_bytes == 3
    assert at_pos.build().to_bytes() == b"def"
    assert from_start.build().to_bytes() == b"abcdef"
    # a second build returns only what came since
    empty = at_pos.build()
    assert empty.size == 0
    builder.append(b"g")
    assert at_pos.is_data_available
    assert at_pos.build().to_bytes() == b"g"
    assert from_start.build().to_bytes() == b"g"


def test_built_slices_share_the_segment_without_copying() -> None:
    builder, _ = make(64)
    consumer = builder.create_buffer_consumer()
    builder.append(b"abc")
    piece = consumer.build()
    builder_view = piece.memoryview()
    piece.segment.put(0, b"X")
    assert bytes(builder_view) == b"Xbc"
    assert piece.segment.get(0, 3) == b"Xbc"


def test_copy_for_broadcast_reads_independently_from_the_same_position() -> None:
    builder, rec = make(64)
    builder.append(b"skip")
    first = builder.create_buffer_consumer()
    builder.append(b"one")
    second = first.copy()
    pieces = [first.build()]
    assert pieces[-1].to_bytes() == b"one"
    builder.append(b"two")
    pieces.append(second.build())
    assert pieces[-1].to_bytes() == b"onetwo"
    third = first.copy()  # at first's position now
    assert third.unread_bytes == 3
    pieces.append(third.build())
    assert pieces[-1].to_bytes() == b"two"
    for c in (first, second, third):
        c.close()
    for p in pieces:
        p.release()
    assert rec.recycled == []
    builder.close()
    assert len(rec.recycled) == 1


def test_segment_recycled_only_after_builder_consumers_and_slices() -> None:
    builder, rec = make(64)
    builder.append(b"data")
    c1 = builder.create_buffer_consumer_from_beginning()
    c2 = c1.copy()
    piece = c1.build()
    builder.close()
    assert rec.recycled == []
    c1.close()
    c1.close()  # idempotent
    assert c1.is_closed
    assert rec.recycled == []
    c2.close()
    assert rec.recycled == []
    assert piece.to_bytes() == b"data"  # the built slice keeps the segment alive
    piece.release()
    assert len(rec.recycled) == 1


def test_consumer_reads_after_the_builder_closed() -> None:
    builder, rec = make(64)
    consumer = builder.create_buffer_consumer()
    builder.append(b"tail")
    builder.close()
    assert consumer.is_finished
    piece = consumer.build()
    consumer.close()
    assert piece.to_bytes() == b"tail"
    piece.release()
    assert len(rec.recycled) == 1


def test_closed_consumer_refuses_build_and_copy() -> None:
    builder, _ = make(64)
    consumer = builder.create_buffer_consumer()
    consumer.close()
    with pytest.raises(IllegalStateError, match="closed"):
        consumer.build()
    with pytest.raises(IllegalStateError, match="closed"):
        consumer.copy()
    builder.close()


def test_consumer_of_a_finished_event_buffer() -> None:
    buf = Buffer.wrap(b"barrier", DataType.EVENT_BUFFER)
    seg = buf.segment
    consumer = BufferConsumer.of_buffer(buf)
    assert consumer.is_finished
    assert not consumer.is_buffer
    assert consumer.data_type is DataType.EVENT_BUFFER
    assert consumer.unread_bytes == 7
    copy = consumer.copy()
    piece = consumer.build()
    assert piece.to_bytes() == b"barrier"
    assert piece.data_type is DataType.EVENT_BUFFER
    assert not consumer.is_data_available
    assert repr(consumer) == "BufferConsumer(EVENT_BUFFER, read=7, written=7, finished=True)"
    consumer.close()
    copy.close()
    assert not seg.is_freed
    piece.release()
    assert seg.is_freed


def test_data_consumer_reports_data_type() -> None:
    builder, _ = make(64)
    consumer = builder.create_buffer_consumer()
    assert consumer.is_buffer
    assert consumer.data_type is DataType.DATA_BUFFER
    assert not consumer.is_finished


# -- with a real pool -----------------------------------------------------------------------


def test_builder_from_a_pool_returns_its_segment_once_everything_is_closed() -> None:
    nbp = NetworkBufferPool(2, 4096)
    pool = nbp.create_buffer_pool(1, 2)
    builder = pool.request_buffer_builder()
    assert builder is not None
    assert builder.capacity == 4096
    consumers = [builder.create_buffer_consumer()]
    builder.append(b"x" * 5000)
    assert builder.committed_bytes == 4096
    consumers.append(consumers[0].copy())
    builder.close()
    assert pool.num_in_use == 1
    pieces = [c.build() for c in consumers]
    assert [p.size for p in pieces] == [4096, 4096]
    for c in consumers:
        c.close()
    assert pool.num_in_use == 1
    for p in pieces:
        p.release()
    assert pool.num_in_use == 0
    assert pool.num_available == 1
    pool.destroy()
    nbp.check_consistency()
    assert nbp.is_whole()
    nbp.destroy()


def test_append_after_the_network_pool_is_destroyed_raises_segment_freed() -> None:
    nbp = NetworkBufferPool(1, 4096)
    pool = nbp.create_buffer_pool(1, 1)
    builder = pool.request_buffer_builder()
    assert builder is not None
    builder.append(b"before")
    nbp.destroy()
    with pytest.raises(SegmentFreedError):
        builder.append(b"after")
    builder.close()
