"""Acting as another local user: a forked child that drops to a uid and groups, then
talks to a daemon. Needs root. The interpreter lives under /root (mode 0700), so no other
user could exec it: the child is forked from the test process instead, with everything
already imported."""

from __future__ import annotations

import asyncio
import os

from client.local_connection import fetch_daemon_info
from exchange.errors import TransportError

#: Spark's user and group in the official apache/spark images (``spark_uid``); named in no
#: /etc/group here, as in a pod.
SPARK_UID = SPARK_GID = 185
NOBODY = 65534


def fetch_info_as(uid: int, groups: list[int], path: str, secret: bytes | None = None) -> str:
    """``fetch_daemon_info(path)`` from a forked child running as ``uid`` with ``groups``
    (the first its primary group): "ok <daemon id>" or "refused <TransportError>"."""
    read_end, write_end = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover - runs in the child
        result = "crashed"
        try:
            os.close(read_end)
            os.setgroups(groups[1:])
            os.setgid(groups[0])
            os.setuid(uid)
            try:
                info = asyncio.run(fetch_daemon_info(path, secret=secret))
                result = f"ok {info.daemon_id}"
            except TransportError as e:
                result = f"refused {e}"
        finally:
            os.write(write_end, result.encode())
            os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as fh:
        out = fh.read().decode()
    _, status = os.waitpid(child, 0)
    assert os.waitstatus_to_exitcode(status) == 0, out
    return out
