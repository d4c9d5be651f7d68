"""Parsers for human-friendly configuration values: sizes, durations, booleans, integers.

Pure functions shared by the daemon's configuration and the engine. Each takes the value and
the name of the setting it belongs to, and raises :class:`~exchange.errors.ConfigError` naming
that setting and quoting the value when the value is invalid.

Sizes use binary units only (``k``, ``kb`` and ``kib`` all mean 1024), as Flink does.
"""

from __future__ import annotations

import math
import re
from decimal import Decimal
from fractions import Fraction
from typing import Final

from exchange.errors import ConfigError

__all__ = [
    "MAX_DURATION",
    "MAX_SIZE",
    "format_size",
    "is_power_of_two",
    "parse_bool",
    "parse_duration",
    "parse_int",
    "parse_size",
]

MAX_SIZE: Final = 2**48
"""Largest size in bytes any setting may take (256 TiB); larger values are surely typos."""

MAX_DURATION: Final = float(2**32)
"""Longest duration in seconds (about 136 years); keeps event-loop timers from overflowing."""

_KIB: Final = 1024
_SIZE_UNITS: Final[dict[str, int]] = {
    "": 1,
    "b": 1,
    "byte": 1,
    "bytes": 1,
    "k": _KIB,
    "kb": _KIB,
    "kib": _KIB,
    "m": _KIB**2,
    "mb": _KIB**2,
    "mib": _KIB**2,
    "g": _KIB**3,
    "gb": _KIB**3,
    "gib": _KIB**3,
    "t": _KIB**4,
    "tb": _KIB**4,
    "tib": _KIB**4,
}
_SIZE_RE: Final = re.compile(r"(-?)(\d+(?:\.\d*)?|\.\d+)\s*([a-z]*)", re.ASCII)
_SIZE_HINT: Final = "expected a number of bytes or a size such as '32kb', '64 MiB' or '1.5g'"

_DURATION_UNITS: Final[dict[str, Decimal]] = {
    "": Decimal(1),
    "us": Decimal("0.000001"),
    "µs": Decimal("0.000001"),
    "ms": Decimal("0.001"),
    "milli": Decimal("0.001"),
    "millis": Decimal("0.001"),
    "millisecond": Decimal("0.001"),
    "milliseconds": Decimal("0.001"),
    "s": Decimal(1),
    "sec": Decimal(1),
    "secs": Decimal(1),
    "second": Decimal(1),
    "seconds": Decimal(1),
    "m": Decimal(60),
    "min": Decimal(60),
    "mins": Decimal(60),
    "minute": Decimal(60),
    "minutes": Decimal(60),
    "h": Decimal(3600),
    "hour": Decimal(3600),
    "hours": Decimal(3600),
    "d": Decimal(86400),
    "day": Decimal(86400),
    "days": Decimal(86400),
}
_DURATION_RE: Final = re.compile(r"(-?)(\d+(?:\.\d*)?|\.\d+)\s*([a-zµ]*)", re.ASCII)
_DURATION_HINT: Final = "expected a duration such as '100ms', '10s' or '2m', or a number of seconds"

_TRUE: Final = frozenset({"true", "yes", "on", "1"})
_FALSE: Final = frozenset({"false", "no", "off", "0"})

_INT_RE: Final = re.compile(r"[+-]?\d+", re.ASCII)


def parse_size(value: int | str, setting: str) -> int:
    """Return ``value`` in bytes: an int, or a string such as ``"4096"``, ``"32k"``, ``"64 MiB"``.

    Fractions are allowed when they come to whole bytes (``"1.5mb"``); negative sizes, garbage
    and sizes above :data:`MAX_SIZE` are refused.
    """
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise ConfigError(setting, f"{value!r} is not a size; {_SIZE_HINT}")
    if isinstance(value, int):
        size = value
    else:
        match = _SIZE_RE.fullmatch(value.strip().lower())
        if match is None or match.group(3) not in _SIZE_UNITS:
            raise ConfigError(setting, f"{value!r} is not a size; {_SIZE_HINT}")
        sign, number, unit = match.groups()
        if sign:
            raise ConfigError(setting, f"{value!r} is negative; sizes must not be negative")
        try:
            exact = Fraction(number) * _SIZE_UNITS[unit]
        except ValueError:  # more digits than int() converts
            raise ConfigError(
                setting, f"{value!r} exceeds the maximum of {MAX_SIZE} bytes"
            ) from None
        if exact.denominator != 1:
            raise ConfigError(setting, f"{value!r} is not a whole number of bytes")
        size = int(exact)
    if size < 0:
        raise ConfigError(setting, f"{value!r} is negative; sizes must not be negative")
    if size > MAX_SIZE:
        raise ConfigError(setting, f"{value!r} exceeds the maximum of {MAX_SIZE} bytes (256 TiB)")
    return size


