"""Messages of the daemon's local endpoint (ids 64..), spoken by tasks on the same host.

A producer task opens one connection per partition: CreatePartition, then PushBuffer for
each filled (or flushed) buffer of a subpartition, each costing one credit the daemon
granted (PartitionCreated carries the first grant, AddProducerCredit the next ones: one
credit is one segment the daemon has reserved in the partition's pool, so a task can never
push more than the pool holds, and waits when it is full). FinishPartition ends it and is
acknowledged with PartitionFinished; a connection that closes first fails the partition.

With shared memory (the daemon decides; a task asks with ``CreatePartition.shared_memory``
on a Unix socket), the partition's segments live in its application's shared arena: the
daemon sends SharedArena (a one-time token for the arena's descriptor, fetched over the
endpoint's hand-out socket, and the first segments granted, by index) before
PartitionCreated, later grants are GrantSegments, and the task writes a data buffer into a
granted segment and sends only a CommitSegments entry (segment, length, subpartition), a
batch of fixed 12-byte entries per frame. Events still travel as PushBuffer.

A consumer on a Unix socket reads the arena in place: it says it can map (RequestArena);
when the daemon has an arena for the connection's application (the daemon checks at
RequestArena, answering NoArena with the reason when it has none, and at every
PartitionRequest until it has offered one) it sends SharedArena with no segments, and
the consumer fetches and maps it as a producer does and answers ArenaMapped. From then
on a data buffer whose segment lies in that arena goes as a SharedBufferResponse (what a
BufferResponse carries, with the segment index, offset and length instead of the
bytes); the daemon holds the segment until the consumer gives it
back with RecycleSegments (indices, a batch per frame; one index per buffer received).
Data buffers elsewhere (spilled, pushed over the socket) and events still come as
BufferResponse.

The local endpoint also serves the ordinary data protocol (PartitionRequest, ...), so a
consumer on the same host reads over the Unix socket instead of TCP.

PushBuffer has a fixed ``>IB`` header (subpartition, data type) before its payload; the
other bodies are msgpack maps (not on the data path; easy to extend).

Unaligned checkpoints: when a producer's unaligned barrier overtakes buffers queued in a
subpartition, the daemon sends them back to the producer task as its *output channel
state* of that checkpoint: one OutputChannelState per overtaken buffer (its bytes, in
queue order), then OutputChannelStateComplete per subpartition with the counts (also
when it overtook nothing). The task persists them with its own snapshot (see
``exchange/checkpointing/output_channel_state.py``).

A consumer task reports its input gate's figures (buffer debloating, checkpoint alignment)
with TaskMetrics about once a second; the daemon keeps the latest report per connection,
task and gate for ``/metrics`` and the dashboard, and forgets it when the connection closes.

A streaming job's driver (its CheckpointCoordinator) publishes the job's status to its
local daemon with JobStatus: state, attempt and restarts, each task's record counts and
output partitions, the recent checkpoint history. The daemon keeps the latest status per
job and joins it with what it measures itself (its partitions' back pressure and pool
usage, the tasks' TaskMetrics) for ``/metrics`` and the dashboard.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass, field
from typing import Any, ClassVar, Final

import msgpack

from exchange.buffers.buffer import DataType
from exchange.errors import ProtocolError
from exchange.partition.result_partition import ALL_SUBPARTITIONS
from exchange.partition.result_partition_id import MAX_DATASET_ID_BYTES, ResultPartitionID
from exchange.protocol.codec import FRAME_HEADER_SIZE, MAGIC, register_message
from exchange.protocol.messages import Message
from exchange.protocol.segment_grants import grant_indices

__all__ = [
    "ALL_SUBPARTITIONS",
    "ARENA_SOCKET_SUFFIX",
    "ARENA_TOKEN_SIZE",
    "CHECKPOINT_STATES",
    "JOB_STATES",
    "MAX_JOB_CHECKPOINTS",
    "MAX_JOB_FAILURES",
    "MAX_JOB_TASKS",
    "MAX_OVERDRAFT_REQUEST",
    "MAX_SHARED_BUFFERS",
    "MAX_TASK_METRICS",
    "MAX_TASK_NAME_LENGTH",
    "SHARED_BUFFER_ENTRY_SIZE",
    "TASK_METRIC_NAMES",
    "AbandonSubpartition",
    "AddProducerCredit",
    "ArenaMapped",
    "CheckpointRecord",
    "CommitSegments",
    "CreatePartition",
    "DaemonInfo",
    "DaemonInfoRequest",
    "FailPartition",
    "FinishPartition",
    "GrantSegments",
    "JobStatus",
    "JobTask",
    "NoArena",
    "OutputChannelState",
    "OutputChannelStateComplete",
    "PartitionCreated",
    "PartitionFinished",
    "ProducerBufferSize",
    "PushBuffer",
    "RecycleSegments",
    "ReleaseDataset",
    "Released",
    "RequestArena",
    "RequestOverdraft",
    "SharedArena",
    "SharedBufferResponse",
    "TaskMetrics",
    "encode_commit",
    "encode_recycle",
    "encode_shared_buffers",
    "pack_shared_buffer",
]

_PUSH: Final = struct.Struct(">IB")
_COMMIT: Final = struct.Struct(">III")
#: A SharedBufferResponse entry: receiver id, sequence number, backlog, data type,
#: compressed, segment, offset, size
_SHARED_BUFFER: Final = struct.Struct(">QIIBBIII")
#: Bytes of one SharedBufferResponse entry.
SHARED_BUFFER_ENTRY_SIZE: Final = _SHARED_BUFFER.size
#: Entries one SharedBufferResponse carries at most (its frame fits the smallest
#: client frame limit, 4 KiB).
MAX_SHARED_BUFFERS: Final = 128
_U32: Final = struct.Struct(">I")
#: Bytes of the one-time token that fetches a shared arena's descriptor.
ARENA_TOKEN_SIZE: Final = 32
#: The arena hand-out socket is the local socket's path with this suffix.
ARENA_SOCKET_SUFFIX: Final = ".arena"
#: Segment indices one grant may carry (more than any producer credit window).
_MAX_GRANT: Final = 4096
_OUTPUT_STATE: Final = struct.Struct(">QI")
#: Segment indices one RecycleSegments may carry.
_MAX_RECYCLE: Final = 1 << 16
_COMMIT_HEADER: Final = struct.Struct(">IIB")
_MAX_CHECKPOINT_ID: Final = 2**63 - 1


@dataclass(frozen=True, slots=True)
class CreatePartition(Message):
    MESSAGE_ID: ClassVar[int] = 64
    partition_id: ResultPartitionID
    blocking: bool
    num_subpartitions: int
    #: the task can map the daemon's shared arena (it is on a Unix socket of this host)
    shared_memory: bool = False


@dataclass(frozen=True, slots=True)
class PartitionCreated(Message):
    MESSAGE_ID: ClassVar[int] = 65
    credit: int
    segment_size: int


@dataclass(frozen=True, slots=True)
class PushBuffer(Message):
    """One buffer for ``subpartition`` (or an event for all, ``ALL_SUBPARTITIONS``)."""

    MESSAGE_ID: ClassVar[int] = 66
    subpartition: int
    data_type: DataType
    payload: bytes | memoryview = field(repr=False)


@dataclass(frozen=True, slots=True)
class AddProducerCredit(Message):
    MESSAGE_ID: ClassVar[int] = 67
    credit: int


#: Overdraft segments a producer may ask for in one RequestOverdraft at most.
MAX_OVERDRAFT_REQUEST: Final = 255


@dataclass(frozen=True, slots=True)
class RequestOverdraft(Message):
    """Producer task -> daemon: the task has no credit and the buffer it waits to push
    continues a record it began; grant up to ``count`` overdraft segments (Flink's
    overdraft buffers) beyond the pool, if the daemon's pool has them free. The grant
    comes as an ordinary AddProducerCredit; nothing comes when none is free."""

    MESSAGE_ID: ClassVar[int] = 88
    count: int

    def __post_init__(self) -> None:
        c = self.count
        if not isinstance(c, int) or isinstance(c, bool) or not 1 <= c <= MAX_OVERDRAFT_REQUEST:
            raise ProtocolError(
                f"RequestOverdraft count must be an int in [1, {MAX_OVERDRAFT_REQUEST}], got {c!r}"
            )


@dataclass(frozen=True, slots=True)
class SharedArena(Message):
    """Daemon -> producer task, before PartitionCreated: this partition's segments live in
    the application's shared arena of ``arena_size`` bytes (segments of ``segment_size``),
    whose descriptor the one-time ``token`` fetches; ``segments`` are the first ones
    granted (by index). Daemon -> consumer task: the same offer, with no segments."""

    MESSAGE_ID: ClassVar[int] = 80
    token: bytes = field(repr=False)
    arena_size: int
    segments: tuple[int, ...]
    segment_size: int


@dataclass(frozen=True, slots=True)
class GrantSegments(Message):
    """Daemon -> producer task: more segments of the shared arena, by index (its credit)."""

    MESSAGE_ID: ClassVar[int] = 81
    segments: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class CommitSegments(Message):
    """Producer task -> daemon: each ``(segment, length, subpartition)`` is a granted
    segment the task has filled; the daemon queues it to the subpartition in place. Only
    a committed segment counts: one the task dies writing is never read."""

    MESSAGE_ID: ClassVar[int] = 82
    commits: tuple[tuple[int, int, int], ...]


@dataclass(frozen=True, slots=True)
class RequestArena(Message):
    """Consumer task -> daemon, on a Unix socket: this reader can map its application's
    shared arena; the daemon offers it (SharedArena, no segments) when it has one."""

    MESSAGE_ID: ClassVar[int] = 83


@dataclass(frozen=True, slots=True)
class NoArena(Message):
    """Daemon -> consumer task, the answer to RequestArena when there is no arena to
    offer now: why (the daemon may still offer one at a later PartitionRequest)."""

    MESSAGE_ID: ClassVar[int] = 87
    reason: str


@dataclass(frozen=True, slots=True)
class ArenaMapped(Message):
    """Consumer task -> daemon: the arena offered is mapped; send descriptors from now."""

    MESSAGE_ID: ClassVar[int] = 84


@dataclass(frozen=True, slots=True)
class SharedBufferResponse(Message):
    """Daemon -> consumer task: data buffers that lie in the mapped arena, one entry
    ``(receiver_id, sequence_number, backlog, data_type, compressed, segment, offset,
    size)`` per buffer (what a BufferResponse carries, with where its ``size`` bytes are
    instead of them; ``data_type`` is always DATA_BUFFER), in stream order; the consumer
    gives each segment back (RecycleSegments) when it is done with it."""

    MESSAGE_ID: ClassVar[int] = 85
    buffers: tuple[tuple[int, int, int, int, int, int, int, int], ...]


@dataclass(frozen=True, slots=True)
class RecycleSegments(Message):
    """Consumer task -> daemon: segments of SharedBufferResponses it is done with, one
    index per buffer received (a segment sent as two slices is given back twice)."""

    MESSAGE_ID: ClassVar[int] = 86
    segments: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class ProducerBufferSize(Message):
    """Daemon -> producer task: the consumer of ``subpartition`` announced NewBufferSize
    (buffer debloating); the task's writer cuts that subpartition's new buffers at
    ``buffer_size`` bytes (broadcast buffers at the smallest size)."""

    MESSAGE_ID: ClassVar[int] = 75
    subpartition: int
    buffer_size: int

    def __post_init__(self) -> None:
        for name in ("subpartition", "buffer_size"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v <= 0xFFFFFFFF:
                raise ProtocolError(f"{name} must be an int in [0, 2**32)")
        if self.buffer_size == 0:
            raise ProtocolError("ProducerBufferSize of zero bytes")


@dataclass(frozen=True, slots=True)
class OutputChannelState(Message):
    """Daemon -> producer task: one buffer that the unaligned barrier of
    ``checkpoint_id`` overtook in ``subpartition`` (its bytes; in queue order)."""

    MESSAGE_ID: ClassVar[int] = 78
    checkpoint_id: int
    subpartition: int
    payload: bytes | memoryview = field(repr=False)

    def __post_init__(self) -> None:
        _check_state_ids(self.checkpoint_id, self.subpartition)
        if len(self.payload) == 0:
            raise ProtocolError("OutputChannelState of zero bytes")


@dataclass(frozen=True, slots=True)
class OutputChannelStateComplete(Message):
    """Daemon -> producer task: every buffer the barrier of ``checkpoint_id`` overtook in
    ``subpartition`` was sent (``buffers`` of them, ``num_bytes`` in all; 0 for none)."""

    MESSAGE_ID: ClassVar[int] = 79
    checkpoint_id: int
    subpartition: int
    buffers: int
    num_bytes: int

    def __post_init__(self) -> None:
        _check_state_ids(self.checkpoint_id, self.subpartition)
        _uint(self.buffers, "buffers")
        _uint(self.num_bytes, "num_bytes", 2**64 - 1)


def _check_state_ids(checkpoint_id: Any, subpartition: Any) -> None:
    _uint(checkpoint_id, "checkpoint_id", _MAX_CHECKPOINT_ID)
    _uint(subpartition, "subpartition")
    if subpartition == ALL_SUBPARTITIONS:
        raise ProtocolError("channel state belongs to one subpartition")


@dataclass(frozen=True, slots=True)
class FinishPartition(Message):
    MESSAGE_ID: ClassVar[int] = 68


@dataclass(frozen=True, slots=True)
class PartitionFinished(Message):
    MESSAGE_ID: ClassVar[int] = 69
    bytes_written: int
    buffers_written: int


@dataclass(frozen=True, slots=True)
class FailPartition(Message):
    MESSAGE_ID: ClassVar[int] = 70
    reason: str


@dataclass(frozen=True, slots=True)
class ReleaseDataset(Message):
    """Release every partition of one exchange (``dataset_id``) on this daemon."""

    MESSAGE_ID: ClassVar[int] = 71
    dataset_id: str


@dataclass(frozen=True, slots=True)
class AbandonSubpartition(Message):
    """A consumer gave up before the end: ``subpartition`` of every pipelined partition of
    ``dataset_id`` (of the caller's application) on this daemon that never had its reader
    is released as when a reader leaves early, also in partitions created later (the
    daemon remembers it, until the dataset is released). Answered by Released with the
    number of partitions it released a subpartition of now. Spoken on the data port and
    on the local socket, like ReleaseDataset."""

    MESSAGE_ID: ClassVar[int] = 89
    dataset_id: str
    subpartition: int

    def __post_init__(self) -> None:
        ds = self.dataset_id
        if not isinstance(ds, str) or not 0 < len(ds.encode("utf-8")) <= MAX_DATASET_ID_BYTES:
            raise ProtocolError(
                f"AbandonSubpartition dataset must be a string of 1 to {MAX_DATASET_ID_BYTES} "
                f"bytes, got {ds!r:.80}"
            )
        _check_uint(self.subpartition, "AbandonSubpartition subpartition", ALL_SUBPARTITIONS - 1)


@dataclass(frozen=True, slots=True)
class Released(Message):
    MESSAGE_ID: ClassVar[int] = 72
    count: int


@dataclass(frozen=True, slots=True)
class DaemonInfoRequest(Message):
    MESSAGE_ID: ClassVar[int] = 73


#: What a value of ``DaemonInfo.settings`` may be.
SettingValue = int | float | bool | None


@dataclass(frozen=True, slots=True)
class DaemonInfo(Message):
    """Who the daemon is, and the settings its tasks use (exclusive and floating buffers,
    backoff, buffer timeout, debloating, alignment limit), so that a setting given to the
    daemon takes effect in the tasks on its host."""

    MESSAGE_ID: ClassVar[int] = 74
    daemon_id: str
    data_address: str
    segment_size: int
    settings: dict[str, SettingValue] = field(default_factory=dict, compare=False)


#: The figures a TaskMetrics report may carry: a gate's debloating figures
#: (``BufferDebloaterStats``) and its barrier handler's (``BarrierHandlerStats``), by the
#: names of those fields. Listed here, not derived, so that the wire does not change when
#: a field is renamed.
TASK_METRIC_NAMES: Final = frozenset(
    {
        # debloating
        "buffer_size",
        "computed_buffer_size",
        "throughput",
        "buffers_in_use",
        "desired_total_bytes",
        "estimated_time_to_consume",
        # checkpoint barriers
        "num_triggered",
        "num_aborted",
        "aligning_checkpoint_id",
        "last_alignment_duration",
        "last_aligned_bytes",
        "current_alignment_duration",
        "buffered_bytes",
        "total_parked_bytes",
        "num_resumed",
    }
)
MAX_TASK_METRICS: Final = len(TASK_METRIC_NAMES)
#: Longest task or gate name (characters); they become Prometheus label values.
MAX_TASK_NAME_LENGTH: Final = 256
#: Largest magnitude of a reported figure (what a float64 holds exactly as an integer).
_MAX_METRIC_VALUE: Final = 2.0**53


@dataclass(frozen=True, slots=True)
class TaskMetrics(Message):
    """Consumer task -> its local daemon: the latest figures of one input gate (no reply).

    ``metrics`` maps names of ``TASK_METRIC_NAMES`` to finite numbers; a figure the task
    does not have (debloating off, no checkpointing) is left out. Anything else raises
    ProtocolError, on whichever side builds or decodes the message.
    """

    MESSAGE_ID: ClassVar[int] = 76
    task: str
    gate: str
    metrics: dict[str, int | float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in ("task", "gate"):
            v = getattr(self, name)
            if not isinstance(v, str) or not 0 < len(v) <= MAX_TASK_NAME_LENGTH:
                raise ProtocolError(
                    f"TaskMetrics {name} must be a string of 1 to {MAX_TASK_NAME_LENGTH} "
                    f"characters, got {v!r:.80}"
                )
        m = self.metrics
        if not isinstance(m, dict) or len(m) > MAX_TASK_METRICS:
            raise ProtocolError(f"TaskMetrics metrics must be a map of at most {MAX_TASK_METRICS}")
        for k, v in m.items():
            if k not in TASK_METRIC_NAMES:
                raise ProtocolError(
                    f"unknown task metric {k!r:.80}; known: {', '.join(sorted(TASK_METRIC_NAMES))}"
                )
            if (
                not isinstance(v, int | float)
                or isinstance(v, bool)
                or not math.isfinite(v)
                or abs(v) > _MAX_METRIC_VALUE
            ):
                raise ProtocolError(f"task metric {k} must be a finite number, got {v!r:.80}")


#: A streaming job's states (Flink's JobStatus, the ones this runtime has).
JOB_STATES: Final = ("RUNNING", "RESTARTING", "FINISHED", "FAILED", "CANCELED")
#: A checkpoint's states in a JobStatus history (Flink's CheckpointStatsStatus).
CHECKPOINT_STATES: Final = ("IN_PROGRESS", "COMPLETED", "FAILED")
#: Most tasks, history entries and failure texts one JobStatus carries (the frame limit of
#: the local endpoint, 32 KiB by default, bounds the whole message too).
MAX_JOB_TASKS: Final = 64
MAX_JOB_CHECKPOINTS: Final = 16
MAX_JOB_FAILURES: Final = 4
#: Longest failure text (characters) a JobStatus carries.
MAX_JOB_FAILURE_LENGTH: Final = 512
_U64: Final = 2**64 - 1


def _check_name(v: Any, what: str) -> None:
    if not isinstance(v, str) or not 0 < len(v) <= MAX_TASK_NAME_LENGTH:
        raise ProtocolError(
            f"{what} must be a string of 1 to {MAX_TASK_NAME_LENGTH} characters, got {v!r:.80}"
        )


def _check_uint(v: Any, what: str, limit: int = _U64) -> None:
    if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v <= limit:
        raise ProtocolError(f"{what} must be an int in [0, {limit}], got {v!r:.80}")


def _check_seconds(v: Any, what: str, *, optional: bool = False) -> None:
    if v is None and optional:
        return
    if (
        not isinstance(v, int | float)
        or isinstance(v, bool)
        or not math.isfinite(v)
        or not 0 <= v <= _MAX_METRIC_VALUE
    ):
        raise ProtocolError(f"{what} must be a finite number >= 0, got {v!r:.80}")


@dataclass(frozen=True, slots=True)
class JobTask:
    """One task (subtask) of a streaming job in a JobStatus.

    ``outputs`` are the datasets of its output exchanges (its partition in each has index
    ``subtask``); ``channels`` the number of its input channels (0 for a source).
    """

    task: str
    name: str
    subtask: int
    outputs: tuple[str, ...]
    channels: int
    records_in: int
    records_out: int

    def __post_init__(self) -> None:
        _check_name(self.task, "JobTask task")
        _check_name(self.name, "JobTask name")
        _check_uint(self.subtask, "JobTask subtask", 0xFFFFFFFF)
        _check_uint(self.channels, "JobTask channels", 0xFFFFFFFF)
        _check_uint(self.records_in, "JobTask records_in")
        _check_uint(self.records_out, "JobTask records_out")
        if not isinstance(self.outputs, tuple) or len(self.outputs) > 8:
            raise ProtocolError("JobTask outputs must be a list of at most 8 datasets")
        for d in self.outputs:
            _check_name(d, "JobTask output dataset")


@dataclass(frozen=True, slots=True)
class CheckpointRecord:
    """One checkpoint of a JobStatus history (Flink's checkpoint statistics).

    ``trigger_time`` is Unix seconds; ``duration`` trigger to completion (None while in
    progress); ``alignment`` the longest alignment of any task, ``aligned_bytes`` the bytes
    processed or parked while aligning (all tasks), ``state_bytes`` the size of the state
    written (all tasks), from the tasks' acknowledgements. ``unaligned``: some task
    triggered it unaligned; ``persisted_bytes``: (task, bytes of in-flight input it
    persisted as channel state), for the tasks that did.
    """

    checkpoint_id: int
    status: str
    trigger_time: float
    duration: float | None
    alignment: float | None
    aligned_bytes: int
    state_bytes: int
    unaligned: bool = False
    persisted_bytes: tuple[tuple[str, int], ...] = ()

    def __post_init__(self) -> None:
        _check_uint(self.checkpoint_id, "checkpoint id")
        if self.status not in CHECKPOINT_STATES:
            raise ProtocolError(
                f"checkpoint status must be one of {', '.join(CHECKPOINT_STATES)}, "
                f"got {self.status!r:.80}"
            )
        _check_seconds(self.trigger_time, "checkpoint trigger_time")
        _check_seconds(self.duration, "checkpoint duration", optional=True)
        _check_seconds(self.alignment, "checkpoint alignment", optional=True)
        _check_uint(self.aligned_bytes, "checkpoint aligned_bytes")
        _check_uint(self.state_bytes, "checkpoint state_bytes")
        if not isinstance(self.unaligned, bool):
            raise ProtocolError(f"checkpoint unaligned must be a bool, got {self.unaligned!r:.80}")
        if not isinstance(self.persisted_bytes, tuple) or len(self.persisted_bytes) > (
            MAX_JOB_TASKS
        ):
            raise ProtocolError(
                f"checkpoint persisted_bytes must hold at most {MAX_JOB_TASKS} tasks"
            )
        for task, nbytes in self.persisted_bytes:
            _check_name(task, "checkpoint persisted_bytes task")
            _check_uint(nbytes, "checkpoint persisted_bytes")


@dataclass(frozen=True, slots=True)
class JobStatus(Message):
    """Driver -> its local daemon: the status of one streaming job (no reply).

    Sent when the job's state changes and about once a second while it runs; the daemon
    keeps the latest per ``job``. Anything out of bounds raises ProtocolError, on whichever
    side builds or decodes the message.
    """

    MESSAGE_ID: ClassVar[int] = 77
    job: str
    state: str
    attempt: int
    restarts: int
    started_at: float
    checkpoints_completed: int
    checkpoints_failed: int
    tasks: tuple[JobTask, ...] = ()
    checkpoints: tuple[CheckpointRecord, ...] = ()
    failures: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        _check_name(self.job, "JobStatus job")
        if self.state not in JOB_STATES:
            raise ProtocolError(
                f"job state must be one of {', '.join(JOB_STATES)}, got {self.state!r:.80}"
            )
        _check_uint(self.attempt, "JobStatus attempt")
        _check_uint(self.restarts, "JobStatus restarts", 0xFFFFFFFF)
        _check_seconds(self.started_at, "JobStatus started_at")
        _check_uint(self.checkpoints_completed, "JobStatus checkpoints_completed")
        _check_uint(self.checkpoints_failed, "JobStatus checkpoints_failed")
        for name, items, kind, limit in (
            ("tasks", self.tasks, JobTask, MAX_JOB_TASKS),
            ("checkpoints", self.checkpoints, CheckpointRecord, MAX_JOB_CHECKPOINTS),
            ("failures", self.failures, str, MAX_JOB_FAILURES),
        ):
            if not isinstance(items, tuple) or len(items) > limit:
                raise ProtocolError(f"JobStatus {name} must be a list of at most {limit}")
            for item in items:
                if not isinstance(item, kind):
                    raise ProtocolError(f"JobStatus {name} holds a {type(item).__name__}")
        for text in self.failures:
            if len(text) > MAX_JOB_FAILURE_LENGTH:
                raise ProtocolError(
                    f"a JobStatus failure is at most {MAX_JOB_FAILURE_LENGTH} characters"
                )


# -- codecs ------------------------------------------------------------------------------


def _unpack_map(body: memoryview, keys: tuple[str, ...]) -> dict[str, Any]:
    try:
        obj = msgpack.unpackb(body, raw=False, strict_map_key=True)
    except Exception as e:  # msgpack raises a zoo of exception types
        raise ProtocolError(f"malformed control body: {e}") from e
    if not isinstance(obj, dict) or set(obj) != set(keys):
        raise ProtocolError(f"control body must be a map with keys {sorted(keys)}")
    return obj


def _str(v: Any, name: str) -> str:
    if not isinstance(v, str):
        raise ProtocolError(f"{name} must be a string")
    return v


def _uint(v: Any, name: str, limit: int = 0xFFFFFFFF) -> int:
    if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v <= limit:
        raise ProtocolError(f"{name} must be an int in [0, {limit}]")
    return v


def _pack(obj: dict[str, Any]) -> list[bytes]:
    return [msgpack.packb(obj)]


def _dec_abandon(m: dict[str, Any]) -> tuple[str, int]:
    return _str(m["dataset"], "dataset"), _uint(m["subpartition"], "subpartition")


def _dec_create(body: memoryview) -> CreatePartition:
    try:
        m = _unpack_map(body, ("dataset", "index", "attempt", "blocking", "n", "shm"))
    except ProtocolError:  # a task that does not map shared memory leaves "shm" out
        m = _unpack_map(body, ("dataset", "index", "attempt", "blocking", "n"))
        m["shm"] = False
    if not isinstance(m["shm"], bool):
        raise ProtocolError("shm must be a bool")
    try:
        pid = ResultPartitionID(
            _str(m["dataset"], "dataset"),
            _uint(m["index"], "index"),
            _uint(m["attempt"], "attempt", 2**64 - 1),
        )
    except ValueError as e:
        raise ProtocolError(f"bad partition id: {e}") from e
    if not isinstance(m["blocking"], bool):
        raise ProtocolError("blocking must be a bool")
    n = _uint(m["n"], "n")
    if n == 0:
        raise ProtocolError("a partition needs at least one subpartition")
    return CreatePartition(pid, m["blocking"], n, m["shm"])


def _enc_create(m: CreatePartition) -> list[bytes]:
    p = m.partition_id
    return _pack(
        {
            "dataset": p.dataset_id,
            "index": p.partition_index,
            "attempt": p.attempt_id,
            "blocking": m.blocking,
            "n": m.num_subpartitions,
            "shm": m.shared_memory,
        }
    )


def _segments(v: Any, name: str) -> tuple[int, ...]:
    if not isinstance(v, list) or not 0 < len(v) <= _MAX_GRANT:
        raise ProtocolError(f"{name} must be a list of 1 to {_MAX_GRANT} segment indices")
    return tuple(_uint(i, name) for i in v)


def _dec_grant(body: memoryview) -> GrantSegments:
    """The daemon's canonical grant read in C (``segment_grants``); any other body the
    general way, which raises the ProtocolError naming what is wrong."""
    segs = grant_indices(body, _MAX_GRANT)
    if segs is None:
        segs = _segments(_unpack_map(body, ("segments",))["segments"], "segments")
    return GrantSegments(segs)


def _dec_arena(body: memoryview) -> SharedArena:
    m = _unpack_map(body, ("token", "size", "segments", "segment_size"))
    token = m["token"]
    if not isinstance(token, bytes) or len(token) != ARENA_TOKEN_SIZE:
        raise ProtocolError(f"token must be {ARENA_TOKEN_SIZE} bytes")
    size = _uint(m["size"], "size", 2**48)
    if size == 0:
        raise ProtocolError("an arena of zero bytes")
    segs = () if m["segments"] == [] else _segments(m["segments"], "segments")
    seg_size = _uint(m["segment_size"], "segment_size")
    if seg_size == 0 or size % seg_size:
        raise ProtocolError(
            f"an arena of {size} bytes is no whole number of {seg_size}-byte segments"
        )
    return SharedArena(token, size, segs, seg_size)


def _dec_commits(body: memoryview) -> CommitSegments:
    n, rest = divmod(len(body), _COMMIT.size)
    if n == 0 or rest:
        raise ProtocolError(f"CommitSegments body of {len(body)} bytes: not entries of 12")
    return CommitSegments(tuple(_COMMIT.iter_unpack(body)))


def encode_commit(segment: int, length: int, subpartition: int) -> bytes:
    """One CommitSegments entry (a frame's body is a run of them)."""
    return _COMMIT.pack(segment, length, subpartition)


def pack_shared_buffer(
    receiver_id: int,
    sequence_number: int,
    backlog: int,
    compressed: bool,
    segment: int,
    offset: int,
    size: int,
) -> bytes:
    """One SharedBufferResponse entry (a frame's body is a run of 1 to 128 of them)."""
    return _SHARED_BUFFER.pack(
        receiver_id, sequence_number, backlog, 0, compressed, segment, offset, size
    )


def encode_shared_buffers(entries: list[bytes]) -> bytes:
    """A whole SharedBufferResponse frame of packed entries (``pack_shared_buffer``)."""
    n = len(entries)
    if not 0 < n <= MAX_SHARED_BUFFERS:
        raise ProtocolError(f"SharedBufferResponse of {n} buffers (1 to {MAX_SHARED_BUFFERS})")
    body = b"".join(entries)
    header = _COMMIT_HEADER.pack(
        FRAME_HEADER_SIZE + len(body), MAGIC, SharedBufferResponse.MESSAGE_ID
    )
    return header + body


def _dec_shared_buffers(body: memoryview) -> SharedBufferResponse:
    n, rest = divmod(len(body), _SHARED_BUFFER.size)
    if not 0 < n <= MAX_SHARED_BUFFERS or rest:
        raise ProtocolError(f"SharedBufferResponse body of {len(body)} bytes")
    entries = tuple(_SHARED_BUFFER.iter_unpack(body))
    for e in entries:
        if e[3] or e[4] > 1:  # not a data buffer, or compressed neither 0 nor 1
            raise ProtocolError(
                f"SharedBufferResponse entry of data type {e[3]}, compressed {e[4]}"
            )
    return SharedBufferResponse(entries)


def _enc_shared_buffers(m: SharedBufferResponse) -> list[bytes]:
    body = [_SHARED_BUFFER.pack(*e) for e in m.buffers]
    return [encode_shared_buffers(body)[FRAME_HEADER_SIZE:]]


def encode_recycle(segments: list[int]) -> bytes:
    """A whole RecycleSegments frame of ``segments`` (1 to 2^16 indices)."""
    n = len(segments)
    if not 0 < n <= _MAX_RECYCLE:
        raise ProtocolError(f"RecycleSegments of {n} segments (1 to {_MAX_RECYCLE})")
    return _COMMIT_HEADER.pack(
        FRAME_HEADER_SIZE + 4 * n, MAGIC, RecycleSegments.MESSAGE_ID
    ) + struct.pack(f">{n}I", *segments)


def _dec_recycle(body: memoryview) -> RecycleSegments:
    n, rest = divmod(len(body), 4)
    if n == 0 or rest or n > _MAX_RECYCLE:
        raise ProtocolError(f"RecycleSegments body of {len(body)} bytes")
    return RecycleSegments(struct.unpack(f">{n}I", body))


def _dec_push(body: memoryview) -> PushBuffer:
    if len(body) < _PUSH.size:
        raise ProtocolError("PushBuffer body too short")
    sub, dt = _PUSH.unpack_from(body)
    try:
        data_type = DataType(dt)
    except ValueError:
        raise ProtocolError(f"bad data type {dt}") from None
    return PushBuffer(sub, data_type, body[_PUSH.size :])


def _enc_push(m: PushBuffer) -> list[bytes | memoryview]:
    return [_PUSH.pack(m.subpartition, m.data_type), m.payload]


def _dec_output_state(body: memoryview) -> OutputChannelState:
    if len(body) < _OUTPUT_STATE.size:
        raise ProtocolError("OutputChannelState body too short")
    cid, sub = _OUTPUT_STATE.unpack_from(body)
    return OutputChannelState(cid, sub, body[_OUTPUT_STATE.size :])


def _enc_output_state(m: OutputChannelState) -> list[bytes | memoryview]:
    return [_OUTPUT_STATE.pack(m.checkpoint_id, m.subpartition), m.payload]


_STATE_COMPLETE_KEYS: Final = ("checkpoint", "subpartition", "buffers", "bytes")


def _dec_output_state_complete(body: memoryview) -> OutputChannelStateComplete:
    m = _unpack_map(body, _STATE_COMPLETE_KEYS)
    return OutputChannelStateComplete(*(m[k] for k in _STATE_COMPLETE_KEYS))


def _enc_output_state_complete(m: OutputChannelStateComplete) -> list[bytes]:
    return _pack(
        {
            "checkpoint": m.checkpoint_id,
            "subpartition": m.subpartition,
            "buffers": m.buffers,
            "bytes": m.num_bytes,
        }
    )


def _register() -> None:
    register_message(64, CreatePartition, _dec_create, _enc_create)
    register_message(
        65,
        PartitionCreated,
        lambda b: PartitionCreated(
            **{k: _uint(v, k) for k, v in _unpack_map(b, ("credit", "segment_size")).items()}
        ),
        lambda m: _pack({"credit": m.credit, "segment_size": m.segment_size}),
    )
    register_message(66, PushBuffer, _dec_push, _enc_push)
    register_message(
        67,
        AddProducerCredit,
        lambda b: AddProducerCredit(_uint(_unpack_map(b, ("credit",))["credit"], "credit")),
        lambda m: _pack({"credit": m.credit}),
    )
    register_message(
        68,
        FinishPartition,
        lambda b: (_unpack_map(b, ()), FinishPartition())[1],
        lambda m: _pack({}),
    )
    register_message(
        69,
        PartitionFinished,
        lambda b: PartitionFinished(
            **{
                k: _uint(v, k, 2**64 - 1)
                for k, v in _unpack_map(b, ("bytes_written", "buffers_written")).items()
            }
        ),
        lambda m: _pack({"bytes_written": m.bytes_written, "buffers_written": m.buffers_written}),
    )
    register_message(
        70,
        FailPartition,
        lambda b: FailPartition(_str(_unpack_map(b, ("reason",))["reason"], "reason")),
        lambda m: _pack({"reason": m.reason[:2048]}),
    )
    register_message(
        71,
        ReleaseDataset,
        lambda b: ReleaseDataset(_str(_unpack_map(b, ("dataset",))["dataset"], "dataset")),
        lambda m: _pack({"dataset": m.dataset_id}),
    )
    register_message(
        89,
        AbandonSubpartition,
        lambda b: AbandonSubpartition(*_dec_abandon(_unpack_map(b, ("dataset", "subpartition")))),
        lambda m: _pack({"dataset": m.dataset_id, "subpartition": m.subpartition}),
    )
    register_message(
        72,
        Released,
        lambda b: Released(_uint(_unpack_map(b, ("count",))["count"], "count")),
        lambda m: _pack({"count": m.count}),
    )
    register_message(
        73,
        DaemonInfoRequest,
        lambda b: (_unpack_map(b, ()), DaemonInfoRequest())[1],
        lambda m: _pack({}),
    )
    register_message(
        74,
        DaemonInfo,
        lambda b: _dec_info(_unpack_map(b, ("id", "data", "segment_size", "settings"))),
        lambda m: _pack(
            {
                "id": m.daemon_id,
                "data": m.data_address,
                "segment_size": m.segment_size,
                "settings": m.settings,
            }
        ),
    )
    register_message(
        75,
        ProducerBufferSize,
        lambda b: ProducerBufferSize(
            **{k: _uint(v, k) for k, v in _unpack_map(b, ("subpartition", "buffer_size")).items()}
        ),
        lambda m: _pack({"subpartition": m.subpartition, "buffer_size": m.buffer_size}),
    )
    register_message(
        76,
        TaskMetrics,
        _dec_task_metrics,
        lambda m: _pack({"task": m.task, "gate": m.gate, "metrics": m.metrics}),
    )
    register_message(77, JobStatus, _dec_job_status, _enc_job_status)
    register_message(78, OutputChannelState, _dec_output_state, _enc_output_state)
    register_message(
        79, OutputChannelStateComplete, _dec_output_state_complete, _enc_output_state_complete
    )
    register_message(
        88,
        RequestOverdraft,
        lambda b: RequestOverdraft(_uint(_unpack_map(b, ("count",))["count"], "count")),
        lambda m: _pack({"count": m.count}),
    )
    register_message(
        80,
        SharedArena,
        _dec_arena,
        lambda m: _pack(
            {
                "token": m.token,
                "size": m.arena_size,
                "segments": list(m.segments),
                "segment_size": m.segment_size,
            }
        ),
    )
    register_message(
        81,
        GrantSegments,
        _dec_grant,
        lambda m: _pack({"segments": list(m.segments)}),
    )
    register_message(
        83, RequestArena, lambda b: (_unpack_map(b, ()), RequestArena())[1], lambda m: _pack({})
    )
    register_message(
        84, ArenaMapped, lambda b: (_unpack_map(b, ()), ArenaMapped())[1], lambda m: _pack({})
    )
    register_message(
        87,
        NoArena,
        lambda b: NoArena(_str(_unpack_map(b, ("reason",))["reason"], "reason")),
        lambda m: _pack({"reason": m.reason[:2048]}),
    )
    register_message(85, SharedBufferResponse, _dec_shared_buffers, _enc_shared_buffers)
    register_message(
        86,
        RecycleSegments,
        _dec_recycle,
        lambda m: [encode_recycle(list(m.segments))[FRAME_HEADER_SIZE:]],
    )
    register_message(
        82,
        CommitSegments,
        _dec_commits,
        lambda m: [b"".join(_COMMIT.pack(*c) for c in m.commits)],
    )


_TASK_KEYS: Final = ("task", "name", "subtask", "outputs", "channels", "in", "out")
_CHECKPOINT_KEYS: Final = (
    "id",
    "status",
    "trigger",
    "duration",
    "alignment",
    "aligned",
    "size",
    "unaligned",
    "persisted",
)
_JOB_KEYS: Final = (
    "job",
    "state",
    "attempt",
    "restarts",
    "started",
    "completed",
    "failed",
    "tasks",
    "checkpoints",
    "failures",
)


def _exact_map(v: Any, keys: tuple[str, ...], what: str) -> dict[str, Any]:
    if not isinstance(v, dict) or set(v) != set(keys):
        raise ProtocolError(f"{what} must be a map with keys {sorted(keys)}")
    return v


def _exact_dict(v: Any, what: str) -> list[tuple[Any, Any]]:
    if not isinstance(v, dict) or len(v) > MAX_JOB_TASKS:
        raise ProtocolError(f"{what} must be a map of at most {MAX_JOB_TASKS} entries")
    return list(v.items())


def _list(v: Any, what: str, limit: int) -> list[Any]:
    if not isinstance(v, list) or len(v) > limit:
        raise ProtocolError(f"{what} must be a list of at most {limit}")
    return v


def _dec_job_status(body: memoryview) -> JobStatus:
    m = _unpack_map(body, _JOB_KEYS)
    tasks = []
    for t in _list(m["tasks"], "tasks", MAX_JOB_TASKS):
        t = _exact_map(t, _TASK_KEYS, "a JobStatus task")
        outputs = _list(t["outputs"], "outputs", 8)
        tasks.append(
            JobTask(
                t["task"],
                t["name"],
                t["subtask"],
                tuple(outputs),
                t["channels"],
                t["in"],
                t["out"],
            )
        )
    checkpoints = []
    for c in _list(m["checkpoints"], "checkpoints", MAX_JOB_CHECKPOINTS):
        c = _exact_map(c, _CHECKPOINT_KEYS, "a JobStatus checkpoint")
        checkpoints.append(
            CheckpointRecord(
                c["id"],
                c["status"],
                c["trigger"],
                c["duration"],
                c["alignment"],
                c["aligned"],
                c["size"],
                c["unaligned"],
                tuple(
                    (task, nbytes)
                    for task, nbytes in _exact_dict(c["persisted"], "a checkpoint's persisted")
                ),
            )
        )
    failures = _list(m["failures"], "failures", MAX_JOB_FAILURES)
    for f in failures:
        _str(f, "a failure")
    return JobStatus(
        m["job"],
        m["state"],
        m["attempt"],
        m["restarts"],
        m["started"],
        m["completed"],
        m["failed"],
        tuple(tasks),
        tuple(checkpoints),
        tuple(failures),
    )


def _enc_job_status(m: JobStatus) -> list[bytes]:
    return _pack(
        {
            "job": m.job,
            "state": m.state,
            "attempt": m.attempt,
            "restarts": m.restarts,
            "started": m.started_at,
            "completed": m.checkpoints_completed,
            "failed": m.checkpoints_failed,
            "tasks": [
                {
                    "task": t.task,
                    "name": t.name,
                    "subtask": t.subtask,
                    "outputs": list(t.outputs),
                    "channels": t.channels,
                    "in": t.records_in,
                    "out": t.records_out,
                }
                for t in m.tasks
            ],
            "checkpoints": [
                {
                    "id": c.checkpoint_id,
                    "status": c.status,
                    "trigger": c.trigger_time,
                    "duration": c.duration,
                    "alignment": c.alignment,
                    "aligned": c.aligned_bytes,
                    "size": c.state_bytes,
                    "unaligned": c.unaligned,
                    "persisted": dict(c.persisted_bytes),
                }
                for c in m.checkpoints
            ],
            "failures": list(m.failures),
        }
    )


def _dec_task_metrics(body: memoryview) -> TaskMetrics:
    m = _unpack_map(body, ("task", "gate", "metrics"))
    return TaskMetrics(m["task"], m["gate"], m["metrics"])


def _dec_info(m: dict[str, Any]) -> DaemonInfo:
    settings = m["settings"]
    if not isinstance(settings, dict) or len(settings) > 64:
        raise ProtocolError("settings must be a map of at most 64 entries")
    for k, v in settings.items():
        if not isinstance(k, str) or not (v is None or isinstance(v, (int, float, bool))):
            raise ProtocolError("settings must map names to numbers, booleans or nil")
    return DaemonInfo(
        _str(m["id"], "id"),
        _str(m["data"], "data"),
        _uint(m["segment_size"], "segment_size"),
        settings,
    )


_register()
