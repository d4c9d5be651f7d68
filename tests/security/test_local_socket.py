"""The daemon's local socket is its user's only (mode 0600), whatever the umask it was
started with: README and docs/security.md promise it, tasks rely on it when no secret is
set."""

from __future__ import annotations

import os
import shutil
import stat
import tempfile
from collections.abc import Iterator
from typing import Any

import pytest

from tests.kit.users import NOBODY, SPARK_GID, SPARK_UID, fetch_info_as


def test_the_local_socket_has_mode_0600_even_under_a_permissive_umask(
    start_daemon: Any,
) -> None:
    old = os.umask(0)  # the daemon inherits it: a plain bind would give 0777
    try:
        d = start_daemon()
    finally:
        os.umask(old)
    st = os.stat(d.local_socket)
    assert stat.S_ISSOCK(st.st_mode)
    assert stat.S_IMODE(st.st_mode) == 0o600, oct(stat.S_IMODE(st.st_mode))
    assert st.st_uid == os.getuid()


# -- a socket shared with one group (Spark's uid 185 beside a root daemon) --------------------


@pytest.fixture
def shared_dir() -> Iterator[str]:
    """A directory every user may enter (the socket's own mode decides who connects)."""
    path = tempfile.mkdtemp(prefix="xsock-")
    os.chmod(path, 0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another user")
def test_a_socket_given_to_a_group_admits_its_members_and_no_one_else(
    start_daemon: Any, shared_dir: str
) -> None:
    sock = os.path.join(shared_dir, "daemon.sock")
    d = start_daemon(
        "--local-socket",
        sock,
        "--local-socket-group",
        str(SPARK_GID),
        "--local-socket-mode",
        "0660",
        "--secret-file",
        "",  # none: the socket's permissions alone decide
    )
    st = os.stat(sock)
    assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (0, SPARK_GID, 0o660)
    # another user in the group: connects and completes the handshake
    assert fetch_info_as(NOBODY, [NOBODY, SPARK_GID], sock) == f"ok {d.daemon_id}"
    # the same user outside it: the kernel refuses the connect
    refused = fetch_info_as(NOBODY, [NOBODY], sock)
    assert refused.startswith("refused ") and "Permission denied" in refused, refused
    # and the group as the primary one of a process works as well (Spark's uid 185:185)
    assert fetch_info_as(SPARK_UID, [SPARK_GID], sock) == f"ok {d.daemon_id}"


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another user")
def test_the_default_socket_refuses_even_the_group(start_daemon: Any, shared_dir: str) -> None:
    sock = os.path.join(shared_dir, "daemon.sock")
    start_daemon("--local-socket", sock)
    assert stat.S_IMODE(os.stat(sock).st_mode) == 0o600
    refused = fetch_info_as(NOBODY, [NOBODY, os.stat(sock).st_gid], sock)
    assert refused.startswith("refused ") and "Permission denied" in refused, refused


def test_a_daemon_that_may_not_give_its_socket_away_refuses_to_start(
    run_daemon_cli: Any, shared_dir: str
) -> None:
    out = run_daemon_cli(
        [
            "--spill-dir",
            os.path.join(shared_dir, "spill"),
            "--local-socket",
            os.path.join(shared_dir, "daemon.sock"),
            "--local-socket-group",
            "no-such-group-here",
            "--local-socket-mode",
            "0660",
        ]
    )
    assert out.returncode == 2, out.stderr
    assert "local_socket_group" in out.stderr and "no-such-group-here" in out.stderr
    assert not os.path.exists(os.path.join(shared_dir, "daemon.sock"))
