"""One subtask of a streaming job, run as one task of the job's Spark barrier stage.

The task registers with the driver (its attempt and its local daemon), receives every
task's daemon and the checkpoint to restore, restores its operators' state, opens one
pipelined partition per output exchange on its local daemon and one PartitionReader over
all its input partitions, and runs its chain of operators.

**The mailbox.** The task thread waits in one place only, ``_wait_for_mail``: on the
control inbox, where the driver's messages arrive and where the task's own loop thread
posts wake-ups (input handed over by the reader, room in a writer's window), as Flink's
mailbox turns input and output availability into mails. So a control message (trigger,
complete, abort, stop, cancel) is handled at once whether the task waits for input, for
room in its output, or for nothing; between records it is looked at every 64 records (a
reading task) or between polls (a source task).

* a **source task** polls its source between mails: ``trigger`` snapshots the chain,
  broadcasts CheckpointBarrier(N) after every record emitted so far and acknowledges.
  An idle source waits for mail at most its ``ready_in()``. Before each poll it looks at
  its output: while back pressure holds it (a writer's window is full), it does not poll
  but waits for mail. (The checkpoint completes once the barrier passed the data ahead
  of it: aligned barriers wait for the back pressure to clear; in mode unaligned the
  barrier is a priority one that overtakes the output queued in the writers and the
  daemon, whose copies, the output channel state, go into the task's state file.) A
  poll ships a batch per 256 KiB it emits and one per buffer timeout that passes while
  it runs; one that overruns the window so still blocks in ``emit``
  until a batch frees (as a Flink record that needs more buffers than are left);
* any other task reads its input gate through the barrier handler: at each barrier the
  reader calls ``trigger_checkpoint`` between the records before and after it (aligned in
  ``exactly_once``, tracked in ``at_least_once``); the task snapshots, forwards the barrier
  and acknowledges.

**End of input (FLIP-147).** When its source runs dry (or the driver says ``stop``), a
source task runs every operator's ``end_input``, head to tail, sends EndOfData on every
output after what they emitted, and tells the driver ``exhausted``; a reading task does
the same once EndOfData arrived on every input channel. The driver triggers the final
checkpoint once every source is exhausted, so its barrier follows EndOfData on every
channel: every task ran ``end_input`` before it snapshots for the final checkpoint, and
sinks commit what ``end_input`` emitted. After the final checkpoint completed the driver
says ``finish``; sources end their partitions (EndOfPartition), the others follow at the
end of their input. Every operator's state records whether its task had ended its input;
a task restored from such a checkpoint is *finished on restore*: it polls nothing and
does not run ``end_input`` again, it only sends EndOfData (so a restart or rerun after
end of input emits nothing twice).

**Checkpoint N** in a task: ``prepare_snapshot_pre_barrier(N, out)`` on every operator,
head to tail (what they emit precedes the barrier), the barrier on every output, then
``snapshot_state(N)`` of every operator. State goes to the checkpoint storage as one file
per task and checkpoint, under a name of its own (every operator's operator state and
keyed state, keyed by the operator's uid), whose path is the acknowledgement's handle. A
restore reads, for each operator of the chain, the files the checkpoint's metadata lists
for that operator's uid, whatever tasks wrote them.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import logging
import pickle
import queue
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Final

from client.consumer import PartitionLocation, PartitionReader
from client.local_connection import fetch_daemon_info, resolve_daemon_socket
from client.options import ReaderOptions
from client.producer import PartitionWriter
from client.runtime import get_runtime
from client.streaming.checkpoint_storage import CheckpointDiscardedError, CheckpointStorage
from client.streaming.control import WAKEUP, ControlClient, ControlLost, Mail, Wakeup
from client.streaming.functions import Collector, Operator, OperatorContext, Source
from client.streaming.graph import Edge, JobGraph, Partitioning, TaskSpec
from exchange.best_effort import best_effort
from exchange.checkpointing import CheckpointFailureReason
from exchange.checkpointing.output_channel_state import CheckpointOutputState
from exchange.errors import (
    ExchangeError,
    IllegalStateError,
    PartitionDataLostError,
    PartitionReleasedError,
    ProducerFailedError,
    UsageError,
)
from exchange.events.events import (
    AbstractEvent,
    CheckpointOptions,
    CheckpointType,
    EndOfDataEvent,
)
from exchange.partition.result_partition_id import ResultPartitionID
from exchange.protocol.driver_messages import (
    CancelTask,
    CheckpointAbort,
    CheckpointAck,
    CheckpointComplete,
    CheckpointDecline,
    CheckpointTrigger,
    FinishTask,
    RegisterTask,
    RegistrationRefused,
    RestorePoint,
    SourceExhausted,
    StartTask,
    StopInput,
    TaskDaemon,
    TaskFailed,
    TaskFinished,
)
from exchange.state import (
    CorruptSnapshotError,
    KeyedStateBackend,
    OperatorStateBackend,
    key_group_range_for_subtask,
    subtask_for_key,
)

__all__ = ["JobSpec", "StreamTaskFailed", "dataset_of", "is_consequence", "run_task"]

log = logging.getLogger("exchange.streaming.task")

#: Records a source emits between two looks at the mailbox.
_POLL_BATCH: Final = 256
#: Batches a task's writer may ship beyond its window within one step (a source's poll,
#: one record list) before an emit waits: the task waits for room between steps, where
#: it runs its mail (``PartitionWriter(overdraft=)``). Without it, a flush timer that
#: shipped beyond the window made the next emit wait inside the step, so under back
#: pressure a priority barrier waited for the consumer to free a whole batch.
_OUTPUT_OVERDRAFT: Final = 2
#: Records a reading task processes between two looks at the mailbox.
_MAIL_EVERY: Final = 64
#: How long an idle source without ``ready_in()`` waits for mail before it polls again.
_IDLE_WAIT: Final = 0.1


class StreamTaskFailed(ExchangeError):
    """The task was cancelled, refused (a stale attempt) or lost its driver."""


def is_consequence(error: BaseException) -> bool:
    """True when ``error`` follows from another failure, so is no attempt's root cause:
    the partition it wrote or read was released (its consumer or producer failed and the
    attempt is being torn down), its producer failed, or the driver cancelled or dropped
    the task. Spilled data lost in a daemon restart is a failure of its own."""
    seen: set[int] = set()
    e: BaseException | None = error
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, PartitionDataLostError):
            return False
        if isinstance(e, PartitionReleasedError | ProducerFailedError | StreamTaskFailed):
            return True
        e = e.__cause__ if e.__cause__ is not None else e.__context__
    return False


@dataclass(frozen=True)
class JobSpec:
    """What every task of one attempt gets (pickled into the Spark closure)."""

    job_id: str
    attempt: int
    token: str
    control_address: str
    graph: JobGraph
    checkpoint_url: str
    mode: str
    daemon_hint: str | None = None
    buffer_timeout: float = 0.01
    #: the key of the job's checkpoint files (derived from the daemons' secret in the
    #: driver; the secret itself never travels), None: no MAC
    checkpoint_key: bytes | None = None
    #: the application's credential, minted by the driver (None: the task's environment)
    credential: bytes | None = None
    #: mode unaligned: seconds each checkpoint stays aligned first (None: unaligned at once)
    aligned_checkpoint_timeout: float | None = None
    #: exactly-once alignment: ``AlignmentMode`` value, limit in bytes (None: the
    #: daemon's), parent of the task's private spill directory (None: its temp dir)
    alignment: str = "block_upstream"
    alignment_limit: int | None = None
    alignment_spill_dir: str | None = None


@dataclass
class _PendingSnapshot:
    """Unaligned mode: a checkpoint triggered in a reading task whose input channel state
    is still being collected (until every channel's barrier came)."""

    state: dict[str, Any]
    #: channel key (``e<edge>-<upstream subtask>``) -> pickled record lists, in order
    channels: dict[str, list[bytes]]
    #: the writers' output channel state (priority barriers), by output edge id
    outputs: dict[int, concurrent.futures.Future[CheckpointOutputState]] = field(
        default_factory=dict
    )
    #: channel key -> the head of the record its decoder held at the channel's cut
    partials: dict[str, bytes] = field(default_factory=dict)
    persisted_bytes: int = 0


def dataset_of(job_id: str, attempt: int, edge: Edge) -> str:
    """The dataset of an exchange's partitions: job, attempt and edge (attempts fenced)."""
    return f"{job_id}-a{attempt}-e{edge.edge_id}"


class _Out:
    """The chain's end: routes each record into the output exchanges."""

    def __init__(self, task: StreamTask) -> None:
        self._routes: list[Callable[[Any], None]] = []
        self.count = 0
        for edge, writer in task.writers:
            self._routes.append(_route(edge, writer, task))

    def collect(self, record: Any) -> None:
        self.count += 1
        for route in self._routes:
            route(record)


def _route(edge: Edge, writer: PartitionWriter, task: StreamTask) -> Callable[[Any], None]:
    n = writer.num_subpartitions
    match edge.partitioning:
        case Partitioning.FORWARD:
            me = task.spec.subtask
            return lambda r: writer.emit_to(r, me)
        case Partitioning.HASH:
            key_fn = edge.key_fn
            assert key_fn is not None
            maxp = task.graph.max_parallelism
            return lambda r: writer.emit_to(r, subtask_for_key(key_fn(r), maxp, n))
        case Partitioning.REBALANCE:
            counter = itertools.cycle(range(n))
            for _ in range(task.spec.subtask):  # start where the subtask's index says
                next(counter)
            return lambda r: writer.emit_to(r, next(counter))
        case Partitioning.BROADCAST:
            return writer.broadcast


class _Counting:
    """Counts what passes into the chain (a source task's records)."""

    __slots__ = ("_out", "count")

    def __init__(self, out: Collector) -> None:
        self._out = out
        self.count = 0

    def collect(self, record: Any) -> None:
        self.count += 1
        self._out.collect(record)


class _Chained:
    """Feeds the next operator of the chain."""

    __slots__ = ("_op", "_out")

    def __init__(self, op: Operator, out: Collector) -> None:
        self._op = op
        self._out = out

    def collect(self, record: Any) -> None:
        self._op.process(record, self._out)


class StreamTask:
    """One subtask; ``run()`` in the Spark task's thread."""

    def __init__(self, job: JobSpec, index: int) -> None:
        self.job = job
        self.graph = job.graph
        self.spec: TaskSpec = job.graph.tasks[index]
        self.vertex = job.graph.vertex(self.spec.vertex_id)
        self.task_id = self.spec.task_id
        self.storage = CheckpointStorage(job.checkpoint_url, key=job.checkpoint_key)
        self.writers: list[tuple[Edge, PartitionWriter]] = []
        self.reader: PartitionReader | None = None
        self.ctl: ControlClient | None = None
        self.ops: list[Operator] = []
        self.contexts: list[OperatorContext] = []
        self.records_in = 0
        self.checkpoints = 0
        self._finish = False
        self._stop = False
        self._ended_input = False
        #: restored from a checkpoint taken after this task had ended its input
        self._finished_on_restore = False
        self._out: _Out | None = None
        #: unaligned mode: checkpoints triggered here whose channel state is incomplete
        self._pending_snapshots: dict[int, _PendingSnapshot] = {}
        #: the reader's channels, by index: ``e<edge>-<upstream subtask>``
        self._channel_keys: list[str] = []
        #: restored input channel state: record lists replayed before any new input
        self._replay: list[list[Any]] = []
        #: restored heads of records cut by a priority barrier, by channel key
        self._replay_partials: dict[str, bytes] = {}
        self.replayed_records = 0
        #: what each operator of the chain emits into (the next operator, or the outputs)
        self._outs: list[Collector] = []
        self._source_out: _Counting | None = None

    # -- setup -----------------------------------------------------------------------------

    def _register(self) -> StartTask:
        sock = resolve_daemon_socket(self.job.daemon_hint)
        info = get_runtime().run(fetch_daemon_info(sock, secret=self.job.credential))
        self.daemon_socket = sock
        self.daemon_info = info
        self.ctl = ControlClient.connect(
            self.job.control_address,
            RegisterTask(
                self.job.token,
                self.job.attempt,
                self.task_id,
                TaskDaemon(info.daemon_id, info.data_address, sock),
            ),
        )
        while True:
            msg = self._take_mail(timeout=120.0)
            if msg is None:
                raise StreamTaskFailed(f"{self.task_id}: no start from the driver in 120 s")
            if isinstance(msg, StartTask):
                return msg
            self._control(msg)

    def _restore_and_open(self, start: StartTask) -> None:
        restore = start.restore
        p, me = self.vertex.parallelism, self.spec.subtask
        maxp = self.graph.max_parallelism
        files: dict[str, dict[str, Any]] = {}  # state file -> its snapshot (read once)
        finished: list[bool] = []  # per operator: its input had ended at the checkpoint
        for node in self.vertex.nodes:
            op_state = OperatorStateBackend(me, p)
            keyed = (
                KeyedStateBackend(maxp, key_group_range_for_subtask(maxp, p, me))
                if node.key_fn is not None
                else None
            )
            if restore is not None:
                # every old subtask of this operator, whatever task ran it: keyed state
                # may move between subtasks, operator state is redistributed
                old = self._old_state(restore, node.state_id, files)
                op_state.restore([(name, s["operator"]) for name, s in old])
                if keyed is not None:
                    keyed.restore([(name, s["keyed"]) for name, s in old if s["keyed"]])
                ended = {name: bool(s.get("ended_input")) for name, s in old}
                subtasks = restore.operators.get(node.state_id, ())
                finished.append(
                    _finished_on_restore(
                        [True if n is None else ended.get(n, False) for n in subtasks], p, me
                    )
                )
            ctx = OperatorContext(
                job_id=self.job.job_id,
                operator_id=node.state_id,
                subtask_index=me,
                parallelism=p,
                attempt=self.job.attempt,
                operator_state=op_state,
                keyed_state=keyed,
                restored_checkpoint_id=None if restore is None else restore.checkpoint_id,
            )
            op = node.factory()
            self.ops.append(op)
            self.contexts.append(ctx)
        # open writers before operators: a source may emit from open()
        for edge in self.vertex.outputs:
            target = self.graph.vertex(edge.target)
            w = PartitionWriter(
                ResultPartitionID(dataset_of(self.job.job_id, self.job.attempt, edge), me, 0),
                target.parallelism,
                daemon_socket=self.daemon_socket,
                buffer_timeout=self.job.buffer_timeout,
                secret=self.job.credential,
                overdraft=_OUTPUT_OVERDRAFT,
            )
            self.writers.append((edge, w))
        self._finished_on_restore = bool(finished) and all(finished)
        if restore is not None:
            self._restore_unaligned_cut(restore, files)
            if not self.vertex.is_source:
                self._replay = self._restored_channel_state(restore, files)
        for op, ctx in zip(self.ops, self.contexts, strict=True):
            op.open(ctx)
        self._out = tail = _Out(self)
        outs: list[Collector] = [tail]
        for op in reversed(self.ops[1:]):
            outs.insert(0, _Chained(op, outs[0]))
        if self.vertex.is_source:  # count what the source emits (a chained sink emits none)
            self._source_out = _Counting(outs[0])
            outs[0] = self._source_out
        self._outs = outs
        out = outs[0]  # what the first operator emits into
        first = self.vertex.nodes[0]
        head_op = self.ops[0]
        key_fn = first.key_fn
        if key_fn is not None:
            keyed = self.contexts[0].keyed_state
            assert keyed is not None
            set_key = keyed.set_current_key
            chain_out = out

            def head(record: Any) -> None:
                set_key(key_fn(record))
                head_op.process(record, chain_out)

            self._process = head
        else:
            chain_out = out
            self._process = lambda record: head_op.process(record, chain_out)

    def _old_state(
        self, restore: RestorePoint, uid: str, files: dict[str, dict[str, Any]]
    ) -> list[tuple[str, dict[str, Any]]]:
        """(file, state) of operator ``uid`` in each old subtask that wrote one, in order."""
        cid = restore.checkpoint_id
        old = []
        for name in restore.operators.get(uid, ()):
            if name is None:  # that subtask had finished: no state
                continue
            snap = files.get(name)
            if snap is None:
                snap = files[name] = self.storage.read_task_state(cid, name)
            try:
                old.append((name, snap["operators"][uid]))
            except (KeyError, TypeError) as exc:
                raise CorruptSnapshotError(
                    name, f"holds no state of operator {uid!r}: {exc!r}"
                ) from None
        return old

    def _old_file(
        self, restore: RestorePoint, name: str, files: dict[str, dict[str, Any]]
    ) -> dict[str, Any]:
        snap = files.get(name)
        if snap is None:
            snap = files[name] = self.storage.read_task_state(restore.checkpoint_id, name)
        return snap

    def _old_names(self, restore: RestorePoint, vertex_id: int) -> list[str | None]:
        """The state file each old subtask of vertex ``vertex_id`` wrote (None: finished)."""
        uid = self.graph.vertex(vertex_id).nodes[0].state_id
        return list(restore.operators.get(uid, ()))

    def _restore_unaligned_cut(
        self, restore: RestorePoint, files: dict[str, dict[str, Any]]
    ) -> None:
        """What priority barriers cut, from the restored checkpoint: each writer re-emits
        its output channel state before any record, and each input channel gets back the
        head of the record its decoder held at the cut (the tail is in the producer's
        output state). The bytes are per subpartition and cut anywhere in a record, so
        only with the same parallelism at both ends of the exchange (else UsageError, if
        the checkpoint holds any)."""
        names = self._old_names(restore, self.vertex.vertex_id)
        p, me = self.vertex.parallelism, self.spec.subtask
        cid = restore.checkpoint_id
        same = len(names) == p
        mine = names[me] if same else None
        own = self._old_file(restore, mine, files) if mine is not None else {}
        for edge, w in self.writers:
            if same and len(self._old_names(restore, edge.target)) == w.num_subpartitions:
                buffers = (own.get("output_state") or {}).get(edge.edge_id)
                if buffers:
                    w.restore_output_state(CheckpointOutputState(cid, dict(buffers)))
                continue
            for name in names:
                if name and (self._old_file(restore, name, files).get("output_state") or {}).get(
                    edge.edge_id
                ):
                    raise UsageError(
                        f"{self.task_id}: checkpoint {cid} holds in-flight output of edge "
                        f"{edge.edge_id} (unaligned); restore it with the same parallelism "
                        "at both ends"
                    )
        if self.vertex.is_source:
            return
        for edge in self.vertex.inputs:
            if (
                same
                and len(self._old_names(restore, edge.source))
                == self.graph.vertex(edge.source).parallelism
            ):
                continue
            for name in names:
                if name and self._old_file(restore, name, files).get("partial_records"):
                    raise UsageError(
                        f"{self.task_id}: checkpoint {cid} holds records cut by unaligned "
                        "barriers; restore it with the same parallelism at both ends"
                    )
        self._replay_partials = dict(own.get("partial_records") or {})

    def _restored_channel_state(
        self, restore: RestorePoint, files: dict[str, dict[str, Any]]
    ) -> list[list[Any]]:
        """The record lists of the restored checkpoint's input channel state this subtask
        replays, channel by channel, each in its order. Same parallelism: its own old
        file's. Rescaled: a hash exchange's records go where their key goes now, a
        rebalanced one's whole channels to old subtask mod parallelism; a broadcast or
        forward exchange with channel state cannot be rescaled (UsageError)."""
        uid = self.vertex.nodes[0].state_id
        cid = restore.checkpoint_id
        names = list(restore.operators.get(uid, ()))
        p, me = self.vertex.parallelism, self.spec.subtask
        maxp = self.graph.max_parallelism
        edges = {e.edge_id: e for e in self.vertex.inputs}
        out: list[list[Any]] = []
        for old, name in enumerate(names):
            if name is None or (len(names) == p and old != me):
                continue
            snap = files.get(name)
            if snap is None:
                snap = files[name] = self.storage.read_task_state(cid, name)
            for key, blobs in sorted((snap.get("channel_state") or {}).items()):
                edge = edges.get(int(key.split("-", 1)[0][1:]))
                if edge is None:
                    raise CorruptSnapshotError(name, f"channel state of unknown input {key!r}")
                lists = [pickle.loads(b) for b in blobs]  # MAC-checked file (see storage)
                if len(names) == p:
                    out.extend(lists)
                elif edge.partitioning is Partitioning.HASH:
                    key_fn = edge.key_fn
                    assert key_fn is not None
                    out.extend(
                        [r for r in records if subtask_for_key(key_fn(r), maxp, p) == me]
                        for records in lists
                    )
                elif edge.partitioning is Partitioning.REBALANCE:
                    if old % p == me:
                        out.extend(lists)
                elif lists:
                    raise UsageError(
                        f"{self.task_id}: checkpoint {cid} holds in-flight records of a "
                        f"{edge.partitioning.value} input from {len(names)} subtasks; they "
                        f"cannot be spread over {p} (restore it with the same parallelism)"
                    )
        return out

    def _open_reader(self, start: StartTask) -> PartitionReader:
        daemons = start.daemons
        locations = []
        for edge in self.vertex.inputs:
            dataset = dataset_of(self.job.job_id, self.job.attempt, edge)
            src = self.graph.vertex(edge.source)
            for u in range(src.parallelism):
                self._channel_keys.append(f"e{edge.edge_id}-{u}")
                d = daemons[f"v{src.vertex_id}-{u}"]
                locations.append(
                    PartitionLocation(
                        ResultPartitionID(dataset, u, 0),
                        self.spec.subtask,
                        d.data_address,
                        d.daemon_id,
                        d.local_socket,
                    )
                )
        info = self.daemon_info
        options = ReaderOptions.from_daemon(
            info,
            event_handler=self._on_event,
            checkpoint_listener=self,
            checkpointing_mode=self.job.mode,
            aligned_checkpoint_timeout=self.job.aligned_checkpoint_timeout,
            alignment=self.job.alignment,
            alignment_spill_dir=self.job.alignment_spill_dir,
            **(
                {}
                if self.job.alignment_limit is None
                else {"checkpoint_alignment_limit": self.job.alignment_limit}
            ),
            metrics_socket=self.daemon_socket,  # TaskMetrics: debloating, alignment
            task_name=f"{self.job.job_id}/{self.task_id}",
            secret=self.job.credential,
            # a daemon that does not say retries within 2 s
            **({} if info.settings.get("partition_request_backoff_max") else {"backoff_max": 2.0}),
        )
        return PartitionReader(locations, options)

    # -- checkpoints (CheckpointListener; the task's thread) --------------------------------

    def trigger_checkpoint(
        self, checkpoint_id: int, timestamp: int, options: CheckpointOptions
    ) -> None:
        # what operators flush now precedes the barrier (Flink's prepareSnapshotPreBarrier)
        for op, out in zip(self.ops, self._outs, strict=True):
            op.prepare_snapshot_pre_barrier(checkpoint_id, out)
        # then the barrier (it travels while this task snapshots), as Flink does; in mode
        # unaligned a priority barrier that overtakes the output queued on the daemon and
        # in the writer, whose copies come back as the output channel state
        priority = self._priority_barriers(options)
        outputs: dict[int, concurrent.futures.Future[CheckpointOutputState]] = {}
        for edge, w in self.writers:
            w.broadcast_barrier(
                checkpoint_id, timestamp, aligned=options.exactly_once, unaligned=priority
            )
            if priority:
                outputs[edge.edge_id] = w.output_channel_state(checkpoint_id)
        state: dict[str, Any] = {}
        for node, op, ctx in zip(self.vertex.nodes, self.ops, self.contexts, strict=True):
            op.snapshot_state(checkpoint_id)
            state[node.state_id] = {
                "operator": ctx.operator_state.snapshot(),
                "keyed": ctx.keyed_state.snapshot() if ctx.keyed_state is not None else None,
                "ended_input": self._ended_input,
            }
        if self.job.mode == "unaligned" and self.reader is not None:
            # acknowledged once every channel's barrier came (input_state_complete)
            self._pending_snapshots[checkpoint_id] = _PendingSnapshot(state, {}, outputs)
            return
        snapshot: dict[str, Any] = {"task": self.task_id, "operators": state}
        if outputs:
            nbytes = self._take_output_state(snapshot, outputs)
            self._write_and_ack(checkpoint_id, snapshot, unaligned=True, persisted_bytes=nbytes)
        else:
            self._write_and_ack(checkpoint_id, snapshot)

    def _priority_barriers(self, options: CheckpointOptions) -> bool:
        """Whether this task's barrier of a checkpoint with ``options`` is a priority one:
        mode unaligned without an aligned-first timeout (a barrier that overtook the
        output cannot be aligned any more; the timeout is the consumer's), never after
        the input ended (FLIP-147's final checkpoint is collected aligned: its barrier
        follows EndOfData) nor for a savepoint."""
        return (
            self.job.mode == "unaligned"
            and not self.job.aligned_checkpoint_timeout
            and options.exactly_once
            and options.checkpoint_type is not CheckpointType.SAVEPOINT
            and not self._ended_input
        )

    @staticmethod
    def _take_output_state(
        snapshot: dict[str, Any],
        outputs: dict[int, concurrent.futures.Future[CheckpointOutputState]],
    ) -> int:
        """Wait for the writers' output channel state (the daemon answers at once; a lost
        daemon fails the future: the checkpoint is not acknowledged) and put it in
        ``snapshot`` (edge id -> {subpartition: buffers}); its bytes."""
        states = {edge_id: fut.result() for edge_id, fut in outputs.items()}
        snapshot["output_state"] = {
            edge_id: dict(st.buffers) for edge_id, st in states.items() if st.buffers
        }
        return sum(st.num_bytes for st in states.values())

    def persist_records(
        self, checkpoint_id: int, channel: int, records: list[Any], nbytes: int
    ) -> None:
        """Unaligned: ``records`` (decoded from ``nbytes`` of input that arrived after the
        trigger, before the channel's barrier; 0: decoded before the trigger and not
        processed yet, counted at their pickled size) are input channel state of the
        checkpoint; pickled now, so what operators do to them later changes nothing."""
        pending = self._pending_snapshots.get(checkpoint_id)
        if pending is None:
            return
        pending.persisted_bytes += nbytes
        if records:
            key = self._channel_keys[channel]
            blob = pickle.dumps(records, protocol=pickle.HIGHEST_PROTOCOL)
            pending.channels.setdefault(key, []).append(blob)
            if not nbytes:
                pending.persisted_bytes += len(blob)

    def persist_partial_record(self, checkpoint_id: int, channel: int, data: bytes) -> None:
        """Unaligned, after a priority barrier: ``data`` is the head of the record the
        channel's decoder held at the channel's cut (the tail is the producer's output
        channel state); fed back to the decoder on restore, before the tail."""
        pending = self._pending_snapshots.get(checkpoint_id)
        if pending is None:
            return
        pending.persisted_bytes += len(data)
        pending.partials[self._channel_keys[channel]] = data

    def input_state_complete(self, checkpoint_id: int) -> None:
        """Every channel's barrier came: the state file holds operator state and channel
        state of the checkpoint (input records, heads of cut records, output buffers),
        written and acknowledged now."""
        pending = self._pending_snapshots.pop(checkpoint_id, None)
        if pending is None:
            return
        snapshot: dict[str, Any] = {
            "task": self.task_id,
            "operators": pending.state,
            "channel_state": pending.channels,
        }
        if pending.partials:
            snapshot["partial_records"] = pending.partials
        nbytes = pending.persisted_bytes
        if pending.outputs:
            nbytes += self._take_output_state(snapshot, pending.outputs)
        self._write_and_ack(
            checkpoint_id,
            snapshot,
            unaligned=bool(self.reader is not None and self.reader.last_unaligned),
            persisted_bytes=nbytes,
        )

    def _write_and_ack(
        self,
        checkpoint_id: int,
        snapshot: dict[str, Any],
        *,
        unaligned: bool = False,
        persisted_bytes: int = 0,
    ) -> None:
        """Write the task's state and acknowledge it with the task's figures (Flink's
        CheckpointMetrics, and the record counts for the job's status): the state's size,
        the alignment of this checkpoint (a task that reads), the records in and out so
        far, and (unaligned) the in-flight bytes persisted."""
        try:
            handle = self.storage.write_task_state(checkpoint_id, self.task_id, snapshot)
        except CheckpointDiscardedError as e:
            # aborted (or subsumed) while this late task wrote: nothing to acknowledge, as
            # Flink drops a late snapshot of a checkpoint its coordinator gave up
            log.info("task %s: %s; not acknowledged", self.task_id, e)
            return
        assert self.ctl is not None
        stats = self.reader.barrier_stats if self.reader is not None else None
        self.ctl.send(
            CheckpointAck(
                checkpoint_id,
                handle.path,
                state_bytes=handle.size,
                records_in=self._records_in(),
                records_out=self._out.count if self._out is not None else 0,
                alignment=None if stats is None else stats.last_alignment_duration,
                aligned_bytes=0 if stats is None else stats.last_aligned_bytes,
                unaligned=unaligned,
                persisted_bytes=persisted_bytes,
            )
        )
        self.checkpoints += 1

    def abort_checkpoint(self, checkpoint_id: int, reason: CheckpointFailureReason) -> None:
        self._pending_snapshots.pop(checkpoint_id, None)
        for op in self.ops:
            op.notify_checkpoint_aborted(checkpoint_id)
        for _, w in self.writers:  # downstream aligners must not wait for it
            w.broadcast_cancel(checkpoint_id)
        if reason is not CheckpointFailureReason.CANCELLED:
            assert self.ctl is not None
            self.ctl.send(CheckpointDecline(checkpoint_id, reason))

    def _records_in(self) -> int:
        """Records taken in so far (a source task: the records its source emitted)."""
        return self._source_out.count if self._source_out is not None else self.records_in

    # -- end of input (FLIP-147) -------------------------------------------------------------

    def _on_event(self, event: AbstractEvent, channel: int) -> None:
        """The reader's events, in order with the records (the task's thread)."""
        if (
            isinstance(event, EndOfDataEvent)
            and self.reader is not None
            and self.reader.end_of_data
        ):
            self._end_input()

    def _end_input(self) -> None:
        """The input ended: every operator's ``end_input``, head to tail, each into what
        follows it, then EndOfData on every output, after all of it (and flushed).

        A task restored from a checkpoint taken after its input had ended (Flink's
        "finished on restore") skips ``end_input``: what it emitted then is in that
        checkpoint already; it only sends EndOfData again."""
        if self._ended_input:
            raise IllegalStateError(f"{self.task_id}: the input ended twice")
        self._ended_input = True
        if not self._finished_on_restore:
            for op, out in zip(self.ops, self._outs, strict=True):
                op.end_input(out)
        for _, w in self.writers:
            w.broadcast_event(EndOfDataEvent.INSTANCE)

    # -- the mailbox -------------------------------------------------------------------------

    def _take_mail(self, timeout: float | None = None, *, block: bool = True) -> Mail | None:
        """The next mail: waits up to ``timeout`` seconds (None: until one comes) when
        ``block``, else only what is queued; None if nothing came."""
        assert self.ctl is not None
        try:
            return self.ctl.inbox.get(block, timeout)
        except queue.Empty:
            return None

    def _wait_for_mail(self, timeout: float | None = None) -> None:
        """The one place the task thread waits: for a control message or a wake-up from its
        loop thread (input handed over, room in the output), at most ``timeout`` seconds
        (None: until one comes); then runs every mail queued."""
        msg = self._take_mail(timeout)
        if msg is not None:
            self._control(msg)
            self._run_mails()

    def _run_mails(self) -> None:
        """Run every mail queued now, without waiting."""
        msg = self._take_mail(block=False)
        while msg is not None:
            self._control(msg)
            msg = self._take_mail(block=False)

    def _control(self, msg: Mail) -> None:
        match msg:
            case CheckpointTrigger():
                if self.vertex.is_source:
                    opts = CheckpointOptions(exactly_once=msg.exactly_once)
                    self.trigger_checkpoint(msg.checkpoint_id, msg.timestamp, opts)
            case CheckpointComplete():
                for op in self.ops:
                    op.notify_checkpoint_complete(msg.checkpoint_id)
            case CheckpointAbort():
                cid = msg.checkpoint_id
                self._pending_snapshots.pop(cid, None)
                for op in self.ops:
                    op.notify_checkpoint_aborted(cid)
                if self.vertex.is_source:
                    for _, w in self.writers:
                        w.broadcast_cancel(cid)
            case Wakeup():
                pass  # whoever waited looks again
            case FinishTask():
                self._finish = True
            case StopInput():
                self._stop = True
            case CancelTask():
                raise StreamTaskFailed(f"{self.task_id}: cancelled by the driver")
            case RegistrationRefused():
                raise StreamTaskFailed(f"{self.task_id}: refused by the driver: {msg.reason}")
            case ControlLost():
                raise StreamTaskFailed(f"{self.task_id}: lost the driver: {msg.error}")
            case _:
                raise IllegalStateError(
                    f"{self.task_id}: unexpected control message {type(msg).__name__}"
                )

    # -- running ---------------------------------------------------------------------------

    def run(self) -> dict[str, Any]:
        try:
            start = self._register()
            self._restore_and_open(start)
            if self.vertex.is_source:
                self._run_source()
            else:
                self._run_reader(start)
            for _, w in self.writers:
                w.close()  # EndOfPartition downstream
            self.writers = []
            assert self.ctl is not None
            self.ctl.send(TaskFinished(self._records_in(), self._collected()))
            self.ctl.flush()
            return {"task": self.task_id, "records_in": self._records_in()}
        except BaseException as e:
            failed_at = time.time()
            if self.ctl is not None and not self.ctl.closed:
                with best_effort(log, f"reporting the failure of task {self.task_id}"):
                    self.ctl.send(
                        TaskFailed(
                            "".join(traceback.format_exception(e))[-4000:],
                            failed_at,
                            is_consequence(e),
                        )
                    )
                    self.ctl.flush()
            raise
        finally:
            self.close()

    def _collected(self) -> dict[str, bytes]:
        """The ``results`` of the task's collect sinks (pickled: exact types), for the
        driver's JobResult: after the final checkpoint completed, all of them committed."""
        from client.streaming.connectors import CollectSink

        return {
            node.name: pickle.dumps(op.results(), protocol=pickle.HIGHEST_PROTOCOL)
            for node, op in zip(self.vertex.nodes, self.ops, strict=True)
            if isinstance(op, CollectSink)
        }

    def _run_source(self) -> None:
        source = self.ops[0]
        assert isinstance(source, Source) and self._source_out is not None
        out = self._source_out
        if self._finished_on_restore:  # its input ended before the checkpoint: no poll
            self._end_input()
            assert self.ctl is not None
            self.ctl.send(SourceExhausted())
        while not self._finish:
            if self._ended_input:  # serve checkpoints (the final one) until finish
                self._wait_for_mail()
                continue
            self._run_mails()
            if self._finish:
                break
            alive, emitted = False, 0
            if not self._stop:  # a clean stop ends the input here, as if exhausted
                blocked = self._blocked_output()
                if blocked is not None:
                    self._await_output(blocked)
                    continue
                before = out.count
                alive = source.poll(out, self._poll_batch())
                emitted = out.count - before
            if alive and emitted == 0:  # idle, rate-limited or watching: wait, never spin
                self._wait_for_mail(_idle_wait(source))
            if not alive:
                self._end_input()  # nothing may follow the final checkpoint's barrier
                assert self.ctl is not None
                self.ctl.send(SourceExhausted())

    def _poll_batch(self) -> int:
        """Records a source emits in one poll: ``_POLL_BATCH``, or fewer when a writer's
        shipment holds fewer (debloated buffers): an emit that finds the window full
        waits inside the poll, where no mail is run, so under back pressure a poll of
        ``_POLL_BATCH`` small records would hold a checkpoint's trigger (and the
        priority barrier it sends) until the consumer freed that many records."""
        batch = _POLL_BATCH
        for _, w in self.writers:
            batch = min(batch, w.records_per_shipment())
        return max(1, batch)

    def _blocked_output(self) -> concurrent.futures.Future[None] | None:
        """The first writer without room (back pressure): its availability future."""
        for _, w in self.writers:
            fut = w.available()
            if fut is not None:
                return fut
        return None

    def _await_output(self, blocked: concurrent.futures.Future[None]) -> None:
        """Run mails until ``blocked`` is done (or the task must end)."""
        assert self.ctl is not None
        inbox = self.ctl.inbox
        blocked.add_done_callback(lambda _: inbox.put(WAKEUP))
        reader = self.reader
        while not (blocked.done() or self._finish or self._stop):
            self._wait_for_mail()
            if reader is not None:  # at a record boundary: a priority barrier goes now
                reader.take_priority()

    def _run_reader(self, start: StartTask) -> None:
        self.reader = reader = self._open_reader(start)
        assert self.ctl is not None
        inbox = self.ctl.inbox
        wake = WAKEUP
        process = self._process
        if self.job.mode == "unaligned":  # a priority barrier wakes a task blocked on output
            reader.set_priority_notify(lambda: inbox.put(wake))
        for key, data in self._replay_partials.items():  # heads of records cut at the cut
            reader.restore_unconsumed(self._channel_keys.index(key), data)
        self._replay_partials = {}
        for records in self._replay:  # restored channel state, before any new input
            for record in records:
                process(record)
            self.records_in += len(records)
            self.replayed_records += len(records)
        self._replay = []
        for records in reader.record_lists(on_available=lambda: inbox.put(wake)):
            if not records:  # nothing handed over: wait for input or control, in one place
                self._wait_for_mail(self._barrier_wait(reader))
                reader.check_barrier_timeout()  # an aligned-first checkpoint may turn
                continue
            for at in range(0, len(records), _MAIL_EVERY):  # a look at the mailbox per 64
                for record in records[at : at + _MAIL_EVERY]:
                    process(record)
                if not inbox.empty():
                    self._run_mails()
            self.records_in += len(records)
            blocked = self._blocked_output()
            if blocked is not None:  # reads no more until its output has room
                self._await_output(blocked)
        if not self._ended_input:
            raise IllegalStateError(
                f"{self.task_id}: the input ended (EndOfPartition) before EndOfData on "
                "every channel: what end_input emits would follow the final checkpoint"
            )
        while not self._finish:  # the final checkpoint's completion, then finish
            self._wait_for_mail()

    @staticmethod
    def _barrier_wait(reader: PartitionReader) -> float | None:
        """How long a reading task may wait for mail: until an aligned-first checkpoint
        turns unaligned (``aligned_checkpoint_timeout``), else until mail comes."""
        deadline = reader.barrier_deadline()
        return None if deadline is None else max(deadline - time.monotonic(), 0.001)

    def close(self) -> None:
        for op in self.ops:
            with best_effort(log, f"closing operator {op!r}", logging.WARNING):
                op.close()
        if self.reader is not None:
            self.reader.close()
        for _, w in self.writers:
            with best_effort(log, f"failing writer {w!r}", logging.WARNING):
                w.fail("the task failed")
        self.writers = []
        if self.ctl is not None:
            self.ctl.close()


def _idle_wait(source: Source) -> float | None:
    """How long an idle source lets the task wait for mail: its ``ready_in()`` (at least
    1 ms, never a spin; None for infinite: only mail matters), else ``_IDLE_WAIT``."""
    ready_in = getattr(source, "ready_in", None)
    wait = float(ready_in()) if callable(ready_in) else _IDLE_WAIT
    return None if wait == float("inf") else max(wait, 0.001)


def _finished_on_restore(ended: list[bool], p: int, me: int) -> bool:
    """Whether an operator whose old subtasks had ``ended`` their input (in subtask order;
    a subtask that left no state had finished) is restored as finished: with the same
    parallelism, subtask ``me``'s own flag says; with another, only if every old subtask
    had (fully finished, as Flink restores a finished operator; a partly finished one
    reads its input again)."""
    if not ended:
        return False
    if len(ended) == p:
        return ended[me]
    return all(ended)


def run_task(job: JobSpec, index: int) -> dict[str, Any]:
    """Run task ``index`` of ``job`` to its end; the Spark task's body."""
    return StreamTask(job, index).run()
