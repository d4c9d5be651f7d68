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

Ordinary stages (``whole_stage_retries=False``): Spark starts their tasks as slots free up
and retries a failed task alone, so a round takes the first attempt of each index; a
second attempt of an index (a retry), a registration to a round a task reported failed,
or a round ``check_round`` finds can never complete (the job runs only some of the
stage's tasks: ``take``) is refused at once, every waiting task with it
(``SchedulingError`` / ``UsageError``), instead of waiting for a set that never comes.

The messages are ``exchange.protocol.driver_messages``' (MeetRequest / AbortRound, answered
with Met or RendezvousRefused; one request per connection); every request carries the
exchange's random token, so only the driver's own tasks can register.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import secrets
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Final

from client.connection_base import FramedProtocol, connect
from client.runtime import ClientRuntime, get_runtime
from exchange.addresses import format_address
from exchange.best_effort import best_effort
from exchange.errors import ExchangeError, SchedulingError, TransportError, UsageError
from exchange.protocol.codec import MAX_CONTROL_FRAME_SIZE
from exchange.protocol.driver_messages import (
    RENDEZVOUS_MESSAGE_IDS,
    AbortRound,
    MeetRequest,
    Met,
    RefusalKind,
    RendezvousRefused,
    TaskLocation,
)
from exchange.protocol.messages import Message

__all__ = [
    "RendezvousServer",
    "RendezvousTicket",
    "TaskLocation",
    "listen_for_tasks",
    "rendezvous",
    "report_abort",
]

log = logging.getLogger("exchange.client.rendezvous")

#: A request (one location) fits a control frame; an answer carries every location.
_MAX_ANSWER: Final = 1 << 20
#: Seconds a connection has to send its request.
_REQUEST_TIMEOUT: Final = 30.0
_NO_RETRY: Final = (
    "its tasks run in an ordinary Spark stage (its input has another partition count than "
    "its output), which Spark retries task by task, and one task of a pipelined exchange "
    "cannot run again alone: the job fails. Give the input as many partitions as the "
    "output (a barrier stage, re-run whole) or use mode='blocking'"
)


@dataclass(frozen=True, slots=True)
class RendezvousTicket:
    """What a task needs to meet the others (shipped in the task's closure)."""

    #: the driver's rendezvous service, ``host:port`` (``[v6]:port``)
    address: str
    exchange_id: str
    token: str
    num_tasks: int
    #: False: an ordinary (not barrier) stage, whose tasks Spark retries one by one
    whole_stage_retries: bool = True


@dataclass(slots=True)
class _Round:
    """One run of the stage (in Spark: one stage id; each action runs a new stage)."""

    n: int
    #: False (an ordinary stage): one attempt per index, launched whenever a slot freed
    #: (its attempt ids need not be adjacent)
    whole_stage_retries: bool = True
    entries: dict[int, TaskLocation] = field(default_factory=dict)
    waiters: list[tuple[int, asyncio.Future[list[TaskLocation]]]] = field(default_factory=list)
    aborted: bool = False
    #: why the round can never complete (its tasks are answered with that error)
    refused: _Refusal | None = None

    def answer_for(self, attempt: int) -> list[TaskLocation] | None:
        if len(self.entries) < self.n:
            return None
        if not self.whole_stage_retries:
            return [self.entries[i] for i in range(self.n)]
        attempts = [loc.attempt for loc in self.entries.values()]
        lo, hi = min(attempts), max(attempts)
        if hi - lo >= self.n or abs(attempt - lo) >= self.n or abs(hi - attempt) >= self.n:
            return None
        return [self.entries[i] for i in range(self.n)]

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


class _Refusal(Exception):
    """A refusal, answered to the task as RendezvousRefused."""

    def __init__(self, kind: RefusalKind, message: str) -> None:
        super().__init__(message)
        self.kind = kind


