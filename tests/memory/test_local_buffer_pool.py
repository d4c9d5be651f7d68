"""LocalBufferPool: lazy requests, exhaustion, listeners, resizing, destroy, backpressure."""

from __future__ import annotations

import asyncio
import cProfile
import pstats
from collections.abc import Callable

import pytest

from exchange.buffers import Buffer
from exchange.errors import IllegalReferenceCountError, PoolDestroyedError, UsageError
from exchange.memory import LocalBufferPool, NetworkBufferPool, NotificationResult

SEG = 4096


class Listener:
    """Answers every offer with ``result``; keeps what it used."""

    def __init__(self, result: NotificationResult, log: list[str] | None = None, name: str = ""):
        self.result = result
        self.held: list[Buffer] = []
        self.offers = 0
        self.destroyed = 0
        self.log = log if log is not None else []
        self.name = name

    def notify_buffer_available(self, buffer: Buffer) -> NotificationResult:
        self.offers += 1
        self.log.append(self.name)
        if self.result.is_buffer_used:
            self.held.append(buffer)
        return self.result

    def notify_buffer_destroyed(self) -> None:
        self.destroyed += 1

    def release_all(self) -> None:
        while self.held:
            self.held.pop().release()


def assert_whole(nbp: NetworkBufferPool) -> None:
    nbp.check_consistency()
    assert nbp.num_available == nbp.total_segments
    assert nbp.num_required == 0
    assert nbp.is_whole()


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def request_blocking(pool: LocalBufferPool) -> Buffer:
    """What a writer does under backpressure (``PartitionWriter._request_buffer``): ask,
    and while the pool has nothing, wait for its availability future and ask again."""
    while True:
        buf = pool.request_buffer()
        if buf is not None:
            return buf
        await pool.get_available_future()


def take(pool: LocalBufferPool, n: int) -> list[Buffer]:
    out = []
    for _ in range(n):
        b = pool.request_buffer()
        assert b is not None
        out.append(b)
    return out


# -- requesting -----------------------------------------------------------------------------


def test_segments_are_requested_lazily_up_to_the_pool_size() -> None:
    nbp = NetworkBufferPool(10, SEG)
    pool = nbp.create_buffer_pool(2, 5)
    # 8 spare, capacity 3 -> size 5; nothing taken yet
    assert pool.stats() == (2, 5, 5, 0, 0, 0, 0, 0, 0)
    assert pool.segment_size == SEG
    assert pool.is_available
    bufs = take(pool, 5)
    assert len({b.segment.index for b in bufs}) == 5
    assert all(b.ref_count == 1 and b.size == 0 and b.is_buffer for b in bufs)
    assert pool.num_requested == 5
    assert pool.num_in_use == 5
    assert nbp.num_available == 5
    assert pool.request_buffer() is None
    assert not pool.is_available
    assert pool.stats().usage == 1.0
    bufs[0].release()
    assert pool.is_available
    assert pool.num_available == 1
    assert pool.num_requested == 5
    assert nbp.num_available == 5  # stays local: the pool is within its size
    again = pool.request_buffer()
    assert again is not None and again.segment is bufs[0].segment
    for b in [again, *bufs[1:]]:
        b.release()
    assert pool.stats() == (2, 5, 5, 5, 5, 0, 0, 0, 0)
    assert pool.stats().usage == 0.0
    pool.destroy()
    assert_whole(nbp)
    nbp.destroy()


def test_releasing_twice_raises_and_keeps_the_pools_consistent() -> None:
    nbp = NetworkBufferPool(4, SEG)
    pool = nbp.create_buffer_pool(1, 4)
    (buf,) = take(pool, 1)
    buf.release()
    with pytest.raises(IllegalReferenceCountError):
        buf.release()
    assert pool.num_available == 1
    assert pool.num_requested == 1
    nbp.check_consistency()
    pool.destroy()
    assert_whole(nbp)
    nbp.destroy()


def test_requests_after_destroy_raise() -> None:
    nbp = NetworkBufferPool(4, SEG)
    pool = nbp.create_buffer_pool(1, 4)
    pool.destroy()
    assert pool.is_destroyed
    with pytest.raises(PoolDestroyedError):
        pool.request_buffer()
    with pytest.raises(PoolDestroyedError):
        asyncio.run(request_blocking(pool))
    pool.destroy()  # idempotent
    assert nbp.local_pools == []
    assert_whole(nbp)
    nbp.destroy()


