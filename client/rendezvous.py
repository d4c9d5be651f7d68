"""Task rendezvous through the driver: how the tasks of a pipelined stage find each other.

``BarrierTaskContext.allGather`` costs about a second (the JVM polls once a second), so
the tasks of a pipelined exchange meet at a small TCP service the driver runs on its
client loop instead. Each task registers ``(index, attempt, location)`` and is answered,
as soon as every index has registered, with everyone's location.

Rounds: Spark re-runs a failed barrier stage whole, with new ``taskAttemptId()``s, and the
killed tasks of the old round may still be running for a few seconds. The tasks of one
round are launched together and get consecutive attempt ids, all above those of earlier
rounds; so the latest registration per index wins, and a task with attempt ``a`` is
answered only with a set of ``n`` registrations whose attempt ids all lie within ``n`` of
``a`` and of each other (a set from one round). A task of a dead round simply never
completes its set; it gives up after ``timeout``.

The wire format is one JSON object per line each way; every request carries the
exchange's random token, so only the driver's own tasks can register.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import secrets
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Final

from client.runtime import ClientRuntime, get_runtime
from exchange.best_effort import best_effort
from exchange.errors import TransportError, UsageError

__all__ = ["RendezvousServer", "RendezvousTicket", "rendezvous", "report_abort"]

log = logging.getLogger("exchange.client.rendezvous")

_MAX_LINE: Final = 1 << 20


@dataclass(frozen=True, slots=True)
class RendezvousTicket:
    """What a task needs to meet the others (shipped in the task's closure)."""

    address: str
    port: int
    exchange_id: str
    token: str
    num_tasks: int


@dataclass(slots=True)
class _Round:
    """One run of the stage (in Spark: one stage id; each action runs a new stage)."""

    n: int
    entries: dict[int, tuple[int, Any]] = field(default_factory=dict)
    waiters: list[tuple[int, asyncio.Future[list[Any]]]] = field(default_factory=list)
    aborted: bool = False

    def answer_for(self, attempt: int) -> list[Any] | None:
        if len(self.entries) < self.n:
            return None
        attempts = [a for a, _ in self.entries.values()]
        lo, hi = min(attempts), max(attempts)
        if hi - lo >= self.n or abs(attempt - lo) >= self.n or abs(hi - attempt) >= self.n:
            return None
        return [self.entries[i][1] for i in range(self.n)]

    def settle(self) -> None:
        still = []
        for attempt, fut in self.waiters:
            if fut.done():
                continue
            answer = self.answer_for(attempt)
            if answer is None:
                still.append((attempt, fut))
            else:
                fut.set_result(answer)
        self.waiters = still


@dataclass(slots=True)
class _Group:
    n: int
    on_abort: Callable[[int, list[Any]], Awaitable[None]] | None = None
    rounds: dict[int, _Round] = field(default_factory=dict)

    def round(self, key: int) -> _Round:
        r = self.rounds.get(key)
        if r is None:
            r = self.rounds[key] = _Round(self.n)
        return r

    def waiters(self) -> list[asyncio.Future[list[Any]]]:
        return [fut for r in self.rounds.values() for _, fut in r.waiters]


async def listen_for_tasks(
    serve: Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]],
    host: str,
    **kwargs: Any,
) -> tuple[asyncio.Server, int]:
    """A driver-side server on an ephemeral port for the application's tasks: on loopback
    when the driver's host is loopback, else on every interface (executors elsewhere)."""
    bind = "0.0.0.0" if host not in ("127.0.0.1", "localhost", "::1") else host
    server = await asyncio.start_server(serve, bind, 0, **kwargs)
    return server, int(server.sockets[0].getsockname()[1])


