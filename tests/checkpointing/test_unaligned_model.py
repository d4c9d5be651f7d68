"""The unaligned handler against a reference model of the cut (FLIP-76's rule).

For every checkpoint whose channel state completed at this input, the cut is, per
channel, the position of its barrier (or its EndOfPartition). Each record before the cut
was processed before the trigger (so it is in the operator state) or was persisted as
channel state of that checkpoint, never both, never neither; each record after the cut
was processed after the trigger and never persisted. Random interleavings of data,
barriers, cancellation markers and EndOfPartition over 1-4 channels, random clock jumps
and polls (so aligned-first checkpoints time out at random points), upstream simulated as
a producer behaves: after an exactly-once barrier a channel sends nothing until resumed.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from exchange.checkpointing import (
    CheckpointingMode,
    UnalignedBarrierHandler,
    create_barrier_handler,
)
from exchange.events.events import CheckpointBarrier, CheckpointOptions
from exchange.memory import NetworkBufferPool
from tests.checkpointing.conftest import REC, FakeClock, barrier, cancel, data, eop, event
from tests.checkpointing.test_barrier_properties import Bar, Cancel, Eop, Rec, Scenario, scenarios
from tests.checkpointing.test_unaligned import UTask


@dataclass(frozen=True)
class Run:
    log: list[tuple[Any, ...]]
    aligned_sent: int


def delivery(sc: Scenario, prio: list[int]) -> list[list[tuple[Any, tuple[int, ...], bool]]]:
    """Each channel's items as its gate returns them: (item, overtaken_by, priority).

    ``prio`` decides barrier by barrier (in channel order): 0 an ordinary barrier, k > 0 a
    priority (unaligned) barrier that overtook the k - 1 records queued right before it
    (as the producer's subpartition and the consumer's channel reorder them: the barrier
    first, then those records, flagged with its checkpoint)."""
    choices = iter(prio)
    out = []
    for script in sc.scripts:
        q: list[tuple[Any, tuple[int, ...], bool]] = []
        for item in script:
            if isinstance(item, Bar) and item.aligned and (k := next(choices, 0)) > 0:
                at = len(q)
                while at > 0 and len(q) - at < k - 1 and isinstance(q[at - 1][0], Rec):
                    at -= 1
                overtaken = [(r, (*flags, item.cid), False) for r, flags, _ in q[at:]]
                q[at:] = [(item, (), True), *overtaken]
            else:
                q.append((item, (), False))
        out.append(q)
    return out


def drive(sc: Scenario, timeout: float | None, jumps: list[int], prio: list[int] = ()) -> Run:  # type: ignore[assignment]
    pool = NetworkBufferPool(128, 4096)
    task, clock = UTask(), FakeClock()
    blocked: set[int] = set()

    def resume(ch: int) -> None:
        assert ch in blocked, f"resume of unblocked channel {ch}"
        blocked.discard(ch)
        task.resume(ch)

    try:
        h = create_barrier_handler(
            CheckpointingMode.UNALIGNED,
            sc.n,
            task,
            clock,
            resume,
            aligned_checkpoint_timeout=timeout,
        )
        assert isinstance(h, UnalignedBarrierHandler)
        queues = [deque(s) for s in delivery(sc, list(prio))]
        aligned_sent = step = 0
        while True:
            jump = jumps[step % len(jumps)] if jumps else 0
            clock.advance(0.001 * jump)
            if jump % 3 == 0:
                assert h.poll_next() is None  # a caller woken by next_deadline()
            eligible = [c for c in range(sc.n) if queues[c] and c not in blocked]
            if not eligible:
                deadline = h.next_deadline()
                if deadline is None:
                    break
                clock.now = max(clock.now, deadline)  # the caller waits for the deadline
                assert h.poll_next() is None
                continue
            pick = sc.choices[step] if step < len(sc.choices) else 0
            step += 1
            c = eligible[pick % len(eligible)]
            item, flags, priority = queues[c].popleft()
            match item:
                case Rec(rid=rid, size=size):
                    boe = data(c, REC.pack(rid) + bytes(size), pool)._replace(overtaken_by=flags)
                case Bar(cid=cid, aligned=aligned) if priority:
                    opts = CheckpointOptions(exactly_once=True, unaligned=True)
                    boe = event(c, CheckpointBarrier(cid, 1000 + cid, opts))
                case Bar(cid=cid, aligned=aligned):
                    boe = barrier(c, cid, aligned)
                    if aligned:
                        blocked.add(c)
                    aligned_sent += aligned
                case Cancel(cid=cid):
                    boe = cancel(c, cid)
                case Eop():
                    boe = eop(c)
            out = h.process(boe)
            if out is not None:
                task.deliver(out)
        assert all(not q for q in queues), f"stalled channels: {queues}"
        assert not blocked
        h.close()
        pool.check_consistency()
        assert pool.is_whole(), pool.stats()
        return Run(task.log, aligned_sent)
    finally:
        pool.destroy()


def rid_of(payload: bytes) -> int:
    return int(REC.unpack(payload[:4])[0])


def check(sc: Scenario, run: Run, aligned_first: bool) -> None:
    log = run.log
    rids = {c: [i.rid for i in s if isinstance(i, Rec)] for c, s in enumerate(sc.scripts)}
    delivered = [(e[1], rid_of(e[2])) for e in log if e[0] == "rec"]
    for c in range(sc.n):  # nothing lost or duplicated, each channel in order
        assert [r for ch, r in delivered if ch == c] == rids[c]
    assert sum(1 for e in log if e[0] == "resume") == run.aligned_sent
    for kind in ("trigger", "abort", "done"):
        ids = [e[1] for e in log if e[0] == kind]
        assert len(ids) == len(set(ids)), f"{kind} twice: {ids}"
    triggers = [e[1] for e in log if e[0] == "trigger"]
    assert triggers == sorted(triggers)
    aborted = {e[1] for e in log if e[0] == "abort"}
    done = {e[1] for e in log if e[0] == "done"}
    assert not aborted & done
    # every channel ended, so every triggered checkpoint completed or was aborted
    assert set(triggers) == (done | (aborted & set(triggers)))
    for cid in done:
        t = log.index(("trigger", cid))
        d = log.index(("done", cid))
        assert t < d
        in_state = {rid_of(e[2]) for e in log[:t] if e[0] == "rec"}
        persisted = [(e[2], rid_of(e[3])) for e in log if e[0] == "persist" and e[1] == cid]
        persisted_ids = {r for _, r in persisted}
        assert len(persisted_ids) == len(persisted), "a record persisted twice"
        for c, script in enumerate(sc.scripts):
            cut = next(
                i
                for i, it in enumerate(script)
                if (isinstance(it, Bar) and it.cid == cid) or isinstance(it, Eop)
            )
            pre = [it.rid for it in script[:cut] if isinstance(it, Rec)]
            post = {it.rid for it in script[cut:] if isinstance(it, Rec)}
            for r in pre:  # before the cut: in the state XOR in the channel state
                assert (r in in_state) != (r in persisted_ids), (cid, c, r)
            bar = script[cut]
            # an at-least-once-type barrier blocks nothing upstream: during an aligned
            # phase what follows it may be processed before the trigger (as in the aligned
            # handler); unaligned from the first barrier nothing is ever processed early
            if isinstance(bar, Eop) or bar.aligned or not aligned_first:
                assert not post & in_state, f"checkpoint {cid}: post-cut records in its state"
            assert not post & persisted_ids, f"checkpoint {cid}: post-cut records persisted"
            # replay order: the channel's persisted records in the channel's order
            assert [r for ch, r in persisted if ch == c] == [r for r in pre if r in persisted_ids]
        # every persist of the checkpoint came between its trigger and its completion
        pos = [i for i, e in enumerate(log) if e[0] == "persist" and e[1] == cid]
        assert all(t < i < d for i in pos)


TIMEOUTS = st.sampled_from([None, 0.0, 0.002, 0.01, 0.05, 1000.0])


@settings(max_examples=400, deadline=None)
@given(
    scenarios(unaligned=True, with_limit=False), TIMEOUTS, st.lists(st.integers(0, 12), max_size=40)
)
def test_unaligned_handler_matches_the_cut_model(
    sc: Scenario, timeout: float | None, jumps: list[int]
) -> None:
    check(sc, drive(sc, timeout, jumps), aligned_first=bool(timeout))


@settings(max_examples=150, deadline=None)
@given(scenarios(unaligned=False, with_limit=False), st.lists(st.integers(0, 12), max_size=40))
def test_pure_unaligned_with_exactly_once_barriers(sc: Scenario, jumps: list[int]) -> None:
    """Unaligned from the first barrier, exactly-once barriers: the cut is exact on every
    channel, and each barrier is resumed as soon as it is processed (nothing waits for
    another channel's barrier: ``drive`` would find stalled channels otherwise)."""
    check(sc, drive(sc, None, jumps), aligned_first=False)


@settings(max_examples=300, deadline=None)
@given(
    scenarios(unaligned=False, with_limit=False),
    TIMEOUTS,
    st.lists(st.integers(0, 12), max_size=40),
    st.lists(st.integers(0, 4), max_size=30),
)
def test_priority_barriers_and_overtaken_buffers_match_the_cut_model(
    sc: Scenario, timeout: float | None, jumps: list[int], prio: list[int]
) -> None:
    """Priority barriers (the producer side's): a barrier arrives ahead of up to three
    records queued before it, which follow it flagged ``overtaken_by``; the cut is still
    the barrier's place in what the producer sent."""
    check(sc, drive(sc, timeout, jumps, prio), aligned_first=bool(timeout))
