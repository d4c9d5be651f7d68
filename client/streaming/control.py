"""The control channel between a streaming job's driver (coordinator) and its tasks.

One TCP connection per task to the driver's ``ControlServer``; the messages are
``exchange.protocol.driver_messages``' control messages (RegisterTask first, then the
checkpoint and end-of-task messages each way) on the project's framing. Everything runs on
the process's client loop; both ends hand received messages to their own thread through a
``queue.Queue``, where a connection that ended appears as ``ControlLost``.

Attempts are fenced: a task registers with its job attempt and the token of that attempt,
so a task of a dead attempt (Spark lets it run on for seconds) is refused
(RegistrationRefused) and its connection closed; it fails at its next control call.

The driver's port faces whatever reaches it, so until a connection has registered it may
send one frame of at most ``MAX_REGISTER_FRAME`` bytes within ``REGISTER_TIMEOUT``, and
at most ``max_unregistered`` connections may be waiting to register at once: a newcomer
beyond that drops the oldest (a task registers as soon as it connects, so the oldest is
one that does not). Only a registered task's frames may be large (a collect sink's
records, up to ``MAX_FRAME``).
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import queue
import time
from dataclasses import dataclass
from typing import Final

from client.connection_base import FramedProtocol, connect
from client.rendezvous import listen_for_tasks
from client.runtime import ClientRuntime, get_runtime
from exchange.addresses import format_address
from exchange.best_effort import best_effort
from exchange.errors import ExchangeError, TransportError
from exchange.protocol.codec import MAX_CONTROL_FRAME_SIZE, encode
from exchange.protocol.driver_messages import (
    CONTROL_MESSAGE_IDS,
    RegisterTask,
    RegistrationRefused,
    TaskFailed,
    TaskFinished,
)
from exchange.protocol.messages import Message

__all__ = ["WAKEUP", "ControlClient", "ControlLost", "ControlServer", "Mail", "Wakeup"]

log = logging.getLogger("exchange.streaming.control")

#: A registered task's frame may carry a collect sink's records.
MAX_FRAME: Final = 256 * 1024 * 1024
#: The registration (token, attempt, task id, daemon address) before the token is checked.
MAX_REGISTER_FRAME: Final = MAX_CONTROL_FRAME_SIZE
#: Seconds a new connection has to register.
REGISTER_TIMEOUT: Final = 30.0


@dataclass(frozen=True, slots=True)
class ControlLost:
    """In an inbox: the connection ended (``error`` says why) at ``time`` (wall clock)
    before the task said it finished or failed."""

    error: str
    time: float


@dataclass(frozen=True, slots=True)
class Wakeup:
    """In a task's inbox, put by the task's own process (input handed over, room in
    its output): whoever waited looks again."""


WAKEUP: Final = Wakeup()

#: What a task's inbox holds.
Mail = Message | ControlLost | Wakeup


def _lost(error: ExchangeError) -> ControlLost:
    return ControlLost(f"{type(error).__name__}: {error}", time.time())


class _TaskConnection(FramedProtocol):
    """The driver's end of one task's connection."""

    def __init__(self, server: ControlServer) -> None:
        super().__init__(CONTROL_MESSAGE_IDS, MAX_REGISTER_FRAME)
        self._server = server
        self.task = ""  # set once registered
        self.refused = False
        self._timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self._server._admit(self)
        self._timer = self._loop.call_later(
            REGISTER_TIMEOUT, self.fail, TransportError("no registration in time")
        )

    def on_message(self, msg: Message) -> None:
        if self.task:
            self._server._received(self.task, msg)
            return
        if self._timer is not None:
            self._timer.cancel()
        self._server._register(self, msg)

    def on_lost(self, error: ExchangeError) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._server._disconnected(self, error)


class ControlServer:
    """The driver's end: registers tasks of one attempt, queues what they send."""

    def __init__(
        self,
        token: str,
        attempt: int,
        task_ids: set[str],
        *,
        host: str = "127.0.0.1",
        runtime: ClientRuntime | None = None,
        max_unregistered: int | None = None,
    ) -> None:
        """``max_unregistered``: connections that may be waiting to register at once
        (default: twice the tasks, at least 16)."""
        self._rt = runtime if runtime is not None else get_runtime()
        self.token = token
        self.attempt = attempt
        self.task_ids = set(task_ids)
        #: (task id, message) in arrival order; (task, ControlLost) when a task's
        #: connection ended before its TaskFinished or TaskFailed
        self.inbox: queue.Queue[tuple[str, Message | ControlLost]] = queue.Queue()
        self._conns: dict[str, _TaskConnection] = {}
        self._done: set[str] = set()
        self.max_unregistered = (
            max_unregistered if max_unregistered is not None else max(16, 2 * len(task_ids))
        )
        self._unregistered: dict[_TaskConnection, None] = {}  # oldest first
        #: connections closed unregistered: over the limit, refused, or malformed
        self.refused = 0
        #: set while no registered task is connected
        self._idle = asyncio.Event()
        self._idle.set()
        self._server: asyncio.Server | None = None
        self.host = host
        self.port = 0
        self._rt.run(self._start())

    async def _start(self) -> None:
        self._server, self.port = await listen_for_tasks(lambda: _TaskConnection(self), self.host)

    @property
    def address(self) -> str:
        return format_address(self.host, self.port)

    # -- the connections' events (on the loop) -------------------------------------------

    def _admit(self, conn: _TaskConnection) -> None:
        if len(self._unregistered) >= self.max_unregistered:
            oldest = next(iter(self._unregistered))
            del self._unregistered[oldest]
            oldest.fail(TransportError("dropped for a newer unregistered connection"))
        self._unregistered[conn] = None

    def _register(self, conn: _TaskConnection, msg: Message) -> None:
        self._unregistered.pop(conn, None)
        if (
            not isinstance(msg, RegisterTask)
            or not hmac.compare_digest(msg.token, self.token)
            or msg.attempt != self.attempt
            or msg.task_id not in self.task_ids
            or msg.task_id in self._conns
        ):
            conn.refused = True
            self.refused += 1
            conn.send(RegistrationRefused("unknown or stale task"))
            conn.close()
            return
        conn.task = msg.task_id
        conn.max_frame_size = MAX_FRAME
        self._conns[conn.task] = conn
        self._idle.clear()
        self.inbox.put((conn.task, msg))

    def _received(self, task: str, msg: Message) -> None:
        if isinstance(msg, TaskFinished | TaskFailed):
            self._done.add(task)
        self.inbox.put((task, msg))

    def _disconnected(self, conn: _TaskConnection, error: ExchangeError) -> None:
        self._unregistered.pop(conn, None)
        task = conn.task
        if not task:
            if not conn.refused:  # over the limit, silent, malformed or gone
                self.refused += 1
            return
        if task not in self._done:
            self.inbox.put((task, _lost(error)))
        if self._conns.get(task) is conn:
            del self._conns[task]
            if not self._conns:
                self._idle.set()

    # -- from the driver's thread --------------------------------------------------------

    def send(self, task: str, msg: Message) -> None:
        """Queue ``msg`` to ``task`` (any thread; dropped if the task is gone)."""
        self.broadcast(msg, {task})

    def broadcast(self, msg: Message, tasks: set[str] | None = None) -> None:
        """Queue ``msg`` to ``tasks`` (None: every task), encoded once, here."""
        frames = encode(msg)
        targets = sorted(self.task_ids if tasks is None else tasks)

        def write() -> None:
            for task in targets:
                conn = self._conns.get(task)
                if conn is not None:
                    conn.write(frames)

        self._rt.loop.call_soon_threadsafe(write)

    def wait_disconnected(self, timeout: float) -> bool:
        """Wait until no task is connected (everything they sent is in ``inbox``);
        False if some still are after ``timeout`` seconds."""

        async def idle() -> bool:
            try:
                await asyncio.wait_for(self._idle.wait(), timeout)
            except TimeoutError:
                return False
            return True

        return self._rt.run(idle())

    def close(self) -> None:
        async def stop() -> None:
            if self._server is not None:
                self._server.close()
            for conn in [*self._conns.values(), *self._unregistered]:
                conn.close()
            self._conns.clear()
            self._idle.set()

        with best_effort(log, "stopping the control server"):
            self._rt.run(stop())


