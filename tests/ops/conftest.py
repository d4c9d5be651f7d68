"""Fixtures for operations tests: real daemons (``tests/daemon/_daemon.py``) watched by the
tools operators use (Prometheus, docker-compose, Kubernetes manifests).

* ``start_daemon(*flags)``: a running ``python -m server``; at teardown every daemon still
  running gets SIGTERM and must exit 0 with its pool whole.
* ``dm``: the ``_daemon`` module itself.
* ``deploy``: the ``_deploy`` module (``daemon_config(command)``: a deployed daemon command
  line checked against the daemon's own parser).
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

TESTS = Path(__file__).resolve().parents[1]


def _load(name: str, path: Path) -> ModuleType:
    module = sys.modules.get(name)
    if module is None:
        spec = importlib.util.spec_from_file_location(name, path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return module


# The same module name as tests/daemon/conftest.py uses.
_daemon: Any = _load("exchange_tests_daemon_helpers", TESTS / "daemon" / "_daemon.py")
_deploy: Any = _load("exchange_tests_ops_deploy", TESTS / "ops" / "_deploy.py")


@pytest.fixture
def dm() -> ModuleType:
    return _daemon


@pytest.fixture
def deploy() -> ModuleType:
    return _deploy


@pytest.fixture
def start_daemon() -> Iterator[Callable[..., Any]]:
    yield from _daemon.started_daemons()
