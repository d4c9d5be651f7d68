"""The wire protocol's messages: one frozen, slotted dataclass per message.

Control messages check their fields when constructed (a bad value is a ``UsageError`` at
the call site, not a confusing failure on the peer). ``BufferResponse`` does not: it is
built ~50k times a second on the data path, and the codec's struct packing range-checks
its integers when it is encoded.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum
from typing import ClassVar, Final

from exchange.buffers.buffer import DataType
from exchange.errors import (
    AccessDeniedError,
    AuthenticationError,
    ExchangeError,
    LimitExceededError,
    LocalProtocolError,
    PartitionError,
    PartitionNotFoundError,
    PartitionReleasedError,
    ProducerFailedError,
    ProtocolError,
    SpillError,
    TransportError,
    UsageError,
    VersionMismatchError,
)
from exchange.partition.result_partition_id import ResultPartitionID

__all__ = [
    "MAX_APP_ID_BYTES",
    "MAX_ERROR_MESSAGE_BYTES",
    "NONCE_SIZE",
    "PROTOCOL_VERSION",
    "AddCredit",
    "AuthOk",
    "AuthResponse",
    "BufferResponse",
    "CancelPartitionRequest",
    "ClientHello",
    "CloseRequest",
    "DataType",
    "ErrorCode",
    "ErrorResponse",
    "Message",
    "MessageId",
    "NewBufferSize",
    "PartitionRequest",
    "Ping",
    "Pong",
    "ResumeConsumption",
    "ServerHello",
    "check_app_id",
    "error_for_response",
    "error_response_for",
]

PROTOCOL_VERSION: Final = 1
NONCE_SIZE: Final = 16
MAC_SIZE: Final = 32
# Long error texts (tracebacks) are cut so that every control frame stays small.
MAX_ERROR_MESSAGE_BYTES: Final = 2048
#: The longest application id (UTF-8) a ClientHello carries.
MAX_APP_ID_BYTES: Final = 255

_U16: Final = 0xFFFF
_U32: Final = 0xFFFF_FFFF
_U64: Final = 0xFFFF_FFFF_FFFF_FFFF


class MessageId(IntEnum):
    """The id byte of each frame. 64..127 are reserved for the local-endpoint protocol."""

    CLIENT_HELLO = 1
    SERVER_HELLO = 2
    AUTH_RESPONSE = 3
    AUTH_OK = 4
    PARTITION_REQUEST = 10
    BUFFER_RESPONSE = 11
    ADD_CREDIT = 12
    RESUME_CONSUMPTION = 13
    NEW_BUFFER_SIZE = 14
    CANCEL_PARTITION_REQUEST = 15
    CLOSE_REQUEST = 16
    ERROR_RESPONSE = 17
    PING = 18
    PONG = 19


class ErrorCode(IntEnum):
    """What an ``ErrorResponse`` reports."""

    PARTITION_NOT_FOUND = 1
    PRODUCER_FAILED = 2
    PROTOCOL_ERROR = 3
    AUTH_FAILED = 4
    PARTITION_RELEASED = 5
    CANCELLED = 6
    TOO_MANY_CONNECTIONS = 7
    SERVER_SHUTDOWN = 8
    INTERNAL = 9
    VERSION_MISMATCH = 10
    INVALID_REQUEST = 11
    ACCESS_DENIED = 12
    LIMIT_EXCEEDED = 13
    SPILL_FAILED = 14


class Message:
    """Base of every protocol message (also of messages registered by other modules)."""

    __slots__ = ()
    MESSAGE_ID: ClassVar[int]


def _check_uint(name: str, value: int, limit: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= limit:
        raise UsageError(f"{name} must be an int in [0, {limit}], got {value!r}")


def _check_positive(name: str, value: int, limit: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or not 0 < value <= limit:
        raise UsageError(f"{name} must be an int in [1, {limit}], got {value!r}")


def _check_bytes(name: str, value: bytes, size: int) -> None:
    if not isinstance(value, bytes) or len(value) != size:
        raise UsageError(f"{name} must be {size} bytes, got {value!r}")


def check_app_id(app_id: object) -> str:
    """``app_id`` if it is a str of at most ``MAX_APP_ID_BYTES`` UTF-8 bytes, else UsageError."""
    if not isinstance(app_id, str):
        raise UsageError(f"app_id must be a str, got {app_id!r}")
    try:
        n = len(app_id.encode("utf-8"))
    except UnicodeEncodeError:
        raise UsageError(f"app_id {app_id!r} is not encodable as UTF-8") from None
    if n > MAX_APP_ID_BYTES:
        raise UsageError(f"app_id of {n} bytes exceeds {MAX_APP_ID_BYTES}")
    return app_id


# -- handshake ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ClientHello(Message):
    """First message of a connection: the client's protocol version and nonce."""

    MESSAGE_ID: ClassVar[int] = MessageId.CLIENT_HELLO

    version: int
    client_nonce: bytes

    def __post_init__(self) -> None:
        _check_uint("version", self.version, _U16)
        _check_bytes("client_nonce", self.client_nonce, NONCE_SIZE)


