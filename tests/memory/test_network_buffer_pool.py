"""NetworkBufferPool: construction limits, redistribution, exclusive segments, destroy."""

from __future__ import annotations

import asyncio
from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from exchange.buffers import Buffer
from exchange.errors import (
    BufferRequestTimeoutError,
    IllegalStateError,
    InsufficientBuffersError,
    PoolDestroyedError,
    SegmentFreedError,
    UsageError,
)
from exchange.memory import LocalBufferPool, MemorySegment, NetworkBufferPool, NotificationResult

SEG = 4096


def assert_whole(nbp: NetworkBufferPool) -> None:
    nbp.check_consistency()
    assert nbp.num_available == nbp.total_segments
    assert nbp.num_in_use == 0
    assert nbp.num_required == 0
    assert nbp.is_whole()


async def settle() -> None:
    """Let woken tasks run (wait_for adds a few hops between a future and its waiter)."""
    for _ in range(5):
        await asyncio.sleep(0)


def sizes(nbp: NetworkBufferPool) -> list[int]:
    return [p.current_pool_size for p in nbp.local_pools]


def expected_spare_sum(nbp: NetworkBufferPool) -> int:
    """What redistribution must hand out beyond the required segments, exactly."""
    spare = nbp.total_segments - nbp.num_required
    if spare == 0:
        return 0
    capacity = sum(min(spare, p.max_segments - p.num_required) for p in nbp.local_pools)
    return min(spare, capacity)


def check_redistribution(nbp: NetworkBufferPool) -> None:
    pools = nbp.local_pools
    spare = nbp.total_segments - nbp.num_required
    shares = [p.current_pool_size - p.num_required for p in pools]
    assert all(s >= 0 for s in shares)
    assert all(p.current_pool_size <= p.max_segments for p in pools)
    assert sum(shares) == expected_spare_sum(nbp)
    exclusive = nbp.num_required - sum(p.num_required for p in pools)
    assert sum(p.current_pool_size for p in pools) <= nbp.total_segments - exclusive
    if spare == 0:
        assert shares == [0] * len(pools)
        return
    caps = [min(spare, p.max_segments - p.num_required) for p in pools]
    total_cap = sum(caps)
    if total_cap == 0:
        return
    to_distribute = min(spare, total_cap)
    for share, cap in zip(shares, caps, strict=True):
        exact = Fraction(to_distribute * cap, total_cap)
        assert abs(share - exact) < 1, (share, exact, shares, caps)


# -- construction ---------------------------------------------------------------------------


def test_defaults_and_stats() -> None:
    nbp = NetworkBufferPool(16, 8192)
    assert nbp.stats() == (16, 16, 0, 8192, 0, 0, 0)
    assert nbp.stats().available_segments == 16
    assert nbp.is_available
    assert repr(nbp) == "NetworkBufferPool(16/16 available, 8192B segments, 0 local pools)"
    assert_whole(nbp)
    nbp.destroy()


@pytest.mark.parametrize("total", [0, -1, 1.5, "8", True, None])
def test_rejects_bad_total(total: object) -> None:
    with pytest.raises(UsageError, match="total_segments"):
        NetworkBufferPool(total, SEG)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "size",
    [0, -4096, 1, 2048, 4095, 4097, 6144, 12288, 3 * 4096, 32 * 1024 * 1024, 4096.0, "4096", False],
)
def test_rejects_bad_segment_size(size: object) -> None:
    with pytest.raises(UsageError, match="segment_size"):
        NetworkBufferPool(4, size)  # type: ignore[arg-type]


@pytest.mark.parametrize("size", [4096, 8192, 32 * 1024, 16 * 1024 * 1024])
def test_accepts_powers_of_two_from_4_kib(size: int) -> None:
    nbp = NetworkBufferPool(1, size)
    seg = nbp.request_memory_segment()
    assert seg is not None and seg.size == size
    nbp.recycle(seg)
    assert_whole(nbp)
    nbp.destroy()


@pytest.mark.parametrize("timeout", [0, -1.0])
def test_rejects_bad_request_timeout(timeout: float) -> None:
    with pytest.raises(UsageError, match="request_timeout"):
        NetworkBufferPool(4, SEG, request_timeout=timeout)


