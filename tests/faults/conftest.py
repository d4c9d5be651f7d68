"""Fixtures for fault tests: a real daemon (``start_daemon`` of ``tests/conftest.py``)
behind the test kit's fault-injecting proxy (``tests/kit/fault_proxy.py``).

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


# The same module name as tests/kit/test_fault_proxy.py uses.
_fault_proxy: Any = _load("exchange_tests_kit_fault_proxy", TESTS / "kit" / "fault_proxy.py")


@pytest.fixture
def fp() -> Any:
    return _fault_proxy


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
