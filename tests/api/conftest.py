"""Fixtures for the API tests: one real daemon per module (``tests/daemon/_daemon.py``;
``run_daemon_cli`` is in ``tests/conftest.py``)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.kit.modules import load_module as _load

TESTS = Path(__file__).resolve().parents[1]


_daemon: Any = _load("exchange_tests_daemon_helpers", TESTS / "daemon" / "_daemon.py")


@pytest.fixture(scope="module")
def daemon() -> Iterator[Any]:
    """One daemon for the module; at its end it must stop with its pool whole."""
    for start in _daemon.started_daemons():
        yield start()
