"""Discovery and secret resolution on the task side, and what the connection does with
messages it is handed (no daemon needed)."""

from __future__ import annotations

from pathlib import Path

import pytest

from client.local_connection import (
    DAEMON_ENV,
    SECRET_FILE_ENV,
    LocalConnection,
    default_socket_path,
    resolve_daemon_socket,
    resolve_secret,
)
from exchange.errors import ConfigError
from exchange.protocol.local_messages import ProducerBufferSize


def test_socket_hint_beats_environment_beats_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(DAEMON_ENV, raising=False)
    assert resolve_daemon_socket(None) == default_socket_path()
    monkeypatch.setenv(DAEMON_ENV, "unix:/run/x.sock")
    assert resolve_daemon_socket(None) == "/run/x.sock"
    assert resolve_daemon_socket("/tmp/hint.sock") == "/tmp/hint.sock"


def test_secret_from_argument_or_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(SECRET_FILE_ENV, raising=False)
    assert resolve_secret(None) is None
    f = tmp_path / "secret"
    f.write_bytes(b"s3cret\n")
    assert resolve_secret(str(f)) == b"s3cret"
    monkeypatch.setenv(SECRET_FILE_ENV, str(f))
    assert resolve_secret(None) == b"s3cret"


@pytest.mark.parametrize("content", [b"", b"\n", b"x" * (64 * 1024 + 1)])
def test_bad_secret_files_are_config_errors(tmp_path: Path, content: bytes) -> None:
    f = tmp_path / "secret"
    f.write_bytes(content)
    with pytest.raises(ConfigError, match="secret_file"):
        resolve_secret(str(f))


def test_missing_secret_file_names_the_setting(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="secret_file"):
        resolve_secret(str(tmp_path / "nope"))


@pytest.mark.asyncio
async def test_buffer_sizes_announced_before_the_listener_are_handed_to_it() -> None:
    """A consumer's first NewBufferSize may reach the producer's connection while the
    partition is still being created (the arena hand-out is a round trip): the latest
    size per subpartition is kept and given to the writer's listener when it is set."""
    conn = LocalConnection("unix:/nowhere", None, 64 * 1024)
    conn.on_message(ProducerBufferSize(0, 4096))
    conn.on_message(ProducerBufferSize(1, 2048))
    conn.on_message(ProducerBufferSize(0, 256))
    got: list[tuple[int, int]] = []
    conn.buffer_size_listener = lambda sub, size: got.append((sub, size))
    assert sorted(got) == [(0, 256), (1, 2048)]
    conn.on_message(ProducerBufferSize(1, 512))  # from now on, as they come
    assert got[-1] == (1, 512) and len(got) == 3
