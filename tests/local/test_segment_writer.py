"""The producer's compiled per-buffer loop (exchange/local/segment_writer.pyx): granted
segments oldest first, each data buffer's pieces copied into one, the CommitSegments frame
byte for byte what the codec encodes, and the typed errors of bad grants and bad buffers.
The path through a real daemon is tests/daemon/test_shared_memory.py's."""

from __future__ import annotations

import ctypes
import mmap
import os
import struct
from collections.abc import Iterator

import pytest

from exchange.buffers.buffer import DataType
from exchange.errors import ProtocolError, UsageError
from exchange.local.segment_writer import SegmentWriter
from exchange.protocol.codec import encode
from exchange.protocol.local_messages import CommitSegments
from exchange.writer.record_writer import OutputBuffer

SEG = 64
DATA = DataType.DATA_BUFFER


@pytest.fixture
def arena() -> Iterator[mmap.mmap]:
    m = mmap.mmap(-1, 8 * SEG)
    yield m
    m.close()


def data(target: int, payload: bytes, *, mid: bool = False, split: int = 0) -> OutputBuffer:
    pieces: list[memoryview | bytes] = (
        [memoryview(payload[:split]), payload[split:]] if split else [payload]
    )
    return OutputBuffer(target, DATA, len(payload), pieces, mid)


def event() -> OutputBuffer:
    return OutputBuffer(0xFFFFFFFF, DataType.EVENT_BUFFER, 3, [b"evt"])


def frame(commits: list[tuple[int, int, int]]) -> bytes:
    return b"".join(bytes(p) for p in encode(CommitSegments(tuple(commits))))


def test_a_run_of_buffers_lands_in_the_oldest_segments_with_one_commit_frame(
    arena: mmap.mmap,
) -> None:
    w = SegmentWriter()
    w.grant((5, 2))  # granted before the arena is mapped (SharedArena), then more
    w.attach(arena, SEG)
    w.grant((7,))
    outs = [data(1, b"a" * 10, mid=True), data(3, b"bc" * 20, split=7), data(1, b"z" * SEG)]
    mid: set[int] = {3}
    assert w.fill(outs, 0, 3, mid) == 3
    assert mid == set()  # 1's record went on, then ended; 3's ended
    assert arena[5 * SEG : 5 * SEG + 10] == b"a" * 10
    assert arena[2 * SEG : 2 * SEG + 40] == b"bc" * 20
    assert arena[7 * SEG : 8 * SEG] == b"z" * SEG
    assert w.take_commits() == frame([(5, 10, 1), (2, 40, 3), (7, SEG, 1)])
    assert w.take_commits() is None and len(w) == 0
    assert w.bytes_shared == 10 + 40 + SEG
    w.detach()


def test_the_ends_of_records_are_tracked_per_target(arena: mmap.mmap) -> None:
    w = SegmentWriter()
    w.attach(arena, SEG)
    w.grant(range(3))
    mid: set[int] = set()
    w.fill([data(1, b"x", mid=True), data(2, b"y", mid=True)], 0, 2, mid)
    assert mid == {1, 2}
    w.fill([data(2, b"y")], 0, 1, mid)
    assert mid == {1}
    w.detach()


def test_it_stops_at_an_event_and_where_credit_ends(arena: mmap.mmap) -> None:
    w = SegmentWriter()
    w.attach(arena, SEG)
    w.grant(range(4))
    outs = [data(0, b"1"), event(), data(0, b"2"), data(0, b"3"), data(0, b"4")]
    assert w.fill(outs, 0, 4, set()) == 1  # the event goes as PushBuffer, after this commit
    assert w.take_commits() == frame([(0, 1, 0)])
    assert w.fill(outs, 2, 2, set()) == 4  # two credits: two buffers
    assert w.granted() == [3]
    assert w.fill(outs, 4, 0, set()) == 4
    assert w.take_commits() == frame([(1, 1, 0), (2, 1, 0)])
    w.detach()


