"""A connection to the daemon's local endpoint (or data port) for producers and control.

Runs the handshake, then speaks the local-endpoint messages: it tracks producer credit
(AddProducerCredit), matches replies to requests in order, and turns an ErrorResponse or
a lost connection into a typed error raised by whatever call is waiting.

On a Unix socket a producer asks for shared memory (``create_partition``); when the daemon
grants it (SharedArena), the connection fetches the arena's descriptor with the one-time
token (``SCM_RIGHTS`` on the hand-out socket), maps it, and from then on copies each data
buffer into the oldest segment granted and sends only its commit (segment, length,
subpartition); events still go as PushBuffer. The daemon chooses: without an arena the
connection pushes bytes over the socket, as it does on TCP.
"""

from __future__ import annotations

import asyncio
import itertools
import mmap
import os
import struct
from collections import deque
from collections.abc import Callable
from typing import Final

from client.arena_handout import map_offered_arena, unmap_arena
from client.connection_base import HandshakingClientProtocol, connect
from client.tls import client_ssl_context
from exchange.addresses import UNIX_PREFIX
from exchange.buffers.buffer import DataType
from exchange.errors import (
    ConfigError,
    ExchangeError,
    ProtocolError,
    SharedMemoryUnavailableError,
    TransportError,
    UsageError,
)
from exchange.local.segment_writer import SegmentWriter
from exchange.paths import default_socket_path
from exchange.protocol.codec import FRAME_HEADER_SIZE, MAGIC, max_frame_size_for
from exchange.protocol.handshake import (
    APP_CREDENTIAL_PREFIX,
    format_app_credential,
    parse_app_credential,
)
from exchange.protocol.local_messages import (
    ALL_SUBPARTITIONS,
    MAX_OVERDRAFT_REQUEST,
    AbandonSubpartition,
    AddProducerCredit,
    CreatePartition,
    DaemonInfo,
    DaemonInfoRequest,
    GrantSegments,
    OutputChannelState,
    OutputChannelStateComplete,
    PartitionCreated,
    PartitionFinished,
    ProducerBufferSize,
    PushBuffer,
    Released,
    ReleaseDataset,
    RequestOverdraft,
    SharedArena,
)
from exchange.protocol.messages import ErrorResponse, Message, error_for_response
from exchange.writer.record_writer import OutputBuffer

__all__ = [
    "DAEMON_ENV",
    "SECRET_FILE_ENV",
    "LocalConnection",
    "abandon_subpartition",
    "default_socket_path",
    "fetch_daemon_info",
    "mint_app_credential",
    "release_dataset",
    "resolve_daemon_socket",
    "resolve_secret",
    "secret_or_env",
]

#: Environment variable naming this host's daemon (its local socket path).
DAEMON_ENV: Final = "EXCHANGE_DAEMON"
_REPLIES = (PartitionCreated, PartitionFinished, DaemonInfo, Released)
_MAX_CONTROL_FRAME: Final = 64 * 1024
#: A PushBuffer frame's header: frame length, magic, id | subpartition, data type.
_PUSH_FRAME: Final = struct.Struct(">IIBIB")
_PUSH_BODY_HEADER: Final = 5


#: How long a push out of credit inside a record waits for a grant before it asks for
#: overdraft. A record here is a whole encoded batch (~256 KiB, 8 segments), so nearly
#: every stall is inside one; under steady backpressure a grant comes within a few
#: hundred microseconds (a consumer gives segments back), and asking at once cost a
#: RequestOverdraft, a grant of its own and global-pool segments for ~1 stall in 15
#: buffers (13 % of the same-host stream's segments were overdraft). Only a consumer
#: that frees nothing (it waits for the rest of the record) leaves the wait to this.
OVERDRAFT_ASK_DELAY: Final = 0.002

#: Environment variable naming a file that holds the daemons' shared secret.
SECRET_FILE_ENV: Final = "EXCHANGE_SECRET_FILE"


def resolve_secret(secret_file: str | None = None) -> bytes | None:
    """The shared secret from ``secret_file``, else from $EXCHANGE_SECRET_FILE, else None.

    Trailing newlines are stripped; an empty or unreadable file is a ConfigError.
    """
    path = secret_file or os.environ.get(SECRET_FILE_ENV)
    if not path:
        return None
    try:
        with open(path, "rb") as f:
            secret = f.read(64 * 1024 + 1).rstrip(b"\r\n")
    except OSError as e:
        raise ConfigError("secret_file", f"cannot read {path!r}: {e}") from e
    if not secret or len(secret) > 64 * 1024:
        raise ConfigError("secret_file", f"{path!r} must hold 1 byte to 64 KiB of secret")
    return secret


