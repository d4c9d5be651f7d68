"""The daemon's spill directory: checked at start, private, and held by one daemon.

Blocking partitions hold pickled records, and a consumer task unpickles what it reads, so
whoever can read or replace a spill file can read the job's data or run code in it. So:

* ``spill_dir`` (default ``$TMPDIR/exchange-<uid>``, the daemon's user's own) is created
  0700 when missing; an existing one must belong to the daemon's user (or root) and be
  writable by nobody else, or the daemon refuses to start with a message saying how to
  fix it (another user could otherwise pre-create it, or rename files in it).
* The daemon's files live in ``spill_dir/partitions`` (``PARTITIONS_DIR``), 0700 and the
  daemon's user's, checked without following a symlink. Spill files and manifests are
  created in it with ``O_CREAT | O_EXCL`` and mode 0600 (``exchange.partition``).
* ``partitions/.lock`` is locked (``flock``) for the daemon's lifetime: a second daemon
  on the same spill directory refuses to start instead of taking over (and deleting)
  the first one's live files. A successor starts once the lock is free (the old daemon
  exited, even by SIGKILL: the kernel drops the lock) and serves what it left.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import stat
from pathlib import Path
from typing import Final

from exchange.errors import ConfigError

__all__ = ["LOCK_NAME", "PARTITIONS_DIR", "SpillDirectory"]

log = logging.getLogger("exchange.server.spill")

#: Subdirectory of spill_dir holding the daemon's manifests and spill files.
PARTITIONS_DIR: Final = "partitions"
LOCK_NAME: Final = ".lock"
_SETTING: Final = "spill_dir"


class SpillDirectory:
    """``spill_dir`` checked and its partitions directory locked (``open``) until ``close``."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)
        self.partitions = self.root / PARTITIONS_DIR
        self._lock_fd = -1

    def open(self) -> SpillDirectory:
        """Check (creating what is missing) and lock; ConfigError naming ``spill_dir``."""
        uid = os.geteuid()
        self._make(self.root, parents=True)
        _check_root(self.root, uid)
        self._make(self.partitions, parents=False)
        _check_private(self.partitions, uid)
        self._lock()
        return self

    def _make(self, path: Path, *, parents: bool) -> None:
        if parents and not path.parent.exists():
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
            except OSError as e:
                raise ConfigError(_SETTING, f"{str(path)!r} cannot be created: {e}") from None
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:
            pass
        except OSError as e:
            raise ConfigError(_SETTING, f"{str(path)!r} cannot be created: {e}") from None

    def _lock(self) -> None:
        path = self.partitions / LOCK_NAME
        flags = os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW
        try:
            fd = os.open(path, flags, 0o600)
        except OSError as e:
            raise ConfigError(_SETTING, f"lock file {str(path)!r} cannot be opened: {e}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            holder = _read_pid(fd)
            os.close(fd)
            if e.errno not in (errno.EWOULDBLOCK, errno.EACCES):
                raise ConfigError(_SETTING, f"cannot lock {str(path)!r}: {e}") from None
            who = f"daemon pid {holder}" if holder else "another daemon"
            raise ConfigError(
                _SETTING,
                f"{str(self.root)!r} is in use by {who} (it holds {str(path)!r}); "
                "give each daemon its own --spill-dir",
            ) from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._lock_fd = fd

    def close(self) -> None:
        """Release the lock (the files stay for the next daemon)."""
        fd, self._lock_fd = self._lock_fd, -1
        if fd >= 0:
            os.close(fd)  # drops the flock

    @property
    def locked(self) -> bool:
        return self._lock_fd >= 0


def _read_pid(fd: int) -> str:
    with contextlib.suppress(OSError, ValueError):
        return str(int(os.pread(fd, 32, 0).decode().strip()))
    return ""


def _owner_ok(st: os.stat_result, uid: int) -> bool:
    return st.st_uid in (uid, 0)


def _check_root(path: Path, uid: int) -> None:
    try:
        st = os.stat(path)
    except OSError as e:
        raise ConfigError(_SETTING, f"{str(path)!r} cannot be used: {e}") from None
    if not stat.S_ISDIR(st.st_mode):
        raise ConfigError(_SETTING, f"{str(path)!r} exists and is not a directory")
    mode = stat.filemode(st.st_mode)
    if not _owner_ok(st, uid):
        raise ConfigError(
            _SETTING,
            f"{str(path)!r} belongs to uid {st.st_uid}, not to this daemon's user (uid {uid}): "
            f"another user may have created it to read or replace spilled records; remove it "
            f"(or `chown {uid} {path}` if it is yours) or choose another --spill-dir",
        )
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise ConfigError(
            _SETTING,
            f"{str(path)!r} is writable by other users ({mode}): they could replace spilled "
            f"records; `chmod go-w {path}` (or 700) or choose another --spill-dir",
        )


def _check_private(path: Path, uid: int) -> None:
    try:
        st = os.lstat(path)  # the daemon's own directory: never through a symlink
    except OSError as e:
        raise ConfigError(_SETTING, f"{str(path)!r} cannot be used: {e}") from None
    if not stat.S_ISDIR(st.st_mode):
        raise ConfigError(_SETTING, f"{str(path)!r} exists and is not a directory")
    if st.st_uid != uid:
        raise ConfigError(
            _SETTING,
            f"{str(path)!r} belongs to uid {st.st_uid}, not to this daemon's user (uid {uid}); "
            "remove it, or choose another --spill-dir",
        )
    if st.st_mode & 0o077:
        raise ConfigError(
            _SETTING,
            f"{str(path)!r} is open to other users ({stat.filemode(st.st_mode)}); "
            f"`chmod 700 {path}`, or choose another --spill-dir",
        )
