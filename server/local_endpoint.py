"""The local endpoint: a Unix socket through which tasks on this host use the daemon.

It speaks the data protocol (a consumer on this host reads over the socket, no TCP) plus
the producer messages of ``exchange.protocol.local_messages``. A producer connection owns
one ResultPartition; the daemon grants it credit as segments of the partition's pool are
reserved for it, so a task pushes at most what the pool can hold and waits (for
AddProducerCredit) when it is full: backpressure reaching the producer task.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import socket
from collections import deque
from typing import TYPE_CHECKING, Final

from exchange.buffers.buffer import Buffer
from exchange.errors import (
    ExchangeError,
    PartitionError,
    PartitionReleasedError,
    ProducerFailedError,
    ProtocolError,
)
from exchange.events.events import EventSerializer
from exchange.partition.result_partition import ResultPartition
from exchange.partition.result_partition_type import ResultPartitionType
from exchange.protocol.local_messages import (
    ALL_SUBPARTITIONS,
    AddProducerCredit,
    CreatePartition,
    DaemonInfo,
    DaemonInfoRequest,
    FailPartition,
    FinishPartition,
    PartitionCreated,
    PartitionFinished,
    PushBuffer,
    Released,
    ReleaseDataset,
)
from exchange.protocol.messages import ErrorResponse, Message, error_response_for
from server.partition_request_server import DataServer, PartitionRequestServerProtocol

if TYPE_CHECKING:
    from server.daemon import ExchangeDaemon

__all__ = ["LocalEndpoint", "LocalEndpointProtocol", "ProducerSession"]

log = logging.getLogger("exchange.server.local")

#: Buffers a producer may have in flight (credit) at most.
MAX_PRODUCER_CREDIT: Final = 8
#: How long a producer whose partition is gone may take to read why and close.
_FAILED_PRODUCER_GRACE: Final = 2.0


class LocalEndpoint(DataServer):
    """The daemon's Unix-socket server."""

    def __init__(self, daemon: ExchangeDaemon, **kwargs: object) -> None:
        super().__init__(daemon.manager, **kwargs)  # type: ignore[arg-type]
        self.daemon = daemon
        self.path: str | None = None
        self.producers = 0
        self.bytes_received = 0
        self.buffers_received = 0
        self.partitions_created = 0
        self.producer_failures = 0

    def protocol_factory(self) -> PartitionRequestServerProtocol:
        return LocalEndpointProtocol(self)

    async def start_unix(self, path: str) -> str:
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
        return path

    async def close(self) -> None:
        await super().close()
        if self.path is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)

    def stats(self) -> dict[str, int]:
        base = super().stats()
        base.update(
            producers=self.producers,
            consumers=base["readers"],
            bytes_received=self.bytes_received,
            buffers_received=self.buffers_received,
            partitions_created=self.partitions_created,
            producer_failures=self.producer_failures,
        )
        return base


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


class ProducerSession:
    """Daemon side of one producer connection: its partition and its credit."""

    def __init__(self, proto: LocalEndpointProtocol, partition: ResultPartition) -> None:
        self.proto = proto
        self.partition = partition
        self._reserved: deque[Buffer] = deque()
        self._waiter: asyncio.Task[None] | None = None
        self.finished = False
        inner = partition.on_release

        def on_release(part: ResultPartition) -> None:
            if inner is not None:
                inner(part)
            self._on_partition_released()

        partition.on_release = on_release
        partition.on_consumer_failure = self._on_consumer_failure

    def _on_consumer_failure(self, cause: BaseException) -> None:
        """A reader left a subpartition early: the stream cannot complete, so the task must
        hear it now (it may be waiting for credit that only that reader would free)."""
        if not self.finished and isinstance(cause, PartitionError):
            self.proto.fail_producer(error_response_for(cause))

    def _on_partition_released(self) -> None:
        """Released under a producer still writing (its consumer left, the daemon stops):
        tell the task now, since one waiting for credit would otherwise wait forever."""
        if self.finished:
            return
        self._drop_reserved()
        cause = self.partition.failure_cause
        if not isinstance(cause, PartitionError):
            cause = PartitionReleasedError(
                "partition was released while its producer was writing",
                self.partition.partition_id,
            )
        self.proto.fail_producer(error_response_for(cause))

    def _reserve_nowait(self) -> int:
        """Reserve free segments up to the credit limit; returns how many were added."""
        pool = self.partition.buffer_pool
        added = 0
        while len(self._reserved) < MAX_PRODUCER_CREDIT and not pool.is_destroyed:
            buf = pool.request_buffer()
            if buf is None:
                break
            self._reserved.append(buf)
            added += 1
        if (
            len(self._reserved) < MAX_PRODUCER_CREDIT
            and self._waiter is None
            and not pool.is_destroyed
            and not self.finished
        ):
            self._waiter = asyncio.get_running_loop().create_task(self._wait_for_segments())
        return added

    async def _wait_for_segments(self) -> None:
        pool = self.partition.buffer_pool
        try:
            while not self.finished and not pool.is_destroyed:
                await pool.get_available_future()
                if self.finished:
                    return
                self._waiter = None
                added = self._reserve_nowait()
                if added:
                    self.proto.send(AddProducerCredit(added))
                return
        except ExchangeError:
            return  # pool destroyed: the partition ended
        finally:
            if self._waiter is asyncio.current_task():
                self._waiter = None

    def start(self) -> int:
        return self._reserve_nowait()

    def on_push(self, msg: PushBuffer) -> None:
        payload = msg.payload
        if msg.data_type.is_buffer:
            if not self._reserved:
                raise ProtocolError("PushBuffer without credit")
            buf = self._reserved.popleft()
            n = len(payload)
            seg = buf.segment
            if n > seg.size:
                buf.release()
                raise ProtocolError(
                    f"pushed buffer of {n} bytes exceeds the {seg.size}-byte segment"
                )
            seg.view()[:n] = payload
            buf.set_size(n)
            self.partition.add_buffer(msg.subpartition, buf)
            ep = self.proto.endpoint
            ep.bytes_received += n
            ep.buffers_received += 1
            self.proto.daemon.bytes_in += n
            added = self._reserve_nowait()
            if added:
                self.proto.send(AddProducerCredit(added))
            return
        event = EventSerializer.from_bytes(payload)
        if msg.subpartition != ALL_SUBPARTITIONS:
            raise ProtocolError("events are broadcast to all subpartitions")
        self.partition.broadcast_event(event)

    def _drop_reserved(self) -> None:
        self.finished = True
        if self._waiter is not None:
            self._waiter.cancel()
            self._waiter = None
        while self._reserved:
            self._reserved.popleft().release()

    def finish(self) -> PartitionFinished:
        self._drop_reserved()
        self.partition.finish()
        st = self.partition.stats()
        return PartitionFinished(st.bytes_out, st.buffers_out)

    def fail(self, reason: str) -> None:
        self._drop_reserved()
        if not self.partition.is_released:
            self.proto.endpoint.producer_failures += 1
            self.proto.daemon.partitions_failed += 1
            self.partition.fail(ProducerFailedError(reason, self.partition.partition_id))


