"""PartitionRequestQueue against a recording OutboundChannel: credit, writability, order.

No sockets and no event loop: ``schedule`` appends to a list that the test runs, which is
exactly what ``loop.call_soon`` does between two callbacks. The channel double records
every BufferResponse (with a copy of its payload) and releases the buffer as a transport
would once written; tests flip its writability the way pause/resume_writing do.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from dataclasses import dataclass

import pytest

from exchange.buffers.buffer import Buffer, DataType
from exchange.errors import PartitionReleasedError
from exchange.events.events import CheckpointBarrier, CheckpointOptions, EventSerializer
from exchange.network.credit_based_view_reader import CreditBasedSequenceNumberingViewReader
from exchange.network.partition_request_queue import PartitionRequestQueue
from exchange.partition import ResultPartition, ResultPartitionManager
from exchange.partition.bounded_data import HEADER as BOUNDED_DATA_HEADER
from exchange.protocol.messages import ErrorCode, ErrorResponse, Message
from tests.conformance.partition_fill import add_full_buffers

PartitionFactory = Callable[..., ResultPartition]


@dataclass(frozen=True)
class Sent:
    receiver_id: int
    sequence_number: int
    backlog: int
    data_type: DataType
    payload: bytes

    @property
    def tag(self) -> int:
        """The buffer number written by ``add_full_buffers`` (data buffers only)."""
        return int(struct.unpack_from(">I", self.payload, 4)[0])


class RecordingChannel:
    """An OutboundChannel that records sends; ``unwritable_after`` simulates pause_writing."""

    def __init__(self) -> None:
        self.writable = True
        self.sent: list[Sent] = []
        self.messages: list[Message] = []
        self.unwritable_after: int | None = None

    @property
    def is_writable(self) -> bool:
        return self.writable

    def send_buffer(
        self, receiver_id: int, sequence_number: int, backlog: int, buf: Buffer
    ) -> None:
        assert self.writable, "the queue wrote to an unwritable channel"
        self.sent.append(Sent(receiver_id, sequence_number, backlog, buf.data_type, buf.to_bytes()))
        buf.release()  # written out
        if self.unwritable_after is not None and len(self.sent) >= self.unwritable_after:
            self.writable = False  # the transport crossed its high watermark

    def send(self, message: Message) -> None:
        self.messages.append(message)

    def data(self, receiver_id: int | None = None) -> list[Sent]:
        return [
            s
            for s in self.sent
            if s.data_type is DataType.DATA_BUFFER
            and (receiver_id is None or s.receiver_id == receiver_id)
        ]


class Loop:
    """``schedule`` for the queue; ``run`` drains it like an event loop iteration would."""

    def __init__(self) -> None:
        self.pending: list[Callable[[], None]] = []

    def schedule(self, fn: Callable[[], None]) -> None:
        self.pending.append(fn)

    def run(self) -> int:
        n = 0
        while self.pending:
            self.pending.pop(0)()
            n += 1
        return n


@pytest.fixture
def channel() -> RecordingChannel:
    return RecordingChannel()


@pytest.fixture
def loop() -> Loop:
    return Loop()


@pytest.fixture
def queue(channel: RecordingChannel, loop: Loop) -> PartitionRequestQueue:
    return PartitionRequestQueue(channel, loop.schedule)


def attach(
    queue: PartitionRequestQueue,
    manager: ResultPartitionManager,
    part: ResultPartition,
    receiver_id: int,
    credit: int,
    index: int = 0,
) -> CreditBasedSequenceNumberingViewReader:
    """What the server does for a PartitionRequest."""
    reader = CreditBasedSequenceNumberingViewReader(receiver_id, credit, queue)
    queue.add_reader(reader)
    reader.request_subpartition_view(manager, part.partition_id, index)
    return reader


def test_sends_only_with_credit_and_resumes_on_add_credit(
    make_partition: PartitionFactory,
    manager: ResultPartitionManager,
    queue: PartitionRequestQueue,
    channel: RecordingChannel,
    loop: Loop,
) -> None:
    part = make_partition(1, "pipelined", 1, (1, 16))
    attach(queue, manager, part, 1, credit=2)
    add_full_buffers(part, 0, 6)
    assert channel.sent == []  # producer notifications are deferred, never re-entrant
    loop.run()
    assert [s.tag for s in channel.data()] == [0, 1]
    assert [s.sequence_number for s in channel.sent] == [0, 1]

    queue.add_credit(1, 3)
    loop.run()
    assert [s.tag for s in channel.data()] == [0, 1, 2, 3, 4]
    assert [s.sequence_number for s in channel.sent] == [0, 1, 2, 3, 4]
    # Every BufferResponse carries the backlog: what is still queued for the channel.
    backlogs = [s.backlog for s in channel.sent]
    assert backlogs == sorted(backlogs, reverse=True)
    assert backlogs[-1] <= 1

    queue.add_credit(1, 10)
    part.finish()
    loop.run()
    assert [s.tag for s in channel.data()] == [0, 1, 2, 3, 4, 5]
    last = channel.sent[-1]
    assert last.data_type is DataType.EVENT_BUFFER
    assert queue.num_readers == 0  # EndOfPartition sent: the view was released at once
    assert part.is_released
    assert channel.messages == []


def test_end_of_partition_needs_no_credit(
    make_partition: PartitionFactory,
    manager: ResultPartitionManager,
    queue: PartitionRequestQueue,
    channel: RecordingChannel,
    loop: Loop,
) -> None:
    part = make_partition(1, "pipelined", 1, (1, 8))
    reader = attach(queue, manager, part, 1, credit=1)
    add_full_buffers(part, 0, 1)
    part.finish()
    loop.run()
    assert reader.credits == 0
    assert [s.data_type for s in channel.sent] == [DataType.DATA_BUFFER, DataType.EVENT_BUFFER]
    assert queue.num_readers == 0


def test_unwritable_channel_stops_and_resume_continues_in_order(
    make_partition: PartitionFactory,
    manager: ResultPartitionManager,
    queue: PartitionRequestQueue,
    channel: RecordingChannel,
    loop: Loop,
) -> None:
    part = make_partition(1, "pipelined", 1, (1, 16))
    attach(queue, manager, part, 1, credit=100)
    add_full_buffers(part, 0, 10)
    part.finish()
    channel.unwritable_after = 3
    loop.run()
    assert len(channel.sent) == 3  # stopped at the watermark, nothing written while paused
    queue.write_and_flush_next()  # a stray call while unwritable writes nothing
    assert len(channel.sent) == 3

    channel.unwritable_after = 7
    channel.writable = True  # resume_writing ...
    queue.write_and_flush_next()  # ... calls this
    assert len(channel.sent) == 7
    channel.unwritable_after = None
    channel.writable = True
    queue.write_and_flush_next()
    assert [s.tag for s in channel.data()] == list(range(10))
    assert [s.sequence_number for s in channel.sent] == list(range(11))
    assert queue.num_readers == 0


def test_readers_take_turns(
    make_partition: PartitionFactory,
    manager: ResultPartitionManager,
    queue: PartitionRequestQueue,
    channel: RecordingChannel,
    loop: Loop,
) -> None:
    part = make_partition(1, "pipelined", 2, (2, 16))
    attach(queue, manager, part, 10, credit=10, index=0)
    attach(queue, manager, part, 20, credit=10, index=1)
    add_full_buffers(part, 0, 3, start=0)
    add_full_buffers(part, 1, 3, start=100)
    channel.writable = False  # both readers queue up while the channel is paused
    loop.run()
    channel.writable = True
    queue.write_and_flush_next()
    order = [s.receiver_id for s in channel.sent]
    # Round robin: a reader with more data goes to the back of the queue.
    assert order == [10, 20, 10, 20, 10, 20]
    assert [s.tag for s in channel.data(10)] == [0, 1, 2]
    assert [s.tag for s in channel.data(20)] == [100, 101, 102]
    part.release()
    loop.run()
    queue.release_all()


def test_duplicate_notifications_enqueue_once(
    make_partition: PartitionFactory,
    manager: ResultPartitionManager,
    queue: PartitionRequestQueue,
    channel: RecordingChannel,
    loop: Loop,
) -> None:
    part = make_partition(1, "pipelined", 1, (1, 8))
    reader = attach(queue, manager, part, 1, credit=5)
    add_full_buffers(part, 0, 2)
    channel.writable = False
    for _ in range(5):
        reader.notify_data_available()
    loop.run()
    assert reader.registered_as_available
    channel.writable = True
    queue.write_and_flush_next()
    assert [s.tag for s in channel.data()] == [0, 1]
    assert not reader.registered_as_available
    part.release()
    loop.run()


def test_aligned_barrier_blocks_until_resume_consumption(
    make_partition: PartitionFactory,
    manager: ResultPartitionManager,
    queue: PartitionRequestQueue,
    channel: RecordingChannel,
    loop: Loop,
) -> None:
    part = make_partition(1, "pipelined", 1, (1, 8))
    attach(queue, manager, part, 1, credit=5)
    add_full_buffers(part, 0, 1)
    part.broadcast_event(CheckpointBarrier(7, 0))
    add_full_buffers(part, 0, 2, start=1)
    part.flush_all()
    loop.run()
    types = [s.data_type for s in channel.sent]
    assert types == [DataType.DATA_BUFFER, DataType.ALIGNED_CHECKPOINT_BARRIER]
    queue.add_credit(1, 5)  # credit does not unblock a barrier
    loop.run()
    assert len(channel.sent) == 2
    queue.resume_consumption(1)
    loop.run()
    assert [s.tag for s in channel.data()] == [0, 1, 2]
    part.release()
    loop.run()


def test_producer_failure_becomes_a_per_channel_error(
    make_partition: PartitionFactory,
    manager: ResultPartitionManager,
    queue: PartitionRequestQueue,
    channel: RecordingChannel,
    loop: Loop,
) -> None:
    part = make_partition(1, "pipelined", 1, (1, 8))
    attach(queue, manager, part, 5, credit=0)  # no credit: data stays queued
    add_full_buffers(part, 0, 2)
    loop.run()
    part.fail(RuntimeError("disk on fire"))
    loop.run()
    assert channel.sent == []
    [err] = channel.messages
    assert isinstance(err, ErrorResponse)
    assert err.code is ErrorCode.PRODUCER_FAILED and err.receiver_id == 5
    assert "disk on fire" in err.message
    assert queue.num_readers == 0


def test_release_mid_stream_is_partition_released(
    make_partition: PartitionFactory,
    manager: ResultPartitionManager,
    queue: PartitionRequestQueue,
    channel: RecordingChannel,
    loop: Loop,
) -> None:
    part = make_partition(1, "pipelined", 1, (1, 8))
    attach(queue, manager, part, 5, credit=1)
    add_full_buffers(part, 0, 3)
    loop.run()
    manager.release_partition(part.partition_id)
    loop.run()
    assert len(channel.data()) == 1
    [err] = channel.messages
    assert isinstance(err, ErrorResponse)
    assert err.code is ErrorCode.PARTITION_RELEASED and err.receiver_id == 5
    queue.add_credit(5, 1)  # late credit for a dropped reader is ignored
    loop.run()
    assert len(channel.sent) == 1


def test_cancel_releases_the_view_and_the_producer_learns(
    make_partition: PartitionFactory,
    manager: ResultPartitionManager,
    queue: PartitionRequestQueue,
    channel: RecordingChannel,
    loop: Loop,
) -> None:
    part = make_partition(1, "pipelined", 1, (1, 8))
    reader = attach(queue, manager, part, 5, credit=1)
    add_full_buffers(part, 0, 3)
    channel.writable = False
    loop.run()
    assert reader.registered_as_available
    queue.cancel(5)
    assert queue.num_readers == 0
    assert reader.is_released and not reader.registered_as_available
    channel.writable = True
    queue.write_and_flush_next()
    assert channel.sent == [] and channel.messages == []
    assert part.is_released  # its only consumer left before the end
    with pytest.raises(PartitionReleasedError):
        part.check_writable(0)
    queue.cancel(5)  # idempotent


def test_release_all_drops_every_reader_and_ignores_later_notifications(
    make_partition: PartitionFactory,
    manager: ResultPartitionManager,
    queue: PartitionRequestQueue,
    channel: RecordingChannel,
    loop: Loop,
) -> None:
    part = make_partition(1, "pipelined", 4, (4, 16))
    readers = [attach(queue, manager, part, 100 + i, credit=2, index=i) for i in range(4)]
    for i in range(4):
        add_full_buffers(part, i, 1)
    channel.writable = False
    loop.run()
    queue.release_all()
    assert queue.num_readers == 0 and queue.readers == []
    assert all(r.is_released for r in readers)
    channel.writable = True
    queue.write_and_flush_next()
    queue.add_credit(100, 1)
    loop.run()
    assert channel.sent == [] and channel.messages == []
    assert part.is_released


def test_stats_count_what_was_sent(
    make_partition: PartitionFactory,
    manager: ResultPartitionManager,
    queue: PartitionRequestQueue,
    channel: RecordingChannel,
    loop: Loop,
) -> None:
    part = make_partition(1, "pipelined", 1, (1, 8))
    attach(queue, manager, part, 1, credit=8)
    add_full_buffers(part, 0, 3)
    part.finish()
    loop.run()
    assert queue.buffers_sent == 4
    assert queue.bytes_sent == sum(len(s.payload) for s in channel.sent)
    assert EventSerializer.from_bytes(channel.sent[-1].payload) is not None


# -- defect 3: a reader's error fails its channel, never the queue ----------------------


def truncate_spill_file(part: ResultPartition, index: int, keep_buffers: int) -> None:
    """Cut subpartition ``index``'s spill file in the middle of buffer ``keep_buffers``."""
    path = part.subpartitions[index].data.path  # type: ignore[union-attr]
    per_buffer = BOUNDED_DATA_HEADER.size + part.segment_size
    with open(path, "r+b") as f:
        f.truncate(keep_buffers * per_buffer + BOUNDED_DATA_HEADER.size + 100)


