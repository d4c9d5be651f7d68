"""Buffer: reference counting, read-only slices, views, and recycling exactly once."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from exchange.buffers import Buffer, DataType, FreeingRecycler
from exchange.errors import IllegalReferenceCountError, UsageError
from exchange.memory import MemorySegment, NetworkBufferPool


class CountingRecycler:
    """Records every segment it gets back."""

    def __init__(self) -> None:
        self.recycled: list[MemorySegment] = []

    def recycle(self, segment: MemorySegment) -> None:
        self.recycled.append(segment)


def make(data: bytes = b"", capacity: int = 64) -> tuple[Buffer, CountingRecycler]:
    seg = MemorySegment.allocate_unpooled(capacity)
    seg.put(0, data)
    rec = CountingRecycler()
    return Buffer(seg, rec, len(data)), rec


def test_new_buffer_holds_one_reference() -> None:
    buf, rec = make(b"hello")
    assert buf.ref_count == 1
    assert not buf.is_recycled
    assert buf.size == 5
    assert buf.data_type is DataType.DATA_BUFFER
    assert buf.is_buffer
    assert not buf.compressed
    assert buf.to_bytes() == b"hello"
    assert repr(buf) == "Buffer(DATA_BUFFER, size=5, refs=1, segment=-1)"
    buf.release()
    assert rec.recycled == [buf.segment]


def test_retain_and_release_recycle_on_the_last_release_only() -> None:
    buf, rec = make(b"x")
    assert buf.retain() is buf
    buf.retain()
    assert buf.ref_count == 3
    buf.release()
    buf.release()
    assert buf.ref_count == 1
    assert rec.recycled == []
    buf.release()
    assert buf.ref_count == 0
    assert buf.is_recycled
    assert rec.recycled == [buf.segment]


def test_released_buffer_refuses_use_and_another_release() -> None:
    buf, rec = make(b"abc")
    buf.release()
    with pytest.raises(IllegalReferenceCountError):
        buf.release()
    with pytest.raises(IllegalReferenceCountError):
        buf.retain()
    with pytest.raises(IllegalReferenceCountError):
        buf.memoryview()
    with pytest.raises(IllegalReferenceCountError):
        buf.read_only_slice()
    assert len(rec.recycled) == 1


@pytest.mark.parametrize("size", [-1, 65])
def test_size_must_fit_the_segment(size: int) -> None:
    seg = MemorySegment.allocate_unpooled(64)
    with pytest.raises(UsageError, match="outside"):
        Buffer(seg, CountingRecycler(), size)
    buf = Buffer(seg, CountingRecycler(), 64)
    with pytest.raises(UsageError, match="outside"):
        buf.set_size(size)
    assert buf.size == 64
    buf.set_size(0)
    assert buf.size == 0


def test_memoryview_is_zero_copy_and_sized() -> None:
    buf, _ = make(b"abcdef")
    view = buf.memoryview()
    assert view.nbytes == 6
    assert bytes(view) == b"abcdef"
    buf.segment.put(0, b"Z")
    assert bytes(view) == b"Zbcdef"
    view[1:2] = b"Y"
    assert buf.segment.get(0, 2) == b"ZY"
    buf.set_size(2)
    assert buf.to_bytes() == b"ZY"
    view.release()
    buf.release()


def test_a_slice_holds_a_reference_on_its_parent() -> None:
    buf, rec = make(b"0123456789")
    piece = buf.read_only_slice(2, 5)
    assert piece.size == 5
    assert piece.to_bytes() == b"23456"
    assert piece.segment is buf.segment
    assert buf.ref_count == 2
    assert piece.ref_count == 2
    buf.release()
    assert rec.recycled == []
    assert piece.to_bytes() == b"23456"
    piece.release()
    assert rec.recycled == [buf.segment]
    assert piece.is_recycled
    with pytest.raises(IllegalReferenceCountError):
        piece.release()
    with pytest.raises(IllegalReferenceCountError):
        piece.memoryview()
    assert len(rec.recycled) == 1


def test_slices_share_one_reference_count() -> None:
    buf, rec = make(b"0123456789")
    piece = buf.read_only_slice(0, 4)
    piece.retain()
    assert buf.ref_count == 3
    assert piece.ref_count == 3
    buf.release()
    piece.release()
    assert buf.ref_count == 1
    assert rec.recycled == []
    piece.release()
    assert buf.ref_count == 0
    assert rec.recycled == [buf.segment]


def test_slice_of_a_slice_is_relative_and_refers_to_the_root() -> None:
    buf, rec = make(b"0123456789")
    outer = buf.read_only_slice(2, 6)  # 234567
    inner = outer.read_only_slice(1, 3)  # 345
    assert inner.to_bytes() == b"345"
    assert buf.ref_count == 3
    buf.release()
    outer.release()
    assert rec.recycled == []
    assert inner.to_bytes() == b"345"
    inner.release()
    assert len(rec.recycled) == 1


def test_default_slice_is_the_rest_of_the_buffer() -> None:
    buf, _ = make(b"abcdef")
    assert buf.read_only_slice().to_bytes() == b"abcdef"
    assert buf.read_only_slice(4).to_bytes() == b"ef"
    assert buf.read_only_slice(6).to_bytes() == b""
    assert buf.read_only_slice(6).size == 0


@pytest.mark.parametrize(
    ("offset", "length"),
    [(-1, 1), (0, -1), (0, 7), (7, None), (6, 1), (3, 4)],
)
def test_slice_bounds(offset: int, length: int | None) -> None:
    buf, rec = make(b"abcdef")
    with pytest.raises(UsageError, match="outside buffer of 6"):
        buf.read_only_slice(offset, length)
    assert buf.ref_count == 1  # a refused slice takes no reference
    buf.release()
    assert len(rec.recycled) == 1


def test_slice_is_read_only_in_size_and_keeps_type_and_compression() -> None:
    buf, _ = make(b"abcdef")
    buf.compressed = True
    piece = buf.read_only_slice(1, 2)
    assert piece.compressed
    assert piece.data_type is DataType.DATA_BUFFER
    with pytest.raises(UsageError, match="read-only slice"):
        piece.set_size(1)
    assert piece.size == 2


def test_wrap_copies_and_frees_on_release() -> None:
    data = bytearray(b"event!")
    buf = Buffer.wrap(data, DataType.EVENT_BUFFER)
    data[0:1] = b"X"
    assert buf.to_bytes() == b"event!"
    assert buf.data_type is DataType.EVENT_BUFFER
    assert not buf.is_buffer
    assert not buf.segment.is_pooled
    seg = buf.segment
    buf.release()
    assert seg.is_freed
    empty = Buffer.wrap(b"", DataType.EVENT_BUFFER)
    assert empty.size == 0
    assert empty.segment.size == 1
    empty.release()
    assert Buffer.wrap(memoryview(b"mv"), DataType.DATA_BUFFER).to_bytes() == b"mv"


def test_freeing_recycler_frees_unpooled_segments() -> None:
    seg = MemorySegment.allocate_unpooled(8)
    FreeingRecycler.recycle(seg)
    assert seg.is_freed


def test_pooled_buffer_goes_back_to_its_pool_once() -> None:
    nbp = NetworkBufferPool(2, 4096)
    pool = nbp.create_buffer_pool(1, 2)
    buf = pool.request_buffer()
    assert buf is not None
    pieces = [buf.read_only_slice() for _ in range(3)]
    buf.release()
    for p in pieces[:-1]:
        p.release()
    assert pool.num_in_use == 1
    pieces[-1].release()
    assert pool.num_in_use == 0
    assert pool.num_available == 1
    with pytest.raises(IllegalReferenceCountError):
        pieces[-1].release()
    with pytest.raises(IllegalReferenceCountError):
        buf.release()
    assert pool.num_available == 1
    pool.destroy()
    nbp.check_consistency()
    assert nbp.is_whole()
    nbp.destroy()


@given(ops=st.lists(st.tuples(st.sampled_from(["retain", "slice", "release"]), st.integers())))
@settings(max_examples=80, deadline=None)
def test_any_sequence_recycles_exactly_when_the_last_reference_goes(
    ops: list[tuple[str, int]],
) -> None:
    buf, rec = make(b"0123456789")
    handles = [buf]  # one entry per reference held
    for op, n in ops:
        if not handles:
            break
        h = handles[n % len(handles)]
        if op == "retain":
            handles.append(h.retain())
        elif op == "slice":
            handles.append(h.read_only_slice(h.size // 2))
        else:
            handles.remove(h)
            h.release()
        assert rec.recycled == ([] if handles else [buf.segment])
        if handles:
            assert buf.ref_count == len(handles)
    while handles:
        handles.pop().release()
    assert rec.recycled == [buf.segment]
