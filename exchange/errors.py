"""The project's error hierarchy.

Every error the engine, the daemon or the client raises on purpose is an ``ExchangeError``.
The tree answers two questions a caller has: *whose fault is it* and *what is broken*::

    ExchangeError
    ├── UsageError                 you (the caller) misused the API  (also ValueError/RuntimeError)
    │   ├── ConfigError            a setting has an invalid value; names the setting
    │   ├── IllegalStateError      the object is not in a state that allows the call
    │   │   ├── PoolDestroyedError        request/recycle on a destroyed buffer pool
    │   │   ├── SegmentFreedError         use of a memory segment after it was freed
    │   │   ├── IllegalReferenceCountError  release of an already released buffer
    │   │   └── WriterClosedError         write after close
    │   ├── NotAPairError          a record routed by key has no key (no item 0): names it
    │   └── (ValueError-flavoured argument errors are raised as UsageError subclasses too)
    ├── InsufficientBuffersError   not enough network buffers: says required, available, setting
    ├── BufferRequestTimeoutError  a batch request for segments timed out
    ├── SharedMemoryUnavailableError  no shared arena can be made here (no memfd, /dev/shm
    │                              missing or too small); says why, the socket path stays
    ├── SchedulingError            the tasks of a pipelined exchange could not all run at
    │                              once (too few free task slots, a task re-run alone);
    │                              says what and the way out
    ├── CorruptRecordError         bytes in a data buffer do not form valid records
    │   ├── RecordTooLargeError    a record exceeds max_record_size; carries size and limit
    │   └── IntegrityError         a file's MAC does not match the secret: forged, or
    │                              written without the key (names the file)
    ├── PartitionError             per-stream failures; carry the partition id
    │   ├── PartitionNotFoundError       no such partition (yet) of this application there
    │   ├── PartitionReleasedError       the partition was released while in use
    │   │   └── PartitionDataLostError   its spilled data did not survive a daemon restart
    │   ├── SubpartitionIndexError       a peer's request or push names a subpartition the
    │   │                                partition does not have; carries index and count
    │   ├── SequenceNumberError          a BufferResponse arrived out of sequence: the peer's
    │   │                                fault, one channel's failure
    │   ├── ProducerFailedError          the producer failed: consumers never see a short read
    │   ├── ConsumerAlreadyAttachedError a pipelined subpartition is consumed once
    │   ├── PartitionNotReadyError       a blocking partition is read before it is finished
    │   ├── AccessDeniedError            the daemon's access policy refuses the connection
    │   ├── LimitExceededError           a per-connection or per-application limit is reached
    │   └── SpillError                   a blocking partition's file cannot be written: disk
    │                                    full, spill quota or free-space floor; names the dir
    ├── ProtocolError              the peer sent bytes that break the protocol (fatal for the
    │   │                          connection); carries what was wrong and the limit
    │   ├── FrameTooLargeError
    │   ├── BadMagicError
    │   ├── UnknownMessageError
    │   ├── VersionMismatchError
    │   └── AuthenticationError   wrong or missing shared secret
    ├── LocalProtocolError         the peer answered that *this* side broke the protocol
    │                              (PROTOCOL_ERROR, VERSION_MISMATCH): a bug or a version
    │                              skew here, fatal for the connection; names the code
    └── TransportError             the connection failed (closed, reset, timed out)

Per-channel errors (``PartitionError`` family) end one stream and leave the connection and
its other streams alone, whoever caused them; ``ProtocolError``, ``LocalProtocolError`` and
``TransportError`` end the whole connection. As in h11, ``ProtocolError`` (the peer
misbehaved) and ``LocalProtocolError`` (the peer says we did) are kept apart; a caller's
own misuse of the API is a ``UsageError``.

An object that remembers its failure and reports it on every later call (a failed
connection, a poisoned decoder, a failed channel or writer) raises ``fresh_error(stored)``,
never the stored object itself: see ``fresh_error``.
"""

from __future__ import annotations

from typing import TypeVar

