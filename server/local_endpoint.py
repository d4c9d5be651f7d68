"""The local endpoint: a Unix socket through which tasks on this host use the daemon.

It speaks the data protocol (a consumer on this host reads over the socket, no TCP) plus
the producer messages of ``exchange.protocol.local_messages``. A producer connection owns
one ResultPartition, driven by a sans-I/O ``exchange.local.ProducerSession``: the daemon
grants the task credit as segments of the partition's pool are reserved for it, so a task
pushes at most what the pool can hold and waits (for AddProducerCredit) when it is full:
backpressure reaching the producer task. A pushed data buffer is received in place: the
PushBuffer frame is a data frame of the connection's in-place decoder, whose body sink is
the session's ``landing_view`` (the reserved segment), so the kernel writes the body
straight into it. This module only moves bytes and messages.

With shared memory (``server.shared_arenas``), a producer's partition takes its segments
from its application's shared arena: the connection sends SharedArena (a one-time token
and the first segments granted) and the task fetches the arena's descriptor on the
hand-out socket beside the local socket (``<local_socket>.arena``, same mode): it sends
the token and gets the descriptor as ``SCM_RIGHTS``. A token is good once, only while its
connection is open, and names only the arena of the application that connection
authenticated for. The task then commits filled segments by index (CommitSegments).

A consumer connection that says it can map (RequestArena) is offered its application's
arena the same way (SharedArena without segments, a token for the hand-out socket), as
soon as that application has one here (at RequestArena or a later PartitionRequest; one
is made for it when the application has finished blocking partitions here, which are
read into it); once it answers ArenaMapped, data buffers in that arena go as
SharedBufferResponse descriptors and come back by index (RecycleSegments); the
connection holds them meanwhile, and its loss returns them
(``exchange.network.server_connection``), unless the daemon dropped it: then its process
(``SO_PEERCRED``) may still read them, and they stay pinned until it exits
(``server.segment_pins``). A process with ``max_consumer_pins_per_process`` segments
pinned is offered no arena any more, and its connections reading in place are turned to
the socket, until it exits. An arena offered to a consumer stays until the consumer's
connection closes. Where no arena can be offered the
consumer reads over the socket, and the log says why once per connection.

A consumer task may also report its gates' figures (TaskMetrics) on a connection of its
own; the latest report per (connection, task, gate) is kept on that connection, so it
goes when the connection closes: a task that stopped leaves no stale gauges.

A streaming job's driver publishes its job's status (JobStatus) the same way; the latest
status of each job is kept on the endpoint's ``jobs`` board (``server.jobs``), under the
application the driver's connection authenticated for, also after the driver's connection
closes, so a finished job stays on the dashboard.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import socket
import time
from typing import ClassVar, Final, Protocol

from exchange.consumer.input_channel import BATCH_FLOATING_BUFFERS
from exchange.errors import (
    ConfigError,
    ExchangeError,
    InsufficientBuffersError,
    PartitionError,
    ProtocolError,
)
from exchange.local.producer_session import PUSH_BUFFER_FRAMES, ProducerSession, PushHeader
from exchange.memory.local_buffer_pool import LocalBufferPool
from exchange.memory.network_buffer_pool import NetworkBufferPool
from exchange.network.server_connection import DATA_PORT_MESSAGES, ServerConnection
from exchange.partition.result_partition import ResultPartition
from exchange.partition.result_partition_id import ResultPartitionID
from exchange.partition.result_partition_manager import ResultPartitionManager
from exchange.partition.result_partition_type import ResultPartitionType
from exchange.protocol.local_messages import (
    ARENA_SOCKET_SUFFIX,
    ARENA_TOKEN_SIZE,
    ArenaMapped,
    CommitSegments,
    CreatePartition,
    DaemonInfo,
    DaemonInfoRequest,
    FailPartition,
    FinishPartition,
    JobStatus,
    NoArena,
    PartitionCreated,
    PushBuffer,
    RecycleSegments,
    Released,
    ReleaseDataset,
    RequestArena,
    RequestOverdraft,
    SharedArena,
    TaskMetrics,
)
from exchange.protocol.messages import ErrorResponse, Message, PartitionRequest, error_response_for
from server.config import DaemonConfig
from server.jobs import JobBoard
from server.metrics import TaskReport
from server.partition_request_server import DataServer, PartitionRequestServerProtocol
from server.segment_pins import PeerProcess, SegmentPins, peer_process
from server.shared_arenas import SharedArenas

__all__ = ["EndpointDaemon", "LocalEndpoint", "LocalEndpointProtocol"]

log = logging.getLogger("exchange.server.local")

#: How long a producer whose partition is gone may take to read why and close.
_FAILED_PRODUCER_GRACE: Final = 2.0
#: Task gates one connection may report (each report of a new one adds a series).
MAX_TASK_REPORTS_PER_CONNECTION: Final = 16


class EndpointDaemon(Protocol):
    """What the local endpoint uses of its daemon (``server.daemon.ExchangeDaemon``):
    the endpoint is given its daemon, it does not import it."""

    config: DaemonConfig
    manager: ResultPartitionManager
    shared_arenas: SharedArenas
    segment_size: int
    bytes_in: int
    partitions_failed: int

    def info(self) -> DaemonInfo: ...

    def create_partition(
        self,
        pid: ResultPartitionID,
        ptype: ResultPartitionType,
        num_subpartitions: int,
        *,
        app_id: str = "",
        network_pool: NetworkBufferPool | None = None,
    ) -> ResultPartition: ...

    def release_dataset(self, dataset_id: str, app_id: str | None = None) -> int: ...


class LocalEndpoint(DataServer):
    """The daemon's Unix-socket server."""

    def __init__(self, daemon: EndpointDaemon, **kwargs: object) -> None:
        super().__init__(daemon.manager, **kwargs)  # type: ignore[arg-type]
        self.daemon = daemon
        self.path: str | None = None
        self.producers = 0
        self.bytes_received = 0
        self.buffers_received = 0
        self.overdraft_granted = 0
        self.partitions_created = 0
        self.producer_failures = 0
        #: producer bytes by path: committed in a shared arena, or pushed over the socket
        self.bytes_shared_memory = 0
        self.bytes_socket = 0
        #: consumer payload bytes sent as arena descriptors, by connections now closed
        self.closed_consumer_bytes_shared = 0
        self.arena_path: str | None = None
        #: segments of consumer connections the daemon dropped, kept until their process exits
        self.pins = SegmentPins(max_per_process=daemon.config.max_consumer_pins_per_process)
        self.pins.on_cap = self._read_over_the_socket
        self._handout: asyncio.Task[None] | None = None
        self._handouts: set[asyncio.Task[None]] = set()
        # unaligned checkpoints: overtaken buffers handed back to producer tasks
        self.output_state_bytes = 0
        self.output_state_buffers = 0
        self.jobs = JobBoard(
            lambda: daemon.manager.partitions,
            self.task_reports,
            daemon.config,
            waiting=self.producers_waiting,
        )

    def protocol_factory(self) -> PartitionRequestServerProtocol:
        return LocalEndpointProtocol(self)

    async def start_unix(self, path: str, *, mode: int = 0o600, gid: int | None = None) -> str:
        """Listen on the Unix socket ``path``, created 0600 and only then given to group
        ``gid`` and ``mode`` (it is never wider than asked, not even for a moment)."""
        # A socket file left by a crashed daemon is replaced; one a live daemon listens on
        # is not (unlinking it would silently cut that daemon off from its tasks).
        if _is_listening(path):
            raise OSError(errno.EADDRINUSE, f"local socket {path!r} is in use by a running daemon")
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        loop = asyncio.get_running_loop()
        old = os.umask(0o177)  # the socket is the daemon's user's only
        try:
            self._server = await loop.create_unix_server(self.protocol_factory, path)
        finally:
            os.umask(old)
        self.path = path
        try:
            if gid is not None:
                os.chown(path, -1, gid)
            if mode != 0o600:
                os.chmod(path, mode)
            if self.daemon.shared_arenas.unavailable is None:
                self._start_handout(path + ARENA_SOCKET_SUFFIX, mode, gid)
        except OSError as exc:
            await self.close()
            raise ConfigError(
                "local_socket_group" if gid is not None else "local_socket_mode",
                f"cannot give {path!r} to group {gid} with mode {mode:04o}: {exc} (the "
                "daemon must run as root or as a member of that group)",
            ) from None
        return path

    # -- shared arenas: descriptors handed out by token ----------------------------------

    def _start_handout(self, path: str, mode: int, gid: int | None) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)  # ours: the main socket was free, so no daemon runs here
        lsock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o177)
        try:
            lsock.bind(path)
        except OSError:
            lsock.close()
            raise
        finally:
            os.umask(old)
        self.arena_path = path
        if gid is not None:
            os.chown(path, -1, gid)
        if mode != 0o600:
            os.chmod(path, mode)
        lsock.listen(64)
        lsock.setblocking(False)
        self._handout = asyncio.get_running_loop().create_task(self._serve_handouts(lsock))

    async def _serve_handouts(self, lsock: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        try:
            while True:
                conn, _ = await loop.sock_accept(lsock)
                task = loop.create_task(self._hand_out(conn))
                self._handouts.add(task)
                task.add_done_callback(self._handouts.discard)
        finally:
            lsock.close()

    async def _hand_out(self, conn: socket.socket) -> None:
        """Read a token; answer with its arena's descriptor, or close (unknown token)."""
        loop = asyncio.get_running_loop()
        with conn:
            conn.setblocking(False)
            token = b""
            try:
                async with asyncio.timeout(self.handshake_timeout):
                    while len(token) < ARENA_TOKEN_SIZE:
                        chunk = await loop.sock_recv(conn, ARENA_TOKEN_SIZE - len(token))
                        if not chunk:
                            return
                        token += chunk
            except (TimeoutError, OSError) as e:
                log.info("arena hand-out: no token read (%s)", e or "timed out")
                return
            pool = self.daemon.shared_arenas.redeem(token)
            if pool is None or pool.arena_fd is None:
                log.warning("arena hand-out refused: unknown, used or expired token")
                return
            try:
                socket.send_fds(conn, [b"\0"], [pool.arena_fd])
            except OSError as e:
                log.warning("arena hand-out failed: %s", e)

    async def _stop_handout(self) -> None:
        tasks = [t for t in (self._handout, *self._handouts) if t is not None]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._handout = None
        if self.arena_path is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.arena_path)
            self.arena_path = None

    async def close(self) -> None:
        await self._stop_handout()
        await super().close()
        self.pins.close()  # the connections are gone; the arenas go next
        if self.path is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)

    def stats(self) -> dict[str, int]:
        base = super().stats()
        live = [c.connection for c in self.connections if c.connection is not None]
        shared_reads = self.closed_consumer_bytes_shared + sum(c.bytes_shared for c in live)
        base.update(
            producers=self.producers,
            consumers=base["readers"],
            bytes_received=self.bytes_received,
            buffers_received=self.buffers_received,
            partitions_created=self.partitions_created,
            producer_failures=self.producer_failures,
            overdraft_granted=self.overdraft_granted,
            bytes_shared_memory=self.bytes_shared_memory,
            bytes_socket=self.bytes_socket,
            shared_arenas=len(self.daemon.shared_arenas),
            shared_segments_in_use=sum(p.num_in_use for p in self.daemon.shared_arenas.pools()),
            consumer_bytes_shared_memory=shared_reads,
            consumer_bytes_socket=base["bytes_sent"] - shared_reads,
            consumer_segments_held=sum(c.num_held for c in live),
            consumer_segments_lent=sum(
                c.segments_lent for c in self.connections if isinstance(c, LocalEndpointProtocol)
            ),
            consumer_segments_pinned=self.pins.num_pinned,
            consumer_reads_refused=self.pins.num_refused,
            output_state_bytes=self.output_state_bytes,
            output_state_buffers=self.output_state_buffers,
        )
        return base

    def _read_over_the_socket(self, process: PeerProcess | None) -> None:
        """``process`` reached ``max_consumer_pins_per_process``: its connections that
        read in place send bytes from now on (what they hold stays held)."""
        for proto in self.connections:
            if isinstance(proto, LocalEndpointProtocol):
                proto.refuse_in_place_reads()  # those of a process at the cap

    def producers_waiting(self) -> dict[tuple[str, int], float]:
        """(dataset, partition index) -> seconds its producer task has been waiting for
        credit in its current wait, for every producer waiting now."""
        out: dict[tuple[str, int], float] = {}
        for conn in self.connections:
            session = getattr(conn, "session", None)
            if session is not None and session.back_pressured_now > 0:
                pid = session.partition.partition_id
                out[(pid.dataset_id, pid.partition_index)] = session.back_pressured_now
        return out

    def task_reports(self) -> list[TaskReport]:
        """The latest report of every task gate on an open connection, by (task, gate);
        of two connections reporting the same gate (a task retried), the newer report."""
        latest: dict[tuple[str, str], TaskReport] = {}
        for conn in self.connections:
            for key, report in getattr(conn, "task_reports", {}).items():
                seen = latest.get(key)
                if seen is None or report.received_at >= seen.received_at:
                    latest[key] = report
        return [latest[k] for k in sorted(latest)]


