"""A streaming job run on a thread of its own, for tests that act while it runs (kill a
task process, hold a sink, scrape metrics) and check its result afterwards."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["JobThread", "run_killing_once"]


class JobThread:
    """``env.execute(**kwargs)`` on a started thread; ``outcome`` gets ``"result"`` or
    ``"error"`` (whatever it raised) once it returns."""

    def __init__(self, env: Any, **kwargs: Any) -> None:
        self.outcome: dict[str, Any] = {}
        self.thread = threading.Thread(target=self._run, args=(env, kwargs), name="job")
        self.thread.start()

    def _run(self, env: Any, kwargs: dict[str, Any]) -> None:
        try:
            self.outcome["result"] = env.execute(**kwargs)
        except BaseException as e:  # handed to the test, which asserts on it
            self.outcome["error"] = e


def run_killing_once(
    env: Any, pids: Path, ready: Callable[[], bool], what: str, **kwargs: Any
) -> Any:
    """Run ``env`` (``execute(**kwargs)``, a LocalRunner with a 0.1 s restart backoff
    unless given); once ``ready()`` and the one process watched left its id in ``pids``,
    SIGKILL that process; the job's result (after its restore)."""
    from client.streaming import LocalRunner

    kwargs.setdefault("runner", LocalRunner())
    kwargs.setdefault("restart_backoff", 0.1)
    job = JobThread(env, **kwargs)
    try:
        deadline = time.monotonic() + 120
        while not (ready() and len(list(pids.iterdir())) == 1):
            assert time.monotonic() < deadline, f"not within 120 s: {what}"
            assert job.thread.is_alive(), job.outcome
            time.sleep(0.005)
        (first,) = pids.iterdir()
        os.kill(int(first.read_text()), signal.SIGKILL)
    finally:
        job.thread.join(240)
    assert not job.thread.is_alive()
    return job.outcome["result"]
