"""Fixtures for daemon process tests (helpers live in ``_daemon.py`` next to this file).

* ``start_daemon(*flags)``: a running ``python -m server`` (``DaemonProcess``). At teardown
  every daemon still running gets SIGTERM and must exit 0 with its pool whole; every
  process is reaped and its spill directory removed.
* ``start_producer(socket, dataset, index, n)``: a producer task in a child process
  (``ChildProducer``), SIGKILLed and reaped at teardown if still alive.
* ``dm``: the ``_daemon`` module itself (``run_daemon_cli``, ``DaemonProcess``, ...).
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest


def _load_helpers() -> ModuleType:
    name = "exchange_tests_daemon_helpers"
    module = sys.modules.get(name)
    if module is None:
        spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name("_daemon.py"))
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return module


_daemon: Any = _load_helpers()


@pytest.fixture
def dm() -> ModuleType:
    return _daemon


@pytest.fixture
def start_daemon() -> Iterator[Callable[..., Any]]:
    yield from _daemon.started_daemons()


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
