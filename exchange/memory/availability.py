"""Availability futures: the asyncio face of Flink's AvailabilityProvider."""

from __future__ import annotations

import asyncio

__all__ = ["AvailabilityHelper"]


class AvailabilityHelper:
    """Tracks available / unavailable and hands out futures that complete on availability.

    Futures are created on the running loop of the caller of ``get_available_future``;
    completing them happens synchronously in ``set_available`` (same loop thread).
    """

    __slots__ = ("_available", "_failure", "_waiters")

    def __init__(self, available: bool = True) -> None:
        self._available = available
        self._waiters: list[asyncio.Future[None]] = []
        self._failure: BaseException | None = None

    @property
    def is_available(self) -> bool:
        return self._available

    def get_available_future(self) -> asyncio.Future[None]:
        """A future that is done once available (already done when available now)."""
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        if self._failure is not None:
            fut.set_exception(self._failure)
        elif self._available:
            fut.set_result(None)
        else:
            self._waiters.append(fut)
        return fut

    def set_available(self) -> None:
        self._available = True
        if self._waiters:
            waiters, self._waiters = self._waiters, []
            for fut in waiters:
                if not fut.done():
                    fut.set_result(None)

    def set_unavailable(self) -> None:
        self._available = False

    def fail(self, exc: BaseException) -> None:
        """Wake every waiter with an exception (the pool was destroyed); later futures
        fail at once too."""
        self._failure = exc
        self._available = False
        waiters, self._waiters = self._waiters, []
        for fut in waiters:
            if not fut.done():
                fut.set_exception(exc)
