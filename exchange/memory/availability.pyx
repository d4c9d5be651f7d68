# cython: language_level=3
"""Availability futures: the asyncio face of Flink's AvailabilityProvider, compiled.

A ``cdef class`` because the buffer pools flip it for every buffer they hand out or take
back (``local_buffer_pool.pyx`` calls ``c_set_available`` / ``c_set_unavailable`` through
``availability.pxd``); ``availability.pyi`` types it for mypy. There is no Python version
of this module.
"""

import asyncio

__all__ = ["AvailabilityHelper"]


cdef class AvailabilityHelper:
    """Tracks available / unavailable and hands out futures that complete on availability.

    Futures are created on the running loop of the caller of ``get_available_future``;
    completing them happens synchronously in ``set_available`` (same loop thread).
    """

    def __init__(self, available=True):
        self._available = bool(available)
        self._waiters = []
        self._failure = None

    @property
    def is_available(self):
        return self._available

    def get_available_future(self):
        """A future that is done once available (already done when available now)."""
        fut = asyncio.get_running_loop().create_future()
        if self._failure is not None:
            fut.set_exception(self._failure)
        elif self._available:
            fut.set_result(None)
        else:
            self._waiters.append(fut)
        return fut

    cdef void c_set_available(self) except *:
        self._available = True
        if self._waiters:
            waiters = self._waiters
            self._waiters = []
            for fut in waiters:
                if not fut.done():
                    fut.set_result(None)

    def set_available(self):
        self.c_set_available()

    def set_unavailable(self):
        self._available = False

    def fail(self, exc):
        """Wake every waiter with an exception (the pool was destroyed); later futures
        fail at once too."""
        self._failure = exc
        self._available = False
        waiters = self._waiters
        self._waiters = []
        for fut in waiters:
            if not fut.done():
                fut.set_exception(exc)
