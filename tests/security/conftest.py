"""Fixtures for the security tests: real daemons (``start_daemon`` and ``run_daemon_cli``
of ``tests/conftest.py``), a certificate authority made with the openssl CLI
(``certs.py``) once per session, and ``secret_file``: the test module's ``SECRET`` in a
file of mode 0600."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.kit.modules import load_module as _load

TESTS = Path(__file__).resolve().parents[1]


certs: Any = _load("exchange_tests_security_certs", TESTS / "security" / "certs.py")


@pytest.fixture(scope="session")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Any:
    if not certs.openssl_available():
        pytest.skip("the openssl command line is not installed (.ci/run installs it)")
    return certs.make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture
def secret_file(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    path = tmp_path / "secret"
    path.write_bytes(request.module.SECRET)
    path.chmod(0o600)
    return str(path)