def mint_app_credential(app_id: str, secret_file: str | None = None) -> bytes | None:
    """The credential application ``app_id``'s tasks authenticate with, minted where the
    daemons' secret is (the driver) from ``secret_file`` or $EXCHANGE_SECRET_FILE; the
    tasks get only it (as Spark's shuffle service registers one secret per application).

    A file that holds an application credential already gives that one (ConfigError if it
    is another application's). None when there is no secret; the daemons' secret itself
    when ``app_id`` is empty (no application).
    """
    secret = resolve_secret(secret_file)
    if secret is None or not app_id:
        return secret
    if secret.startswith(APP_CREDENTIAL_PREFIX):
        try:
            cred_app, _ = parse_app_credential(secret)
        except UsageError as e:
            raise ConfigError("secret_file", str(e)) from None
        if cred_app != app_id:
            raise ConfigError(
                "secret_file",
                f"holds application {cred_app!r}'s credential, not {app_id!r}'s",
            )
        return secret
    return format_app_credential(secret, app_id)


def secret_or_env(secret: bytes | None) -> bytes | None:
    """``secret``, or when None the one ``$EXCHANGE_SECRET_FILE`` names (None if unset):
    what every task-side API connects with, so tasks started beside a daemon that has a
    secret authenticate without passing it."""
    return secret if secret is not None else resolve_secret()


def resolve_daemon_socket(hint: str | None = None) -> str:
    """The local daemon's socket: ``hint``, else $EXCHANGE_DAEMON, else the default path."""
    for candidate in (hint, os.environ.get(DAEMON_ENV)):
        if candidate:
            return candidate[len("unix:") :] if candidate.startswith("unix:") else candidate
    return default_socket_path()


