"""A fault-injecting TCP proxy for tests (asyncpg's ``_testbase/fuzzer.py``, grown up).

``FaultProxy(target_host, target_port)`` listens on ``127.0.0.1:0`` and forwards every
connection it accepts to the target. It runs its own asyncio loop on a background thread,
so synchronous tests (PartitionReader, daemon processes) and asyncio tests drive it alike;
every public method is thread-safe and returns once the change is in force.

Faults are set per direction at any moment and apply to every connection, open or future:

* ``UPSTREAM`` is client -> target, ``DOWNSTREAM`` is target -> client;
* ``delay_ms``: every chunk is forwarded ``delay_ms`` after it arrived (latency, not a
  pause per chunk: chunks arriving together leave together);
* ``throttle_bps``: at most this many bytes per second leave in that direction;
* ``cut_after``: forward this many more bytes, then close both sides cleanly (FIN);
* ``reset_after``: forward this many more bytes, then reset both sides (SO_LINGER 0 ->
  RST), so the peers see ECONNRESET, typically in the middle of a frame;
* ``stall``: stop forwarding (and, once the small queue is full, stop reading, so TCP's
  own backpressure reaches the sender) until the stall is lifted.

The byte budgets of ``cut_after`` / ``reset_after`` count from the moment the fault is set,
over all connections in that direction, so "cut after 100 000 more bytes" is deterministic
whatever the timing; once spent, any connection that sends in that direction is ended at
its first byte, until the fault is changed (``clear()``).

``stats()`` reports bytes forwarded and connections; ``wait_for(predicate)`` waits for a
condition on them with a deadline.

Usage::

    with FaultProxy("127.0.0.1", port) as proxy:
        proxy.set_fault(DOWNSTREAM, cut_after=100_003)
        connect_to(proxy.address)
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import enum
import socket
import struct
import threading
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any, Final, TypeVar

__all__ = ["DOWNSTREAM", "UPSTREAM", "Direction", "Fault", "FaultProxy", "ProxyStats"]

_T = TypeVar("_T")

#: Bytes read from a socket at a time.
_CHUNK: Final = 64 * 1024
#: Chunks queued per direction and connection before the reader stops reading.
_QUEUE_CHUNKS: Final = 4
#: Granularity of throttled writes (bytes) at most.
_THROTTLE_SLICE: Final = 16 * 1024


class Direction(enum.Enum):
    UPSTREAM = "upstream"  # client -> target
    DOWNSTREAM = "downstream"  # target -> client


UPSTREAM: Final = Direction.UPSTREAM
DOWNSTREAM: Final = Direction.DOWNSTREAM


@dataclass(frozen=True, slots=True)
class Fault:
    """What happens to the bytes of one direction (the default: nothing)."""

    delay_ms: float = 0.0
    throttle_bps: float | None = None
    cut_after: int | None = None
    reset_after: int | None = None
    stall: bool = False

    def __post_init__(self) -> None:
        if self.delay_ms < 0:
            raise ValueError(f"delay_ms must be >= 0, got {self.delay_ms}")
        if self.throttle_bps is not None and self.throttle_bps <= 0:
            raise ValueError(f"throttle_bps must be > 0, got {self.throttle_bps}")
        for name in ("cut_after", "reset_after"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ValueError(f"{name} must be >= 0, got {value}")
        if self.cut_after is not None and self.reset_after is not None:
            raise ValueError("cut_after and reset_after are exclusive")


@dataclass(frozen=True, slots=True)
class ProxyStats:
    """Counters of a proxy (a snapshot)."""

    accepted: int  # connections accepted so far
    open: int  # connections currently open (either side)
    bytes_up: int  # client -> target bytes forwarded
    bytes_down: int  # target -> client bytes forwarded
    cuts: int  # connections ended by cut_after
    resets: int  # connections ended by reset_after

    def forwarded(self, direction: Direction) -> int:
        return self.bytes_up if direction is UPSTREAM else self.bytes_down


class _DirectionState:
    """The fault of one direction, with its remaining budget and a change signal."""

    def __init__(self) -> None:
        self.fault = Fault()
        self.budget: int | None = None  # bytes left before the cut/reset, over connections
        self.changed = asyncio.Event()
        self.forwarded = 0

    def set(self, fault: Fault) -> None:
        self.fault = fault
        self.budget = fault.cut_after if fault.cut_after is not None else fault.reset_after
        self.changed.set()  # wake stalled or throttled writers
        self.changed = asyncio.Event()


class _Ended(Exception):
    """A pump ends its connection (cut or reset)."""

    def __init__(self, reset: bool) -> None:
        super().__init__("reset" if reset else "cut")
        self.reset = reset


def _set_linger_zero(writer: asyncio.StreamWriter) -> None:
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))


class _Link:
    """One proxied connection: two pumps (reader -> queue -> writer per direction)."""

    def __init__(
        self,
        proxy: FaultProxy,
        client: tuple[asyncio.StreamReader, asyncio.StreamWriter],
        target: tuple[asyncio.StreamReader, asyncio.StreamWriter],
    ) -> None:
        self.proxy = proxy
        self.client = client
        self.target = target
        self.tasks: list[asyncio.Task[None]] = []
        self.ended = False

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        for direction, src, dst in (
            (UPSTREAM, self.client[0], self.target[1]),
            (DOWNSTREAM, self.target[0], self.client[1]),
        ):
            queue: asyncio.Queue[tuple[float, bytes] | None] = asyncio.Queue(_QUEUE_CHUNKS)
            self.tasks.append(loop.create_task(self._read(src, queue)))
            self.tasks.append(loop.create_task(self._write(direction, queue, dst)))

    async def _read(
        self, src: asyncio.StreamReader, queue: asyncio.Queue[tuple[float, bytes] | None]
    ) -> None:
        try:
            while True:
                data = await src.read(_CHUNK)
                if not data:
                    break
                await queue.put((time.monotonic(), data))
        except (ConnectionError, OSError):
            self.end(reset=True, injected=False)  # pass a peer's reset on as a reset
            return
        await queue.put(None)

    async def _write(
        self,
        direction: Direction,
        queue: asyncio.Queue[tuple[float, bytes] | None],
        dst: asyncio.StreamWriter,
    ) -> None:
        state = self.proxy._states[direction]
        try:
            while True:
                item = await queue.get()
                if item is None:  # the source closed: pass the FIN on
                    if dst.can_write_eof():
                        with contextlib.suppress(OSError, RuntimeError):
                            dst.write_eof()
                    return
                arrived, data = item
                while data:
                    fault = state.fault
                    if fault.stall:
                        await state.changed.wait()
                        continue
                    if fault.delay_ms:
                        wait = arrived + fault.delay_ms / 1000 - time.monotonic()
                        if wait > 0:
                            changed = state.changed
                            with contextlib.suppress(TimeoutError):
                                await asyncio.wait_for(changed.wait(), wait)
                            continue  # the fault may have changed meanwhile
                    n = len(data)
                    if fault.throttle_bps is not None:
                        n = min(n, _THROTTLE_SLICE, max(1, int(fault.throttle_bps / 50)))
                    if state.budget is not None:
                        n = min(n, state.budget)
                    piece, data = data[:n], data[n:]
                    if piece:
                        dst.write(piece)
                        state.forwarded += len(piece)
                        self.proxy._counts[direction] += len(piece)
                        if state.budget is not None:
                            state.budget -= len(piece)
                        await dst.drain()
                    if state.budget == 0:
                        raise _Ended(reset=fault.reset_after is not None)
                    if fault.throttle_bps is not None and piece:
                        changed = state.changed
                        with contextlib.suppress(TimeoutError):
                            await asyncio.wait_for(changed.wait(), len(piece) / fault.throttle_bps)
        except _Ended as e:
            self.end(reset=e.reset)
        except (ConnectionError, OSError):
            self.end(reset=True, injected=False)

    def end(self, reset: bool, *, injected: bool = True) -> None:
        """Close both sides (with RST when ``reset``) and stop both pumps. ``injected``:
        a fault did it (counted in the stats), not a peer."""
        if self.ended:
            return
        self.ended = True
        if injected and reset:
            self.proxy._resets += 1
        elif injected:
            self.proxy._cuts += 1
        for _, writer in (self.client, self.target):
            if reset:
                _set_linger_zero(writer)
                writer.transport.abort()
            else:
                writer.close()
        current = asyncio.current_task()
        for task in self.tasks:
            if task is not current:
                task.cancel()

    async def wait_closed(self) -> None:
        await asyncio.gather(*self.tasks, return_exceptions=True)
        for _, writer in (self.client, self.target):
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()


class FaultProxy:
    """A TCP proxy on 127.0.0.1:0 in front of ``target_host:target_port`` (see the module)."""

    def __init__(self, target_host: str, target_port: int, *, host: str = "127.0.0.1") -> None:
        self.target = (target_host, target_port)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="fault-proxy")
        self._thread.daemon = True
        self._thread.start()
        self._links: set[_Link] = set()
        self._accepted = 0
        self._cuts = 0
        self._resets = 0
        self._counts = {UPSTREAM: 0, DOWNSTREAM: 0}
        self._closed = False
        try:
            self._states = self._call(self._make_states())
            self._server = self._call(asyncio.start_server(self._on_client, host, 0))
        except BaseException:
            self._stop_loop()
            raise
        sockname = self._server.sockets[0].getsockname()
        self.host: str = sockname[0]
        self.port: int = sockname[1]

    @classmethod
    def for_address(cls, address: str) -> FaultProxy:
        """A proxy in front of ``host:port``."""
        host, _, port = address.rpartition(":")
        return cls(host, int(port))

    @property
    def address(self) -> str:
        """``host:port`` to connect to instead of the target."""
        return f"{self.host}:{self.port}"

    # -- the loop thread -------------------------------------------------------------------

    def _call(self, coro: Coroutine[Any, Any, _T], timeout: float = 10.0) -> _T:
        if threading.current_thread() is self._thread:
            raise RuntimeError("FaultProxy methods must be called from outside its loop thread")
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    async def _make_states(self) -> dict[Direction, _DirectionState]:
        return {d: _DirectionState() for d in Direction}

    async def _on_client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._accepted += 1
        try:
            target = await asyncio.open_connection(*self.target)
        except OSError:
            _set_linger_zero(writer)
            writer.transport.abort()
            return
        link = _Link(self, (reader, writer), target)
        self._links.add(link)
        link.start()
        try:
            await asyncio.gather(*link.tasks, return_exceptions=True)
        finally:
            await link.wait_closed()
            self._links.discard(link)

    # -- faults ----------------------------------------------------------------------------

    def set_fault(self, direction: Direction, fault: Fault | None = None, **kwargs: Any) -> None:
        """Replace ``direction``'s fault: a ``Fault``, or its fields as keywords."""
        if fault is None:
            fault = Fault(**kwargs)
        elif kwargs:
            fault = dataclasses.replace(fault, **kwargs)

        async def apply() -> None:
            self._states[direction].set(fault)

        self._call(apply())

    def set_faults(self, **kwargs: Any) -> None:
        """The same fault in both directions."""
        for direction in Direction:
            self.set_fault(direction, **kwargs)

    def clear(self) -> None:
        """No fault in either direction."""
        for direction in Direction:
            self.set_fault(direction, Fault())

    def fault(self, direction: Direction) -> Fault:
        return self._states[direction].fault

    def cut_all(self, *, reset: bool = False) -> int:
        """End every open connection now (FIN, or RST when ``reset``); how many."""

        async def cut() -> int:
            links = [link for link in self._links if not link.ended]
            for link in links:
                link.end(reset)
            return len(links)

        return self._call(cut())

    # -- observing -------------------------------------------------------------------------

    def stats(self) -> ProxyStats:
        async def snapshot() -> ProxyStats:
            return ProxyStats(
                accepted=self._accepted,
                open=len(self._links),
                bytes_up=self._counts[UPSTREAM],
                bytes_down=self._counts[DOWNSTREAM],
                cuts=self._cuts,
                resets=self._resets,
            )

        return self._call(snapshot())

    def wait_for(
        self, predicate: Callable[[ProxyStats], bool], timeout: float = 10.0
    ) -> ProxyStats:
        """Poll ``stats()`` until ``predicate`` holds; AssertionError with the last stats."""
        deadline = time.monotonic() + timeout
        while True:
            st = self.stats()
            if predicate(st):
                return st
            if time.monotonic() > deadline:
                raise AssertionError(f"proxy condition not reached within {timeout}s: {st}")
            time.sleep(0.01)

    # -- closing ---------------------------------------------------------------------------

    def close(self) -> None:
        """Stop listening, close every connection, stop the loop thread (idempotent)."""
        if self._closed:
            return
        self._closed = True

        async def shutdown() -> None:
            self._server.close()
            links = list(self._links)
            for link in links:
                link.end(reset=False, injected=False)
            await asyncio.gather(*(link.wait_closed() for link in links), return_exceptions=True)
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 5)

        try:
            with contextlib.suppress(concurrent.futures.TimeoutError):
                self._call(shutdown())
        finally:
            self._stop_loop()

    def _stop_loop(self) -> None:
        async def cancel_rest() -> None:
            current = asyncio.current_task()
            rest = [t for t in asyncio.all_tasks() if t is not current]
            for t in rest:
                t.cancel()
            await asyncio.gather(*rest, return_exceptions=True)

        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(cancel_rest(), self._loop).result(5)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        if not self._thread.is_alive():
            self._loop.close()

    def __enter__(self) -> FaultProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"FaultProxy({self.address} -> {self.target[0]}:{self.target[1]})"
