"""MemorySegment: bounds, views, freeing; and the segments a NetworkBufferPool carves out."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from exchange.errors import SegmentFreedError, UsageError
from exchange.memory import MemorySegment, NetworkBufferPool


def test_unpooled_segment_is_zeroed_writable_and_unindexed() -> None:
    seg = MemorySegment.allocate_unpooled(16)
    assert seg.size == 16
    assert seg.index == -1
    assert not seg.is_pooled
    assert not seg.is_freed
    assert seg.get(0, 16) == bytes(16)
    view = seg.view()
    assert not view.readonly
    assert view.nbytes == 16


@pytest.mark.parametrize("size", [0, -1, 1.5, "16", None])
def test_unpooled_segment_rejects_bad_sizes(size: object) -> None:
    with pytest.raises(UsageError, match="positive int"):
        MemorySegment.allocate_unpooled(size)  # type: ignore[arg-type]


def test_put_then_get_round_trips_and_leaves_the_rest_alone() -> None:
    seg = MemorySegment.allocate_unpooled(10)
    seg.put(3, b"abcd")
    assert seg.get(3, 4) == b"abcd"
    assert seg.get(0, 10) == b"\x00\x00\x00abcd\x00\x00\x00"
    seg.put(0, bytearray(b"xy"))
    seg.put(8, memoryview(b"zz"))
    assert seg.get(0, 10) == b"xy\x00abcd\x00zz"


def test_get_returns_a_copy_not_a_view() -> None:
    seg = MemorySegment.allocate_unpooled(4)
    seg.put(0, b"abcd")
    copy = seg.get(0, 4)
    seg.put(0, b"wxyz")
    assert copy == b"abcd"


@pytest.mark.parametrize(
    ("offset", "length"),
    [(-1, 1), (0, -1), (0, 11), (10, 1), (5, 6), (11, 0)],
)
def test_out_of_range_access_raises_index_error(offset: int, length: int) -> None:
    seg = MemorySegment.allocate_unpooled(10)
    with pytest.raises(IndexError, match="outside segment of 10 bytes"):
        seg.get(offset, length)
    if length >= 0:
        with pytest.raises(IndexError):
            seg.put(offset, bytes(length))


def test_edge_ranges_are_allowed() -> None:
    seg = MemorySegment.allocate_unpooled(10)
    assert seg.get(10, 0) == b""
    seg.put(10, b"")
    seg.put(0, bytes(range(10)))
    assert seg.get(9, 1) == b"\x09"


@given(
    size=st.integers(1, 64),
    offset=st.integers(-4, 70),
    data=st.binary(max_size=70),
)
@settings(max_examples=60, deadline=None)
def test_put_either_fits_or_raises_and_never_writes_partially(
    size: int, offset: int, data: bytes
) -> None:
    seg = MemorySegment.allocate_unpooled(size)
    before = seg.get(0, size)
    if offset >= 0 and offset + len(data) <= size:
        seg.put(offset, data)
        assert seg.get(offset, len(data)) == data
    else:
        with pytest.raises(IndexError):
            seg.put(offset, data)
        assert seg.get(0, size) == before


def test_free_makes_every_use_raise() -> None:
    seg = MemorySegment.allocate_unpooled(8)
    seg.free()
    assert seg.is_freed
    assert seg.size == 8
    with pytest.raises(SegmentFreedError):
        seg.view()
    with pytest.raises(SegmentFreedError):
        seg.get(0, 1)
    with pytest.raises(SegmentFreedError):
        seg.put(0, b"x")
    with pytest.raises(SegmentFreedError, match="freed twice"):
        seg.free()
    assert "freed" in repr(seg)


def test_rejects_read_only_and_non_flat_views() -> None:
    with pytest.raises(UsageError, match="writable"):
        MemorySegment(memoryview(b"abcd"))
    with pytest.raises(UsageError, match="flat byte view"):
        MemorySegment(memoryview(bytearray(8)).cast("I"))
    with pytest.raises(UsageError, match="flat byte view"):
        MemorySegment(memoryview(bytearray(8)).cast("B", (2, 4)))


def test_segment_writes_through_to_its_backing_memory() -> None:
    backing = bytearray(8)
    seg = MemorySegment(memoryview(backing)[2:6], index=7)
    assert seg.index == 7
    assert seg.is_pooled
    assert seg.size == 4
    seg.put(0, b"WXYZ")
    assert backing == bytearray(b"\x00\x00WXYZ\x00\x00")
    assert repr(seg) == "MemorySegment(index=7, 4B)"


def test_pool_segments_are_distinct_non_overlapping_windows() -> None:
    nbp = NetworkBufferPool(8, 4096)
    segs = [nbp.request_memory_segment() for _ in range(8)]
    assert all(s is not None for s in segs)
    got = [s for s in segs if s is not None]
    assert sorted(s.index for s in got) == list(range(8))
    assert all(s.size == 4096 and s.is_pooled for s in got)
    assert nbp.request_memory_segment() is None
    for s in got:
        s.put(0, bytes([s.index + 1]) * 4096)
    for s in got:
        assert s.get(0, 4096) == bytes([s.index + 1]) * 4096
    for s in got:
        nbp.recycle(s)
    nbp.check_consistency()
    assert nbp.is_whole()
    nbp.destroy()
    assert all(s.is_freed for s in got)
