"""A bounded channel between two threads, each end blocking or asyncio: items pass in
batches, with one wake-up per batch at most (none when the other end is not waiting).

The semantics are those of anyio's memory object streams, for one sender and one
receiver that may live in different threads:

* ``send`` / ``asend`` put a whole batch (a list) at once. The channel holds at most
  ``capacity`` items: a batch waits until it fits, except into an empty channel (a batch
  larger than the capacity enters alone, so no batch waits forever). ``send_nowait``
  never waits: it raises ``ChannelFullError`` when the batch does not fit, or admits it
  anyway with ``force=True`` (what is never back-pressured: events).
* ``receive`` / ``areceive`` / ``receive_nowait`` return *every* item queued, in order,
  in one list: the receiver wakes once per batch, however many items reached it.
  ``poll(notify)`` is ``receive_nowait`` for a receiver that waits elsewhere (a mailbox):
  when nothing is queued, ``notify()`` is armed and called once by the next send or close.
* Close rules. ``close_sender()``: the receiver still gets everything queued, then
  ``EndOfChannel``; the sender's later sends raise ``ChannelClosedError``.
  ``close_receiver()``: returns what was queued and never received (its owner releases
  it); a send waiting for room, and every later send, raises ``ChannelBrokenError`` (the
  sender keeps its batch); a receive waiting in another thread, and every later receive,
  raises ``ChannelClosedError``. Both are idempotent and may be called from any thread.
* ``statistics()``: items queued, capacity, which ends are open and waiting, and the
  counts of items and batches through it and of the wake-ups it made (a blocked thread
  notified, an asyncio waiter woken from another thread or a ``notify`` called).

A waiting send or receive is woken only when it is waiting: a send into a channel whose
receiver is busy costs a lock and a ``deque.extend``, no system call. Timeouts of the
blocking calls raise ``ChannelTimeoutError``; a cancelled ``asend`` / ``areceive`` leaves
the channel as it was (nothing sent, nothing taken).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Generic, NamedTuple, TypeVar

from client._checks import check_count
from exchange.errors import ExchangeError, IllegalStateError

__all__ = [
    "Channel",
    "ChannelBrokenError",
    "ChannelClosedError",
    "ChannelFullError",
    "ChannelStatistics",
    "ChannelTimeoutError",
    "EndOfChannel",
]

log = logging.getLogger("exchange.client.channel")

T = TypeVar("T")


class ChannelClosedError(IllegalStateError):
    """This end of the channel was closed (by its owner): it may not be used any more."""


class ChannelBrokenError(IllegalStateError):
    """The receiver closed the channel: what is sent would never be received."""


class EndOfChannel(ExchangeError):
    """The sender closed the channel and every item sent was received."""


class ChannelFullError(ExchangeError):
    """``send_nowait`` of a batch that does not fit in the channel now."""


class ChannelTimeoutError(ExchangeError, TimeoutError):
    """A blocking send or receive did not complete within its timeout."""


class ChannelStatistics(NamedTuple):
    """A channel's figures (``Channel.statistics``)."""

    items_queued: int
    capacity: int
    sender_open: bool
    receiver_open: bool
    senders_waiting: int
    receivers_waiting: int
    items_sent: int
    items_received: int
    batches_sent: int
    batches_received: int
    #: threads notified, asyncio waiters woken from another thread, ``notify`` calls
    wakeups: int


class _Waiter:
    """An asyncio end waiting: its future and its loop (woken thread-safely)."""

    __slots__ = ("future", "loop")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.future: asyncio.Future[None] = loop.create_future()