class RendezvousServer:
    """The driver's rendezvous service, on the process's client loop."""

    def __init__(self, runtime: ClientRuntime | None = None, host: str = "127.0.0.1") -> None:
        self._rt = runtime if runtime is not None else get_runtime()
        self._groups: dict[str, tuple[str, _Group]] = {}
        self._server: asyncio.Server | None = None
        self.host = host
        self.port = 0
        self._rt.run(self._start())

    async def _start(self) -> None:
        self._server, self.port = await listen_for_tasks(self._serve, self.host, limit=_MAX_LINE)

    def open_group(
        self,
        exchange_id: str,
        num_tasks: int,
        on_abort: Callable[[int, list[Any]], Awaitable[None]] | None = None,
    ) -> RendezvousTicket:
        """A new meeting of ``num_tasks`` tasks; the ticket goes to each task.

        Tasks meet per round (``round_id``; in Spark the stage id, new with every action
        on the same RDD): a task is answered only with registrations of its own round.
        ``on_abort(round_id, locations)`` runs (on the loop, once per round) when a task
        reports that it failed, with every location of its round registered so far: the
        driver's chance to release what the failed stage left on the daemons (a task
        killed hard cleans nothing).
        """
        if num_tasks <= 0:
            raise UsageError(f"num_tasks must be positive, got {num_tasks}")
        token = secrets.token_hex(16)

        def add() -> None:
            self._groups[exchange_id] = (token, _Group(num_tasks, on_abort))

        self._rt.loop.call_soon_threadsafe(add)
        return RendezvousTicket(self.host, self.port, exchange_id, token, num_tasks)

    def close_group(self, exchange_id: str) -> None:
        def drop() -> None:
            entry = self._groups.pop(exchange_id, None)
            if entry is not None:
                for fut in entry[1].waiters():
                    if not fut.done():
                        fut.cancel()

        self._rt.loop.call_soon_threadsafe(drop)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            line = await asyncio.wait_for(reader.readline(), 30)
            req = json.loads(line)
            if not isinstance(req, dict):
                raise ValueError("not an object")
            entry = self._groups.get(str(req.get("exchange")))
            if entry is None or not hmac.compare_digest(str(req.get("token")), entry[0]):
                raise ValueError("unknown exchange or bad token")
            group = entry[1]
            round_id = req.get("round", 0)
            if not isinstance(round_id, int):
                raise ValueError("round must be an int")
            rnd = group.round(round_id)
            if req.get("abort"):
                if not rnd.aborted and group.on_abort is not None:
                    rnd.aborted = True
                    await group.on_abort(round_id, [loc for _, loc in rnd.entries.values()])
                writer.write(b'{"ok": []}\n')
                await writer.drain()
                return
            index, attempt = req["index"], req["attempt"]
            if not isinstance(index, int) or not 0 <= index < group.n:
                raise ValueError(f"index {index!r} out of range")
            if not isinstance(attempt, int):
                raise ValueError("attempt must be an int")
            old = rnd.entries.get(index)
            if old is None or old[0] <= attempt:
                rnd.entries[index] = (attempt, req.get("location"))
            fut: asyncio.Future[list[Any]] = asyncio.get_running_loop().create_future()
            rnd.waiters.append((attempt, fut))
            rnd.settle()
            answer = await fut
            writer.write(json.dumps({"ok": answer}).encode() + b"\n")
            await writer.drain()
        except (ValueError, KeyError, TypeError, json.JSONDecodeError) as e:
            with best_effort(log, "answering a bad rendezvous request"):
                writer.write(json.dumps({"error": str(e)}).encode() + b"\n")
                await writer.drain()
        except (asyncio.CancelledError, TimeoutError, ConnectionError):
            pass
        finally:
            writer.close()

    def close(self) -> None:
        """Stop serving; tasks still waiting are let go (their connections close)."""

        async def stop() -> None:
            if self._server is not None:
                self._server.close()
                await self._server.wait_closed()
            for _, group in self._groups.values():
                for fut in group.waiters():
                    fut.cancel()
            self._groups.clear()
            for _ in range(10):  # let the cancelled handlers close their connections
                await asyncio.sleep(0)

        with best_effort(log, "stopping the rendezvous service"):
            self._rt.run(stop(), timeout=5)


async def _meet(
    ticket: RendezvousTicket,
    index: int,
    attempt: int,
    location: Any,
    timeout: float,
    *,
    abort: bool = False,
    round_id: int = 0,
) -> list[Any]:
    try:
        reader, writer = await asyncio.wait_for(
            asyncio.open_connection(ticket.address, ticket.port, limit=_MAX_LINE), 10
        )
    except (OSError, TimeoutError) as e:
        raise TransportError(
            f"cannot reach the driver's rendezvous at {ticket.address}:{ticket.port}: {e}"
        ) from e
    try:
        req = {
            "exchange": ticket.exchange_id,
            "token": ticket.token,
            "index": index,
            "attempt": attempt,
            "location": location,
            "abort": abort,
            "round": round_id,
        }
        writer.write(json.dumps(req).encode() + b"\n")
        await writer.drain()
        try:
            line = await asyncio.wait_for(reader.readline(), timeout)
        except TimeoutError:
            raise TransportError(
                f"task {index} of exchange {ticket.exchange_id} waited {timeout:.0f}s for the "
                f"other {ticket.num_tasks - 1} tasks of its pipelined stage"
            ) from None
        if not line:
            raise TransportError("the driver's rendezvous closed the connection")
        reply = json.loads(line)
        if "error" in reply:
            raise TransportError(f"rendezvous refused: {reply['error']}")
        result: list[Any] = reply["ok"]
        return result
    finally:
        writer.close()


def report_abort(
    ticket: RendezvousTicket,
    index: int,
    attempt: int,
    *,
    round_id: int = 0,
    timeout: float = 10.0,
    runtime: ClientRuntime | None = None,
) -> None:
    """Tell the driver this task failed (best effort: the task's own error goes on)."""
    rt = runtime if runtime is not None else get_runtime()
    with best_effort(log, f"telling the driver that task {index} failed", logging.WARNING):
        meeting = _meet(ticket, index, attempt, None, timeout, abort=True, round_id=round_id)
        rt.run(meeting, timeout=timeout)


def rendezvous(
    ticket: RendezvousTicket,
    index: int,
    attempt: int,
    location: Any,
    *,
    round_id: int = 0,
    timeout: float = 300.0,
    runtime: ClientRuntime | None = None,
) -> list[Any]:
    """Register this task and wait for every task of its round's location (index order)."""
    rt = runtime if runtime is not None else get_runtime()
    return rt.run(_meet(ticket, index, attempt, location, timeout, round_id=round_id))