@dataclass(frozen=True, slots=True)
class ServerHello(Message):
    """The server's answer to ``ClientHello``."""

    MESSAGE_ID: ClassVar[int] = MessageId.SERVER_HELLO

    version: int
    auth_required: bool
    server_nonce: bytes

    def __post_init__(self) -> None:
        _check_uint("version", self.version, _U16)
        if not isinstance(self.auth_required, bool):
            raise UsageError(f"auth_required must be a bool, got {self.auth_required!r}")
        _check_bytes("server_nonce", self.server_nonce, NONCE_SIZE)


@dataclass(frozen=True, slots=True)
class AuthResponse(Message):
    """The client's proof that it holds the credential of application ``app_id`` (an HMAC
    over both nonces; ``""``: the daemon's secret itself, no application)."""

    MESSAGE_ID: ClassVar[int] = MessageId.AUTH_RESPONSE

    mac: bytes
    app_id: str = ""

    def __post_init__(self) -> None:
        _check_bytes("mac", self.mac, MAC_SIZE)
        check_app_id(self.app_id)


@dataclass(frozen=True, slots=True)
class AuthOk(Message):
    """The server accepted the client and proves that it knows the secret too."""

    MESSAGE_ID: ClassVar[int] = MessageId.AUTH_OK

    server_proof: bytes

    def __post_init__(self) -> None:
        _check_bytes("server_proof", self.server_proof, MAC_SIZE)


# -- client to server ---------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class PartitionRequest(Message):
    """Ask for one subpartition; the server streams it to ``receiver_id``.

    ``floating_credit``: the floating buffers of the reader's gate (credit it can add
    beyond ``initial_credit``), an optional trailing field; None: not sent (a client
    from before it), and the daemon assumes the batch default."""

    MESSAGE_ID: ClassVar[int] = MessageId.PARTITION_REQUEST

    partition_id: ResultPartitionID
    subpartition_index: int
    receiver_id: int
    initial_credit: int
    floating_credit: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.partition_id, ResultPartitionID):
            raise UsageError(f"partition_id must be a ResultPartitionID, got {self.partition_id!r}")
        _check_uint("subpartition_index", self.subpartition_index, _U32)
        _check_uint("receiver_id", self.receiver_id, _U64)
        _check_uint("initial_credit", self.initial_credit, _U32)
        if self.floating_credit is not None:
            _check_uint("floating_credit", self.floating_credit, _U32)


@dataclass(frozen=True, slots=True)
class AddCredit(Message):
    """The receiver has ``credit`` more buffers for this channel (sent on 0 -> positive)."""

    MESSAGE_ID: ClassVar[int] = MessageId.ADD_CREDIT

    receiver_id: int
    credit: int

    def __post_init__(self) -> None:
        _check_uint("receiver_id", self.receiver_id, _U64)
        _check_positive("credit", self.credit, _U32)


@dataclass(frozen=True, slots=True)
class ResumeConsumption(Message):
    """Unblock a channel that a checkpoint barrier blocked."""

    MESSAGE_ID: ClassVar[int] = MessageId.RESUME_CONSUMPTION

    receiver_id: int

    def __post_init__(self) -> None:
        _check_uint("receiver_id", self.receiver_id, _U64)


@dataclass(frozen=True, slots=True)
class NewBufferSize(Message):
    """Buffer debloating: the producer should cut buffers of at most ``buffer_size`` bytes."""

    MESSAGE_ID: ClassVar[int] = MessageId.NEW_BUFFER_SIZE

    receiver_id: int
    buffer_size: int

    def __post_init__(self) -> None:
        _check_uint("receiver_id", self.receiver_id, _U64)
        _check_positive("buffer_size", self.buffer_size, _U32)


@dataclass(frozen=True, slots=True)
class CancelPartitionRequest(Message):
    """The receiver no longer wants this channel's data."""

    MESSAGE_ID: ClassVar[int] = MessageId.CANCEL_PARTITION_REQUEST

    receiver_id: int

    def __post_init__(self) -> None:
        _check_uint("receiver_id", self.receiver_id, _U64)


@dataclass(frozen=True, slots=True)
class CloseRequest(Message):
    """The client is done with the connection; the server releases its readers."""

    MESSAGE_ID: ClassVar[int] = MessageId.CLOSE_REQUEST


@dataclass(frozen=True, slots=True)
class Pong(Message):
    """The answer to a ``Ping``: the client read everything the daemon sent before it."""

    MESSAGE_ID: ClassVar[int] = MessageId.PONG


# -- server to client ---------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class BufferResponse(Message):
    """One buffer (data or event) of a channel.

    ``payload`` is passed through without copying on both sides: ``encode`` emits the very
    object, and the decoder hands out a read-only memoryview into the received bytes. A
    memoryview payload must be C-contiguous with 1-byte items. Not validated on
    construction (hot path).
    """

    MESSAGE_ID: ClassVar[int] = MessageId.BUFFER_RESPONSE

    receiver_id: int
    sequence_number: int
    backlog: int
    data_type: DataType
    compressed: bool
    payload: bytes | memoryview = field(repr=False)

    @property
    def size(self) -> int:
        """Payload bytes."""
        p = self.payload
        return p.nbytes if isinstance(p, memoryview) else len(p)

    @property
    def is_buffer(self) -> bool:
        """True for data buffers; events (barriers, end of partition) need no credit."""
        return self.data_type is DataType.DATA_BUFFER


