"""The runnable examples of a document: its fenced ``python`` blocks, in order.

Tests execute them as they stand, so a document's examples cannot drift from the code
(illustrative snippets are fenced ``text``)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
_BLOCK = re.compile(r"^```python\n(.*?)^```$", re.M | re.S)


def python_blocks(doc: str) -> list[str]:
    """The ``python`` blocks of ``doc`` (a path relative to the repository)."""
    return _BLOCK.findall((ROOT / doc).read_text())


def run_block(code: str, doc: str) -> dict[str, object]:
    """Execute one block in a fresh namespace; returns the namespace."""
    namespace: dict[str, object] = {"__name__": "__doc_example__"}
    exec(compile(code, f"<{doc} example>", "exec"), namespace)
    return namespace
