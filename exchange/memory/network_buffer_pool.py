"""NetworkBufferPool: the fixed set of network memory segments of one daemon or process.

One mmap arena carved into ``total_segments`` segments of ``segment_size``: anonymous
memory, or with ``shared=True`` a shared arena (``exchange.memory.shared_arena``) whose
descriptor (``arena_fd``) the daemon hands to one application's local tasks, so they
write into its segments by index (segment ``i`` is bytes ``[i*size, (i+1)*size)``).
Segments go out two ways, as in Flink: to LocalBufferPools (whose sizes the pool
redistributes whenever one is created or destroyed) and as batches of exclusive segments
(a RemoteInputChannel's exclusive buffers), which count as required segments.

Invariant, checked by ``check_consistency``: every segment is either in the available queue
or handed out, never both, never twice: ``num_available + num_in_use == total_segments``.
"""

from __future__ import annotations

import asyncio
import mmap
import os
from collections import deque
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Final, NamedTuple

from exchange.errors import (
    BufferRequestTimeoutError,
    IllegalStateError,
    InsufficientBuffersError,
    PoolDestroyedError,
    UsageError,
)
from exchange.memory.availability import AvailabilityHelper
from exchange.memory.memory_segment import MemorySegment
from exchange.memory.shared_arena import SHM_DIR, create_arena

if TYPE_CHECKING:
    from exchange.memory.local_buffer_pool import LocalBufferPool

__all__ = [
    "DEFAULT_SEGMENT_SIZE",
    "DEFAULT_TOTAL_SEGMENTS",
    "MIN_SEGMENT_SIZE",
    "NetworkBufferPool",
    "NetworkBufferPoolStats",
]

DEFAULT_SEGMENT_SIZE: Final = 32 * 1024
DEFAULT_TOTAL_SEGMENTS: Final = 2048
MIN_SEGMENT_SIZE: Final = 4 * 1024
MAX_SEGMENT_SIZE: Final = 16 * 1024 * 1024
#: The setting a user raises when buffers run out (named in error messages).
NETWORK_MEMORY_SETTING: Final = "network_memory"


class NetworkBufferPoolStats(NamedTuple):
    total_segments: int
    available_segments: int
    in_use_segments: int
    segment_size: int
    num_local_pools: int
    required_segments: int
    #: of ``in_use_segments``, those local pools hold as overdraft (beyond their sizes)
    overdraft_segments: int = 0