__all__ = [
    "AccessDeniedError",
    "AuthenticationError",
    "BadMagicError",
    "BufferRequestTimeoutError",
    "ConfigError",
    "ConsumerAlreadyAttachedError",
    "CorruptRecordError",
    "ExchangeError",
    "FrameTooLargeError",
    "IllegalReferenceCountError",
    "IllegalStateError",
    "InsufficientBuffersError",
    "IntegrityError",
    "LimitExceededError",
    "LocalProtocolError",
    "NotAPairError",
    "PartitionDataLostError",
    "PartitionError",
    "PartitionNotFoundError",
    "PartitionNotReadyError",
    "PartitionReleasedError",
    "PoolDestroyedError",
    "ProducerFailedError",
    "ProtocolError",
    "RecordTooLargeError",
    "SegmentFreedError",
    "SequenceNumberError",
    "SharedMemoryUnavailableError",
    "SpillError",
    "SubpartitionIndexError",
    "TransportError",
    "UnknownMessageError",
    "UsageError",
    "VersionMismatchError",
    "WriterClosedError",
    "error_reason",
    "fresh_error",
]

_E = TypeVar("_E", bound=BaseException)


def fresh_error(stored: _E) -> _E:
    """A new exception equal to ``stored``, to raise where ``stored`` is reported again.

    Raising one object twice prepends the frames of every raise to its ``__traceback__``
    (memory that grows with each failed call, and a traceback nobody can read), overwrites
    its ``__context__``, and threads raising it race on both. The copy goes through no
    ``__init__`` (errors here format their message there): its type (which decides the
    ``ErrorCode`` it travels as), ``args``, ``str`` and attributes (``partition_id``,
    ``setting``, ``size`` …) are ``stored``'s, and so are its ``__cause__`` and context.
    It starts from ``stored``'s traceback, so a raise shows where the error is reported
    now followed by where it first happened, and ``stored`` itself is left untouched.
    """
    cls = type(stored)
    new = cls.__new__(cls, *stored.args)
    new.args = stored.args
    new.__dict__.update(stored.__dict__)
    if "__notes__" in stored.__dict__:
        new.__notes__ = list(stored.__notes__)  # add_note on the copy leaves stored alone
    new.__cause__ = stored.__cause__
    new.__context__ = stored.__context__
    new.__suppress_context__ = stored.__suppress_context__
    return new.with_traceback(stored.__traceback__)


def error_reason(exc: BaseException) -> str:
    """What ``exc`` says, without the partition and daemon a PartitionError appends: the
    text to quote when one error's message tells of another about the same partition."""
    return exc.reason if isinstance(exc, PartitionError) else str(exc)


class ExchangeError(Exception):
    """Base of every error this project raises on purpose."""


class UsageError(ExchangeError, ValueError):
    """The caller misused the API (bad argument, wrong order of calls)."""


class ConfigError(UsageError):
    """A configuration value is invalid. ``setting`` names it."""

    def __init__(self, setting: str, message: str) -> None:
        super().__init__(f"invalid value for {setting!r}: {message}")
        self.setting = setting


class IllegalStateError(UsageError, RuntimeError):
    """The object's state does not allow this call."""


class PoolDestroyedError(IllegalStateError):
    """The buffer pool was destroyed."""


class SegmentFreedError(IllegalStateError):
    """The memory segment was freed and may not be used."""


class IllegalReferenceCountError(IllegalStateError):
    """A buffer was retained or released after its reference count reached zero."""


class WriterClosedError(IllegalStateError):
    """The writer (or partition) was closed; nothing more may be written."""


class NotAPairError(UsageError, TypeError):
    """A record emitted by key is not a ``(key, value)`` pair: ``record[0]`` fails on it.

    Also a ``TypeError``, what unpacking such a record raises. The message names the
    record (its repr, cut short) and the fix."""

    @classmethod
    def for_record(cls, record: object) -> NotAPairError:
        text = repr(record)
        if len(text) > 200:
            text = text[:200] + "..."
        return cls(
            f"record {text} of type {type(record).__name__} is not a (key, value) pair: "
            "records are routed by their item 0. Map them to pairs first, for example "
            "rdd.map(lambda r: (key_of(r), r)) or rdd.keyBy(key_of)"
        )


class InsufficientBuffersError(ExchangeError):
    """Not enough network buffers to satisfy a request."""

    def __init__(self, required: int, available: int, total: int, setting: str) -> None:
        super().__init__(
            f"insufficient number of network buffers: required {required}, but only "
            f"{available} available (of {total} in total); increase {setting!r}"
        )
        self.required = required
        self.available = available
        self.total = total
        self.setting = setting