# -- listeners ------------------------------------------------------------------------------


def test_a_listener_gets_a_recycled_buffer_before_the_available_queue() -> None:
    nbp = NetworkBufferPool(4, SEG)
    pool = nbp.create_buffer_pool(2, 2)
    a, b = take(pool, 2)
    listener = Listener(NotificationResult.BUFFER_USED_NO_NEED_MORE)
    assert pool.add_buffer_listener(listener)
    assert pool.stats().num_listeners == 1
    a.release()
    assert listener.offers == 1
    assert [x.segment.index for x in listener.held] == [a.segment.index]
    assert listener.held[0].ref_count == 1
    assert pool.num_available == 0
    assert pool.stats().num_listeners == 0  # it needed no more
    b.release()
    assert listener.offers == 1
    assert pool.num_available == 1
    listener.release_all()
    assert pool.num_available == 2
    pool.destroy()
    assert_whole(nbp)
    nbp.destroy()


def test_a_listener_that_needs_more_stays_registered() -> None:
    nbp = NetworkBufferPool(3, SEG)
    pool = nbp.create_buffer_pool(3, 3)
    bufs = take(pool, 3)
    listener = Listener(NotificationResult.BUFFER_USED_NEED_MORE)
    pool.add_buffer_listener(listener)
    bufs[0].release()
    bufs[1].release()
    assert listener.offers == 2
    assert pool.stats().num_listeners == 1
    assert pool.num_available == 0
    listener.result = NotificationResult.BUFFER_USED_NO_NEED_MORE
    bufs[2].release()
    assert listener.offers == 3
    assert pool.stats().num_listeners == 0
    assert sorted(x.segment.index for x in listener.held) == sorted(x.segment.index for x in bufs)
    listener.release_all()
    assert pool.num_available == 3
    pool.destroy()
    assert_whole(nbp)
    nbp.destroy()


def test_a_listener_that_declines_passes_the_buffer_on() -> None:
    nbp = NetworkBufferPool(2, SEG)
    pool = nbp.create_buffer_pool(2, 2)
    a, b = take(pool, 2)
    log: list[str] = []
    no = Listener(NotificationResult.BUFFER_NOT_USED, log, "no")
    yes = Listener(NotificationResult.BUFFER_USED_NO_NEED_MORE, log, "yes")
    pool.add_buffer_listener(no)
    pool.add_buffer_listener(yes)
    a.release()
    assert log == ["no", "yes"]
    assert no.held == []
    assert [x.segment.index for x in yes.held] == [a.segment.index]
    assert pool.num_available == 0
    assert pool.stats().num_listeners == 0  # the decliner is dropped too
    b.release()
    assert log == ["no", "yes"]
    assert pool.num_available == 1
    yes.release_all()
    pool.destroy()
    assert_whole(nbp)
    nbp.destroy()


def test_when_every_listener_declines_the_buffer_goes_to_the_queue() -> None:
    nbp = NetworkBufferPool(2, SEG)
    pool = nbp.create_buffer_pool(2, 2)
    (a,) = take(pool, 1)
    listeners = [Listener(NotificationResult.BUFFER_NOT_USED) for _ in range(3)]
    for x in listeners:
        pool.add_buffer_listener(x)
    a.release()
    assert [x.offers for x in listeners] == [1, 1, 1]
    assert pool.num_available == 1
    assert pool.is_available
    pool.destroy()
    assert [x.destroyed for x in listeners] == [0, 0, 0]
    assert_whole(nbp)
    nbp.destroy()


def test_destroy_notifies_registered_listeners_once() -> None:
    nbp = NetworkBufferPool(2, SEG)
    pool = nbp.create_buffer_pool(2, 2)
    bufs = take(pool, 2)
    first = Listener(NotificationResult.BUFFER_USED_NO_NEED_MORE)
    second = Listener(NotificationResult.BUFFER_USED_NEED_MORE)
    pool.add_buffer_listener(first)
    pool.add_buffer_listener(second)
    pool.destroy()
    pool.destroy()
    assert (first.destroyed, second.destroyed) == (1, 1)
    assert pool.stats().num_listeners == 0
    assert not pool.add_buffer_listener(Listener(NotificationResult.BUFFER_NOT_USED))
    for b in bufs:
        b.release()  # nobody is offered a buffer of a destroyed pool
    assert (first.offers, second.offers) == (0, 0)
    assert_whole(nbp)
    nbp.destroy()


