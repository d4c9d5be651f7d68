"""Where a daemon and the tasks of its host meet when nothing names the place.

Both sides derive the same paths from here: the daemon (``server.config``) for its
``spill_dir`` and local socket defaults, a task (``client.local_connection``) for the
socket it looks for, an in-process partition for its spill files.
"""

from __future__ import annotations

import os
import tempfile
from typing import Final

__all__ = ["DEFAULT_SOCKET_NAME", "default_socket_path", "default_spill_dir"]

#: The local socket's file name under spill_dir when ``local_socket`` is not set.
DEFAULT_SOCKET_NAME: Final = "exchange-daemon.sock"


def default_spill_dir() -> str:
    """``$TMPDIR/exchange-<uid>``: the daemon's user's own (docs/security.md, Spill files);
    tasks of the same user find its socket there."""
    return os.path.join(tempfile.gettempdir(), f"exchange-{os.geteuid()}")


def default_socket_path() -> str:
    """The socket a daemon started without ``local_socket`` or ``spill_dir`` listens on."""
    return os.path.join(default_spill_dir(), DEFAULT_SOCKET_NAME)
