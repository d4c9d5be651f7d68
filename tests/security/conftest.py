"""Fixtures for the security tests: real daemons (``tests/daemon/_daemon.py``) and a
certificate authority made with the openssl CLI (``certs.py``) once per session."""

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


_daemon: Any = _load("exchange_tests_daemon_helpers", TESTS / "daemon" / "_daemon.py")
certs: Any = _load("exchange_tests_security_certs", TESTS / "security" / "certs.py")


@pytest.fixture(scope="session")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Any:
    if not certs.openssl_available():
        pytest.skip("the openssl command line is not installed (.ci/run installs it)")
    return certs.make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture
def start_daemon() -> Iterator[Callable[..., Any]]:
    yield from _daemon.started_daemons()


@pytest.fixture
def run_daemon_cli() -> Callable[..., Any]:
    return _daemon.run_daemon_cli  # type: ignore[no-any-return]
