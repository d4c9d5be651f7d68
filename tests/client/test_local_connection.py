"""Discovery and secret resolution on the task side (no daemon needed)."""

from __future__ import annotations

from pathlib import Path

import pytest

from client.local_connection import (
    DAEMON_ENV,
    SECRET_FILE_ENV,
    default_socket_path,
    resolve_daemon_socket,
    resolve_secret,
)
from exchange.errors import ConfigError


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
