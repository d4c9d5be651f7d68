"""ProducerSession: the daemon's side of one producer task's connection, sans I/O.

A producer task owns one ResultPartition on its local daemon and pushes the buffers its
RecordWriter cut. Credit is Flink's idea turned around: one credit is one segment of the
partition's LocalBufferPool that the daemon has already *reserved* for the task, so a
push always has a segment to land in and a task can never push more than the pool holds.
When the pool is exhausted (consumers are slow) the session registers as the pool's
BufferListener and is handed each segment a consumer frees; credit goes back to the task
in batches (``AddProducerCredit``), not one message per buffer: a grant is sent when a
quarter of the window has accumulated, or at once when the task has no credit left.
A task whose next buffer continues a record it began, and that has no credit, asks for
overdraft (``RequestOverdraft``): credit already on its way and the pool's own segments
count first; for the rest the session takes what the pool's overdraft allows
(``LocalBufferPool.request_overdraft_buffer``: beyond the pool's size, only from free
global segments) and grants it all at once, so the record ends without waiting for a
consumer.
A NewBufferSize a consumer announces for a pipelined subpartition (buffer debloating)
goes on to the task as ``ProducerBufferSize``: the task's writer cuts the buffers.
The buffers an unaligned barrier of the task overtakes in a pipelined subpartition go back
to the task (a copy of each, then the subpartition's segments are its own again) as
``OutputChannelState`` messages and one ``OutputChannelStateComplete`` per subpartition:
the task persists them with its snapshot (``exchange/checkpointing/output_channel_state``).

With ``shared=True`` the partition's pool is carved from the application's shared arena
(the task maps it): grants name the reserved segments by index (``GrantSegments``), the
task writes a buffer into the oldest granted segment and commits it (``commit``), and the
daemon queues that very segment, no byte copied. A segment counts only once committed; the
segments granted to a task that ends are held until its connection is gone (it may still
be writing into them: ``drop_landing``), then they return to the pool.

The session does no I/O: messages for the task go through the injected ``send``. Its
lifecycle is one enum, with the transitions in ``_TRANSITIONS``:

    OPEN --finish--> FINISHED
    OPEN --fail (task failed / disconnected)--> FAILED
    OPEN --partition released or a reader left early--> ABORTED
"""

from __future__ import annotations

import struct
import time
from collections import deque
from collections.abc import Callable, Iterable
from enum import Enum
from typing import Final, NamedTuple

from exchange.buffers.buffer import Buffer, DataType
from exchange.errors import (
    IllegalStateError,
    PartitionError,
    PartitionReleasedError,
    ProducerFailedError,
    ProtocolError,
    SubpartitionIndexError,
)
from exchange.events.events import EventSerializer
from exchange.local.segment_commits import commit_segments, segment_indices
from exchange.memory.buffer_listener import NotificationResult
from exchange.partition.pipelined_subpartition import PipelinedSubpartition
from exchange.partition.result_partition import ResultPartition
from exchange.protocol.codec import DataFrameSpec
from exchange.protocol.local_messages import (
    ALL_SUBPARTITIONS,
    AddProducerCredit,
    GrantSegments,
    OutputChannelState,
    OutputChannelStateComplete,
    PartitionFinished,
    ProducerBufferSize,
    PushBuffer,
)
from exchange.protocol.messages import ErrorResponse, Message, error_response_for

__all__ = [
    "DEFAULT_PRODUCER_CREDIT",
    "PUSH_BUFFER_FRAMES",
    "ProducerSession",
    "ProducerSessionState",
    "PushHeader",
]

#: Segments a producer may have in flight (its credit window) by default.
DEFAULT_PRODUCER_CREDIT: Final = 8

_PUSH_PREFIX: Final = struct.Struct(">IB")
_DATA_TYPES: Final = tuple(sorted(DataType))


class PushHeader(NamedTuple):
    """The fixed fields of a PushBuffer frame; ``size`` is the payload's."""

    subpartition: int
    data_type: DataType
    size: int


