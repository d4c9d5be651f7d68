"""The driver of test_spark_isolation, in a process of its own: the daemon's address set
on the SparkSession becomes a system property of the JVM that PySpark launches, so a
session made in the test process would hand that daemon to every later session there.

    python _spark_isolation_job.py <local socket> <secret file> <daemon http host:port>
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from client.local_connection import release_dataset  # noqa: E402
from client.runtime import get_runtime  # noqa: E402
from client.spark import (  # noqa: E402
    CONF_DAEMON_ADDRESS,
    exchange_shuffle,
    release_exchange,
)
from exchange.protocol.handshake import format_app_credential  # noqa: E402


def _cluster() -> Any:
    path = ROOT / "tests" / "spark" / "_cluster.py"
    spec = importlib.util.spec_from_file_location("exchange_tests_spark_cluster", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _partitions(http: str) -> int:
    with urllib.request.urlopen(f"http://{http}/api/stats", timeout=10) as resp:
        return int(json.load(resp)["partitions"]["count"])


def main(socket_path: str, secret_file: str, http: str) -> None:
    secret = Path(secret_file).read_bytes()
    cluster = _cluster()
    session = cluster.local_session(
        "local[2]", "exchange-isolation", **{CONF_DAEMON_ADDRESS: socket_path}
    )
    try:
        sc = session.sparkContext
        app = str(sc.applicationId)
        rdd = sc.parallelize([(i % 7, i) for i in range(2000)], 3)
        # the driver mints the application's credential; the tasks get only it: the
        # secret's file is gone before they run, and their environment never named it
        assert "EXCHANGE_SECRET_FILE" not in os.environ
        scratch = tempfile.mkdtemp()
        driver_copy = shutil.copy(secret_file, os.path.join(scratch, "secret"))
        out = exchange_shuffle(rdd, 4, secret_file=driver_copy)
        shutil.rmtree(scratch)
        got = out.glom().collect()
        cluster.assert_exact_partitions(got, rdd.partitionBy(4).glom().collect())
        run = get_runtime().run
        xid = out.exchange_id
        # neither a client of no application nor one of another application may release
        for who in (secret, format_app_credential(secret, app + "-other")):
            assert run(release_dataset(socket_path, xid, secret=who)) == 0
        assert _partitions(http) == 3
        assert release_exchange(out, secret_file=secret_file) == 3  # the application's own
        deadline = time.monotonic() + 30
        while _partitions(http) != 0:
            assert time.monotonic() < deadline, "partitions left after release"
            time.sleep(0.05)
        _streaming(session, secret_file, http, app)
    finally:
        session.stop()
    print("OK", flush=True)


def _streaming(session: Any, secret_file: str, http: str, app: str) -> None:
    """A streaming job authenticates as the application: the driver mints the credential
    (from $EXCHANGE_SECRET_FILE, the driver's only: Spark's JVM and its Python workers
    started before it was set), its tasks and its status use it."""
    from client.streaming.connectors import CollectSink
    from client.streaming.environment import StreamEnvironment

    os.environ["EXCHANGE_SECRET_FILE"] = secret_file
    try:
        env = StreamEnvironment(
            session,
            checkpoint_dir=tempfile.mkdtemp(),
            checkpoint_interval="200ms",
            job_id="isolated-stream",
        )
        (
            env.from_generator(lambda i: (i % 3, i), count=600, parallelism=1)
            .map(lambda r: r[1])
            .rebalance()  # an exchange: pipelined partitions on the daemon
            .sink_to(CollectSink, parallelism=1)
        )
        result = env.execute(restart_attempts=0)
        assert result.records, result
    finally:
        del os.environ["EXCHANGE_SECRET_FILE"]
    with urllib.request.urlopen(f"http://{http}/api/stats", timeout=10) as resp:
        jobs = json.load(resp)["jobs"]
    [job] = [j for j in jobs if j["job"] == "isolated-stream"]
    assert job["application"] == app and job["state"] == "FINISHED", job


if __name__ == "__main__":
    main(*sys.argv[1:4])
