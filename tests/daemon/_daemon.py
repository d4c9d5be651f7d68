"""Helpers for daemon process tests: a real ``python -m server`` on ports 0.

``DaemonProcess`` starts the daemon with its own spill directory (and so its own local
socket), reads its ready JSON line, answers ``stats()`` from ``/api/stats`` on its HTTP
port, and stops it with SIGTERM (``terminate()`` returns the exit code and the 'stopped'
line). Run as a script, this module is a producer task in a child process::

    python _daemon.py produce SOCKET DATASET INDEX NUM_SUBPARTITIONS

It writes a pipelined partition through ``PartitionWriter`` (record ``(i, i % n, pad)``
to subpartition ``i % n``) without end, printing one JSON line once it is writing, until
it is killed.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
#: Upper bound for the daemon's ready line (a cold interpreter on a busy 2-core machine).
READY_TIMEOUT = 30.0
STOP_TIMEOUT = 30.0


def child_env(**extra: str) -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
    for key in [k for k in env if k.startswith("EXCHANGE_")]:
        del env[key]  # the daemon under test takes its settings from flags only
    env.update(extra)
    return env


class _LineReader:
    """Reads a pipe's lines on a thread, so lines can be awaited with a timeout."""

    def __init__(self, pipe: Any, name: str) -> None:
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.all: list[str] = []
        self._thread = threading.Thread(target=self._run, args=(pipe,), name=name, daemon=True)
        self._thread.start()

    def _run(self, pipe: Any) -> None:
        with pipe:
            for line in pipe:
                self.all.append(line)
                self.lines.put(line)
        self.lines.put(None)

    def next_line(self, timeout: float) -> str | None:
        """The next line, or None at end of file; TimeoutError if none comes in time."""
        try:
            return self.lines.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError(f"no line within {timeout}s") from None

    def join(self, timeout: float = 5.0) -> None:
        self._thread.join(timeout)


