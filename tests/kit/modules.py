"""Loading a test helper module by path under a fixed name, once per process.

Test directories are not packages; their conftests share helpers such as
``tests/daemon/_daemon.py`` by loading them under one module name each (the same name in
every conftest, so the module — and its state — exists once).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

TESTS = Path(__file__).resolve().parents[1]


def load_module(name: str, path: Path) -> ModuleType:
    """The module ``name``, loaded from ``path`` on first use."""
    module = sys.modules.get(name)
    if module is None:
        spec = importlib.util.spec_from_file_location(name, path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return module
