"""Best-effort steps of close and failure paths, logged instead of silently swallowed.

A close that has its own outcome to report (or an error already on its way) must not
fail because a secondary step failed: closing a connection that is already gone, telling
a peer about a failure, waiting for a cancelled helper task. ``best_effort`` runs such a
step, logs an ``Exception`` it raises with the caller's logger and goes on; it never
catches ``BaseException``, so KeyboardInterrupt, SystemExit and a cancellation of the
caller propagate. ``cancel_and_wait`` cancels a helper task and waits until it ended.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterator
from typing import Any

__all__ = ["best_effort", "cancel_and_wait", "wait_quietly"]


@contextlib.contextmanager
def best_effort(log: logging.Logger, what: str, level: int = logging.DEBUG) -> Iterator[None]:
    """Run the body; an ``Exception`` from it is logged (``what`` failed) and dropped."""
    try:
        yield
    except Exception:
        log.log(level, "%s failed", what, exc_info=True)


async def wait_quietly(fut: asyncio.Future[Any], log: logging.Logger, what: str) -> None:
    """Wait until ``fut`` (a task being stopped) is done, whatever its outcome.

    Its own cancellation and its failure are expected here (its failure is logged at
    debug level); a cancellation of the *caller* while it waits propagates.
    """
    try:
        await fut
    except asyncio.CancelledError:
        current = asyncio.current_task()
        if current is not None and current.cancelling():
            raise
    except Exception:
        log.debug("%s ended with an error", what, exc_info=True)


async def cancel_and_wait(task: asyncio.Future[Any] | None, log: logging.Logger, what: str) -> None:
    """Cancel ``task`` (if any) and wait until it has ended (``wait_quietly``)."""
    if task is None:
        return
    task.cancel()
    await wait_quietly(task, log, what)
