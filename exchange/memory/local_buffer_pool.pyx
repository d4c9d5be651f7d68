# cython: language_level=3
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

Compiled (a ``cdef class``, ``local_buffer_pool.pxd``): every floating buffer of a consumer
and every buffer a producer's partition fills is requested and recycled here, so
``request_buffer``, ``recycle`` and what they run (the listener hand-off, the availability
flips through the compiled ``AvailabilityHelper``, the global pool's ``num_owed``) are C
calls. ``local_buffer_pool.pyi`` types it for mypy. There is no Python version of this
module; ``LocalBufferPoolStats`` and ``check_overdraft_limit`` live in
``local_pool_stats.py`` and are re-exported here.
"""

from collections import deque

from exchange.buffers.buffer cimport Buffer
from exchange.memory.availability cimport AvailabilityHelper

from exchange.errors import PoolDestroyedError, UsageError
from exchange.memory.local_pool_stats import LocalBufferPoolStats, check_overdraft_limit

__all__ = ["LocalBufferPool", "LocalBufferPoolStats", "check_overdraft_limit"]


cdef class LocalBufferPool:
    """A resizable pool of segments borrowed from a NetworkBufferPool."""

    def __init__(self, network_pool, num_required, max_segments, max_overdraft_buffers=0):
        check_overdraft_limit(max_overdraft_buffers)
        self._network_pool = network_pool
        # the global pool's free queue (the same deque for its whole life: destroy clears
        # it), read in C where the Python pool asked ``network_pool.is_available``
        self._global_free = network_pool._available
        self.max_overdraft_buffers = max_overdraft_buffers
        self._num_overdraft = 0
        self.overdraft_taken = 0
        self.num_required = num_required
        self.max_segments = max_segments
        self.current_pool_size = num_required
        self._num_requested = 0
        # what this pool may still take from the global pool up to its size
        # (``current_pool_size - num_requested``, at least 0), as counted in the global
        # pool's running total (``NetworkBufferPool.num_owed``); kept by ``_update_owed``
        self._owed = 0
        self._available = deque()
        self._listeners = deque()
        self._availability = AvailabilityHelper(False)
        self._destroyed = False
        self._update_availability()

    # -- statistics ----------------------------------------------------------------------

    @property
    def segment_size(self):
        return self._network_pool.segment_size

    @property
    def num_requested(self):
        """Segments taken from the global pool (available here or in use)."""
        return self._num_requested

    @property
    def num_available(self):
        return len(self._available)

    @property
    def num_in_use(self):
        return self._num_requested - len(self._available)

    @property
    def num_overdraft(self):
        """Overdraft segments in use (beyond ``num_requested``)."""
        return self._num_overdraft

    @property
    def is_destroyed(self):
        return self._destroyed

    def stats(self):
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

    cpdef object request_buffer(self):
        """A buffer of one segment, or None if the pool has none to give right now."""
        seg = self._request_segment()
        return None if seg is None else Buffer(seg, self)

    cdef object _request_segment(self):
        if self._destroyed:
            raise PoolDestroyedError("local buffer pool destroyed")
        if self._available:
            seg = self._available.popleft()
        elif self._num_requested < self.current_pool_size:
            seg = self._network_pool.request_memory_segment()
            if seg is None:
                self._network_pool._register_waiting_pool(self)
                self._availability.c_set_unavailable()
                return None
            self._num_requested += 1
            self._update_owed()
        else:
            self._availability.c_set_unavailable()
            return None
        self._update_availability()
        return seg

    def request_overdraft_buffer(self):
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
    def is_available(self):
        return self._availability._available

    def get_available_future(self):
        return self._availability.get_available_future()

    cdef void _update_availability(self) except *:
        if self._destroyed:
            return
        if self._available or (
            self._num_requested < self.current_pool_size and self._global_free
        ):
            self._availability.c_set_available()
        else:
            self._availability.c_set_unavailable()
            if self._num_requested < self.current_pool_size:
                self._network_pool._register_waiting_pool(self)

    def _on_global_available(self):
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

    def add_buffer_listener(self, listener):
        """Register to be handed the next recycled buffer. False if the pool is destroyed."""
        if self._destroyed:
            return False
        self._listeners.append(listener)
        if self._num_requested < self.current_pool_size:
            self._network_pool._register_waiting_pool(self)
        return True

    # -- recycling -----------------------------------------------------------------------

    cpdef void recycle(self, object segment) except *:
        """BufferRecycler: a buffer of this pool was released (overdraft goes back first)."""
        if self._num_overdraft:
            self._num_overdraft -= 1
            self._network_pool.recycle(segment)
            return
        if self._destroyed or self._num_requested > self.current_pool_size:
            self._return_to_global(segment)
            return
        self._offer(segment)

    cdef void _offer(self, object segment) except *:
        listeners = self._listeners
        while listeners:
            listener = listeners.popleft()
            result = listener.notify_buffer_available(Buffer(segment, self))
            if result.needs_more_buffers:
                if self._destroyed:
                    listener.notify_buffer_destroyed()
                else:
                    listeners.append(listener)
            if result.is_buffer_used:
                return
        self._available.append(segment)
        self._availability.c_set_available()

    cdef void _return_to_global(self, object segment) except *:
        self._num_requested -= 1
        self._update_owed()
        self._network_pool.recycle(segment)

    cpdef void _update_owed(self) except *:
        """Bring the global pool's running ``num_owed`` up to date after this pool's size
        or ``num_requested`` changed (O(1); a destroyed pool owes nothing more: the global
        pool takes its last ``_owed`` off when it forgets it)."""
        if self._destroyed:
            return
        cdef Py_ssize_t owed = self.current_pool_size - self._num_requested
        if owed < 0:
            owed = 0
        if owed != self._owed:
            self._network_pool._num_owed += owed - self._owed
            self._owed = owed

    # -- sizing and lifecycle ------------------------------------------------------------

    def set_num_buffers(self, Py_ssize_t num_buffers):
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

    def destroy(self):
        """Give back every available segment; in-use ones go back as they are recycled."""
        if not self._destroyed:
            self._destroyed = True
            while self._available:
                self._return_to_global(self._available.popleft())
            while self._listeners:
                self._listeners.popleft().notify_buffer_destroyed()
            self._availability.fail(PoolDestroyedError("local buffer pool destroyed"))
        self._network_pool.destroy_buffer_pool(self)

    def __repr__(self):
        return (
            f"LocalBufferPool(size={self.current_pool_size} [{self.num_required}, "
            f"{self.max_segments}], requested={self._num_requested}, "
            f"available={len(self._available)}, overdraft={self._num_overdraft}, "
            f"destroyed={self._destroyed})"
        )