# -- redistribution -------------------------------------------------------------------------


def test_redistribution_concrete_example() -> None:
    nbp = NetworkBufferPool(100, SEG)
    a = nbp.create_buffer_pool(10, 20)
    # alone: 90 spare, but it can take only 10 more
    assert a.current_pool_size == 20
    b = nbp.create_buffer_pool(10, 1000)
    # 80 spare, capacities 10 and 80 -> 80*10//90 = 8 and 80 - 8 = 72
    assert sizes(nbp) == [18, 82]
    assert nbp.num_required == 20
    check_redistribution(nbp)
    # 30 exclusive segments: 50 spare, capacities 10 and 50 -> 50*10//60 = 8, 42
    segs = nbp.request_memory_segments_nowait(30)
    assert len(segs) == 30
    assert sizes(nbp) == [18, 52]
    assert nbp.num_required == 50
    check_redistribution(nbp)
    nbp.recycle_memory_segments(segs)
    assert sizes(nbp) == [18, 82]
    a.destroy()
    assert sizes(nbp) == [100]
    assert b.current_pool_size == 100
    b.destroy()
    assert_whole(nbp)
    nbp.destroy()


def test_redistribution_splits_evenly_and_hands_out_the_remainder() -> None:
    nbp = NetworkBufferPool(10, SEG)
    pools = [nbp.create_buffer_pool(1, 100) for _ in range(3)]
    # 7 spare over three equal capacities: 7*7//21=2, 7*14//21-2=2, 7-4=3
    assert sizes(nbp) == [3, 3, 4]
    check_redistribution(nbp)
    pools[1].destroy()
    # 8 spare over two: 4 and 4
    assert sizes(nbp) == [5, 5]
    for p in (pools[0], pools[2]):
        p.destroy()
    assert_whole(nbp)
    nbp.destroy()


def test_no_spare_segments_means_every_pool_at_its_required_size() -> None:
    nbp = NetworkBufferPool(10, SEG)
    a = nbp.create_buffer_pool(3, 10)
    b = nbp.create_buffer_pool(7, 10)
    assert sizes(nbp) == [3, 7]
    assert nbp.num_required == 10
    with pytest.raises(InsufficientBuffersError):
        nbp.create_buffer_pool(1, 1)
    # a pool with nothing required still fits, at size 0
    c = nbp.create_buffer_pool(0, 5)
    assert c.current_pool_size == 0
    assert c.request_buffer() is None
    b.destroy()
    # 7 spare: capacities min(7,7)=7 and min(7,5)=5 -> 7*7//12 = 4, 7 - 4 = 3
    assert sizes(nbp) == [7, 3]
    for p in (a, c):
        p.destroy()
    assert_whole(nbp)
    nbp.destroy()


def test_fixed_size_pools_do_not_take_spare_segments() -> None:
    nbp = NetworkBufferPool(10, SEG)
    a = nbp.create_buffer_pool(2, 2)
    b = nbp.create_buffer_pool(3, 3)
    assert sizes(nbp) == [2, 3]
    check_redistribution(nbp)
    c = nbp.create_buffer_pool(0, 1)
    assert sizes(nbp) == [2, 3, 1]
    for p in (a, b, c):
        p.destroy()
    assert_whole(nbp)
    nbp.destroy()


@st.composite
def pool_ops(draw: st.DrawFn) -> list[tuple[str, int, int]]:
    ops = []
    for _ in range(draw(st.integers(1, 14))):
        kind = draw(st.sampled_from(["create", "create", "create", "destroy", "exclusive"]))
        required = draw(st.integers(0, 12))
        extra = draw(st.one_of(st.integers(0, 30), st.just(10_000)))
        ops.append((kind, required, extra))
    return ops


