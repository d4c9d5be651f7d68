"""Fixtures for operations tests: real daemons (``tests/daemon/_daemon.py``) watched by the
tools operators use (Prometheus, docker-compose, Kubernetes manifests).

* ``start_daemon(*flags)``: a running ``python -m server``; at teardown every daemon still
  running gets SIGTERM and must exit 0 with its pool whole.
* ``dm``: the ``_daemon`` module itself.
* ``deploy``: the ``_deploy`` module (``daemon_config(command)``: a deployed daemon command
  line checked against the daemon's own parser).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from tests.kit.modules import load_module as _load

TESTS = Path(__file__).resolve().parents[1]


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
