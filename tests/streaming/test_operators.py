"""Operators driven by hand through the runtime's call order (open -> process ->
snapshot_state -> crash -> restore from the backends' snapshot bytes -> open -> process)."""

from __future__ import annotations

import operator
import random
from typing import Any

import pytest

from client.streaming.functions import OperatorContext
from client.streaming.operators import (
    FilterOperator,
    FlatMapOperator,
    KeyByOperator,
    KeyedProcessOperator,
    MapOperator,
    ProcessContext,
    RunningReduce,
    RuntimeContext,
)
from exchange.errors import UsageError
from exchange.state import (
    KeyedStateBackend,
    KeyGroupOutOfRangeError,
    OperatorStateBackend,
    key_group_range_for_subtask,
    subtask_for_key,
)

MAX_P = 32


class ListCollector:
    def __init__(self) -> None:
        self.records: list[Any] = []

    def collect(self, record: Any) -> None:
        self.records.append(record)


def keyed_ctx(
    k: int = 0, p: int = 1, restore: list[bytes] | None = None, op_id: str = "proc"
) -> OperatorContext:
    backend = KeyedStateBackend(MAX_P, key_group_range_for_subtask(MAX_P, p, k))
    if restore is not None:
        backend.restore(restore)
    return OperatorContext("job", op_id, k, p, 0, OperatorStateBackend(k, p), backend)


def plain_ctx() -> OperatorContext:
    return OperatorContext("job", "op", 0, 1, 0, OperatorStateBackend())


def test_map_flat_map_filter_key_by_chain() -> None:
    out = ListCollector()
    chain = [
        MapOperator(lambda x: x * 10),
        FlatMapOperator(lambda x: [x, x + 1]),
        FilterOperator(lambda x: x % 20 != 1),
        KeyByOperator(lambda x: x % 3),
    ]
    for op in chain:
        op.open(plain_ctx())

    def push(i: int, record: Any) -> None:
        if i == len(chain):
            out.records.append(record)
            return

        class Next:
            def collect(self, r: Any) -> None:
                push(i + 1, r)

        chain[i].process(record, Next())

    for x in range(4):
        push(0, x)
    assert out.records == [(0, 0), (1, 10), (2, 11), (2, 20), (0, 30), (1, 31)]


@pytest.mark.parametrize("cls", [MapOperator, FlatMapOperator, FilterOperator, KeyByOperator])
def test_not_callable_is_a_usage_error(cls: Any) -> None:
    with pytest.raises(UsageError, match="callable"):
        cls(42)


class Totals:
    """Running total and per-key count of distinct items: a value and a map state."""

    def open(self, rc: RuntimeContext) -> None:
        self.total = rc.value_state("total", 0)
        self.seen = rc.map_state("seen")
        self.closed = False

    def process_element(self, value: Any, ctx: ProcessContext, out: Any) -> None:
        self.total.update(self.total.value() + value["amount"])
        self.seen.put(value["item"], True)
        out.collect((ctx.current_key, self.total.value(), len(self.seen.keys())))

    def close(self) -> None:
        self.closed = True


def events(n: int, seed: int) -> list[tuple[str, dict[str, int]]]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        user = f"u{rng.randrange(7)}"
        out.append((user, {"amount": rng.randrange(1, 10), "item": rng.randrange(4)}))
    return out


def expected_outputs(evs: list[tuple[str, dict[str, int]]]) -> list[tuple[str, int, int]]:
    totals: dict[str, int] = {}
    seen: dict[str, set[int]] = {}
    res = []
    for user, v in evs:
        totals[user] = totals.get(user, 0) + v["amount"]
        seen.setdefault(user, set()).add(v["item"])
        res.append((user, totals[user], len(seen[user])))
    return res


@pytest.mark.parametrize("seed", range(4))
def test_keyed_process_state_survives_a_crash(seed: int) -> None:
    evs = events(300, seed)
    cut = random.Random(seed).randrange(1, len(evs))
    ctx = keyed_ctx()
    op = KeyedProcessOperator(Totals())
    op.open(ctx)
    out = ListCollector()
    for e in evs[:cut]:
        op.process(e, out)
    op.snapshot_state(1)
    assert ctx.keyed_state is not None
    snap = ctx.keyed_state.snapshot()
    for e in evs[cut : cut + 17]:  # processed after the checkpoint, then lost in the crash
        op.process(e, ListCollector())
    del op  # crash: no close

    fn = Totals()
    op2 = KeyedProcessOperator(fn)
    op2.open(keyed_ctx(restore=[snap]))
    for e in evs[cut:]:
        op2.process(e, out)
    op2.close()
    assert fn.closed
    assert out.records == expected_outputs(evs)