@dataclass(frozen=True, slots=True)
class ErrorResponse(Message):
    """An error; per channel when ``receiver_id`` is set, else fatal for the connection.

    A message longer than ``MAX_ERROR_MESSAGE_BYTES`` (UTF-8) is truncated on construction.
    """

    MESSAGE_ID: ClassVar[int] = MessageId.ERROR_RESPONSE

    code: ErrorCode
    message: str
    receiver_id: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.code, ErrorCode):
            raise UsageError(f"code must be an ErrorCode, got {self.code!r}")
        if not isinstance(self.message, str):
            raise UsageError(f"message must be a str, got {self.message!r}")
        if self.receiver_id is not None:
            _check_uint("receiver_id", self.receiver_id, _U64)
        try:
            encoded = self.message.encode("utf-8")
        except UnicodeEncodeError:  # lone surrogates: keep what can be sent
            encoded = self.message.encode("utf-8", "replace")
            object.__setattr__(self, "message", encoded.decode("utf-8"))
        if len(encoded) > MAX_ERROR_MESSAGE_BYTES:
            cut = encoded[: MAX_ERROR_MESSAGE_BYTES - 3].decode("utf-8", "ignore") + "..."
            object.__setattr__(self, "message", cut)

    @property
    def is_fatal(self) -> bool:
        """Without a receiver id the error concerns the whole connection (Flink's rule)."""
        return self.receiver_id is None


@dataclass(frozen=True, slots=True)
class Ping(Message):
    """The daemon's keepalive: a client that does not answer with a ``Pong`` within the
    daemon's ``peer_timeout`` (it stopped reading, or stopped mid-frame) is dropped."""

    MESSAGE_ID: ClassVar[int] = MessageId.PING


# -- errors <-> ErrorResponse -------------------------------------------------------------


def error_for_response(
    resp: ErrorResponse, address: str | None = None, partition_id: object = None
) -> ExchangeError:
    """The typed error a received ``ErrorResponse`` stands for (to raise on this side)."""
    code = resp.code
    message = resp.message
    if partition_id is not None:  # named once, by the error built here
        message = message.removesuffix(f" (partition={partition_id})")
    text = f"{message} [remote {code.name}]"
    where = f" (daemon={address})" if address is not None else ""
    if code is ErrorCode.PARTITION_NOT_FOUND:
        return PartitionNotFoundError(text, partition_id, address)
    if code is ErrorCode.PRODUCER_FAILED:
        return ProducerFailedError(text, partition_id, address)
    if code is ErrorCode.PARTITION_RELEASED:
        return PartitionReleasedError(text, partition_id, address)
    if code is ErrorCode.ACCESS_DENIED:
        return AccessDeniedError(text, partition_id, address)
    if code is ErrorCode.LIMIT_EXCEEDED:
        return LimitExceededError(text, partition_id, address)
    if code is ErrorCode.SPILL_FAILED:
        return SpillError(text, partition_id, address)
    if code is ErrorCode.AUTH_FAILED:
        return AuthenticationError(text + where)
    if code in (ErrorCode.PROTOCOL_ERROR, ErrorCode.VERSION_MISMATCH):
        # the peer says *we* broke the protocol: not the peer's misbehaviour
        return LocalProtocolError(text + where, code.name)
    if code in (ErrorCode.TOO_MANY_CONNECTIONS, ErrorCode.SERVER_SHUTDOWN):
        return TransportError(text + where)
    # CANCELLED, INVALID_REQUEST, INTERNAL: one stream's failure when it names a receiver,
    # otherwise the connection is gone.
    if resp.is_fatal:
        return TransportError(text + where)
    return PartitionError(text, partition_id, address)


def error_response_for(exc: BaseException, receiver_id: int | None = None) -> ErrorResponse:
    """The ``ErrorResponse`` to send for ``exc``; fatal unless ``receiver_id`` is given."""
    code: ErrorCode
    match exc:
        case PartitionNotFoundError():
            code = ErrorCode.PARTITION_NOT_FOUND
        case ProducerFailedError():
            code = ErrorCode.PRODUCER_FAILED
        case PartitionReleasedError():
            code = ErrorCode.PARTITION_RELEASED
        case AccessDeniedError():
            code = ErrorCode.ACCESS_DENIED
        case LimitExceededError():
            code = ErrorCode.LIMIT_EXCEEDED
        case SpillError():
            code = ErrorCode.SPILL_FAILED
        case PartitionError() | UsageError():
            code = ErrorCode.INVALID_REQUEST
        case AuthenticationError():
            code = ErrorCode.AUTH_FAILED
        case VersionMismatchError():
            code = ErrorCode.VERSION_MISMATCH
        case ProtocolError():
            code = ErrorCode.PROTOCOL_ERROR
        case _:
            code = ErrorCode.INTERNAL
    text = str(exc) or type(exc).__name__
    return ErrorResponse(code, text, receiver_id)
