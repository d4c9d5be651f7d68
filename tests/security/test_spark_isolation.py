"""``exchange_shuffle`` on a daemon that holds a secret: its tasks authenticate for the
Spark application (``sc.applicationId``) with the credential derived from the secret file,
the result equals ``partitionBy``, and the partitions are the application's: another
application, or a client of no application, can neither release nor count them."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

import pytest

from client.local_connection import release_dataset
from client.runtime import get_runtime
from exchange.protocol.handshake import format_app_credential

pytestmark = pytest.mark.timeout(300)

SECRET = b"the-daemons-secret"


def _cluster() -> Any:
    name = "exchange_tests_spark_cluster"
    module = sys.modules.get(name)
    if module is None:
        path = Path(__file__).resolve().parents[1] / "spark" / "_cluster.py"
        spec = importlib.util.spec_from_file_location(name, path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return module


def test_exchange_shuffle_partitions_belong_to_the_spark_application(
    start_daemon: Any, tmp_path: Path
) -> None:
    pytest.importorskip("pyspark")
    from client.spark import CONF_DAEMON_ADDRESS, exchange_hash, exchange_shuffle, release_exchange

    secret = tmp_path / "secret"
    secret.write_bytes(SECRET)
    secret.chmod(0o600)
    d = start_daemon("--secret-file", str(secret))
    cluster = _cluster()
    session = cluster.local_session(
        "local[2]", "exchange-isolation", **{CONF_DAEMON_ADDRESS: d.local_socket}
    )
    try:
        sc = session.sparkContext
        app = str(sc.applicationId)
        rdd = sc.parallelize([(i % 7, i) for i in range(2000)], 3)
        out = exchange_shuffle(rdd, 4, secret_file=str(secret))
        got = out.glom().collect()
        cluster.assert_exact_partitions(got, rdd.partitionBy(4, exchange_hash).glom().collect())
        run = get_runtime().run
        xid = out.exchange_id
        for who in (SECRET, format_app_credential(SECRET, app + "-other")):
            assert run(release_dataset(d.local_socket, xid, secret=who)) == 0
        assert d.stats()["partitions"]["count"] == 3
        assert release_exchange(out, secret_file=str(secret)) == 3  # the application's own
        d.wait_stats(lambda s: s["partitions"]["count"] == 0)
    finally:
        session.stop()