def test_a_listener_is_served_from_the_global_pool_when_segments_come_back() -> None:
    nbp = NetworkBufferPool(2, SEG)
    hog = nbp.create_buffer_pool(0, 2)
    held = take(hog, 2)
    pool = nbp.create_buffer_pool(0, 2)
    # 2 spare over equal capacities: 1 each; the hog holds 2 > 1
    assert (hog.current_pool_size, pool.current_pool_size) == (1, 1)
    assert pool.request_buffer() is None
    listener = Listener(NotificationResult.BUFFER_USED_NO_NEED_MORE)
    pool.add_buffer_listener(listener)
    held[0].release()  # hog is over its size: back to the global pool, then to the listener
    assert listener.offers == 1
    assert pool.num_requested == 1
    assert hog.num_requested == 1
    assert nbp.num_available == 0
    nbp.check_consistency()
    listener.release_all()
    held[1].release()
    for p in (hog, pool):
        p.destroy()
    assert_whole(nbp)
    nbp.destroy()


# -- resizing -------------------------------------------------------------------------------


def test_shrinking_returns_excess_segments_to_the_global_pool() -> None:
    nbp = NetworkBufferPool(10, SEG)
    a = nbp.create_buffer_pool(1, 10)
    assert a.current_pool_size == 10
    bufs = take(a, 6)
    bufs.pop().release()
    bufs.pop().release()
    assert (a.num_requested, a.num_available) == (6, 2)
    b = nbp.create_buffer_pool(4, 10)
    # 5 spare, capacities 5 and 5: 2 and 3
    assert (a.current_pool_size, b.current_pool_size) == (3, 7)
    # the two available segments went back at once; four are still in use
    assert (a.num_requested, a.num_available) == (4, 0)
    assert nbp.num_available == 6
    assert a.request_buffer() is None
    bufs.pop().release()  # over size: global
    assert (a.num_requested, a.num_available, nbp.num_available) == (3, 0, 7)
    bufs.pop().release()  # at size: stays local
    assert (a.num_requested, a.num_available, nbp.num_available) == (3, 1, 7)
    for x in bufs:
        x.release()
    nbp.check_consistency()
    b.destroy()
    assert a.current_pool_size == 10
    a.destroy()
    assert_whole(nbp)
    nbp.destroy()


def test_set_num_buffers_bounds() -> None:
    nbp = NetworkBufferPool(8, SEG)
    pool = nbp.create_buffer_pool(2, 4)
    with pytest.raises(UsageError, match="below its required"):
        pool.set_num_buffers(1)
    assert pool.current_pool_size == 4
    pool.set_num_buffers(100)
    assert pool.current_pool_size == 4  # capped at max
    bufs = take(pool, 4)
    for b in bufs:
        b.release()
    pool.set_num_buffers(2)
    assert (pool.num_requested, pool.num_available) == (2, 2)
    assert nbp.num_available == 6
    pool.destroy()
    assert_whole(nbp)
    nbp.destroy()


def test_buffers_released_after_destroy_go_to_the_global_pool() -> None:
    nbp = NetworkBufferPool(4, SEG)
    pool = nbp.create_buffer_pool(2, 4)
    bufs = take(pool, 3)
    bufs.pop().release()
    assert pool.num_available == 1
    other = nbp.create_buffer_pool(0, 4)
    assert pool.current_pool_size == 3
    pool.destroy()
    assert nbp.local_pools == [other]
    assert nbp.num_required == 0
    assert other.current_pool_size == 4
    assert nbp.num_available == 2  # the available one came back, two are still out
    assert pool.num_requested == 2
    bufs.pop().release()
    assert nbp.num_available == 3
    assert pool.num_requested == 1
    bufs.pop().release()
    assert pool.num_requested == 0
    other.destroy()
    assert_whole(nbp)
    nbp.destroy()


# -- backpressure ---------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_blocking_request_is_woken_by_a_release() -> None:
    nbp = NetworkBufferPool(4, SEG)
    pool = nbp.create_buffer_pool(2, 2)
    a, b = take(pool, 2)
    task = asyncio.create_task(request_blocking(pool))
    await settle()
    assert not task.done()
    a.release()
    got = await asyncio.wait_for(task, 10)
    assert pool.num_in_use == 2
    assert pool.num_available == 0
    assert pool.num_requested == 2
    got.release()
    b.release()
    pool.destroy()
    assert_whole(nbp)
    nbp.destroy()