def test_a_truncated_spill_file_fails_only_its_channel(
    make_partition: PartitionFactory,
    manager: ResultPartitionManager,
    queue: PartitionRequestQueue,
    channel: RecordingChannel,
    loop: Loop,
) -> None:
    """Defect 3: the reader's error used to escape the scheduled callback (asyncio logged
    and dropped it) and every channel of the connection stalled silently."""
    part = make_partition(1, "blocking", 2, (2, 4))
    add_full_buffers(part, 0, 6, start=0)
    add_full_buffers(part, 1, 6, start=100)
    part.finish()
    broken = attach(queue, manager, part, 10, credit=20, index=0)
    attach(queue, manager, part, 20, credit=20, index=1)
    # cut under the open reader (a reader opens only the file it was written as, of the
    # size written: cut before, the request itself is refused)
    truncate_spill_file(part, 0, keep_buffers=2)
    loop.run()  # must not raise: the error is routed to its channel

    [err] = channel.messages
    assert isinstance(err, ErrorResponse)
    assert err.receiver_id == 10 and not err.is_fatal
    assert err.code is ErrorCode.INTERNAL and "truncated" in err.message
    assert broken.is_released  # its view (and the file reader) released
    # An in-order prefix of the intact buffers (the reader reads one ahead).
    tags = [s.tag for s in channel.data(10)]
    assert tags == list(range(len(tags))) and len(tags) <= 2
    # The other channel of the same connection goes on to its end.
    assert [s.tag for s in channel.data(20)] == list(range(100, 106))
    assert channel.sent[-1].receiver_id == 20
    assert channel.sent[-1].data_type is DataType.EVENT_BUFFER
    assert queue.num_readers == 0
    queue.add_credit(10, 5)  # late credit for the failed channel is ignored
    loop.run()
    assert len(channel.messages) == 1