class DaemonProcess:
    """``python -m server`` in a subprocess, with its own spill dir and ports 0."""

    def __init__(self, *args: str, spill_dir: str | None = None, start: bool = True) -> None:
        self._own_dir = spill_dir is None
        self.spill_dir = spill_dir or tempfile.mkdtemp(prefix="xd-")
        self.args = [
            "--host",
            "127.0.0.1",
            "--data-port",
            "0",
            "--http-port",
            "0",
            "--spill-dir",
            self.spill_dir,
            "--log-level",
            "WARNING",
            *args,
        ]
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "server", *self.args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=ROOT,
            env=child_env(),
        )
        self._out = _LineReader(self.proc.stdout, "daemon-stdout")
        self._err = _LineReader(self.proc.stderr, "daemon-stderr")
        self.info: dict[str, Any] = {}
        self.stopped: dict[str, Any] | None = None
        if start:
            self.wait_ready()

    # -- startup ---------------------------------------------------------------------------

    def wait_ready(self) -> dict[str, Any]:
        try:
            line = self._out.next_line(READY_TIMEOUT)
        except TimeoutError:
            self.kill()
            raise AssertionError(f"daemon not ready in {READY_TIMEOUT}s: {self.stderr}") from None
        if line is None:
            code = self.proc.wait(10)
            raise AssertionError(f"daemon exited with {code} before ready: {self.stderr}")
        self.info = json.loads(line)
        assert self.info["event"] == "ready", self.info
        return self.info

    @property
    def stderr(self) -> str:
        return "".join(self._err.all)

    @property
    def data_address(self) -> str:
        return str(self.info["data"])

    @property
    def local_socket(self) -> str:
        return str(self.info["local_socket"])

    @property
    def daemon_id(self) -> str:
        return str(self.info["daemon_id"])

    @property
    def segment_size(self) -> int:
        return int(self.info["segment_size"])

    # -- HTTP ------------------------------------------------------------------------------

    def http_get(self, path: str, timeout: float = 10.0) -> bytes:
        url = f"http://{self.info['http']}{path}"
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            body: bytes = resp.read()
            return body

    def stats(self) -> dict[str, Any]:
        result: dict[str, Any] = json.loads(self.http_get("/api/stats"))
        return result

    def metric(self, name: str) -> float:
        """The value of the unlabelled sample ``name`` of /metrics (AssertionError if none)."""
        from prometheus_client.parser import text_string_to_metric_families

        for family in text_string_to_metric_families(self.http_get("/metrics").decode()):
            for s in family.samples:
                if s.name == name and not s.labels:
                    return float(s.value)
        raise AssertionError(f"{name} not in /metrics")

    def wait_stats(
        self, predicate: Callable[[dict[str, Any]], bool], timeout: float = 10.0
    ) -> dict[str, Any]:
        """Poll ``/api/stats`` until ``predicate`` holds; AssertionError with the last one."""
        deadline = time.monotonic() + timeout
        while True:
            st = self.stats()
            if predicate(st):
                return st
            if time.monotonic() > deadline:
                raise AssertionError(f"not reached within {timeout}s: {json.dumps(st)[:3000]}")
            time.sleep(0.05)

    def wait_pool_whole(self, timeout: float = 10.0) -> dict[str, Any]:
        """Every segment back in the network pool, as the daemon reports it."""
        return self.wait_stats(
            lambda s: s["network"]["available_segments"] == s["network"]["total_segments"],
            timeout,
        )

    # -- stopping --------------------------------------------------------------------------

    def terminate(self, timeout: float = STOP_TIMEOUT) -> tuple[int, dict[str, Any] | None]:
        """SIGTERM; returns the exit code and the 'stopped' line (None if it never came)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"daemon ignored SIGTERM for {timeout}s: {self.stderr}") from None
        self._out.join()
        self._err.join()
        for line in self._out.all[1:]:
            with contextlib.suppress(ValueError):
                event = json.loads(line)
                if event.get("event") == "stopped":
                    self.stopped = event
        return code, self.stopped

    def stop_clean(self) -> None:
        """SIGTERM and check the daemon exits 0 with every segment back in its pool."""
        code, stopped = self.terminate()
        assert code == 0, f"daemon exited with {code}: {self.stderr}"
        assert stopped is not None, f"no 'stopped' line: {self._out.all} {self.stderr}"
        assert stopped["pool_whole"] is True, f"{stopped} {self.stderr}"

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)

    def cleanup(self) -> None:
        self.kill()
        self._out.join()
        self._err.join()
        if self._own_dir:
            shutil.rmtree(self.spill_dir, ignore_errors=True)

    @property
    def running(self) -> bool:
        return self.proc.poll() is None


def started_daemons() -> Iterator[Callable[..., DaemonProcess]]:
    """The body of a ``start_daemon`` fixture: yields ``start(*flags, spill_dir=None)`` (a
    spill directory of the test's, left in place, or one of its own); at teardown every
    daemon still running gets SIGTERM and must exit 0 with its pool whole, and every
    process is reaped and its spill directory removed."""
    started: list[DaemonProcess] = []

    def start(*flags: str, spill_dir: str | None = None) -> DaemonProcess:
        d = DaemonProcess(*flags, spill_dir=spill_dir)
        started.append(d)
        return d

    yield start
    try:
        for d in started:
            if d.running:
                d.stop_clean()
    finally:
        for d in started:
            d.cleanup()
            assert d.proc.returncode is not None


def run_daemon_cli(
    args: Sequence[str], timeout: float = 30.0, preexec_fn: Callable[[], None] | None = None
) -> subprocess.CompletedProcess[str]:
    """``python -m server ARGS`` expected to exit by itself (refused configs);
    ``preexec_fn`` runs in the child before the daemon (a lower resource limit)."""
    return subprocess.run(
        [sys.executable, "-m", "server", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=child_env(),
        timeout=timeout,
        preexec_fn=preexec_fn,
    )


# -- a producer task in a child process ------------------------------------------------------


class ChildProducer:
    """``python _daemon.py produce ...``: a producer process the test can SIGKILL."""

    def __init__(self, socket: str, dataset: str, index: int, num_subpartitions: int) -> None:
        self.proc = subprocess.Popen(
            [
                sys.executable,
                __file__,
                "produce",
                socket,
                dataset,
                str(index),
                str(num_subpartitions),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=ROOT,
            env=child_env(),
        )
        self._out = _LineReader(self.proc.stdout, "producer-stdout")
        self._err = _LineReader(self.proc.stderr, "producer-stderr")

    def wait_writing(self, timeout: float = READY_TIMEOUT) -> dict[str, Any]:
        line = self._out.next_line(timeout)
        if line is None:
            self.proc.wait(10)
            raise AssertionError(f"producer exited: {''.join(self._err.all)}")
        event: dict[str, Any] = json.loads(line)
        return event

    @property
    def stderr(self) -> str:
        return "".join(self._err.all)

    def sigkill(self) -> int:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
        code = self.proc.wait(10)
        self._out.join()
        self._err.join()
        return code

    def cleanup(self) -> None:
        self.sigkill()


def _records(num_subpartitions: int, pad: bytes) -> Iterator[tuple[int, int, bytes]]:
    i = 0
    while True:
        yield (i, i % num_subpartitions, pad)
        i += 1
        if i % 256 == 0:
            time.sleep(0.002)  # keep streaming without hogging a shared core


def _produce(argv: Sequence[str]) -> None:
    from client.producer import PartitionWriter
    from exchange.partition.result_partition_id import ResultPartitionID

    socket, dataset, index, n = argv[0], argv[1], int(argv[2]), int(argv[3])
    pid = ResultPartitionID(dataset, index, 0)
    writer = PartitionWriter(pid, n, blocking=False, daemon_socket=socket, buffer_timeout=0.01)
    print(json.dumps({"event": "writing", "pid": os.getpid()}), flush=True)
    writer.emit_all(_records(n, b"p" * 100), partition_func=lambda k: k % n)


class BarrierProducer(ChildProducer):
    """``python _daemon.py produce-barriers ...``: a producer task that streams
    ``(index, seq, pad)`` records into a one-subpartition pipelined partition and, every
    ``interval`` seconds, broadcasts checkpoint barrier 1, 2, ... ``barriers`` (or, for
    the ids in ``cancel``, a CancelCheckpointMarker instead), then finishes. It prints one
    JSON line once its partition exists (``wait_writing``), one per barrier:
    ``{"barrier": id, "emitted": records before it, "cancel": bool}``, and
    ``{"done": records}`` at the end."""

    def __init__(
        self,
        socket: str,
        dataset: str,
        index: int,
        *,
        barriers: int,
        interval: float,
        aligned: bool,
        cancel: Sequence[int] = (),
    ) -> None:
        self.proc = subprocess.Popen(
            [
                sys.executable,
                __file__,
                "produce-barriers",
                socket,
                dataset,
                str(index),
                str(barriers),
                str(interval),
                "aligned" if aligned else "unaligned",
                ",".join(map(str, cancel)),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=ROOT,
            env=child_env(),
        )
        self._out = _LineReader(self.proc.stdout, "producer-stdout")
        self._err = _LineReader(self.proc.stderr, "producer-stderr")

    def lines(self, timeout: float = 60.0) -> list[dict[str, Any]]:
        """Every line up to ``done`` (raises if the process fails first)."""
        out: list[dict[str, Any]] = []
        deadline = time.monotonic() + timeout
        while True:
            line = self._out.next_line(max(0.1, deadline - time.monotonic()))
            if line is None:
                code = self.proc.wait(10)
                raise AssertionError(f"producer exited {code}: {''.join(self._err.all)}")
            event: dict[str, Any] = json.loads(line)
            out.append(event)
            if "done" in event:
                return out


def _produce_barriers(argv: Sequence[str]) -> None:
    from client.producer import PartitionWriter
    from exchange.partition.result_partition_id import ResultPartitionID

    socket, dataset, index = argv[0], argv[1], int(argv[2])
    barriers, interval, aligned = int(argv[3]), float(argv[4]), argv[5] == "aligned"
    cancel = {int(c) for c in argv[6].split(",") if c}
    pad = b"r" * 200
    with PartitionWriter(
        ResultPartitionID(dataset, index, 0), 1, daemon_socket=socket, buffer_timeout=0.01
    ) as w:
        print(json.dumps({"event": "writing", "pid": os.getpid()}), flush=True)
        seq = 0
        next_at = time.monotonic() + interval
        for cid in range(1, barriers + 1):
            while time.monotonic() < next_at:
                for _ in range(32):
                    w.emit_to((index, seq, pad), 0)
                    seq += 1
                time.sleep(0.001)
            next_at += interval
            if cid in cancel:
                w.broadcast_cancel(cid)
            else:
                w.broadcast_barrier(cid, int(time.time() * 1000), aligned=aligned)
            line = {"barrier": cid, "emitted": seq, "cancel": cid in cancel}
            print(json.dumps(line), flush=True)
        for _ in range(100):  # records after the last barrier too
            w.emit_to((index, seq, pad), 0)
            seq += 1
    print(json.dumps({"done": seq}), flush=True)


if __name__ == "__main__":
    if len(sys.argv) >= 2 and sys.argv[1] == "produce":
        _produce(sys.argv[2:])
    elif len(sys.argv) >= 2 and sys.argv[1] == "produce-barriers":
        _produce_barriers(sys.argv[2:])
    else:
        sys.exit(
            f"usage: {sys.argv[0]} produce SOCKET DATASET INDEX NUM_SUBPARTITIONS\n"
            f"       {sys.argv[0]} produce-barriers SOCKET DATASET INDEX BARRIERS INTERVAL "
            "aligned|unaligned CANCEL_IDS"
        )