class LocalConnection(HandshakingClientProtocol):
    """Client side of one local-endpoint connection."""

    def __init__(
        self,
        address: str,
        secret: bytes | None,
        max_frame_size: int,
        app_id: str | None = None,
    ) -> None:
        super().__init__(address, secret, max_frame_size, app_id)
        self._replies: deque[asyncio.Future[Message]] = deque()
        self.credit = 0
        self.bytes_pushed = 0
        self._credit_waiter: asyncio.Future[None] | None = None
        #: subpartitions whose last pushed buffer ended inside a record (its rest follows)
        self._mid_record: set[int] = set()
        #: overdraft segments asked for (RequestOverdraft), whether granted or not
        self.overdraft_requested = 0
        # OVERDRAFT_ASK_DELAY passed while a push waited mid-record: it asks now
        self._overdraft_due = False
        # the push waiting for credit, and where it stands (unaligned barriers overtake it)
        self._pushing: list[OutputBuffer] = []
        self._push_index = 0
        #: OutputChannelState(Complete) of unaligned checkpoints (loop thread); without
        #: one they are a protocol error (the task never sent an unaligned barrier).
        self.channel_state_listener: (
            Callable[[OutputChannelState | OutputChannelStateComplete], None] | None
        ) = None
        self._buffer_size_listener: Callable[[int, int], None] | None = None
        #: sizes announced before a listener was set (while the partition was being
        #: created, e.g. during the arena's hand-out): the latest per subpartition
        self._early_sizes: dict[int, int] = {}
        #: the local socket's path (None on TCP: no shared memory there)
        self.socket_path: str | None = None
        self._offer: SharedArena | None = None
        #: granted segments of the shared arena (oldest first), the arena once mapped,
        #: and the copy of each data buffer into its segment with its commit (compiled)
        self.segments = SegmentWriter()
        self._arena: mmap.mmap | None = None
        self._arena_view: memoryview | None = None
        #: the inode of the shared arena mapped (None without one): which arena it is
        self.arena_inode: int | None = None

    @property
    def buffer_size_listener(self) -> Callable[[int, int], None] | None:
        """``(subpartition, size)`` for each ProducerBufferSize (debloating); loop thread.
        Sizes that came before it was set are handed to it when it is set."""
        return self._buffer_size_listener

    @buffer_size_listener.setter
    def buffer_size_listener(self, listener: Callable[[int, int], None] | None) -> None:
        self._buffer_size_listener = listener
        if listener is not None:
            early, self._early_sizes = self._early_sizes, {}
            for sub, size in early.items():
                listener(sub, size)

    @classmethod
    async def connect(
        cls,
        socket_path: str,
        *,
        secret: bytes | None = None,
        segment_size: int = 32 * 1024,
        timeout: float = 10.0,
        app_id: str | None = None,
    ) -> LocalConnection:
        """Connect to a daemon's local socket, or to ``host:port`` / ``unix:/path``, for
        application ``app_id`` (None: ``$EXCHANGE_APP_ID``)."""
        if socket_path.startswith(UNIX_PREFIX) or ":" not in socket_path:
            path: str | None = socket_path.removeprefix(UNIX_PREFIX)
            address = UNIX_PREFIX + socket_path.removeprefix(UNIX_PREFIX)
        else:
            path = None
            address = socket_path
        limit = max(max_frame_size_for(segment_size), _MAX_CONTROL_FRAME)
        conn = await connect(
            address,
            lambda: cls(address, secret, limit, app_id),
            timeout=timeout,
            ssl_context=None if path is not None else client_ssl_context(),  # data port: TLS
            peer="the exchange daemon",
            hint=f". Start one with 'exchange-daemon', or point ${DAEMON_ENV} at its local socket",
        )
        conn.socket_path = path
        try:
            await asyncio.wait_for(asyncio.shield(conn.ready), timeout)
        except TimeoutError:
            conn.close()
            raise TransportError(f"handshake with daemon {address} timed out") from None
        except BaseException:
            conn.close()
            raise
        return conn

    def on_connection_lost(self, error: ExchangeError) -> None:
        self._unmap()
        while self._replies:
            fut = self._replies.popleft()
            if not fut.done():
                fut.set_exception(error)
        self._wake_credit()

    def fail(self, err: ExchangeError) -> None:
        super().fail(err)
        self._wake_credit()  # a push waiting for credit raises now, not at connection_lost

    def on_message(self, msg: Message) -> None:
        if type(msg) is AddProducerCredit:
            self.credit += msg.credit
            self._wake_credit()
        elif type(msg) is GrantSegments:
            self.segments.grant(msg.segments)
            self.credit += len(msg.segments)
            self._wake_credit()
        elif type(msg) is SharedArena:
            if self._offer is not None or not self._replies:
                raise ProtocolError(f"unsolicited SharedArena from {self.address}")
            self._offer = msg
            self.segments.grant(msg.segments)
        elif type(msg) is ProducerBufferSize:
            if self._buffer_size_listener is not None:
                self._buffer_size_listener(msg.subpartition, msg.buffer_size)
            else:
                self._early_sizes[msg.subpartition] = msg.buffer_size
        elif isinstance(msg, OutputChannelState | OutputChannelStateComplete):
            if self.channel_state_listener is None:
                raise ProtocolError(f"unexpected {type(msg).__name__} from {self.address}")
            self.channel_state_listener(msg)
        elif isinstance(msg, _REPLIES):
            if not self._replies:
                raise ProtocolError(f"unsolicited {type(msg).__name__} from {self.address}")
            fut = self._replies.popleft()
            if not fut.done():
                fut.set_result(msg)
            if type(msg) is PartitionCreated:
                self.credit += msg.credit
        elif isinstance(msg, ErrorResponse):
            self.fail(error_for_response(msg, self.address))
        else:
            raise ProtocolError(f"unexpected {type(msg).__name__} from {self.address}")

    def _wake_credit(self) -> None:
        w = self._credit_waiter
        if w is not None and not w.done():
            w.set_result(None)

    # -- calls ---------------------------------------------------------------------------

    async def request(self, msg: Message) -> Message:
        """Send ``msg`` and wait for its reply (replies come in request order)."""
        self.check()
        fut: asyncio.Future[Message] = self._loop.create_future()
        self._replies.append(fut)
        self.send(msg)
        return await fut

    @property
    def shared_memory(self) -> bool:
        """True when data buffers go through the daemon's shared arena."""
        return self._arena_view is not None

    async def create_partition(
        self, msg: CreatePartition, timeout: float = 10.0
    ) -> PartitionCreated:
        """Create the partition, asking for shared memory on a Unix socket; map the arena
        when the daemon grants one (SharedMemoryUnavailableError if it cannot be mapped)."""
        if self.socket_path is not None and not msg.shared_memory:
            msg = CreatePartition(msg.partition_id, msg.blocking, msg.num_subpartitions, True)
        reply = await self.request(msg)
        assert isinstance(reply, PartitionCreated)
        offer, self._offer = self._offer, None
        if offer is not None:
            assert self.socket_path is not None
            try:
                self._arena, self.arena_inode = await map_offered_arena(
                    self.socket_path, offer, timeout
                )
            except SharedMemoryUnavailableError:
                # The partition went at once (a consumer had abandoned it, the dataset was
                # released): its error closed this connection, which revoked the token.
                # That error is the reason, not the refused token.
                self.check()
                raise
            self._arena_view = memoryview(self._arena)
            self.segments.attach(self._arena_view, reply.segment_size)
        return reply

    @property
    def bytes_shared(self) -> int:
        """Bytes of data buffers written into the shared arena."""
        return self.segments.bytes_shared

    def _unmap(self) -> None:
        self.segments.detach()
        view, self._arena_view = self._arena_view, None
        arena, self._arena = self._arena, None
        unmap_arena(view, arena)

    def unsent_buffers(self) -> list[OutputBuffer]:
        """The buffers of the push now waiting for credit that are not written yet."""
        return self._pushing[self._push_index :]

    def push_event_now(self, out: OutputBuffer) -> None:
        """Write an event frame at once, ahead of any push waiting for credit (an
        unaligned barrier: events need no credit)."""
        if not out.is_event:
            raise UsageError("only events may overtake waiting pushes")
        self.check()
        t = self._transport
        if t is None or t.is_closing():
            raise TransportError(f"connection to daemon {self.address} is closing")
        header = _PUSH_FRAME.pack(
            FRAME_HEADER_SIZE + _PUSH_BODY_HEADER + out.size,
            MAGIC,
            PushBuffer.MESSAGE_ID,
            ALL_SUBPARTITIONS,
            out.data_type,
        )
        t.writelines([header, *out.pieces])
        self.bytes_pushed += out.size

    async def push_buffer(self, out: OutputBuffer) -> None:
        """Push one buffer the RecordWriter cut (see ``push_buffers``)."""
        await self.push_buffers([out])

    async def push_buffers(self, outs: list[OutputBuffer]) -> None:
        """Push buffers in order, as many per write as credit allows (one syscall for
        several buffers, their pieces gathered: no copy here). A push that runs out of
        credit inside a record asks for overdraft in that same write."""
        i, n = 0, len(outs)
        data = DataType.DATA_BUFFER
        asked = -1  # the index of the buffer overdraft was asked for
        while i < n:
            while self.credit <= 0 and outs[i].data_type is data:
                self.check()
                timer: asyncio.TimerHandle | None = None
                if asked != i and outs[i].target in self._mid_record:
                    if self._overdraft_due:  # no grant came in OVERDRAFT_ASK_DELAY
                        asked = i
                        self._ask_overdraft(outs, i)
                        self._flush()
                    else:
                        timer = self._loop.call_later(OVERDRAFT_ASK_DELAY, self._overdue)
                self._credit_waiter = self._loop.create_future()
                self._pushing, self._push_index = outs, i
                try:
                    await self._credit_waiter
                finally:
                    self._pushing = []
                    if timer is not None:
                        timer.cancel()
                self._credit_waiter = None
            self._overdraft_due = False
            self.check()
            t = self._transport
            if t is None or t.is_closing():
                raise TransportError(f"connection to daemon {self.address} is closing")
            frames: list[bytes | memoryview] = []
            pushed = 0
            pack = _PUSH_FRAME.pack
            writer = self.segments if self.segments.mapped else None
            mid_record = self._mid_record
            while i < n:
                out = outs[i]
                if out.data_type is data:
                    if self.credit <= 0:
                        break  # it waits for credit (or, mid-record, overdraft) above
                    if writer is not None:  # a run written in place, committed by index
                        j = writer.fill(outs, i, self.credit, mid_record)
                        self.credit -= j - i
                        i = j
                        continue
                    self.credit -= 1
                    target = out.target
                    if out.ends_mid_record:
                        mid_record.add(target)
                    else:
                        mid_record.discard(target)
                else:
                    target = ALL_SUBPARTITIONS
                    if writer is not None:  # the commits before it go first: the stream's order
                        commits = writer.take_commits()
                        if commits is not None:
                            frames.append(commits)
                frames.append(
                    pack(
                        FRAME_HEADER_SIZE + _PUSH_BODY_HEADER + out.size,
                        MAGIC,
                        PushBuffer.MESSAGE_ID,
                        target,
                        out.data_type,
                    )
                )
                frames.extend(out.pieces)
                pushed += out.size
                i += 1
            if writer is not None:
                commits = writer.take_commits()
                if commits is not None:
                    frames.append(commits)
            frames.extend(self.connection.data_to_send())  # a RequestOverdraft, if asked
            t.writelines(frames)
            self.bytes_pushed += pushed

    def _overdue(self) -> None:
        """OVERDRAFT_ASK_DELAY passed with no grant: the push waiting asks for overdraft."""
        self._overdraft_due = True
        self._wake_credit()

    def _ask_overdraft(self, outs: list[OutputBuffer], i: int) -> None:
        """Out of credit with ``outs[i]`` continuing a record already partly pushed, and no
        grant for ``OVERDRAFT_ASK_DELAY``: ask the daemon for overdraft segments for the
        buffers up to that record's end (Flink's overdraft: the record ends without
        waiting for a consumer to free a segment). Queued on the connection: the caller
        writes it."""
        target, count = outs[i].target, 0
        data = DataType.DATA_BUFFER
        for out in itertools.islice(outs, i, None):
            if out.data_type is not data:
                break
            count += 1
            if out.target == target and not out.ends_mid_record:
                break
        count = min(count, MAX_OVERDRAFT_REQUEST)
        self.overdraft_requested += count
        self.connection.send(RequestOverdraft(count))