def parse_duration(value: float | str, setting: str, *, allow_negative_one: bool = False) -> float:
    """Return ``value`` in seconds: a number of seconds, or a string such as ``"100ms"``, ``"2m"``.

    Negative durations are refused, except exactly ``-1`` (as a number or the bare string
    ``"-1"``) when ``allow_negative_one`` is set: callers use it as "disabled" or "never".
    """
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise ConfigError(setting, f"{value!r} is not a duration; {_DURATION_HINT}")
    if isinstance(value, str):
        match = _DURATION_RE.fullmatch(value.strip().lower())
        if match is None or match.group(3) not in _DURATION_UNITS:
            raise ConfigError(setting, f"{value!r} is not a duration; {_DURATION_HINT}")
        sign, number, unit = match.groups()
        magnitude = Decimal(number) * _DURATION_UNITS[unit]
        if sign and unit == "" and magnitude == 1 and allow_negative_one:
            return -1.0
        seconds = float(magnitude)
        if sign and seconds:
            seconds = -seconds
    else:
        try:
            seconds = float(value)
        except OverflowError:  # an int too large for a float
            seconds = math.inf
        if math.isnan(seconds):
            raise ConfigError(setting, f"{value!r} is not a duration; {_DURATION_HINT}")
        if seconds == -1 and allow_negative_one:
            return -1.0
    if seconds < 0:
        only = " (-1 is the only negative value allowed)" if allow_negative_one else ""
        raise ConfigError(setting, f"{value!r} is negative; durations must not be negative{only}")
    if seconds > MAX_DURATION:
        raise ConfigError(setting, f"{value!r} exceeds the maximum of {MAX_DURATION:.0f} seconds")
    return seconds


def parse_bool(value: bool | str, setting: str) -> bool:
    """Return ``value`` as a bool: a bool, or one of true/false, yes/no, on/off, 1/0 (any case)."""
    if isinstance(value, bool):
        return value
    if isinstance(value, str):
        text = value.strip().lower()
        if text in _TRUE:
            return True
        if text in _FALSE:
            return False
    raise ConfigError(setting, f"{value!r} is not a boolean; expected true/false, yes/no or on/off")


def parse_int(
    value: int | str, setting: str, *, minimum: int | None = None, maximum: int | None = None
) -> int:
    """Return ``value`` as an int (an int or a decimal string), checked against the bounds."""
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise ConfigError(setting, f"{value!r} is not an integer")
    if isinstance(value, str):
        text = value.strip()
        if _INT_RE.fullmatch(text) is None:
            raise ConfigError(setting, f"{value!r} is not an integer")
        try:
            number = int(text)
        except ValueError:  # more digits than int() converts
            raise ConfigError(setting, f"{value!r} is out of range") from None
    else:
        number = value
    too_small = minimum is not None and number < minimum
    too_large = maximum is not None and number > maximum
    if too_small or too_large:
        if minimum is not None and maximum is not None:
            bounds = f"between {minimum} and {maximum}"
        elif minimum is not None:
            bounds = f"at least {minimum}"
        else:
            bounds = f"at most {maximum}"
        raise ConfigError(setting, f"{value!r} is out of range; it must be {bounds}")
    return number


def is_power_of_two(n: int) -> bool:
    """True if ``n`` is a positive power of two."""
    return n > 0 and n & (n - 1) == 0


def format_size(n: int) -> str:
    """Format a size in bytes with the largest binary unit that divides it: ``"32 KiB"``."""
    for unit, factor in (("TiB", _KIB**4), ("GiB", _KIB**3), ("MiB", _KIB**2), ("KiB", _KIB)):
        if n and n % factor == 0:
            return f"{n // factor} {unit}"
    return f"{n} bytes"