class BufferRequestTimeoutError(ExchangeError, TimeoutError):
    """A request for memory segments could not be served within its timeout."""

    def __init__(self, requested: int, available: int, timeout: float, setting: str) -> None:
        super().__init__(
            f"timed out after {timeout:.3f}s waiting for {requested} network buffers "
            f"({available} available); increase {setting!r} or lower the demand"
        )
        self.requested = requested
        self.available = available
        self.timeout = timeout
        self.setting = setting


class SharedMemoryUnavailableError(ExchangeError):
    """No shared-memory arena can be created (or mapped) here; ``reason`` says why."""

    def __init__(self, reason: str) -> None:
        super().__init__(f"shared memory unavailable: {reason}")
        self.reason = reason


class SchedulingError(ExchangeError):
    """The tasks of a pipelined exchange could not all run at once, as its readers and
    writers need: too few free task slots when the stage started, or Spark re-ran one
    of its tasks alone (a retry). Says which and the way out."""


class CorruptRecordError(ExchangeError):
    """The bytes of a data stream do not decode to whole records."""


class RecordTooLargeError(CorruptRecordError):
    """A record is larger than ``max_record_size``.

    ``size`` is the record's size in bytes, or a lower bound of it when ``at_least`` is
    true (a decoder that stops reading a record as soon as it is too large).
    """

    def __init__(self, size: int, limit: int, *, at_least: bool = False) -> None:
        what = f"at least {size}" if at_least else f"{size}"
        super().__init__(f"record of {what} bytes exceeds the limit of {limit} bytes")
        self.size = size
        self.limit = limit
        self.at_least = at_least


class IntegrityError(CorruptRecordError):
    """A file the daemon wrote (a partition manifest) fails its authentication: with a
    secret configured such files carry an HMAC, and this one's is missing or wrong. It
    was forged, or written by a daemon with another secret; it is refused, never used."""


class PartitionError(ExchangeError):
    """A failure of one stream (one partition or subpartition); the connection survives."""

    def __init__(self, message: str, partition_id: object = None, address: str | None = None):
        parts = [message]
        if partition_id is not None:
            parts.append(f"partition={partition_id}")
        if address is not None:
            parts.append(f"daemon={address}")
        detail = f" ({', '.join(parts[1:])})" if len(parts) > 1 else ""
        super().__init__(f"{message}{detail}")
        #: The message without the partition and daemon it names (to quote it in another).
        self.reason = message
        self.partition_id = partition_id
        self.address = address


class PartitionNotFoundError(PartitionError):
    """The partition is not (or not yet) registered where it was looked up."""


class PartitionReleasedError(PartitionError):
    """The partition was released."""


class PartitionDataLostError(PartitionReleasedError):
    """A finished blocking partition cannot be served again after a daemon restart: a
    spill file is missing, truncated or corrupt. Travels as PARTITION_RELEASED (its
    message says which file and what is wrong); the producer has to run again."""


class SubpartitionIndexError(PartitionError):
    """A request or a pushed buffer from a peer names a subpartition the partition does
    not have: that stream fails, the connection lives on. (A caller of this process's API
    passing a bad index gets a UsageError instead.)"""

    def __init__(
        self,
        index: object,
        num_subpartitions: int,
        partition_id: object = None,
        address: str | None = None,
    ) -> None:
        super().__init__(
            f"subpartition index {index!r} out of range [0, {num_subpartitions})",
            partition_id,
            address,
        )
        self.index = index
        self.num_subpartitions = num_subpartitions


class SequenceNumberError(PartitionError):
    """A BufferResponse arrived with an unexpected sequence number (gap or repeat).

    The peer's fault, but sequence numbers count per receiver: the one channel fails
    (as Flink's ``BufferReorderingException``), the connection's other channels go on.
    """

    def __init__(
        self,
        received: int,
        expected: int,
        receiver_id: object = None,
        partition_id: object = None,
        address: str | None = None,
    ) -> None:
        super().__init__(
            f"buffer with sequence number {received} received, expected {expected}"
            + (f" (receiver {receiver_id})" if receiver_id is not None else ""),
            partition_id,
            address,
        )
        self.received = received
        self.expected = expected
        self.receiver_id = receiver_id


