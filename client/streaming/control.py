"""The control channel between a streaming job's driver (coordinator) and its tasks.

One TCP connection per task to the driver's ``ControlServer``; frames are a u32 length
and a msgpack map with a ``type``. Everything runs on the process's client loop; both ends
hand received messages to their own thread through a ``queue.Queue``.

Task -> driver: ``register`` (token, attempt, task id, its local daemon) first, then
``ack`` (checkpoint id, state handle), ``decline``, ``exhausted`` (a bounded source ran
out), ``finished`` (with its collect sinks' records, pickled), ``failed`` (error text,
when it failed (``time``, wall clock) and whether the error is a ``consequence`` of
another failure).
Driver -> task: ``start`` (every task's daemon, the checkpoint to restore), ``trigger``
(sources), ``complete``, ``abort``, ``stop`` (sources, a clean stop: end the input now, as
if exhausted), ``finish`` (after the final checkpoint: end the stream), ``cancel``.
An ``ack`` carries the state handle and the task's figures (``metrics``, Flink's
CheckpointMetrics and more): the state's size (``state_bytes``), for a task that reads its
alignment (``alignment``, seconds) and the bytes processed or parked meanwhile
(``aligned_bytes``), and its records so far (``records_in``, ``records_out``).

Attempts are fenced: a task registers with its job attempt and the token of that attempt,
so a task of a dead attempt (Spark lets it run on for seconds) is refused and its
connection closed; it fails at its next control call.

The driver's port faces whatever reaches it, so until a connection has registered it may
send one frame of at most ``MAX_REGISTER_FRAME`` bytes within ``REGISTER_TIMEOUT``, and
at most ``max_unregistered`` connections may be waiting to register at once: a newcomer
beyond that drops the oldest (a task registers as soon as it connects, so the oldest is
one that does not). Only a registered task's frames may be large (a collect sink's
records).
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import queue
import struct
import time
from typing import Any, Final

import msgpack

from client.rendezvous import listen_for_tasks
from client.runtime import ClientRuntime, get_runtime
from exchange.best_effort import best_effort
from exchange.errors import ProtocolError, TransportError

__all__ = ["ControlClient", "ControlServer"]

log = logging.getLogger("exchange.streaming.control")

_LEN: Final = struct.Struct(">I")
#: A registered task's frame may carry a collect sink's records.
MAX_FRAME: Final = 256 * 1024 * 1024
#: The registration (token, attempt, task id, daemon address) before the token is checked.
MAX_REGISTER_FRAME: Final = 4 * 1024
#: Seconds a new connection has to register.
REGISTER_TIMEOUT: Final = 30.0


def _frame(msg: dict[str, Any]) -> bytes:
    body: bytes = msgpack.packb(msg, use_bin_type=True)
    return _LEN.pack(len(body)) + body


async def _read_frame(reader: asyncio.StreamReader, limit: int = MAX_FRAME) -> dict[str, Any]:
    head = await reader.readexactly(_LEN.size)
    (n,) = _LEN.unpack(head)
    if n > limit:  # checked before a byte of the body is read
        raise ProtocolError(f"control frame of {n} bytes exceeds {limit}")
    try:
        msg = msgpack.unpackb(await reader.readexactly(n), raw=False, strict_map_key=False)
    except (ValueError, msgpack.UnpackException) as e:
        raise ProtocolError(f"malformed control frame: {e}") from e
    if not isinstance(msg, dict) or not isinstance(msg.get("type"), str):
        raise ProtocolError("a control frame is a map with a 'type'")
    return msg


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
        #: (task id, message) in arrival order; (task, {"type": "lost", "time": ...}) when
        #: a task's connection ended before its ``finished`` or ``failed``
        self.inbox: queue.Queue[tuple[str, dict[str, Any]]] = queue.Queue()
        self._writers: dict[str, asyncio.StreamWriter] = {}
        self._done: set[str] = set()
        self.max_unregistered = (
            max_unregistered if max_unregistered is not None else max(16, 2 * len(task_ids))
        )
        self._unregistered: dict[asyncio.StreamWriter, None] = {}  # oldest first
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
        self._server, self.port = await listen_for_tasks(self._serve, self.host)

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if len(self._unregistered) >= self.max_unregistered:
            oldest = next(iter(self._unregistered))
            del self._unregistered[oldest]
            oldest.transport.abort()  # its _serve ends with a ConnectionError
        task = ""
        self._unregistered[writer] = None
        try:
            try:
                first = await asyncio.wait_for(
                    _read_frame(reader, MAX_REGISTER_FRAME), REGISTER_TIMEOUT
                )
            except (asyncio.IncompleteReadError, ConnectionError, TimeoutError, ProtocolError):
                self.refused += 1
                return
            finally:
                self._unregistered.pop(writer, None)
            task = str(first.get("task", ""))
            if (
                first["type"] != "register"
                or not hmac.compare_digest(str(first.get("token", "")), self.token)
                or first.get("attempt") != self.attempt
                or task not in self.task_ids
                or task in self._writers
            ):
                self.refused += 1
                writer.write(_frame({"type": "refused", "reason": "unknown or stale task"}))
                task = ""
                async with asyncio.timeout(REGISTER_TIMEOUT):
                    await writer.drain()
                return
            self._writers[task] = writer
            self._idle.clear()
            self.inbox.put((task, first))
            while True:
                msg = await _read_frame(reader)
                if msg["type"] in ("finished", "failed"):
                    self._done.add(task)
                self.inbox.put((task, msg))
        except (asyncio.IncompleteReadError, ConnectionError, TimeoutError, ProtocolError) as e:
            if task and task not in self._done:
                lost = {"type": "lost", "error": f"{type(e).__name__}: {e}", "time": time.time()}
                self.inbox.put((task, lost))
        except asyncio.CancelledError:
            pass
        finally:
            if task:
                self._writers.pop(task, None)
                if not self._writers:
                    self._idle.set()
            writer.close()

    def send(self, task: str, msg: dict[str, Any]) -> None:
        """Queue ``msg`` to ``task`` (any thread; dropped if the task is gone)."""
        data = _frame(msg)

        def write() -> None:
            w = self._writers.get(task)
            if w is not None and not w.is_closing():
                w.write(data)

        self._rt.loop.call_soon_threadsafe(write)

    def broadcast(self, msg: dict[str, Any], tasks: set[str] | None = None) -> None:
        for t in sorted(self.task_ids if tasks is None else tasks):
            self.send(t, msg)

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
            for w in list(self._writers.values()):
                w.close()
            self._writers.clear()
            self._idle.set()

        with best_effort(log, "stopping the control server"):
            self._rt.run(stop())


class ControlClient:
    """A task's end: registers, then sends and receives (``inbox``) from its thread."""

    def __init__(self, runtime: ClientRuntime | None = None) -> None:
        self._rt = runtime if runtime is not None else get_runtime()
        self.inbox: queue.Queue[dict[str, Any]] = queue.Queue()
        self._writer: asyncio.StreamWriter | None = None
        self._pump: Any = None
        self.closed = False

    @classmethod
    def connect(
        cls, address: str, registration: dict[str, Any], *, timeout: float = 30.0
    ) -> ControlClient:
        self = cls()
        host, _, port = address.rpartition(":")

        async def open_() -> None:
            try:
                reader, writer = await asyncio.wait_for(
                    asyncio.open_connection(host, int(port)), timeout
                )
            except (OSError, TimeoutError) as e:
                raise TransportError(f"cannot reach the job's driver at {address}: {e}") from e
            writer.write(_frame({"type": "register", **registration}))
            await writer.drain()
            self._writer = writer
            self._pump = asyncio.get_running_loop().create_task(self._read(reader))

        self._rt.run(open_())
        return self

    async def _read(self, reader: asyncio.StreamReader) -> None:
        try:
            while True:
                self.inbox.put(await _read_frame(reader))
        except (asyncio.IncompleteReadError, ConnectionError, ProtocolError) as e:
            self.inbox.put({"type": "lost", "error": f"{type(e).__name__}: {e}"})
        except asyncio.CancelledError:
            pass

    def send(self, msg: dict[str, Any]) -> None:
        """Send ``msg`` to the driver (any thread)."""
        data = _frame(msg)

        def write() -> None:
            w = self._writer
            if w is not None and not w.is_closing():
                w.write(data)

        self._rt.loop.call_soon_threadsafe(write)

    def flush(self) -> None:
        """Wait until everything sent so far left this process."""

        async def drain() -> None:
            if self._writer is not None and not self._writer.is_closing():
                await self._writer.drain()

        self._rt.run(drain())

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True

        async def stop() -> None:
            if self._writer is not None:
                with best_effort(log, "draining the control connection"):
                    await self._writer.drain()
                self._writer.close()
            if self._pump is not None:
                self._pump.cancel()

        with best_effort(log, "closing the control connection"):
            self._rt.run(stop())
