"""DebloatConfig: defaults, validation naming the daemon's settings, from_settings."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import pytest

from exchange.debloat import DEFAULT_INITIAL_BUFFER_SIZE, DebloatConfig
from exchange.errors import ConfigError
from server.config import DaemonConfig


def test_defaults_are_flinks() -> None:
    config = DebloatConfig()
    assert not config.enabled
    assert (config.target, config.period, config.samples) == (1.0, 0.2, 20)
    assert (config.threshold_percent, config.min_buffer_size) == (25, 256)
    assert config.max_buffer_size == 32 * 1024
    assert config.starting_buffer_size == DEFAULT_INITIAL_BUFFER_SIZE == 1024
    assert config.alpha == pytest.approx(2 / 21)


def test_defaults_match_the_daemons() -> None:
    daemon = DaemonConfig()
    config = DebloatConfig()
    assert config.enabled == daemon.debloat_enabled
    assert config.target == daemon.debloat_target
    assert config.period == daemon.debloat_period
    assert config.samples == daemon.debloat_samples
    assert config.threshold_percent == daemon.debloat_threshold_percent
    assert config.min_buffer_size == daemon.debloat_min_buffer_size
    assert config.max_buffer_size == daemon.segment_size


@pytest.mark.parametrize(
    ("min_size", "max_size", "expected"),
    [(256, 32768, 1024), (2048, 32768, 2048), (256, 512, 512), (1024, 1024, 1024)],
)
def test_starting_size_defaults_to_1k_within_bounds(
    min_size: int, max_size: int, expected: int
) -> None:
    config = DebloatConfig(min_buffer_size=min_size, max_buffer_size=max_size)
    assert config.starting_buffer_size == expected


def test_explicit_starting_size() -> None:
    assert DebloatConfig(initial_buffer_size=4096).starting_buffer_size == 4096


INVALID: list[tuple[dict[str, Any], str]] = [
    ({"enabled": 1}, "debloat_enabled"),
    ({"enabled": "yes"}, "debloat_enabled"),
    ({"target": 0}, "debloat_target"),
    ({"target": -1.0}, "debloat_target"),
    ({"target": math.nan}, "debloat_target"),
    ({"target": math.inf}, "debloat_target"),
    ({"target": "1s"}, "debloat_target"),
    ({"target": True}, "debloat_target"),
    ({"period": 0.0}, "debloat_period"),
    ({"period": -0.2}, "debloat_period"),
    ({"period": None}, "debloat_period"),
    ({"samples": 0}, "debloat_samples"),
    ({"samples": 2.0}, "debloat_samples"),
    ({"samples": True}, "debloat_samples"),
    ({"threshold_percent": -1}, "debloat_threshold_percent"),
    ({"threshold_percent": 101}, "debloat_threshold_percent"),
    ({"threshold_percent": 25.5}, "debloat_threshold_percent"),
    ({"min_buffer_size": 0}, "debloat_min_buffer_size"),
    ({"min_buffer_size": 255}, "debloat_min_buffer_size"),  # below the writers' floor
    ({"min_buffer_size": "256"}, "debloat_min_buffer_size"),
    ({"min_buffer_size": 64 * 1024}, "debloat_min_buffer_size"),  # above the segment size
    ({"max_buffer_size": 0}, "segment_size"),
    ({"max_buffer_size": 2**60}, "segment_size"),
    ({"initial_buffer_size": 128}, "debloat_initial_buffer_size"),
    ({"initial_buffer_size": 64 * 1024}, "debloat_initial_buffer_size"),
    ({"initial_buffer_size": 1024.0}, "debloat_initial_buffer_size"),
]


@pytest.mark.parametrize(("changes", "setting"), INVALID)
def test_invalid_values_are_refused_naming_the_setting(
    changes: dict[str, Any], setting: str
) -> None:
    with pytest.raises(ConfigError) as info:
        DebloatConfig(**changes)
    assert info.value.setting == setting
    assert setting in str(info.value)


def test_replace_validates_too() -> None:
    with pytest.raises(ConfigError, match="debloat_samples"):
        dataclasses.replace(DebloatConfig(), samples=0)


def test_from_settings_parses_what_users_write() -> None:
    config = DebloatConfig.from_settings(
        {
            "debloat_enabled": "on",
            "debloat_target": "500ms",
            "debloat_period": "50ms",
            "debloat_samples": "10",
            "debloat_threshold_percent": 50,
            "debloat_min_buffer_size": "1kb",
            "segment_size": "64k",
            "debloat_initial_buffer_size": "2kb",
            "network_memory": "1gb",  # not a debloating setting: ignored
        }
    )
    assert config == DebloatConfig(
        enabled=True,
        target=0.5,
        period=0.05,
        samples=10,
        threshold_percent=50,
        min_buffer_size=1024,
        max_buffer_size=64 * 1024,
        initial_buffer_size=2048,
    )


def test_from_settings_takes_a_whole_daemon_config() -> None:
    daemon = DaemonConfig(
        debloat_enabled=True, debloat_target=2.0, debloat_min_buffer_size=512, segment_size=8192
    )
    config = DebloatConfig.from_settings(dataclasses.asdict(daemon))
    assert config == DebloatConfig(
        enabled=True, target=2.0, min_buffer_size=512, max_buffer_size=8192
    )


def test_from_settings_empty_gives_defaults() -> None:
    assert DebloatConfig.from_settings({}) == DebloatConfig()


@pytest.mark.parametrize(
    ("settings", "setting"),
    [
        ({"debloat_enabled": "maybe"}, "debloat_enabled"),
        ({"debloat_enabled": 1.5}, "debloat_enabled"),
        ({"debloat_target": "soon"}, "debloat_target"),
        ({"debloat_target": "0s"}, "debloat_target"),
        ({"debloat_period": ["1s"]}, "debloat_period"),
        ({"debloat_samples": "many"}, "debloat_samples"),
        ({"debloat_samples": 1.0}, "debloat_samples"),
        ({"debloat_threshold_percent": "200"}, "debloat_threshold_percent"),
        ({"debloat_min_buffer_size": "-1kb"}, "debloat_min_buffer_size"),
        ({"debloat_min_buffer_size": True}, "debloat_min_buffer_size"),
        ({"segment_size": "big"}, "segment_size"),
        ({"debloat_initial_buffer_size": "100"}, "debloat_initial_buffer_size"),
        ({"debloat_initial_buffer_size": 3.5}, "debloat_initial_buffer_size"),
    ],
)
def test_from_settings_refuses_naming_the_setting(
    settings: dict[str, object], setting: str
) -> None:
    with pytest.raises(ConfigError) as info:
        DebloatConfig.from_settings(settings)
    assert info.value.setting == setting
