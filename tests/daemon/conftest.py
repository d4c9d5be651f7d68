"""Fixtures for daemon process tests (helpers live in ``_daemon.py`` next to this file;
``start_daemon``, ``run_daemon_cli`` and ``dm`` are in ``tests/conftest.py``).

* ``start_producer(socket, dataset, index, n)``: a producer task in a child process
  (``ChildProducer``), SIGKILLed and reaped at teardown if still alive.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.kit.modules import load_module as _load

# The same module name as tests/conftest.py uses.
_daemon: Any = _load("exchange_tests_daemon_helpers", Path(__file__).with_name("_daemon.py"))


@pytest.fixture
def start_producer() -> Iterator[Callable[..., Any]]:
    started: list[Any] = []

    def start(socket: str, dataset: str, index: int, n: int) -> Any:
        p = _daemon.ChildProducer(socket, dataset, index, n)
        started.append(p)
        return p

    yield start
    for p in started:
        p.cleanup()