#: refusals of a round -> the error its task raises (BAD_REQUEST: a TransportError)
_KINDS: Final[dict[RefusalKind, type[ExchangeError]]] = {
    RefusalKind.SCHEDULING: SchedulingError,
    RefusalKind.USAGE: UsageError,
}

#: what a round's driver hook gets: the round and every location registered so far
AbortHook = Callable[[int, list[TaskLocation]], Awaitable[None]]


@dataclass(slots=True)
class _Group:
    n: int
    on_abort: AbortHook | None = None
    whole_stage_retries: bool = True
    check_round: Callable[[int], Awaitable[str | None]] | None = None
    rounds: dict[int, _Round] = field(default_factory=dict)

    def round(self, key: int) -> _Round:
        r = self.rounds.get(key)
        if r is None:
            r = self.rounds[key] = _Round(self.n, self.whole_stage_retries)
        return r

    def waiters(self) -> list[asyncio.Future[list[TaskLocation]]]:
        return [fut for r in self.rounds.values() for _, fut in r.waiters]


async def listen_for_tasks(
    factory: Callable[[], asyncio.BaseProtocol], host: str
) -> tuple[asyncio.Server, int]:
    """A driver-side server on an ephemeral port for the application's tasks: on loopback
    when the driver's host is loopback, else on every interface (executors elsewhere; every
    IPv6 one when the host is an IPv6 address)."""
    loopback = host in ("127.0.0.1", "localhost", "::1")
    wildcard = "::" if ":" in host else "0.0.0.0"
    server = await asyncio.get_running_loop().create_server(
        factory, host if loopback else wildcard, 0
    )
    return server, int(server.sockets[0].getsockname()[1])


class _RequestConnection(FramedProtocol):
    """The driver's end of one rendezvous request: the request, then the answer."""

    def __init__(self, service: RendezvousServer) -> None:
        super().__init__(RENDEZVOUS_MESSAGE_IDS, MAX_CONTROL_FRAME_SIZE)
        self._service = service
        self._handler: asyncio.Task[None] | None = None
        self._timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self._timer = self._loop.call_later(
            _REQUEST_TIMEOUT, self.fail, TransportError("no rendezvous request in time")
        )

    def on_message(self, msg: Message) -> None:
        if self._handler is not None or not isinstance(msg, MeetRequest | AbortRound):
            self.fail(TransportError(f"unexpected {type(msg).__name__}"))
            return
        if self._timer is not None:
            self._timer.cancel()
        self._handler = self._loop.create_task(self._service._answer(self, msg))

    def on_lost(self, error: ExchangeError) -> None:
        if self._timer is not None:
            self._timer.cancel()
        if self._handler is not None:
            self._handler.cancel()  # the task is gone: nobody waits for the answer


