"""Fixtures for operations tests: real daemons (``start_daemon`` of ``tests/conftest.py``)
watched by the tools operators use (Prometheus, docker-compose, Kubernetes manifests).

* ``deploy``: the ``_deploy`` module (``daemon_config(command)``: a deployed daemon command
  line checked against the daemon's own parser).
"""

from __future__ import annotations

from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from tests.kit.modules import load_module as _load

TESTS = Path(__file__).resolve().parents[1]


_deploy: Any = _load("exchange_tests_ops_deploy", TESTS / "ops" / "_deploy.py")


@pytest.fixture
def deploy() -> ModuleType:
    return _deploy
