"""Any interleaving of pool operations keeps every segment accounted for exactly once.

A hypothesis state machine drives one NetworkBufferPool through local pool creation and
destruction, buffer requests (held whole, as a slice or through a BufferConsumer),
releases in random order, exclusive batches and BufferListeners that take, decline or ask
for more. After every step it recounts the segments itself (held by the test + queued in
local pools + free globally == total, every index exactly once) and checks the
redistribution arithmetic. After every step that grows pools (a pool destroyed, exclusive
segments returned) no grown pool keeps a listener waiting while it could take a free
segment (issue 8, defect 8). Spare segments (``request_spare_segment``: lent outside any
local pool, never from a pool's share) are taken and recycled too, and the global pool's
running count of what the local pools may still take (``num_owed``, issue 21) equals the
sum over the pools after every step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from fractions import Fraction

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from exchange.buffers import Buffer, BufferConsumer
from exchange.errors import InsufficientBuffersError, PoolDestroyedError, UsageError
from exchange.memory import LocalBufferPool, MemorySegment, NetworkBufferPool, NotificationResult

TOTAL = 24
SEG = 4096


@dataclass
class Held:
    """One segment the test holds: as a Buffer or a read-only slice of one."""

    pool: LocalBufferPool
    segment: MemorySegment
    buffer: Buffer

    def release(self) -> None:
        self.buffer.release()


@dataclass(eq=False)
class MachineListener:
    """take: use one buffer; decline: use none; more: use up to ``budget``, asking for more."""

    machine: PoolMachine
    pool: LocalBufferPool
    mode: str
    budget: int
    registered: bool = True
    offers: int = 0
    destroyed: int = 0
    taken: list[int] = field(default_factory=list)

    def notify_buffer_available(self, buffer: Buffer) -> NotificationResult:
        assert self.registered, "offered a buffer after it was unregistered"
        assert not self.pool.is_destroyed
        self.offers += 1
        if self.mode == "decline":
            self.registered = False
            return NotificationResult.BUFFER_NOT_USED
        assert buffer.ref_count == 1
        self.machine.held.append(Held(self.pool, buffer.segment, buffer=buffer))
        self.taken.append(buffer.segment.index)
        if self.mode == "more" and len(self.taken) < self.budget:
            return NotificationResult.BUFFER_USED_NEED_MORE
        self.registered = False
        return NotificationResult.BUFFER_USED_NO_NEED_MORE

    def notify_buffer_destroyed(self) -> None:
        assert self.registered
        self.registered = False
        self.destroyed += 1


class PoolMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.nbp = NetworkBufferPool(TOTAL, SEG)
        self.live: list[LocalBufferPool] = []
        self.dead: list[LocalBufferPool] = []
        self.held: list[Held] = []
        self.exclusive: list[list[MemorySegment]] = []
        self.spare: list[MemorySegment] = []
        self.listeners: list[MachineListener] = []
        self.last_requested: dict[int, int] = {}
        self.size_before: dict[int, int] = {}

    # -- helpers ---------------------------------------------------------------------------

    def pick_live(self, i: int) -> LocalBufferPool:
        return self.live[i % len(self.live)]

    def held_from(self, pool: LocalBufferPool) -> int:
        return sum(1 for h in self.held if h.pool is pool)

    def sizes(self) -> dict[int, int]:
        return {id(p): p.current_pool_size for p in self.live}

    def check_grown_pools_served_their_listeners(self, before: dict[int, int]) -> None:
        for p in self.live:
            if p.current_pool_size <= before.get(id(p), p.current_pool_size):
                continue
            waiting = p.stats().num_listeners > 0
            could_take = p.num_requested < p.current_pool_size and self.nbp.num_available > 0
            assert not (waiting and could_take), f"{p} grew but left its listeners waiting"

    # -- rules -----------------------------------------------------------------------------

    @rule(
        required=st.integers(0, 6),
        extra=st.one_of(st.integers(0, 12), st.just(1000)),
        overdraft=st.integers(0, 3),
    )
    def create_pool(self, required: int, extra: int, overdraft: int) -> None:
        max_segments = max(required, 1) + extra
        if self.nbp.num_required + required > TOTAL:
            before = [p.current_pool_size for p in self.live]
            with pytest.raises(InsufficientBuffersError) as err:
                self.nbp.create_buffer_pool(required, max_segments)
            assert err.value.required == required
            assert err.value.available == TOTAL - self.nbp.num_required
            assert [p.current_pool_size for p in self.live] == before
            return
        pool = self.nbp.create_buffer_pool(required, max_segments, overdraft)
        assert pool.num_requested == 0
        assert pool.current_pool_size <= max_segments
        self.live.append(pool)
        self.last_requested[id(pool)] = 0

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 1000))
    def destroy_pool(self, i: int) -> None:
        pool = self.pick_live(i)
        registered = [x for x in self.listeners if x.pool is pool and x.registered]
        # As in Flink's lazyDestroy, the pool gives back its queued segments before the
        # redistribution: a waiting pool may take one at its old size, then be shrunk.
        self.size_before = {id(p): p.current_pool_size for p in self.live}
        sizes = self.sizes()
        pool.destroy()
        self.check_grown_pools_served_their_listeners(sizes)
        assert pool.is_destroyed
        assert pool.num_available == 0
        assert all(x.destroyed == 1 and not x.registered for x in registered)
        self.live.remove(pool)
        self.dead.append(pool)
        with pytest.raises(PoolDestroyedError):
            pool.request_buffer()

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 1000), kind=st.sampled_from(["buffer", "slice", "consumer"]))
    def request(self, i: int, kind: str) -> None:
        pool = self.pick_live(i)
        from_queue = pool.num_available > 0
        from_global = (
            not from_queue
            and pool.num_requested < pool.current_pool_size
            and self.nbp.num_available > 0
        )
        global_before = self.nbp.num_available
        buf = pool.request_buffer()
        got = None
        if buf is not None:
            held = buf
            if kind != "buffer":
                buf.segment.put(0, b"abc")
                buf.set_size(3)
            if kind == "slice":  # the slice holds the segment once the buffer is released
                held = buf.read_only_slice(1, 2)
                buf.release()
            elif kind == "consumer":  # queued in a subpartition, then polled
                consumer = BufferConsumer.of_buffer(buf)
                held = consumer.build()
                consumer.close()
                assert held.to_bytes() == b"abc"
            got = Held(pool, held.segment, held)
        assert (got is not None) == (from_queue or from_global)
        if got is not None:
            assert not got.segment.is_freed
            self.held.append(got)
        assert self.nbp.num_available == global_before - (1 if from_global else 0)

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 1000), extra=st.integers(0, 12))
    def set_ceiling(self, i: int, extra: int) -> None:
        """A pool's ceiling moved (an in-place reader's credit lent or taken back): sizes
        follow the formula again; a lowered pool only gives back."""
        pool = self.pick_live(i)
        self.size_before = {id(p): p.current_pool_size for p in self.live}
        sizes = self.sizes()
        self.nbp.set_max_segments(pool, max(pool.num_required, 1) + extra)
        assert pool.max_segments == max(pool.num_required, 1) + extra
        self.check_grown_pools_served_their_listeners(sizes)
        with pytest.raises(UsageError):
            self.nbp.set_max_segments(pool, max(pool.num_required, 1) - 1)

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 1000))
    def request_overdraft(self, i: int) -> None:
        """Overdraft: only from an exhausted pool, up to its limit, from free global
        segments; counted apart from ``num_requested``."""
        pool = self.pick_live(i)
        expect = (
            pool.num_available == 0
            and pool.num_requested >= pool.current_pool_size
            and pool.num_overdraft < pool.max_overdraft_buffers
            and self.nbp.num_available > 0
        )
        requested, global_before = pool.num_requested, self.nbp.num_available
        buf = pool.request_overdraft_buffer()
        assert (buf is not None) == expect
        assert pool.num_requested == requested
        if buf is not None:
            self.held.append(Held(pool, buf.segment, buf))
            assert self.nbp.num_available == global_before - 1
        assert self.nbp.stats().overdraft_segments == sum(p.num_overdraft for p in self.live)

    @precondition(lambda self: self.held)
    @rule(i=st.integers(0, 10_000))
    def release(self, i: int) -> None:
        h = self.held.pop(i % len(self.held))
        pool = h.pool
        stays_local = (
            pool.num_overdraft == 0  # overdraft goes back to the global pool first
            and not pool.is_destroyed
            and pool.num_requested <= pool.current_pool_size
            and pool.stats().num_listeners == 0
        )
        queued_before = pool.num_available
        h.release()
        if stays_local:
            assert pool.num_available == queued_before + 1

    @precondition(lambda self: any(h.buffer is not None for h in self.held))
    @rule(i=st.integers(0, 10_000))
    def replace_by_slice(self, i: int) -> None:
        """Hold a read-only slice instead of the buffer: the slice's release recycles."""
        with_buffer = [h for h in self.held if h.buffer is not None]
        h = with_buffer[i % len(with_buffer)]
        assert h.buffer is not None
        piece = h.buffer.read_only_slice(0, 0)
        h.buffer.release()
        assert piece.ref_count == 1
        h.buffer = piece

    @rule()
    def request_spare(self) -> None:
        """A spare segment only while more are free than the pools may still take."""
        owed = owed_by(self.live)
        global_before = self.nbp.num_available
        seg = self.nbp.request_spare_segment()
        assert (seg is not None) == (global_before > owed)
        if seg is not None:
            self.spare.append(seg)
            assert self.nbp.num_available == global_before - 1

    @precondition(lambda self: self.spare)
    @rule(i=st.integers(0, 1000))
    def recycle_spare(self, i: int) -> None:
        self.nbp.recycle(self.spare.pop(i % len(self.spare)))

    @rule(num=st.integers(1, 8))
    def request_exclusive(self, num: int) -> None:
        required_before = self.nbp.num_required
        if required_before + num > TOTAL:
            with pytest.raises(InsufficientBuffersError):
                self.nbp.request_memory_segments_nowait(num)
            assert self.nbp.num_required == required_before
            return
        try:
            segs = self.nbp.request_memory_segments_nowait(num)
        except InsufficientBuffersError as err:
            assert err.required == num
            assert err.available < num
            assert self.nbp.num_required == required_before
            return
        assert len(segs) == num
        assert self.nbp.num_required == required_before + num
        self.exclusive.append(segs)

    @precondition(lambda self: self.exclusive)
    @rule(i=st.integers(0, 1000))
    def recycle_exclusive(self, i: int) -> None:
        segs = self.exclusive.pop(i % len(self.exclusive))
        required_before = self.nbp.num_required
        sizes = self.sizes()
        self.nbp.recycle_memory_segments(segs)
        assert self.nbp.num_required == required_before - len(segs)
        self.check_grown_pools_served_their_listeners(sizes)

    @precondition(lambda self: self.live)
    @rule(
        i=st.integers(0, 1000),
        mode=st.sampled_from(["take", "decline", "more"]),
        budget=st.integers(1, 3),
    )
    def add_listener(self, i: int, mode: str, budget: int) -> None:
        pool = self.pick_live(i)
        listener = MachineListener(self, pool, mode, budget)
        assert pool.add_buffer_listener(listener)
        self.listeners.append(listener)

    # -- invariants ------------------------------------------------------------------------

    @invariant()
    def every_segment_is_somewhere_exactly_once(self) -> None:
        self.nbp.check_consistency()
        assert self.nbp.num_available + self.nbp.num_in_use == TOTAL
        held = [h.segment.index for h in self.held]
        held += [s.index for segs in self.exclusive for s in segs]
        held += [s.index for s in self.spare]
        assert len(set(held)) == len(held), "a segment was handed out twice"
        # read-only peeks at the queues, to name every segment by index
        queued = [s.index for p in self.live for s in p._available]
        free = [s.index for s in self.nbp._available]
        everywhere = held + queued + free
        assert len(everywhere) == TOTAL
        assert sorted(everywhere) == list(range(TOTAL))
        assert len(held) + sum(p.num_available for p in self.live) + self.nbp.num_available == (
            TOTAL
        )

    @invariant()
    def the_running_owed_count_is_the_sum_over_the_pools(self) -> None:
        assert self.nbp.num_owed == owed_by(self.live)

    @invariant()
    def pools_count_what_they_lent(self) -> None:
        for p in self.live + self.dead:
            assert p.num_requested + p.num_overdraft == self.held_from(p) + p.num_available
            assert p.num_in_use + p.num_overdraft == self.held_from(p)
            assert p.num_overdraft <= p.max_overdraft_buffers
            last = self.last_requested[id(p)]
            if p.is_destroyed:
                assert p.num_available == 0
                assert p.num_requested <= last
            else:
                # it grows only while below its size; shrunk, it only gives back
                held_when_shrunk = max(last, self.size_before.get(id(p), 0))
                assert p.num_requested <= max(p.current_pool_size, held_when_shrunk)
                if p.num_requested > p.current_pool_size:
                    # excess segments are not kept queued: they went back to the global pool
                    assert p.num_available == 0
            self.last_requested[id(p)] = p.num_requested
        self.dead = [p for p in self.dead if p.num_requested + p.num_overdraft > 0]
        self.size_before.clear()

    @invariant()
    def sizes_follow_the_redistribution_formula(self) -> None:
        assert self.nbp.local_pools == self.live
        num_exclusive = sum(len(segs) for segs in self.exclusive)
        assert self.nbp.num_required == num_exclusive + sum(p.num_required for p in self.live)
        assert sum(p.current_pool_size for p in self.live) <= TOTAL - num_exclusive
        spare = TOTAL - self.nbp.num_required
        shares = [p.current_pool_size - p.num_required for p in self.live]
        caps = [min(spare, p.max_segments - p.num_required) for p in self.live]
        assert all(0 <= s <= c for s, c in zip(shares, caps, strict=True))
        expected = 0 if spare == 0 else min(spare, sum(caps))
        assert sum(shares) == expected
        for share, cap in zip(shares, caps, strict=True):
            if expected:
                assert abs(share - Fraction(expected * cap, sum(caps))) < 1

    @invariant()
    def listeners_are_counted(self) -> None:
        for p in self.live:
            mine = [x for x in self.listeners if x.pool is p and x.registered]
            assert p.stats().num_listeners == len(mine)
        for x in self.listeners:
            assert x.destroyed <= 1
            if x.destroyed:
                assert x.pool.is_destroyed
        self.listeners = [x for x in self.listeners if x.registered]

    def teardown(self) -> None:
        # segments coming back may be handed to listeners of other pools: drain until empty
        while self.held or self.exclusive or self.spare or self.live:
            if self.spare:
                self.nbp.recycle(self.spare.pop())
            elif self.held:
                self.held.pop().release()
            elif self.exclusive:
                self.nbp.recycle_memory_segments(self.exclusive.pop())
            else:
                self.live.pop().destroy()
        self.nbp.check_consistency()
        assert self.nbp.num_required == 0
        assert self.nbp.num_available == TOTAL
        assert self.nbp.is_whole()
        assert self.nbp.num_owed == 0
        self.nbp.destroy()


def owed_by(pools: list[LocalBufferPool]) -> int:
    """What ``pools`` may still take from the global pool up to their current sizes."""
    return sum(max(0, p.current_pool_size - p.num_requested) for p in pools)


TestPoolMachine = PoolMachine.TestCase
TestPoolMachine.settings = settings(max_examples=120, stateful_step_count=50, deadline=None)
