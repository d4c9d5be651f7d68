"""The options of the task-facing readers and writers, as frozen values.

``ReaderOptions`` configures ``PartitionReader`` / ``AsyncPartitionReader``,
``WriterOptions`` ``PartitionWriter`` / ``AsyncPartitionWriter``. Each is validated once,
when it is built (a bad value raises ``ConfigError`` naming the option, before anything
is connected or allocated), and is then passed down whole: the layers below take the
object, not a list of keyword arguments. ``from_daemon(info, **overrides)`` takes the
values the local daemon decides (``DaemonInfo.settings``: buffers, backoff, buffer
timeout, debloating, alignment limit); ``replace(**changes)`` derives a new, validated
value. The public constructors still take the options as keyword arguments: they build
the object (``ReaderOptions.of``), or take one as ``options=`` (keywords then override it).

What is not configuration stays an argument of the object that uses it: the locations
and partition ids, and the synchronous facades' ``runtime`` and hand-off ``window``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Final, Self

from client._checks import (
    check_codec,
    check_count,
    check_metrics_target,
    check_optional,
    check_seconds,
    check_selector,
)
from exchange.checkpointing import AlignmentMode, CheckpointingMode, CheckpointListener
from exchange.consumer.input_channel import (
    BATCH_FLOATING_BUFFERS,
    DEFAULT_BACKOFF_INITIAL,
    DEFAULT_BACKOFF_MAX,
    STREAMING_FLOATING_BUFFERS,
)
from exchange.consumer.record_reader import EventHandler
from exchange.debloat.config import DebloatConfig
from exchange.errors import ConfigError
from exchange.memory.network_buffer_pool import MAX_SEGMENT_SIZE, MIN_SEGMENT_SIZE
from exchange.protocol.local_messages import DaemonInfo
from exchange.serialization.record_codec import RecordCodec
from exchange.writer.channel_selector import ChannelSelector
from exchange.writer.record_writer import DEFAULT_BUFFER_TIMEOUT

__all__ = ["ReaderOptions", "WriterOptions"]

#: Daemon setting (``DaemonInfo.settings``) -> reader option it decides.
_DAEMON_READER_SETTINGS: Final = {
    "exclusive_buffers_per_channel": "num_exclusive",
    "floating_buffers_per_gate": "num_floating",
    "partition_request_backoff_initial": "backoff_initial",
    "partition_request_backoff_max": "backoff_max",
}


class _Options:
    """What both option classes share: building from a mapping with named errors."""

    __slots__ = ()

    @classmethod
    def of(cls, options: Self | None, overrides: Mapping[str, Any]) -> Self:
        """``options`` (or the defaults) with ``overrides`` applied, validated."""
        if options is None:
            return cls._build(overrides)
        if not isinstance(options, cls):
            raise ConfigError("options", f"must be a {cls.__name__}, got {options!r}")
        return options.replace(**overrides) if overrides else options

    @classmethod
    def _check_names(cls, values: Mapping[str, Any]) -> None:
        names = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
        for name in values:
            if name not in names:
                raise ConfigError(
                    name, f"not a {cls.__name__} option (options: {', '.join(sorted(names))})"
                )

    @classmethod
    def _build(cls, values: Mapping[str, Any]) -> Self:
        cls._check_names(values)
        return cls(**values)

    def replace(self, **changes: Any) -> Self:
        """A copy with ``changes``, validated as a new value is."""
        self._check_names(changes)
        return dataclasses.replace(self, **changes)  # type: ignore[type-var]


@dataclass(frozen=True, slots=True, kw_only=True)
class ReaderOptions(_Options):
    """How a reader reads: buffers and credit, retries, decoding, events, checkpoints,
    debloating, metrics.

    ``num_exclusive`` buffers per channel are its initial credit; ``num_floating`` are
    shared by the gate's channels as their backlogs ask (None, the default: 32 for a batch
    reader, 8, Flink's default, for a streaming one, i.e. with a ``checkpoint_listener``:
    ``floating_buffers``); a partition not registered yet is
    requested again after ``backoff_initial`` doubling up to ``backoff_max`` seconds.
    ``auto_resume_barriers``: see ``exchange.consumer.record_reader``.
    ``checkpoint_listener``: its ``trigger_checkpoint`` / ``abort_checkpoint`` run at the
    exact point in the records (``checkpointing_mode`` exactly_once aligns, at_least_once
    tracks; ``checkpoint_alignment_limit`` bytes, 0 or None unlimited; ``unaligned``
    triggers at the first barrier and hands the listener the input that overtook the cut:
    ``persist_records`` / ``input_state_complete`` in PartitionReader, ``persist_input`` /
    ``input_state_complete`` in the async reader; ``aligned_checkpoint_timeout`` seconds,
    unaligned only, starts each checkpoint aligned). ``alignment``: how exactly-once
    alignment holds back aligned channels, ``block_upstream`` (default), ``buffer``
    (parked in memory) or ``spill`` (parked in private files in a directory of the
    reader's own under ``alignment_spill_dir``, None: the temporary directory, removed
    when the reader closes).
    ``debloat``: buffer debloating of the reader's gate (off when None or disabled).
    ``metrics_socket`` and ``task_name``: report the gate's debloating and checkpoint
    figures, if it has any, to the daemon at that local socket as task ``task_name``.
    ``local_daemon_id``: locations on that daemon are read over its Unix socket.
    """

    local_daemon_id: str | None = None
    codec: RecordCodec | None = None
    secret: bytes | None = field(default=None, repr=False)  # never in a log line
    segment_size: int = 32 * 1024
    num_exclusive: int = 2
    num_floating: int | None = None
    backoff_initial: float = DEFAULT_BACKOFF_INITIAL
    backoff_max: float = DEFAULT_BACKOFF_MAX
    event_handler: EventHandler | None = None
    auto_resume_barriers: bool = True
    checkpoint_listener: CheckpointListener | None = None
    #: a string as a user writes it (``"at_least_once"``) is stored as the enum
    checkpointing_mode: CheckpointingMode | str = CheckpointingMode.EXACTLY_ONCE
    checkpoint_alignment_limit: int | None = None
    aligned_checkpoint_timeout: float | None = None
    #: a string as a user writes it (``"spill"``) is stored as the enum
    alignment: AlignmentMode | str = AlignmentMode.BLOCK_UPSTREAM
    alignment_spill_dir: str | None = None
    debloat: DebloatConfig | None = None
    metrics_socket: str | None = None
    task_name: str | None = None

    def __post_init__(self) -> None:
        check_optional("local_daemon_id", self.local_daemon_id, str)
        check_codec(self.codec)
        check_optional("secret", self.secret, bytes)
        check_count("segment_size", self.segment_size, MIN_SEGMENT_SIZE)
        if self.segment_size > MAX_SEGMENT_SIZE:
            raise ConfigError(
                "segment_size", f"must be <= {MAX_SEGMENT_SIZE}, got {self.segment_size}"
            )
        check_count("num_exclusive", self.num_exclusive, 1)
        if self.num_floating is not None:
            check_count("num_floating", self.num_floating, 0)
        check_seconds("backoff_initial", self.backoff_initial)
        check_seconds("backoff_max", self.backoff_max)
        if self.backoff_max < self.backoff_initial:
            raise ConfigError(
                "backoff_max",
                f"{self.backoff_max} is below backoff_initial {self.backoff_initial}",
            )
        if self.event_handler is not None and not callable(self.event_handler):
            raise ConfigError(
                "event_handler", f"must be None or a callable, got {self.event_handler!r}"
            )
        if not isinstance(self.auto_resume_barriers, bool):
            raise ConfigError(
                "auto_resume_barriers", f"must be a bool, got {self.auto_resume_barriers!r}"
            )
        if self.checkpoint_listener is not None:
            for method in ("trigger_checkpoint", "abort_checkpoint"):
                if not callable(getattr(self.checkpoint_listener, method, None)):
                    raise ConfigError(
                        "checkpoint_listener",
                        f"needs a {method}() method, got {self.checkpoint_listener!r}",
                    )
        try:
            mode = CheckpointingMode(self.checkpointing_mode)
        except ValueError:
            raise ConfigError(
                "checkpointing_mode",
                f"must be one of {[m.value for m in CheckpointingMode]}, "
                f"got {self.checkpointing_mode!r}",
            ) from None
        object.__setattr__(self, "checkpointing_mode", mode)
        if self.aligned_checkpoint_timeout is not None:
            check_seconds("aligned_checkpoint_timeout", self.aligned_checkpoint_timeout)
            if mode is not CheckpointingMode.UNALIGNED:
                raise ConfigError(
                    "aligned_checkpoint_timeout",
                    f"applies to checkpointing_mode unaligned only, not {mode.value}",
                )
        limit = self.checkpoint_alignment_limit
        if limit is not None and (
            not isinstance(limit, int) or isinstance(limit, bool) or limit < 0
        ):
            raise ConfigError(
                "checkpoint_alignment_limit", f"must be an int >= 0 (0: unlimited), got {limit!r}"
            )
        object.__setattr__(self, "alignment", AlignmentMode.parse(self.alignment))
        check_optional("alignment_spill_dir", self.alignment_spill_dir, str)
        if self.debloat is not None:
            if not isinstance(self.debloat, DebloatConfig):
                raise ConfigError("debloat", f"must be a DebloatConfig, got {self.debloat!r}")
            if self.debloat.max_buffer_size > self.segment_size:
                raise ConfigError(
                    "debloat",
                    f"max_buffer_size {self.debloat.max_buffer_size} exceeds the segment size "
                    f"{self.segment_size}",
                )
        check_metrics_target(self.metrics_socket, self.task_name)

    @property
    def floating_buffers(self) -> int:
        """The gate's floating buffers: ``num_floating``, or when None by the reader's
        kind: ``STREAMING_FLOATING_BUFFERS`` (8, Flink's default: checkpoint alignment
        depends on the data in flight) with a ``checkpoint_listener``, else
        ``BATCH_FLOATING_BUFFERS`` (32: a larger credit window, fewer wake-ups per buffer)."""
        if self.num_floating is not None:
            return self.num_floating
        if self.checkpoint_listener is not None:
            return STREAMING_FLOATING_BUFFERS
        return BATCH_FLOATING_BUFFERS

    @classmethod
    def from_daemon(cls, info: DaemonInfo, **overrides: Any) -> ReaderOptions:
        """The options the local daemon's settings decide, then ``overrides``.

        From ``info``: ``local_daemon_id``, ``segment_size``, buffers per channel and
        gate, request backoff, debloating (a ``DebloatConfig`` sized to the segment when
        ``debloat_enabled``) and, for a reader given a ``checkpoint_listener``, the
        alignment limit. An option in ``overrides`` wins over the daemon's value; an
        invalid daemon setting raises ConfigError naming it.
        """
        settings = info.settings
        values: dict[str, Any] = {
            "local_daemon_id": info.daemon_id,
            "segment_size": info.segment_size,
        }
        for name, option in _DAEMON_READER_SETTINGS.items():
            if settings.get(name) is not None:
                values[option] = settings[name]
        values.update(overrides)
        if settings.get("debloat_enabled") and "debloat" not in overrides:
            values["debloat"] = DebloatConfig.from_settings(
                {**settings, "segment_size": values["segment_size"]}
            )
        if (
            values.get("checkpoint_listener") is not None
            and "checkpoint_alignment_limit" not in overrides
            and settings.get("checkpoint_alignment_limit") is not None
        ):
            values["checkpoint_alignment_limit"] = settings["checkpoint_alignment_limit"]
        return cls._build(values)


@dataclass(frozen=True, slots=True, kw_only=True)
class WriterOptions(_Options):
    """How a writer writes its partition.

    ``blocking``: a blocking partition (read after it is finished, spilled to disk) or a
    pipelined one. ``daemon_socket``: the local daemon (default: the environment's).
    ``buffer_timeout``: seconds a partial buffer may wait before it is flushed (0: flush
    every record, -1: only full buffers).
    """

    blocking: bool = False
    daemon_socket: str | None = None
    codec: RecordCodec | None = None
    selector: ChannelSelector | None = None
    secret: bytes | None = field(default=None, repr=False)  # never in a log line
    buffer_timeout: float = DEFAULT_BUFFER_TIMEOUT

    def __post_init__(self) -> None:
        if not isinstance(self.blocking, bool):
            raise ConfigError("blocking", f"must be a bool, got {self.blocking!r}")
        check_optional("daemon_socket", self.daemon_socket, str)
        check_optional("secret", self.secret, bytes)
        check_codec(self.codec)
        check_selector(self.selector)
        t = self.buffer_timeout
        if (
            not isinstance(t, int | float)
            or isinstance(t, bool)
            or math.isnan(t)
            or (t != -1 and t < 0)
        ):
            raise ConfigError("buffer_timeout", f"must be >= 0 or -1, got {t!r}")

    @classmethod
    def from_daemon(cls, info: DaemonInfo, **overrides: Any) -> WriterOptions:
        """The daemon's ``buffer_timeout``, then ``overrides``; a ``blocking`` partition
        (read once it is written) flushes only full buffers unless told otherwise."""
        values: dict[str, Any] = {}
        timeout = info.settings.get("buffer_timeout")
        if overrides.get("blocking"):
            values["buffer_timeout"] = -1
        elif timeout is not None:
            values["buffer_timeout"] = timeout
        values.update(overrides)
        return cls._build(values)
