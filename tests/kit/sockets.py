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


def has_ipv6_loopback() -> bool:
    """Whether this machine can listen on ``::1`` (tests over IPv6 skip without it)."""
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as s:
            s.bind(("::1", 0))
    except OSError:
        return False
    return True
