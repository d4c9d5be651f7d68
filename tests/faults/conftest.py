"""Fixtures for fault tests: a real daemon (``tests/daemon/_daemon.py``) behind the test
kit's fault-injecting proxy (``tests/kit/fault_proxy.py``).

* ``start_daemon(*flags)``: a running ``python -m server``; at teardown every daemon still
  running gets SIGTERM and must exit 0 with its pool whole.
* ``proxy_for(daemon)``: a ``FaultProxy`` in front of the daemon's data port, closed at
  teardown.
* ``fp``: the ``fault_proxy`` module (``UPSTREAM``, ``DOWNSTREAM``, ``Fault``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.kit.modules import load_module as _load

TESTS = Path(__file__).resolve().parents[1]


# The same module names as tests/daemon/conftest.py and tests/kit/test_fault_proxy.py use.
_daemon: Any = _load("exchange_tests_daemon_helpers", TESTS / "daemon" / "_daemon.py")
_fault_proxy: Any = _load("exchange_tests_kit_fault_proxy", TESTS / "kit" / "fault_proxy.py")


@pytest.fixture
def fp() -> Any:
    return _fault_proxy


@pytest.fixture
def start_daemon() -> Iterator[Callable[..., Any]]:
    yield from _daemon.started_daemons()


@pytest.fixture
def proxy_for() -> Iterator[Callable[[Any], Any]]:
    proxies: list[Any] = []

    def make(daemon: Any) -> Any:
        proxy = _fault_proxy.FaultProxy.for_address(daemon.data_address)
        proxies.append(proxy)
        return proxy

    yield make
    for proxy in proxies:
        proxy.close()