@given(total=st.integers(1, 64), ops=pool_ops())
@settings(max_examples=150, deadline=None)
def test_redistribution_is_exact_and_proportional(
    total: int, ops: list[tuple[str, int, int]]
) -> None:
    nbp = NetworkBufferPool(total, SEG)
    live: list[LocalBufferPool] = []
    exclusive: list[list[MemorySegment]] = []
    for kind, required, extra in ops:
        if kind == "create":
            max_segments = max(required, 1) + extra
            if nbp.num_required + required > total:
                with pytest.raises(InsufficientBuffersError):
                    nbp.create_buffer_pool(required, max_segments)
            else:
                live.append(nbp.create_buffer_pool(required, max_segments))
        elif kind == "destroy" and live:
            live.pop(required % len(live)).destroy()
        elif kind == "exclusive" and required > 0:
            if nbp.num_required + required <= total:
                # nothing is requested from the local pools, so all segments are available
                exclusive.append(nbp.request_memory_segments_nowait(required))
            else:
                with pytest.raises(InsufficientBuffersError):
                    nbp.request_memory_segments_nowait(required)
        assert nbp.local_pools == live
        check_redistribution(nbp)
        nbp.check_consistency()
    for segs in exclusive:
        nbp.recycle_memory_segments(segs)
        check_redistribution(nbp)
    for p in live:
        p.destroy()
        check_redistribution(nbp)
    assert_whole(nbp)
    nbp.destroy()


# -- errors ---------------------------------------------------------------------------------


def test_insufficient_buffers_error_names_numbers_and_setting() -> None:
    nbp = NetworkBufferPool(10, SEG)
    with pytest.raises(InsufficientBuffersError) as err:
        nbp.create_buffer_pool(11, 20)
    assert (err.value.required, err.value.available, err.value.total) == (11, 10, 10)
    assert err.value.setting == "network_memory"
    assert str(err.value) == (
        "insufficient number of network buffers: required 11, but only 10 available "
        "(of 10 in total); increase 'network_memory'"
    )
    a = nbp.create_buffer_pool(4, 8)
    with pytest.raises(InsufficientBuffersError) as err:
        nbp.create_buffer_pool(7, 7)
    assert (err.value.required, err.value.available) == (7, 6)
    assert "required 7, but only 6 available" in str(err.value)
    assert "network_memory" in str(err.value)
    with pytest.raises(InsufficientBuffersError) as err:
        nbp.request_memory_segments_nowait(7)
    assert (err.value.required, err.value.available) == (7, 6)
    # nothing changed by the failures
    assert nbp.num_required == 4
    assert sizes(nbp) == [8]
    a.destroy()
    assert_whole(nbp)
    nbp.destroy()


@pytest.mark.parametrize(
    ("required", "max_segments"),
    [(-1, 5), (2, 1), (0, 0), (3, -3), (1.5, 4), ("1", 4), (1, 4.0), (None, 4)],
)
def test_create_buffer_pool_rejects_bad_sizes(required: object, max_segments: object) -> None:
    nbp = NetworkBufferPool(8, SEG)
    with pytest.raises(UsageError):
        nbp.create_buffer_pool(required, max_segments)  # type: ignore[arg-type]
    assert nbp.local_pools == []
    assert_whole(nbp)
    nbp.destroy()


@pytest.mark.parametrize("num", [0, -1, 1.5, "2", None])
def test_exclusive_requests_reject_bad_counts(num: object) -> None:
    nbp = NetworkBufferPool(8, SEG)
    with pytest.raises(UsageError, match="positive"):
        nbp.request_memory_segments_nowait(num)  # type: ignore[arg-type]
    with pytest.raises(UsageError, match="positive"):
        asyncio.run(nbp.request_memory_segments(num))  # type: ignore[arg-type]
    assert_whole(nbp)
    nbp.destroy()


def test_exclusive_request_timeout_must_be_positive() -> None:
    nbp = NetworkBufferPool(8, SEG)
    with pytest.raises(UsageError, match="timeout"):
        asyncio.run(nbp.request_memory_segments(1, timeout=0))
    assert_whole(nbp)
    nbp.destroy()