def test_keyed_state_follows_its_key_on_rescale() -> None:
    evs = events(400, 9)
    old_p, new_p = 3, 2
    outs = ListCollector()
    ctxs = [keyed_ctx(k, old_p) for k in range(old_p)]
    ops = [KeyedProcessOperator(RunningReduce(operator.add)) for _ in range(old_p)]
    for op, c in zip(ops, ctxs, strict=True):
        op.open(c)
    half = len(evs) // 2
    for user, v in evs[:half]:
        k = subtask_for_key(user, MAX_P, old_p)
        ops[k].process((user, v["amount"]), outs)
    snaps = [c.keyed_state.snapshot() for c in ctxs if c.keyed_state is not None]
    new_ops = []
    for k in range(new_p):
        op = KeyedProcessOperator(RunningReduce(operator.add))
        op.open(keyed_ctx(k, new_p, restore=snaps))
        new_ops.append(op)
    for user, v in evs[half:]:
        new_ops[subtask_for_key(user, MAX_P, new_p)].process((user, v["amount"]), outs)
    totals: dict[str, int] = {}
    want = []
    for user, v in evs:
        totals[user] = totals.get(user, 0) + v["amount"]
        want.append((user, totals[user]))
    assert outs.records == want


def test_a_bare_function_and_current_key() -> None:
    seen: list[Any] = []

    def fn(value: Any, ctx: ProcessContext, out: Any) -> None:
        seen.append(ctx.current_key)
        out.collect(value * 2)

    op = KeyedProcessOperator(fn)
    op.open(keyed_ctx())
    out = ListCollector()
    op.process(("a", 1), out)
    op.process((("t", 2), 5), out)
    assert out.records == [2, 10]
    assert seen == ["a", ("t", 2)]


def test_state_is_scoped_by_operator_id() -> None:
    backend = KeyedStateBackend(MAX_P)
    ctx_a = OperatorContext("job", "a", 0, 1, 0, OperatorStateBackend(), backend)
    ctx_b = OperatorContext("job", "b", 0, 1, 0, OperatorStateBackend(), backend)
    a = KeyedProcessOperator(RunningReduce(operator.add))
    b = KeyedProcessOperator(RunningReduce(lambda x, y: x * y))
    a.open(ctx_a)
    b.open(ctx_b)
    out = ListCollector()
    for v in (2, 3, 4):
        a.process(("k", v), out)
        b.process(("k", v), out)
    assert out.records == [("k", 2), ("k", 2), ("k", 5), ("k", 6), ("k", 9), ("k", 24)]


def test_keyed_misuse_is_a_typed_error() -> None:
    with pytest.raises(UsageError, match="process_element"):
        KeyedProcessOperator(42)  # type: ignore[arg-type]
    op = KeyedProcessOperator(RunningReduce(operator.add))
    with pytest.raises(UsageError, match="before open"):
        op.process(("k", 1), ListCollector())
    with pytest.raises(UsageError, match="key_by"):
        op.open(plain_ctx())
    op.open(keyed_ctx())
    with pytest.raises(UsageError, match=r"\(key, value\) pairs"):
        op.process({"not": "a pair"}, ListCollector())
    with pytest.raises(UsageError, match=r"\(key, value\) pairs"):
        op.process(["k", 1], ListCollector())
    # a key routed to the wrong subtask is caught by the backend
    op2 = KeyedProcessOperator(RunningReduce(operator.add))
    op2.open(keyed_ctx(0, 2))
    wrong = next(f"k{i}" for i in range(100) if subtask_for_key(f"k{i}", MAX_P, 2) == 1)
    with pytest.raises(KeyGroupOutOfRangeError):
        op2.process((wrong, 1), ListCollector())


class _Buffering:
    """Holds values; emits them before the barrier, and the rest at the end of input."""

    def __init__(self) -> None:
        self.held: list[Any] = []

    def process_element(self, value: Any, ctx: ProcessContext, out: Any) -> None:
        self.held.append(value)

    def prepare_snapshot_pre_barrier(self, checkpoint_id: int, out: Any) -> None:
        out.collect(("flushed", checkpoint_id, self.held))
        self.held = []

    def end_input(self, out: Any) -> None:
        out.collect(("end", self.held))


def test_keyed_process_forwards_the_optional_hooks() -> None:
    op = KeyedProcessOperator(_Buffering())
    op.open(keyed_ctx())
    out = ListCollector()
    op.process(("k", 1), out)
    op.process(("k", 2), out)
    op.prepare_snapshot_pre_barrier(4, out)
    op.process(("k", 3), out)
    op.end_input(out)
    assert out.records == [("flushed", 4, [1, 2]), ("end", [3])]
    # a function without the hooks: they do nothing (the Operator defaults)
    bare = KeyedProcessOperator(lambda value, ctx, out: out.collect(value))
    bare.open(keyed_ctx())
    bare.prepare_snapshot_pre_barrier(1, out)
    bare.end_input(out)
    assert len(out.records) == 2
