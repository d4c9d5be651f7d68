"""Argument checks of the task-facing APIs, run before anything is acquired.

A writer or reader given a bad argument raises ``ConfigError`` (a ``UsageError``) naming
it, from its constructor (or its options', ``client.options``) before it connects, creates a
partition or takes a segment: nothing is left to release.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from exchange.errors import ConfigError
from exchange.protocol.local_messages import MAX_TASK_NAME_LENGTH

__all__ = [
    "check_codec",
    "check_count",
    "check_metrics_target",
    "check_optional",
    "check_seconds",
    "check_selector",
]


def check_count(name: str, value: Any, minimum: int) -> None:
    """``value`` is an int (not a bool) >= ``minimum``."""
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ConfigError(name, f"must be an int >= {minimum}, got {value!r}")


def check_seconds(name: str, value: Any) -> None:
    """``value`` is a positive number of seconds."""
    if not isinstance(value, int | float) or isinstance(value, bool) or not value > 0:
        raise ConfigError(name, f"must be a positive number of seconds, got {value!r}")


def check_optional(name: str, value: Any, kind: type | tuple[type, ...]) -> None:
    """``value`` is None or of ``kind``."""
    if value is not None and not isinstance(value, kind):
        names = kind.__name__ if isinstance(kind, type) else " or ".join(k.__name__ for k in kind)
        raise ConfigError(name, f"must be None or {names}, got {value!r}")


def _has_methods(value: Any, names: Sequence[str]) -> bool:
    return all(callable(getattr(value, n, None)) for n in names)


def check_codec(codec: Any) -> None:
    """None or a RecordCodec (it has ``new_encoder``, ``new_decoder``, ``max_record_size``)."""
    if codec is not None and (
        not _has_methods(codec, ("new_encoder", "new_decoder"))
        or not hasattr(codec, "max_record_size")
        or isinstance(codec, type)
    ):
        raise ConfigError("codec", f"must be None or a RecordCodec instance, got {codec!r}")


def check_selector(selector: Any) -> None:
    """None or a ChannelSelector (``setup``, ``select_channel``, ``is_broadcast``)."""
    if selector is not None and (
        not _has_methods(selector, ("setup", "select_channel"))
        or not hasattr(selector, "is_broadcast")
        or isinstance(selector, type)
    ):
        raise ConfigError(
            "selector", f"must be None or a ChannelSelector instance, got {selector!r}"
        )


def check_metrics_target(metrics_socket: Any, task_name: Any) -> None:
    """Where a reader reports its figures: a non-empty socket path and task name, or None."""
    for name, value in (("metrics_socket", metrics_socket), ("task_name", task_name)):
        if value is not None and (not isinstance(value, str) or not value):
            raise ConfigError(name, f"must be a non-empty string or None, got {value!r}")
    if task_name is not None and len(task_name) > MAX_TASK_NAME_LENGTH:
        raise ConfigError(
            "task_name", f"must be at most {MAX_TASK_NAME_LENGTH} characters, got {len(task_name)}"
        )
