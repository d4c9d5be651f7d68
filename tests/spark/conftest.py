"""Fixtures for the PySpark tests (helpers live in ``_cluster.py`` next to this file).

* ``sx``: the ``_cluster`` module (``assert_same_partitions``, ``StandaloneCluster``, ...).
* ``spark``: one lean ``local[2]`` SparkSession per test module, using the embedded
  exchange daemon; at teardown the session stops and the embedded daemon must report its
  pool whole.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from tests.kit.modules import load_module

_cluster: Any = load_module("exchange_tests_spark_cluster", Path(__file__).with_name("_cluster.py"))


@pytest.fixture(scope="session")
def sx() -> ModuleType:
    return _cluster


@pytest.fixture(scope="module")
def spark() -> Iterator[Any]:
    pytest.importorskip("pyspark")
    from client import spark as xs

    session = _cluster.local_session("local[2]", "exchange-tests")
    try:
        yield session
    finally:
        session.stop()
        assert xs.stop_embedded_daemon() is True, "embedded daemon's pool not whole at exit"
