"""The daemon's local socket is its user's only (mode 0600), whatever the umask it was
started with: README and docs/security.md promise it, tasks rely on it when no secret is
set."""

from __future__ import annotations

import os
import stat
from typing import Any


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
