"""What a task imports: the client and the engine, never the daemon's package.

A PySpark task ships ``client`` and ``exchange``; it finds its daemon by a path both sides
derive from ``exchange.paths``, not by importing the daemon's configuration.
"""

from __future__ import annotations

import json
import subprocess
import sys

from exchange.paths import default_socket_path
from server.config import DaemonConfig


def test_no_client_module_imports_the_daemon() -> None:
    code = (
        "import importlib, json, pkgutil, sys, client\n"
        "names = [m.name for m in pkgutil.walk_packages(client.__path__, 'client.')]\n"
        "for name in names: importlib.import_module(name)\n"
        "print(json.dumps([names, sorted(m for m in sys.modules if m.split('.')[0] == 'server')]))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    names, server_modules = json.loads(out.stdout.strip().splitlines()[-1])
    assert "client.local_connection" in names and "client.spark" in names, names
    assert server_modules == [], server_modules


def test_the_task_and_the_daemon_agree_on_the_default_socket() -> None:
    assert DaemonConfig().resolved_local_socket() == default_socket_path()
