"""A local runner's task process (``client.streaming.runners.LocalRunner``): reads
(``sys.path``, the pickled job and its task index) from stdin and runs the task; exit
status 0 when it ended well, 1 (the traceback on stderr) when it failed."""

from __future__ import annotations

import pickle
import signal
import sys
import traceback


def main() -> int:
    """A local task process: read (sys.path, job, index) from stdin, run the task."""
    data = sys.stdin.buffer.read()
    n = int.from_bytes(data[:8], "big")
    sys.path[:] = pickle.loads(data[8 : 8 + n])
    from client.streaming.task import run_task

    job, index = pickle.loads(data[8 + n :])
    # a Ctrl-C in the driver's terminal reaches this process group too: the driver
    # decides (a clean stop), so the task ignores it
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        run_task(job, index)
    except BaseException:
        traceback.print_exc()
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
