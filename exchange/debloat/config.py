"""Buffer debloating settings (Flink's ``taskmanager.network.memory.buffer-debloat.*``).

Every setting keeps the daemon's name (``server/config.py``), so that an invalid value is
reported under the name the user typed: ``debloat_target``, ``debloat_period``,
``debloat_samples``, ``debloat_threshold_percent``, ``debloat_min_buffer_size`` and
``segment_size`` for the largest size. The starting size has no daemon setting yet; it is
reported as ``debloat_initial_buffer_size``.

The announced sizes must be sizes a producer honours: at most one segment, and at least
``MIN_BUFFER_SIZE`` (256 B), the smallest buffer a RecordWriter cuts (it clamps smaller
announcements up). A minimum below that floor is refused rather than silently raised.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final

from exchange.config_values import (
    MAX_DURATION,
    MAX_SIZE,
    parse_bool,
    parse_duration,
    parse_int,
    parse_size,
)
from exchange.errors import ConfigError
from exchange.writer.record_writer import MIN_BUFFER_SIZE

__all__ = [
    "DEFAULT_INITIAL_BUFFER_SIZE",
    "DebloatConfig",
]

#: Recent Flink (FLINK-36556) starts debloating at 1 KiB rather than at the segment size:
#: a too small buffer grows back within a few periods, a too large one fills the pipe at once.
DEFAULT_INITIAL_BUFFER_SIZE: Final = 1024

#: Setting names, as the daemon spells them.
ENABLED: Final = "debloat_enabled"
TARGET: Final = "debloat_target"
PERIOD: Final = "debloat_period"
SAMPLES: Final = "debloat_samples"
THRESHOLD: Final = "debloat_threshold_percent"
MIN_BUFFER: Final = "debloat_min_buffer_size"
MAX_BUFFER: Final = "segment_size"
INITIAL_BUFFER: Final = "debloat_initial_buffer_size"


@dataclass(frozen=True, slots=True)
class DebloatConfig:
    """What one input gate's debloater is configured with. Durations in seconds, sizes in bytes.

    ``max_buffer_size`` is the segment size: a producer cannot cut a buffer larger than
    one segment. ``initial_buffer_size`` None starts at :data:`DEFAULT_INITIAL_BUFFER_SIZE`
    clamped to [min, max] (see :attr:`starting_buffer_size`).
    """

    enabled: bool = False
    target: float = 1.0
    period: float = 0.2
    samples: int = 20
    threshold_percent: int = 25
    min_buffer_size: int = 256
    max_buffer_size: int = 32 * 1024
    initial_buffer_size: int | None = None

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise :class:`ConfigError` naming the first invalid setting."""
        if not isinstance(self.enabled, bool):
            raise ConfigError(ENABLED, f"{self.enabled!r} is not a boolean")
        _check_duration(TARGET, self.target)
        _check_duration(PERIOD, self.period)
        _check_int(SAMPLES, self.samples, 1, None)
        _check_int(THRESHOLD, self.threshold_percent, 0, 100)
        _check_int(MIN_BUFFER, self.min_buffer_size, 1, MAX_SIZE)
        if self.min_buffer_size < MIN_BUFFER_SIZE:
            raise ConfigError(
                MIN_BUFFER,
                f"{self.min_buffer_size} bytes is below {MIN_BUFFER_SIZE} bytes, the smallest "
                "buffer a producer cuts: smaller announced sizes would not be honoured",
            )
        _check_int(MAX_BUFFER, self.max_buffer_size, 1, MAX_SIZE)
        if self.min_buffer_size > self.max_buffer_size:
            raise ConfigError(
                MIN_BUFFER,
                f"{self.min_buffer_size} bytes exceeds {MAX_BUFFER} ({self.max_buffer_size} bytes)",
            )
        if self.initial_buffer_size is not None:
            _check_int(
                INITIAL_BUFFER,
                self.initial_buffer_size,
                self.min_buffer_size,
                self.max_buffer_size,
            )

    @property
    def starting_buffer_size(self) -> int:
        """The size the debloater (and the producer) starts from."""
        if self.initial_buffer_size is not None:
            return self.initial_buffer_size
        return max(self.min_buffer_size, min(DEFAULT_INITIAL_BUFFER_SIZE, self.max_buffer_size))

    @property
    def alpha(self) -> float:
        """The smoothing factor of the buffer size's moving average, 2 / (samples + 1)."""
        return 2.0 / (self.samples + 1)

    @classmethod
    def from_settings(cls, settings: Mapping[str, object]) -> DebloatConfig:
        """Build from daemon-named settings (``debloat_target``, ``segment_size``, ...).

        Values may be typed or strings as a user writes them (``"500ms"``, ``"32kb"``,
        ``"on"``); missing settings take the defaults; other keys are ignored, so a whole
        daemon configuration may be passed.
        """
        d = cls()
        initial = settings.get(INITIAL_BUFFER)
        return cls(
            enabled=parse_bool(_bool_or_str(settings, ENABLED, d.enabled), ENABLED),
            target=parse_duration(_number_or_str(settings, TARGET, d.target), TARGET),
            period=parse_duration(_number_or_str(settings, PERIOD, d.period), PERIOD),
            samples=parse_int(_int_or_str(settings, SAMPLES, d.samples), SAMPLES),
            threshold_percent=parse_int(
                _int_or_str(settings, THRESHOLD, d.threshold_percent), THRESHOLD
            ),
            min_buffer_size=parse_size(
                _int_or_str(settings, MIN_BUFFER, d.min_buffer_size), MIN_BUFFER
            ),
            max_buffer_size=parse_size(
                _int_or_str(settings, MAX_BUFFER, d.max_buffer_size), MAX_BUFFER
            ),
            initial_buffer_size=(
                None
                if initial is None
                else parse_size(_int_or_str(settings, INITIAL_BUFFER, 0), INITIAL_BUFFER)
            ),
        )


# The parse_* functions refuse bools and other types themselves; these only narrow the type.


def _bool_or_str(settings: Mapping[str, object], name: str, default: bool) -> bool | str:
    value = settings.get(name, default)
    if isinstance(value, bool | str):
        return value
    raise ConfigError(name, f"{value!r} is not a boolean")


def _int_or_str(settings: Mapping[str, object], name: str, default: int) -> int | str:
    value = settings.get(name, default)
    if isinstance(value, int | str):
        return value
    raise ConfigError(name, f"{value!r} is not an integer")


def _number_or_str(settings: Mapping[str, object], name: str, default: float) -> float | str:
    value = settings.get(name, default)
    if isinstance(value, int | float | str):
        return value
    raise ConfigError(name, f"{value!r} is not a duration")


def _check_duration(setting: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigError(setting, f"{value!r} is not a duration in seconds")
    if math.isnan(value) or value <= 0:
        raise ConfigError(setting, f"{value!r} must be a positive duration")
    if value > MAX_DURATION:
        raise ConfigError(setting, f"{value!r} exceeds the maximum of {MAX_DURATION:.0f} seconds")


def _check_int(setting: str, value: object, minimum: int, maximum: int | None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(setting, f"{value!r} is not an integer")
    if value < minimum or (maximum is not None and value > maximum):
        bounds = f"at least {minimum}" if maximum is None else f"between {minimum} and {maximum}"
        raise ConfigError(setting, f"{value!r} is out of range; it must be {bounds}")