class _DriverConnection(FramedProtocol):
    """A task's end: what the driver sends goes to ``inbox``."""

    def __init__(self, inbox: queue.Queue[Mail]) -> None:
        super().__init__(CONTROL_MESSAGE_IDS, MAX_FRAME)
        self._inbox = inbox
        self.closing = False

    def on_message(self, msg: Message) -> None:
        self._inbox.put(msg)

    def on_lost(self, error: ExchangeError) -> None:
        if not self.closing:
            self._inbox.put(_lost(error))


class ControlClient:
    """A task's end: registers, then sends and receives (``inbox``) from its thread."""

    def __init__(self, conn: _DriverConnection, runtime: ClientRuntime) -> None:
        self._rt = runtime
        self._conn = conn
        self.closed = False

    @property
    def inbox(self) -> queue.Queue[Mail]:
        """The driver's messages, in order; ControlLost once the connection ended."""
        return self._conn._inbox

    @classmethod
    def connect(
        cls,
        address: str,
        registration: RegisterTask,
        *,
        timeout: float = 30.0,
        runtime: ClientRuntime | None = None,
    ) -> ControlClient:
        """Connect to the driver at ``address`` (``host:port``, ``[v6]:port``) and register."""
        rt = runtime if runtime is not None else get_runtime()
        inbox: queue.Queue[Mail] = queue.Queue()

        async def open_() -> _DriverConnection:
            conn = await connect(
                address,
                lambda: _DriverConnection(inbox),
                timeout=timeout,
                peer="the job's driver",
            )
            conn.send(registration)
            return conn

        return cls(rt.run(open_()), rt)

    def send(self, msg: Message) -> None:
        """Send ``msg`` to the driver (any thread; encoded here, not on the loop)."""
        self._rt.loop.call_soon_threadsafe(self._conn.write, encode(msg))

    def flush(self) -> None:
        """Wait until what was sent so far is handed to the kernel (at most the
        transport's low-water mark still queued)."""
        self._rt.run(self._conn.drain())

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True

        async def stop() -> None:
            conn = self._conn
            conn.closing = True
            with best_effort(log, "draining the control connection"):
                await conn.drain()
            conn.close()
            await conn.closed

        with best_effort(log, "closing the control connection"):
            self._rt.run(stop(), timeout=10)
