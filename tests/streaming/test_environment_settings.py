"""StreamEnvironment's job settings are parsed and checked in the driver, up front."""

from __future__ import annotations

import pytest

from client.streaming.environment import StreamEnvironment
from exchange.errors import ConfigError


class _Context:
    """Stands for the SparkContext: settings are checked before Spark is used."""

    def parallelize(self, *args: object) -> None:
        raise AssertionError("no job runs here")


def test_buffer_timeout_takes_a_duration() -> None:
    env = StreamEnvironment(_Context(), checkpoint_dir="/tmp/ckpt", buffer_timeout="100ms")
    assert env.buffer_timeout == pytest.approx(0.1)
    assert StreamEnvironment(_Context(), checkpoint_dir="/tmp/ckpt").buffer_timeout == 0.01


@pytest.mark.parametrize("bad", [-1, "soon", True])
def test_a_bad_buffer_timeout_is_a_config_error(bad: object) -> None:
    with pytest.raises(ConfigError, match="buffer_timeout"):
        StreamEnvironment(_Context(), checkpoint_dir="/tmp/ckpt", buffer_timeout=bad)  # type: ignore[arg-type]
