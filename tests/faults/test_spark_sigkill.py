"""A Spark job using ``exchange_shuffle`` survives SIGKILLed Python workers.

``tests/kit/spark_retry_job.py sigkill`` runs in a process of its own (``local[2,2]``):
the worker of a producer task dies mid-write and the worker of a consumer task mid-read,
each on its first attempt. Spark's own retries recover: the result equals ``partitionBy``
record for record (nothing lost, nothing duplicated from the dead attempts), the killed
producer's partition was failed by the daemon (its connection vanished), only the retried
attempt's partitions are read and released, and the embedded daemon's pool is whole at
the end.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

from tests.kit.spark_retry_job import run_job

pytest.importorskip("pyspark")

pytestmark = [pytest.mark.spark, pytest.mark.timeout(300)]


def test_sigkilled_workers_recover_through_spark_retries(tmp_path: Path) -> None:
    helpers: Any = sys.modules["exchange_tests_daemon_helpers"]
    result = run_job("sigkill", tmp_path, helpers.child_env())
    killed = sorted(p.name.rsplit("-", 1)[0] for p in tmp_path.iterdir())
    assert killed == ["sigkill-consumer", "sigkill-producer"], killed
    assert result["equal"] == [True] * 4, result
    assert result["counts"] == result["expected_counts"]
    assert sum(result["counts"]) == 20_000
    # the killed producer's partition failed (its task vanished); 3 finished ones were read
    assert result["totals"]["partitions_failed"] == 1, result["totals"]
    assert result["totals"]["partitions_created"] == 4, result["totals"]
    assert result["released"] == 3
    assert result["partitions_left"] == 0
    assert result["pool_whole"] is True
