"""Addresses of daemons and of the driver's services: one parser, one formatter.

An address is ``host:port`` (``[v6]:port`` for an IPv6 host) or ``unix:/path`` (a
daemon's local socket). Every side reads and writes them with these two functions.
"""

from __future__ import annotations

from typing import Final

from exchange.errors import UsageError

__all__ = ["UNIX_PREFIX", "format_address", "parse_address"]

UNIX_PREFIX: Final = "unix:"


def parse_address(address: str) -> tuple[str, int]:
    """``host:port`` or ``[v6]:port`` to (host, port); UsageError when malformed.

    ``unix:/path`` (a daemon's local socket) gives ``(path, 0)``.
    """
    if isinstance(address, str) and address.startswith(UNIX_PREFIX):
        path = address[len(UNIX_PREFIX) :]
        if not path:
            raise UsageError(f"address {address!r} names no socket path")
        return path, 0
    if not isinstance(address, str):
        raise UsageError(f"an address must be a 'host:port' string, got {address!r}")
    host, sep, port_s = address.rpartition(":")
    if not sep or not host or not port_s.isdigit():
        raise UsageError(f"address {address!r} is not of the form host:port")
    port = int(port_s)
    if not 0 < port < 65536:
        raise UsageError(f"address {address!r}: port out of range")
    if host.startswith("[") != host.endswith("]"):
        raise UsageError(f"address {address!r}: unbalanced brackets around the host")
    if host.startswith("["):
        host = host[1:-1]
    return host, port


def format_address(host: str, port: int) -> str:
    """``host:port``, with an IPv6 host in brackets (what ``parse_address`` reads back)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
