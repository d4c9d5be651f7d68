"""A real Prometheus (Debian's ``prometheus``) scrapes two live daemons; the figures are read
back through Prometheus's HTTP API (``/api/v1/query``) and compared, instance by instance,
with what each daemon reports on ``/api/stats``.

``make test`` installs the package when it is missing and it runs as root with apt-get
(``scripts/ensure-prometheus.sh``); elsewhere these tests fail, naming what to install: they
never skip, so a run without Prometheus cannot pass for one that checked it.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import socket
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from client.consumer import PartitionLocation, PartitionReader
from client.producer import PartitionWriter
from exchange.partition.result_partition_id import ResultPartitionID
from tests.kit.jobs import JobThread

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parents[2]
PROMETHEUS = shutil.which("prometheus")
PROMTOOL = shutil.which("promtool")
NO_PROMETHEUS = (
    "Debian's prometheus (prometheus, promtool) is not installed: apt-get install prometheus "
    "(make test does, as root: scripts/ensure-prometheus.sh)"
)
JOB = "exchange-daemons"  # the job name of deploy/prometheus.yml

Daemon = Any  # tests/daemon/_daemon.py: DaemonProcess


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class Prometheus:
    """``prometheus`` in a subprocess with a generated config and its own TSDB directory."""

    def __init__(self, workdir: Path, targets: list[str], interval: str = "1s") -> None:
        self.config = workdir / "prometheus.yml"
        self.config.write_text(
            "global:\n"
            f"  scrape_interval: {interval}\n"
            f"  scrape_timeout: {interval}\n"
            "scrape_configs:\n"
            f"  - job_name: {JOB}\n"
            "    static_configs:\n"
            f"      - targets: {json.dumps(targets)}\n"
        )
        self.workdir = workdir
        self.proc: subprocess.Popen[bytes] | None = None
        self.address = ""

    def start(self, timeout: float = 60.0) -> None:
        assert PROMETHEUS is not None
        for _attempt in range(3):  # the free port can be taken between probe and bind
            self.address = f"127.0.0.1:{_free_port()}"
            log = open(self.workdir / "prometheus.log", "wb")  # noqa: SIM115 - closed in stop
            self.proc = subprocess.Popen(
                [
                    PROMETHEUS,
                    f"--config.file={self.config}",
                    f"--storage.tsdb.path={self.workdir / 'data'}",
                    f"--web.listen-address={self.address}",
                    "--log.level=warn",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
            )
            log.close()
            deadline = time.monotonic() + timeout
            while self.proc.poll() is None and time.monotonic() < deadline:
                if self._ready():
                    return
                time.sleep(0.1)
            if self.proc.poll() is None:
                self.stop()
                raise AssertionError(f"prometheus not ready in {timeout}s: {self.log}")
            if "address already in use" not in self.log:
                raise AssertionError(f"prometheus exited {self.proc.returncode}: {self.log}")
        raise AssertionError(f"prometheus found no free port: {self.log}")

    def _ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://{self.address}/-/ready", timeout=2) as r:
                return bool(r.status == 200)
        except OSError:
            return False

    @property
    def log(self) -> str:
        path = self.workdir / "prometheus.log"
        return path.read_text(errors="replace")[-3000:] if path.exists() else ""

    def query(self, promql: str) -> list[dict[str, Any]]:
        """The instant vector of ``promql`` (``data.result``)."""
        url = f"http://{self.address}/api/v1/query?" + urllib.parse.urlencode({"query": promql})
        with urllib.request.urlopen(url, timeout=10) as resp:
            body = json.loads(resp.read())
        assert body["status"] == "success", body
        assert body["data"]["resultType"] == "vector", body
        result: list[dict[str, Any]] = body["data"]["result"]
        return result

    def by_instance(self, promql: str) -> dict[str, float]:
        return {r["metric"]["instance"]: float(r["value"][1]) for r in self.query(promql)}

    def wait_for(
        self, promql: str, want: dict[str, float], timeout: float = 30.0
    ) -> dict[str, float]:
        """Poll until ``promql`` gives exactly ``want`` per instance (scrapes take a while)."""
        deadline = time.monotonic() + timeout
        while True:
            got = self.by_instance(promql)
            if got == want:
                return got
            if time.monotonic() > deadline:
                raise AssertionError(f"{promql}: {got} != {want} after {timeout}s; {self.log}")
            time.sleep(0.2)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


@pytest.fixture
def prometheus(tmp_path: Path) -> Iterator[Callable[[list[str]], Prometheus]]:
    if PROMETHEUS is None:
        pytest.fail(NO_PROMETHEUS)
    started: list[Prometheus] = []

    def start(targets: list[str]) -> Prometheus:
        p = Prometheus(tmp_path, targets)
        started.append(p)
        p.start()
        return p

    yield start
    for p in started:
        p.stop()
        assert p.proc is not None and p.proc.returncode is not None


def _write_and_read(d: Daemon, dataset: str, partitions: int, read: bool) -> int:
    """``partitions`` blocking partitions of 2000 records each; read them over TCP if
    ``read``. Returns the records read."""
    got = 0
    for index in range(partitions):
        pid = ResultPartitionID(dataset, index, 0)
        records = ((i, b"m" * 200 + i.to_bytes(4, "big")) for i in range(2000))
        with PartitionWriter(
            pid, 1, blocking=True, daemon_socket=d.local_socket, buffer_timeout=-1
        ) as w:
            assert w.emit_all(records) == 2000
        if read:
            loc = PartitionLocation(pid, 0, d.data_address, d.daemon_id, d.local_socket)
            with PartitionReader([loc]) as reader:
                got += len(reader.read_all())
    return got


def test_promtool_accepts_the_deployed_prometheus_config() -> None:
    assert PROMTOOL is not None, NO_PROMETHEUS
    out = subprocess.run(
        [PROMTOOL, "check", "config", str(ROOT / "deploy" / "prometheus.yml")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    text = (ROOT / "deploy" / "prometheus.yml").read_text()
    assert f"job_name: {JOB}" in text


def test_prometheus_scrapes_two_daemons_and_answers_per_instance(
    start_daemon: Callable[..., Daemon], prometheus: Callable[[list[str]], Prometheus]
) -> None:
    # Two daemons that differ in every figure checked below.
    a = start_daemon("--network-memory", "32mb")
    b = start_daemon("--network-memory", "64mb")
    assert _write_and_read(a, "prom-a", 1, read=True) == 2000
    assert _write_and_read(b, "prom-b", 3, read=False) == 0
    ha, hb = a.info["http"], b.info["http"]
    prom = prometheus([ha, hb])

    prom.wait_for(f'up{{job="{JOB}"}}', {ha: 1.0, hb: 1.0})
    prom.wait_for(
        "exchange_network_segments_total",
        {ha: float(a.info["segments"]), hb: float(b.info["segments"])},
    )
    assert a.info["segments"] * 2 == b.info["segments"]  # 32mb vs 64mb

    sa, sb = a.stats(), b.stats()
    prom.wait_for(
        "exchange_partitions_created_total",
        {ha: sa["totals"]["partitions_created"], hb: sb["totals"]["partitions_created"]},
    )
    assert (sa["totals"]["partitions_created"], sb["totals"]["partitions_created"]) == (1, 3)
    sent = prom.wait_for(
        "exchange_bytes_sent_total",
        {ha: float(sa["data_port"]["bytes_sent_total"]), hb: 0.0},
    )
    assert sent[ha] > 2000 * 200  # every record went over TCP once
    prom.wait_for(
        "exchange_bytes_out_total",
        {ha: sa["totals"]["bytes_out"], hb: sb["totals"]["bytes_out"]},
    )
    assert sb["totals"]["bytes_out"] > 2 * sa["totals"]["bytes_out"]

    # Labels survive the trip: each instance carries its own daemon's identity.
    info = prom.query("exchange_daemon_info")
    assert {r["metric"]["instance"]: r["metric"]["daemon_id"] for r in info} == {
        ha: a.daemon_id,
        hb: b.daemon_id,
    }
    assert {r["metric"]["instance"]: r["metric"]["data_address"] for r in info} == {
        ha: a.data_address,
        hb: b.data_address,
    }
    # The event loop's tasks: at least the servers and the sweeper on each daemon.
    tasks = prom.by_instance("exchange_asyncio_tasks")
    assert set(tasks) == {ha, hb} and all(n >= 1 for n in tasks.values()), tasks
    # An aggregation across instances, as a dashboard would ask.
    total = prom.query("sum(exchange_partitions_created_total)")
    assert float(total[0]["value"][1]) == 4.0
    # Every query of the Grafana dashboard is PromQL this Prometheus accepts, and those on
    # the figures two idle daemons have (pool, throughput, tasks) answer for both.
    dashboard = json.loads(
        (ROOT / "deploy" / "grafana" / "dashboards" / "exchange.json").read_text()
    )
    answered = 0
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            result = prom.query(target["expr"].replace("$instance", ".*"))
            answered += bool(result)
    assert answered >= 15, answered
    a.wait_pool_whole()
    b.wait_pool_whole()


def test_prometheus_marks_a_stopped_daemon_down(
    start_daemon: Callable[..., Daemon], prometheus: Callable[[list[str]], Prometheus]
) -> None:
    a = start_daemon()
    b = start_daemon()
    ha, hb = a.info["http"], b.info["http"]
    prom = prometheus([ha, hb])
    prom.wait_for(f'up{{job="{JOB}"}}', {ha: 1.0, hb: 1.0})
    b.stop_clean()
    prom.wait_for(f'up{{job="{JOB}"}}', {ha: 1.0, hb: 0.0})
    with contextlib.suppress(urllib.error.URLError, OSError):
        b.stats()
        raise AssertionError("the stopped daemon still answers")


def _restart_once_sink_factory(marks: str) -> Any:
    """A sink that fails once, in the first attempt after its first completed checkpoint
    (a restart for the Restarts panel), then sleeps a little per record (back pressure)."""
    import os

    from client.streaming import Operator

    class FlakySlowSink(Operator):
        def process(self, record: Any, out: Any) -> None:
            time.sleep(0.0005)

        def notify_checkpoint_complete(self, checkpoint_id: int) -> None:
            mark = os.path.join(marks, "failed-once")
            if not os.path.exists(mark):
                open(mark, "w").close()
                raise RuntimeError("injected: one failure, for a restart")

    return FlakySlowSink()


def test_the_streaming_job_panels_answer_for_a_running_job(
    prometheus: Callable[[list[str]], Prometheus], tmp_path: Path
) -> None:
    """A real job (the local runner: its tasks write through the embedded daemon, which
    measures their back pressure) restarts once and runs on, its driver publishing its
    status there; a real Prometheus scrapes that daemon, and every query of the
    dashboard's Streaming jobs row answers with the job's series."""

    from client import spark as xs
    from client.streaming import LocalRunner, StreamEnvironment

    daemon = xs.get_embedded_daemon()
    marks = str(tmp_path)
    env = StreamEnvironment(
        None, checkpoint_dir=str(tmp_path / "ckpt"), checkpoint_interval=0.3, job_id="panels"
    )
    (
        env.from_generator(lambda i: (i % 5, i), rate=4000.0)
        .key_by(lambda e: e[0])
        .process(lambda value, ctx, out: out.collect(value))
        .sink_to(lambda: _restart_once_sink_factory(marks))
    )
    job = JobThread(env, runner=LocalRunner(), restart_backoff=0.1)
    thread, outcome = job.thread, job.outcome
    dashboard = json.loads(
        (ROOT / "deploy" / "grafana" / "dashboards" / "exchange.json").read_text()
    )
    row = next(p for p in dashboard["panels"] if p.get("title") == "Streaming jobs")
    panels = [p for p in dashboard["panels"] if p["gridPos"]["y"] > row["gridPos"]["y"]]
    assert len(panels) >= 8
    try:
        prom = prometheus([daemon.http_address])
        prom.wait_for(
            'exchange_job_restarts_total{job_id="panels"}', {daemon.http_address: 1.0}, 90
        )
        deadline = time.monotonic() + 60
        silent = ["not yet"]
        while silent:
            silent = [
                p["title"]
                for p in panels
                if not any(prom.query(t["expr"].replace("$instance", ".*")) for t in p["targets"])
            ]
            assert time.monotonic() < deadline, f"panels without series: {silent}"
            time.sleep(0.5)
        levels = prom.query(panels_expr(panels, "Back pressure per task (OK / LOW / HIGH)"))
        assert {r["metric"]["job_id"] for r in levels} == {"panels"}
        assert {float(r["value"][1]) for r in levels} <= {0.0, 1.0, 2.0}
    finally:
        env.cancel()
        thread.join(120)
    assert not thread.is_alive() and "error" not in outcome, outcome
    assert outcome["result"].restarts == 1
    assert xs.stop_embedded_daemon() is True, "embedded daemon's pool not whole at exit"


def panels_expr(panels: list[dict[str, Any]], title: str) -> str:
    (panel,) = [p for p in panels if p["title"] == title]
    return str(panel["targets"][0]["expr"]).replace("$instance", ".*")
