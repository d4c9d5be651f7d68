"""``exchange_shuffle`` and a streaming job on a daemon that holds a secret: the driver
mints the Spark application's (``sc.applicationId``) credential from the secret file and
its tasks get only that (the file is gone before they run, their environment never named
it); the result equals ``partitionBy``, the partitions are the application's (another
application, or a client of no application, can neither release nor count them), and the
streaming job's status on the daemon is the application's."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.timeout(300)

SECRET = b"the-daemons-secret"
JOB = Path(__file__).with_name("_spark_isolation_job.py")


def test_exchange_shuffle_partitions_belong_to_the_spark_application(
    start_daemon: Any, tmp_path: Path
) -> None:
    pytest.importorskip("pyspark")
    secret = tmp_path / "secret"
    secret.write_bytes(SECRET)
    secret.chmod(0o600)
    d = start_daemon("--secret-file", str(secret))
    res = subprocess.run(
        [sys.executable, str(JOB), d.local_socket, str(secret), d.info["http"]],
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert res.returncode == 0 and res.stdout.strip().endswith("OK"), res.stderr[-4000:]
    assert d.stats()["partitions"]["count"] == 0
