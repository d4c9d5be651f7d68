"""The client runtime: one background event loop per process, for synchronous callers.

PySpark task code is synchronous, and PySpark reuses Python worker processes across
tasks, so a loop thread started per task would pile up. Instead every task of a process
shares one daemon thread running one (uv)loop, started on first use; tasks submit
coroutines to it and wait for their results.

``stop`` (also run at interpreter exit) ends the loop as ``asyncio.run`` does: every task
still pending on it is cancelled and awaited, for ``STOP_TIMEOUT`` seconds at most, then
async generators are finalized and the loop is closed. Without that, pending tasks were
destroyed with the loop ("Task was destroyed but it is pending!") and their ``finally``
blocks, which release connections and buffers, never ran.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import logging
import os
import threading
from collections.abc import Coroutine
from typing import Any, Final, TypeVar

__all__ = ["STOP_TIMEOUT", "ClientRuntime", "get_runtime"]

log = logging.getLogger("exchange.client.runtime")

#: Seconds ``ClientRuntime.stop`` waits for the cancelled tasks to finish.
STOP_TIMEOUT: Final = 5.0

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
        self._stop_timeout = STOP_TIMEOUT
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._main, name="exchange-client-loop", daemon=True)
        self._thread.start()
        self._ready.wait()
        self.pid = os.getpid()

    def _main(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.call_soon(self._ready.set)
        try:
            self.loop.run_forever()
        finally:
            self._shutdown()

    def _shutdown(self) -> None:
        """On the loop thread, once the loop stopped: cancel and await what is pending."""
        loop = self.loop
        try:
            tasks = asyncio.all_tasks(loop)
            for task in tasks:
                task.cancel()
            if tasks:
                _, left = loop.run_until_complete(asyncio.wait(tasks, timeout=self._stop_timeout))
                for task in tasks - left:
                    if not task.cancelled() and task.exception() is not None:
                        log.warning(
                            "task %r failed while the runtime stopped",
                            task,
                            exc_info=task.exception(),
                        )
                if left:
                    log.warning(
                        "%d task(s) still pending %.1fs after the runtime cancelled them: %r",
                        len(left),
                        self._stop_timeout,
                        sorted(map(repr, left)),
                    )
            loop.run_until_complete(loop.shutdown_asyncgens())
        finally:
            loop.close()

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

    def stop(self, timeout: float = STOP_TIMEOUT) -> None:
        """Stop the loop, cancel the tasks still pending on it and wait up to ``timeout``
        seconds for them to finish; then close the loop. Idempotent."""
        if self._thread.is_alive() and not self.loop.is_closed():
            self._stop_timeout = timeout
            try:
                self.loop.call_soon_threadsafe(self.loop.stop)
            except RuntimeError:  # closed meanwhile by a concurrent stop
                return
            if threading.current_thread() is not self._thread:
                self._thread.join(timeout=timeout + 5)


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
