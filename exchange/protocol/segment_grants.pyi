# Types of exchange/protocol/segment_grants.pyx (compiled), for mypy --strict.
from typing import Any

__all__ = ["grant_indices"]

def grant_indices(body: Any, max_count: int) -> tuple[int, ...] | None: ...