def test_recycle_twice_raises_and_pool_stays_consistent() -> None:
    nbp = NetworkBufferPool(4, SEG)
    seg = nbp.request_memory_segment()
    assert seg is not None
    nbp.recycle(seg)
    with pytest.raises(IllegalStateError, match="recycled twice"):
        nbp.recycle(seg)
    assert_whole(nbp)
    segs = nbp.request_memory_segments_nowait(2)
    nbp.recycle_memory_segments(segs)
    with pytest.raises(IllegalStateError, match="recycled twice"):
        nbp.recycle_memory_segments(segs)
    assert_whole(nbp)
    nbp.destroy()


def test_recycling_a_foreign_segment_raises() -> None:
    nbp = NetworkBufferPool(4, SEG)
    other = NetworkBufferPool(4, SEG)
    theirs = other.request_memory_segment()
    assert theirs is not None
    with pytest.raises(UsageError, match="does not belong"):
        nbp.recycle(theirs)
    with pytest.raises(UsageError, match="does not belong"):
        nbp.recycle(MemorySegment.allocate_unpooled(SEG))
    with pytest.raises(UsageError, match="does not belong"):
        nbp.recycle(MemorySegment(memoryview(bytearray(SEG)), index=99))
    assert_whole(nbp)
    other.recycle(theirs)
    assert_whole(other)
    for p in (nbp, other):
        p.destroy()


def test_a_rejected_exclusive_batch_changes_nothing() -> None:
    """A batch with a foreign or repeated segment is refused as a whole and can be retried."""
    nbp = NetworkBufferPool(4, SEG)
    segs = nbp.request_memory_segments_nowait(2)
    foreign = MemorySegment.allocate_unpooled(SEG)
    with pytest.raises(UsageError, match="does not belong"):
        nbp.recycle_memory_segments([segs[0], foreign])
    with pytest.raises(IllegalStateError, match="recycled twice"):
        nbp.recycle_memory_segments([segs[1], segs[1]])
    nbp.check_consistency()
    assert nbp.num_in_use == 2
    assert nbp.num_required == 2
    nbp.recycle_memory_segments(segs)
    assert_whole(nbp)
    nbp.destroy()


def test_exclusive_nowait_takes_segments_and_counts_them_as_required() -> None:
    nbp = NetworkBufferPool(8, SEG)
    pool = nbp.create_buffer_pool(2, 8)
    assert pool.current_pool_size == 8
    segs = nbp.request_memory_segments_nowait(5)
    assert len({s.index for s in segs}) == 5
    assert nbp.num_required == 7
    assert nbp.num_available == 3
    assert pool.current_pool_size == 3
    with pytest.raises(InsufficientBuffersError):
        nbp.request_memory_segments_nowait(2)
    nbp.recycle_memory_segments(segs[:3])
    assert nbp.num_required == 4
    assert pool.current_pool_size == 6
    nbp.recycle_memory_segments(segs[3:])
    pool.destroy()
    assert_whole(nbp)
    nbp.destroy()


def test_exclusive_nowait_fails_when_local_pools_hold_the_segments() -> None:
    nbp = NetworkBufferPool(4, SEG)
    pool = nbp.create_buffer_pool(1, 4)
    held = [pool.request_buffer() for _ in range(4)]
    assert all(b is not None for b in held)
    with pytest.raises(InsufficientBuffersError) as err:
        nbp.request_memory_segments_nowait(2)
    assert (err.value.required, err.value.available) == (2, 0)
    # the reservation was rolled back: the pool got its full size back
    assert nbp.num_required == 1
    assert pool.current_pool_size == 4
    for b in held:
        assert b is not None
        b.release()
    assert pool.num_available == 4
    pool.destroy()
    assert_whole(nbp)
    nbp.destroy()


class TakingListener:
    def __init__(self) -> None:
        self.held: list[Buffer] = []

    def notify_buffer_available(self, buffer: Buffer) -> NotificationResult:
        self.held.append(buffer)
        return NotificationResult.BUFFER_USED_NO_NEED_MORE

    def notify_buffer_destroyed(self) -> None:
        pass


