"""Fixtures for the security tests: real daemons (``tests/daemon/_daemon.py``) and a
certificate authority made with the openssl CLI (``certs.py``) once per session."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.kit.modules import load_module as _load

TESTS = Path(__file__).resolve().parents[1]


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
