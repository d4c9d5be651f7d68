"""ProducerSession (the daemon's side of a producer task), sans I/O.

Credit is reserved segments, granted in batches as consumers free segments (through the
pool's BufferListener); pushes land in them; the lifecycle ends exactly once; and a reader
that leaves one subpartition early fails the partition for every other reader (defect 1).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from exchange.buffers.buffer import DataType
from exchange.errors import (
    IllegalStateError,
    PartitionReleasedError,
    ProducerFailedError,
    ProtocolError,
    SubpartitionIndexError,
    UsageError,
)
from exchange.events.events import CancelCheckpointMarker, EventSerializer
from exchange.local import ProducerSession, ProducerSessionState
from exchange.local.producer_session import PUSH_BUFFER_FRAMES, PushHeader
from exchange.partition import (
    ALL_SUBPARTITIONS,
    PipelinedSubpartition,
    ResultPartition,
    ResultPartitionType,
)
from exchange.protocol.codec import (
    DEFAULT_MAX_FRAME_SIZE,
    InPlaceFrameDecoder,
    PayloadReceived,
    encode,
)
from exchange.protocol.local_messages import (
    AddProducerCredit,
    GrantSegments,
    PartitionFinished,
    PushBuffer,
)
from exchange.protocol.messages import ErrorResponse, Message

PIPELINED = ResultPartitionType.PIPELINED


class Task:
    """What the session sends to the task, and the error it aborts with."""

    def __init__(self) -> None:
        self.sent: list[Message] = []
        self.aborted: list[ErrorResponse] = []

    @property
    def credit(self) -> int:
        return sum(m.credit for m in self.sent if isinstance(m, AddProducerCredit))


def session_for(
    make_partition: Callable[..., ResultPartition], n: int, pool: tuple[int, int], credit: int
) -> tuple[ResultPartition, ProducerSession, Task]:
    part = make_partition("p", PIPELINED, n, pool_size=pool)
    task = Task()
    s = ProducerSession(part, task.sent.append, max_credit=credit, on_abort=task.aborted.append)
    return part, s, task


def push(s: ProducerSession, target: int, data: bytes) -> None:
    s.on_push(target, DataType.DATA_BUFFER, memoryview(data))


def drain(part: ResultPartition, sub: int) -> int:
    """Read and release what subpartition ``sub`` holds (a consumer freeing segments)."""
    subpartition = part.subpartitions[sub]
    assert isinstance(subpartition, PipelinedSubpartition)
    n = 0
    while (b := subpartition.poll_buffer()) is not None:
        b.buffer.release()
        n += 1
    return n


class Listener:
    def notify_data_available(self) -> None:
        pass


def test_first_grant_is_what_the_pool_has_free(make_partition: Callable[..., Any]) -> None:
    part, s, task = session_for(make_partition, 1, (1, 4), credit=8)
    assert s.start() == 4 and s.credit_outstanding == 4
    assert task.sent == []
    part.release()


def test_credit_comes_back_in_batches_as_consumers_free_segments(
    make_partition: Callable[..., Any],
) -> None:
    part, s, task = session_for(make_partition, 1, (1, 8), credit=8)
    part.create_subpartition_view(0, Listener())
    assert s.start() == 8
    for i in range(8):
        push(s, 0, bytes([i]) * 100)
    assert s.credit_outstanding == 0 and task.credit == 0  # the pool is full: no credit
    # the consumer frees segments one by one: the task, out of credit, hears at once, and
    # then in batches of max_credit // 4, not one message per buffer
    freed = drain(part, 0)
    assert freed == 8
    assert s.num_reserved == 8
    unannounced = s.num_reserved - s.credit_outstanding
    assert task.credit == 8 - unannounced and 0 <= unannounced < 8 // 4
    assert 1 < len(task.sent) <= 1 + 8 // 2
    # the task spends its credit: once it has none, the rest is granted at once
    for _ in range(task.credit):
        push(s, 0, b"again")
    assert task.credit == 8 and s.credit_outstanding == unannounced
    part.release()


def test_with_a_scheduler_one_grant_per_callback(make_partition: Callable[..., Any]) -> None:
    part = make_partition("p", PIPELINED, 1, pool_size=(1, 8))
    task = Task()
    later: list[Callable[[], None]] = []
    s = ProducerSession(part, task.sent.append, max_credit=8, schedule=later.append)
    part.create_subpartition_view(0, Listener())
    assert s.start() == 8
    for i in range(8):
        push(s, 0, bytes([i]) * 100)
    assert len(later) == 1  # decided once the callback is done, whatever it pushed
    later.pop()()
    assert task.sent == []  # nothing was free: no grant
    assert drain(part, 0) == 8  # one callback frees eight segments...
    assert len(later) == 1
    later.pop()()
    assert task.sent == [AddProducerCredit(8)]  # ...and the task hears once
    push(s, 0, b"x")
    assert len(later) == 1
    part.release()
    later.pop()()  # a grant decided after the partition went sends nothing
    assert task.sent == [AddProducerCredit(8)]


def test_push_without_credit_or_too_large_is_a_protocol_error(
    make_partition: Callable[..., Any],
) -> None:
    part, s, _ = session_for(make_partition, 1, (1, 1), credit=1)
    s.start()
    with pytest.raises(ProtocolError, match="exceeds"):
        push(s, 0, b"x" * (part.segment_size + 1))
    push(s, 0, b"ok")
    with pytest.raises(ProtocolError, match="without credit"):
        push(s, 0, b"no credit left")
    part.release()


def test_bad_subpartition_releases_the_segment(make_partition: Callable[..., Any]) -> None:
    part, s, _ = session_for(make_partition, 2, (2, 4), credit=2)
    s.start()
    with pytest.raises(SubpartitionIndexError):
        push(s, 5, b"x")
    part.release()


def test_broadcast_buffers_and_events(make_partition: Callable[..., Any]) -> None:
    part, s, _ = session_for(make_partition, 3, (3, 6), credit=2)
    views = [part.create_subpartition_view(i, Listener()) for i in range(3)]
    s.start()
    push(s, ALL_SUBPARTITIONS, b"shared")
    s.on_push(
        ALL_SUBPARTITIONS,
        DataType.EVENT_BUFFER,
        memoryview(EventSerializer.to_bytes(CancelCheckpointMarker(3))),
    )
    with pytest.raises(ProtocolError, match="broadcast"):
        s.on_push(
            0,
            DataType.EVENT_BUFFER,
            memoryview(EventSerializer.to_bytes(CancelCheckpointMarker(4))),
        )
    assert isinstance(s.finish(), PartitionFinished)
    for v in views:
        got = []
        while (b := v.get_next_buffer()) is not None:
            got.append(bytes(b.buffer.memoryview()) if b.buffer.is_buffer else b.buffer.data_type)
            b.buffer.release()
        assert got[0] == b"shared" and got[1] is DataType.EVENT_BUFFER
        v.release_all_resources()


def test_lifecycle_ends_once(make_partition: Callable[..., Any]) -> None:
    part, s, _ = session_for(make_partition, 1, (1, 2), credit=2)
    s.start()
    s.finish()
    assert s.state is ProducerSessionState.FINISHED
    assert not s.fail("late")  # the first end wins
    with pytest.raises(ProtocolError):
        s.finish()
    with pytest.raises(ProtocolError):
        push(s, 0, b"x")
    with pytest.raises(IllegalStateError):
        s._transition(ProducerSessionState.OPEN)
    part.release()


def test_failed_task_fails_the_partition_and_returns_its_reservations(
    make_partition: Callable[..., Any], nbp: Any
) -> None:
    part, s, _ = session_for(make_partition, 1, (1, 4), credit=4)
    s.start()
    assert s.fail("task died")
    assert s.state is ProducerSessionState.FAILED and s.num_reserved == 0
    assert part.is_released and isinstance(part.failure_cause, ProducerFailedError)


def test_partition_released_under_the_task_tells_it(make_partition: Callable[..., Any]) -> None:
    part, s, task = session_for(make_partition, 1, (1, 4), credit=4)
    s.start()
    part.release(PartitionReleasedError("daemon stopping"))
    assert s.state is ProducerSessionState.ABORTED and s.num_reserved == 0
    assert len(task.aborted) == 1


def test_reader_leaving_early_fails_the_partition_for_every_other_reader(
    make_partition: Callable[..., Any],
) -> None:
    """Defect 1: the readers of the other subpartitions must get an error, not wait for
    an EndOfPartition that never comes."""
    part, s, task = session_for(make_partition, 2, (2, 6), credit=2)
    leaving = part.create_subpartition_view(0, Listener())
    staying = part.create_subpartition_view(1, Listener())
    s.start()
    push(s, 1, b"first")
    leaving.release_all_resources()  # its reader left before the end
    assert s.state is ProducerSessionState.ABORTED
    assert len(task.aborted) == 1
    assert part.is_released
    assert staying.is_released
    assert isinstance(staying.failure_cause, PartitionReleasedError | ProducerFailedError)
    staying.release_all_resources()


# -- pushes land in place: the decoder receives the payload straight into the segment ----


def push_frame(target: int, data_type: DataType, payload: bytes) -> bytes:
    return b"".join(encode(PushBuffer(target, data_type, payload)))


def in_place_decoder(s: ProducerSession) -> InPlaceFrameDecoder:
    return InPlaceFrameDecoder(
        DEFAULT_MAX_FRAME_SIZE, body_sink=s.landing_view, data_frames=PUSH_BUFFER_FRAMES
    )


def test_pushed_payloads_land_in_their_reserved_segments(
    make_partition: Callable[..., Any],
) -> None:
    part, s, _ = session_for(make_partition, 1, (1, 4), credit=4)
    view = part.create_subpartition_view(0, Listener())
    s.start()
    segments = [b.segment for b in s._reserved]
    dec = in_place_decoder(s)
    big = bytes(range(256)) * 12  # larger than the read-ahead: most of it lands in place
    stream = push_frame(0, DataType.DATA_BUFFER, b"small") + push_frame(
        0, DataType.DATA_BUFFER, big
    )
    out: list[Any] = []
    pos = 0
    while pos < len(stream):  # as the transport does: into get_buffer(), then report
        target = dec.get_buffer()
        k = min(len(target), len(stream) - pos)
        target[:k] = stream[pos : pos + k]
        pos += k
        out.extend(dec.buffer_updated(k))
    # the second payload was written by the "transport" into the reserved segment itself
    assert [type(o) for o in out] == [PayloadReceived, PayloadReceived]
    for o in out:
        s.on_data_pushed(o.header.subpartition, o.header.size)
    got = []
    while (b := view.get_next_buffer()) is not None:
        got.append((b.buffer.segment, bytes(b.buffer.memoryview())))
        b.buffer.release()
    assert got == [(segments[0], b"small"), (segments[1], big)]
    # an event is decoded as a message, not landed
    (event,) = dec.feed(
        push_frame(
            ALL_SUBPARTITIONS,
            DataType.EVENT_BUFFER,
            EventSerializer.to_bytes(CancelCheckpointMarker(1)),
        )
    )
    assert isinstance(event, PushBuffer)
    view.release_all_resources()
    part.release()


def test_push_without_credit_stops_the_in_place_decoder(
    make_partition: Callable[..., Any],
) -> None:
    part, s, _ = session_for(make_partition, 1, (1, 1), credit=1)
    s.start()
    dec = in_place_decoder(s)
    frames = push_frame(0, DataType.DATA_BUFFER, b"a") + push_frame(0, DataType.DATA_BUFFER, b"b")
    with pytest.raises(ProtocolError, match="without credit"):
        dec.feed(frames)
    s.drop_landing()  # the connection dies: the landed, unreported segment goes back
    part.release()


def test_partition_released_while_a_push_lands_drops_it(
    make_partition: Callable[..., Any], nbp: Any
) -> None:
    part, s, task = session_for(make_partition, 1, (1, 2), credit=2)
    s.start()
    target = s.landing_view(PushHeader(0, DataType.DATA_BUFFER, 4))
    assert target is not None
    part.release(PartitionReleasedError("released"))  # while the bytes arrive
    assert s.state is ProducerSessionState.ABORTED and len(task.aborted) == 1
    target[:] = b"late"  # the segment is still ours until the payload is reported
    s.on_data_pushed(0, 4)  # dropped: back to the pool
    assert s.landing_view(PushHeader(0, DataType.DATA_BUFFER, 4)) is None


def test_connection_lost_while_a_push_lands_returns_the_segment(
    make_partition: Callable[..., Any],
) -> None:
    _part, s, _ = session_for(make_partition, 1, (1, 2), credit=2)
    s.start()
    assert s.landing_view(PushHeader(0, DataType.DATA_BUFFER, 10)) is not None
    assert s.fail("task disconnected")
    s.drop_landing()
    with pytest.raises(IllegalStateError):
        s.on_data_pushed(0, 10)


# -- shared memory: grants by index, commits in place ------------------------------------


def shared_session(
    make_partition: Callable[..., ResultPartition], credit: int = 4, pool: tuple[int, int] = (2, 8)
) -> tuple[ResultPartition, ProducerSession, Task]:
    part = make_partition("p", PIPELINED, 2, pool_size=pool)
    task = Task()
    s = ProducerSession(
        part, task.sent.append, max_credit=credit, on_abort=task.aborted.append, shared=True
    )
    return part, s, task


def test_shared_grants_name_segments_and_a_commit_queues_that_very_segment(
    make_partition: Callable[..., Any],
) -> None:
    part, s, task = shared_session(make_partition)
    view = part.create_subpartition_view(1, Listener())
    n = s.start()
    granted = s.granted_segments(n)
    assert n == 4 and len(set(granted)) == 4
    assert s.granted_segments(0) == ()
    with pytest.raises(UsageError):  # more than the task holds: a caller's bug
        s.granted_segments(n + 1)
    first = granted[0]
    seg = next(b.segment for b in s._reserved if b.segment.index == first)
    seg.view()[:5] = b"hello"  # what the task wrote into the arena
    s.commit(first, 5, 1)
    got = view.get_next_buffer()
    assert got is not None and got.buffer.segment is seg  # no copy: the segment itself
    assert bytes(got.buffer.memoryview()) == b"hello"
    got.buffer.release()
    # credit comes back as indices: the segments the task now holds
    for idx in granted[1:]:
        s.commit(idx, 1, 0)
    assert task.sent and all(isinstance(m, GrantSegments) and m.segments for m in task.sent)
    assert (
        s.granted_segments(s.credit_outstanding)
        == tuple(i for m in task.sent if isinstance(m, GrantSegments) for i in m.segments)[
            -s.credit_outstanding :
        ]
    )
    part.release()
    s.drop_landing()


@pytest.mark.parametrize(
    ("commit", "match"),
    [
        (lambda g, size: (g[1], 1, 0), "oldest granted"),  # out of grant order
        (lambda g, size: (10_000, 1, 0), "oldest granted"),  # never granted
        (lambda g, size: (g[0], size + 1, 0), "bytes into"),  # larger than a segment
        (lambda g, size: (g[0], 0, 0), "bytes into"),
    ],
)
def test_a_bad_commit_is_a_protocol_error(
    make_partition: Callable[..., Any], commit: Any, match: str
) -> None:
    part, s, _ = shared_session(make_partition)
    granted = s.granted_segments(s.start())
    with pytest.raises(ProtocolError, match=match):
        s.commit(*commit(granted, part.segment_size))
    part.release()
    s.drop_landing()


@pytest.mark.parametrize(
    ("commit", "match"),
    [
        (lambda g, size: (g[0], -1, 0), "bytes into"),
        (lambda g, size: (g[0], 2**70, 0), "bytes into"),  # beyond any C integer
        (lambda g, size: (2**70, 1, 0), "oldest granted"),
        (lambda g, size: (-1, 1, 0), "oldest granted"),
    ],
)
def test_commit_fields_out_of_any_range_are_protocol_errors_with_nothing_queued(
    make_partition: Callable[..., Any], nbp: Any, commit: Any, match: str
) -> None:
    """The commit loop is compiled: values no C integer holds are refused as the others,
    with the session's books unchanged (the segment stays granted)."""
    part, s, _ = shared_session(make_partition)
    granted = s.granted_segments(s.start())
    with pytest.raises(ProtocolError, match=match):
        s.commit(*commit(granted, part.segment_size))
    assert s.credit_outstanding == len(granted) and s.buffers_received == 0
    assert s.granted_segments(len(granted)) == granted
    part.release()
    s.drop_landing()
    assert nbp.is_whole()


