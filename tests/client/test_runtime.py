"""ClientRuntime: the process's loop thread, and what its ``stop`` leaves behind."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import threading
import time

import pytest

from client.runtime import ClientRuntime


def test_run_returns_results_and_refuses_the_loop_thread() -> None:
    rt = ClientRuntime()
    try:

        async def add(a: int, b: int) -> int:
            await asyncio.sleep(0)
            return a + b

        assert rt.run(add(2, 3)) == 5

        async def nested() -> None:
            rt.run(add(1, 1))

        with pytest.raises(RuntimeError, match="loop thread itself"):
            rt.run(nested())
    finally:
        rt.stop()


def test_stop_cancels_and_awaits_the_tasks_still_pending() -> None:
    rt = ClientRuntime()
    started = threading.Event()
    cleaned: list[str] = []

    async def holds_a_resource(name: str) -> None:
        try:
            started.set()
            await asyncio.Event().wait()
        finally:
            await asyncio.sleep(0)  # a cleanup that needs the loop once more
            cleaned.append(name)

    futures = [rt.submit(holds_a_resource(n)) for n in ("a", "b")]
    assert started.wait(10)
    rt.stop()
    assert not rt.is_alive
    assert rt.loop.is_closed()
    assert sorted(cleaned) == ["a", "b"]
    for fut in futures:
        with pytest.raises(concurrent.futures.CancelledError):
            fut.result(0)
    rt.stop()  # again: nothing to do


def test_stop_waits_for_a_task_that_ignores_cancellation_only_as_long_as_told(
    caplog: pytest.LogCaptureFixture,
) -> None:
    rt = ClientRuntime()
    started = threading.Event()
    release = threading.Event()

    async def stubborn() -> None:
        started.set()
        while not release.is_set():
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.sleep(0.01)

    rt.submit(stubborn())
    assert started.wait(10)
    t0 = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="exchange.client.runtime"):
        rt.stop(timeout=0.3)
    elapsed = time.monotonic() - t0
    release.set()
    assert not rt.is_alive and rt.loop.is_closed()
    assert 0.3 <= elapsed < 0.3 + 5
    assert "1 task(s) still pending" in caplog.text and "stubborn" in caplog.text
