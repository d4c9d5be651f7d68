"""A real Spark standalone cluster on this machine: Master, 2 Workers, 2 exchange daemons.

Each Worker (1 core) names its own daemon in ``EXCHANGE_DAEMON``, so its executor's
producer tasks write there, and consumer tasks read the other executor's partitions from
the other daemon over TCP. The blocking exchange must equal ``partitionBy``; both daemons
must have served a remote reader on their data port; after ``release_exchange`` and at
shutdown both pools must be whole. Everything is torn down in ``finally``.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from types import ModuleType
from typing import Any

import pytest

pytest.importorskip("pyspark")

from client.spark import exchange_shuffle, release_exchange

pytestmark = [pytest.mark.slow, pytest.mark.spark]


def _slow(it: Iterator[Any]) -> Iterator[Any]:
    """Hold each task a little, so the scheduler spreads tasks over both executors."""
    time.sleep(0.4)
    yield from it


def _wait_executors(sc: Any, count: int, timeout: float = 90.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        seen = sc._jsc.sc().getExecutorMemoryStatus().size() - 1  # minus the driver
        if seen >= count:
            return
        assert time.monotonic() < deadline, f"only {seen} of {count} executors registered"
        time.sleep(0.5)


def _our_partitions(stats: dict[str, Any], exchange_id: str) -> int:
    return sum(1 for p in stats["partitions"]["items"] if exchange_id in str(p))


@pytest.mark.timeout(600)
def test_blocking_exchange_across_two_workers_and_daemons(sx: ModuleType) -> None:
    cluster = sx.StandaloneCluster(workers=2)
    spark = None
    try:
        cluster.start()
        spark = sx.local_session(
            cluster.master_url,
            "exchange-standalone",
            **{"spark.executor.memory": "512m", "spark.cores.max": "2"},
        )
        sc = spark.sparkContext
        _wait_executors(sc, 2)

        records = [(i % 1009, (i, f"v{i}")) for i in range(50_000)]
        src = sc.parallelize(records, 8)
        want = src.partitionBy(4).glom().collect()

        out = exchange_shuffle(src.mapPartitions(_slow), 4, mode="blocking")
        got = out.mapPartitions(_slow).glom().collect()
        sx.assert_same_partitions(got, want)

        stats = [cluster.daemon_stats(i) for i in range(2)]
        held = [_our_partitions(s, out.exchange_id) for s in stats]
        assert sum(held) == 8 and all(held), f"producer partitions per daemon: {held}"
        for i, s in enumerate(stats):
            # Only remote consumers use the data port (producers and local readers use the
            # Unix socket), and nothing has been released over TCP yet.
            assert s["data_port"]["total_connections"] > 0, (i, s["data_port"], s["local"])
            assert s["totals"]["bytes_out"] > 0, (i, s["totals"])
            assert s["local"]["partitions_created"] == held[i], (i, s["local"])

        assert release_exchange(out) == 8
        for i in range(2):
            s = cluster.daemon_stats(i)
            assert s["partitions"]["count"] == 0, (i, s["partitions"])
            net = s["network"]
            assert net["available_segments"] == net["total_segments"], (i, net)

        spark.stop()
        spark = None
        stopped = cluster.stop_daemons()
        assert stopped == [{"event": "stopped", "pool_whole": True}] * 2, stopped
    finally:
        if spark is not None:
            spark.stop()
        cluster.close()
    assert cluster.leftover_groups() == [], "processes of the cluster survived close()"
