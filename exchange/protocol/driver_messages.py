"""Messages of the driver's two services (ids 128..159), spoken by the tasks it launches.

Both run on the project's framing (``exchange.protocol.codec``: ``length u32 | magic u32 |
id u8 | body``, the limit checked at the header, before a byte of the body is read); the
bodies are msgpack maps with exactly the keys of their fields, every field checked by the
message's constructor: whatever does not decode into a valid message raises
``ProtocolError`` (``UnknownMessageError`` for an id the side does not accept,
``FrameTooLargeError`` past its limit).

**Rendezvous** (``client.rendezvous``; one connection per request): a task of a pipelined
exchange sends MeetRequest (the exchange's token, the round, its TaskLocation) and is
answered, once every index of its round has registered, with Met (every location, index
order); AbortRound (the task failed) is answered with an empty Met. A request that can
never be answered gets RendezvousRefused, whose ``kind`` says which error the task raises.

**Control** (``client.streaming.control``; one connection per streaming task, for the
task's life). Task -> driver: RegisterTask first (token and attempt of the job attempt,
task id, its local daemon), then CheckpointAck, CheckpointDecline, SourceExhausted,
TaskFinished (its collect sinks' records, pickled) and TaskFailed. Driver -> task:
RegistrationRefused (and the connection closes), StartTask (every task's daemon, the
checkpoint to restore), CheckpointTrigger (sources), CheckpointComplete, CheckpointAbort,
StopInput (sources: end the input now, as if exhausted), FinishTask (after the final
checkpoint: end the stream), CancelTask (fail now; the driver itself cancels through
Spark, this is for a driver that cannot).
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar, Final, TypeVar

from exchange.checkpointing.barrier_handler import CheckpointFailureReason
from exchange.errors import ProtocolError
from exchange.protocol.codec import register_message
from exchange.protocol.local_messages import _check_seconds, _check_uint, _pack, _unpack_map
from exchange.protocol.messages import Message

__all__ = [
    "CONTROL_MESSAGE_IDS",
    "MAX_ERROR_TEXT",
    "MAX_TOKEN_LENGTH",
    "RENDEZVOUS_MESSAGE_IDS",
    "AbortRound",
    "CancelTask",
    "CheckpointAbort",
    "CheckpointAck",
    "CheckpointComplete",
    "CheckpointDecline",
    "CheckpointTrigger",
    "FinishTask",
    "MeetRequest",
    "Met",
    "RefusalKind",
    "RegisterTask",
    "RegistrationRefused",
    "RendezvousRefused",
    "RestorePoint",
    "SourceExhausted",
    "StartTask",
    "StopInput",
    "TaskDaemon",
    "TaskFailed",
    "TaskFinished",
    "TaskLocation",
]

#: Longest exchange token, exchange id or job token (characters).
MAX_TOKEN_LENGTH: Final = 256
#: Longest name (task id, daemon id, operator uid, sink name) or address (characters).
_MAX_NAME: Final = 4096
#: Longest error or refusal text (characters).
MAX_ERROR_TEXT: Final = 16384
_U32: Final = 0xFFFFFFFF
_I63: Final = 2**63 - 1
_U64: Final = 2**64 - 1


# -- field checks (each raises ProtocolError naming the field) ----------------------------


def _text(v: Any, what: str, limit: int = _MAX_NAME, *, empty: bool = False) -> None:
    if not isinstance(v, str) or len(v) > limit or (not v and not empty):
        lo = 0 if empty else 1
        raise ProtocolError(f"{what} must be a string of {lo} to {limit} characters, got {v!r:.80}")


def _flag(v: Any, what: str) -> None:
    if not isinstance(v, bool):
        raise ProtocolError(f"{what} must be a bool, got {v!r:.80}")


def _map(v: Any, what: str) -> dict[Any, Any]:
    if not isinstance(v, dict):
        raise ProtocolError(f"{what} must be a map, got {type(v).__name__}")
    return v


# -- rendezvous ---------------------------------------------------------------------------

#: Ids of the rendezvous service's messages (its frame decoders accept only these).
RENDEZVOUS_MESSAGE_IDS: Final = range(128, 132)


@dataclass(frozen=True, slots=True)
class TaskLocation:
    """Where task ``index`` (attempt ``attempt``) of a pipelined exchange writes: its
    partition's daemon (id, data port, local socket) and that daemon's segment size."""

    index: int
    attempt: int
    daemon_id: str
    data_address: str
    local_socket: str
    segment_size: int

    def __post_init__(self) -> None:
        _check_uint(self.index, "location index", _U32)
        _check_uint(self.attempt, "location attempt", _U64)
        _text(self.daemon_id, "location daemon_id")
        _text(self.data_address, "location data_address")
        _text(self.local_socket, "location local_socket", empty=True)
        _check_uint(self.segment_size, "location segment_size", _U32)


@dataclass(frozen=True, slots=True)
class MeetRequest(Message):
    """Task -> driver: register ``location`` in round ``round_id`` of exchange
    ``exchange_id`` and wait for the others."""

    MESSAGE_ID: ClassVar[int] = 128
    exchange_id: str
    token: str = field(repr=False)
    round_id: int
    location: TaskLocation

    def __post_init__(self) -> None:
        _text(self.exchange_id, "MeetRequest exchange_id", MAX_TOKEN_LENGTH)
        _text(self.token, "MeetRequest token", MAX_TOKEN_LENGTH)
        _check_uint(self.round_id, "MeetRequest round_id", _I63)
        if not isinstance(self.location, TaskLocation):
            raise ProtocolError("MeetRequest location must be a TaskLocation")


@dataclass(frozen=True, slots=True)
class AbortRound(Message):
    """Task -> driver: task ``index`` (attempt ``attempt``) of round ``round_id`` failed."""

    MESSAGE_ID: ClassVar[int] = 129
    exchange_id: str
    token: str = field(repr=False)
    round_id: int
    index: int
    attempt: int

    def __post_init__(self) -> None:
        _text(self.exchange_id, "AbortRound exchange_id", MAX_TOKEN_LENGTH)
        _text(self.token, "AbortRound token", MAX_TOKEN_LENGTH)
        _check_uint(self.round_id, "AbortRound round_id", _I63)
        _check_uint(self.index, "AbortRound index", _U32)
        _check_uint(self.attempt, "AbortRound attempt", _U64)


@dataclass(frozen=True, slots=True)
class Met(Message):
    """Driver -> task: every location of the round, in index order (none for AbortRound)."""

    MESSAGE_ID: ClassVar[int] = 130
    locations: tuple[TaskLocation, ...]

    def __post_init__(self) -> None:
        if not isinstance(self.locations, tuple) or not all(
            isinstance(loc, TaskLocation) for loc in self.locations
        ):
            raise ProtocolError("Met locations must be a list of TaskLocations")


class RefusalKind(enum.Enum):
    """Why the driver refused a rendezvous request: the task raises SchedulingError
    (``SCHEDULING``), UsageError (``USAGE``), or TransportError (``BAD_REQUEST``: an
    unknown exchange, a bad token, an index out of range)."""

    SCHEDULING = "scheduling"
    USAGE = "usage"
    BAD_REQUEST = "bad-request"


@dataclass(frozen=True, slots=True)
class RendezvousRefused(Message):
    MESSAGE_ID: ClassVar[int] = 131
    kind: RefusalKind
    message: str

    def __post_init__(self) -> None:
        if not isinstance(self.kind, RefusalKind):
            raise ProtocolError(f"RendezvousRefused kind must be a RefusalKind, got {self.kind!r}")
        _text(self.message, "RendezvousRefused message", MAX_ERROR_TEXT, empty=True)


# -- control ------------------------------------------------------------------------------

#: Ids of the control service's messages (its frame decoders accept only these).
CONTROL_MESSAGE_IDS: Final = range(136, 150)


@dataclass(frozen=True, slots=True)
class TaskDaemon:
    """The daemon a streaming task runs beside: its id, data port and local socket."""

    daemon_id: str
    data_address: str
    local_socket: str

    def __post_init__(self) -> None:
        _text(self.daemon_id, "daemon id")
        _text(self.data_address, "daemon data_address")
        _text(self.local_socket, "daemon local_socket", empty=True)


@dataclass(frozen=True, slots=True)
class RegisterTask(Message):
    """Task -> driver, first: task ``task_id`` of job attempt ``attempt`` (fenced by the
    attempt's ``token``) runs beside ``daemon``."""

    MESSAGE_ID: ClassVar[int] = 136
    token: str = field(repr=False)
    attempt: int
    task_id: str
    daemon: TaskDaemon

    def __post_init__(self) -> None:
        _text(self.token, "RegisterTask token", MAX_TOKEN_LENGTH)
        _check_uint(self.attempt, "RegisterTask attempt", _I63)
        _text(self.task_id, "RegisterTask task_id", MAX_TOKEN_LENGTH)
        if not isinstance(self.daemon, TaskDaemon):
            raise ProtocolError("RegisterTask daemon must be a TaskDaemon")


@dataclass(frozen=True, slots=True)
class RegistrationRefused(Message):
    """Driver -> task: not a task of this attempt (or a wrong token); the driver closes."""

    MESSAGE_ID: ClassVar[int] = 137
    reason: str

    def __post_init__(self) -> None:
        _text(self.reason, "RegistrationRefused reason", MAX_ERROR_TEXT, empty=True)


@dataclass(frozen=True, slots=True)
class RestorePoint:
    """The checkpoint an attempt restores: for each operator uid, the state file each
    of its old subtasks wrote (None: that subtask had none)."""

    checkpoint_id: int
    operators: Mapping[str, tuple[str | None, ...]] = field(compare=False)

    def __post_init__(self) -> None:
        _check_uint(self.checkpoint_id, "RestorePoint checkpoint_id", _I63)
        if not isinstance(self.operators, Mapping):
            raise ProtocolError("RestorePoint operators must be a map")
        for uid, files in self.operators.items():
            _text(uid, "RestorePoint operator uid")
            if not isinstance(files, tuple):
                raise ProtocolError("RestorePoint files must be a list")
            for f in files:
                if f is not None:
                    _text(f, "RestorePoint file")


@dataclass(frozen=True, slots=True)
class StartTask(Message):
    """Driver -> every task, once all registered: each task's daemon (by task id) and
    the checkpoint to restore (None: a fresh start)."""

    MESSAGE_ID: ClassVar[int] = 138
    daemons: Mapping[str, TaskDaemon] = field(compare=False)
    restore: RestorePoint | None

    def __post_init__(self) -> None:
        if not isinstance(self.daemons, Mapping):
            raise ProtocolError("StartTask daemons must be a map")
        for task, daemon in self.daemons.items():
            _text(task, "StartTask task id", MAX_TOKEN_LENGTH)
            if not isinstance(daemon, TaskDaemon):
                raise ProtocolError("StartTask daemons must map task ids to TaskDaemons")
        if self.restore is not None and not isinstance(self.restore, RestorePoint):
            raise ProtocolError("StartTask restore must be a RestorePoint or nil")


@dataclass(frozen=True, slots=True)
class CheckpointTrigger(Message):
    """Driver -> source tasks: take checkpoint ``checkpoint_id`` (barrier timestamp in
    wall-clock milliseconds)."""

    MESSAGE_ID: ClassVar[int] = 139
    checkpoint_id: int
    timestamp: int
    exactly_once: bool = True

    def __post_init__(self) -> None:
        _check_uint(self.checkpoint_id, "CheckpointTrigger checkpoint_id", _I63)
        _check_uint(self.timestamp, "CheckpointTrigger timestamp", _I63)
        _flag(self.exactly_once, "CheckpointTrigger exactly_once")


@dataclass(frozen=True, slots=True)
class CheckpointComplete(Message):
    MESSAGE_ID: ClassVar[int] = 140
    checkpoint_id: int

    def __post_init__(self) -> None:
        _check_uint(self.checkpoint_id, "CheckpointComplete checkpoint_id", _I63)


@dataclass(frozen=True, slots=True)
class CheckpointAbort(Message):
    MESSAGE_ID: ClassVar[int] = 141
    checkpoint_id: int

    def __post_init__(self) -> None:
        _check_uint(self.checkpoint_id, "CheckpointAbort checkpoint_id", _I63)


@dataclass(frozen=True, slots=True)
class StopInput(Message):
    """Driver -> source tasks: a clean stop, end the input now as if exhausted."""

    MESSAGE_ID: ClassVar[int] = 142


@dataclass(frozen=True, slots=True)
class FinishTask(Message):
    """Driver -> every task, after the final checkpoint completed: end the stream."""

    MESSAGE_ID: ClassVar[int] = 143


@dataclass(frozen=True, slots=True)
class CancelTask(Message):
    """Driver -> task: fail now (the task raises StreamTaskFailed)."""

    MESSAGE_ID: ClassVar[int] = 149


@dataclass(frozen=True, slots=True)
class CheckpointAck(Message):
    """Task -> driver: its state of ``checkpoint_id`` is written (``handle``), with the
    task's figures (Flink's CheckpointMetrics and more): the state's size, for a task
    that reads its alignment (seconds) and the bytes processed or parked meanwhile,
    its records so far, and, in unaligned mode, whether this task's snapshot was
    unaligned and the in-flight bytes it persisted."""

    MESSAGE_ID: ClassVar[int] = 144
    checkpoint_id: int
    handle: str
    state_bytes: int
    records_in: int
    records_out: int
    alignment: float | None = None
    aligned_bytes: int = 0
    unaligned: bool = False
    persisted_bytes: int = 0

    def __post_init__(self) -> None:
        _check_uint(self.checkpoint_id, "CheckpointAck checkpoint_id", _I63)
        _text(self.handle, "CheckpointAck handle")
        for name in ("state_bytes", "records_in", "records_out", "aligned_bytes"):
            _check_uint(getattr(self, name), f"CheckpointAck {name}", _U64)
        if self.alignment is not None:
            _check_seconds(self.alignment, "CheckpointAck alignment")
        _flag(self.unaligned, "CheckpointAck unaligned")
        _check_uint(self.persisted_bytes, "CheckpointAck persisted_bytes", _U64)


@dataclass(frozen=True, slots=True)
class CheckpointDecline(Message):
    MESSAGE_ID: ClassVar[int] = 145
    checkpoint_id: int
    reason: CheckpointFailureReason

    def __post_init__(self) -> None:
        _check_uint(self.checkpoint_id, "CheckpointDecline checkpoint_id", _I63)
        if not isinstance(self.reason, CheckpointFailureReason):
            raise ProtocolError(f"CheckpointDecline reason {self.reason!r:.80} is unknown")


@dataclass(frozen=True, slots=True)
class SourceExhausted(Message):
    """Task -> driver: a bounded source ran out (the final checkpoint may come)."""

    MESSAGE_ID: ClassVar[int] = 146


@dataclass(frozen=True, slots=True)
class TaskFinished(Message):
    """Task -> driver: the task ended; ``results``: each collect sink's records, pickled
    (exact types; the driver unpickles only after the token admitted the task)."""

    MESSAGE_ID: ClassVar[int] = 147
    records_in: int
    results: Mapping[str, bytes] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        _check_uint(self.records_in, "TaskFinished records_in", _U64)
        if not isinstance(self.results, Mapping):
            raise ProtocolError("TaskFinished results must be a map")
        for name, blob in self.results.items():
            _text(name, "TaskFinished sink name")
            if not isinstance(blob, bytes):
                raise ProtocolError("TaskFinished results must be binary")


@dataclass(frozen=True, slots=True)
class TaskFailed(Message):
    """Task -> driver: the task failed with ``error`` at ``time`` (its wall clock), which
    is a ``consequence`` of another failure or not."""

    MESSAGE_ID: ClassVar[int] = 148
    error: str
    time: float
    consequence: bool

    def __post_init__(self) -> None:
        _text(self.error, "TaskFailed error", MAX_ERROR_TEXT, empty=True)
        _check_seconds(self.time, "TaskFailed time")
        _flag(self.consequence, "TaskFailed consequence")


# -- codecs -------------------------------------------------------------------------------

_M = TypeVar("_M", bound=Message)


def _names(cls: type[Any]) -> tuple[str, ...]:
    return tuple(f.name for f in fields(cls))


def _flat(cls: type[_M]) -> tuple[Callable[[memoryview], _M], Callable[[_M], list[bytes]]]:
    """The codec of a message whose fields are plain values: a map keyed by field name."""
    names = _names(cls)
    return (
        lambda body: cls(**_unpack_map(body, names)),
        lambda m: _pack({n: getattr(m, n) for n in names}),
    )


_LOCATION_KEYS: Final = _names(TaskLocation)
_DAEMON_KEYS: Final = _names(TaskDaemon)


def _location(v: Any) -> TaskLocation:
    m = _map(v, "a location")
    if set(m) != set(_LOCATION_KEYS):
        raise ProtocolError(f"a location must be a map with keys {sorted(_LOCATION_KEYS)}")
    return TaskLocation(**m)


def _location_map(loc: TaskLocation) -> dict[str, Any]:
    return {n: getattr(loc, n) for n in _LOCATION_KEYS}


def _daemon(v: Any) -> TaskDaemon:
    m = _map(v, "a daemon")
    if set(m) != set(_DAEMON_KEYS):
        raise ProtocolError(f"a daemon must be a map with keys {sorted(_DAEMON_KEYS)}")
    return TaskDaemon(**m)


def _daemon_map(d: TaskDaemon) -> dict[str, Any]:
    return {n: getattr(d, n) for n in _DAEMON_KEYS}


def _dec_meet(body: memoryview) -> MeetRequest:
    m = _unpack_map(body, _names(MeetRequest))
    return MeetRequest(m["exchange_id"], m["token"], m["round_id"], _location(m["location"]))


def _enc_meet(m: MeetRequest) -> list[bytes]:
    return _pack(
        {
            "exchange_id": m.exchange_id,
            "token": m.token,
            "round_id": m.round_id,
            "location": _location_map(m.location),
        }
    )


def _dec_met(body: memoryview) -> Met:
    locations = _unpack_map(body, ("locations",))["locations"]
    if not isinstance(locations, list):
        raise ProtocolError("Met locations must be a list")
    return Met(tuple(_location(loc) for loc in locations))


def _dec_refused(body: memoryview) -> RendezvousRefused:
    m = _unpack_map(body, ("kind", "message"))
    return RendezvousRefused(RefusalKind(m["kind"]), m["message"])  # ValueError: ProtocolError


def _dec_register(body: memoryview) -> RegisterTask:
    m = _unpack_map(body, _names(RegisterTask))
    return RegisterTask(m["token"], m["attempt"], m["task_id"], _daemon(m["daemon"]))


def _enc_register(m: RegisterTask) -> list[bytes]:
    return _pack(
        {
            "token": m.token,
            "attempt": m.attempt,
            "task_id": m.task_id,
            "daemon": _daemon_map(m.daemon),
        }
    )


def _dec_start(body: memoryview) -> StartTask:
    m = _unpack_map(body, ("daemons", "restore"))
    daemons = {task: _daemon(d) for task, d in _map(m["daemons"], "StartTask daemons").items()}
    restore = m["restore"]
    if restore is not None:
        r = _map(restore, "StartTask restore")
        if set(r) != {"checkpoint_id", "operators"}:
            raise ProtocolError("StartTask restore must be a map of checkpoint_id, operators")
        operators = _map(r["operators"], "RestorePoint operators")
        for files in operators.values():
            if not isinstance(files, list):
                raise ProtocolError("RestorePoint files must be a list")
        restore = RestorePoint(r["checkpoint_id"], {k: tuple(v) for k, v in operators.items()})
    return StartTask(daemons, restore)


def _enc_start(m: StartTask) -> list[bytes]:
    r = m.restore
    return _pack(
        {
            "daemons": {task: _daemon_map(d) for task, d in m.daemons.items()},
            "restore": None
            if r is None
            else {
                "checkpoint_id": r.checkpoint_id,
                "operators": {uid: list(files) for uid, files in r.operators.items()},
            },
        }
    )


def _dec_decline(body: memoryview) -> CheckpointDecline:
    m = _unpack_map(body, ("checkpoint_id", "reason"))
    reason = m["reason"]
    if not isinstance(reason, str) or reason not in CheckpointFailureReason.__members__:
        raise ProtocolError(f"CheckpointDecline reason {reason!r:.80} is unknown")
    return CheckpointDecline(m["checkpoint_id"], CheckpointFailureReason[reason])


def _dec_finished(body: memoryview) -> TaskFinished:
    m = _unpack_map(body, ("records_in", "results"))
    return TaskFinished(m["records_in"], _map(m["results"], "TaskFinished results"))


def _register() -> None:
    register_message(128, MeetRequest, _dec_meet, _enc_meet)
    register_message(129, AbortRound, *_flat(AbortRound))
    register_message(
        130,
        Met,
        _dec_met,
        lambda m: _pack({"locations": [_location_map(loc) for loc in m.locations]}),
    )
    register_message(
        131,
        RendezvousRefused,
        _dec_refused,
        lambda m: _pack({"kind": m.kind.value, "message": m.message}),
    )
    register_message(136, RegisterTask, _dec_register, _enc_register)
    register_message(137, RegistrationRefused, *_flat(RegistrationRefused))
    register_message(138, StartTask, _dec_start, _enc_start)
    register_message(139, CheckpointTrigger, *_flat(CheckpointTrigger))
    register_message(140, CheckpointComplete, *_flat(CheckpointComplete))
    register_message(141, CheckpointAbort, *_flat(CheckpointAbort))
    register_message(142, StopInput, *_flat(StopInput))
    register_message(143, FinishTask, *_flat(FinishTask))
    register_message(144, CheckpointAck, *_flat(CheckpointAck))
    register_message(
        145,
        CheckpointDecline,
        _dec_decline,
        lambda m: _pack({"checkpoint_id": m.checkpoint_id, "reason": m.reason.name}),
    )
    register_message(146, SourceExhausted, *_flat(SourceExhausted))
    register_message(
        147,
        TaskFinished,
        _dec_finished,
        lambda m: _pack({"records_in": m.records_in, "results": dict(m.results)}),
    )
    register_message(148, TaskFailed, *_flat(TaskFailed))
    register_message(149, CancelTask, *_flat(CancelTask))


_register()
