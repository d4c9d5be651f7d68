"""Shared arenas: network memory a daemon and its local tasks both map.

An arena is one anonymous file (``memfd_create``; where that is missing, a file under
``/dev/shm`` unlinked at once) of mode 0600, mapped shared. The daemon carves it into the
segments of one application's ``NetworkBufferPool`` and hands the file descriptor to that
application's authenticated producer tasks (``SCM_RIGHTS``), which map it too and write
records straight into the segments they were granted. The arena has no name anyone else
can open: only a process given its descriptor maps it.

This module makes and maps arenas; it does no socket I/O.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import secrets
from typing import Final

from exchange.errors import SharedMemoryUnavailableError, UsageError

__all__ = ["SHM_DIR", "create_arena", "map_arena"]

#: Where an arena lives when the platform has no ``memfd_create``.
SHM_DIR: Final = "/dev/shm"


def create_arena(size: int, name: str, *, shm_dir: str = SHM_DIR) -> tuple[int, mmap.mmap]:
    """A new arena of ``size`` bytes: its descriptor (the caller closes it) and a shared,
    writable mapping. SharedMemoryUnavailableError says why none can be had."""
    if not isinstance(size, int) or size <= 0:
        raise UsageError(f"arena size must be a positive int, got {size!r}")
    fd = _memfd(name)
    if fd is None:
        fd = _shm_file(size, shm_dir)
    try:
        os.fchmod(fd, 0o600)
        os.ftruncate(fd, size)
        return fd, map_arena(fd, size)
    except OSError as e:
        os.close(fd)
        raise SharedMemoryUnavailableError(
            f"cannot size or map an arena of {size} bytes: {e}"
        ) from e
    except BaseException:
        os.close(fd)
        raise


def map_arena(fd: int, size: int) -> mmap.mmap:
    """Map the arena behind ``fd`` (``size`` bytes, shared, read and write)."""
    try:
        if os.fstat(fd).st_size < size:
            raise SharedMemoryUnavailableError(f"the arena is smaller than {size} bytes")
        return mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    except OSError as e:
        raise SharedMemoryUnavailableError(f"cannot map the arena: {e}") from e


def _memfd(name: str) -> int | None:
    create = getattr(os, "memfd_create", None)
    if create is None:
        return None
    try:
        fd: int = create(name, getattr(os, "MFD_CLOEXEC", 0))
    except OSError:
        return None  # e.g. a seccomp profile that forbids it: /dev/shm may still work
    return fd


def _shm_file(size: int, shm_dir: str) -> int:
    """A file under ``shm_dir``, created 0600 and unlinked at once (only descriptors hold
    it), after checking the file system has room for ``size`` bytes: tmpfs pages are
    allocated only when touched, so a short /dev/shm would fail later, as SIGBUS."""
    try:
        st = os.statvfs(shm_dir)
    except OSError as e:
        raise SharedMemoryUnavailableError(f"no memfd_create and no {shm_dir}: {e}") from e
    free = st.f_bavail * st.f_frsize
    if free < size:
        raise SharedMemoryUnavailableError(
            f"no memfd_create, and {shm_dir} has {free} bytes free, fewer than the arena's {size}"
        )
    path = os.path.join(shm_dir, f"exchange-arena-{secrets.token_hex(8)}")
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    except OSError as e:
        raise SharedMemoryUnavailableError(f"no memfd_create, and {shm_dir}: {e}") from e
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    return fd