@pytest.mark.asyncio
async def test_available_future_completes_on_release() -> None:
    nbp = NetworkBufferPool(1, SEG)
    pool = nbp.create_buffer_pool(1, 1)
    (a,) = take(pool, 1)
    assert pool.request_buffer() is None
    fut = pool.get_available_future()
    assert not fut.done()
    a.release()
    await asyncio.wait_for(fut, 10)
    assert pool.get_available_future().done()
    pool.destroy()
    assert_whole(nbp)
    nbp.destroy()


@pytest.mark.asyncio
async def test_destroy_wakes_a_blocked_writer_with_an_error() -> None:
    nbp = NetworkBufferPool(1, SEG)
    pool = nbp.create_buffer_pool(1, 1)
    (a,) = take(pool, 1)
    task = asyncio.create_task(request_blocking(pool))
    await settle()
    assert not task.done()
    pool.destroy()
    with pytest.raises(PoolDestroyedError):
        await asyncio.wait_for(task, 10)
    a.release()
    assert_whole(nbp)
    nbp.destroy()


@pytest.mark.asyncio
async def test_a_pool_waiting_on_an_empty_global_pool_is_woken_by_another_pool() -> None:
    nbp = NetworkBufferPool(4, SEG)
    b = nbp.create_buffer_pool(1, 4)
    held = take(b, 4)
    a = nbp.create_buffer_pool(1, 4)
    # 2 spare, capacities 2 and 2: b shrinks to 2 but holds 4
    assert (b.current_pool_size, a.current_pool_size) == (2, 2)
    assert nbp.num_available == 0
    assert a.request_buffer() is None
    assert not a.is_available
    task = asyncio.create_task(request_blocking(a))
    await settle()
    assert not task.done()
    held.pop().release()  # b is over its size: to the global pool, which wakes a
    got = await asyncio.wait_for(task, 10)
    assert a.num_requested == 1
    assert b.num_requested == 3
    assert nbp.num_available == 0
    nbp.check_consistency()
    got.release()
    for x in held:
        x.release()
    for p in (a, b):
        p.destroy()
    assert_whole(nbp)
    nbp.destroy()


@pytest.mark.asyncio
async def test_a_blocked_writer_is_woken_when_its_pool_grows() -> None:
    nbp = NetworkBufferPool(4, SEG)
    a = nbp.create_buffer_pool(1, 4)
    b = nbp.create_buffer_pool(2, 4)
    # 1 spare, capacities 1 and 1: 0 for a, 1 for b
    assert (a.current_pool_size, b.current_pool_size) == (1, 3)
    (x,) = take(a, 1)
    task = asyncio.create_task(request_blocking(a))
    await settle()
    assert not task.done()
    b.destroy()
    assert a.current_pool_size == 4
    got = await asyncio.wait_for(task, 10)
    assert a.num_requested == 2
    got.release()
    x.release()
    a.destroy()
    assert_whole(nbp)
    nbp.destroy()


@pytest.mark.asyncio
async def test_available_future_after_destroy_fails_at_once() -> None:
    nbp = NetworkBufferPool(8, 4096)
    pool = nbp.create_buffer_pool(1, 2)
    pool.destroy()
    fut = pool.get_available_future()
    assert fut.done()
    with pytest.raises(PoolDestroyedError):
        fut.result()
    assert nbp.is_whole()
    nbp.destroy()


# -- listeners while the pool is resized (issue 8, defect 8) --------------------------------


def test_a_pool_grown_by_redistribution_serves_its_waiting_listeners() -> None:
    nbp = NetworkBufferPool(4, SEG)
    pool = nbp.create_buffer_pool(1, 4)
    other = nbp.create_buffer_pool(3, 3)
    assert pool.current_pool_size == 1
    (held,) = take(pool, 1)
    listener = Listener(NotificationResult.BUFFER_USED_NEED_MORE)
    assert pool.add_buffer_listener(listener)
    other.destroy()  # its share comes free: pool may grow to 4, and its listener waits
    assert pool.current_pool_size == 4
    assert listener.offers == 3
    assert pool.num_requested == 4 and nbp.num_available == 0
    nbp.check_consistency()
    pool.destroy()  # first: the listener still asks for more
    assert listener.destroyed == 1
    listener.release_all()
    held.release()
    assert_whole(nbp)
    nbp.destroy()


