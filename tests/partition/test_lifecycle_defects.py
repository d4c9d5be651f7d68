"""Regression tests of issue 8's partition and pool lifecycle defects.

Each test failed on the code before its fix. Data is written the way every producer now
writes it: complete buffers handed to ``ResultPartition.add_buffer``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from exchange.errors import (
    ConsumerAlreadyAttachedError,
    InsufficientBuffersError,
    PartitionError,
    PartitionNotReadyError,
    PartitionReleasedError,
    ProducerFailedError,
    SubpartitionIndexError,
)
from exchange.events import EndOfPartitionEvent, EventSerializer
from exchange.memory import NetworkBufferPool
from exchange.partition import (
    ALL_SUBPARTITIONS,
    ResultPartition,
    ResultPartitionID,
    ResultPartitionManager,
    ResultPartitionState,
    ResultPartitionType,
    ResultSubpartitionView,
)

pytestmark = pytest.mark.timeout(10)

PIPELINED = ResultPartitionType.PIPELINED
BLOCKING = ResultPartitionType.BLOCKING
PartitionFactory = Callable[..., ResultPartition]


class Listener:
    def __init__(self) -> None:
        self.notifications = 0

    def notify_data_available(self) -> None:
        self.notifications += 1


def push(part: ResultPartition, target: int, payload: bytes) -> None:
    """Queue one complete data buffer holding ``payload``, as a producer session does."""
    buf = part.buffer_pool.request_buffer()
    assert buf is not None, "test pool too small"
    buf.segment.put(0, payload)
    buf.set_size(len(payload))
    part.add_buffer(target, buf)


def read_all(view: ResultSubpartitionView) -> Iterator[bytes | object]:
    """Everything readable now: data as bytes, events decoded; every buffer released."""
    while (nb := view.get_next_buffer()) is not None:
        buf = nb.buffer
        try:
            yield buf.to_bytes() if buf.is_buffer else EventSerializer.from_buffer(buf)
        finally:
            buf.release()


def assert_accounted(nbp: NetworkBufferPool) -> None:
    nbp.check_consistency()
    assert nbp.num_available + nbp.num_in_use == nbp.total_segments


@pytest.fixture
def small_nbp() -> Iterator[NetworkBufferPool]:
    pool = NetworkBufferPool(8, 4096)
    try:
        yield pool
        assert_accounted(pool)
        assert pool.is_whole(), f"not whole: {pool.stats()} {pool.local_pools}"
    finally:
        pool.destroy()


# -- (2) a pipelined subpartition is consumed once ------------------------------------------


def test_a_fully_consumed_pipelined_subpartition_cannot_be_opened_again(
    make_partition: PartitionFactory,
) -> None:
    part = make_partition("reopen", PIPELINED, 2)
    push(part, 0, b"zero")
    push(part, 1, b"one")
    part.finish()
    view = part.create_subpartition_view(0, Listener())
    assert list(read_all(view)) == [b"zero", EndOfPartitionEvent.INSTANCE]
    view.release_all_resources()
    with pytest.raises(ConsumerAlreadyAttachedError, match="consumed once"):
        part.create_subpartition_view(0, Listener())
    # ... and so the partition is not released while subpartition 1 is unread
    assert not part.is_released
    other = part.create_subpartition_view(1, Listener())
    assert list(read_all(other)) == [b"one", EndOfPartitionEvent.INSTANCE]
    other.release_all_resources()
    assert part.state is ResultPartitionState.RELEASED
    assert part.failure_cause is None


def test_an_early_view_release_is_a_consumer_failure_not_consumption(
    make_partition: PartitionFactory,
) -> None:
    part = make_partition("early", PIPELINED, 2)
    failures: list[BaseException] = []
    part.add_consumer_failure_listener(failures.append)
    push(part, 0, b"a")
    push(part, 1, b"b")
    part.finish()
    early = part.create_subpartition_view(0, Listener())
    early.release_all_resources()  # left before EndOfPartition
    assert len(failures) == 1 and isinstance(failures[0], PartitionReleasedError)
    with pytest.raises(PartitionError):
        part.create_subpartition_view(0, Listener())
    assert not part.is_released  # subpartition 1 still has its reader to come
    view = part.create_subpartition_view(1, Listener())
    assert list(read_all(view)) == [b"b", EndOfPartitionEvent.INSTANCE]
    view.release_all_resources()
    assert part.is_released  # every subpartition is done (one consumed, one failed)
    assert failures == [failures[0]]  # a normal end is not a failure


# -- (4) backlog ------------------------------------------------------------------------------


def test_backlog_counts_a_finished_tail_buffer(make_partition: PartitionFactory) -> None:
    part = make_partition("backlog", PIPELINED, 1, (1, 8))
    view = part.create_subpartition_view(0, Listener())
    for i in range(3):
        push(part, 0, bytes([i]) * 10)
    assert part.stats().backlog == 3
    assert view.get_availability_and_backlog(1) == (True, 3)
    backlogs = []
    while (nb := view.get_next_buffer()) is not None:
        backlogs.append(nb.buffers_in_backlog)
        nb.buffer.release()
    assert backlogs == [2, 1, 0]
    part.release()


def test_notified_once_when_finished_buffers_appear_not_per_buffer(
    make_partition: PartitionFactory,
) -> None:
    part = make_partition("notify", PIPELINED, 1, (1, 8))
    listener = Listener()
    view = part.create_subpartition_view(0, listener)
    for _ in range(3):
        push(part, 0, b"x")
    assert listener.notifications == 1
    assert len(list(read_all(view))) == 3
    push(part, 0, b"y")
    assert listener.notifications == 2
    part.release()


# -- (5) finish keeps the pool while pipelined data is unread ---------------------------------


def test_finish_keeps_the_pool_of_unread_pipelined_data(small_nbp: NetworkBufferPool) -> None:
    pool = small_nbp.create_buffer_pool(2, 2)
    part = ResultPartition(ResultPartitionID("keep", 0), PIPELINED, 2, pool)
    push(part, 0, b"a")
    push(part, 1, b"b")
    part.finish()
    assert_accounted(small_nbp)
    assert not pool.is_destroyed
    assert small_nbp.num_required == 2
    # the two segments are still held: only 6 of 8 can be promised to anyone else
    with pytest.raises(InsufficientBuffersError):
        small_nbp.create_buffer_pool(7, 7)
    views = [part.create_subpartition_view(i, Listener()) for i in range(2)]
    assert list(read_all(views[0])) == [b"a", EndOfPartitionEvent.INSTANCE]
    views[0].release_all_resources()
    assert_accounted(small_nbp)
    assert not pool.is_destroyed
    assert list(read_all(views[1])) == [b"b", EndOfPartitionEvent.INSTANCE]
    assert_accounted(small_nbp)
    views[1].release_all_resources()
    assert part.is_released and pool.is_destroyed
    assert small_nbp.num_required == 0


def test_a_blocking_partition_gives_its_pool_back_at_finish(
    small_nbp: NetworkBufferPool, tmp_path: Path
) -> None:
    pool = small_nbp.create_buffer_pool(2, 4)
    part = ResultPartition(ResultPartitionID("spill", 0), BLOCKING, 2, pool, spill_dir=tmp_path)
    push(part, 0, b"a")
    part.finish()
    assert pool.is_destroyed  # everything was written out: no segment is held
    assert small_nbp.num_required == 0
    view = part.create_subpartition_view(0, Listener())
    assert list(read_all(view)) == [b"a", EndOfPartitionEvent.INSTANCE]
    view.release_all_resources()
    part.release()


# -- (6) an unfinished blocking partition is a per-channel error ------------------------------


def test_requesting_an_unfinished_blocking_partition_is_a_partition_error(
    make_partition: PartitionFactory, manager: ResultPartitionManager
) -> None:
    part = make_partition("unfinished", BLOCKING, 2)
    with pytest.raises(PartitionNotReadyError, match="not finished") as info:
        manager.create_subpartition_view(part.partition_id, 1, Listener())
    assert isinstance(info.value, PartitionError)
    assert info.value.partition_id == part.partition_id


# -- (1) a failed partition fails every reader, whatever the order of calls -------------------


@pytest.mark.parametrize(
    "calls",
    [
        ["fail"],
        ["finish", "fail"],
        ["fail", "finish"],
        ["fail", "release"],
        ["finish", "fail", "release"],
        ["fail", "fail"],
    ],
)
@pytest.mark.parametrize("ptype", [PIPELINED, BLOCKING])
def test_every_reader_of_a_failed_partition_gets_producer_failed(
    make_partition: PartitionFactory, calls: list[str], ptype: ResultPartitionType
) -> None:
    part = make_partition("failed", ptype, 3)
    for i in range(3):
        push(part, i, b"data")
    views: list[ResultSubpartitionView] = []
    if ptype.is_pipelined:
        views = [part.create_subpartition_view(i, Listener()) for i in range(3)]
    for call in calls:
        if call == "fail":
            part.fail(OSError("task died"))
        elif call == "finish":
            if part.is_released:
                with pytest.raises(PartitionReleasedError):
                    part.finish()
            else:
                part.finish()
                if ptype.is_blocking:
                    views = [part.create_subpartition_view(i, Listener()) for i in range(3)]
        else:
            part.release()
    assert part.state is ResultPartitionState.FAILED
    for view in views:
        # the reader never sees an EndOfPartition: whatever it reads, it ends in the error
        assert EndOfPartitionEvent.INSTANCE not in list(read_all(view))
        assert view.is_released
        assert isinstance(view.failure_cause, ProducerFailedError)
        view.release_all_resources()
    with pytest.raises(ProducerFailedError):
        part.create_subpartition_view(0, Listener())


def test_a_late_reader_of_a_failed_partition_hears_producer_failed(
    make_partition: PartitionFactory, manager: ResultPartitionManager
) -> None:
    part = make_partition("late", PIPELINED, 1)
    part.fail(OSError("boom"))
    with pytest.raises(ProducerFailedError, match="boom"):
        manager.create_subpartition_view(part.partition_id, 0, Listener())


def test_release_then_fail_keeps_the_first_end(make_partition: PartitionFactory) -> None:
    part = make_partition("first-end", PIPELINED, 1)
    view = part.create_subpartition_view(0, Listener())
    part.release()
    part.fail(OSError("later"))  # the partition is gone already: nothing changes
    assert part.state is ResultPartitionState.RELEASED
    assert view.is_released and view.failure_cause is None
    view.release_all_resources()


# -- listeners ------------------------------------------------------------------------------


def test_every_release_listener_is_called_once(make_partition: PartitionFactory) -> None:
    part = make_partition("listeners", PIPELINED, 1)
    calls: list[str] = []
    part.add_release_listener(lambda p: calls.append("a"))
    part.add_release_listener(lambda p: calls.append("b"))
    part.release()
    part.release()
    assert calls == ["a", "b"]


def test_a_failing_release_listener_does_not_starve_the_others(
    make_partition: PartitionFactory,
) -> None:
    part = make_partition("raising", PIPELINED, 1)
    calls: list[str] = []

    def bad(p: ResultPartition) -> None:
        raise RuntimeError("listener bug")

    part.add_release_listener(bad)
    part.add_release_listener(lambda p: calls.append("after"))
    with pytest.raises(RuntimeError, match="listener bug"):
        part.release()
    assert calls == ["after"]
    assert part.is_released and part.buffer_pool.is_destroyed


def test_a_consumer_failure_listener_may_fail_the_partition(
    make_partition: PartitionFactory,
) -> None:
    part = make_partition("cascade", PIPELINED, 2)
    part.add_consumer_failure_listener(lambda cause: part.fail(cause))
    push(part, 1, b"other")
    views = [part.create_subpartition_view(i, Listener()) for i in range(2)]
    views[0].release_all_resources()
    assert part.state is ResultPartitionState.FAILED
    assert list(read_all(views[1])) == []
    assert isinstance(views[1].failure_cause, ProducerFailedError)
    views[1].release_all_resources()


# -- broadcast through add_buffer -------------------------------------------------------------


@pytest.mark.parametrize("ptype", [PIPELINED, BLOCKING])
def test_add_buffer_to_all_subpartitions_shares_one_segment(
    nbp: NetworkBufferPool, make_partition: PartitionFactory, ptype: ResultPartitionType
) -> None:
    part = make_partition("bcast", ptype, 3, (3, 3))
    push(part, 1, b"unicast")
    in_use = part.buffer_pool.num_in_use
    buf = part.buffer_pool.request_buffer()
    assert buf is not None
    buf.segment.put(0, b"everyone")
    buf.set_size(8)
    part.add_buffer(ALL_SUBPARTITIONS, buf)
    if ptype.is_pipelined:
        assert part.buffer_pool.num_in_use == in_use + 1  # one segment for three readers
    stats = part.stats()
    assert stats.buffers_out == 1 + 3 and stats.bytes_out == 7 + 3 * 8
    part.finish()
    views = [part.create_subpartition_view(i, Listener()) for i in range(3)]
    got = [list(read_all(v)) for v in views]
    eop = EndOfPartitionEvent.INSTANCE
    assert got == [[b"everyone", eop], [b"unicast", b"everyone", eop], [b"everyone", eop]]
    for v in views:
        v.release_all_resources()
    if ptype.is_blocking:
        part.release()
    assert part.is_released
    assert_accounted(nbp)


def test_a_broadcast_segment_returns_only_after_every_reader_released_it(
    small_nbp: NetworkBufferPool,
) -> None:
    pool = small_nbp.create_buffer_pool(2, 2)
    part = ResultPartition(ResultPartitionID("refs", 0), PIPELINED, 2, pool)
    views = [part.create_subpartition_view(i, Listener()) for i in range(2)]
    buf = pool.request_buffer()
    assert buf is not None
    buf.set_size(100)
    part.add_buffer(ALL_SUBPARTITIONS, buf)
    first = views[0].get_next_buffer()
    assert first is not None
    segment = first.buffer.segment
    first.buffer.release()
    assert pool.num_in_use == 1  # subpartition 1 still holds it
    second = views[1].get_next_buffer()
    assert second is not None and second.buffer.segment is segment
    second.buffer.release()
    assert pool.num_in_use == 0 and pool.num_available == 1
    part.release()
    for v in views:
        v.release_all_resources()


def test_add_buffer_to_all_refuses_while_a_subpartition_failed(
    make_partition: PartitionFactory, nbp: NetworkBufferPool
) -> None:
    part = make_partition("bcast-fail", PIPELINED, 2)
    view = part.create_subpartition_view(0, Listener())
    view.release_all_resources()  # consumer failure on subpartition 0
    buf = part.buffer_pool.request_buffer()
    assert buf is not None
    with pytest.raises(PartitionReleasedError):
        part.add_buffer(ALL_SUBPARTITIONS, buf)
    assert buf.is_recycled  # taken over even when refused
    part.release()
    assert_accounted(nbp)


@pytest.mark.parametrize("target", [-1, 3, ALL_SUBPARTITIONS - 1])
def test_add_buffer_rejects_other_targets(make_partition: PartitionFactory, target: int) -> None:
    part = make_partition("targets", PIPELINED, 3)
    buf = part.buffer_pool.request_buffer()
    assert buf is not None
    with pytest.raises(SubpartitionIndexError):
        part.add_buffer(target, buf)
    assert buf.is_recycled
    part.release()
