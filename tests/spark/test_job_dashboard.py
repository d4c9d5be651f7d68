"""A running streaming job on the daemon's dashboard, in headless Chromium, and on /metrics.

The job's last operator is throttled (a few ms per record), so its upstream task (the
source, whose output partition's pool stays full) spends most of its time waiting for
buffers: the daemon measures that from the partition's back-pressured time and the
dashboard, fed by the driver's JobStatus, shows the task HIGH, the throttled one OK, and
the checkpoint history; cancelled, it shows CANCELED. Follows tests/server/test_http.py's
browser test.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

pytestmark = [pytest.mark.spark, pytest.mark.slow, pytest.mark.timeout(400)]

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
#: Seconds a throttled record takes.
THROTTLE = 0.004


class Throttled:
    """A keyed function that takes its time: the job's bottleneck."""

    def open(self, rc: Any) -> None:
        self.seen = rc.value_state("seen", 0)

    def process_element(self, value: Any, ctx: Any, out: Any) -> None:
        self.seen.update(self.seen.value() + 1)
        time.sleep(THROTTLE)


def _get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=5) as resp:
        body: bytes = resp.read()
        return body


def _job(base: str, job_id: str) -> dict[str, Any] | None:
    for job in json.loads(_get(base + "api/stats"))["jobs"]:
        if job["job"] == job_id:
            return dict(job)
    return None


#: Set to a path (e.g. docs/dashboard-job.png) to keep a screenshot of the job's dashboard.
SCREENSHOT_ENV = "EXCHANGE_JOB_DASHBOARD_SCREENSHOT"


def _chromium(url: str, profile: Path, *out: str) -> str:
    args = [
        CHROMIUM or "chromium",
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        f"--user-data-dir={profile}",
        "--virtual-time-budget=5000",
        *out,
        url,
    ]
    proc = subprocess.run(args, capture_output=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout.decode()


def _completed(job: dict[str, Any]) -> bool:
    """The job has completed a checkpoint and its history (as published) shows one."""
    return job["checkpoints_completed"] >= 1 and any(
        c["status"] == "COMPLETED" for c in job["checkpoints"]
    )


def _row(dom: str, attr: str) -> list[str]:
    """The cells' inner HTML of the table row with ``data-*="..."`` ``attr``."""
    row = dom.split(f"<tr {attr}>", 1)[1].split("</tr>", 1)[0]
    return [c.split(">", 1)[1] for c in row.split("</td>")[:-1]]


@pytest.mark.skipif(CHROMIUM is None, reason="no chromium (apt-get install -y chromium)")
def test_dashboard_shows_a_running_jobs_back_pressure_and_checkpoints(
    spark: Any, tmp_path: Path
) -> None:
    from client import spark as xs
    from client.streaming.environment import JobFailedError, StreamEnvironment

    xs.stop_embedded_daemon()  # earlier tests' daemon runs without debloating
    # 4 KiB segments: the buffers the source fills at full speed before the consumer's
    # first debloating announcement are drained by the throttled task in seconds. With
    # 32 KiB segments they hold 8x as much, and the first checkpoint, whose barrier waits
    # behind them, took longer than the 180 s this test waits (first checkpoint measured
    # on the same machine: 14.7 s with 4 KiB segments; not done after 180 s with 32 KiB).
    daemon = xs.get_embedded_daemon(["--debloat", "--segment-size", "4kb"])
    base = daemon.dashboard_url
    env = StreamEnvironment(
        spark, checkpoint_dir=str(tmp_path / "ckpt"), checkpoint_interval="1s", job_id="throttled"
    )
    (
        env.from_generator(lambda i: (i % 64, i), parallelism=1, name="numbers")  # unbounded
        .key_by(lambda r: r[0], name="by-key")
        .process(Throttled(), parallelism=1, name="throttled")
    )
    failure: list[BaseException] = []
    results: list[Any] = []

    def run() -> None:
        try:
            results.append(env.execute(restart_attempts=0))
        except BaseException as e:
            failure.append(e)

    thread = threading.Thread(target=run, name="throttled-job", daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 180
        job: dict[str, Any] | None = None
        while time.monotonic() < deadline and not failure:
            job = _job(base, "throttled")
            if job is not None and _completed(job):
                levels = {t["task"]: t["back_pressure"] for t in job["tasks"]}
                if levels.get("v0-0") == "HIGH":
                    break
            time.sleep(0.5)
        assert not failure, failure
        assert job is not None, "the driver never published the job's status"
        tasks = {t["task"]: t for t in job["tasks"]}
        assert tasks["v0-0"]["back_pressure"] == "HIGH", job
        assert tasks["v0-0"]["back_pressure_ratio"] > 0.5
        assert tasks["v0-0"]["out_pool_usage"] > 0.5, tasks["v0-0"]
        assert tasks["v1-0"]["back_pressure"] == "OK"  # no output: never waits for buffers
        assert job["state"] == "RUNNING" and job["restarts"] == 0

        assert _completed(job), job["checkpoints"]
        # the page polls /api/stats and renders what it got; a dump can catch the page
        # before the poll that carries the completed checkpoint: dump again, a bounded
        # number of times
        for _ in range(5):
            dom = _chromium(base, tmp_path / "profile", "--dump-dom")
            if '<span class="ck COMPLETED">COMPLETED</span>' in dom:
                break
        keep = os.environ.get(SCREENSHOT_ENV)
        if keep:
            _chromium(base, tmp_path / "shot", "--window-size=1280,900", f"--screenshot={keep}")
        assert '<span class="state RUNNING" id="job-state-throttled">RUNNING</span>' in dom
        source = _row(dom, 'data-task="throttled/v0-0"')
        assert source[:2] == ["v0-0", "numbers -&gt; by-key"], source
        assert source[2].startswith('<span class="bp HIGH">HIGH</span> '), source
        sink = _row(dom, 'data-task="throttled/v1-0"')
        assert sink[2].startswith('<span class="bp OK">OK</span> '), sink
        assert '<span class="ck COMPLETED">COMPLETED</span>' in dom

        families = {
            f.name: f for f in text_string_to_metric_families(_get(base + "metrics").decode())
        }
        status = families["exchange_task_back_pressure_status"].samples
        assert any(
            s.labels == {"job_id": "throttled", "task": "v0-0", "level": "HIGH"} for s in status
        ), status
        completed = families["exchange_job_checkpoints_completed"].samples
        assert completed[0].labels == {"job_id": "throttled"} and completed[0].value >= 1
    finally:
        env.cancel()  # a clean stop would drain the back pressure first:
        env.cancel()  # the second call cancels at once
        thread.join(120)
    assert not thread.is_alive()
    assert not results and len(failure) == 1, (failure, results)
    assert isinstance(failure[0], JobFailedError), failure
    job = _job(base, "throttled")
    assert job is not None and job["state"] == "CANCELED", job
