"""Shared arenas offered by the local daemon: fetched by token and mapped (task side).

The daemon offers an application's arena (SharedArena) on a task's authenticated Unix
socket connection, a producer's or a consumer's; the task sends the one-time token on the
hand-out socket beside the local socket (``<local_socket>.arena``) and gets the arena's
descriptor as ``SCM_RIGHTS``, which it maps (``exchange.memory.shared_arena.map_arena``).
"""

from __future__ import annotations

import asyncio
import mmap
import os
import socket

from exchange.errors import SharedMemoryUnavailableError
from exchange.memory.shared_arena import map_arena
from exchange.protocol.local_messages import ARENA_SOCKET_SUFFIX, SharedArena

__all__ = ["fetch_arena_fd", "map_offered_arena", "unmap_arena"]


async def map_offered_arena(
    socket_path: str, offer: SharedArena, timeout: float
) -> tuple[mmap.mmap, int]:
    """Fetch and map the arena ``offer`` names from the daemon of ``socket_path``: the
    mapping and the arena's inode (SharedMemoryUnavailableError if refused or unmappable)."""
    fd = await fetch_arena_fd(socket_path + ARENA_SOCKET_SUFFIX, offer.token, timeout)
    try:
        return map_arena(fd, offer.arena_size), os.fstat(fd).st_ino
    finally:
        os.close(fd)


def unmap_arena(view: memoryview | None, arena: mmap.mmap | None) -> None:
    """Drop a connection's view and mapping of an arena. Buffers still held over it keep
    it mapped until they are released (the memory stays valid: a dead daemon's arena lives
    while anyone maps it)."""
    try:
        if view is not None:
            view.release()
        if arena is not None:
            arena.close()
    except BufferError:
        pass  # unmapped when the last buffer over it goes


async def fetch_arena_fd(path: str, token: bytes, timeout: float) -> int:
    """The shared arena's descriptor from the daemon's hand-out socket ``path``, for the
    one-time ``token`` (SharedMemoryUnavailableError if refused or unreachable)."""
    loop = asyncio.get_running_loop()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.setblocking(False)
    fds: list[int] = []
    try:
        async with asyncio.timeout(timeout):
            await loop.sock_connect(sock, path)
            await loop.sock_sendall(sock, token)
            while True:
                try:
                    _, fds, _, _ = socket.recv_fds(sock, 1, 1)
                    break
                except BlockingIOError:
                    readable: asyncio.Future[None] = loop.create_future()
                    loop.add_reader(sock.fileno(), _set_once, readable)
                    try:
                        await readable
                    finally:
                        loop.remove_reader(sock.fileno())
    except (OSError, TimeoutError) as e:
        for fd in fds:
            os.close(fd)
        raise SharedMemoryUnavailableError(f"cannot fetch the arena from {path}: {e}") from e
    finally:
        sock.close()
    if not fds:
        raise SharedMemoryUnavailableError(f"the daemon at {path} refused the arena token")
    for extra in fds[1:]:
        os.close(extra)
    return fds[0]


def _set_once(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)