def _set_done(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


class Channel(Generic[T]):
    """One sender, one receiver, ``capacity`` items at most (see the module docstring)."""

    def __init__(self, capacity: int, name: str = "channel") -> None:
        check_count("capacity", capacity, 1)
        self.name = name
        self._capacity = capacity
        self._items: deque[T] = deque()
        lock = threading.Lock()
        self._lock = lock
        self._readable = threading.Condition(lock)  # items queued, or closed
        self._writable = threading.Condition(lock)  # room made, or closed
        self._recv_threads = 0  # threads blocked in receive
        self._send_threads = 0  # threads blocked in send
        self._recv_async: list[_Waiter] = []
        self._send_async: list[_Waiter] = []
        self._notify: Callable[[], None] | None = None
        self._sender_open = True
        self._receiver_open = True
        self._starved = False  # a receive found nothing since the last send
        #: Called (in the receiving thread, without the lock) when a receive or poll
        #: finds the channel empty, once until the next send fills it.
        self.on_starved: Callable[[], None] | None = None
        self._sent = self._received = self._batches_sent = self._batches_received = 0
        self._wakeups = 0

    # -- figures ---------------------------------------------------------------------------

    @property
    def capacity(self) -> int:
        return self._capacity

    def set_capacity(self, capacity: int) -> None:
        """Change the bound (any thread); a larger one lets waiting senders in."""
        check_count("capacity", capacity, 1)
        with self._lock:
            grew = capacity > self._capacity
            self._capacity = capacity
            wake = self._wake_senders() if grew else []
        self._run(wake)

    def statistics(self) -> ChannelStatistics:
        with self._lock:
            return ChannelStatistics(
                len(self._items),
                self._capacity,
                self._sender_open,
                self._receiver_open,
                self._send_threads + len(self._send_async),
                self._recv_threads + len(self._recv_async) + (self._notify is not None),
                self._sent,
                self._received,
                self._batches_sent,
                self._batches_received,
                self._wakeups,
            )

    @property
    def receiver_starved(self) -> bool:
        """True when the last receive found nothing and no send came since."""
        return self._starved

    # -- wake-ups (lock held; what they return runs after the lock is released) -------------

    def _wake(
        self, cond: threading.Condition, threads: int, waiters: list[_Waiter]
    ) -> list[_Waiter]:
        if threads:
            self._wakeups += 1
            cond.notify_all()
        if not waiters:
            return waiters
        woken = waiters[:]
        waiters.clear()
        return woken

    def _wake_receivers(self) -> list[_Waiter]:
        return self._wake(self._readable, self._recv_threads, self._recv_async)

    def _wake_senders(self) -> list[_Waiter]:
        return self._wake(self._writable, self._send_threads, self._send_async)

    def _run(self, woken: list[_Waiter], notify: Callable[[], None] | None = None) -> None:
        """Wake asyncio waiters (directly on their own loop's thread) and ``notify``."""
        if woken:
            try:
                running: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
            except RuntimeError:
                running = None
            for w in woken:
                if w.loop is running:
                    _set_done(w.future)
                else:
                    with self._lock:
                        self._wakeups += 1
                    w.loop.call_soon_threadsafe(_set_done, w.future)
        if notify is not None:
            with self._lock:
                self._wakeups += 1
            notify()

    # -- sending ---------------------------------------------------------------------------

    def _check_send(self) -> None:
        if not self._sender_open:
            raise ChannelClosedError(f"{self.name}: the sender is closed")
        if not self._receiver_open:
            raise ChannelBrokenError(f"{self.name}: the receiver is closed")

    def _fits(self, n: int) -> bool:
        queued = len(self._items)
        return queued == 0 or queued + n <= self._capacity

    def _put(self, batch: Sequence[T]) -> tuple[bool, list[_Waiter], Callable[[], None] | None]:
        """Lock held: queue ``batch``; True when it fed a starved receiver."""
        self._items.extend(batch)
        self._sent += len(batch)
        self._batches_sent += 1
        fed, self._starved = self._starved, False
        notify, self._notify = self._notify, None
        return fed, self._wake_receivers(), notify

    def send_nowait(self, batch: Sequence[T], *, force: bool = False) -> bool:
        """Queue ``batch`` without waiting (``force``: even beyond the capacity); True when
        the receiver had found the channel empty since the last send (it starved)."""
        if not batch:
            return False
        with self._lock:
            self._check_send()
            if not force and not self._fits(len(batch)):
                raise ChannelFullError(f"{self.name}: {len(batch)} items do not fit")
            fed, woken, notify = self._put(batch)
        self._run(woken, notify)
        return fed

    def send(self, batch: Sequence[T], timeout: float | None = None) -> bool:
        """Queue ``batch``, blocking this thread until it fits (see ``send_nowait``)."""
        if not batch:
            return False
        n = len(batch)
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            while True:
                self._check_send()
                if self._fits(n):
                    break
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise ChannelTimeoutError(f"{self.name}: no room within {timeout} s")
                self._send_threads += 1
                try:
                    self._writable.wait(remaining)
                finally:
                    self._send_threads -= 1
            fed, woken, notify = self._put(batch)
        self._run(woken, notify)
        return fed

    async def asend(self, batch: Sequence[T]) -> bool:
        """Queue ``batch``, waiting (asyncio) until it fits (see ``send_nowait``)."""
        if not batch:
            return False
        n = len(batch)
        loop = asyncio.get_running_loop()
        while True:
            with self._lock:
                self._check_send()
                if self._fits(n):
                    fed, woken, notify = self._put(batch)
                    break
                waiter = _Waiter(loop)
                self._send_async.append(waiter)
            try:
                await waiter.future
            finally:
                with self._lock:
                    if waiter in self._send_async:
                        self._send_async.remove(waiter)
        self._run(woken, notify)
        return fed

    def close_sender(self) -> None:
        """No more sends: the receiver drains what is queued, then gets EndOfChannel."""
        with self._lock:
            if not self._sender_open:
                return
            self._sender_open = False
            notify, self._notify = self._notify, None
            woken = self._wake_receivers()
            woken += self._wake_senders()  # a send of this end waiting in another thread
        self._run(woken, notify)

    # -- receiving -------------------------------------------------------------------------

    def _take(self) -> list[T] | None:
        """Lock held: every item queued, or None (raising when none will come)."""
        if not self._receiver_open:
            raise ChannelClosedError(f"{self.name}: the receiver is closed")
        items = self._items
        if items:
            out = list(items)
            items.clear()
            self._received += len(out)
            self._batches_received += 1
            return out
        if not self._sender_open:
            raise EndOfChannel(f"{self.name}: the sender closed it")
        return None

    def _starving(self) -> bool:
        """Lock held, nothing queued: True the first time since the last send."""
        if self._starved:
            return False
        self._starved = True
        return self.on_starved is not None

    def _took(self, out: list[T]) -> list[_Waiter]:
        """Lock held: room was made."""
        return self._wake_senders() if out else []

    def receive_nowait(self) -> list[T]:
        """Every item queued (an empty list when none is)."""
        with self._lock:
            out = self._take()
            if out is None:
                starving = self._starving()
                out = []
            else:
                starving = False
            woken = self._took(out)
        self._run(woken)
        if starving:
            self._call_starved()
        return out

    def poll(self, notify: Callable[[], None]) -> list[T] | None:
        """Every item queued, or None after arming ``notify`` for the next send or close."""
        with self._lock:
            out = self._take()
            if out is None:
                self._notify = notify
                starving = self._starving()
            else:
                woken = self._took(out)
        if out is None:
            if starving:
                self._call_starved()
            return None
        self._run(woken)
        return out

    def receive(self, timeout: float | None = None) -> list[T]:
        """Every item queued, blocking this thread until there is one."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            while True:
                out = self._take()
                if out is not None:
                    break
                if self._starving():
                    self._lock.release()  # the hook may take locks of its own
                    try:
                        self._call_starved()
                    finally:
                        self._lock.acquire()
                    continue
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise ChannelTimeoutError(f"{self.name}: nothing within {timeout} s")
                self._recv_threads += 1
                try:
                    self._readable.wait(remaining)
                finally:
                    self._recv_threads -= 1
            woken = self._took(out)
        self._run(woken)
        return out

    async def areceive(self) -> list[T]:
        """Every item queued, waiting (asyncio) until there is one."""
        loop = asyncio.get_running_loop()
        while True:
            with self._lock:
                out = self._take()
                if out is not None:
                    woken = self._took(out)
                    break
                starving = self._starving()
                waiter = _Waiter(loop)
                self._recv_async.append(waiter)
            if starving:
                self._call_starved()
            try:
                await waiter.future
            finally:
                with self._lock:
                    if waiter in self._recv_async:
                        self._recv_async.remove(waiter)
        self._run(woken)
        return out

    def _call_starved(self) -> None:
        hook = self.on_starved
        if hook is not None:
            hook()

    def close_receiver(self) -> list[T]:
        """No more receives: returns what was queued and never received; a waiting send
        and later ones raise ChannelBrokenError, a waiting receive ChannelClosedError."""
        with self._lock:
            if not self._receiver_open:
                return []
            self._receiver_open = False
            left = list(self._items)
            self._items.clear()
            notify, self._notify = self._notify, None
            woken = self._wake_senders()
            woken += self._wake_receivers()
        self._run(woken, notify)
        return left
