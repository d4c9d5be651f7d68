"""Overdraft buffers (Flink's ``LocalBufferPool`` overdraft): a pool out of segments may
take up to ``max_overdraft_buffers`` more from the global pool's *free* segments, counted
apart from its own, and gives them back first. Sans I/O."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from exchange.buffers import Buffer
from exchange.errors import PoolDestroyedError, UsageError
from exchange.memory import NetworkBufferPool

SEG = 4096


def exhausted(nbp: NetworkBufferPool, size: int, overdraft: int) -> tuple[Any, list[Buffer]]:
    pool = nbp.create_buffer_pool(size, size, overdraft)
    held = [pool.request_buffer() for _ in range(size)]
    assert all(b is not None for b in held) and pool.request_buffer() is None
    return pool, [b for b in held if b is not None]


def test_overdraft_beyond_an_exhausted_pool_up_to_the_limit() -> None:
    nbp = NetworkBufferPool(16, SEG)
    pool, held = exhausted(nbp, 4, overdraft=2)
    assert not pool.is_available  # the writer may not start a new record
    extra = [pool.request_overdraft_buffer(), pool.request_overdraft_buffer()]
    assert all(b is not None for b in extra)
    assert pool.request_overdraft_buffer() is None  # the limit
    st = pool.stats()
    assert (st.num_requested, st.num_overdraft, st.max_overdraft, st.overdraft_taken) == (
        4,
        2,
        2,
        2,
    )
    # the global pool's invariant holds; overdraft is in use there and counted apart
    nbp.check_consistency()
    g = nbp.stats()
    assert (g.in_use_segments, g.available_segments, g.overdraft_segments) == (6, 10, 2)
    # overdraft goes back first: the first two releases return to the global pool, and the
    # pool keeps its own four (the next release lands in the pool's queue)
    held[0].release()
    assert (nbp.num_available, pool.num_overdraft, pool.num_available) == (11, 1, 0)
    held[1].release()
    assert (nbp.num_available, pool.num_overdraft, pool.num_available) == (12, 0, 0)
    for b in [*extra, *held[2:]]:
        b.release()
    assert (pool.num_requested, pool.num_available, nbp.num_available) == (4, 4, 12)
    pool.destroy()
    nbp.check_consistency()
    assert nbp.is_whole()
    nbp.destroy()


def test_no_overdraft_while_the_pool_has_its_own_or_the_global_pool_has_none() -> None:
    nbp = NetworkBufferPool(6, SEG)
    pool = nbp.create_buffer_pool(2, 2, 5)
    assert pool.request_overdraft_buffer() is None  # it may still take its own
    own = [pool.request_buffer(), pool.request_buffer()]
    other = nbp.create_buffer_pool(4, 4)
    theirs = [other.request_buffer() for _ in range(4)]
    assert nbp.num_available == 0
    # never at the expense of another pool's share: only free global segments
    assert pool.request_overdraft_buffer() is None
    assert pool.stats().overdraft_taken == 0
    theirs[0].release()  # type: ignore[union-attr]  # back into ``other``'s own queue
    assert pool.request_overdraft_buffer() is None
    for b in [*own, *theirs[1:]]:
        assert b is not None
        b.release()
    other.destroy()
    pool.destroy()
    assert nbp.is_whole()
    nbp.destroy()


def test_zero_overdraft_by_default_and_bad_limits_refused() -> None:
    nbp = NetworkBufferPool(8, SEG)
    pool, held = exhausted(nbp, 2, overdraft=0)
    assert pool.request_overdraft_buffer() is None
    for bad in (-1, 1.5, True, "5"):
        with pytest.raises(UsageError, match="max_overdraft_buffers"):
            nbp.create_buffer_pool(1, 1, bad)  # type: ignore[arg-type]
    assert nbp.num_required == 2  # a refused pool reserved nothing
    for b in held:
        b.release()
    pool.destroy()
    assert nbp.is_whole()
    nbp.destroy()


def test_destroyed_pool_takes_no_overdraft_and_gets_its_overdraft_back() -> None:
    nbp = NetworkBufferPool(8, SEG)
    pool, held = exhausted(nbp, 2, overdraft=3)
    extra = pool.request_overdraft_buffer()
    assert extra is not None
    pool.destroy()
    with pytest.raises(PoolDestroyedError):
        pool.request_overdraft_buffer()
    for b in [extra, *held]:
        b.release()
    nbp.check_consistency()
    assert nbp.is_whole() and pool.num_overdraft == 0 and pool.num_requested == 0
    nbp.destroy()


def test_session_grants_overdraft_credit_to_a_task_mid_record(
    make_partition: Callable[..., Any],
) -> None:
    """ProducerSession.request_overdraft: a task out of credit in the middle of a record
    gets overdraft segments as credit at once (AddProducerCredit), at most the pool's
    limit, and they land pushes like any credit."""
    from exchange.buffers.buffer import DataType
    from exchange.local import ProducerSession
    from exchange.partition import ResultPartitionType
    from exchange.protocol.local_messages import AddProducerCredit
    from exchange.protocol.messages import Message

    part = make_partition("p", ResultPartitionType.PIPELINED, 1, pool_size=(2, 2))
    part.buffer_pool.max_overdraft_buffers = 2
    sent: list[Message] = []
    s = ProducerSession(part, sent.append, max_credit=8)
    assert s.start() == 2
    for i in range(2):
        s.on_push(0, DataType.DATA_BUFFER, memoryview(bytes([i]) * 10))
    assert s.credit_outstanding == 0 and sent == []  # backpressured: no consumer reads
    assert s.request_overdraft(5) == 2  # capped by the pool's overdraft limit
    assert [m for m in sent if isinstance(m, AddProducerCredit)] == [AddProducerCredit(2)]
    assert s.request_overdraft(1) == 0  # used up
    for i in range(2):
        s.on_push(0, DataType.DATA_BUFFER, memoryview(bytes([i]) * 10))
    assert part.buffer_pool.num_overdraft == 2 and s.overdraft_granted == 2
    assert part.subpartitions[0].buffers_in_backlog == 4
    part.release()  # the leak check of ``nbp`` sees every segment back, overdraft first
    assert part.buffer_pool.num_overdraft == 0


def test_session_overdraft_only_beyond_credit_in_flight_and_the_pools_own(
    make_partition: Callable[..., Any],
) -> None:
    """A task that asks for overdraft gets the credit already on its way and the pool's
    own segments first, overdraft only for the rest (Flink takes overdraft only from a
    pool with none of its own): a grant that crossed the request covers it (nothing
    taken), and reserved segments waiting for their batch go out with the overdraft in
    one grant."""
    from exchange.buffers.buffer import DataType
    from exchange.local import ProducerSession
    from exchange.partition import ResultPartitionType
    from exchange.protocol.local_messages import AddProducerCredit
    from exchange.protocol.messages import Message

    part = make_partition("p", ResultPartitionType.PIPELINED, 1, pool_size=(4, 4))
    part.buffer_pool.max_overdraft_buffers = 2
    sent: list[Message] = []
    pending: list[Callable[[], None]] = []  # the loop's call_soon, run by hand below
    s = ProducerSession(part, sent.append, max_credit=2, schedule=pending.append)
    assert s.start() == 2
    # the task's request crossed that grant: the credit in flight covers it
    assert s.request_overdraft(2) == 0
    assert sent == [] and part.buffer_pool.num_overdraft == 0
    for i in range(2):
        s.on_push(0, DataType.DATA_BUFFER, memoryview(bytes([i]) * 10))
    # the pool's 2 other segments are reserved, their grant due after this callback
    assert s.credit_outstanding == 0 and s.num_reserved == 2 and sent == [] and pending
    assert s.request_overdraft(3) == 1  # 2 of the pool's own, 1 overdraft
    assert sent == [AddProducerCredit(3)]
    assert part.buffer_pool.num_overdraft == 1 and s.overdraft_granted == 1
    for run in pending:
        run()
    assert sent == [AddProducerCredit(3)] and s.credit_outstanding == 3
    for i in range(3):
        s.on_push(0, DataType.DATA_BUFFER, memoryview(bytes([i]) * 10))
    assert part.subpartitions[0].buffers_in_backlog == 5
    part.release()
    assert part.buffer_pool.num_overdraft == 0