def _is_listening(path: str) -> bool:
    """True if something accepts connections on the Unix socket ``path``."""
    if not os.path.exists(path):
        return False
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(1.0)
    try:
        probe.connect(path)
    except TimeoutError:
        return True  # a full backlog: someone listens
    except OSError:
        return False  # refused (stale file) or not a socket
    finally:
        probe.close()
    return True


class LocalEndpointProtocol(PartitionRequestServerProtocol):
    """A local connection: a consumer (data protocol) or a producer (one partition)."""

    accepted_messages: ClassVar[frozenset[type[Message]]] = DATA_PORT_MESSAGES | {
        CreatePartition,
        PushBuffer,
        CommitSegments,
        FinishPartition,
        FailPartition,
        RequestOverdraft,
        RequestArena,
        ArenaMapped,
        RecycleSegments,
        DaemonInfoRequest,
        TaskMetrics,
        JobStatus,
    }
    #: A pushed data buffer's payload is received straight into its reserved segment.
    data_frames = PUSH_BUFFER_FRAMES

    def __init__(self, endpoint: LocalEndpoint) -> None:
        super().__init__(endpoint)
        self.endpoint = endpoint
        self.daemon = endpoint.daemon
        self.session: ProducerSession | None = None
        self._producer_failed = False
        self._arena_token: bytes | None = None
        # a consumer that can map its application's arena: offered which (pinned), told why not
        self._wants_arena = False
        self._read_offer: NetworkBufferPool | None = None
        self._read_token: bytes | None = None
        self._no_arena_logged = False
        self._in_place_refused = False  # its process was at max_consumer_pins_per_process
        self._process: PeerProcess | None = None
        self._process_known = False
        # id(pool) -> (arena, pool, segments): partition pools grown by this reader's credit
        self._lent: dict[int, tuple[NetworkBufferPool, LocalBufferPool, int]] = {}
        #: (task, gate) -> the latest TaskMetrics of that gate on this connection
        self.task_reports: dict[tuple[str, str], TaskReport] = {}

    def fail_producer(self, resp: ErrorResponse) -> None:
        """Tell the producer task why its partition is gone, then let *it* close.

        Closing first would make the pushes it still has in flight fail with EPIPE before
        it reads the reason; so pushes are dropped from now on, and the connection is
        closed after a grace period if the task does not close it.
        """
        if self._producer_failed:
            return
        self._producer_failed = True
        self.send(resp)
        self._loop.call_later(_FAILED_PRODUCER_GRACE, self.close)

    # -- pushes: the payload lands in the segment reserved for it ----------------------------

    def body_sink(self, header: PushHeader) -> memoryview | None:
        session = self.session
        if session is None or self._producer_failed:
            return None  # decoded as a message: refused, or dropped (see on_message)
        return session.landing_view(header)

    def on_payload(self, header: PushHeader, payload: memoryview) -> None:
        session = self.session
        assert session is not None
        was_open = session.is_open  # else the partition went while the bytes arrived
        try:
            session.on_data_pushed(header.subpartition, header.size)
        except PartitionError as e:
            self._push_refused(session, e)
            return
        if was_open:
            self._count_push(header.size)
            self.endpoint.bytes_socket += header.size

    def _push_refused(self, session: ProducerSession, e: PartitionError) -> None:
        """The partition is gone (released, or a consumer failed): tell the task."""
        session.fail(str(e))
        self.fail_producer(error_response_for(e))

    def _count_push(self, n: int, buffers: int = 1) -> None:
        self.endpoint.bytes_received += n
        self.endpoint.buffers_received += buffers
        self.daemon.bytes_in += n

    def on_message(self, msg: Message) -> None:
        if type(msg) is CommitSegments:
            self._commit(msg)
            return
        if type(msg) is RecycleSegments:
            self._conn().give_back(msg.segments)
            return
        if type(msg) is PushBuffer:
            if self._producer_failed:
                return  # in flight before the task learned its partition is gone
            session = self.session
            if session is None:
                raise ProtocolError("PushBuffer before CreatePartition")
            try:  # an event (data buffers land in place, see body_sink)
                session.on_push(msg.subpartition, msg.data_type, memoryview(msg.payload))
            except PartitionError as e:
                self._push_refused(session, e)
                return
            if msg.data_type.is_buffer:
                self._count_push(len(msg.payload))
                self.endpoint.bytes_socket += len(msg.payload)
            return
        if self._producer_failed and isinstance(msg, (FinishPartition, FailPartition)):
            return
        match msg:
            case CreatePartition():
                self._create(msg)
            case FinishPartition():
                if self.session is None:
                    raise ProtocolError("FinishPartition without an open partition")
                try:
                    self.send(self.session.finish())
                except PartitionError as e:
                    self.fail_producer(error_response_for(e))
            case FailPartition(reason=reason):
                if self.session is not None and self.session.fail(
                    f"producer task failed: {reason}"
                ):
                    self._count_failure()
            case RequestOverdraft(count=count):
                if self.session is None:
                    raise ProtocolError("RequestOverdraft without an open partition")
                self.endpoint.overdraft_granted += self.session.request_overdraft(count)
            case ReleaseDataset(dataset_id=ds):
                self.send(Released(self.daemon.release_dataset(ds, self._conn().app_id)))
            case DaemonInfoRequest():
                self.send(self.daemon.info())
            case TaskMetrics():
                self._task_report(msg)
            case JobStatus():
                self.endpoint.jobs.update(msg, self._conn().app_id)
            case RequestArena():
                self._wants_arena = True
                app_id = self._conn().app_id
                why = self._offer_arena(self.daemon.manager.has_finished_blocking(app_id))
                if why is not None:
                    self.send(NoArena(why))
            case ArenaMapped():
                offer = self._read_offer
                if offer is None:
                    raise ProtocolError("ArenaMapped without a SharedArena offered")
                # (destroyed: the daemon is shutting down; at the cap: its process reached
                # it since the offer)
                if not offer.is_destroyed and self.refuse_in_place_reads() is None:
                    conn = self._conn()
                    conn.read_arena = offer
                    self._pin_on_drop(conn)
            case PartitionRequest():
                super().on_message(msg)
                if self._wants_arena and self._read_offer is None:
                    self._offer_arena(self._is_blocking(msg))
                self._lend_read_credit(msg)
            case _:
                super().on_message(msg)

    def _commit(self, msg: CommitSegments) -> None:
        """Filled segments of the shared arena: queued where they lie (one batch)."""
        if self._producer_failed:
            return  # in flight before the task learned its partition is gone
        session = self.session
        if session is None:
            raise ProtocolError("CommitSegments before CreatePartition")
        buffers, size = session.buffers_received, session.bytes_received
        try:
            session.commit_all(msg.commits)
        except PartitionError as e:
            self._push_refused(session, e)
        finally:
            size = session.bytes_received - size
            self._count_push(size, session.buffers_received - buffers)
            self.endpoint.bytes_shared_memory += size

    def _is_blocking(self, req: PartitionRequest) -> bool:
        """Whether the connection's application has ``req``'s partition, blocking."""
        try:
            part = self.daemon.manager.get_partition(req.partition_id, self._conn().app_id)
        except PartitionError:
            return False
        return part.partition_type.is_blocking

    @property
    def reader_process(self) -> PeerProcess | None:
        """The process at the other end (``SO_PEERCRED`` at the first question; None:
        unknown)."""
        if not self._process_known:
            transport = self.transport
            sock = None if transport is None else transport.get_extra_info("socket")
            self._process = peer_process(sock)
            self._process_known = transport is not None
        return self._process

    def refuse_in_place_reads(self) -> str | None:
        """If this consumer's process is at ``max_consumer_pins_per_process``: no more
        descriptors to it (its reads go over the socket), counted and logged once; why."""
        if not self._wants_arena:
            return None  # not a consumer that reads in place (a producer, a driver)
        pins = self.endpoint.pins
        process = self.reader_process
        if not pins.at_cap(process):
            return None
        conn = self.connection
        if conn is not None:
            conn.read_arena = None  # data buffers go as bytes; what it holds stays held
        why = (
            f"its process {'(unknown)' if process is None else process.pid} has "
            f"{pins.pinned_for(process)} shared segment(s) pinned "
            f"(max_consumer_pins_per_process = {pins.max_per_process})"
        )
        if not self._in_place_refused:
            self._in_place_refused = True
            pins.num_refused += 1
            log.warning("consumer %s reads over the socket, not in place: %s", self.peer, why)
        return why

    def _offer_arena(self, reads_blocking: bool) -> str | None:
        """Offer a consumer its application's arena, once, if there is one (made for it
        when it reads blocking partitions: they are read into it) and its process may
        hold more; else why not."""
        if self._read_offer is not None:
            return None
        refused = self.refuse_in_place_reads()
        if refused is not None:
            return refused
        arenas = self.daemon.shared_arenas
        app_id = self._conn().app_id
        pool = arenas.existing(app_id)
        if pool is None and reads_blocking:
            pool = arenas.pool_for(app_id, "its readers read over the socket")
        if pool is None:
            why = (
                arenas.unavailable
                or (arenas.refusal(app_id) if reads_blocking else None)
                or f"application {app_id!r} has no shared arena here yet (no producer of it "
                "wrote into one)"
            )
            if not self._no_arena_logged:
                self._no_arena_logged = True
                log.info("consumer %s reads over the socket for now: %s", self.peer, why)
            return why
        self._read_offer = pool
        arenas.pin(pool)
        self._read_token = token = arenas.issue_token(pool)
        self.send(SharedArena(token, pool.arena_size, (), pool.segment_size))
        if self._no_arena_logged:
            log.info("consumer %s: its application's shared arena exists now, offered", self.peer)
        return None

    def _lend_read_credit(self, req: PartitionRequest) -> None:
        """A consumer reading in place holds its floating credit in the producer's pool
        (over the socket it holds copies in its own memory): with only the pool's
        ``max(2n + 8, 16)`` the whole stream cycled through those few segments, a few at a
        time, at twice the wake-ups per 32 KiB of a TCP reader. So the pool of a pipelined
        partition in the arena this connection mapped grows by the reader's floating
        buffers while the connection lives, back at its end: what its request says it has
        (``floating_credit``: 8 for a streaming reader, 32 for a batch one), no more, or it
        would keep more segments in flight than the reader can hold (longer aligned
        checkpoints, past debloating's bound); a request without the field (an older
        client) gets the daemon's ``floating_buffers_per_gate``, else the batch default.
        Once per partition and connection: its channels share the gate's floating
        buffers (a later request with more tops the loan up to it)."""
        conn = self.connection
        arena = None if conn is None else conn.read_arena
        if conn is None or arena is None or arena.is_destroyed:
            return
        try:
            part = self.daemon.manager.get_partition(req.partition_id, conn.app_id)
        except PartitionError:
            return  # not there yet: the reader asks again
        pool = part.buffer_pool
        if not part.partition_type.is_pipelined:
            return
        if pool.is_destroyed or not arena.has_pool(pool):
            return  # in the daemon's own pool: its buffers go as bytes
        lend = req.floating_credit
        if lend is None:
            floating = self.daemon.config.floating_buffers_per_gate
            lend = BATCH_FLOATING_BUFFERS if floating is None else floating
        _, _, lent = self._lent.get(id(pool), (arena, pool, 0))
        if lend > lent:
            self._lent[id(pool)] = (arena, pool, lend)
            arena.set_max_segments(pool, pool.max_segments + lend - lent)

    @property
    def segments_lent(self) -> int:
        """Segments this consumer connection's in-place reads lend producers' pools now."""
        return sum(lend for _, _, lend in self._lent.values())

    def _take_back_read_credit(self) -> None:
        lent, self._lent = self._lent, {}
        for arena, pool, lend in lent.values():
            if not arena.is_destroyed and arena.has_pool(pool):
                arena.set_max_segments(pool, pool.max_segments - lend)

    def _pin_on_drop(self, conn: ServerConnection) -> None:
        """Segments this consumer holds when the daemon drops its connection stay out of
        the pool until its process (the connecting one, ``SO_PEERCRED``) exits."""
        peer = self.reader_process
        pins, who = self.endpoint.pins, f"consumer connection {self.peer}"
        conn.keep_held = lambda buffers: pins.pin(peer, buffers, who)

    @property
    def bytes_shared_read(self) -> int:
        """Consumer payload bytes sent as descriptors into the mapped arena."""
        conn = self.connection
        return 0 if conn is None else conn.bytes_shared

    def _task_report(self, msg: TaskMetrics) -> None:
        key = (msg.task, msg.gate)
        reports = self.task_reports
        if key not in reports and len(reports) >= MAX_TASK_REPORTS_PER_CONNECTION:
            raise ProtocolError(
                f"more than {MAX_TASK_REPORTS_PER_CONNECTION} task gates reported on one connection"
            )
        reports[key] = TaskReport(
            msg.task, msg.gate, dict(msg.metrics), time.time(), self._conn().app_id
        )

    def _count_output_state(self, buffers: int, size: int) -> None:
        self.endpoint.output_state_buffers += buffers
        self.endpoint.output_state_bytes += size

    def _count_failure(self) -> None:
        self.endpoint.producer_failures += 1
        self.daemon.partitions_failed += 1

    def _create(self, msg: CreatePartition) -> None:
        if self.session is not None:
            raise ProtocolError("one partition per producer connection")
        conn = self._conn()
        # the daemon's choice: the application's shared arena when the task can map it
        arena = self.daemon.shared_arenas.pool_for(conn.app_id) if msg.shared_memory else None
        ptype = ResultPartitionType.BLOCKING if msg.blocking else ResultPartitionType.PIPELINED
        try:  # ids are per application: another's same id is another partition
            try:
                partition = self.daemon.create_partition(
                    msg.partition_id,
                    ptype,
                    msg.num_subpartitions,
                    app_id=conn.app_id,
                    network_pool=arena,
                )
            except InsufficientBuffersError as e:
                if arena is None:
                    raise
                log.info("%s: its arena is full (%s); it goes over the socket", msg.partition_id, e)
                arena = None
                partition = self.daemon.create_partition(
                    msg.partition_id, ptype, msg.num_subpartitions, app_id=conn.app_id
                )
        except ExchangeError as e:
            self.daemon.shared_arenas.release_idle()  # an arena made for it goes again
            self._close_with(error_response_for(e))
            return
        self.endpoint.producers += 1
        self.endpoint.partitions_created += 1
        self.session = ProducerSession(
            partition,
            self.send,
            max_credit=self.daemon.config.producer_credit,
            on_abort=self.fail_producer,
            schedule=self._loop.call_soon,
            shared=arena is not None,
            on_output_state=self._count_output_state,
        )
        credit = self.session.start()
        if arena is not None:
            token = self.daemon.shared_arenas.issue_token(arena)
            self._arena_token = token
            granted = self.session.granted_segments(credit)
            self.send(SharedArena(token, arena.arena_size, granted, arena.segment_size))
        self.send(PartitionCreated(credit, self.daemon.segment_size))
        # a consumer that gave up before this partition existed: its subpartition goes
        # now, and the task hears it as from a reader that left early
        if self.daemon.manager.apply_abandoned(partition):
            log.info("%s: created with subpartitions abandoned by their consumers", partition)

    def connection_lost(self, exc: Exception | None) -> None:
        self.task_reports.clear()
        self._take_back_read_credit()
        if self._arena_token is not None:
            self.daemon.shared_arenas.revoke(self._arena_token)
        session = self.session
        if session is not None:
            self.endpoint.producers -= 1
            if session.fail("producer task disconnected before closing its partition"):
                self._count_failure()
        super().connection_lost(exc)  # stops the input: nothing lands any more
        # (and the segments a consumer held are back)
        self.endpoint.closed_consumer_bytes_shared += self.bytes_shared_read
        if self._read_token is not None:
            self.daemon.shared_arenas.revoke(self._read_token)
        if self._read_offer is not None:
            self.daemon.shared_arenas.unpin(self._read_offer)
            self._read_offer = None
        if session is not None:
            session.drop_landing()  # and the shared segments the task was granted
