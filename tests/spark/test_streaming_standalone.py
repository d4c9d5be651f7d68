"""The streaming pipeline of the fault tests on a real Spark standalone cluster: Master,
2 Workers of 1 core, a daemon per Worker (``_cluster.StandaloneCluster``).

The source task and the keyed task take the two slots, so each runs on its own executor
and writes to its own daemon: the keyed exchange crosses daemons over TCP. The keyed
task's Python worker is SIGKILLed after a checkpoint; the job restarts on the cluster and
the committed output holds every event exactly once. Afterwards no partition is left on
either daemon and both pools are whole.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from tests.kit.modules import load_module

pytest.importorskip("pyspark")

pytestmark = [pytest.mark.slow, pytest.mark.spark]


st: Any = load_module(
    "exchange_tests_streaming_pipeline", Path(__file__).with_name("_streaming.py")
)


def _wait_executors(sc: Any, count: int, timeout: float = 90.0) -> None:
    deadline = time.monotonic() + timeout
    while sc._jsc.sc().getExecutorMemoryStatus().size() - 1 < count:
        assert time.monotonic() < deadline, f"fewer than {count} executors registered"
        time.sleep(0.5)


@pytest.mark.timeout(600)
def test_streaming_job_across_two_workers_and_daemons(sx: ModuleType, tmp_path: Path) -> None:
    from pyspark import cloudpickle

    from client.streaming.environment import StreamEnvironment

    cloudpickle.register_pickle_by_value(st)  # type: ignore[no-untyped-call]
    probes, out = tmp_path / "probes", tmp_path / "out"
    probes.mkdir()
    out.mkdir()
    ckpt = str(tmp_path / "ckpt")
    cluster = sx.StandaloneCluster(workers=2)
    spark = None
    try:
        cluster.start()
        spark = sx.local_session(
            cluster.master_url,
            "exchange-streaming-standalone",
            **{"spark.executor.memory": "512m", "spark.cores.max": "2"},
        )
        _wait_executors(spark.sparkContext, 2)
        n = 60_000
        env = StreamEnvironment(
            spark, checkpoint_dir=ckpt, checkpoint_interval="300ms", job_id="standalone"
        )
        st.build(env, probes, out, n, parallelism=1, rate=20_000.0)

        killed: list[int] = []

        def kill_after_first_checkpoint() -> None:
            seen = st.wait_for(lambda: st.pids(probes), 120, "the first attempt's tasks")
            first = seen[min(seen)]
            st.wait_for(lambda: "sink-0" in st.pids(probes)[min(seen)], 60, "the keyed task")
            st.wait_for(lambda: list(Path(ckpt).glob("chk-*/_metadata")), 60, "a checkpoint")
            first = st.pids(probes)[min(seen)]
            os.kill(first["sink-0"], signal.SIGKILL)
            killed.append(first["sink-0"])

        import threading

        killer = threading.Thread(target=kill_after_first_checkpoint, daemon=True)
        killer.start()
        result = env.execute(restart_attempts=2, restart_backoff=0.5)
        killer.join(10)
        assert killed and result.restarts == 1, (killed, result)
        st.check_exactly_once(out, n)

        stats = [cluster.daemon_stats(i) for i in range(2)]
        print("daemons:", [(s["local"]["partitions_created"], s["data_port"]) for s in stats])
        # one source partition per attempt, on the source's daemon; the keyed task, on the
        # other executor, read it from there over TCP (local readers use the Unix socket)
        assert sum(s["local"]["partitions_created"] for s in stats) == 2, stats
        sent = [
            s["data_port"]["bytes_sent_total"] for s in stats if s["local"]["partitions_created"]
        ]
        assert sent and all(b > 0 for b in sent), stats
        for i, s in enumerate(stats):
            assert s["partitions"]["count"] == 0, (i, s["partitions"])
        spark.stop()
        spark = None
        stopped = cluster.stop_daemons()
        assert stopped == [{"event": "stopped", "pool_whole": True}] * 2, stopped
    finally:
        if spark is not None:
            spark.stop()
        cluster.close()
    assert cluster.leftover_groups() == [], "processes of the cluster survived close()"