class RendezvousServer:
    """The driver's rendezvous service, on the process's client loop."""

    def __init__(self, runtime: ClientRuntime | None = None, host: str = "127.0.0.1") -> None:
        self._rt = runtime if runtime is not None else get_runtime()
        self._groups: dict[str, tuple[str, _Group]] = {}
        self._server: asyncio.Server | None = None
        self._checks: set[asyncio.Future[None]] = set()
        self.host = host
        self.port = 0
        self._rt.run(self._start())

    async def _start(self) -> None:
        self._server, self.port = await listen_for_tasks(
            lambda: _RequestConnection(self), self.host
        )

    def open_group(
        self,
        exchange_id: str,
        num_tasks: int,
        on_abort: AbortHook | None = None,
        *,
        whole_stage_retries: bool = True,
        check_round: Callable[[int], Awaitable[str | None]] | None = None,
    ) -> RendezvousTicket:
        """A new meeting of ``num_tasks`` tasks; the ticket goes to each task.

        Tasks meet per round (``round_id``; in Spark the stage id, new with every action
        on the same RDD): a task is answered only with registrations of its own round.
        ``on_abort(round_id, locations)`` runs (on the loop, once per round) when a task
        reports that it failed, with every location of its round registered so far: the
        driver's chance to release what the failed stage left on the daemons (a task
        killed hard cleans nothing).

        ``whole_stage_retries=False``: the tasks run in an ordinary stage (see the module
        docstring). ``check_round(round_id)`` runs (on the loop) when a round gets its
        first task: a reason the round can never complete refuses it (``UsageError`` in
        its tasks), None lets it be.
        """
        if num_tasks <= 0:
            raise UsageError(f"num_tasks must be positive, got {num_tasks}")
        token = secrets.token_hex(16)

        def add() -> None:
            group = _Group(num_tasks, on_abort, whole_stage_retries, check_round)
            self._groups[exchange_id] = (token, group)

        self._rt.loop.call_soon_threadsafe(add)
        return RendezvousTicket(
            format_address(self.host, self.port),
            exchange_id,
            token,
            num_tasks,
            whole_stage_retries,
        )

    def close_group(self, exchange_id: str) -> None:
        def drop() -> None:
            entry = self._groups.pop(exchange_id, None)
            if entry is not None:
                for fut in entry[1].waiters():
                    if not fut.done():
                        fut.cancel()

        self._rt.loop.call_soon_threadsafe(drop)

    async def _answer(self, conn: _RequestConnection, req: MeetRequest | AbortRound) -> None:
        """Answer one request on ``conn`` (when its round completes), then close it."""
        try:
            entry = self._groups.get(req.exchange_id)
            if entry is None or not hmac.compare_digest(req.token, entry[0]):
                raise _Refusal(RefusalKind.BAD_REQUEST, "unknown exchange or bad token")
            group = entry[1]
            rnd = group.round(req.round_id)
            if isinstance(req, AbortRound):
                await self._abort(group, req.round_id, rnd)
                if not group.whole_stage_retries and rnd.refused is None:
                    self._refuse(
                        rnd,
                        _Refusal(
                            RefusalKind.SCHEDULING, f"a task of its stage failed: {_NO_RETRY}"
                        ),
                    )
                conn.send(Met(()))
                return
            loc = req.location
            index, attempt = loc.index, loc.attempt
            if not index < group.n:
                raise _Refusal(RefusalKind.BAD_REQUEST, f"index {index} out of range")
            old = rnd.entries.get(index)
            if not group.whole_stage_retries and old is not None and old.attempt != attempt:
                self._refuse(
                    rnd,
                    _Refusal(
                        RefusalKind.SCHEDULING,
                        f"Spark ran task {index} again (attempt {attempt} after {old.attempt}: "
                        f"a retried or resubmitted task): {_NO_RETRY}",
                    ),
                )
                await self._abort(group, req.round_id, rnd)
            if rnd.refused is not None:
                raise rnd.refused
            if not rnd.entries and group.check_round is not None:
                check = asyncio.ensure_future(self._check(group, req.round_id, rnd))
                self._checks.add(check)
                check.add_done_callback(self._checks.discard)
            if old is None or old.attempt <= attempt:
                rnd.entries[index] = loc
            fut: asyncio.Future[list[TaskLocation]] = asyncio.get_running_loop().create_future()
            rnd.waiters.append((attempt, fut))
            rnd.settle()
            conn.send(Met(tuple(await fut)))
        except _Refusal as e:
            conn.send(RendezvousRefused(e.kind, str(e)))
        finally:
            conn.close()

    @staticmethod
    async def _abort(group: _Group, round_id: int, rnd: _Round) -> None:
        """The driver's clean-up of a failed round, once."""
        if not rnd.aborted and group.on_abort is not None:
            rnd.aborted = True
            await group.on_abort(round_id, list(rnd.entries.values()))

    @staticmethod
    def _refuse(rnd: _Round, refusal: _Refusal) -> None:
        """The round can never complete: its waiting tasks and later ones get ``refusal``."""
        rnd.refused = refusal
        for _, fut in rnd.waiters:
            if not fut.done():
                fut.set_exception(refusal)
        rnd.waiters = []

    async def _check(self, group: _Group, round_id: int, rnd: _Round) -> None:
        assert group.check_round is not None
        try:
            reason = await group.check_round(round_id)
        except Exception:  # the check is an early answer only: the tasks still time out
            log.warning("checking round %d of a rendezvous failed", round_id, exc_info=True)
            return
        if reason is not None and rnd.refused is None:
            self._refuse(rnd, _Refusal(RefusalKind.USAGE, reason))
            await self._abort(group, round_id, rnd)

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
            for check in list(self._checks):
                check.cancel()
            for _ in range(10):  # let the cancelled handlers close their connections
                await asyncio.sleep(0)

        with best_effort(log, "stopping the rendezvous service"):
            self._rt.run(stop(), timeout=5)


