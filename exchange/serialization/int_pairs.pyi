# Types of the packed (int, int) frame (exchange/serialization/int_pairs.pyx), for mypy --strict.
from typing import Any, Final

__all__ = ["HEADER_SIZE", "PAIRS_TAG", "encode_int_pairs"]

PAIRS_TAG: Final[int]
HEADER_SIZE: Final[int]

def encode_int_pairs(records: Any, max_payload: int) -> bytes | None: ...