def _parse_push(prefix: memoryview, payload_size: int) -> PushHeader:
    sub, dt = _PUSH_PREFIX.unpack(prefix)
    if dt >= len(_DATA_TYPES):  # a table, not DataType(dt): this runs once per push
        raise ProtocolError(f"bad data type {dt}")
    return PushHeader(sub, _DATA_TYPES[dt], payload_size)


#: The local endpoint's data frame: a PushBuffer payload lands in its reserved segment
#: (``ProducerSession.landing_view``), the header in the decoder's scratch space.
PUSH_BUFFER_FRAMES: Final = {PushBuffer.MESSAGE_ID: DataFrameSpec(_PUSH_PREFIX.size, _parse_push)}


class ProducerSessionState(Enum):
    OPEN = "open"
    FINISHED = "finished"
    FAILED = "failed"
    ABORTED = "aborted"

    __hash__ = object.__hash__  # identity, in C (Enum's own __hash__ is Python code)


#: (compared with ``is`` on the push path instead of calling the ``is_open`` property)
_OPEN: Final = ProducerSessionState.OPEN

_TRANSITIONS: Final[dict[ProducerSessionState, frozenset[ProducerSessionState]]] = {
    ProducerSessionState.OPEN: frozenset(
        {ProducerSessionState.FINISHED, ProducerSessionState.FAILED, ProducerSessionState.ABORTED}
    ),
    ProducerSessionState.FINISHED: frozenset(),
    ProducerSessionState.FAILED: frozenset(),
    ProducerSessionState.ABORTED: frozenset(),
}