class NetworkBufferPool:
    """The global, fixed-size pool of network segments."""

    def __init__(
        self,
        total_segments: int = DEFAULT_TOTAL_SEGMENTS,
        segment_size: int = DEFAULT_SEGMENT_SIZE,
        *,
        request_timeout: float = 30.0,
        shared: bool = False,
        shm_dir: str = SHM_DIR,
    ) -> None:
        if not isinstance(total_segments, int) or isinstance(total_segments, bool):
            raise UsageError(f"total_segments must be an int, got {total_segments!r}")
        if total_segments <= 0:
            raise UsageError(f"total_segments must be positive, got {total_segments}")
        if not isinstance(segment_size, int) or isinstance(segment_size, bool):
            raise UsageError(f"segment_size must be an int, got {segment_size!r}")
        if segment_size < MIN_SEGMENT_SIZE or segment_size > MAX_SEGMENT_SIZE:
            raise UsageError(
                f"segment_size {segment_size} outside [{MIN_SEGMENT_SIZE}, {MAX_SEGMENT_SIZE}]"
            )
        if segment_size & (segment_size - 1):
            raise UsageError(f"segment_size must be a power of two, got {segment_size}")
        if request_timeout <= 0:
            raise UsageError(f"request_timeout must be positive, got {request_timeout}")
        self.total_segments = total_segments
        self.segment_size = segment_size
        self.request_timeout = request_timeout
        #: the shared arena's descriptor (``shared=True``), else None; closed by destroy
        self.arena_fd: int | None = None
        if shared:
            self.arena_fd, arena = create_arena(
                total_segments * segment_size, "exchange-network-memory", shm_dir=shm_dir
            )
        else:
            arena = mmap.mmap(-1, total_segments * segment_size)
        self._arena: mmap.mmap | None = arena
        arena_view = memoryview(self._arena)
        self._arena_view: memoryview | None = arena_view
        self._segments = [
            MemorySegment(arena_view[i * segment_size : (i + 1) * segment_size], i)
            for i in range(total_segments)
        ]
        self._available: deque[MemorySegment] = deque(self._segments)
        self._in_use: set[int] = set()
        self._pools: dict[int, LocalBufferPool] = {}  # insertion ordered, keyed by id()
        self._num_required = 0
        #: what the local pools may still take up to their current sizes: the sum of
        #: ``max(0, current_pool_size - num_requested)`` over them, kept up to date by the
        #: pools (``LocalBufferPool._update_owed``) so ``request_spare_segment`` is O(1)
        self._num_owed = 0
        self._waiting_pools: dict[int, LocalBufferPool] = {}
        self._availability = AvailabilityHelper(available=True)
        self._destroyed = False
        #: called when the pool becomes whole again (every segment back, no local pool):
        #: the owner of an application's arena drops it then
        self.on_whole: Callable[[], None] | None = None
        self._redistributing = False
        self._wakeup_deferred = False

    # -- statistics ----------------------------------------------------------------------

    @property
    def num_available(self) -> int:
        return len(self._available)

    @property
    def num_in_use(self) -> int:
        return len(self._in_use)

    @property
    def num_required(self) -> int:
        return self._num_required

    @property
    def num_owed(self) -> int:
        """Segments the local pools may still take up to their current sizes."""
        return self._num_owed

    @property
    def arena_size(self) -> int:
        return self.total_segments * self.segment_size

    @property
    def is_destroyed(self) -> bool:
        return self._destroyed

    def owns(self, segment: MemorySegment) -> bool:
        """True if ``segment`` is one of this pool's own (its ``index`` says which)."""
        return segment.is_in(self._segments)

    @property
    def local_pools(self) -> list[LocalBufferPool]:
        return list(self._pools.values())

    def stats(self) -> NetworkBufferPoolStats:
        return NetworkBufferPoolStats(
            self.total_segments,
            len(self._available),
            len(self._in_use),
            self.segment_size,
            len(self._pools),
            self._num_required,
            self.num_overdraft,
        )

    @property
    def num_overdraft(self) -> int:
        """Segments in use as local pools' overdraft (counted in ``num_in_use`` too)."""
        return sum(p.num_overdraft for p in self._pools.values())

    def check_consistency(self) -> None:
        """Raise IllegalStateError unless available + in use == total, all distinct."""
        avail = {s.index for s in self._available}
        if len(avail) != len(self._available):
            raise IllegalStateError("a segment is in the available queue twice")
        if avail & self._in_use:
            raise IllegalStateError("a segment is both available and in use")
        if len(avail) + len(self._in_use) != self.total_segments:
            raise IllegalStateError(
                f"segments lost: {len(avail)} available + {len(self._in_use)} in use "
                f"!= {self.total_segments} total"
            )

    def is_whole(self) -> bool:
        """True when every segment is back and no local pool or exclusive request remains."""
        return len(self._available) == self.total_segments and not self._pools

    # -- single segments (used by LocalBufferPools) --------------------------------------

    def request_memory_segment(self) -> MemorySegment | None:
        """One segment, or None when none is free."""
        self._check_alive()
        if not self._available:
            return None
        seg = self._available.popleft()
        self._hand_out(seg)
        if not self._available:
            self._availability.set_unavailable()
        return seg

    def request_spare_segment(self) -> MemorySegment | None:
        """One segment no local pool can claim: None unless more are free than the local
        pools may still take up to their current sizes. Lent outside any local pool (a
        blocking partition read into a local consumer's arena) and given back with
        ``recycle``; so such loans never keep a partition from its share. O(1): what the
        pools may still take is a running count (``num_owed``)."""
        if len(self._available) <= self._num_owed:
            return None
        return self.request_memory_segment()

    def recycle(self, segment: MemorySegment) -> None:
        """Return one segment to the pool."""
        self._take_back(segment)
        self._after_return()
        if self.on_whole is not None and self.is_whole():
            self.on_whole()

    # -- batches of exclusive segments ---------------------------------------------------

    def request_memory_segments_nowait(self, num: int) -> list[MemorySegment]:
        """``num`` exclusive segments at once, or InsufficientBuffersError."""
        self._reserve(num)
        if len(self._available) < num:
            self._num_required -= num
            self._redistribute()
            raise InsufficientBuffersError(
                num, len(self._available), self.total_segments, NETWORK_MEMORY_SETTING
            )
        return self._take_batch(num)

    async def request_memory_segments(
        self, num: int, timeout: float | None = None
    ) -> list[MemorySegment]:
        """``num`` exclusive segments, waiting up to ``timeout`` for them to come back.

        Reserving them as required first shrinks the local pools (redistribution), which
        return their excess segments as they recycle them.
        """
        timeout = self.request_timeout if timeout is None else timeout
        if timeout <= 0:
            raise UsageError(f"timeout must be positive, got {timeout}")
        self._reserve(num)
        got: list[MemorySegment] = []
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        try:
            while True:
                while self._available and len(got) < num:
                    seg = self._available.popleft()
                    self._hand_out(seg)
                    got.append(seg)
                if len(got) == num:
                    if not self._available:
                        self._availability.set_unavailable()
                    return got
                self._availability.set_unavailable()
                remaining = deadline - loop.time()
                if remaining <= 0:
                    raise BufferRequestTimeoutError(
                        num, len(got) + len(self._available), timeout, NETWORK_MEMORY_SETTING
                    )
                fut = self._availability.get_available_future()
                try:
                    await asyncio.wait_for(fut, remaining)
                except TimeoutError:
                    raise BufferRequestTimeoutError(
                        num, len(got) + len(self._available), timeout, NETWORK_MEMORY_SETTING
                    ) from None
                self._check_alive()
        except BaseException:
            self._num_required -= num
            for seg in got:
                self._take_back(seg)
            if not self._destroyed:
                self._redistribute()
                self._after_return()
            raise

    def recycle_memory_segments(self, segments: Iterable[MemorySegment]) -> None:
        """Return a batch of exclusive segments; they stop counting as required."""
        segs = list(segments)
        if not self._destroyed:
            # validate the whole batch first: a refused batch changes nothing
            for seg in segs:
                self._check_in_use(seg)
            if len({seg.index for seg in segs}) != len(segs):
                raise IllegalStateError("a segment recycled twice in one batch")
        for seg in segs:
            self._take_back(seg)
        if self._destroyed:
            return
        self._num_required -= len(segs)
        if self._num_required < 0:
            raise IllegalStateError("more exclusive segments recycled than requested")
        self._redistribute()
        self._after_return()

    def _reserve(self, num: int) -> None:
        self._check_alive()
        if not isinstance(num, int) or num <= 0:
            raise UsageError(f"number of segments to request must be positive, got {num!r}")
        if self._num_required + num > self.total_segments:
            raise InsufficientBuffersError(
                num,
                self.total_segments - self._num_required,
                self.total_segments,
                NETWORK_MEMORY_SETTING,
            )
        self._num_required += num
        self._redistribute()

    def _take_batch(self, num: int) -> list[MemorySegment]:
        got = []
        for _ in range(num):
            seg = self._available.popleft()
            self._hand_out(seg)
            got.append(seg)
        if not self._available:
            self._availability.set_unavailable()
        return got

    # -- local buffer pools --------------------------------------------------------------

    def create_buffer_pool(
        self, num_required: int, max_segments: int, max_overdraft_buffers: int = 0
    ) -> LocalBufferPool:
        """A LocalBufferPool guaranteed ``num_required`` segments, growing up to ``max``
        (and ``max_overdraft_buffers`` beyond, to finish a record)."""
        from exchange.memory.local_buffer_pool import LocalBufferPool, check_overdraft_limit

        self._check_alive()
        if not isinstance(num_required, int) or num_required < 0:
            raise UsageError(f"num_required must be a non-negative int, got {num_required!r}")
        if not isinstance(max_segments, int) or max_segments < max(num_required, 1):
            raise UsageError(
                f"max_segments must be an int >= max(num_required, 1), got {max_segments!r}"
            )
        check_overdraft_limit(max_overdraft_buffers)  # before anything is reserved
        if self._num_required + num_required > self.total_segments:
            raise InsufficientBuffersError(
                num_required,
                self.total_segments - self._num_required,
                self.total_segments,
                NETWORK_MEMORY_SETTING,
            )
        self._num_required += num_required
        pool = LocalBufferPool(self, num_required, max_segments, max_overdraft_buffers)
        self._pools[id(pool)] = pool
        pool._update_owed()
        self._redistribute()
        return pool

    def has_pool(self, pool: LocalBufferPool) -> bool:
        """True if ``pool`` is one of this pool's live local pools."""
        return self._pools.get(id(pool)) is pool

    def set_max_segments(self, pool: LocalBufferPool, max_segments: int) -> None:
        """Move the ceiling of the local pool ``pool`` and redistribute: a raised one may
        grow into spare segments, a lowered one gives back its excess as it recycles."""
        self._check_alive()
        if not self.has_pool(pool):
            raise UsageError(f"{pool!r} is not a live local pool of {self!r}")
        if (
            not isinstance(max_segments, int)
            or isinstance(max_segments, bool)
            or max_segments < max(pool.num_required, 1)
        ):
            raise UsageError(
                f"max_segments must be an int >= max(num_required, 1) = "
                f"{max(pool.num_required, 1)}, got {max_segments!r}"
            )
        pool.max_segments = max_segments
        self._redistribute()

    def destroy_buffer_pool(self, pool: LocalBufferPool) -> None:
        """Forget a (destroyed) local pool and give its share to the others."""
        if self._pools.pop(id(pool), None) is None:
            return
        self._num_owed -= pool._owed
        pool._owed = 0
        self._waiting_pools.pop(id(pool), None)
        self._num_required -= pool.num_required
        if not self._destroyed:
            self._redistribute()
            if self.on_whole is not None and self.is_whole():
                self.on_whole()

    def _redistribute(self) -> None:
        """Flink's redistributeBuffers: spare segments in proportion to excess capacity."""
        # Segments a shrinking pool gives back are handed to waiting pools only once every
        # size is final; otherwise a pool not resized yet could take them above its share.
        self._redistributing = True
        try:
            self._set_pool_sizes()
        finally:
            self._redistributing = False
        if self._wakeup_deferred:
            self._wakeup_deferred = False
            self._after_return()

    def _set_pool_sizes(self) -> None:
        spare = self.total_segments - self._num_required
        pools = list(self._pools.values())
        if spare == 0:
            for pool in pools:
                pool.set_num_buffers(pool.num_required)
            return
        total_capacity = 0
        for pool in pools:
            total_capacity += min(spare, pool.max_segments - pool.num_required)
        if total_capacity == 0:  # every ceiling at its guarantee (one may have been lowered)
            for pool in pools:
                pool.set_num_buffers(pool.num_required)
            return
        to_distribute = min(spare, total_capacity)
        parts_used = 0
        distributed = 0
        for pool in pools:
            excess_max = pool.max_segments - pool.num_required
            if excess_max == 0:
                pool.set_num_buffers(pool.num_required)  # its ceiling may have been lowered
                continue
            parts_used += min(spare, excess_max)
            mine = to_distribute * parts_used // total_capacity - distributed
            distributed += mine
            pool.set_num_buffers(pool.num_required + mine)

    def _register_waiting_pool(self, pool: LocalBufferPool) -> None:
        self._waiting_pools[id(pool)] = pool

    def _request_wakeup(self, pool: LocalBufferPool) -> None:
        """``pool`` grew while it has listeners waiting: serve it from the free segments,
        after the redistribution in progress (if any) has set every size."""
        self._register_waiting_pool(pool)
        if self._redistributing:
            self._wakeup_deferred = True
        else:
            self._after_return()

    # -- availability --------------------------------------------------------------------

    @property
    def is_available(self) -> bool:
        return bool(self._available)

    def get_available_future(self) -> asyncio.Future[None]:
        return self._availability.get_available_future()

    # -- lifecycle -----------------------------------------------------------------------

    def destroy(self) -> None:
        """Destroy the pool: every local pool is destroyed, every segment freed."""
        if self._destroyed:
            return
        for pool in list(self._pools.values()):
            pool.destroy()
        self._destroyed = True
        self._availability.fail(PoolDestroyedError("network buffer pool destroyed"))
        for seg in self._segments:
            if not seg.is_freed:
                seg.free()
        self._available.clear()
        self._in_use.clear()
        # A slice of a segment that someone still holds keeps the arena mapped; it is then
        # unmapped when the last slice is garbage collected.
        try:
            if self._arena_view is not None:
                self._arena_view.release()
            if self._arena is not None:
                self._arena.close()
        except BufferError:
            pass
        self._arena_view = None
        self._arena = None
        if self.arena_fd is not None:
            os.close(self.arena_fd)
            self.arena_fd = None

    # -- internals -----------------------------------------------------------------------

    def _check_alive(self) -> None:
        if self._destroyed:
            raise PoolDestroyedError("network buffer pool destroyed")

    def _hand_out(self, seg: MemorySegment) -> None:
        self._in_use.add(seg.index)

    def _check_in_use(self, segment: MemorySegment) -> None:
        idx = segment.index
        if idx < 0 or idx >= self.total_segments or self._segments[idx] is not segment:
            raise UsageError(f"{segment!r} does not belong to this pool")
        if idx not in self._in_use:
            raise IllegalStateError(f"segment {idx} recycled twice")

    def _take_back(self, segment: MemorySegment) -> None:
        if self._destroyed:
            return
        self._check_in_use(segment)
        self._in_use.discard(segment.index)
        self._available.append(segment)

    def _after_return(self) -> None:
        if not self._available:
            return
        if self._redistributing:
            self._wakeup_deferred = True
            return
        self._availability.set_available()
        if self._waiting_pools:
            waiting = list(self._waiting_pools.values())
            self._waiting_pools.clear()
            for pool in waiting:
                if not self._available:
                    self._waiting_pools[id(pool)] = pool
                    continue
                pool._on_global_available()

    def __repr__(self) -> str:
        return (
            f"NetworkBufferPool({len(self._available)}/{self.total_segments} available, "
            f"{self.segment_size}B segments, {len(self._pools)} local pools)"
        )
