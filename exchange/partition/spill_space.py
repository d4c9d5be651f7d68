"""SpillSpace: how much of the spill directory's file system each application may fill.

A daemon's blocking partitions write into one directory that every application shares. A
``SpillSpace`` keeps one ``SpillAccount`` per application; each blocking file charges its
account as it grows (``charge``) and refunds it when deleted (``refund``). A charge is
refused with a :class:`~exchange.errors.SpillError` naming the directory and the setting
when it would take the application beyond ``quota`` bytes, or when the file system's
free space has fallen below ``min_free`` bytes: new spills stop *before* the disk is
full, so the ones already written stay readable and the daemon's own files (manifests)
still fit. Free space is asked of the kernel (``statvfs``) at most once per
``check_every`` bytes charged, not per buffer.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Callable
from pathlib import Path
from typing import Final

from exchange.errors import SpillError

__all__ = ["SpillAccount", "SpillSpace", "free_bytes", "spill_error"]

#: Bytes charged between two free-space checks.
CHECK_EVERY: Final = 256 * 1024


def free_bytes(directory: str | os.PathLike[str]) -> int:
    """Bytes an unprivileged writer may still use on ``directory``'s file system."""
    st = os.statvfs(directory)
    return st.f_bavail * st.f_frsize


def spill_error(directory: Path, what: str, e: OSError) -> SpillError:
    """The SpillError for an OSError met while writing into ``directory``."""
    why = "is full" if e.errno in (errno.ENOSPC, errno.EDQUOT) else "failed"
    return SpillError(
        f"spill directory {directory} {why}: cannot {what}: {e.strerror or e}",
        directory=str(directory),
        errno=e.errno,
    )


class SpillSpace:
    """The spill budget of one directory, per application."""

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        quota: int | None = None,
        min_free: int = 0,
        free: Callable[[Path], int] = free_bytes,
        check_every: int = CHECK_EVERY,
    ) -> None:
        self.directory = Path(directory)
        self.quota = quota  # None: no per-application limit
        self.min_free = min_free
        self._free = free
        self._check_every = check_every
        self._accounts: dict[str, SpillAccount] = {}

    def account(self, app_id: str) -> SpillAccount:
        acct = self._accounts.get(app_id)
        if acct is None:
            acct = self._accounts[app_id] = SpillAccount(self, app_id)
        return acct

    def used(self, app_id: str) -> int:
        acct = self._accounts.get(app_id)
        return 0 if acct is None else acct.used

    @property
    def total_used(self) -> int:
        return sum(a.used for a in self._accounts.values())

    def check_free(self, who: str) -> None:
        """SpillError when the file system's free space is below ``min_free``."""
        if self.min_free <= 0:
            return
        try:
            free = self._free(self.directory)
        except OSError as e:
            raise SpillError(
                f"cannot tell the free space of spill directory {self.directory}: {e}",
                directory=str(self.directory),
                errno=e.errno,
            ) from None
        if free < self.min_free:
            raise SpillError(
                f"{who} refused: spill directory {self.directory} has {free} bytes free, "
                f"below the floor spill_min_free={self.min_free}",
                directory=str(self.directory),
                setting="spill_min_free",
            )

    def _forget_if_empty(self, acct: SpillAccount) -> None:
        if acct.used <= 0 and self._accounts.get(acct.app_id) is acct:
            del self._accounts[acct.app_id]


class SpillAccount:
    """One application's bytes in the spill directory."""

    __slots__ = ("_since_check", "_space", "app_id", "used")

    def __init__(self, space: SpillSpace, app_id: str) -> None:
        self._space = space
        self.app_id = app_id
        self.used = 0
        self._since_check = 0

    @property
    def directory(self) -> Path:
        return self._space.directory

    def _who(self) -> str:
        return f"spilling for application {self.app_id!r}" if self.app_id else "spilling"

    def check_new(self) -> None:
        """May a new blocking partition start? SpillError if the quota is used up or the
        free space is below the floor."""
        space = self._space
        if space.quota is not None and self.used >= space.quota:
            raise self._over_quota(0)
        space.check_free(self._who())

    def charge(self, n: int) -> None:
        """Count ``n`` more bytes, or raise SpillError (nothing counted) if they do not fit."""
        space = self._space
        quota = space.quota
        if quota is not None and self.used + n > quota:
            raise self._over_quota(n)
        since = self._since_check + n
        if since >= space._check_every:
            space.check_free(self._who())
            since = 0
        self._since_check = since
        self.used += n

    def add_existing(self, n: int) -> None:
        """Count bytes already on disk (a restored partition's files), unchecked."""
        self.used += n

    def refund(self, n: int) -> None:
        self.used -= n
        self._space._forget_if_empty(self)

    def _over_quota(self, n: int) -> SpillError:
        space = self._space
        return SpillError(
            f"{self._who()} refused: {self.used} bytes in spill directory {space.directory}"
            + (f", {n} more" if n else "")
            + f" would exceed spill_quota_per_app={space.quota}",
            directory=str(space.directory),
            setting="spill_quota_per_app",
        )