def test_segments_freed_by_a_shrink_do_not_go_to_a_pool_about_to_shrink() -> None:
    """Redistribution sets every size before waiting pools are served from what came back."""
    nbp = NetworkBufferPool(2, SEG)
    a = nbp.create_buffer_pool(0, 2)
    b = nbp.create_buffer_pool(0, 2)
    assert sizes(nbp) == [1, 1]
    buf = a.request_buffer()
    assert buf is not None
    buf.release()
    assert (a.num_requested, a.num_available) == (1, 1)
    listener = TakingListener()
    assert b.add_buffer_listener(listener)  # b may still request one: it waits on the pool
    # reserving both segments shrinks a (its queued segment comes back) and then b to 0
    segs = nbp.request_memory_segments_nowait(2)
    assert len(segs) == 2
    assert sizes(nbp) == [0, 0]
    assert (a.num_requested, b.num_requested) == (0, 0)
    assert listener.held == []
    nbp.recycle_memory_segments(segs)
    assert sizes(nbp) == [1, 1]
    for p in (a, b):
        p.destroy()
    for x in listener.held:
        x.release()
    assert_whole(nbp)
    nbp.destroy()


# -- exclusive requests that wait -------------------------------------------------------------


@pytest.mark.asyncio
async def test_exclusive_request_waits_for_a_shrinking_local_pool() -> None:
    nbp = NetworkBufferPool(8, SEG)
    pool = nbp.create_buffer_pool(1, 8)
    held = [pool.request_buffer() for _ in range(8)]
    bufs = [b for b in held if b is not None]
    assert len(bufs) == 8
    task = asyncio.create_task(nbp.request_memory_segments(4, timeout=5.0))
    await asyncio.sleep(0)
    assert not task.done()
    # reserving 4 shrank the pool to 1 + 3 spare
    assert nbp.num_required == 5
    assert pool.current_pool_size == 4
    for b in bufs[:3]:
        b.release()
    await settle()
    assert not task.done()
    assert nbp.num_available == 0  # the waiting request took all three
    assert pool.num_requested == 5
    bufs[3].release()
    segs = await asyncio.wait_for(task, 10)
    assert len(segs) == 4
    assert len({s.index for s in segs}) == 4
    assert pool.num_requested == 4
    # back within its size: the next release stays in the local pool
    bufs[4].release()
    assert pool.num_available == 1
    assert nbp.num_available == 0
    nbp.check_consistency()
    for b in bufs[5:]:
        b.release()
    nbp.recycle_memory_segments(segs)
    assert pool.current_pool_size == 8
    pool.destroy()
    assert_whole(nbp)
    nbp.destroy()


@pytest.mark.asyncio
async def test_exclusive_request_that_is_served_at_once_does_not_wait() -> None:
    nbp = NetworkBufferPool(8, SEG)
    segs = await asyncio.wait_for(nbp.request_memory_segments(8), 10)
    assert sorted(s.index for s in segs) == list(range(8))
    assert not nbp.is_available
    nbp.recycle_memory_segments(segs)
    assert nbp.is_available
    assert_whole(nbp)
    nbp.destroy()


@pytest.mark.asyncio
async def test_exclusive_request_times_out_and_gives_back_what_it_got() -> None:
    nbp = NetworkBufferPool(4, SEG)
    pool = nbp.create_buffer_pool(1, 4)
    held = [pool.request_buffer() for _ in range(4)]
    bufs = [b for b in held if b is not None]
    assert len(bufs) == 4
    task = asyncio.create_task(nbp.request_memory_segments(3, timeout=0.05))
    await asyncio.sleep(0)
    assert pool.current_pool_size == 1
    bufs[0].release()  # goes global, the request takes it
    await settle()
    assert nbp.num_available == 0
    with pytest.raises(BufferRequestTimeoutError) as err:
        await asyncio.wait_for(task, 10)
    assert isinstance(err.value, TimeoutError)
    assert err.value.requested == 3
    assert err.value.available == 1
    assert err.value.timeout == 0.05
    assert err.value.setting == "network_memory"
    assert "network_memory" in str(err.value)
    assert "waiting for 3 network buffers" in str(err.value)
    # rolled back: the segment it had is back, the pool has its full size again
    assert nbp.num_required == 1
    assert nbp.num_available == 1
    assert pool.current_pool_size == 4
    nbp.check_consistency()
    for b in bufs[1:]:
        b.release()
    pool.destroy()
    assert_whole(nbp)
    nbp.destroy()


