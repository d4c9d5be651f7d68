"""Fixtures for the API tests: a real daemon (``tests/daemon/_daemon.py``)."""

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


@pytest.fixture(scope="module")
def daemon() -> Iterator[Any]:
    """One daemon for the module; at its end it must stop with its pool whole."""
    for start in _daemon.started_daemons():
        yield start()


@pytest.fixture
def run_daemon_cli() -> Callable[..., Any]:
    return _daemon.run_daemon_cli  # type: ignore[no-any-return]
