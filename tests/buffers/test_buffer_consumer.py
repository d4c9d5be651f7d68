"""BufferConsumer: a complete buffer read once, copies for broadcast, recycling."""

from __future__ import annotations

import pytest

from exchange.buffers import Buffer, BufferConsumer, DataType
from exchange.errors import IllegalStateError
from exchange.memory import MemorySegment, NetworkBufferPool


class CountingRecycler:
    def __init__(self) -> None:
        self.recycled: list[MemorySegment] = []

    def recycle(self, segment: MemorySegment) -> None:
        self.recycled.append(segment)


def data_buffer(data: bytes, size: int = 64) -> tuple[Buffer, CountingRecycler]:
    rec = CountingRecycler()
    buf = Buffer(MemorySegment.allocate_unpooled(size), rec)
    buf.segment.put(0, data)
    buf.set_size(len(data))
    return buf, rec


def test_build_gives_the_whole_buffer_once_then_empty_slices() -> None:
    buf, rec = data_buffer(b"hello")
    consumer = BufferConsumer.of_buffer(buf)
    assert consumer.is_buffer and consumer.data_type is DataType.DATA_BUFFER
    assert consumer.is_data_available and consumer.unread_bytes == 5
    piece = consumer.build()
    assert piece.to_bytes() == b"hello"
    assert piece.data_type is DataType.DATA_BUFFER
    assert not consumer.is_data_available and consumer.unread_bytes == 0
    empty = consumer.build()
    assert empty.size == 0
    empty.release()
    consumer.close()
    assert rec.recycled == []  # the built slice keeps the segment
    piece.release()
    assert rec.recycled == [buf.segment]


def test_an_empty_buffer_has_no_data_available() -> None:
    buf, rec = data_buffer(b"")
    consumer = BufferConsumer.of_buffer(buf)
    assert not consumer.is_data_available
    piece = consumer.build()
    assert piece.size == 0
    piece.release()
    consumer.close()
    assert len(rec.recycled) == 1


def test_copies_for_broadcast_read_independently_and_share_the_segment() -> None:
    buf, rec = data_buffer(b"event")
    first = BufferConsumer.of_buffer(buf)
    second = first.copy()
    a = first.build()
    third = first.copy()  # in first's read state now: nothing left to read
    assert not third.is_data_available
    b = second.build()
    assert a.to_bytes() == b.to_bytes() == b"event"
    for c in (first, second, third):
        c.close()
    assert rec.recycled == []
    a.release()
    assert rec.recycled == []
    b.release()
    assert len(rec.recycled) == 1


def test_close_is_idempotent_and_a_closed_consumer_refuses_build_and_copy() -> None:
    buf, rec = data_buffer(b"x")
    consumer = BufferConsumer.of_buffer(buf)
    consumer.close()
    consumer.close()
    assert consumer.is_closed
    assert len(rec.recycled) == 1
    with pytest.raises(IllegalStateError, match="closed"):
        consumer.build()
    with pytest.raises(IllegalStateError, match="closed"):
        consumer.copy()


def test_consumer_of_an_event_buffer() -> None:
    buf = Buffer.wrap(b"barrier", DataType.EVENT_BUFFER)
    seg = buf.segment
    consumer = BufferConsumer.of_buffer(buf)
    assert not consumer.is_buffer
    assert consumer.data_type is DataType.EVENT_BUFFER
    assert repr(consumer) == "BufferConsumer(EVENT_BUFFER, size=7, read=False)"
    piece = consumer.build()
    assert piece.to_bytes() == b"barrier"
    assert piece.data_type is DataType.EVENT_BUFFER
    consumer.close()
    assert not seg.is_freed
    piece.release()
    assert seg.is_freed


def test_a_pooled_buffer_goes_back_to_its_pool_once_every_copy_and_slice_is_gone() -> None:
    nbp = NetworkBufferPool(2, 4096)
    pool = nbp.create_buffer_pool(1, 2)
    buf = pool.request_buffer()
    assert buf is not None
    buf.segment.put(0, b"y" * 4096)
    buf.set_size(4096)
    consumers = [BufferConsumer.of_buffer(buf)]
    consumers.append(consumers[0].copy())
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
