"""Random interleavings on N channels against a reference model of what each handler owes.

Upstream is simulated as a producer would behave: after sending an aligned barrier a
channel sends nothing until ``resume`` (the subpartition is blocked), so a missing resume
shows up as a stalled channel and a duplicate one as a resume of an unblocked channel.
Buffers come from a real NetworkBufferPool, which must be whole afterwards; spill
directories must be empty.
"""

from __future__ import annotations

import shutil
import tempfile
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from exchange.checkpointing import (
    AlignedBarrierHandler,
    AlignmentStrategy,
    BufferSpiller,
    CachedBufferBlocker,
    CheckpointBarrierHandler,
    CheckpointBarrierTracker,
    CheckpointFailureReason,
)
from exchange.memory import NetworkBufferPool
from tests.checkpointing.conftest import REC, FakeClock, Task, barrier, cancel, data, eop


@dataclass(frozen=True)
class Rec:
    rid: int
    size: int


@dataclass(frozen=True)
class Bar:
    cid: int
    aligned: bool


@dataclass(frozen=True)
class Cancel:
    cid: int


@dataclass(frozen=True)
class Eop:
    pass


Item = Rec | Bar | Cancel | Eop


@dataclass(frozen=True)
class Scenario:
    scripts: list[list[Item]]
    choices: list[int]
    limit: int | None

    @property
    def n(self) -> int:
        return len(self.scripts)


@st.composite
def scenarios(draw: st.DrawFn, unaligned: bool = False, with_limit: bool = True) -> Scenario:
    n = draw(st.integers(1, 4))
    k = draw(st.integers(0, 5))
    rid = 0
    scripts: list[list[Item]] = []
    for _ in range(n):
        items: list[Item] = []
        for cid in range(1, k + 2):
            for _ in range(draw(st.integers(0, 3))):
                items.append(Rec(rid, draw(st.integers(0, 40))))
                rid += 1
            if cid > k:
                break
            action = draw(st.sampled_from(["barrier"] * 5 + ["cancel", "skip"]))
            if action == "barrier":
                items.append(Bar(cid, draw(st.booleans()) if unaligned else True))
            elif action == "cancel":
                items.append(Cancel(cid))
        items.append(Eop())
        scripts.append(items)
    choices = draw(st.lists(st.integers(0, 2**16), max_size=120))
    limit = draw(st.sampled_from([None, None, 30, 90])) if with_limit else None
    return Scenario(scripts, choices, limit)


HandlerFactory = Callable[[Scenario, Task, FakeClock, Callable[[int], None], Path], Any]


def run(
    sc: Scenario, factory: HandlerFactory, upstream_blocks: bool = True
) -> tuple[list[tuple[Any, ...]], int]:
    """Drive one scenario; return the task's log and the number of aligned barriers sent.

    ``upstream_blocks=False`` models inputs that cannot be blocked upstream: channels run
    ahead past their barriers, so parked input holds barriers of later checkpoints.
    """
    pool = NetworkBufferPool(128, 4096)
    spill_dir = Path(tempfile.mkdtemp(prefix="barrier-prop-"))
    task, clock = Task(), FakeClock()
    blocked: set[int] = set()

    def resume(ch: int) -> None:
        assert ch in blocked or not upstream_blocks, f"resume of unblocked channel {ch}"
        blocked.discard(ch)
        task.resume(ch)

    try:
        handler: CheckpointBarrierHandler = factory(sc, task, clock, resume, spill_dir)
        queues = [deque(s) for s in sc.scripts]
        aligned_sent = 0
        step = 0
        while True:
            out = handler.poll_next()
            if out is not None:
                task.deliver(out)
                continue
            eligible = [c for c in range(sc.n) if queues[c] and c not in blocked]
            if not eligible:
                break
            pick = sc.choices[step] if step < len(sc.choices) else 0
            step += 1
            clock.advance(0.001)
            c = eligible[pick % len(eligible)]
            item = queues[c].popleft()
            match item:
                case Rec(rid=rid, size=size):
                    boe = data(c, REC.pack(rid) + bytes(size), pool)
                case Bar(cid=cid, aligned=aligned):
                    boe = barrier(c, cid, aligned)
                    if aligned and upstream_blocks:
                        blocked.add(c)  # the producer blocks the subpartition
                    aligned_sent += aligned
                case Cancel(cid=cid):
                    boe = cancel(c, cid)
                case Eop():
                    boe = eop(c)
            out = handler.process(boe)
            if out is not None:
                task.deliver(out)
        assert all(not q for q in queues), f"stalled channels (missing resume): {queues}"
        assert not blocked
        assert handler.is_empty()
        handler.close()
        pool.check_consistency()
        assert pool.is_whole(), pool.stats()
        assert list(spill_dir.iterdir()) == []
        return task.log, aligned_sent
    finally:
        pool.destroy()
        shutil.rmtree(spill_dir, ignore_errors=True)


