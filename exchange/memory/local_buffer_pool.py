"""LocalBufferPool: one partition's or one input gate's share of the NetworkBufferPool.

Sizes, as in Flink: ``num_required`` is guaranteed, ``max_segments`` is the ceiling and
``current_pool_size`` (set by the global pool's redistribution) lies between them. Segments
are taken from the global pool lazily, up to the current size. A recycled segment goes, in
order of preference: back to the global pool if this pool holds more than its current size
or is destroyed; to a registered BufferListener (a RemoteInputChannel waiting for a
floating buffer); else into the pool's own available queue.

Backpressure: a writer that gets no buffer from ``request_buffer`` awaits
``get_available_future`` (a release, a grown pool or a refilled global pool completes it;
``destroy`` fails it) and asks again.

Overdraft (Flink's ``maxOverdraftBuffersPerGate``): a writer that has started a record and
has no buffer left for its rest may take up to ``max_overdraft_buffers`` segments beyond
the pool's size with ``request_overdraft_buffer``, straight from the global pool and only
when it has one free (never at the expense of another pool's share), so the record ends
and the task gets back to its mailbox (where the next barrier waits). Overdraft segments
are counted apart from ``num_requested`` and go back first: while any is out, every
recycled segment returns to the global pool.
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import TYPE_CHECKING, NamedTuple

from exchange.buffers.buffer import Buffer
from exchange.errors import PoolDestroyedError, UsageError
from exchange.memory.availability import AvailabilityHelper
from exchange.memory.buffer_listener import BufferListener
from exchange.memory.memory_segment import MemorySegment

if TYPE_CHECKING:
    from exchange.memory.network_buffer_pool import NetworkBufferPool

__all__ = ["LocalBufferPool", "LocalBufferPoolStats"]


class LocalBufferPoolStats(NamedTuple):
    num_required: int
    max_segments: int
    current_pool_size: int
    num_requested: int
    num_available: int
    num_listeners: int
    #: segments taken beyond the pool's size to finish a record, now in use
    num_overdraft: int = 0
    max_overdraft: int = 0
    #: overdraft segments taken since the pool was created
    overdraft_taken: int = 0

    @property
    def usage(self) -> float:
        """Segments in use / current size (Flink's in/outPoolUsage)."""
        in_use = self.num_requested - self.num_available
        return in_use / self.current_pool_size if self.current_pool_size else 0.0


def check_overdraft_limit(max_overdraft_buffers: object) -> None:
    """UsageError unless ``max_overdraft_buffers`` is an int >= 0."""
    if (
        not isinstance(max_overdraft_buffers, int)
        or isinstance(max_overdraft_buffers, bool)
        or max_overdraft_buffers < 0
    ):
        raise UsageError(
            f"max_overdraft_buffers must be an int >= 0, got {max_overdraft_buffers!r}"
        )


class LocalBufferPool:
    """A resizable pool of segments borrowed from a NetworkBufferPool."""

    def __init__(
        self,
        network_pool: NetworkBufferPool,
        num_required: int,
        max_segments: int,
        max_overdraft_buffers: int = 0,
    ):
        check_overdraft_limit(max_overdraft_buffers)
        self._network_pool = network_pool
        self.max_overdraft_buffers = max_overdraft_buffers
        self._num_overdraft = 0
        self.overdraft_taken = 0
        self.num_required = num_required
        self.max_segments = max_segments
        self.current_pool_size = num_required
        self._num_requested = 0
        #: what this pool may still take from the global pool up to its size
        #: (``current_pool_size - num_requested``, at least 0), as counted in the global
        #: pool's running total (``NetworkBufferPool.num_owed``); kept by ``_update_owed``
        self._owed = 0
        self._available: deque[MemorySegment] = deque()
        self._listeners: deque[BufferListener] = deque()
        self._availability = AvailabilityHelper(available=False)
        self._destroyed = False
        self._update_availability()

    # -- statistics ----------------------------------------------------------------------

    @property
    def segment_size(self) -> int:
        return self._network_pool.segment_size

    @property
    def num_requested(self) -> int:
        """Segments taken from the global pool (available here or in use)."""
        return self._num_requested

    @property
    def num_available(self) -> int:
        return len(self._available)

    @property
    def num_in_use(self) -> int:
        return self._num_requested - len(self._available)

    @property
    def num_overdraft(self) -> int:
        """Overdraft segments in use (beyond ``num_requested``)."""
        return self._num_overdraft

    @property
    def is_destroyed(self) -> bool:
        return self._destroyed

    def stats(self) -> LocalBufferPoolStats:
        return LocalBufferPoolStats(
            self.num_required,
            self.max_segments,
            self.current_pool_size,
            self._num_requested,
            len(self._available),
            len(self._listeners),
            self._num_overdraft,
            self.max_overdraft_buffers,
            self.overdraft_taken,
        )

    # -- requesting ----------------------------------------------------------------------

    def request_buffer(self) -> Buffer | None:
        """A buffer of one segment, or None if the pool has none to give right now."""
        seg = self._request_segment()
        return None if seg is None else Buffer(seg, self)

    def _request_segment(self) -> MemorySegment | None:
        if self._destroyed:
            raise PoolDestroyedError("local buffer pool destroyed")
        if self._available:
            seg = self._available.popleft()
        elif self._num_requested < self.current_pool_size:
            got = self._network_pool.request_memory_segment()
            if got is None:
                self._network_pool._register_waiting_pool(self)
                self._availability.set_unavailable()
                return None
            seg = got
            self._num_requested += 1
            self._update_owed()
        else:
            self._availability.set_unavailable()
            return None
        self._update_availability()
        return seg

    def request_overdraft_buffer(self) -> Buffer | None:
        """A segment beyond the pool's size, to finish a record that has begun; None when
        the pool still has one of its own to give, ``max_overdraft_buffers`` are out, or the
        global pool has none free."""
        if self._destroyed:
            raise PoolDestroyedError("local buffer pool destroyed")
        if (
            self._num_overdraft >= self.max_overdraft_buffers
            or self._available
            or self._num_requested < self.current_pool_size
        ):
            return None
        seg = self._network_pool.request_memory_segment()
        if seg is None:
            return None
        self._num_overdraft += 1
        self.overdraft_taken += 1
        return Buffer(seg, self)

    # -- availability --------------------------------------------------------------------

    @property
    def is_available(self) -> bool:
        return self._availability.is_available

    def get_available_future(self) -> asyncio.Future[None]:
        return self._availability.get_available_future()

    def _update_availability(self) -> None:
        if self._destroyed:
            return
        if self._available or (
            self._num_requested < self.current_pool_size and self._network_pool.is_available
        ):
            self._availability.set_available()
        else:
            self._availability.set_unavailable()
            if self._num_requested < self.current_pool_size:
                self._network_pool._register_waiting_pool(self)

    def _on_global_available(self) -> None:
        """The global pool has segments again: serve listeners first, then wake writers."""
        while (
            self._listeners and not self._destroyed and self._num_requested < self.current_pool_size
        ):
            seg = self._network_pool.request_memory_segment()
            if seg is None:
                break
            self._num_requested += 1
            self._update_owed()
            self._offer(seg)
        self._update_availability()

    # -- listeners -----------------------------------------------------------------------

    def add_buffer_listener(self, listener: BufferListener) -> bool:
        """Register to be handed the next recycled buffer. False if the pool is destroyed."""
        if self._destroyed:
            return False
        self._listeners.append(listener)
        if self._num_requested < self.current_pool_size:
            self._network_pool._register_waiting_pool(self)
        return True

    # -- recycling -----------------------------------------------------------------------

    def recycle(self, segment: MemorySegment) -> None:
        """BufferRecycler: a buffer of this pool was released (overdraft goes back first)."""
        if self._num_overdraft:
            self._num_overdraft -= 1
            self._network_pool.recycle(segment)
            return
        if self._destroyed or self._num_requested > self.current_pool_size:
            self._return_to_global(segment)
            return
        self._offer(segment)

    def _offer(self, segment: MemorySegment) -> None:
        while self._listeners:
            listener = self._listeners.popleft()
            result = listener.notify_buffer_available(Buffer(segment, self))
            if result.needs_more_buffers:
                if self._destroyed:
                    listener.notify_buffer_destroyed()
                else:
                    self._listeners.append(listener)
            if result.is_buffer_used:
                return
        self._available.append(segment)
        self._availability.set_available()

    def _return_to_global(self, segment: MemorySegment) -> None:
        self._num_requested -= 1
        self._update_owed()
        self._network_pool.recycle(segment)

    def _update_owed(self) -> None:
        """Bring the global pool's running ``num_owed`` up to date after this pool's size
        or ``num_requested`` changed (O(1); a destroyed pool owes nothing more: the global
        pool takes its last ``_owed`` off when it forgets it)."""
        if self._destroyed:
            return
        owed = self.current_pool_size - self._num_requested
        if owed < 0:
            owed = 0
        if owed != self._owed:
            self._network_pool._num_owed += owed - self._owed
            self._owed = owed

    # -- sizing and lifecycle ------------------------------------------------------------

    def set_num_buffers(self, num_buffers: int) -> None:
        """Resize (called by redistribution).

        Shrunk: excess available segments go back at once, excess in-use ones as they are
        recycled. Grown: waiting BufferListeners are served from the global pool (once
        every pool's new size is set, when called by the redistribution).
        """
        if num_buffers < self.num_required:
            raise UsageError(
                f"pool size {num_buffers} below its required {self.num_required} segments"
            )
        self.current_pool_size = min(num_buffers, self.max_segments)
        self._update_owed()
        while self._num_requested > self.current_pool_size and self._available:
            self._return_to_global(self._available.pop())
        self._update_availability()
        if self._listeners and self._num_requested < self.current_pool_size:
            self._network_pool._request_wakeup(self)

    def destroy(self) -> None:
        """Give back every available segment; in-use ones go back as they are recycled."""
        if not self._destroyed:
            self._destroyed = True
            while self._available:
                self._return_to_global(self._available.popleft())
            while self._listeners:
                self._listeners.popleft().notify_buffer_destroyed()
            self._availability.fail(PoolDestroyedError("local buffer pool destroyed"))
        self._network_pool.destroy_buffer_pool(self)

    def __repr__(self) -> str:
        return (
            f"LocalBufferPool(size={self.current_pool_size} [{self.num_required}, "
            f"{self.max_segments}], requested={self._num_requested}, "
            f"available={len(self._available)}, overdraft={self._num_overdraft}, "
            f"destroyed={self._destroyed})"
        )
