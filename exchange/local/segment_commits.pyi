# Types of the compiled commit loop (exchange/local/segment_commits.pyx), for mypy --strict.
from collections.abc import Iterable
from typing import Any

__all__ = ["commit_segments", "segment_indices"]

def commit_segments(session: Any, commits: Iterable[tuple[int, int, int]]) -> int: ...
def segment_indices(reserved: Any, start: int, stop: int) -> tuple[int, ...]: ...