@pytest.mark.parametrize("subpartition", [2, -1, 2**70, ALL_SUBPARTITIONS - 1])
def test_a_commit_to_a_bad_subpartition_fails_and_its_segment_goes_back(
    make_partition: Callable[..., Any], nbp: Any, subpartition: int
) -> None:
    """A commit naming a subpartition the partition lacks: SubpartitionIndexError (the
    peer's bad index), the commits before it queued, that segment back in the pool."""
    part, s, _ = shared_session(make_partition, credit=4, pool=(8, 8))
    granted = s.granted_segments(s.start())
    with pytest.raises(SubpartitionIndexError):
        s.commit_all([(granted[0], 1, 1), (granted[1], 1, subpartition), (granted[2], 1, 0)])
    assert s.buffers_received == 1 and s.bytes_received == 1
    assert part.subpartitions[1].num_queued_buffers == 1  # type: ignore[union-attr]
    assert part.subpartitions[0].num_queued_buffers == 0  # type: ignore[union-attr]
    # the refused segment went back to the pool (and was reserved for the task again):
    # every segment out of the global pool is the one queued or one reserved
    assert nbp.num_in_use == 1 + s.num_reserved
    part.release()
    s.drop_landing()


def test_a_commit_after_finish_is_a_protocol_error_and_after_release_is_dropped(
    make_partition: Callable[..., Any], nbp: Any
) -> None:
    part, s, _ = shared_session(make_partition)
    granted = s.granted_segments(s.start())
    s.commit(granted[0], 1, 0)
    s.finish()
    with pytest.raises(ProtocolError, match="after FinishPartition"):
        s.commit(granted[1], 1, 0)
    assert s.buffers_received == 1
    part.release()
    s.drop_landing()
    other, s2, _ = shared_session(make_partition)
    granted = s2.granted_segments(s2.start())
    other.release()  # the partition went while the commit was in flight
    s2.commit_all([(granted[0], 1, 0), (granted[1], 1, 0)])
    assert s2.buffers_received == 0
    s2.drop_landing()
    assert nbp.is_whole()