@pytest.mark.asyncio
async def test_exclusive_request_beyond_the_unreserved_segments_fails_at_once() -> None:
    nbp = NetworkBufferPool(4, SEG)
    first = nbp.request_memory_segments_nowait(3)
    with pytest.raises(InsufficientBuffersError) as err:
        await asyncio.wait_for(nbp.request_memory_segments(2, timeout=60.0), 10)  # at once
    assert (err.value.required, err.value.available) == (2, 1)
    assert nbp.num_required == 3
    nbp.recycle_memory_segments(first)
    assert_whole(nbp)
    nbp.destroy()


@pytest.mark.asyncio
async def test_cancelled_exclusive_request_rolls_back() -> None:
    nbp = NetworkBufferPool(4, SEG)
    first = nbp.request_memory_segments_nowait(3)
    pool = nbp.create_buffer_pool(0, 4)
    assert pool.current_pool_size == 1
    b = pool.request_buffer()
    assert b is not None
    task = asyncio.create_task(nbp.request_memory_segments(1, timeout=5.0))
    await settle()
    assert not task.done()  # the only other segment is in use by the pool
    assert nbp.num_required == 4
    assert pool.current_pool_size == 0
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert nbp.num_required == 3
    assert pool.current_pool_size == 1
    b.release()
    assert pool.num_available == 1
    pool.destroy()
    nbp.recycle_memory_segments(first)
    assert_whole(nbp)
    nbp.destroy()


@pytest.mark.asyncio
async def test_destroy_wakes_a_waiting_exclusive_request() -> None:
    nbp = NetworkBufferPool(2, SEG)
    pool = nbp.create_buffer_pool(0, 2)
    held = [pool.request_buffer(), pool.request_buffer()]
    task = asyncio.create_task(nbp.request_memory_segments(2, timeout=60.0))
    await asyncio.sleep(0)
    assert not task.done()
    nbp.destroy()
    with pytest.raises(PoolDestroyedError):
        await asyncio.wait_for(task, 10)
    for b in held:
        assert b is not None
        b.release()  # after destroy: accepted, nothing to do


# -- destroy --------------------------------------------------------------------------------


def test_destroy_frees_segments_and_refuses_later_use() -> None:
    nbp = NetworkBufferPool(4, SEG)
    pool = nbp.create_buffer_pool(1, 2)
    buf = pool.request_buffer()
    assert buf is not None
    excl = nbp.request_memory_segments_nowait(1)
    nbp.destroy()
    assert nbp.is_destroyed
    assert pool.is_destroyed
    assert nbp.local_pools == []
    assert excl[0].is_freed
    with pytest.raises(SegmentFreedError):
        excl[0].view()
    with pytest.raises(SegmentFreedError):
        buf.memoryview()
    with pytest.raises(PoolDestroyedError):
        nbp.request_memory_segment()
    with pytest.raises(PoolDestroyedError):
        nbp.request_memory_segments_nowait(1)
    with pytest.raises(PoolDestroyedError):
        asyncio.run(nbp.request_memory_segments(1))
    with pytest.raises(PoolDestroyedError):
        nbp.create_buffer_pool(0, 1)
    with pytest.raises(PoolDestroyedError):
        pool.request_buffer()
    # giving back after destroy is harmless
    buf.release()
    nbp.recycle_memory_segments(excl)
    nbp.destroy()  # idempotent
    assert nbp.num_available == 0


def test_destroy_while_a_slice_of_the_arena_is_held() -> None:
    nbp = NetworkBufferPool(2, SEG)
    pool = nbp.create_buffer_pool(1, 2)
    buf = pool.request_buffer()
    assert buf is not None
    buf.segment.put(0, b"kept")
    buf.set_size(4)
    view = buf.memoryview()  # a slice outliving the pool keeps the arena mapped
    nbp.destroy()
    assert bytes(view) == b"kept"
    with pytest.raises(SegmentFreedError):
        buf.segment.get(0, 4)
    view.release()
    buf.release()