def check(sc: Scenario, log: list[tuple[Any, ...]], aligned_sent: int, exactly_once: bool) -> None:
    """The reference model: what every handler owes the task."""
    rids = {c: [i.rid for i in s if isinstance(i, Rec)] for c, s in enumerate(sc.scripts)}
    delivered = [(e[1], REC.unpack(e[2][:4])[0]) for e in log if e[0] == "rec"]
    # nothing lost or duplicated, every channel in order
    for c in range(sc.n):
        assert [r for ch, r in delivered if ch == c] == rids[c]
    assert len(delivered) == sum(len(r) for r in rids.values())
    assert [e[1] for e in log if e[0] == "eop"] != [] or sc.n == 0
    assert sorted(e[1] for e in log if e[0] == "eop") == list(range(sc.n))
    # every aligned barrier got exactly one resume (duplicates fail inside run)
    assert sum(1 for e in log if e[0] == "resume") == aligned_sent
    # each checkpoint ends once; triggers in increasing order
    ends = [e[1] for e in log if e[0] in ("trigger", "abort")]
    assert len(ends) == len(set(ends))
    triggers = [e[1] for e in log if e[0] == "trigger"]
    assert triggers == sorted(triggers)
    # the trigger sits exactly between the records before and after the barriers
    for pos, entry in enumerate(log):
        if entry[0] != "trigger":
            continue
        cid = entry[1]
        before = {REC.unpack(e[2][:4])[0] for e in log[:pos] if e[0] == "rec"}
        for script in sc.scripts:
            idx = next(
                (i for i, it in enumerate(script) if isinstance(it, Bar) and it.cid == cid), None
            )
            if idx is None:  # the channel must have ended before the checkpoint triggered
                assert {it.rid for it in script if isinstance(it, Rec)} <= before
                continue
            bar = script[idx]
            assert isinstance(bar, Bar)
            pre = {it.rid for it in script[:idx] if isinstance(it, Rec)}
            post = {it.rid for it in script[idx:] if isinstance(it, Rec)}
            assert pre <= before, f"checkpoint {cid} triggered before pre-barrier records"
            if exactly_once and bar.aligned:
                assert not post & before, f"post-barrier record before trigger {cid}"
    # liveness: a checkpoint whose barrier every channel sent always triggers, for the
    # aligned handler if those barriers are aligned and there is no limit (no channel gets
    # past its barrier first), for the tracker if no marker cancels newer ones (subsuming)
    if exactly_once:
        live = sc.limit is None
    else:
        live = not any(isinstance(i, Cancel) for s in sc.scripts for i in s)
    for cid in {i.cid for s in sc.scripts for i in s if isinstance(i, Bar)} if live else ():
        bars = [next((i for i in s if isinstance(i, Bar) and i.cid == cid), None) for s in
                sc.scripts]  # fmt: skip
        if all(b is not None and (b.aligned or not exactly_once) for b in bars):
            assert cid in triggers, f"checkpoint {cid} with every barrier did not trigger"


def tracker(sc: Scenario, task: Task, clock: FakeClock, resume: Any, _: Path) -> Any:
    return CheckpointBarrierTracker(sc.n, task, clock, resume)


def blocking(sc: Scenario, task: Task, clock: FakeClock, resume: Any, _: Path) -> Any:
    return AlignedBarrierHandler(sc.n, task, clock, resume, max_aligned_bytes=sc.limit)


def cached(sc: Scenario, task: Task, clock: FakeClock, resume: Any, _: Path) -> Any:
    return AlignedBarrierHandler(
        sc.n,
        task,
        clock,
        resume,
        strategy=AlignmentStrategy.PARKING,
        blocker=CachedBufferBlocker(),
        max_aligned_bytes=sc.limit,
    )


def spilled(sc: Scenario, task: Task, clock: FakeClock, resume: Any, d: Path) -> Any:
    return AlignedBarrierHandler(
        sc.n,
        task,
        clock,
        resume,
        strategy=AlignmentStrategy.PARKING,
        blocker=BufferSpiller(d, 4096),
        max_aligned_bytes=sc.limit,
    )


PROPS = settings(max_examples=150, deadline=None)


@PROPS
@given(scenarios(unaligned=True, with_limit=False))
def test_tracker_is_at_least_once(sc: Scenario) -> None:
    log, aligned = run(sc, tracker)
    check(sc, log, aligned, exactly_once=False)


@PROPS
@given(scenarios())
def test_blocking_upstream_is_exactly_once(sc: Scenario) -> None:
    log, aligned = run(sc, blocking)
    check(sc, log, aligned, exactly_once=True)


@PROPS
@given(scenarios())
def test_parking_is_exactly_once_and_spilling_changes_nothing(sc: Scenario) -> None:
    log, aligned = run(sc, cached)
    check(sc, log, aligned, exactly_once=True)
    assert run(sc, spilled) == (log, aligned)


@PROPS
@given(scenarios())
def test_parking_input_that_runs_ahead_replays_in_order(sc: Scenario) -> None:
    """Channels not blocked upstream park barriers of later checkpoints: nested replay."""
    log, aligned = run(sc, cached, upstream_blocks=False)
    check(sc, log, aligned, exactly_once=True)
    assert run(sc, spilled, upstream_blocks=False) == (log, aligned)


@PROPS
@given(scenarios(unaligned=True))
def test_mixed_aligned_and_at_least_once_barriers(sc: Scenario) -> None:
    for factory in (blocking, cached):
        log, aligned = run(sc, factory)
        check(sc, log, aligned, exactly_once=True)


def test_reasons_are_distinct() -> None:
    assert len({r.value for r in CheckpointFailureReason}) == len(CheckpointFailureReason)