def test_a_commit_without_credit_or_shared_memory_is_a_protocol_error(
    make_partition: Callable[..., Any],
) -> None:
    part, s, _ = shared_session(make_partition, credit=1, pool=(2, 2))
    (first,) = s.granted_segments(s.start())
    s.commit(first, 1, 0)
    (second,) = s.granted_segments(1)  # the pool's other segment, granted at once
    s.commit(second, 1, 0)
    assert s.credit_outstanding == 0  # both queued: nothing left to grant
    with pytest.raises(ProtocolError, match="without credit"):
        s.commit(second, 1, 0)
    part.release()
    s.drop_landing()
    other, plain, _ = session_for(make_partition, 1, (1, 2), credit=1)
    plain.start()
    with pytest.raises(ProtocolError, match="without shared memory"):
        plain.commit(0, 1, 0)
    other.release()


def test_a_batch_of_commits_is_granted_back_in_one_message(
    make_partition: Callable[..., Any],
) -> None:
    """A CommitSegments of k segments queues each in place and grants the segments the
    pool has free once, after the batch (one GrantSegments, not one per commit)."""
    part, s, task = shared_session(make_partition, credit=4, pool=(8, 8))
    granted = s.granted_segments(s.start())
    s.commit_all([(idx, 1, 0) for idx in granted])
    assert [len(m.segments) for m in task.sent if isinstance(m, GrantSegments)] == [4]
    assert s.buffers_received == 4 and s.bytes_received == 4
    assert part.subpartitions[0].num_queued_buffers == 4  # type: ignore[union-attr]
    part.create_subpartition_view(0, Listener())
    assert drain(part, 0) == 4
    part.release()
    s.drop_landing()