class _RequestClient(FramedProtocol):
    """A task's end of one rendezvous request: ``reply`` gets the answer."""

    def __init__(self) -> None:
        super().__init__(RENDEZVOUS_MESSAGE_IDS, _MAX_ANSWER)
        self.reply: asyncio.Future[Met | RendezvousRefused] = self._loop.create_future()

    def on_message(self, msg: Message) -> None:
        if isinstance(msg, Met | RendezvousRefused) and not self.reply.done():
            self.reply.set_result(msg)
        else:
            self.fail(TransportError(f"unexpected {type(msg).__name__} from the rendezvous"))

    def on_lost(self, error: ExchangeError) -> None:
        if not self.reply.done():
            self.reply.set_exception(error)


async def _meet(
    ticket: RendezvousTicket, request: MeetRequest | AbortRound, timeout: float
) -> list[TaskLocation]:
    index = request.location.index if isinstance(request, MeetRequest) else request.index
    conn = await connect(ticket.address, _RequestClient, peer="the driver's rendezvous")
    try:
        conn.send(request)
        try:
            reply = await asyncio.wait_for(conn.reply, timeout)
        except TimeoutError:
            waited = (
                f"task {index} of exchange {ticket.exchange_id} waited {timeout:.0f}s for the "
                f"other {ticket.num_tasks - 1} tasks of its pipelined stage"
            )
            if ticket.whole_stage_retries:
                raise TransportError(waited) from None
            raise SchedulingError(
                f"{waited}: they must all run at once, and an ordinary Spark stage (its input "
                "has another partition count than its output) starts its tasks only as task "
                f"slots free up; it needs {ticket.num_tasks} free task slots when the action "
                "runs (other jobs held them?): free them, give the input as many partitions "
                "as the output (a barrier stage, which waits for its slots), or use "
                "mode='blocking'"
            ) from None
        except TransportError as e:
            raise TransportError(f"the driver's rendezvous closed the connection: {e}") from e
        if isinstance(reply, RendezvousRefused):
            if reply.kind is RefusalKind.BAD_REQUEST:
                raise TransportError(f"rendezvous refused: {reply.message}")
            error = _KINDS[reply.kind]
            raise error(f"task {index} of exchange {ticket.exchange_id}: {reply.message}")
        return list(reply.locations)
    finally:
        conn.close()
        await conn.closed


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
        request = AbortRound(ticket.exchange_id, ticket.token, round_id, index, attempt)
        rt.run(_meet(ticket, request, timeout), timeout=timeout)


def rendezvous(
    ticket: RendezvousTicket,
    location: TaskLocation,
    *,
    round_id: int = 0,
    timeout: float = 300.0,
    runtime: ClientRuntime | None = None,
) -> list[TaskLocation]:
    """Register this task (``location.index``, ``location.attempt``) and wait for every
    task of its round's location (index order)."""
    rt = runtime if runtime is not None else get_runtime()
    request = MeetRequest(ticket.exchange_id, ticket.token, round_id, location)
    return rt.run(_meet(ticket, request, timeout))