def test_many_grants_keep_their_order_across_the_ring_growing(arena: mmap.mmap) -> None:
    w = SegmentWriter()
    w.attach(arena, 1)  # 512 one-byte segments
    order = [(i * 37) % 512 for i in range(512)]
    for k in range(0, 512, 50):
        w.grant(order[k : k + 50])
        if k % 100 == 0:  # write some between grants: the ring wraps, then grows
            w.fill([data(0, b"q")], 0, 1, set())
    assert w.granted() == order[6:]  # one written per 100 granted, oldest first
    assert w.take_commits() == frame([(s, 1, 0) for s in order[:6]])
    w2 = SegmentWriter()
    w2.attach(arena, 1)
    w2.grant(range(60))
    assert w2.fill([data(0, b"q")] * 50, 0, 50, set()) == 50
    w2.grant(range(100, 110))  # wraps around the ring's end without growing
    assert w2.granted() == [*range(50, 60), *range(100, 110)]
    assert w2.fill([data(0, b"q")] * 20, 0, 20, set()) == 20
    assert len(w2.take_commits() or b"") == 9 + 70 * 12
    w2.detach()
    w.detach()


def test_a_grant_outside_the_arena_is_a_protocol_error(arena: mmap.mmap) -> None:
    w = SegmentWriter()
    w.grant((8,))  # before the mapping: checked when the arena is attached
    with pytest.raises(ProtocolError, match="outside the arena"):
        w.attach(arena, SEG)
    assert not w.mapped
    w2 = SegmentWriter()
    w2.attach(arena, SEG)
    for bad in (8, -1, 2**32):
        with pytest.raises(ProtocolError, match="outside the arena"):
            w2.grant((bad,))
    w2.detach()


def test_credit_without_a_granted_segment_is_a_protocol_error(arena: mmap.mmap) -> None:
    w = SegmentWriter()
    w.attach(arena, SEG)
    with pytest.raises(ProtocolError, match="without a granted segment"):
        w.fill([data(0, b"x")], 0, 1, set())
    w.detach()


@pytest.mark.parametrize(
    "out",
    [
        OutputBuffer(0, DATA, SEG + 1, [b"x" * (SEG + 1)]),  # larger than a segment
        OutputBuffer(0, DATA, 4, [b"xx", b"yyy"]),  # pieces beyond the size
        OutputBuffer(0, DATA, 4, [b"xyz"]),  # pieces short of it
    ],
)
def test_a_buffer_that_does_not_fit_is_a_usage_error(arena: mmap.mmap, out: OutputBuffer) -> None:
    w = SegmentWriter()
    w.attach(arena, SEG)
    w.grant((0,))
    with pytest.raises(UsageError):
        w.fill([out], 0, 1, set())
    w.detach()


def test_without_an_arena_nothing_is_written_and_the_mapping_can_close() -> None:
    w = SegmentWriter()
    w.grant((0,))
    with pytest.raises(UsageError, match="no shared arena"):
        w.fill([data(0, b"x")], 0, 1, set())
    m = mmap.mmap(-1, SEG)
    w.attach(m, SEG)
    with pytest.raises(BufferError):
        m.close()  # the writer holds the mapping until detached
    w.detach()
    w.detach()  # idempotent
    m.close()
    assert not w.mapped and w.granted() == [0]


def _mapped_here(view: mmap.mmap, offset: int) -> bool:
    """Whether this process has the page at ``offset`` of ``view`` mapped (the present
    bit of /proc/self/pagemap, readable without privileges)."""
    address = ctypes.addressof(ctypes.c_char.from_buffer(view)) + offset
    with open("/proc/self/pagemap", "rb") as f:
        f.seek(address // mmap.PAGESIZE * 8)
        (entry,) = struct.unpack("<Q", f.read(8))
    return bool(entry >> 63)


def test_granted_segments_are_mapped_in_before_their_first_write() -> None:
    # A shared file mapping, as the arena: this process has none of its pages mapped
    # until it touches them (a fault per page on the first write).
    big = 32 * 1024  # the daemon's segment: whole pages
    fd = os.memfd_create("arena")
    try:
        os.ftruncate(fd, 16 * big)
        arena = mmap.mmap(fd, 16 * big, mmap.MAP_SHARED)
    finally:
        os.close(fd)
    w = SegmentWriter()
    w.grant((2,))
    w.attach(arena, big)  # what was granted before the mapping is mapped in with it
    w.grant((5, 6, 7, 12, 6))  # 6 twice: once is enough
    assert [_mapped_here(arena, s * big) for s in (2, 5, 6, 7, 12)] == [True] * 5
    assert not _mapped_here(arena, 9 * big)  # not granted: left alone
    assert w.populated == 5
    w.detach()
    arena.close()