def test_a_bad_commit_in_a_batch_keeps_the_commits_before_it(
    make_partition: Callable[..., Any],
) -> None:
    part, s, task = shared_session(make_partition, credit=4, pool=(8, 8))
    granted = s.granted_segments(s.start())
    with pytest.raises(ProtocolError, match="oldest granted"):
        s.commit_all([(granted[0], 2, 1), (granted[2], 1, 1)])
    assert s.buffers_received == 1 and s.bytes_received == 2
    assert [len(m.segments) for m in task.sent if isinstance(m, GrantSegments)] == [1]
    part.create_subpartition_view(1, Listener())
    assert drain(part, 1) == 1
    part.release()
    s.drop_landing()


def test_segments_granted_to_an_ended_task_wait_for_its_connection_to_go(
    make_partition: Callable[..., Any], nbp: Any
) -> None:
    """An uncommitted segment is never queued (no torn record), and those granted stay
    out of the pool until the task's connection is gone (it may still write into them)."""
    part, s, _ = shared_session(make_partition)
    granted = s.granted_segments(s.start())
    view = part.create_subpartition_view(0, Listener())
    s.commit(granted[0], 3, 0)
    got = view.get_next_buffer()
    assert got is not None and len(got.buffer.memoryview()) == 3
    got.buffer.release()
    assert view.get_next_buffer() is None  # the granted, uncommitted ones are not read
    granted_now = s.credit_outstanding  # what the task may still be writing into
    assert granted_now > 0
    assert s.fail("producer task disconnected")
    part.release()
    assert nbp.num_in_use == granted_now  # held, not back in the pool yet
    s.drop_landing()  # the connection is gone
    assert nbp.num_in_use == 0