def test_set_num_buffers_serves_waiting_listeners_up_to_the_new_size() -> None:
    nbp = NetworkBufferPool(8, SEG)
    pool = nbp.create_buffer_pool(2, 2)
    held = take(pool, 2)
    pool.max_segments = 8  # as if configured larger; grown by hand below
    listener = Listener(NotificationResult.BUFFER_USED_NEED_MORE)
    assert pool.add_buffer_listener(listener)
    pool.set_num_buffers(5)
    assert listener.offers == 3
    assert pool.num_requested == 5
    assert nbp.num_available == 3
    nbp.check_consistency()
    pool.destroy()  # first: the listener still asks for more
    for b in held:
        b.release()
    listener.release_all()
    assert_whole(nbp)
    nbp.destroy()


def test_a_grown_pool_wakes_a_listener_that_is_satisfied_with_one() -> None:
    nbp = NetworkBufferPool(4, SEG)
    pool = nbp.create_buffer_pool(1, 4)
    other = nbp.create_buffer_pool(3, 3)
    (held,) = take(pool, 1)
    listener = Listener(NotificationResult.BUFFER_USED_NO_NEED_MORE)
    pool.add_buffer_listener(listener)
    other.destroy()
    assert listener.offers == 1
    assert pool.stats().num_listeners == 0
    assert pool.num_requested == 2  # only what the listener took: the rest stays global
    listener.release_all()
    held.release()
    pool.destroy()
    assert_whole(nbp)
    nbp.destroy()


def test_a_shrunk_pool_returns_its_excess_before_serving_listeners() -> None:
    nbp = NetworkBufferPool(4, SEG)
    pool = nbp.create_buffer_pool(1, 4)
    held = take(pool, 4)
    listener = Listener(NotificationResult.BUFFER_USED_NO_NEED_MORE)
    pool.add_buffer_listener(listener)
    other = nbp.create_buffer_pool(3, 3)  # pool shrinks to 1 while holding 4
    assert pool.current_pool_size == 1
    for b in held[:3]:
        b.release()  # over its size: back to the global pool, not to the listener
    assert listener.offers == 0
    assert pool.num_requested == 1 and nbp.num_available == 3
    taken = take(other, 3)
    held[3].release()  # at its size again: this one goes to the listener
    assert listener.offers == 1
    nbp.check_consistency()
    listener.release_all()
    for b in taken:
        b.release()
    for p in (pool, other):
        p.destroy()
    assert_whole(nbp)
    nbp.destroy()


def _python_frames_of_the_memory_package(run: Callable[[], object]) -> list[str]:
    """The Python functions of ``exchange/memory`` that ``run`` entered (cProfile sees
    interpreted frames only: a compiled method leaves none)."""
    profile = cProfile.Profile()
    profile.enable()
    try:
        run()
    finally:
        profile.disable()
    stats = pstats.Stats(profile).stats  # type: ignore[attr-defined]
    return sorted(f"{name}" for (path, _, name) in stats if "exchange/memory/" in path)


def test_a_buffers_request_and_recycle_run_no_python_frame_of_the_pool() -> None:
    """The per-buffer paths (issue 20): request from the pool's own queue, release back into
    it, and a recycled buffer handed to a waiting listener are C calls of the compiled pool
    and its availability (the Python pool entered request_buffer, _request_segment,
    _update_availability, set_available, recycle and _offer for each)."""
    nbp = NetworkBufferPool(8, SEG)
    pool = nbp.create_buffer_pool(2, 2)
    first = pool.request_buffer()
    assert first is not None
    first.release()  # the segment now waits in the pool's own queue

    def request_and_release() -> None:
        for _ in range(10):
            buf = pool.request_buffer()
            assert buf is not None
            buf.release()

    assert _python_frames_of_the_memory_package(request_and_release) == []
    assert pool.num_requested == 1 and pool.num_available == 1

    held = [pool.request_buffer(), pool.request_buffer()]
    assert pool.request_buffer() is None
    listener = Listener(NotificationResult.BUFFER_USED_NEED_MORE)
    assert pool.add_buffer_listener(listener)

    def hand_over() -> None:
        for buf in held:
            assert buf is not None
            buf.release()

    assert _python_frames_of_the_memory_package(hand_over) == []
    assert listener.offers == 2 and len(listener.held) == 2 and pool.num_available == 0
    pool.destroy()  # the listener is told and dropped; its buffers go to the global pool
    assert listener.destroyed == 1
    listener.release_all()
    assert nbp.num_available == 8
    nbp.check_consistency()