class LocalEndpointProtocol(PartitionRequestServerProtocol):
    """A local connection: a consumer (data protocol) or a producer (one partition)."""

    def __init__(self, endpoint: LocalEndpoint) -> None:
        super().__init__(endpoint)
        self.endpoint = endpoint
        self.daemon = endpoint.daemon
        self.session: ProducerSession | None = None
        self._producer_failed = False

    def fail_producer(self, resp: ErrorResponse) -> None:
        """Tell the producer task why its partition is gone, then let *it* close.

        Closing first would make the pushes it still has in flight fail with EPIPE before
        it reads the reason; so pushes are dropped from now on, and the connection is
        closed after a grace period if the task does not close it.
        """
        if self._producer_failed:
            return
        self._producer_failed = True
        if self.session is not None:
            self.session._drop_reserved()
        self.send(resp)
        self._loop.call_later(_FAILED_PRODUCER_GRACE, self.close)

    def on_message(self, msg: Message) -> None:
        if type(msg) is PushBuffer:
            if self._producer_failed:
                return  # in flight before the task learned its partition is gone
            if self.session is None or self.session.finished:
                raise ProtocolError("PushBuffer before CreatePartition")
            try:
                self.session.on_push(msg)
            except PartitionError as e:
                # The partition is gone (released, or a consumer failed): tell the task.
                self.fail_producer(error_response_for(e))
            return
        if self._producer_failed and isinstance(msg, (FinishPartition, FailPartition)):
            return
        match msg:
            case CreatePartition():
                self._create(msg)
            case FinishPartition():
                if self.session is None or self.session.finished:
                    raise ProtocolError("FinishPartition without an open partition")
                try:
                    self.send(self.session.finish())
                except PartitionError as e:
                    self.fail_producer(error_response_for(e))
            case FailPartition(reason=reason):
                if self.session is not None and not self.session.finished:
                    self.session.fail(f"producer task failed: {reason}")
            case ReleaseDataset(dataset_id=ds):
                self.send(Released(self.daemon.release_dataset(ds)))
            case DaemonInfoRequest():
                self.send(
                    DaemonInfo(
                        self.daemon.daemon_id, self.daemon.data_address, self.daemon.segment_size
                    )
                )
            case _:
                super().on_message(msg)

    def _create(self, msg: CreatePartition) -> None:
        if self.session is not None:
            raise ProtocolError("one partition per producer connection")
        try:
            partition = self.daemon.create_partition(
                msg.partition_id,
                ResultPartitionType.BLOCKING if msg.blocking else ResultPartitionType.PIPELINED,
                msg.num_subpartitions,
            )
        except ExchangeError as e:
            self._close_with(error_response_for(e))
            return
        self.endpoint.producers += 1
        self.endpoint.partitions_created += 1
        self.session = ProducerSession(self, partition)
        credit = self.session.start()
        self.send(PartitionCreated(credit, self.daemon.segment_size))

    def connection_lost(self, exc: Exception | None) -> None:
        session = self.session
        if session is not None:
            self.endpoint.producers -= 1
            if not session.finished:
                session.fail("producer task disconnected before closing its partition")
        super().connection_lost(exc)
