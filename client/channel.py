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
* Held items. A receive with ``hold=True`` takes the items but keeps their room: they
  still count against the capacity until the receiver calls ``release(n)`` (any thread).
  The bound is then on the items *in flight* (queued, or taken and not yet dealt with):
  a receiver that takes everything at once and works on it for long (a sender waiting
  for network credit) does not let the sender queue a second ``capacity`` meanwhile.
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
    #: items received with ``hold=True`` and not released yet (they take room)
    items_held: int = 0


_Wake = Callable[[], None]


class _Waiter:
    """An asyncio end waiting: its future, its loop and that loop's thread."""

    __slots__ = ("future", "loop", "thread")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.thread = threading.get_ident()
        self.future: asyncio.Future[None] = loop.create_future()

    def wake_here(self) -> None:
        if not self.future.done():
            self.future.set_result(None)

    def wake_from_elsewhere(self) -> None:
        self.loop.call_soon_threadsafe(self.wake_here)


class Channel(Generic[T]):
    """One sender, one receiver, ``capacity`` items at most (see the module docstring)."""

    def __init__(self, capacity: int, name: str = "channel") -> None:
        check_count("capacity", capacity, 1)
        self.name = name
        self._capacity = capacity
        self._items: deque[T] = deque()
        self._held = 0  # received with hold=True, not released: they still take room
        lock = threading.Lock()
        self._lock = lock
        self._readable = threading.Condition(lock)  # items queued, or closed
        self._writable = threading.Condition(lock)  # room made, or closed
        self._recv_threads = 0  # threads blocked in receive
        self._send_threads = 0  # threads blocked in send
        self._recv_async: list[_Waiter] = []
        self._send_async: list[_Waiter] = []
        self._notify: _Wake | None = None  # poll's
        self._room_notify: _Wake | None = None  # poll_room's
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
            after = self._wake_senders([]) if grew else []
        self._run(after)

    def statistics(self) -> ChannelStatistics:
        with self._lock:
            return ChannelStatistics(
                len(self._items),
                self._capacity,
                self._sender_open,
                self._receiver_open,
                self._send_threads + len(self._send_async) + (self._room_notify is not None),
                self._recv_threads + len(self._recv_async) + (self._notify is not None),
                self._sent,
                self._received,
                self._batches_sent,
                self._batches_received,
                self._wakeups,
                self._held,
            )

    def queued(self) -> list[T]:
        """A copy of the items queued now, in order (they stay queued)."""
        with self._lock:
            return list(self._items)

    @property
    def receiver_starved(self) -> bool:
        """True when the last receive found nothing and no send came since."""
        return self._starved

    # -- wake-ups (lock held; what they return runs after the lock is released) -------------

    def _wake(
        self,
        cond: threading.Condition,
        threads: int,
        waiters: list[_Waiter],
        notify: _Wake | None,
        after: list[_Wake],
    ) -> list[_Wake]:
        """Lock held: notify the blocked threads; what wakes asyncio waiters, and the
        armed ``notify``, is added to ``after``, run once the lock is released (``_run``)."""
        if notify is not None:
            self._wakeups += 1
            after.append(notify)
        if threads:
            self._wakeups += 1
            cond.notify_all()
        if waiters:
            here = threading.get_ident()
            for w in waiters:
                if w.thread == here:
                    after.append(w.wake_here)
                else:
                    self._wakeups += 1
                    after.append(w.wake_from_elsewhere)
            waiters.clear()
        return after

    def _wake_receivers(self, after: list[_Wake]) -> list[_Wake]:
        notify, self._notify = self._notify, None
        return self._wake(self._readable, self._recv_threads, self._recv_async, notify, after)

    def _wake_senders(self, after: list[_Wake]) -> list[_Wake]:
        notify, self._room_notify = self._room_notify, None
        return self._wake(self._writable, self._send_threads, self._send_async, notify, after)

    def _block(self, sending: bool, deadline: float | None, timeout: float | None) -> None:
        """Lock held: block this thread until woken (or the deadline passes, raising)."""
        remaining = None if deadline is None else deadline - time.monotonic()
        if remaining is not None and remaining <= 0:
            what = "no room" if sending else "nothing"
            raise ChannelTimeoutError(f"{self.name}: {what} within {timeout} s")
        if sending:
            self._send_threads += 1
        else:
            self._recv_threads += 1
        try:
            (self._writable if sending else self._readable).wait(remaining)
        finally:
            if sending:
                self._send_threads -= 1
            else:
                self._recv_threads -= 1

    async def _park(self, waiter: _Waiter, waiters: list[_Waiter]) -> None:
        """Wait on the loop until woken; a cancelled waiter leaves the list."""
        try:
            await waiter.future
        finally:
            with self._lock:
                if waiter in waiters:
                    waiters.remove(waiter)

    @staticmethod
    def _run(after: list[_Wake]) -> None:
        for wake in after:
            wake()

    # -- sending ---------------------------------------------------------------------------

    def _check_send(self) -> None:
        if not self._sender_open:
            raise ChannelClosedError(f"{self.name}: the sender is closed")
        if not self._receiver_open:
            raise ChannelBrokenError(f"{self.name}: the receiver is closed")

    def _fits(self, n: int) -> bool:
        taken = len(self._items) + self._held
        return taken == 0 or taken + n <= self._capacity

    def _put(self, batch: Sequence[T]) -> tuple[bool, list[_Wake]]:
        """Lock held: queue ``batch``; True when it fed a starved receiver."""
        self._items.extend(batch)
        self._sent += len(batch)
        self._batches_sent += 1
        fed, self._starved = self._starved, False
        return fed, self._wake_receivers([])

    def send_nowait(self, batch: Sequence[T], *, force: bool = False) -> bool:
        """Queue ``batch`` without waiting (``force``: even beyond the capacity); True when
        the receiver had found the channel empty since the last send (it starved)."""
        if not batch:
            return False
        with self._lock:
            self._check_send()
            if not force and not self._fits(len(batch)):
                raise ChannelFullError(f"{self.name}: {len(batch)} items do not fit")
            fed, after = self._put(batch)
        self._run(after)
        return fed

    def send(self, batch: Sequence[T], timeout: float | None = None) -> bool:
        """Queue ``batch``, blocking this thread until it fits (see ``send_nowait``)."""
        if not batch:
            return False
        with self._lock:
            self._wait_room(len(batch), timeout)
            fed, after = self._put(batch)
        self._run(after)
        return fed

    def wait_room(self, n: int = 1, timeout: float | None = None) -> None:
        """Block this thread until ``n`` more items would fit (``n=0``: until the channel
        holds at most its capacity); raises like a send would."""
        with self._lock:
            self._wait_room(n, timeout)

    def _wait_room(self, n: int, timeout: float | None) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            self._check_send()
            if self._fits(n):
                return
            self._block(True, deadline, timeout)

    def poll_room(self, n: int, notify: _Wake) -> bool:
        """True when ``n`` more items fit now; otherwise False after arming ``notify``,
        called once when the receiver makes room or either end closes."""
        with self._lock:
            self._check_send()
            if self._fits(n):
                return True
            self._room_notify = notify
            return False

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
                    fed, after = self._put(batch)
                    break
                waiter = _Waiter(loop)
                self._send_async.append(waiter)
            await self._park(waiter, self._send_async)
        self._run(after)
        return fed

    def close_sender(self) -> None:
        """No more sends: the receiver drains what is queued, then gets EndOfChannel."""
        with self._lock:
            if not self._sender_open:
                return
            self._sender_open = False
            # the receiver hears of the end; a send of this end waiting elsewhere fails
            after = self._wake_senders(self._wake_receivers([]))
        self._run(after)

    # -- receiving -------------------------------------------------------------------------

    def _take(self, hold: bool = False) -> list[T] | None:
        """Lock held: every item queued, or None (raising when none will come); with
        ``hold`` their room stays taken until ``release``."""
        if not self._receiver_open:
            raise ChannelClosedError(f"{self.name}: the receiver is closed")
        items = self._items
        if items:
            out = list(items)
            items.clear()
            self._received += len(out)
            self._batches_received += 1
            if hold:
                self._held += len(out)
            return out
        if not self._sender_open:
            raise EndOfChannel(f"{self.name}: the sender closed it")
        return None

    def _starving(self) -> bool:
        """Lock held, nothing queued: True the first time since the last send (and a
        hook is set to hear it)."""
        if self._starved:
            return False
        self._starved = True
        return self.on_starved is not None

    def receive_nowait(self) -> list[T]:
        """Every item queued (an empty list when none is)."""
        out = self._receive_or_arm(None)
        return [] if out is None else out

    def poll(self, notify: _Wake) -> list[T] | None:
        """Every item queued, or None after arming ``notify`` for the next send or close."""
        return self._receive_or_arm(notify)

    def _receive_or_arm(self, notify: _Wake | None) -> list[T] | None:
        with self._lock:
            out = self._take()
            if out is None:
                if notify is not None:
                    self._notify = notify
                starving = self._starving()
            else:
                after = self._wake_senders([])
        if out is None:
            if starving:
                self._call_starved()
            return None
        self._run(after)
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
                self._block(False, deadline, timeout)
            after = self._wake_senders([])
        self._run(after)
        return out

    async def areceive(self, *, hold: bool = False) -> list[T]:
        """Every item queued, waiting (asyncio) until there is one; ``hold``: their room
        stays taken until ``release`` (see the module docstring)."""
        loop = asyncio.get_running_loop()
        while True:
            with self._lock:
                out = self._take(hold)
                if out is not None:
                    after = [] if hold else self._wake_senders([])
                    break
                starving = self._starving()
                waiter = _Waiter(loop)
                self._recv_async.append(waiter)
            if starving:
                self._call_starved()
            await self._park(waiter, self._recv_async)
        self._run(after)
        return out

    def release(self, n: int) -> None:
        """Give back the room of ``n`` items received with ``hold=True`` (any thread);
        senders waiting for it are woken."""
        with self._lock:
            if not 0 <= n <= self._held:
                raise IllegalStateError(f"{self.name}: release({n}) with {self._held} held")
            self._held -= n
            after = self._wake_senders([]) if n else []
        self._run(after)

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
            after = self._wake_receivers(self._wake_senders([]))
        self._run(after)
        return left
