"""Fixtures for the PySpark tests (helpers live in ``_cluster.py`` next to this file).

* ``sx``: the ``_cluster`` module (``assert_same_partitions``, ``StandaloneCluster``, ...).
* ``spark``: one lean ``local[2]`` SparkSession per test module, using the embedded
  exchange daemon; at teardown the session stops and the embedded daemon must report its
  pool whole.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest


def _load_helpers() -> ModuleType:
    name = "exchange_tests_spark_cluster"
    module = sys.modules.get(name)
    if module is None:
        spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name("_cluster.py"))
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return module


_cluster: Any = _load_helpers()


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
