"""Argument checks of the task-facing APIs, run before anything is acquired.

A writer or reader given a bad argument raises ``UsageError`` from its constructor before
it connects, creates a partition or takes a segment: nothing is left to release.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from exchange.errors import UsageError

__all__ = [
    "check_codec",
    "check_count",
    "check_optional",
    "check_seconds",
    "check_selector",
]


def check_count(name: str, value: Any, minimum: int) -> None:
    """``value`` is an int (not a bool) >= ``minimum``."""
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise UsageError(f"{name} must be an int >= {minimum}, got {value!r}")


def check_seconds(name: str, value: Any) -> None:
    """``value`` is a positive number of seconds."""
    if not isinstance(value, int | float) or isinstance(value, bool) or not value > 0:
        raise UsageError(f"{name} must be a positive number of seconds, got {value!r}")


def check_optional(name: str, value: Any, kind: type | tuple[type, ...]) -> None:
    """``value`` is None or of ``kind``."""
    if value is not None and not isinstance(value, kind):
        names = kind.__name__ if isinstance(kind, type) else " or ".join(k.__name__ for k in kind)
        raise UsageError(f"{name} must be None or {names}, got {value!r}")


def _has_methods(value: Any, names: Sequence[str]) -> bool:
    return all(callable(getattr(value, n, None)) for n in names)


def check_codec(codec: Any) -> None:
    """None or a RecordCodec (it has ``new_encoder``, ``new_decoder``, ``max_record_size``)."""
    if codec is not None and (
        not _has_methods(codec, ("new_encoder", "new_decoder"))
        or not hasattr(codec, "max_record_size")
        or isinstance(codec, type)
    ):
        raise UsageError(f"codec must be None or a RecordCodec instance, got {codec!r}")


def check_selector(selector: Any) -> None:
    """None or a ChannelSelector (``setup``, ``select_channel``, ``is_broadcast``)."""
    if selector is not None and (
        not _has_methods(selector, ("setup", "select_channel"))
        or not hasattr(selector, "is_broadcast")
        or isinstance(selector, type)
    ):
        raise UsageError(f"selector must be None or a ChannelSelector instance, got {selector!r}")
