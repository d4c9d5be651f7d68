"""The interfaces user code and connectors implement in a streaming dataflow.

A task runs a *chain* of operators in one thread: a source (or the task's input gate)
feeds the first operator, each operator's ``Collector`` feeds the next, the last one's
feeds the task's output (the exchange) or nothing (a sink). The runtime calls, in order:

1. state restored into ``ctx.keyed_state`` / ``ctx.operator_state`` (from the latest
   completed checkpoint, possibly written by another parallelism), then ``open(ctx)``;
2. ``process(record, out)`` for every input record (a source: ``poll(out, n)`` instead);
3. at checkpoint N, between the records before and after the barrier:
   ``prepare_snapshot_pre_barrier(N, out)`` on every operator of the chain, head to
   tail — what it emits goes downstream *before* barrier N (Flink's
   ``prepareSnapshotPreBarrier``: flush what an operator holds back); then the barrier
   is sent; then ``snapshot_state(N)`` — put everything needed to resume into the state
   backends (a sink pre-commits here: what it wrote since the last checkpoint becomes
   *pending*). A record emitted during ``snapshot_state`` (through a collector kept from
   ``process``) comes *after* the barrier: it belongs to checkpoint N + 1;
4. ``notify_checkpoint_complete(N)`` once every task acknowledged N (a sink commits its
   pending output of checkpoints <= N), or ``notify_checkpoint_aborted(N)``;
5. ``end_input(out)`` once the input ended: a source's bounded input is exhausted (or
   the job stops cleanly), or every upstream task ended its own (EndOfData on every
   input channel). It runs head to tail, before the final checkpoint's barrier reaches
   the task, so what it emits is in the final checkpoint and sinks commit it;
6. ``close()`` always, also after a failure (release files, connections).

Keyed operators see ``ctx.keyed_state`` with the current key already set by the runtime
to the record's key (``key_by``); their state is partitioned into key groups so a job can
restart with another parallelism. A record's key goes to the subtask
``exchange.state.subtask_for_key(key, max_parallelism, parallelism)``.

Everything here runs in the task's thread; nothing may block forever (a source that
waits for input returns from ``poll`` with what it has, possibly nothing).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from exchange.state import KeyedStateBackend, OperatorStateBackend

__all__ = ["Collector", "Operator", "OperatorContext", "Source"]


class Collector(Protocol):
    """Where an operator emits its output records."""

    def collect(self, record: Any) -> None: ...


@dataclass(frozen=True)
class OperatorContext:
    """What an operator knows about where it runs."""

    job_id: str
    #: the operator's uid (``DataStream.uid``, else its name): stable across restarts and
    #: rescales, it names the operator's state in checkpoints
    operator_id: str
    subtask_index: int
    parallelism: int
    #: the attempt's id, unique across restarts and drivers of the job (the driver's clock
    #: in milliseconds at the attempt's start, increasing; not a count: use
    #: ``restored_checkpoint_id`` to tell a fresh start): part of every name a task creates
    #: outside the checkpoint (files, partitions), so nothing of a dead attempt is mistaken
    #: for this one's
    attempt: int
    operator_state: OperatorStateBackend
    #: None for operators not after a key_by
    keyed_state: KeyedStateBackend | None = None
    #: the completed checkpoint the state was restored from (None: a fresh start)
    restored_checkpoint_id: int | None = None


class Operator:
    """One step of a chain. Override what you need; the defaults do nothing."""

    ctx: OperatorContext

    def open(self, ctx: OperatorContext) -> None:
        self.ctx = ctx

    def process(self, record: Any, out: Collector) -> None:
        raise NotImplementedError

    def end_input(self, out: Collector) -> None:
        """The input ended (before the final checkpoint): emit what is still held back."""

    def prepare_snapshot_pre_barrier(self, checkpoint_id: int, out: Collector) -> None:
        """Checkpoint ``checkpoint_id`` is about to be taken: what is emitted into ``out``
        now precedes its barrier (Flink's ``prepareSnapshotPreBarrier``). Flush buffered
        output here, not in ``snapshot_state``, which runs after the barrier left."""

    def snapshot_state(self, checkpoint_id: int) -> None:
        """Checkpoint ``checkpoint_id``: write what is needed to resume into the backends."""

    def notify_checkpoint_complete(self, checkpoint_id: int) -> None:
        """Checkpoint ``checkpoint_id`` and all before it are complete."""

    def notify_checkpoint_aborted(self, checkpoint_id: int) -> None:
        """Checkpoint ``checkpoint_id`` will never complete."""

    def close(self) -> None:
        """Release everything; called also after a failure, so be idempotent."""


class Source(Operator):
    """The first operator of a source task: the runtime polls it between checkpoints."""

    #: True when the source ends by itself (files, a bounded generator)
    bounded: bool = True

    def poll(self, out: Collector, max_records: int) -> bool:
        """Emit up to ``max_records`` into ``out``; False once the input is exhausted
        (a bounded source), True otherwise (also when nothing was available yet)."""
        raise NotImplementedError

    def process(self, record: Any, out: Collector) -> None:  # pragma: no cover - not called
        raise TypeError("a source has no input")