async def fetch_daemon_info(socket_path: str, *, secret: bytes | None = None) -> DaemonInfo:
    """Ask the local daemon who it is and where its data port is (``secret`` None:
    ``$EXCHANGE_SECRET_FILE``'s)."""
    conn = await LocalConnection.connect(socket_path, secret=secret_or_env(secret))
    try:
        info = await conn.request(DaemonInfoRequest())
    finally:
        await conn.aclose()
    assert isinstance(info, DaemonInfo)
    return info


async def release_dataset(
    address: str, dataset_id: str, *, secret: bytes | None = None, app_id: str | None = None
) -> int:
    """Release every partition of one exchange that application ``app_id`` (None:
    ``$EXCHANGE_APP_ID``) created on the daemon at ``address`` (its local socket path,
    ``unix:/path``, or its data port ``host:port``); another application's stay.
    ``secret`` None: ``$EXCHANGE_SECRET_FILE``'s."""
    return await _count_request(address, ReleaseDataset(dataset_id), secret, app_id)


async def _count_request(
    address: str, message: Message, secret: bytes | None, app_id: str | None
) -> int:
    """One request answered by Released, on a connection of its own; the count."""
    conn = await LocalConnection.connect(address, secret=secret_or_env(secret), app_id=app_id)
    try:
        reply = await conn.request(message)
    finally:
        await conn.aclose()
    assert isinstance(reply, Released)
    return reply.count


async def abandon_subpartition(
    address: str,
    dataset_id: str,
    subpartition: int,
    *,
    secret: bytes | None = None,
    app_id: str | None = None,
) -> int:
    """Tell the daemon at ``address`` (as for ``release_dataset``) that the consumer of
    ``subpartition`` of dataset ``dataset_id`` gave up before the end: that subpartition
    of each of the dataset's pipelined partitions that application ``app_id`` (None:
    ``$EXCHANGE_APP_ID``) created there and that never had its reader is released (its
    producer sees "released by its consumer before the end"), and so is the one of every
    partition of the dataset created there later. Returns how many partitions it
    released a subpartition of now. ``secret`` None: ``$EXCHANGE_SECRET_FILE``'s."""
    try:
        message = AbandonSubpartition(dataset_id, subpartition)
    except ProtocolError as e:
        raise UsageError(str(e)) from None
    return await _count_request(address, message, secret, app_id)