class FailingView:
    """A ResultSubpartitionView whose every call raises ``error`` once ``armed``."""

    def __init__(self, error: Exception) -> None:
        self.error = error
        self.armed = False
        self.released = False

    def _check(self) -> None:
        if self.armed:
            raise self.error

    def get_next_buffer(self) -> None:
        self._check()

    def get_availability_and_backlog(self, num_credits: int) -> tuple[bool, int]:
        self._check()
        return False, 0

    def resume_consumption(self) -> None:
        self._check()

    def notify_new_buffer_size(self, size: int) -> None:
        self._check()

    def release_all_resources(self) -> None:
        self.released = True
        self._check()  # even the release may fail: the reader is dropped all the same

    @property
    def is_released(self) -> bool:
        return self.released

    @property
    def failure_cause(self) -> BaseException | None:
        return None


@pytest.mark.parametrize("trigger", ["notify", "add_credit", "resume", "buffer_size"])
def test_any_view_error_fails_that_channel_and_nothing_else(
    trigger: str,
    make_partition: PartitionFactory,
    manager: ResultPartitionManager,
    queue: PartitionRequestQueue,
    channel: RecordingChannel,
    loop: Loop,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    view = FailingView(OSError(5, "Input/output error"))
    bad = CreditBasedSequenceNumberingViewReader(7, 1, queue)
    part = make_partition(1, "pipelined", 1, (1, 8))
    monkeypatch.setattr(manager, "create_subpartition_view", lambda *_: view)
    bad.request_subpartition_view(manager, part.partition_id, 0)
    monkeypatch.undo()
    queue.add_reader(bad)
    attach(queue, manager, part, 8, credit=4)
    add_full_buffers(part, 0, 2)
    view.armed = True
    match trigger:
        case "notify":
            bad.notify_data_available()
        case "add_credit":
            queue.add_credit(7, 1)
        case "resume":
            queue.resume_consumption(7)
        case "buffer_size":
            queue.notify_new_buffer_size(7, 1024)
    loop.run()
    [err] = channel.messages
    assert isinstance(err, ErrorResponse) and err.receiver_id == 7
    assert err.code is ErrorCode.INTERNAL and "Input/output error" in err.message
    assert view.released and queue.get_reader(7) is None
    assert [s.tag for s in channel.data(8)] == [0, 1]  # the healthy channel was served
    part.finish()
    loop.run()
    assert queue.num_readers == 0


def test_unaligned_barrier_overtakes_the_backlog_with_zero_credit(
    make_partition: PartitionFactory,
    manager: ResultPartitionManager,
    queue: PartitionRequestQueue,
    channel: RecordingChannel,
    loop: Loop,
) -> None:
    """Flink's PartitionRequestQueueTest#testNotifyReaderPriorityEvent: the priority
    barrier leaves first, ahead of the other readers' buffers too, and without credit."""
    part = make_partition(1, "pipelined", 2, (2, 16))
    attach(queue, manager, part, 1, credit=1, index=0)
    attach(queue, manager, part, 2, credit=4, index=1)
    add_full_buffers(part, 0, 3)  # reader 1: one credit, then stuck with a backlog of 2
    loop.run()
    assert [s.tag for s in channel.data(1)] == [0]
    channel.writable = False  # reader 2 waits in the queue behind nothing it could send
    add_full_buffers(part, 1, 2)
    loop.run()
    barrier = CheckpointBarrier(4, 0, CheckpointOptions(unaligned=True))
    part.broadcast_event(barrier)
    loop.run()
    channel.writable = True
    queue.write_and_flush_next()
    loop.run()
    sent = [(s.receiver_id, s.data_type) for s in channel.sent[1:]]
    # both barriers before reader 2's data; reader 1's backlog still waits for credit
    assert sorted(sent[:2]) == [
        (1, DataType.PRIORITIZED_EVENT_BUFFER),
        (2, DataType.PRIORITIZED_EVENT_BUFFER),
    ]
    assert [s.tag for s in channel.data(2)] == [0, 1]
    assert [s.tag for s in channel.data(1)] == [0]
    queue.add_credit(1, 2)
    loop.run()
    assert [s.tag for s in channel.data(1)] == [0, 1, 2]  # overtaken, still sent after it
    part.release()
    loop.run()


def test_priority_moves_a_waiting_reader_to_the_head(
    make_partition: PartitionFactory,
    manager: ResultPartitionManager,
    queue: PartitionRequestQueue,
    channel: RecordingChannel,
    loop: Loop,
) -> None:
    a = make_partition(1, "pipelined", 1, (1, 16))
    b = make_partition(2, "pipelined", 1, (1, 16))
    attach(queue, manager, a, 1, credit=4)
    attach(queue, manager, b, 2, credit=4)
    channel.writable = False
    add_full_buffers(a, 0, 2)
    add_full_buffers(b, 0, 2)
    loop.run()  # both readers wait, reader 1 first
    b.broadcast_event(CheckpointBarrier(3, 0, CheckpointOptions(unaligned=True)))
    loop.run()
    channel.writable = True
    queue.write_and_flush_next()
    assert (channel.sent[0].receiver_id, channel.sent[0].data_type) == (
        2,
        DataType.PRIORITIZED_EVENT_BUFFER,
    )
    a.release()
    b.release()
    loop.run()
