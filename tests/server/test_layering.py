"""The daemon's modules import downwards: the local endpoint is given its daemon (typed by
``EndpointDaemon``, a Protocol the daemon satisfies, checked by mypy where the daemon
builds it) and never imports ``server.daemon``, not even for types."""

from __future__ import annotations

import ast
from pathlib import Path

import server.local_endpoint

SOURCE = Path(server.local_endpoint.__file__)


def _imported_modules(tree: ast.AST) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(tree):  # every import, also under ``if TYPE_CHECKING:``
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module is not None:
            names.add(node.module)
    return names


def test_the_local_endpoint_does_not_import_the_daemon() -> None:
    imported = _imported_modules(ast.parse(SOURCE.read_text()))
    assert "server.partition_request_server" in imported  # the walk sees its imports
    assert "server.daemon" not in imported, sorted(imported)