class ProducerSession:
    """Reserves segments for one producer task, grants them as credit, queues its pushes."""

    def __init__(
        self,
        partition: ResultPartition,
        send: Callable[[Message], None],
        *,
        max_credit: int = DEFAULT_PRODUCER_CREDIT,
        on_abort: Callable[[ErrorResponse], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
        schedule: Callable[[Callable[[], None]], object] | None = None,
        shared: bool = False,
        on_output_state: Callable[[int, int], None] | None = None,
    ) -> None:
        """``on_output_state(buffers, bytes)``: output channel state was handed back to
        the task (for the daemon's metrics)."""
        if max_credit < 1:
            raise IllegalStateError(f"max_credit must be >= 1, got {max_credit}")
        self.partition = partition
        self._send = send
        self._on_abort = on_abort
        self._on_output_state = on_output_state
        self.max_credit = max_credit
        self._batch = max(1, max_credit // 4)
        self._reserved: deque[Buffer] = deque()
        # taken for pushes whose bytes are arriving, in stream order (the decoder may
        # hand out several views before the first one's payload is reported)
        self._landing: deque[Buffer] = deque()
        #: grants name segments by index; the task writes them in the shared arena
        self.shared = shared
        # shared: segments granted to a task whose session ended, held until it is gone
        self._held: list[Buffer] = []
        self._granted = 0  # credit the task holds (granted, not yet used by a push)
        self._unannounced = 0  # reserved segments not yet granted
        self._listening = False
        # Grants are decided once per event-loop callback (``schedule``: call_soon): a
        # callback that frees or fills many segments sends one AddProducerCredit for all.
        self._schedule = schedule
        self._announce_pending = False
        self._clock = clock
        self._starved_since: float | None = None
        self.state = ProducerSessionState.OPEN
        self.bytes_received = 0
        self.buffers_received = 0
        self.credit_messages = 0
        self.overdraft_granted = 0
        # unaligned checkpoints: output channel state handed back to the task
        self.output_state_bytes = 0
        self.output_state_buffers = 0
        self.output_state_reports = 0  # (subpartition, checkpoint) pairs reported
        partition.set_output_channel_state_listener(self._on_output_channel_state)
        partition.add_release_listener(self._on_partition_released)
        partition.add_consumer_failure_listener(self._on_consumer_failure)
        for sub in partition.subpartitions:
            if isinstance(sub, PipelinedSubpartition):  # blocking ones ignore NewBufferSize
                sub.add_buffer_size_listener(self._on_buffer_size)

    # -- lifecycle -----------------------------------------------------------------------

    def _transition(self, to: ProducerSessionState) -> None:
        if to not in _TRANSITIONS[self.state]:
            raise IllegalStateError(f"producer session: {self.state.value} -> {to.value}")
        self.state = to

    @property
    def is_open(self) -> bool:
        return self.state is ProducerSessionState.OPEN

    # -- credit --------------------------------------------------------------------------

    def start(self) -> int:
        """Reserve what the pool has free now; returns the first grant (for
        PartitionCreated; ``granted_segments`` names them when shared). Later grants go
        out as AddProducerCredit (GrantSegments when shared)."""
        self._reserve_nowait()
        credit, self._unannounced = self._unannounced, 0
        self._granted += credit
        return credit

    def granted_segments(self, n: int) -> tuple[int, ...]:
        """The arena indices of the ``n`` segments granted last (the newest reserved)."""
        k = len(self._reserved) - self._unannounced
        return segment_indices(self._reserved, k - n, k)

    def _reserve_nowait(self) -> None:
        pool = self.partition.buffer_pool
        while len(self._reserved) < self.max_credit and not pool.is_destroyed:
            buf = pool.request_buffer()
            if buf is None:
                break
            self._reserved.append(buf)
            self._unannounced += 1
        if len(self._reserved) < self.max_credit and not self._listening and self.state is _OPEN:
            self._listening = pool.add_buffer_listener(self)

    def _announce(self) -> None:
        """Grant the reserved segments in a batch, or at once if the task has none; with
        ``schedule``, once the current callback is done (one message for what it freed)."""
        if self._schedule is None:
            self._announce_now()
        elif not self._announce_pending:
            self._announce_pending = True
            self._schedule(self._announce_scheduled)

    def _announce_scheduled(self) -> None:
        self._announce_pending = False
        self._announce_now()

    def _announce_now(self, *, whole: bool = False) -> None:
        """Grant what is reserved once it makes a batch or the task has none left (or
        at once with ``whole``: the task asked for overdraft, it waits for them)."""
        n = self._unannounced
        if self._granted == 0 and n == 0 and self._starved_since is None:
            self._starved_since = self._clock()  # the task waits for credit: backpressure
        if n and (whole or n >= self._batch or self._granted == 0) and self.state is _OPEN:
            if self._starved_since is not None:
                self.partition.record_back_pressure(self._clock() - self._starved_since)
                self._starved_since = None
            self._unannounced = 0
            self._granted += n
            self.credit_messages += 1
            if self.shared:
                self._send(GrantSegments(self.granted_segments(n)))
            else:
                self._send(AddProducerCredit(n))

    def request_overdraft(self, count: int) -> int:
        """The task waits to push the rest of a record and has no credit: grant it up to
        ``count`` segments now, overdraft (beyond the pool's size) only for what the pool's
        own cannot cover. Credit already on its way covers the request first: a task that
        asked while a grant crossed its request (``credit_outstanding`` > 0 once its pushes
        before the request are in) gets nothing more; then the pool's own segments
        (reserved and not yet granted, or free now) are granted at once, whatever the
        batch; only the rest is overdraft. Returns the overdraft segments taken (0: none
        needed, the pool's overdraft is used up, or the global pool has none free; the
        task waits for credit as usual)."""
        if self.state is not _OPEN:
            return 0
        count -= self._granted  # in flight to the task already
        if count <= 0:
            return 0
        self._reserve_nowait()
        count -= self._unannounced  # the pool's own, granted below whatever their number
        pool = self.partition.buffer_pool
        got = 0
        while got < count and not pool.is_destroyed:
            buf = pool.request_overdraft_buffer()
            if buf is None:
                break
            self._reserved.append(buf)
            got += 1
        self.overdraft_granted += got
        self._unannounced += got
        self._announce_now(whole=True)  # one grant: the pool's own, then the overdraft
        return got

    # BufferListener: a consumer freed a segment of the partition's pool.
    def notify_buffer_available(self, buffer: Buffer) -> NotificationResult:
        self._listening = False
        if self.state is not _OPEN or len(self._reserved) >= self.max_credit:
            return NotificationResult.BUFFER_NOT_USED
        self._reserved.append(buffer)
        self._unannounced += 1
        if not self._announce_pending:  # a give-back frees many: one grant decision
            self._announce()
        if len(self._reserved) < self.max_credit:
            self._listening = True
            return NotificationResult.BUFFER_USED_NEED_MORE
        return NotificationResult.BUFFER_USED_NO_NEED_MORE

    def notify_buffer_destroyed(self) -> None:
        self._listening = False

    @property
    def back_pressured_now(self) -> float:
        """Seconds the task has waited for credit so far in the current wait (0 while it
        has credit): back-pressured time the partition records only when the wait ends."""
        since = self._starved_since
        return 0.0 if since is None else max(0.0, self._clock() - since)

    @property
    def credit_outstanding(self) -> int:
        return self._granted

    @property
    def num_reserved(self) -> int:
        return len(self._reserved)

    # -- pushes --------------------------------------------------------------------------

    def landing_view(self, header: PushHeader) -> memoryview | None:
        """The body sink of the PushBuffer frame: the view of the reserved segment a
        pushed data buffer lands in (then ``on_data_pushed``), or None for a frame to be
        decoded as a message (an event, or a push to a session no longer open: the
        endpoint drops or refuses those). ProtocolError if the task pushed without credit
        or more than a segment."""
        if header.data_type is not DataType.DATA_BUFFER or self.state is not _OPEN:
            return None
        return self._take_segment(header.size).segment.view()[: header.size]

    def _take_segment(self, size: int) -> Buffer:
        if not self._reserved or self._granted <= 0:
            raise ProtocolError("PushBuffer without credit")
        if size > self._reserved[0].segment.size:
            raise ProtocolError(
                f"pushed buffer of {size} bytes exceeds the "
                f"{self._reserved[0].segment.size}-byte segment"
            )
        self._granted -= 1
        buf = self._reserved.popleft()
        self._landing.append(buf)
        return buf

    def drop_landing(self) -> None:
        """The connection is gone: segments whose pushes were landing, and those granted
        to the task (shared), go back (call this once nothing writes into them any more)."""
        while self._landing:
            self._landing.popleft().release()
        held, self._held = self._held, []
        for buf in held:
            buf.release()

    def commit(self, segment: int, size: int, subpartition: int) -> None:
        """The task filled granted segment ``segment`` with ``size`` bytes for
        ``subpartition``: queue it there in place. Segments are committed in the order
        they were granted; anything else is a ProtocolError."""
        self.commit_all(((segment, size, subpartition),))

    def commit_all(self, commits: Iterable[tuple[int, int, int]]) -> None:
        """``commit`` for each ``(segment, size, subpartition)`` of a CommitSegments, in
        order; the segments freed meanwhile are reserved and granted once, after the
        batch. An error stops the batch: the commits before it are queued. The loop is
        compiled (``segment_commits.pyx``), with the same checks and errors."""
        if not self.shared:
            raise ProtocolError("CommitSegments on a partition without shared memory")
        try:
            commit_segments(self, commits)  # compiled: checks and queues each entry
        finally:
            if self.state is _OPEN:
                self._reserve_nowait()
                self._announce()

    def on_data_pushed(self, subpartition: int, size: int) -> None:
        """The bytes of the oldest landing buffer are in place: queue it. A session that
        ended while they arrived (the partition was released) drops them."""
        if not self._landing:
            raise IllegalStateError("no pushed buffer is landing")
        buf = self._landing.popleft()
        if self.state is not _OPEN:
            buf.release()
            return
        self._queue(buf, subpartition, size)

    def _queue(self, buf: Buffer, subpartition: int, size: int) -> None:
        self._queue_only(buf, subpartition, size)
        self._reserve_nowait()
        self._announce()

    def _queue_only(self, buf: Buffer, subpartition: int, size: int) -> None:
        """Queue a filled segment in ``subpartition`` (no credit granted for it yet)."""
        buf.set_size(size)
        n = self.partition.num_subpartitions
        if not 0 <= subpartition < n and subpartition != ALL_SUBPARTITIONS:
            buf.release()
            raise SubpartitionIndexError(subpartition, n, self.partition.partition_id)
        # takes it over, even when it raises; ALL_SUBPARTITIONS: every subpartition reads it
        self.partition.add_buffer(subpartition, buf)
        self.bytes_received += size  # what was queued
        self.buffers_received += 1

    def on_push(self, subpartition: int, data_type: DataType, payload: memoryview) -> None:
        """A pushed buffer or event whose bytes arrived outside a segment (copied once)."""
        if not self.is_open:
            raise ProtocolError(f"PushBuffer after the partition was {self.state.value}")
        if data_type is DataType.DATA_BUFFER:
            size = len(payload)
            self._take_segment(size).segment.view()[:size] = payload
            self.on_data_pushed(subpartition, size)
            return
        if subpartition != ALL_SUBPARTITIONS:
            raise ProtocolError("events are broadcast to all subpartitions")
        self.partition.broadcast_event(EventSerializer.from_bytes(payload))

    # -- ending --------------------------------------------------------------------------

    def _drop_reserved(self) -> None:
        reserved = self._reserved
        if self.shared:  # the task may still write into what it was granted
            for _ in range(min(self._granted, len(reserved))):
                self._held.append(reserved.popleft())
        while reserved:
            reserved.popleft().release()
        self._granted = 0
        self._unannounced = 0

    def finish(self) -> PartitionFinished:
        """The task closed its writer: EndOfPartition to every subpartition."""
        if not self.is_open:
            raise ProtocolError(f"FinishPartition after the partition was {self.state.value}")
        self._transition(ProducerSessionState.FINISHED)
        self._drop_reserved()
        self.partition.finish()  # a PartitionError here: released meanwhile, readers know
        st = self.partition.stats()
        return PartitionFinished(st.bytes_out, st.buffers_out)

    def fail(self, reason: str) -> bool:
        """The task failed or went away before finishing: readers get ProducerFailedError.
        True if this failed the partition (False: it had ended already)."""
        if not self.is_open:
            return False
        self._transition(ProducerSessionState.FAILED)
        self._drop_reserved()
        if self.partition.is_released:
            return False
        self.partition.fail(ProducerFailedError(reason, self.partition.partition_id))
        return True

    def _abort(self, cause: BaseException | None) -> None:
        """The partition cannot complete (released, a reader left early): tell the task
        now; one waiting for credit would otherwise wait forever."""
        if not self.is_open:
            return
        self._transition(ProducerSessionState.ABORTED)
        self._drop_reserved()
        if not isinstance(cause, PartitionError):
            cause = PartitionReleasedError(
                "partition was released while its producer was writing",
                self.partition.partition_id,
            )
        if self._on_abort is not None:
            self._on_abort(error_response_for(cause))

    def _on_output_channel_state(
        self, subpartition: int, checkpoint_id: int, buffers: list[Buffer]
    ) -> None:
        """An unaligned barrier overtook ``buffers`` (retained slices) in ``subpartition``:
        copy each to the task, release them, then say the subpartition is complete."""
        size = 0
        try:
            for buf in buffers:
                if self.is_open:
                    payload = buf.to_bytes()
                    self._send(OutputChannelState(checkpoint_id, subpartition, payload))
                    size += len(payload)
        finally:
            for buf in buffers:
                buf.release()
        if not self.is_open:
            return  # the task is gone or done: its checkpoint cannot complete anyway
        self._send(OutputChannelStateComplete(checkpoint_id, subpartition, len(buffers), size))
        self.output_state_bytes += size
        self.output_state_buffers += len(buffers)
        self.output_state_reports += 1
        if self._on_output_state is not None:
            self._on_output_state(len(buffers), size)

    def _on_buffer_size(self, subpartition: int, size: int) -> None:
        if self.is_open:
            self._send(ProducerBufferSize(subpartition, size))

    def _on_partition_released(self, partition: ResultPartition) -> None:
        self._abort(partition.failure_cause)

    def _on_consumer_failure(self, cause: BaseException) -> None:
        """A reader left a pipelined subpartition early: the stream cannot complete. The
        partition itself is failed too, so readers of the *other* subpartitions get the
        error instead of waiting for an EndOfPartition that never comes."""
        if not self.is_open or not isinstance(cause, PartitionError):
            return
        self._abort(cause)
        if not self.partition.is_released:
            self.partition.fail(cause)