class ProducerFailedError(PartitionError):
    """The producer of the partition failed; the stream is incomplete."""


class ConsumerAlreadyAttachedError(PartitionError):
    """A pipelined subpartition already has (or had) its single reader."""


class PartitionNotReadyError(PartitionError):
    """The partition exists but cannot be read yet (a blocking partition still written).

    A per-channel error: the request fails, the connection and its other channels live on.
    """


class AccessDeniedError(PartitionError):
    """The daemon's access policy refuses this connection (``docs/security.md``): a plain
    connection from a peer off loopback to a daemon with ``require_tls_remote``, refused
    before the handshake. (Another application's partition is not refused with it: ids
    are per application, so it is answered as not found, revealing nothing.)
    """


class LimitExceededError(PartitionError):
    """A per-connection or per-application limit of the daemon is reached (open requests
    on one connection, partitions or pinned segments of one application). Only the one
    that exceeds it is refused: per channel on a read, the producer's connection on a
    write; everyone else goes on. ``setting`` and ``limit`` name the limit where it was
    raised (the receiving side of an ``ErrorResponse`` has its text only)."""

    def __init__(
        self,
        message: str,
        partition_id: object = None,
        address: str | None = None,
        *,
        setting: str | None = None,
        limit: int | None = None,
    ) -> None:
        if setting is not None:
            message = f"{message} ({setting}={limit})"
        super().__init__(message, partition_id, address)
        self.setting = setting
        self.limit = limit


class SpillError(PartitionError):
    """A blocking partition's data cannot be spilled: the disk is full or failed
    (``errno``), the application's spill quota or the spill directory's free-space floor
    is reached (``setting``). ``directory`` names the spill directory. The partition is
    released (its files deleted, its pool destroyed); the producer gets this error
    (``SPILL_FAILED``), its readers a PartitionReleasedError naming it."""

    def __init__(
        self,
        message: str,
        partition_id: object = None,
        address: str | None = None,
        *,
        directory: str | None = None,
        setting: str | None = None,
        errno: int | None = None,
    ) -> None:
        super().__init__(message, partition_id, address)
        self.directory = directory
        self.setting = setting
        self.errno = errno


class ProtocolError(ExchangeError):
    """The peer broke the wire protocol. Fatal for the connection."""


class FrameTooLargeError(ProtocolError):
    """A frame's declared length exceeds the limit."""

    def __init__(self, size: int, limit: int) -> None:
        super().__init__(f"frame of {size} bytes exceeds the limit of {limit} bytes")
        self.size = size
        self.limit = limit


class BadMagicError(ProtocolError):
    """A frame does not start with the protocol's magic number."""

    def __init__(self, magic: int, expected: int) -> None:
        super().__init__(f"bad magic number 0x{magic:08X}, expected 0x{expected:08X}")
        self.magic = magic
        self.expected = expected


class UnknownMessageError(ProtocolError):
    """A frame carries a message id this side does not know."""

    def __init__(self, msg_id: int) -> None:
        super().__init__(f"unknown message id {msg_id}")
        self.msg_id = msg_id


class VersionMismatchError(ProtocolError):
    """The peers speak different protocol versions."""

    def __init__(self, theirs: int, ours: int) -> None:
        super().__init__(f"protocol version {theirs} not supported (this side speaks {ours})")
        self.theirs = theirs
        self.ours = ours


class AuthenticationError(ProtocolError):
    """The handshake's shared-secret authentication failed."""


class LocalProtocolError(ExchangeError):
    """The peer answered that this side broke the wire protocol (its fatal
    ``PROTOCOL_ERROR`` or ``VERSION_MISMATCH`` ErrorResponse): a bug or a version skew on
    this side, not the peer's misbehaviour (that is a ``ProtocolError``). Fatal for the
    connection. ``code`` names the peer's error code."""

    def __init__(self, message: str, code: str) -> None:
        super().__init__(message)
        self.code = code


class TransportError(ExchangeError, ConnectionError):
    """The connection to a peer failed (closed, reset, refused, timed out)."""
