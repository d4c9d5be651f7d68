"""Waiting for a condition, never for a fixed time: a loaded machine is slower, not wrong.

``wait_until`` (async, polls on the running loop) and ``wait_for`` (a thread) poll a
predicate until it holds and fail with what was awaited after a generous deadline."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import TypeVar

__all__ = ["wait_for", "wait_until"]

T = TypeVar("T")


async def wait_until(
    predicate: Callable[[], object], timeout: float = 10.0, what: str = "condition"
) -> None:
    """Poll ``predicate`` on the loop until it holds; AssertionError after ``timeout``."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not reached within {timeout}s")
        await asyncio.sleep(0.01)


def wait_for(predicate: Callable[[], T], timeout: float, what: str) -> T:
    """Poll ``predicate`` from this thread until it returns something true; returns it."""
    deadline = time.monotonic() + timeout
    while True:
        got = predicate()
        if got:
            return got
        assert time.monotonic() < deadline, f"not within {timeout} s: {what}"
        time.sleep(0.02)
