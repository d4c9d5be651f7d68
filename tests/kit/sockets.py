"""Raw-socket helpers for tests that play a misbehaving peer."""

from __future__ import annotations

import socket


def closed_by_peer(s: socket.socket, timeout: float) -> bool:
    """True once the peer closed ``s`` (EOF or reset, after whatever it sent first);
    False if it is still open after ``timeout`` seconds."""
    s.settimeout(timeout)
    try:
        while s.recv(65536):
            pass
    except ConnectionError:
        return True
    except TimeoutError:
        return False
    return True
