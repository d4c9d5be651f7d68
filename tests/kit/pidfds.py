"""Counting the pidfds a process has open (``/proc/<pid>/fd``): a test of a daemon that
watches processes ends with none left."""

from __future__ import annotations

import contextlib
import os

__all__ = ["pidfds"]


def pidfds(pid: int | str = "self") -> int:
    """pidfds process ``pid`` (this one by default) has open now."""
    n = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):  # closed meanwhile (the listing's own fd)
            n += os.readlink(f"/proc/{pid}/fd/{fd}") == "anon_inode:[pidfd]"
    return n
