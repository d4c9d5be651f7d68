"""The stateless and keyed operators of a dataflow: map, flat_map, filter, key_by, process.

``KeyedProcessOperator`` is Flink's ``KeyedProcessFunction`` for Python users::

    class RunningTotals:
        def open(self, rc):                       # a RuntimeContext
            self.total = rc.value_state("total", 0)

        def process_element(self, value, ctx, out):
            self.total.update(self.total.value() + value["amount"])
            out.collect((ctx.current_key, self.total.value()))

**Records of a keyed operator are ``(key, value)`` pairs**, as ``KeyByOperator`` emits them
(the keyed exchange routes a pair by ``pair[0]``). The operator sets the keyed backend's
current key to ``pair[0]`` itself before calling ``process_element(pair[1], ...)``, so it is
correct whether or not the runtime already did; its state handles (taken once, in ``open``)
then read and write that key's entries. State names are scoped by the operator's
``operator_id``, so two keyed operators chained in one task never share state. Timers are
not supported.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, Final, Protocol

from client.streaming.functions import Collector, Operator, OperatorContext
from exchange.errors import UsageError
from exchange.state import KeyedStateBackend, MapState, ValueState

__all__ = [
    "FilterOperator",
    "FlatMapOperator",
    "KeyByOperator",
    "KeyedProcessFunction",
    "KeyedProcessOperator",
    "MapOperator",
    "ProcessContext",
    "RunningReduce",
    "RuntimeContext",
]


class MapOperator(Operator):
    """One output record per input record: ``fn(record)``."""

    def __init__(self, fn: Callable[[Any], Any]) -> None:
        _check_callable(fn, "map")
        self.fn = fn

    def process(self, record: Any, out: Collector) -> None:
        out.collect(self.fn(record))


class FlatMapOperator(Operator):
    """Zero or more output records per input record: every item of ``fn(record)``."""

    def __init__(self, fn: Callable[[Any], Iterable[Any]]) -> None:
        _check_callable(fn, "flat_map")
        self.fn = fn

    def process(self, record: Any, out: Collector) -> None:
        for item in self.fn(record):
            out.collect(item)


class FilterOperator(Operator):
    """The input records for which ``fn(record)`` is true."""

    def __init__(self, fn: Callable[[Any], Any]) -> None:
        _check_callable(fn, "filter")
        self.fn = fn

    def process(self, record: Any, out: Collector) -> None:
        if self.fn(record):
            out.collect(record)


class KeyByOperator(Operator):
    """``(key_fn(record), record)``: the pairs a keyed exchange routes by their first item."""

    def __init__(self, key_fn: Callable[[Any], Any]) -> None:
        _check_callable(key_fn, "key_by")
        self.key_fn = key_fn

    def process(self, record: Any, out: Collector) -> None:
        out.collect((self.key_fn(record), record))


class RuntimeContext:
    """What a keyed process function gets in ``open``: keyed state of the operator.

    A handle taken here is bound to whatever key is current when it is used, so take handles
    once in ``open`` and use them in ``process_element``.
    """

    def __init__(self, ctx: OperatorContext, backend: KeyedStateBackend) -> None:
        self.operator_context = ctx
        self._backend = backend

    @property
    def subtask_index(self) -> int:
        return self.operator_context.subtask_index

    @property
    def parallelism(self) -> int:
        return self.operator_context.parallelism

    def value_state(self, name: str, default: Any = None) -> ValueState[Any]:
        """The ValueState ``name`` (``default`` for a key with no value)."""
        return self._backend.value_state(self.operator_context.operator_id, name, default)

    def map_state(self, name: str) -> MapState[Any, Any]:
        """The MapState ``name``."""
        return self._backend.map_state(self.operator_context.operator_id, name)


class ProcessContext:
    """What ``process_element`` gets as ``ctx``: the current key."""

    __slots__ = ("_backend",)

    def __init__(self, backend: KeyedStateBackend) -> None:
        self._backend = backend

    @property
    def current_key(self) -> Any:
        return self._backend.current_key


class KeyedProcessFunction(Protocol):
    """The shape of a keyed process function (``open`` and ``close`` are optional)."""

    def process_element(self, value: Any, ctx: ProcessContext, out: Collector) -> None: ...


class _FunctionAdapter:
    """A bare ``fn(value, ctx, out)`` as a keyed process function."""

    def __init__(self, fn: Callable[[Any, ProcessContext, Collector], None]) -> None:
        self.process_element = fn


class KeyedProcessOperator(Operator):
    """Runs a keyed process function (an object with ``process_element(value, ctx, out)`` and
    optionally ``open(runtime_context)``, ``end_input(out)``,
    ``prepare_snapshot_pre_barrier(checkpoint_id, out)`` and ``close()``, or a bare
    function ``fn(value, ctx, out)``) on ``(key, value)`` records. The optional hooks are
    not called for a key (state handles would see whichever key was current last): a
    function emits there what it holds back in memory."""

    def __init__(self, fn_or_obj: KeyedProcessFunction | Callable[..., None]) -> None:
        if callable(getattr(fn_or_obj, "process_element", None)):
            self.function: Any = fn_or_obj
        elif callable(fn_or_obj):
            self.function = _FunctionAdapter(fn_or_obj)
        else:
            raise UsageError(
                "process needs an object with a process_element(value, ctx, out) method or "
                f"a function (value, ctx, out), got {type(fn_or_obj).__name__}"
            )
        self._backend: KeyedStateBackend | None = None
        self._pctx: ProcessContext | None = None

    def open(self, ctx: OperatorContext) -> None:
        super().open(ctx)
        if ctx.keyed_state is None:
            raise UsageError(
                f"operator {ctx.operator_id!r} is a keyed process operator: it must follow a "
                "key_by (its context has no keyed state)"
            )
        self._backend = ctx.keyed_state
        self._pctx = ProcessContext(ctx.keyed_state)
        opener = getattr(self.function, "open", None)
        if callable(opener):
            opener(RuntimeContext(ctx, ctx.keyed_state))

    def process(self, record: Any, out: Collector) -> None:
        backend, pctx = self._backend, self._pctx
        if backend is None or pctx is None:
            raise UsageError("process called before open")
        if type(record) is not tuple or len(record) != 2:
            raise UsageError(
                f"a keyed process operator takes (key, value) pairs from key_by, got "
                f"{type(record).__name__} {record!r:.80}"
            )
        backend.set_current_key(record[0])
        self.function.process_element(record[1], pctx, out)

    def end_input(self, out: Collector) -> None:
        hook = getattr(self.function, "end_input", None)
        if callable(hook):
            hook(out)

    def prepare_snapshot_pre_barrier(self, checkpoint_id: int, out: Collector) -> None:
        hook = getattr(self.function, "prepare_snapshot_pre_barrier", None)
        if callable(hook):
            hook(checkpoint_id, out)

    def close(self) -> None:
        hook = getattr(self.function, "close", None)
        if callable(hook):
            hook()


_ABSENT: Final[Any] = object()


class RunningReduce:
    """A keyed process function emitting ``(key, running value)`` for every input value:
    the first value of a key as is, then ``fn(previous, value)`` (running totals with
    ``RunningReduce(operator.add)``). The running value is keyed state, so it survives a
    restart and follows its key when the parallelism changes."""

    def __init__(self, fn: Callable[[Any, Any], Any], state_name: str = "running") -> None:
        _check_callable(fn, "RunningReduce")
        self.fn = fn
        self.state_name = state_name
        self._state: ValueState[Any] | None = None

    def open(self, rc: RuntimeContext) -> None:
        self._state = rc.value_state(self.state_name, _ABSENT)

    def process_element(self, value: Any, ctx: ProcessContext, out: Collector) -> None:
        state = self._state
        if state is None:
            raise UsageError("RunningReduce used before open")
        previous = state.value()
        current = value if previous is _ABSENT else self.fn(previous, value)
        state.update(current)
        out.collect((ctx.current_key, current))


def _check_callable(fn: object, what: str) -> None:
    if not callable(fn):
        raise UsageError(f"{what} needs a callable, got {type(fn).__name__}")
