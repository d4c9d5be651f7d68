"""Helpers for the PySpark tests: sessions, partition comparison, a standalone cluster.

* ``local_session(master)``: a lean SparkSession (no UI, no progress bar, 2 shuffle
  partitions, driver on 127.0.0.1) whose Python workers run this interpreter.
* ``assert_same_partitions(got, want)``: partition ``i`` of both holds the same multiset
  of records (compared by ``repr``, so ``(1, b"")`` never equals ``[1, ""]``).
* ``StandaloneCluster``: a Master, Workers and one exchange daemon per Worker, started
  from the pip-installed pyspark with ``spark-class``, torn down by ``close()``.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]

LEAN_CONF: dict[str, str] = {
    "spark.ui.enabled": "false",
    "spark.ui.showConsoleProgress": "false",
    "spark.sql.shuffle.partitions": "2",
    "spark.driver.host": "127.0.0.1",
    "spark.driver.bindAddress": "127.0.0.1",
    "spark.driver.memory": "1g",
    "spark.python.worker.reuse": "true",
}


def local_session(master: str, app: str, **conf: str) -> Any:
    os.environ["PYSPARK_PYTHON"] = sys.executable
    from pyspark.sql import SparkSession

    builder = SparkSession.builder.master(master).appName(app)
    for key, value in {**LEAN_CONF, **conf}.items():
        builder = builder.config(key, value)
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    return spark


def _summary(items: Counter[str]) -> list[str]:
    return [f"{count} x {text[:80]}" for text, count in list(items.items())[:5]]


def assert_same_partitions(got: Sequence[Sequence[Any]], want: Sequence[Sequence[Any]]) -> None:
    assert len(got) == len(want), f"{len(got)} partitions, expected {len(want)}"
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        cg, cw = Counter(map(repr, g)), Counter(map(repr, w))
        if cg != cw:
            raise AssertionError(
                f"partition {i}: {len(g)} records, expected {len(w)}; "
                f"unexpected {_summary(cg - cw)}, missing {_summary(cw - cg)}"
            )


def assert_exact(a: Any, b: Any, path: str = "record") -> None:
    """``a`` equals ``b`` with the same types all the way down (NaN equals NaN)."""
    assert type(a) is type(b), f"{path}: {type(a).__name__} != {type(b).__name__}"
    if isinstance(a, float) and a != a:
        assert b != b, f"{path}: NaN != {b!r}"
        return
    if isinstance(a, (list, tuple)):
        assert len(a) == len(b), f"{path}: length {len(a)} != {len(b)}"
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_exact(x, y, f"{path}[{i}]")
        if hasattr(a, "__fields__"):  # pyspark Row: the field names too
            assert a.__fields__ == b.__fields__, f"{path}: fields differ"
        return
    if isinstance(a, dict):
        assert list(a) == list(b), f"{path}: keys {list(a)} != {list(b)}"
        for k in a:
            assert_exact(a[k], b[k], f"{path}[{k!r}]")
        return
    assert a == b, f"{path}: {a!r} != {b!r}"
    if hasattr(a, "tzinfo"):
        assert a.tzinfo == b.tzinfo, f"{path}: tzinfo {a.tzinfo!r} != {b.tzinfo!r}"


def assert_exact_partitions(got: Sequence[Sequence[Any]], want: Sequence[Sequence[Any]]) -> None:
    """Partition by partition the same records (as multisets), equal and of the same
    types: compared with == and type(), not through repr."""
    assert_same_partitions(got, want)
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        for j, (x, y) in enumerate(zip(sorted(g, key=repr), sorted(w, key=repr), strict=True)):
            assert_exact(x, y, f"partition {i} record {j}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def http_json(url: str, timeout: float = 5.0) -> Any:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return json.loads(resp.read())


def spark_home() -> str:
    import pyspark

    return os.path.dirname(os.path.abspath(pyspark.__file__))


def child_env(**extra: str) -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
    for key in [k for k in env if k.startswith("EXCHANGE_")]:
        del env[key]
    env.update(extra)
    return env


class StandaloneCluster:
    """Master + ``workers`` Workers (1 core each), each Worker with its own exchange daemon.

    Each Worker's environment names its daemon's local socket in ``EXCHANGE_DAEMON``, so
    its executors' Python workers write to that daemon. Everything runs on 127.0.0.1.
    ``close()`` kills and reaps every process (also after a failed start).
    """

    def __init__(self, workers: int = 2) -> None:
        self.base = tempfile.mkdtemp(prefix="xsa-")
        self.procs: list[tuple[str, subprocess.Popen[bytes]]] = []
        self.daemons: list[dict[str, Any]] = []
        self.master_port = free_port()
        self.master_ui = free_port()
        self.num_workers = workers
        self.spark_home = spark_home()
        self.logs: dict[str, Path] = {}

    @property
    def master_url(self) -> str:
        return f"spark://127.0.0.1:{self.master_port}"

    def _spawn(self, name: str, cmd: list[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
        log = Path(self.base) / f"{name}.log"
        self.logs[name] = log
        with open(log, "wb") as fh:
            proc = subprocess.Popen(
                cmd,
                stdout=fh,
                stderr=subprocess.STDOUT,
                cwd=self.base,
                env=env,
                start_new_session=True,  # so close() can kill a JVM's whole process group
            )
        self.procs.append((name, proc))
        return proc

    def _start_daemon(self, i: int) -> dict[str, Any]:
        spill = os.path.join(self.base, f"d{i}")
        log = Path(self.base) / f"daemon{i}.log"
        self.logs[f"daemon{i}"] = log
        with open(log, "wb") as err:
            proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "server",
                    "--host",
                    "127.0.0.1",
                    "--data-port",
                    "0",
                    "--http-port",
                    "0",
                    "--spill-dir",
                    spill,
                    "--log-level",
                    "WARNING",
                ],
                stdout=subprocess.PIPE,
                stderr=err,
                cwd=ROOT,
                env=child_env(),
                start_new_session=True,
            )
        self.procs.append((f"daemon{i}", proc))
        assert proc.stdout is not None
        line = proc.stdout.readline()
        info: dict[str, Any] = json.loads(line)
        info["proc"] = proc
        self.daemons.append(info)
        return info

    def start(self, register_timeout: float = 90.0) -> None:
        cls = os.path.join(self.spark_home, "bin", "spark-class")
        base_env = child_env(SPARK_HOME=self.spark_home, PYSPARK_PYTHON=sys.executable)
        for i in range(self.num_workers):
            self._start_daemon(i)
        self._spawn(
            "master",
            [
                cls,
                "org.apache.spark.deploy.master.Master",
                "--host",
                "127.0.0.1",
                "--port",
                str(self.master_port),
                "--webui-port",
                str(self.master_ui),
            ],
            base_env,
        )
        for i, info in enumerate(self.daemons):
            work = os.path.join(self.base, f"work{i}")
            os.makedirs(work)
            self._spawn(
                f"worker{i}",
                [
                    cls,
                    "org.apache.spark.deploy.worker.Worker",
                    "--host",
                    "127.0.0.1",
                    "--cores",
                    "1",
                    "--memory",
                    "1g",
                    "--webui-port",
                    str(free_port()),
                    "--work-dir",
                    work,
                    self.master_url,
                ],
                {**base_env, "EXCHANGE_DAEMON": info["local_socket"]},
            )
        self.wait_workers(register_timeout)

    def wait_workers(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        last: Any = None
        while time.monotonic() < deadline:
            for name, proc in self.procs:
                if proc.poll() is not None:
                    raise AssertionError(f"{name} exited with {proc.returncode}: {self.tail(name)}")
            with contextlib.suppress(OSError, ValueError):
                last = http_json(f"http://127.0.0.1:{self.master_ui}/json/")
                if last.get("aliveworkers") == self.num_workers:
                    return
            time.sleep(1.0)
        raise AssertionError(f"workers did not register in {timeout}s: {last}")

    def tail(self, name: str, size: int = 3000) -> str:
        log = self.logs.get(name)
        if log is None or not log.exists():
            return ""
        return log.read_bytes()[-size:].decode(errors="replace")

    def daemon_stats(self, i: int) -> dict[str, Any]:
        stats: dict[str, Any] = http_json(f"http://{self.daemons[i]['http']}/api/stats")
        return stats

    def stop_daemons(self) -> list[dict[str, Any] | None]:
        """SIGTERM every daemon; their 'stopped' lines (None where none came)."""
        stopped: list[dict[str, Any] | None] = []
        for info in self.daemons:
            proc: subprocess.Popen[bytes] = info["proc"]
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
            try:
                out, _ = proc.communicate(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                out, _ = proc.communicate()
            event = None
            for line in out.decode(errors="replace").splitlines():
                with contextlib.suppress(ValueError):
                    msg = json.loads(line)
                    if msg.get("event") == "stopped":
                        event = msg
            stopped.append(event)
        return stopped

    def close(self) -> None:
        """Kill every process (JVMs with their process groups) and reap it."""
        for _name, proc in reversed(self.procs):
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + 20
        for _name, proc in reversed(self.procs):
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)
            if proc.stdout is not None:
                proc.stdout.close()
        # Executors and their Python workers are in their Worker's process group.
        deadline = time.monotonic() + 20
        while self.leftover_groups() and time.monotonic() < deadline:
            time.sleep(0.2)
        for pgid in self.leftover_groups():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pgid, signal.SIGKILL)
        shutil.rmtree(self.base, ignore_errors=True)

    def leftover_groups(self) -> list[int]:
        """Process groups of ours that still have a live member."""
        alive = []
        for _name, proc in self.procs:
            try:
                os.killpg(proc.pid, 0)
            except ProcessLookupError:
                continue
            except PermissionError:
                pass
            alive.append(proc.pid)
        return alive
