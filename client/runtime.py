"""The client runtime: one background event loop per process, for synchronous callers.

PySpark task code is synchronous, and PySpark reuses Python worker processes across
tasks, so a loop thread started per task would pile up. Instead every task of a process
shares one daemon thread running one (uv)loop, started on first use; tasks submit
coroutines to it and wait for their results.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import os
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

__all__ = ["ClientRuntime", "get_runtime"]

T = TypeVar("T")


def _new_loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


class ClientRuntime:
    """A daemon thread running an event loop; ``run`` executes a coroutine on it."""

    def __init__(self) -> None:
        self.loop = _new_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._main, name="exchange-client-loop", daemon=True)
        self._thread.start()
        self._ready.wait()
        self.pid = os.getpid()

    def _main(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.call_soon(self._ready.set)
        self.loop.run_forever()

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run ``coro`` on the loop thread and wait for its result (re-raising errors)."""
        if threading.current_thread() is self._thread:
            coro.close()
            raise RuntimeError("ClientRuntime.run called from the loop thread itself")
        fut = self.submit(coro)
        try:
            return fut.result(timeout)
        except BaseException:
            fut.cancel()
            raise

    def call_soon(self, fn: Any, *args: Any) -> None:
        self.loop.call_soon_threadsafe(fn, *args)

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def stop(self) -> None:
        if self._thread.is_alive():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout=5)


_runtime: ClientRuntime | None = None
_lock = threading.Lock()


def get_runtime() -> ClientRuntime:
    """The process's runtime (a new one after fork: threads do not survive fork)."""
    global _runtime
    rt = _runtime
    if rt is not None and rt.pid == os.getpid() and rt.is_alive:
        return rt
    with _lock:
        rt = _runtime
        if rt is None or rt.pid != os.getpid() or not rt.is_alive:
            rt = ClientRuntime()
            _runtime = rt
            atexit.register(rt.stop)
    return rt
